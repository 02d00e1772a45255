"""P's engine: every decision of one prefill rank, sans I/O.

Theory of operation
-------------------
`ProducerEngine` owns one P rank's stream of the lifecycle (a `Ledger` over
a `LifecycleState`) and makes that rank's decisions from its fold.  It
performs no I/O and reads no clock: its driver feeds it what happened and
carries out what it returns.

* What the host engine did: ``prefill_started``, ``exported`` (the blocks
  stay pinned under a lease), ``aborted`` (before the export: the host engine
  frees those blocks itself).
* What arrived: ``on_notification(sender, message, now)``.  ``sender`` is who
  the driver vouches sent it (the transport peer, learned at the handshake),
  never what the message claims.  A heartbeat is answered with a
  `HeartbeatAck` for the driver to send back (``time_left`` per request,
  `policy.lease_time_left`); a release is recorded (the fold decides whether
  it counts) and, once every consumer rank released, the blocks are freed by
  the next ``poll``.
* Time passing: ``poll(now)`` reaps expired leases and returns the requests
  whose blocks must be freed now, each exactly once; a request D released is
  forgotten as it is freed (`policy.forgotten_when_freed`).  ``forget(now)``
  drops the other finished records (`policy.to_forget`), each a `Forgotten`
  event.

A heartbeat or a release can overtake its own export (vLLM's P hands out the
parameters a step before its worker folds the export): ids still
``PREFILLING`` are held back and answered (a release: applied) by a later
``poll`` once exported, or taken for what they are one lease later.

The connector's P worker (`adapters.vllm.producer`) and the simulator's P
(`simulations.prefill`) drive this same object; a model of vLLM 0.32's P is
a driver choice (whom it names as sender, whether it sends the answer, the
lease it exports), not another engine.

An event the fold refuses is a bug of the driver or a hostile peer: it is
logged, counted (``counts["refused_events"]``) and leaves the state
unchanged; it never raises into the driver.  ``counts`` only grows: the
driver reports what it gained since it last looked.  ``counts["heartbeats_late"]``: heartbeats
that arrived (from the request's consumer, with its token) for a lease already
past its deadline, reaped or not yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvhandoff.core.events import (
    Aborted,
    Event,
    Exported,
    Forgotten,
    Freed,
    HeartbeatReceived,
    LeaseExpired,
    PrefillStarted,
    ReleaseNotified,
    Stream,
)
from kvhandoff.core.fence import CLEARED, fence_value
from kvhandoff.core.ledger import LedgerEngine
from kvhandoff.core.lifecycle import LifecycleState, ProducerRecord, PState
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Message, Release
from kvhandoff.core.policy import (
    expired_leases,
    forgotten_when_freed,
    lease_time_left,
    to_forget,
    to_free,
)
from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)

_TO_FREE = frozenset({PState.RELEASED, PState.EXPIRED, PState.ABORTED})


@dataclass(slots=True)
class ProducerStep:
    """What the driver must do after an input: write these fence slots, then free these
    requests, and send these answers."""

    acks: list[tuple[str, HeartbeatAck]] = field(default_factory=list)  # (to whom, answer)
    # (slot, value) to write into this rank's fence region, in order, before any free
    fences: list[tuple[int, int]] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)  # free now (exactly once each)
    expired: list[str] = field(default_factory=list)  # of the freed: their lease ran out


class ProducerEngine(LedgerEngine):
    """One P rank's lifecycle decisions (see the module docstring)."""

    side = "producer"

    def __init__(self, stream: Stream, lease_s: float, state: LifecycleState | None = None,
                 sink: Callable[[Event], None] | None = None) -> None:
        super().__init__(stream, state, sink)
        self.lease_s = lease_s
        # The fence (`core.fence`): which request's value each slot holds (the driver hands
        # out slots; a slot handed out twice still never vouches for a freed request), and
        # the writes the next ``poll`` hands the driver.
        self._fence_owner: dict[int, str] = {}
        self._fence_out: list[tuple[int, int]] = []
        # Heartbeats and releases that overtook their export, by what they say (sender,
        # message type, D rank, ids, tokens): (first seen, sender, the latest-sent such
        # message).  A D repeating itself while P still prefills replaces its message,
        # keeping when it was first seen (the hold's bound): memory and each ``poll``'s
        # rescan stay one entry per distinct message, however often it is sent.
        self._deferred: dict[tuple, tuple[float, str, Heartbeat | Release]] = {}
        # Hints that keep ``poll`` from scanning every record of a hot P each step
        # (100,000 live leases: ~30 ms a scan).  The fold still decides: a lease
        # is expired only if `expired_leases` names it, freed only from a state
        # `to_free` names.  No lease can run out before ``_due_at`` (heartbeats
        # only move deadlines later); ``_ended`` holds what a release just ended.
        self._due_at = math.inf
        self._ended: list[str] = []
        self._unpinned: list[str] = []  # exports refused: the host engine frees them now

    # ---- what the host engine did --------------------------------------------

    def prefill_started(self, rid: str, now: float) -> None:
        self._record(PrefillStarted, rid, now)

    def exported(self, rid: str, now: float, num_blocks: int, consumer_ranks: Iterable[int],
                 token: str = "", lease_s: float | None = None, fence_slot: int | None = None
                 ) -> bool:
        """Prefill done: pin the blocks under a lease (``lease_s``: this engine's by default);
        with a ``fence_slot`` (and a token) the next ``poll`` writes the request's value there."""
        slot = -1 if fence_slot is None or not token else fence_slot
        ok = self._record(Exported, rid, now, lease_s=self.lease_s if lease_s is None else lease_s,
                          consumer_ranks=tuple(consumer_ranks), num_blocks=num_blocks, token=token,
                          fence_slot=slot)
        if ok:
            self.counts["leases_exported"] += 1
            self._due_at = min(self._due_at, self._rec(rid).deadline)
            if slot >= 0:
                self._fence_owner[slot] = rid
                self._fence_out.append((slot, fence_value(rid, token)))
        else:
            # The host engine keeps these blocks until we name them: an export the fold
            # refuses must not pin them for ever.  Named now when nothing else will name
            # them: the id is unknown, still prefilling (its record ends: aborted), or its
            # earlier life was already freed (and reported).  Not a live export's: that
            # one is reported when it ends, and the host engine must hear of each id once.
            # No lease, so no READ is safe: D's heartbeat hears "unknown" and the fence
            # never vouches for it.
            rec = self._rec(rid)
            if rec is None or rec.state in (PState.NEW, PState.PREFILLING, PState.FREED):
                if rec is not None and rec.state is PState.PREFILLING:
                    self.aborted(rid, now, "export refused")
                self._unpinned.append(rid)
                log.warning("producer.export_refused_freed_now", stream=str(self.stream),
                            request_id=rid)
            else:
                log.error("producer.export_refused_live_id", stream=str(self.stream),
                          request_id=rid, state=None if rec is None else rec.state.value)
        return ok

    def aborted(self, rid: str, now: float, reason: str) -> None:
        """The request ended on P before its export; the host engine frees its blocks itself."""
        if self._record(Aborted, rid, now, reason=reason):
            self._record(Freed, rid, now)

    # ---- what arrived ------------------------------------------------------------

    def on_notification(self, sender: str, msg: Message, now: float) -> ProducerStep:
        step = ProducerStep()
        if isinstance(msg, Heartbeat):
            self.counts["heartbeats_received"] += 1
            self._heartbeat(sender, msg, now, now, step)
        elif isinstance(msg, Release):
            self._release(sender, msg, now, now)
        else:
            self.counts["notifications_ignored"] += 1  # P never expects an acknowledgement
        return step

    def _release(self, sender: str, msg: Release, now: float, since: float) -> None:
        """A D rank's release; one that overtook its export (D admitted and let go before this
        engine heard of the export: a cancel at once, nothing to read) waits for the export
        as a heartbeat does, for at most a lease, instead of pinning the blocks a lease."""
        rec = self._rec(msg.request_id)
        if (isinstance(rec, ProducerRecord) and rec.state is PState.PREFILLING
                and now - since < self.lease_s):
            self._defer(sender, msg, since,
                        (sender, Release, msg.rank, msg.request_id, msg.engine, msg.token))
            return
        self._record(ReleaseNotified, msg.request_id, now, from_engine=sender,
                     consumer_rank=msg.rank, token=msg.token)
        rec = self._rec(msg.request_id)
        if rec is not None and rec.state is PState.RELEASED:
            self._ended.append(msg.request_id)

    def _defer(self, sender: str, msg: Heartbeat | Release, since: float, key: tuple) -> None:
        held = self._deferred.get(key)
        if held is not None:
            since = min(held[0], since)
            if isinstance(msg, Heartbeat) and held[2].sent_at > msg.sent_at:
                msg = held[2]  # overtaken by a later one: answer the later one
        self._deferred[key] = (since, sender, msg)

    def _heartbeat(self, sender: str, msg: Heartbeat, now: float, since: float,
                   step: ProducerStep) -> None:
        held = now - since < self.lease_s
        # By position (skipped through a set, not `in` over a tuple): linear in its length.
        at = [i for i, rid in enumerate(msg.request_ids)
              if isinstance(rec := self._rec(rid), ProducerRecord)
              and rec.state is PState.PREFILLING] if held else []
        waiting_at = set(at)
        if at:
            waiting = tuple(msg.request_ids[i] for i in at)
            tokens = tuple(msg.token_of(i) for i in at) if msg.tokens else ()
            self._defer(sender, Heartbeat(msg.engine, msg.rank, msg.sent_at, waiting, tokens),
                        since, (sender, Heartbeat, msg.rank, waiting, msg.engine, tokens))
        left: dict[str, float] = {}
        late = False
        for i, rid in enumerate(msg.request_ids):
            if i in waiting_at:
                continue
            token = msg.token_of(i)
            rec = self._rec(rid)
            before = rec.deadline if isinstance(rec, ProducerRecord) else None
            # Late: from the request's own consumer, for a lease past its deadline when it came.
            late = late or (isinstance(rec, ProducerRecord) and token == rec.token
                            and rec.consumer in ("", sender)
                            and (rec.ended == "expired"
                                 or rec.state is PState.EXPORTED and since >= rec.deadline))
            self._record(HeartbeatReceived, rid, now, from_engine=sender, token=token)
            if before is not None and rec.deadline > before:  # the fold accepted it
                self.counts["leases_extended"] += 1
            left[rid] = lease_time_left(self.state, self.stream, rid, now, engine=sender,
                                        token=token)
        if late:
            self.counts["heartbeats_late"] += 1
        if left:
            step.acks.append((sender, HeartbeatAck(self.stream.engine, self.stream.rank,
                                                   msg.sent_at, left)))

    # ---- time passing --------------------------------------------------------------

    def poll(self, now: float) -> ProducerStep:
        """Answer held-back heartbeats (and apply held-back releases), reap expired leases,
        name what to free now (and the fence writes of what was exported since, and of what
        is freed, to carry out first)."""
        step = ProducerStep()
        step.fences, self._fence_out = self._fence_out, []
        if self._unpinned:
            step.freed, self._unpinned = self._unpinned, []
            self.counts["exports_refused_freed"] += len(step.freed)
        deferred, self._deferred = self._deferred, {}
        for since, sender, msg in deferred.values():
            try:  # a peer's message costs only itself, whatever it does
                if isinstance(msg, Heartbeat):
                    self._heartbeat(sender, msg, now, since, step)
                else:
                    self._release(sender, msg, now, since)
            except Exception as exc:
                self.counts["notifications_ignored"] += 1
                log.error(f"producer.deferred_{type(msg).__name__.lower()}_error",
                          stream=str(self.stream), peer=sender, error=str(exc),
                          error_type=type(exc).__name__)
        if now >= self._due_at:
            for rid in expired_leases(self.state, self.stream, now):
                if self._record(LeaseExpired, rid, now):
                    self.counts["leases_expired"] += 1
                    step.expired.append(rid)
                    self._ended.append(rid)
                    log.warning("producer.lease_expired", stream=str(self.stream),
                                request_id=rid, lease_s=self._rec(rid).lease_s)
            self._due_at = self.next_deadline()
            self._ended += to_free(self.state, self.stream)  # and anything a hint missed
        while self._ended:  # what raises stays queued for the next poll
            rid = self._ended[0]
            rec = self._rec(rid)
            if rec is not None and rec.state in _TO_FREE:
                released = rec.state is PState.RELEASED
                slot = rec.fence_slot
                if self._record(Freed, rid, now):
                    if slot >= 0 and self._fence_owner.get(slot) == rid:
                        del self._fence_owner[slot]  # cleared before the blocks go back
                        step.fences.append((slot, CLEARED))
                    step.freed.append(rid)
                    self.counts["frees"] += 1
                    self.counts["leases_released"] += released
                    if forgotten_when_freed(rec):
                        self._record(Forgotten, rid, now)
            self._ended.pop(0)
        return step

    def forget(self, now: float) -> None:
        for rid in to_forget(self.state, self.stream, now, self.lease_s):
            self._record(Forgotten, rid, now)

    def live(self) -> bool:
        """Whether any request is prefilling or under a lease (the driver polls faster)."""
        ss = self.state.streams.get(self.stream)
        return ss is not None and any(r.state in (PState.EXPORTED, PState.PREFILLING)
                                      for r in ss.requests.values())

    @property
    def due_at(self) -> float:
        """No lease can run out before this (``inf``: none live): when the driver must
        ``poll`` at the latest (it may be early; ``poll`` then looks again)."""
        return self._due_at

    def next_deadline(self) -> float:
        """The earliest lease deadline (``inf`` with none): when ``poll`` has work at the latest."""
        ss = self.state.streams.get(self.stream)
        return min((r.deadline for r in ss.requests.values() if r.state is PState.EXPORTED),
                   default=float("inf")) if ss is not None else float("inf")

"""D's engine: every decision of one decode rank, sans I/O.

Theory of operation
-------------------
`ConsumerEngine` owns one D rank's stream of the lifecycle (a `Ledger` over
a `LifecycleState`) and makes that rank's decisions from its fold.  It
performs no I/O and reads no clock: its driver feeds it what happened and
carries out what it returns.  Each request reads from one P rank, its
``peer``: an opaque name the driver chose (the transport agent of that P
rank), used to send to it and to vouch for what arrives from it.

* Admission: ``check_unused`` (parameters are single-use: `ParamsReused`),
  ``admit`` (the request is heartbeated from now on), then ``validated`` or
  ``rejected`` (a notify-only release).  ``nothing_to_read`` ends a request
  D holds entirely (a notify-only release).
* READs: ``reads_posted`` (one split per READ the driver posts), then
  ``split_done`` as each drains (a READ that could not be posted drains at
  once, failed).  A split READ that outlives `policy.read_deadline` is failed
  by ``poll`` (NIXL cannot cancel it): it still owns D's pages and P's lease,
  so the request keeps its heartbeat and is reported only once it drained.
* ``cancel``: the client went away.  With no READ posted P is released at
  once; with READs in flight nothing changes until they drained.
* ``on_notification(sender, message, now)``: P's acknowledgements, each
  taken only from the peer the request reads (``sender`` is who the driver
  vouches sent it, never what the message claims).
* ``poll(now)``: fail READs past their deadline, report what is due
  (`policy.report_due`; ``finished_recving`` once, then the release), and
  plan the heartbeats (`policy.heartbeat_plan`).  The driver sends each one
  and then says so with ``heartbeat_sent`` (a send that fails is not
  recorded, and is planned again next poll).
* ``release_unsent``: the driver could not send a release; ``poll`` plans it
  again (`policy.release_retry_at`) until it goes or P has freed by lease.
* ``forget(now)`` drops finished records (`policy.to_forget`).

The connector's D worker (`adapters.vllm.consumer`) and the simulator's D
(`simulations.decode`, one engine per simulated rank) drive this same
object.  The model of vLLM 0.32's D in the simulator is driver choices on
top of it (it drops cancelled requests from the heartbeats it sends, reports
drained READs without waiting for P's word, lets each READ carry its release).

An event the fold refuses is a bug of the driver or a hostile peer: it is
logged, counted (``counts["refused_events"]``) and leaves the state
unchanged (`LedgerEngine._record`).  ``counts`` only grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from kvhandoff.core.errors import LifecycleError, MalformedMessage
from kvhandoff.core.events import (
    Admitted,
    ClientCancelled,
    Event,
    FenceHeld,
    FinishedRecving,
    Forgotten,
    HeartbeatSent,
    LeaseAcknowledged,
    ReadsPosted,
    Rejected,
    ReleaseSent,
    SplitCompleted,
    SplitFailed,
    Stream,
    Validated,
)
from kvhandoff.core.fence import FENCE_READS, fence_of
from kvhandoff.core.ledger import LedgerEngine
from kvhandoff.core.lifecycle import (
    HEARTBEAT_STATES,
    READING_STATES,
    ConsumerRecord,
    DState,
    LifecycleState,
    Verdict,
    read_verdict_of,
)
from kvhandoff.core.messages import MAX_IDS, Heartbeat, HeartbeatAck, Message, Release
from kvhandoff.core.policy import (
    TimingConfig,
    heartbeat_period,
    heartbeat_plan,
    last_vouched,
    next_heartbeat,
    read_deadline,
    read_deadline_bound,
    release_retry_at,
    report_due,
    to_forget,
)
from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)



class ParamsReused(MalformedMessage):
    """The parameters name a P request this D already took: they are single-use."""


class RequestIdCollision(MalformedMessage):
    """Another P's request under an id this D still remembers for a different P."""


@dataclass(slots=True)
class Finished:
    """A request reported ``finished_recving``: ``ok`` when D may use its bytes."""

    request_id: str
    ok: bool
    verdict: Verdict
    reason: str = ""  # why not ok (the first failure, or the verdict's meaning)
    # not ok only because the client left before P proved it held the blocks: nothing
    # went wrong with the hand-off, and nothing would have been served anyway
    abandoned: bool = False


@dataclass(slots=True)
class ConsumerStep:
    """What the driver must do after an input."""

    heartbeats: list[tuple[Hashable, Heartbeat, bool]] = field(default_factory=list)  # (peer, msg, urgent)
    releases: list[tuple[Hashable, Release]] = field(default_factory=list)  # (to whom, message)
    finished: list[Finished] = field(default_factory=list)  # tell the host engine, once each
    timed_out: list[str] = field(default_factory=list)  # READs failed past their deadline
    # fence READs to post now, each after its request's READs drained: (request, peer,
    # P rank, slot, planned at); the driver answers each with ``fence_read``, handing back
    # when it was planned (a late answer to an earlier READ proves nothing)
    fences: list[tuple[str, Hashable, int, int, float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        """Whether the engine decided anything (most polls decide nothing)."""
        return bool(self.heartbeats or self.releases or self.finished or self.timed_out
                    or self.fences)


@dataclass(slots=True)
class _Request:
    """The engine's working data for one request (its lifecycle is the fold's)."""

    peer: Hashable
    token: str
    in_flight: set[int] = field(default_factory=set)  # splits whose READ still moves bytes
    splits_failed: bool = False  # failed by the deadline or given up: drains record nothing
    fence: tuple[int, int] | None = None  # (slot, value) in P's fence region (`core.fence`)
    fence_posted: float | None = None  # when its fence READ in flight was planned (None: none)
    fence_reads: int = 0  # fence READs that came back without proving anything


_UNSAFE = "a read completed after P may have freed its blocks (P answered: gone)"
_ABANDONED = "the client cancelled before P proved it held the blocks"  # `Finished.abandoned`


class ConsumerEngine(LedgerEngine):
    """One D rank's lifecycle decisions (see the module docstring)."""

    side = "consumer"

    def __init__(self, stream: Stream, timing: TimingConfig, state: LifecycleState | None = None,
                 sink: Callable[[Event], None] | None = None) -> None:
        super().__init__(stream, state, sink)
        self.timing = timing
        self._reqs: dict[str, _Request] = {}  # requests this rank still acts for
        self._reading: dict[str, None] = {}  # of those, with READs posted and not reported
        self._fresh: set[str] = set()  # admitted, not heartbeated yet
        self._last_sent: dict[Hashable, float] = {}  # per peer: the last keep-alive
        self._last_asked: dict[Hashable, float] = {}  # per peer: the last heartbeat of any kind
        # per peer: the keep-alive the last poll planned there: (``sent_at``, its messages
        # not sent yet, its messages) -- more than one past MAX_IDS requests due there
        self._keepalive: dict[Hashable, tuple[float, int, int]] = {}
        self._reasked: set[Hashable] = set()  # peers asked again for an overdue answer
        # per peer: when the last keep-alive P has not answered yet was sent, and how many of
        # its messages P has not answered
        self._unanswered: dict[Hashable, float] = {}
        self._acks_due: dict[Hashable, int] = {}
        # per peer: the requests whose READs drained and wait for P's word, as the last poll saw
        self._awaiting: dict[Hashable, list[str]] = {}
        self._deadline = math.inf  # the earliest READ deadline the last poll saw
        # The stream's requests in a heartbeat state, in the fold's order (what
        # `policy.heartbeat_due` finds by scanning every record), kept up to date
        # by ``_record``; rebuilt by a scan if another writer moved the stream.
        self._hb: dict[str, None] = {}
        self._hb_seq = self._ss.last_seq
        self._due_cache: dict[Hashable, list[str]] | None = None  # `_due` until _hb/_reqs change
        self._periods: dict[Hashable, float] = {}  # per peer of `_due_cache`: its period
        # Per request READs are posted for, what `poll` found when it decided nothing for
        # it: (its wake-up time, the peer it waits for P's word from or None, valid
        # until), kept until the request's next event or input (or the time it names).
        self._settled: dict[str, tuple[float, Hashable | None, float]] = {}
        self._settled_timing = timing
        self._vouched: dict[str, float] = {}  # per request: `last_vouched`, until its next event
        # A poll that decided nothing, with nothing changed since (no event on the
        # stream, no input) and its `due_at` not reached, would decide nothing again:
        # ``poll`` returns at once then.  An event moves the stream's seq; every other
        # input sets ``_dirty``.
        self._dirty = True
        self._polled: tuple[int, TimingConfig] | None = None  # (stream seq, timing) then
        self._quiet_until = -math.inf  # that poll's `due_at`
        # Releases the driver could not send, per request: (peer, message, first failure,
        # next try); and of those the last poll planned again, their first failure.
        self._unsent: dict[str, tuple[Hashable, Release, float, float]] = {}
        self._retried: dict[str, float] = {}
        self._hb_rebuild()

    def _hb_rebuild(self) -> None:
        self._hb = {rid: None for rid, rec in self._records.items()
                    if rec.state in HEARTBEAT_STATES}
        self._hb_seq = self._ss.last_seq
        self._due_cache = None
        self._settled.clear()
        self._vouched.clear()

    def _record(self, event_type: type[Event], rid: str, t: float, **fields) -> bool:
        try:  # `LedgerEngine._record`, inlined: this runs for every event D writes
            self.ledger.record_fields(event_type, rid, t, fields)
        except LifecycleError as exc:
            self._refused(event_type, rid, exc)
            return False
        if self._ss.last_seq != self._hb_seq + 1:  # not ours alone: rescan when needed
            return True
        self._hb_seq += 1
        if event_type is HeartbeatSent:
            return True  # it moves `last_heartbeat` alone: no state, no deadline, no proof
        self._settled.pop(rid, None)
        self._vouched.pop(rid, None)
        rec = self._records.get(rid)
        if rec is not None and rec.state in HEARTBEAT_STATES:
            if rid not in self._hb:  # entered (admitted): last in the fold's order too
                self._hb[rid] = None
                self._due_cache = None
        elif rid in self._hb:  # left; it never comes back (a new request is admitted anew)
            del self._hb[rid]
            self._due_cache = None
        return True

    # ---- admission -------------------------------------------------------------

    def check_unused(self, rid: str, remote_engine: str, cleanup: bool = False) -> bool:
        """Raise unless ``rid``'s parameters may be taken now; True for a clean-up (``cleanup``)
        of a request this D already took (nothing to do for it).

        Parameters are single-use: a second request naming a P request this D
        took (in any state, released included, until `to_forget` drops it, two
        leases after it ended) must never read P's blocks again.
        """
        rec = self._rec(rid)
        if not isinstance(rec, ConsumerRecord):
            return False
        if rec.remote_engine != remote_engine:
            raise RequestIdCollision(
                f"remote_request_id {rid!r} of {remote_engine!r} collides with the request of "
                f"{rec.remote_engine!r} this D still knows (local request {rec.local_id!r}, "
                f"state {rec.state.value})")
        if cleanup:
            return True
        raise ParamsReused(
            f"remote_request_id {rid!r} was already taken by local request {rec.local_id!r} "
            f"(state {rec.state.value}): transfer parameters are single-use")

    def admit(self, rid: str, now: float, *, peer: Hashable, remote_engine: str,
              remote_ranks: Iterable[int], num_blocks: int, lease_s: float, token: str = "",
              local_id: str = "", fence_slot: int | None = None, fence_slots: int = 0
              ) -> bool:
        """Take the request (heartbeated from now until its reads drained or P is released).

        ``fence_slot``: the export's slot in the peer's fence region, from the parameters
        (None: none); ``fence_slots``: how many slots the peer registered (a slot outside
        them is no fence).  With a fence the drained READs are proven by reading it, not
        by asking P at admission.
        """
        if not self._record(Admitted, rid, now, remote_engine=remote_engine,
                            remote_ranks=tuple(remote_ranks), num_blocks=num_blocks,
                            lease_s=lease_s, lease_margin_s=self.timing.lease_margin_s,
                            local_request_id=local_id):
            return False
        fence = fence_of(rid, token, fence_slot if fence_slot is not None
                         and fence_slot < fence_slots else None)
        self._reqs[rid] = _Request(peer, token, fence=fence)
        self._due_cache = None
        if fence is None:
            self._fresh.add(rid)
        return True

    def validated(self, rid: str, now: float) -> bool:
        return self._record(Validated, rid, now)

    def rejected(self, rid: str, now: float, reason: str) -> ConsumerStep:
        """The request cannot be read (its parameters do not fit): release P notify-only."""
        step = ConsumerStep()
        if self._record(Rejected, rid, now, reason=reason[:500]):
            self._release(rid, now, True, step)
        return step

    def nothing_to_read(self, rid: str, now: float) -> ConsumerStep:
        """D holds every block already (a local prefix hit): P may free now."""
        step = ConsumerStep()
        self._release(rid, now, True, step)
        return step

    def cancel(self, rid: str, now: float) -> ConsumerStep:
        """The client went away.  READs in flight keep P's lease and D's pages until drained."""
        step = ConsumerStep()
        rec = self._rec(rid)
        if isinstance(rec, ConsumerRecord) and rec.state is not DState.DONE:
            self._record(ClientCancelled, rid, now)
            if self._rec(rid).state is DState.CANCELLED:  # nothing posted: release at once
                self._release(rid, now, True, step)
        return step

    # ---- READs -------------------------------------------------------------------------

    def reads_posted(self, rid: str, now: float, split_ranks: Iterable[int],
                     split_groups: Iterable[int] = ()) -> bool:
        """The driver is posting one READ per split (then ``split_done`` for each)."""
        ranks = tuple(split_ranks)
        if not self._record(ReadsPosted, rid, now, split_ranks=ranks,
                            split_groups=tuple(split_groups)):
            return False
        req = self._reqs[rid]
        req.in_flight = set(range(len(ranks)))
        self._reading[rid] = None
        return True

    def nothing_posted(self, rid: str, now: float, rank: int) -> bool:
        """The plan had no split for this rank (D holds every block it would read, or the
        host pool it shares is rank 0's): one empty split of remote rank ``rank``, drained
        at once, so the request completes and is reported like any other."""
        return self.reads_posted(rid, now, (rank,)) and self.split_done(rid, 0, now)

    def split_done(self, rid: str, split: int, now: float, ok: bool = True,
                   reason: str = "") -> bool:
        """Split ``split``'s READ drained (``ok``: its bytes landed); True when recorded.  A
        drained READ that was failed already (deadline, give-up) only gives D's pages back."""
        req = self._reqs.get(rid)
        if req is None or split not in req.in_flight:
            return False
        self._dirty = True
        self._settled.pop(rid, None)
        req.in_flight.discard(split)
        if req.splits_failed:
            return False
        if ok:
            if self._record(SplitCompleted, rid, now, split=split):
                self.counts["reads_completed"] += 1
                return True
        elif self._record(SplitFailed, rid, now, split=split, reason=reason or "read failed"):
            self.counts["reads_failed"] += 1
            return True
        return False

    def give_up(self, rid: str, now: float, reason: str) -> ConsumerStep:
        """Fail the request after an error of the driver's: before any READ it is rejected
        (P released notify-only); with READs in flight they are failed and the request is
        reported once they drained; with every READ drained it is reported now, with what
        the fold says of its bytes (no longer waiting for P's word).  Returns what to do."""
        step = ConsumerStep()
        rec = self._rec(rid)
        req = self._reqs.get(rid)
        if not isinstance(rec, ConsumerRecord) or req is None:
            return step
        if rec.state in (DState.ADMITTED, DState.VALIDATED):
            return self.rejected(rid, now, reason)
        if rec.state in READING_STATES:
            if req.in_flight:
                if not req.splits_failed:
                    self._fail_open_splits(rid, rec, req, now, reason)
            elif rid in self._reading:
                self._dirty = True
                self._finish(rid, rec, now, step, f"given up: {reason}")
        return step

    def abandon(self, rid: str) -> None:
        """Stop acting for ``rid`` (its fold stays as it is): no heartbeat, no report, no
        release.  P frees its blocks when the lease lapses.  Only for a request whose every
        READ drained (the driver checks `in_flight`)."""
        self._dirty = True
        self._reqs.pop(rid, None)
        self._due_cache = None
        self._reading.pop(rid, None)
        self._fresh.discard(rid)
        self._unsent.pop(rid, None)
        self._retried.pop(rid, None)

    def in_flight(self, rid: str) -> int:
        """How many of the request's READs still move bytes into D's pages."""
        req = self._reqs.get(rid)
        return len(req.in_flight) if req is not None else 0

    def fence_read(self, rid: str, value: int | None, now: float, planned_at: float) -> bool:
        """The fence READ ``poll`` planned for ``rid`` at ``planned_at`` came back with
        ``value`` (None: it failed).  The request's value proves its READs (`FenceHeld`);
        anything else proves nothing, and the request asks P instead.  An answer to any
        other READ (an earlier one of a request since forgotten and admitted again) is
        ignored.  True when it proved them."""
        self._dirty = True
        self._settled.pop(rid, None)
        req = self._reqs.get(rid)
        rec = self._rec(rid)
        if (req is None or req.fence is None or req.fence_posted != planned_at
                or rid not in self._reading or not isinstance(rec, ConsumerRecord)):
            return False
        posted, req.fence_posted = req.fence_posted, None
        if value == req.fence[1] and self._record(FenceHeld, rid, now, p_rank=rec.split_ranks[0],
                                                  posted_at=posted):
            self.counts["fences_held"] += 1
            return True
        req.fence_reads += 1  # read it again (P's worker may write it a step late), and ask P
        self.counts["fences_missed"] += 1
        return False

    # ---- what arrived -------------------------------------------------------------

    def on_notification(self, sender: Hashable, msg: Message, now: float) -> None:
        """P's answers; one from another agent than the request's peer proves nothing."""
        self._dirty = True
        if not isinstance(msg, HeartbeatAck):
            self.counts["notifications_ignored"] += 1  # D expects nothing else from P
            return
        self.counts["acks_received"] += 1
        unanswered = self._unanswered.get(sender, math.inf)
        if unanswered <= msg.sent_at:  # P answered the keep-alive, or an ask after it
            if unanswered == msg.sent_at and self._acks_due.get(sender, 1) > 1:
                self._acks_due[sender] -= 1  # one of its messages: others still unanswered
            else:
                del self._unanswered[sender]
                self._acks_due.pop(sender, None)
        for rid, left in sorted(msg.time_left.items()):
            rec = self._rec(rid)
            req = self._reqs.get(rid)
            if (isinstance(rec, ConsumerRecord) and req is not None and req.peer == sender
                    and rec.remote_engine == msg.engine):
                self._record(LeaseAcknowledged, rid, now, p_rank=msg.rank, sent_at=msg.sent_at,
                             time_left=left)
            else:
                self.counts["notifications_ignored"] += 1

    # ---- time passing ---------------------------------------------------------------

    def poll(self, now: float) -> ConsumerStep:
        """Fail READs past their deadline, report what is due, plan the heartbeats."""
        if (not self._dirty and now < self._quiet_until
                and self._polled == (self._ss.last_seq, self.timing)):
            return ConsumerStep()  # the last poll decided nothing and nothing changed
        step = ConsumerStep()
        self._retried.clear()  # the driver reported the last poll's failed sends already
        if self._ss.last_seq != self._hb_seq or self.timing is not self._settled_timing:
            self._hb_rebuild()  # another writer moved the stream, or the timing changed
            self._settled_timing = self.timing
        wake = math.inf
        awaiting: dict[Hashable, list[str]] = {}
        settled = self._settled
        for rid in list(self._reading):
            found = settled.get(rid)
            if found is None or now > found[2]:
                found = self._settle(rid, now, step)
                if found is None:
                    continue  # it acted (or left): nothing to add
            if found[0] < wake:
                wake = found[0]
            if found[1] is not None:
                awaiting.setdefault(found[1], []).append(rid)
        self._awaiting, self._deadline = awaiting, wake
        self._plan_heartbeats(now, awaiting, step)
        if self._unsent:
            self._retry_releases(now, step)
        # Anything decided is an input to the next poll (the driver may not carry it out).
        self._dirty = bool(step)
        self._polled = (self._ss.last_seq, self.timing)
        self._quiet_until = -math.inf if self._dirty else self._next_due()
        return step

    def _settle(self, rid: str, now: float, step: ConsumerStep
                ) -> tuple[float, Hashable | None, float] | None:
        """``poll``'s decision for one request with READs posted: fail READs past their
        deadline, report it when due, read P's fence.  Returns None when it acted (or the
        request is no longer reading), else (wake-up time, the peer whose word it awaits or
        None, valid until), also kept in ``_settled`` for the next polls."""
        rec, req = self._records.get(rid), self._reqs[rid]
        if not isinstance(rec, ConsumerRecord) or rec.state not in READING_STATES:
            del self._reading[rid]
            return None
        deadline = read_deadline(rec, self.timing.read_timeout_s)
        wake = math.inf
        if req.in_flight and not req.splits_failed:
            if now > deadline:
                waited = now - rec.posted_at
                self._fail_open_splits(rid, rec, req, now, f"read timeout after {waited:.1f}s "
                                       f"({read_deadline_bound(rec, self.timing.read_timeout_s)})")
                step.timed_out.append(rid)
                return None
            wake = deadline
        peer = None
        if not req.in_flight:  # (a failed READ still moving bytes owns D's pages: wait)
            if report_due(rec, now, self.timing):
                self._finish(rid, rec, now, step)
                return None
            if rec.drained:  # the bytes are here and wait only for P's word
                wake = min(wake, deadline)
                posted = (req.fence is not None and req.fence_posted is None
                          and req.fence_reads < FENCE_READS and len(set(rec.split_ranks)) == 1)
                if posted:
                    req.fence_posted = now  # read P's fence (at first, rather than ask P)
                    step.fences.append((rid, req.peer, rec.split_ranks[0], req.fence[0], now))
                if not (req.fence is not None and req.fence_reads == 0
                        and req.fence_posted is not None):
                    peer = req.peer  # (not while its first fence READ is in flight)
                if posted:
                    return (wake, peer, -math.inf)  # it acted: look again at the next poll
        found = (wake, peer, deadline)  # each time rule above turns at `now > deadline`
        self._settled[rid] = found
        return found

    def report_now(self, rid: str, now: float) -> ConsumerStep:
        """Report a request whose READs drained without waiting for P's word: what vLLM 0.32
        does (the simulator's model of it), never this engine's own choice."""
        step = ConsumerStep()
        rec = self._rec(rid)
        if (rid in self._reading and isinstance(rec, ConsumerRecord)
                and rec.state in READING_STATES and rec.drained
                and not self._reqs[rid].in_flight):
            self._finish(rid, rec, now, step)
        return step

    @property
    def due_at(self) -> float:
        """When ``poll`` has work at the latest, nothing new arriving (a READ deadline, a
        heartbeat): the driver may poll earlier (``poll`` then finds less to do)."""
        if not self._dirty and self._polled == (self._ss.last_seq, self.timing):
            return self._quiet_until
        return self._next_due()

    def _next_due(self) -> float:
        retry = min((u[3] for u in self._unsent.values()), default=math.inf)
        return min(self._deadline, retry,
                   next_heartbeat(self._due(), self._last_sent, self._last_asked,
                                  self._periods, self._awaiting, self._reasked,
                                  self._unanswered))

    def release_unsent(self, peer: Hashable, release: Release, now: float,
                       retry: bool = True) -> bool:
        """The driver could not send ``release`` (one this engine planned) to ``peer``:
        ``poll`` plans it again at `policy.release_retry_at`, until a send goes or the
        time is up.  ``retry=False``: there is nobody to send it to (the driver dropped
        the peer as lost).  True on the request's first failed send (the driver logs
        that one, not each retry).  A release of a request this engine no longer acts
        for, or with another token (a driver's mistake), is not planned again: it would
        reach P for whatever request holds the id by then."""
        rid = release.request_id
        req = self._reqs.get(rid)
        if req is None or req.token != release.token:
            return True
        first = self._retried.pop(rid, None)
        pending = self._unsent.pop(rid, None)
        if first is None and pending is not None:
            first = pending[2]
        is_first = first is None
        if is_first:
            first = now
        if retry:
            at = release_retry_at(first, now, self.timing.heartbeat_interval_s,
                                  max(self.timing.lease_s, self._lease_of(rid)))
            if at is not None:
                self._dirty = True
                self._unsent[rid] = (peer, release, first, at)
        return is_first

    def _retry_releases(self, now: float, step: ConsumerStep) -> None:
        for rid, (peer, release, first, at) in list(self._unsent.items()):
            if at <= now:
                del self._unsent[rid]
                self._retried[rid] = first
                step.releases.append((peer, release))

    def heartbeat_sent(self, peer: Hashable, hb: Heartbeat, now: float, urgent: bool) -> None:
        """The driver sent ``hb`` (planned by ``poll``, or fewer of its ids) to ``peer``."""
        self._dirty = True
        self._last_asked[peer] = now
        keepalive = self._keepalive.get(peer)
        if keepalive is not None and keepalive[0] == hb.sent_at:  # not an older ask
            sent_at, unsent, messages = keepalive
            if unsent > 1:  # more of its messages to go: one that fails means it goes again
                self._keepalive[peer] = (sent_at, unsent - 1, messages)
            else:  # its last message: the keep-alive went
                del self._keepalive[peer]
                self._last_sent[peer] = now
                self._unanswered[peer] = hb.sent_at
                self._acks_due[peer] = messages
        if urgent:
            self._reasked.add(peer)
        if not hb.request_ids:
            return  # the driver dropped every id (vLLM's model): its timer ran all the same
        self.counts["heartbeats_sent"] += 1
        period = heartbeat_period(self.timing.heartbeat_interval_s,
                                  map(self._lease_of, hb.request_ids))
        if any(rid not in self._fresh and now - self._rec(rid).last_heartbeat > 2 * period
               for rid in hb.request_ids if isinstance(self._rec(rid), ConsumerRecord)):
            self.counts["heartbeats_sent_late"] += 1
        for rid in hb.request_ids:
            self._record(HeartbeatSent, rid, now)
            self._fresh.discard(rid)

    def forget(self, now: float) -> list[str]:
        """Drop finished records `to_forget` names (each a `Forgotten` event); returns them."""
        gone = [rid for rid in to_forget(self.state, self.stream, now, self.timing.lease_s)
                if self._record(Forgotten, rid, now)]
        for rid in gone:
            self.abandon(rid)
        return gone

    # ---- decisions ----------------------------------------------------------------------

    def _plan_heartbeats(self, now: float, awaiting: dict[Hashable, list[str]],
                         step: ConsumerStep) -> None:
        self._reasked &= awaiting.keys()
        due = self._due()
        if not self._unanswered.keys() <= due.keys():  # nothing due there: nothing to ask
            self._unanswered = {p: t for p, t in self._unanswered.items() if p in due}
            self._acks_due = {p: n for p, n in self._acks_due.items() if p in due}
        self._keepalive.clear()
        for peer, rids, urgent, keepalive in heartbeat_plan(
                due, now, self._last_sent, self._last_asked, self._periods, self._fresh,
                awaiting, self._reasked, self._last_vouched, self._unanswered):
            ordered = tuple(sorted(rids))
            chunks = [ordered[at:at + MAX_IDS]  # a message names ≤ MAX_IDS
                      for at in range(0, max(len(ordered), 1), MAX_IDS)]
            if keepalive:
                self._keepalive[peer] = (now, len(chunks), len(chunks))
            for chunk in chunks:
                tokens = tuple(self._reqs[rid].token for rid in chunk)
                step.heartbeats.append((peer, Heartbeat(self.stream.engine, self.stream.rank,
                                                        now, chunk, tokens if any(tokens) else ()),
                                        urgent))

    def _due(self) -> dict[Hashable, list[str]]:
        """The requests to keep alive, per peer: every one this rank acts for in a heartbeat
        state (from admission until its reads drained or a notify-only release).  Read-only:
        the same dict is returned until a request enters or leaves it."""
        if self._ss.last_seq != self._hb_seq:
            self._hb_rebuild()
        if self._due_cache is not None:
            return self._due_cache
        by_engine: dict[str, list[str]] = {}  # as `policy.heartbeat_due` groups them
        records = self._records
        for rid in self._hb:
            by_engine.setdefault(records[rid].remote_engine, []).append(rid)
        due: dict[Hashable, list[str]] = {}
        for rids in by_engine.values():
            for rid in rids:
                req = self._reqs.get(rid)
                if req is not None:
                    due.setdefault(req.peer, []).append(rid)
        self._due_cache = due
        interval = self.timing.heartbeat_interval_s
        self._periods = {peer: heartbeat_period(interval, map(self._lease_of, rids))
                         for peer, rids in due.items()}
        return due

    def _last_vouched(self, rid: str) -> float:
        vouched = self._vouched.get(rid)
        if vouched is None:
            vouched = self._vouched[rid] = last_vouched(self._records[rid])
        return vouched

    def _lease_of(self, rid: str) -> float:
        return self._records[rid].lease_s

    def _fail_open_splits(self, rid: str, rec: ConsumerRecord, req: _Request, now: float,
                          reason: str) -> None:
        req.splits_failed = True
        for split, done in enumerate(rec.split_done):
            if done is None:
                self._record(SplitFailed, rid, now, split=split, reason=reason[:500])
        self.counts["reads_failed"] += 1

    def _finish(self, rid: str, rec: ConsumerRecord, now: float, step: ConsumerStep,
                why: str = "") -> None:
        """Report ``rid`` with the fold's verdict; ``why``: the failure's reason when the
        fold's own would be none (the driver gave the request up)."""
        verdict = read_verdict_of(rec)
        if not self._record(FinishedRecving, rid, now):
            return
        del self._reading[rid]
        ok = rec.state is DState.RECEIVED
        reason = "" if ok else (rec.failed or why or self._unproven(rec, verdict, now))
        step.finished.append(Finished(rid, ok, verdict, reason, reason is _ABANDONED))
        self._release(rid, now, not ok, step)

    def _unproven(self, rec: ConsumerRecord, verdict: Verdict, now: float) -> str:
        if verdict is Verdict.UNSAFE:
            return _UNSAFE
        if verdict is not Verdict.PENDING:
            return "nothing D may serve"
        if rec.cancelled:
            return _ABANDONED
        timeout_s = self.timing.read_timeout_s
        if now <= read_deadline(rec, timeout_s):  # `report_now`: vLLM 0.32's D
            return "reported without P's word"
        return (f"no answer from P proving it held the blocks {now - rec.posted_at:.1f}s after "
                f"the post ({read_deadline_bound(rec, timeout_s)})")

    def _release(self, rid: str, now: float, notify_only: bool, step: ConsumerStep) -> None:
        self._dirty = True
        req = self._reqs.get(rid)
        if self._record(ReleaseSent, rid, now, notify_only=notify_only):
            self.counts["releases_sent"] += 1
            self.counts["notify_only_releases"] += notify_only
            if req is not None:
                step.releases.append((req.peer, Release(rid, self.stream.engine,
                                                        self.stream.rank, req.token)))
        self._fresh.discard(rid)

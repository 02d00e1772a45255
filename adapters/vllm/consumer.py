"""D's half of the worker: I/O around `core.consumer.ConsumerEngine`.

A mixin of `HandoffWorker` (which owns the engine, the transport and the
lock; see its module docstring).  Everything here runs on the engine thread
inside `start_step` / `finish_step`.  This module parses what vLLM hands it
(the request's parameters, the handshake), checks them against the caches
(`_geometry_problem`), posts the READs the plan names and carries out what
the engine returns: the engine decides what to heartbeat and when, when to
give up on a READ or on P's word, what to report and what to release.

Nothing a request carries may stop the engine: each per-request step runs
under `_contained`, which turns an exception into `_give_up` for that
request (logged once; the fold refuses what it must, P is released
notify-only when no read owns its blocks, vLLM hears ``failed_recving``
exactly once) and carries on with the next request.  A request whose path
fails again after that is ended for good (`_end_for_good`): reported failed
once its READs drained, then forgotten, so P frees it by lease.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.adapters.vllm import stats as kstats
from kvhandoff.adapters.vllm.metadata import Admit, Failure, StepPlan
from kvhandoff.adapters.vllm.params import (
    UNCANCELLED_HOLD_S,
    MalformedTransferParams,
    RemotePrefill,
)
from kvhandoff.adapters.vllm.side_channel import HandshakeFailed, PeerIncompatible, handshake
from kvhandoff.adapters.vllm.trust import UntrustedProducer
from kvhandoff.core import messages
from kvhandoff.core.consumer import ConsumerStep, Finished, ParamsReused
from kvhandoff.core.errors import GeometryMismatch, MalformedMessage
from kvhandoff.core.groups import CacheLayout, MalformedGroups
from kvhandoff.core.lifecycle import ConsumerRecord, DState, Verdict
from kvhandoff.core.planning import (
    export_lengths,
    plan_group_reads,
    tokens_prefilled,
    validate_block_ids,
)
from kvhandoff.core.safelog import bounded_repr, get_logger
from kvhandoff.transports.base import UnknownPeer, group_splits

log = get_logger(__name__)


REFUSE_S = 10.0  # a P address whose handshake failed is not tried again for this long
# P addresses come from requests (within `trusted_producers`, by default all of loopback):
# at most this many handshakes run at once, and this many failed addresses are remembered.
MAX_HANDSHAKES = 256
MAX_REFUSED = 1024

_VERDICT_CLASS = {Verdict.UNSAFE: "unsafe", Verdict.PENDING: "unproven", Verdict.FAILED: "failed"}


class ProducerRefused(MalformedTransferParams):
    """The P rank the parameters name failed its handshake a moment ago (``reason_class``:
    the failure's class, `reject_class` of the handshake's error)."""

    def __init__(self, message: str, reason_class: str = "handshake_failed") -> None:
        super().__init__(message)
        self.reason_class = reason_class


class LayoutVersionMismatch(MalformedTransferParams):
    """The scheduler refused params of another ``cache_layout_version`` (a P of another
    kvhandoff version)."""


def _scheduler_error(error: str) -> MalformedTransferParams:
    """The scheduler half's parse error (text by the time it reaches the worker), typed again.

    The one distinction made is the field `parse_remote_prefill` names first, our
    constant; what the client wrote follows it and is never looked at.
    """
    if error.startswith("kv_transfer_params['cache_layout_version']"):
        return LayoutVersionMismatch(error)
    return MalformedTransferParams(error)


def reject_class(exc: BaseException) -> str:
    """A rejection's class for the metrics (`stats.REJECT_REASONS`), from the error's type."""
    if isinstance(exc, ProducerRefused):
        return exc.reason_class
    if isinstance(exc, MalformedGroups | PeerIncompatible):
        cause = exc if isinstance(exc, MalformedGroups) else exc.__context__
        if isinstance(cause, MalformedGroups) and cause.field == "version":
            return "layout_version"
    for kind, name in ((LayoutVersionMismatch, "layout_version"),
                       (UntrustedProducer, "untrusted_producer"),
                       (ParamsReused, "reused_params"),
                       (HandshakeFailed, "handshake_failed"),
                       (PeerIncompatible, "incompatible_peer"),
                       (GeometryMismatch, "geometry"),
                       (MalformedMessage, "malformed_params")):
        if isinstance(exc, kind):
            return name
    return "other"


@dataclass(slots=True)
class ProducerLink:
    engine_id: str
    agent: str
    num_blocks: int
    tp_size: int
    layout: CacheLayout  # P rank's cache groups, checked against ours at the handshake
    fence_slots: int = 0  # P rank's fence slots (`core.fence`; 0: it has none)


@dataclass(slots=True)
class IncomingHandoff:
    """D's adapter-side handle on one local request (the fold holds its lifecycle)."""

    local_id: str
    remote: RemotePrefill | None
    admitted: bool = False
    error: str = ""
    read_entry: bool = False  # vLLM parked it in WAITING_FOR_REMOTE_KVS: report exactly once
    handles: dict[int, int] = field(default_factory=dict)  # transport handle -> split
    posted_at: float = 0.0
    split_bytes: list[int] = field(default_factory=list)  # bytes each split reads
    gave_up: bool = False  # failed by _give_up after an unexpected error
    repeats: int = 0  # errors contained for it after it was given up
    held: list[tuple[int, bool, str]] = field(default_factory=list)  # completions not yet due
    hold_s: float = 0.0  # debug_read_delay_s: how long `held` completions wait
    hold_until_cancelled: bool = False  # ... counted from the client's cancel
    parked: bool = False  # waiting for the handshake with its P
    pending_read: tuple[list[list[int]], bool] | None = None  # a read that came while parked
    cancelled_at: float | None = None  # when the client cancelled (None: it has not)
    link: ProducerLink | None = None  # its P rank as admitted (its agent is the engine's peer)

    @property
    def cancelled(self) -> bool:
        return self.cancelled_at is not None

    def due(self) -> float:
        """When its READ completions reach the engine: ``hold_s`` after the post, or,
        held until cancelled, ``hold_s`` after the client's cancel (and, if none comes,
        `UNCANCELLED_HOLD_S` after the post).

        Held for a cancel, a test's READ is in flight when the client leaves however
        late an overloaded API server reports the leaving; a plain delay is a race
        with that report.
        """
        if not self.hold_until_cancelled:
            return self.posted_at + self.hold_s
        if self.cancelled_at is None:
            return self.posted_at + UNCANCELLED_HOLD_S
        return self.cancelled_at + self.hold_s

    def in_flight(self, now: float) -> list[int]:
        """READ handles not completed by ``now`` (they own D's pages and P's lease).

        A completion held back by ``debug_read_delay_s`` counts as in flight
        until it is due: the delay stands in for a slow READ.
        """
        if self.held and self.due() <= now:
            arrived = {handle for handle, _, _ in self.held}
            return [h for h in self.handles if h not in arrived]
        return list(self.handles)


class ConsumerHalf:
    def _dial_address(self, remote: RemotePrefill) -> tuple[str, int]:
        """The side-channel address D dials for ``remote``: its P rank ``self.rank``."""
        return (remote.host, remote.port + self.rank)

    def _peer_for(self, remote: RemotePrefill, now: float) -> ProducerLink | None:
        """The link to ``remote``'s P rank, or None while the handshake runs (started here).

        Handshakes run on a thread: an unreachable or hostile address costs
        that request ``handshake_timeout_s``, never the engine loop.  A failed
        address is refused for ``REFUSE_S`` without trying again.
        """
        key = self._dial_address(remote)
        peer = self._peers.get(key)
        if peer is not None:
            return peer
        refused = self._refused.get(key)
        if refused is not None:
            if now - refused[0] < REFUSE_S:
                raise ProducerRefused(f"P at {key[0]}:{key[1]}: {refused[1]}", *refused[2:])
            del self._refused[key]
        if key not in self._handshakes:
            if len(self._handshakes) >= MAX_HANDSHAKES:
                raise ProducerRefused(f"P at {key[0]}:{key[1]}: {len(self._handshakes)} "
                                      f"handshakes with other P addresses are running (at "
                                      f"most {MAX_HANDSHAKES}): try again")
            box: dict[str, Any] = {"done": threading.Event()}
            self._handshakes[key] = box
            threading.Thread(target=self._handshake, args=(key, self.transport.metadata(), box),
                             name="kvhandoff-handshake", daemon=True).start()
        return None

    def _handshake(self, key: tuple[str, int], metadata: bytes, box: dict[str, Any]) -> None:
        try:
            box["result"] = handshake(key[0], key[1], self.engine_id, self.rank, self.compat,
                                      metadata, self.cfg.handshake_timeout_s)
        except Exception as exc:  # handed to the engine thread, which rejects the requests
            box["error"] = exc
        box["done"].set()

    def _drop_lost_producers(self) -> None:
        """Forget links to P agents the transport reports gone (a restarted P re-handshakes)."""
        lost = set(self.transport.lost_peers())
        if not lost:
            return
        for key, link in list(self._peers.items()):
            if link.agent in lost:
                del self._peers[key]
                log.warning("vllm.worker.producer_lost", producer=link.engine_id, agent=link.agent,
                            address=f"{key[0]}:{key[1]}")
        for agent in lost:
            self.transport.remove_peer(agent)  # READs in flight from it drain first

    def _finish_handshakes(self, now: float) -> None:
        for key, box in list(self._handshakes.items()):
            if not box["done"].is_set():
                continue
            del self._handshakes[key]
            error = box.get("error")
            if error is None:
                hello, md = box["result"]
                try:  # a hostile hello must fail its requests, never the engine
                    num_blocks = hello["compat"].get("num_blocks", 0)
                    tp_size = hello["compat"].get("tp_size", 0)
                    fence_slots = hello["compat"].get("fence_slots", 0)  # older P: none
                    if not all(type(v) is int for v in (num_blocks, tp_size, fence_slots)):
                        raise HandshakeFailed(f"{key[0]}:{key[1]}: num_blocks / tp_size / "
                                              f"fence_slots must be integers, found "
                                              f"{bounded_repr((num_blocks, tp_size, fence_slots))}")
                    if fence_slots < 0:
                        raise HandshakeFailed(f"{key[0]}:{key[1]}: fence_slots must be >= 0, "
                                              f"found {fence_slots}")
                    layout = CacheLayout.from_wire(hello["compat"].get("cache_layout"))
                    agent = self.transport.add_peer(md)
                except Exception as exc:
                    error = exc
                else:
                    self._peers[key] = ProducerLink(hello["engine_id"], agent, num_blocks, tp_size,
                                                    layout, fence_slots)
                    log.info("vllm.worker.producer_connected", producer=hello["engine_id"],
                             agent=agent)
            if error is not None:
                kind = reject_class(error)  # the class its parked requests are rejected as
                if kind not in ("layout_version", "incompatible_peer"):
                    kind = "handshake_failed"
                if len(self._refused) >= MAX_REFUSED:  # keep it bounded: expired, then oldest
                    kept = [(k, v) for k, v in self._refused.items() if now - v[0] < REFUSE_S]
                    self._refused = dict(kept[max(0, len(kept) - MAX_REFUSED + 1):])
                self._refused[key] = (now, f"handshake failed: {type(error).__name__}: {error}",
                                      kind)
                log.error("vllm.worker.handshake_failed", address=f"{key[0]}:{key[1]}",
                          error=str(error), error_type=type(error).__name__)
            for a in self._parked.pop(key, []):
                self._contained("admission", a.local_id, now, self._unpark, a, now)

    def _unpark(self, a: Admit, now: float) -> None:
        inc = self._incoming.get(a.local_id)
        if inc is None:
            return  # cancelled (and nothing to report) while parked
        self._admit(a, now)
        if inc.cancelled:
            self._cancel(a.local_id, now)
            if inc.read_entry:
                self._fail_now.append(a.local_id)  # vLLM kept its pages: report once
        elif inc.pending_read is not None:
            ids, awaiting = inc.pending_read
            inc.pending_read = None
            self._post_read(a.local_id, ids, awaiting, now)

    def _admit(self, a: Admit, now: float) -> None:
        from kvhandoff.adapters.vllm.params import parse_remote_prefill

        local_id = a.local_id
        inc = self._incoming.get(local_id)
        if inc is None:
            inc = self._incoming[local_id] = IncomingHandoff(local_id, None)
        inc.parked = False
        try:
            if a.error and a.identity is None:
                raise _scheduler_error(a.error)
            if a.error or a.cleanup:
                # Bad fields but a readable identity: admit, then reject, so
                # the right P hears a notify-only release and frees at once.
                engine, prid, host, port, token = a.identity
                remote = RemotePrefill(engine, prid, host, port, 0, (), 0, self.cfg.lease_s,
                                       token=token)
            else:
                remote = parse_remote_prefill(a.params)
            inc.remote = remote
            self.trusted.check(*self._dial_address(remote))  # before a single packet leaves
            if self.consumer.check_unused(remote.request_id, remote.engine_id, a.cleanup):
                log.info("vllm.worker.cleanup_of_known_request", local_request_id=local_id,
                         request_id=remote.request_id)
                inc.remote = None
                return
            peer = self._peer_for(remote, now)
            if peer is None:
                inc.parked = True
                self._parked.setdefault(self._dial_address(remote), []).append(a)
                return
            if peer.engine_id != remote.engine_id:
                raise GeometryMismatch("remote_engine_id (unknown engine at that address)",
                                       expected=peer.engine_id, found=remote.engine_id)
        except (MalformedMessage, GeometryMismatch) as exc:
            inc.error = f"{type(exc).__name__}: {exc}"
            inc.remote = None
            self._count("rejected")
            self._count(kstats.failure_key("rejected", reject_class(exc)))
            log.error("vllm.worker.request_rejected", local_request_id=local_id, error=inc.error)
            return
        rid = remote.request_id
        if not self.consumer.admit(rid, now, peer=peer.agent, remote_engine=remote.engine_id,
                                   remote_ranks=(self.rank,),
                                   num_blocks=sum(map(len, remote.block_ids)),
                                   lease_s=remote.lease_s, token=remote.token,
                                   local_id=local_id, fence_slot=remote.fence_slot,
                                   fence_slots=peer.fence_slots):
            inc.error = "admission refused by the lifecycle"
            self._count("rejected")
            self._count("rejected_lifecycle")
            return
        inc.admitted, inc.link = True, peer
        self._by_remote[rid] = local_id
        if a.cleanup:
            return  # its cancel (same plan) sends P a notify-only release
        reason = a.error or self._geometry_problem(remote, peer, a.num_prompt_tokens)
        if reason:
            inc.error = reason
            self._count("rejected")
            kind = reject_class(_scheduler_error(a.error)) if a.error else "geometry"
            self._count(kstats.failure_key("rejected", kind))
            log.error("vllm.worker.request_rejected", local_request_id=local_id, request_id=rid,
                      error=reason)
            self._carry_out(self.consumer.rejected(rid, now, reason), now)
        else:
            self.consumer.validated(rid, now)

    def _geometry_problem(self, remote: RemotePrefill, peer: ProducerLink, num_prompt_tokens: int) -> str:
        """Why ``remote`` cannot be read into this D, or "" (checked before any READ)."""
        load = tokens_prefilled(self.layout, num_prompt_tokens)
        what = ("remote_num_tokens (D's prompt length)" if not self.backoff else
                f"remote_num_tokens (D's prompt length - {self.backoff}: D computes the rest)")
        checks = [
            ("tp_size", peer.tp_size, remote.tp_size),
            (what, load, remote.num_tokens),
            ("len(remote_block_ids) (KV cache groups)", len(self.layout.groups),
             len(remote.block_ids)),
        ]
        for what, expected, found in checks:
            if expected != found:
                return str(GeometryMismatch(what, expected=expected, found=found))
        lengths = export_lengths(self.layout, remote.num_tokens)
        for g, (ids, n) in enumerate(zip(remote.block_ids, lengths, strict=True)):
            if len(ids) != n:
                return str(GeometryMismatch(f"len(remote_block_ids[{g}]) (group {g}, "
                                            f"{self.layout.groups[g].kind.value})",
                                            expected=n, found=len(ids)))
            try:  # against P's real pool, now that the handshake told us its size
                validate_block_ids(ids, peer.num_blocks, f"remote_block_ids[{g}]")
            except GeometryMismatch as exc:
                return str(exc)
        return ""

    def _rid_of(self, local_id: str) -> str | None:
        """P's request id of an admitted local request (what the engine knows it by)."""
        inc = self._incoming.get(local_id)
        return inc.remote.request_id if inc is not None and inc.admitted and inc.remote else None

    def _cancel(self, local_id: str, now: float) -> None:
        inc = self._incoming.get(local_id)
        if inc is None:
            return
        if inc.cancelled_at is None:
            inc.cancelled_at = now
        rid = self._rid_of(local_id)
        if rid is not None:
            self._carry_out(self.consumer.cancel(rid, now), now)
        if not inc.read_entry and not inc.parked:
            # vLLM is not waiting for a completion: nothing more to report.
            # With reads in flight the request stays until they drain; a
            # parked one is admitted and released when its handshake ends.
            self._forget(local_id)

    def _forget(self, local_id: str) -> None:
        inc = self._incoming.pop(local_id, None)
        if inc is not None and inc.remote is not None and self._by_remote.get(inc.remote.request_id) == local_id:
            del self._by_remote[inc.remote.request_id]

    def _post_read(self, local_id: str, local_block_ids: list[list[int]], awaiting: bool,
                   now: float) -> None:
        inc = self._incoming.get(local_id)
        if inc is None:
            log.error("vllm.worker.read_for_unknown_request", local_request_id=local_id)
            if awaiting:  # vLLM parked it for a completion: it gets one, a failure
                self._fail_now.append(local_id)
            return
        inc.read_entry = awaiting
        if inc.parked:  # the handshake with its P is still running: post when it is done
            inc.pending_read = (local_block_ids, awaiting)
            return
        rid = self._rid_of(local_id)
        rec = self._rec(rid) if rid else None
        if not isinstance(rec, ConsumerRecord) or rec.state is not DState.VALIDATED:
            if awaiting:
                self._fail_now.append(local_id)
            else:
                self._forget(local_id)
            return
        if not awaiting:  # full local prefix hit: nothing to read, P may free now
            self._carry_out(self.consumer.nothing_to_read(rid, now), now)
            self._forget(local_id)
            return
        # Its P rank as admitted, whatever link the address has now: a P restarted there
        # since is another agent, and the post fails, as the heartbeats and proof would.
        peer = inc.link
        inc.posted_at = now
        inc.hold_s = self.cfg.debug_read_delay_s
        if self.cfg.debug_read_delay_param:
            inc.hold_s = max(inc.hold_s, inc.remote.debug_read_delay_s)
            inc.hold_until_cancelled = inc.remote.debug_hold_until_cancelled
        try:  # one READ split per cache group that needs one (core.planning)
            plan = plan_group_reads(peer.layout, self.layout, inc.remote.block_ids,
                                    local_block_ids, inc.remote.num_tokens, self.rank,
                                    null_block=0, local_rank=self.rank)
        except GeometryMismatch as exc:
            self.consumer.reads_posted(rid, now, (self.rank,))
            self.consumer.split_done(rid, 0, now, ok=False, reason=str(exc)[:500])
            return
        if plan.notify_only:  # a local hit after all, or the shared pool is rank 0's
            self.consumer.nothing_posted(rid, now, self.rank)
            return
        self.consumer.reads_posted(rid, now, tuple(r.rank for r in plan.reads),
                                   tuple(r.group for r in plan.reads))
        inc.split_bytes = [r.nbytes for r in plan.reads]
        for split, read in enumerate(plan.reads):
            try:
                handle = self.transport.post_split_read(peer.agent, group_splits([read]))
            except Exception as exc:
                self.consumer.split_done(rid, split, now, ok=False, reason=f"post failed: {exc}")
                continue
            inc.handles[handle] = split
            self._count("reads_posted")

    def _d_plan(self, plan: StepPlan, now: float) -> None:
        for a in plan.admits:
            self._contained("admission", a.local_id, now, self._admit, a, now)
        for f in plan.failures:
            self._scheduler_failed(f, now)
        for r in plan.reads:
            self._contained("read", r.local_id, now, self._post_read, r.local_id,
                            r.local_block_ids, r.awaiting, now, awaiting=r.awaiting)
        for local_id in plan.cancels:
            self._contained("cancel", local_id, now, self._cancel, local_id, now)

    # ---- the engine's effects ----------------------------------------------

    def _send(self, peer: str, msg: messages.Message) -> Exception | None:
        """Send ``msg`` to ``peer``; what failed, if it did (the engine plans it again)."""
        try:
            self.transport.send_notif(peer, messages.encode(msg))
            return None
        except Exception as exc:
            return exc

    def _post_fence(self, rid: str, peer: str, slot: int, planned: float, now: float) -> None:
        """Post the fence READ the engine planned; one that cannot be posted proves nothing
        (the engine asks P instead)."""
        try:
            posted = self.fence_reader.post(self.transport, peer, rid, slot, planned)
        except Exception as exc:
            log.warning("vllm.worker.fence_read_failed", request_id=rid, error=str(exc))
            posted = False
        if not posted:
            self.consumer.fence_read(rid, None, now, planned)

    def _carry_out(self, step: ConsumerStep, now: float) -> None:
        """Hand vLLM what it must hear, then send what the engine decided.

        Reports first: the engine reports a request once, so one lost to an error in a
        later part of this step (a fence post, a send) would leave vLLM waiting for ever.
        """
        for f in step.finished:
            inc = self._incoming.get(self._by_remote.get(f.request_id) or "")
            if inc is not None:
                self._contained("report", inc.local_id, now, self._report, f.request_id, inc, f)
        for rid, peer, _rank, slot, planned in step.fences:
            self._post_fence(rid, peer, slot, planned, now)
        for peer, hb, urgent in step.heartbeats:
            exc = self._send(peer, hb)
            if exc is None:
                self.consumer.heartbeat_sent(peer, hb, now, urgent)
            else:  # not recorded: planned again next poll
                log.warning("vllm.worker.heartbeat_failed", producer_agent=peer, error=str(exc))
        for peer, release in step.releases:
            exc = self._send(peer, release)
            # UnknownPeer: P was dropped as lost, nobody to tell (its lease lapses)
            if exc is not None and self.consumer.release_unsent(
                    peer, release, now, retry=not isinstance(exc, UnknownPeer)):
                log.warning("vllm.worker.release_failed", producer_agent=peer,
                            request_id=release.request_id, error=str(exc))
        for rid in step.timed_out:
            rec = self._rec(rid)
            log.warning("vllm.worker.read_timeout", request_id=rid,
                        waited_s=round(now - rec.posted_at, 3),
                        timeout_s=self.cfg.read_timeout_s, lease_s=rec.lease_s,
                        splits_in_flight=self.consumer.in_flight(rid))

    def _report(self, rid: str, inc: IncomingHandoff, f: Finished) -> None:
        """The engine reported ``rid`` (``finished_recving``): tell vLLM, once."""
        if f.abandoned and not inc.gave_up:  # the client's cancel, not a refused READ
            log.info("vllm.worker.read_abandoned", request_id=rid, local_request_id=inc.local_id,
                     reason=f.reason)
        elif not f.ok and not inc.gave_up:
            self._count(kstats.failure_key("reads_refused", _VERDICT_CLASS.get(f.verdict, "failed")))
            log.error("vllm.worker.read_refused", request_id=rid, local_request_id=inc.local_id,
                      verdict=f.verdict.value, error=f.reason)
        if inc.read_entry:
            if not f.ok or inc.gave_up:
                self._report_failed.add(inc.local_id)
            self._report_recving.add(inc.local_id)
        self._forget(inc.local_id)

    # ---- containment: one request's error fails that request only ---------

    def _contained(self, what: str, local_id: str, now: float, step: Any, *args: Any,
                   awaiting: bool = False) -> None:
        """Run one request's ``step``; an exception gives that request up (``awaiting``: vLLM
        waits for a completion of it)."""
        try:
            step(*args)
        except Exception as exc:
            inc = self._incoming.get(local_id)
            if inc is not None and awaiting:
                inc.read_entry = True
            self._give_up(local_id, f"{what}: {type(exc).__name__}: {exc}", now)

    def _scheduler_failed(self, f: Failure, now: float) -> None:
        inc = self._incoming.setdefault(f.local_id, IncomingHandoff(f.local_id, None))
        inc.read_entry = inc.read_entry or f.awaiting
        self._give_up(f.local_id, f"scheduler: {f.reason}", now)

    def _give_up(self, local_id: str, reason: str, now: float) -> None:
        """Fail one request after an unexpected error, without touching any other.

        Logged once.  The engine decides the rest (`ConsumerEngine.give_up`): a
        request that posted no read is rejected and P released notify-only; one
        with READs in flight has them failed and is reported when they drain
        (its pages stay held until then); one whose READs all drained is reported
        failed at once; vLLM hears of it once.
        """
        inc = self._incoming.get(local_id)
        if inc is None:
            return
        if inc.gave_up:  # it fails again: whatever path raises will raise every step
            inc.repeats += 1
            if inc.repeats == 1:
                log.error("vllm.worker.request_failed_again", local_request_id=local_id,
                          error=reason, reads_in_flight=len(inc.in_flight(now)))
            self._end_for_good(inc, now)
            return
        log.error("vllm.worker.request_failed", local_request_id=local_id, error=reason)
        inc.gave_up = True
        inc.error = reason
        if inc.parked:  # never admit it when its handshake finishes
            for waiting in self._parked.values():
                waiting[:] = [a for a in waiting if a.local_id != local_id]
            inc.parked = False
        self._count("rejected")
        self._count("rejected_internal_error")
        rid = self._rid_of(local_id)
        try:
            if rid is not None:
                rec = self._rec(rid)
                reading = isinstance(rec, ConsumerRecord) and rec.state in (
                    DState.READING, DState.CANCELLED_READING)
                self._carry_out(self.consumer.give_up(rid, now, reason), now)
                if reading:
                    return  # reported (failed) by the engine: now, or once its READs drain
        except Exception as exc:  # the fold stays as it was; vLLM still hears below
            log.error("vllm.worker.give_up_incomplete", local_request_id=local_id,
                      error=f"{type(exc).__name__}: {exc}")
        if inc.handles:
            return  # READs still own the pages: reported when they drain
        if inc.read_entry and local_id not in self._fail_now:
            self._fail_now.append(local_id)

    def _end_for_good(self, inc: IncomingHandoff, now: float) -> None:
        """End a request whose contained path failed again after it was given up.

        The fold is left as it is (recording is what may be failing).  Once
        no READ is in flight, vLLM hears ``failed_recving`` for it once (when
        it waits for one) and the engine stops acting for it (`abandon`): its
        heartbeats stop, so P frees its blocks when the lease lapses.  Until
        then it keeps its heartbeat and D keeps its pages: a READ in flight
        never loses its lease.  Called again each step (`_d_drain`) until its
        READs drain.
        """
        if inc.in_flight(now):
            return
        local_id = inc.local_id
        if (inc.read_entry and local_id not in self._fail_now
                and local_id not in self._report_recving):
            self._fail_now.append(local_id)
        log.error("vllm.worker.request_ended", local_request_id=local_id,
                  request_id=inc.remote.request_id if inc.remote else None,
                  errors_after_give_up=inc.repeats, error=inc.error)
        rid = self._rid_of(local_id)
        if rid is not None:
            self.consumer.abandon(rid)
        self._forget(local_id)

    def _local_of(self, handle: int) -> IncomingHandoff | None:
        for inc in self._incoming.values():
            if handle in inc.handles:
                return inc
        return None

    def _d_poll(self) -> None:
        """Collect READ completions (the caller reads the clock after this: a completion's
        time is never earlier than its receipt, or a late READ could pass for a safe one)."""
        for c in self.transport.poll():
            fence = self.fence_reader.landed(c)
            if fence is not None:  # the slot's word, read now: the engine hears it in _d_drain
                rid, _slot, value, planned = fence
                self._fence_landed.append((rid, value, planned))
                continue
            inc = self._local_of(c.handle)
            if inc is None:
                log.warning("vllm.worker.completion_for_unknown_handle", handle=c.handle)
                continue
            inc.held.append((c.handle, c.ok, c.reason))

    def _d_drain(self, now: float) -> None:
        """Hand the completions that are due to the engine (`_drain`), request by request,
        and what each fence READ found."""
        landed, self._fence_landed = self._fence_landed, []
        for rid, value, planned in landed:
            self.consumer.fence_read(rid, value, now, planned)
        for inc in list(self._incoming.values()):
            if inc.repeats:  # ended for good: only waits for its READs to drain
                self._end_for_good(inc, now)
            elif inc.held:  # (nothing held: nothing to hand over)
                self._contained("completion", inc.local_id, now, self._drain, inc, now)

    def _drain(self, inc: IncomingHandoff, now: float) -> None:
        """Hand one request's due READ completions to the engine (see debug_read_delay_s)."""
        if now < inc.due():
            return
        rid = inc.remote.request_id if inc.remote else ""
        while inc.held:  # one by one: what an error leaves stays held (arrived, not in flight)
            handle, ok, reason = inc.held[0]
            accepted = self.consumer.split_done(rid, inc.handles[handle], now, ok, reason)
            inc.held.pop(0)  # (only now: a completion the engine did not take stays held, so
            split = inc.handles.pop(handle)  # the request can still end, `_end_for_good`)
            if accepted and ok:
                self._count("bytes_read", inc.split_bytes[split])
                for bucket in (self.stats, self.total):
                    kstats.add_read(bucket, now - inc.posted_at, inc.split_bytes[split])

    def _d_receive(self) -> None:
        """Collect notifications (before the caller reads the clock, as `_d_poll`)."""
        self._d_received.extend(self._notifications())

    def _d_notifs(self, now: float) -> None:
        received, self._d_received = self._d_received, []
        for peer, msg in received:  # one peer's odd message must not cost the others theirs
            self._one("notification", self.consumer.on_notification, peer, msg, now, peer=peer)

    def _d_engine(self, now: float) -> None:
        """The engine's turn: READ deadlines, reports, heartbeats; then what vLLM must hear.

        `finish_step` empties the report sets only when it returns them: an
        error in a later stage never loses a report.
        """
        while self._fail_now:
            local_id = self._fail_now[0]
            self._report_recving.add(local_id)
            self._report_failed.add(local_id)
            self._fail_now.pop(0)
            self._forget(local_id)
        self._carry_out(self.consumer.poll(now), now)

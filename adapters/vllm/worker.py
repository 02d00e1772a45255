"""The worker half: KV registration, handshakes, READs, notifications, the event log.

Theory of operation
-------------------
Each worker rank owns one stream (engine, side, rank) of the lifecycle: a
`Ledger` whose fold is the only state that decides anything, and an event
log it writes.  The adapter here translates between vLLM, the transport and
that fold:

* P (producer): the scheduler's plan says a prefill started, finished
  (``Export`` → ``Exported`` with a lease) or was aborted.  A notification
  thread answers D's heartbeats (``HeartbeatReceived`` + an acknowledgement
  carrying `lease_time_left`) and records releases (``ReleaseNotified``);
  each engine step reaps `expired_leases` and frees what `to_free` names,
  reporting those requests to vLLM in ``finished_sending`` exactly once.
* D (consumer): a request is admitted when it arrives (after a handshake
  with its P rank and identity checks), validated against P's geometry,
  and read when vLLM has allocated its blocks.  `heartbeat_due` names what to
  heartbeat; P's acknowledgements become ``LeaseAcknowledged``; a request is
  reported in ``finished_recving`` once `reads_to_report` says its reads
  drained with a verdict, after which D releases P (a notify-only release
  when no read carried the data).  A client cancel with reads in flight keeps
  heartbeating until then: vLLM keeps D's destination blocks too, because
  the scheduler half answered ``delay_free`` for it.

All ledger and transport calls go through one lock: the notification thread
and the engine thread share both.  Time is ``time.monotonic()`` here, passed
into the core.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from kvhandoff.adapters.vllm import stats as kstats
from kvhandoff.adapters.vllm.config import HandoffConfig, UnsupportedTopology
from kvhandoff.adapters.vllm.metadata import Admit, StepPlan
from kvhandoff.adapters.vllm.params import MalformedTransferParams, RemotePrefill
from kvhandoff.adapters.vllm.side_channel import SideChannelServer, handshake
from kvhandoff.adapters.vllm.transport import make_transport
from kvhandoff.core import messages
from kvhandoff.core.errors import GeometryMismatch, LifecycleError, MalformedMessage
from kvhandoff.core.events import (
    Aborted,
    Admitted,
    ClientCancelled,
    Exported,
    FinishedRecving,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
    LeaseAcknowledged,
    LeaseExpired,
    PrefillStarted,
    ReadsPosted,
    Rejected,
    ReleaseNotified,
    ReleaseSent,
    Side,
    SplitCompleted,
    SplitFailed,
    Stream,
    Validated,
)
from kvhandoff.core.ledger import Ledger
from kvhandoff.core.lifecycle import (
    ConsumerRecord,
    DState,
    LifecycleState,
    ProducerRecord,
    PState,
    prune_terminal,
)
from kvhandoff.core.log import LogWriter
from kvhandoff.core.planning import coalesce
from kvhandoff.core.policy import (
    Verdict,
    expired_leases,
    heartbeat_due,
    lease_time_left,
    read_verdict,
    reads_to_report,
    to_free,
)
from kvhandoff.transports.base import KVRegion, ReadRequest

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Peer:
    engine_id: str
    agent: str
    num_blocks: int
    tp_size: int


@dataclass(slots=True)
class _Incoming:
    """D's adapter-side handle on one local request (the fold holds its lifecycle)."""

    local_id: str
    remote: RemotePrefill | None
    admitted: bool = False
    error: str = ""
    read_entry: bool = False  # vLLM parked it in WAITING_FOR_REMOTE_KVS: report exactly once
    handles: dict[int, int] = field(default_factory=dict)  # transport handle -> split
    posted_at: float = 0.0
    bytes: int = 0
    timed_out: bool = False
    held: list[tuple[float, int, bool, str]] = field(default_factory=list)


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.replace(".", " ").split())


class HandoffWorker:
    def __init__(self, cfg: HandoffConfig, engine_id: str, side: Side, rank: int, tp_size: int,
                 compat: dict[str, Any]) -> None:
        self.cfg, self.engine_id, self.side, self.rank, self.tp_size = cfg, engine_id, side, rank, tp_size
        self.stream = Stream(engine_id, side, rank)
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = str(Path(cfg.log_dir) / f"{engine_id}.{side.value}{rank}.jsonl")
        self.writer = LogWriter(self.log_path)
        self.state = LifecycleState()
        self._last_prune = 0.0
        self.ledger = Ledger(self.stream, self.state, sink=self.writer)
        self.lock = threading.RLock()
        self.compat = dict(compat)
        self.transport: Any = None
        self.num_blocks = 0
        self.block_bytes_total = 0
        self.stats = kstats.empty()
        self.total = kstats.empty()
        # P
        self._server: SideChannelServer | None = None
        self._notif_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._d_agents: dict[str, str] = {}  # D engine id -> agent name
        self._deferred: list[tuple[float, str, messages.Heartbeat]] = []
        # D
        self._peers: dict[tuple[str, int], _Peer] = {}  # (host, port) -> peer
        self._refused: dict[tuple[str, int], tuple[float, str]] = {}
        self._incoming: dict[str, _Incoming] = {}  # local id -> adapter handle
        self._by_remote: dict[str, str] = {}  # P's request id -> local id
        self._fail_now: list[str] = []  # local ids to report failed this step
        self._last_hb: dict[str, float] = {}
        self._fresh: set[str] = set()  # admitted, not heartbeated yet
        self._urgent: set[str] = set()  # engines whose ack we need now
        self._reasked: set[str] = set()  # engines asked again for an overdue ack
        log.info("vllm.worker.started", engine=engine_id, side=side.value, rank=rank,
                 event_log=self.log_path)

    # ---- bookkeeping -------------------------------------------------------

    def _count(self, key: str, n: int | float = 1) -> None:
        self.stats[key] += n
        self.total[key] += n

    def _record(self, event_type: type, rid: str, t: float, **fields: Any) -> bool:
        try:
            self.ledger.record(event_type, rid, t, **fields)
            return True
        except LifecycleError as exc:
            # An event the graph refuses is a bug in this adapter or a hostile
            # peer; the request's lifecycle is left unchanged and it is logged.
            log.error("vllm.worker.refused_event", request_id=rid, event=event_type.kind,
                      error=str(exc))
            return False

    def _rec(self, rid: str) -> Any:
        return self.state.record(self.stream, rid)

    def take_stats(self) -> dict[str, Any]:
        with self.lock:
            out, self.stats = self.stats, kstats.empty()
            ss = self.state.streams.get(self.stream)
            ignored = sum(ss.ignored.values()) if ss else 0
            out["notifications_ignored"] += ignored - self.total.get("_ignored_seen", 0)
            self.total["notifications_ignored"] += ignored - self.total.get("_ignored_seen", 0)
            self.total["_ignored_seen"] = ignored
        return out

    def flush(self) -> str:
        with self.lock:
            self.writer.flush()
        return self.log_path

    # ---- registration ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = sorted(kv_caches, key=_natural_key)
        regions: list[KVRegion] = []
        seen: set[int] = set()
        for name in names:
            t = kv_caches[name]
            if t.data_ptr() in seen:
                continue  # a layer sharing another layer's cache: register once
            seen.add(t.data_ptr())
            if t.device.type != "cpu":
                kind = "VRAM"
            else:
                kind = "DRAM"
            block_bytes = t.stride(0) * t.element_size()
            if not t.is_contiguous() or block_bytes * t.shape[0] != t.numel() * t.element_size():
                raise UnsupportedTopology(
                    f"KV cache of {name} is not block-major contiguous (shape {tuple(t.shape)}, "
                    f"strides {t.stride()}); kvhandoff needs blocks as the outermost dimension")
            regions.append(KVRegion(name, t, int(t.shape[0]), block_bytes, kind=kind,
                                    device=max(t.get_device(), 0) if kind == "VRAM" else 0))
        if not regions:
            raise UnsupportedTopology("no KV cache tensors to register")
        if len({r.num_blocks for r in regions}) != 1 or len({r.block_bytes for r in regions}) != 1:
            raise UnsupportedTopology("KV cache layers differ in block count or block size")
        self.num_blocks = regions[0].num_blocks
        self.block_bytes_total = sum(r.block_bytes for r in regions)
        self.compat.update(block_bytes=regions[0].block_bytes, num_regions=len(regions),
                           num_blocks=self.num_blocks,
                           layout=f"block-major{tuple(regions[0].buffer.shape[1:])}",
                           cache_dtype=str(regions[0].buffer.dtype))
        agent = f"{self.engine_id}-{self.side.value}{self.rank}-{uuid.uuid4().hex[:8]}"
        self.transport = make_transport(agent)
        self.transport.register(regions)
        log.info("vllm.worker.registered", regions=len(regions), num_blocks=self.num_blocks,
                 block_bytes=regions[0].block_bytes, agent=agent)
        if self.side is Side.P:
            self._server = SideChannelServer(
                self.cfg.side_channel_host, self.cfg.side_channel_port + self.rank,
                self.engine_id, self.rank, self.compat, self._on_hello)
            self._notif_thread = threading.Thread(target=self._notif_loop, daemon=True,
                                                  name="kvhandoff-notifications")
            self._notif_thread.start()

    # ---- P: side channel and notifications --------------------------------

    def _on_hello(self, hello: dict[str, Any], metadata: bytes) -> bytes:
        with self.lock:
            agent = self.transport.add_peer(metadata)
            self._d_agents[hello["engine_id"]] = agent
            log.info("vllm.worker.consumer_connected", consumer=hello["engine_id"], agent=agent)
            return self._metadata_with_geometry()

    def _metadata_with_geometry(self) -> bytes:
        return self.transport.metadata()

    def _notif_loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                try:
                    self._p_handle_notifs(time.monotonic())
                except Exception as exc:  # never let the thread die silently
                    log.error("vllm.worker.notif_loop_error", error=str(exc),
                              error_type=type(exc).__name__)
                ss = self.state.streams.get(self.stream)
                live = ss is not None and any(r.state in (PState.EXPORTED, PState.PREFILLING)
                                              for r in ss.requests.values())
            self._stop.wait(self.cfg.notif_poll_s if live else self.cfg.idle_poll_s)

    def _p_handle_notifs(self, now: float) -> None:
        deferred, self._deferred = self._deferred, []
        for since, peer, hb in deferred:
            self._p_heartbeat(peer, hb, now, since)
        for note in self.transport.recv_notifs():
            try:
                msg = messages.decode(note.message)
            except MalformedMessage as exc:
                self._count("notifications_ignored")
                log.warning("vllm.worker.malformed_notification", peer=note.peer, error=str(exc))
                continue
            if isinstance(msg, messages.Heartbeat):
                self._count("heartbeats_received")
                self._p_heartbeat(note.peer, msg, now, now)
            elif isinstance(msg, messages.Release):
                self._record(ReleaseNotified, msg.request_id, now, from_engine=msg.engine,
                             consumer_rank=msg.rank, token=msg.token)
            else:
                self._count("notifications_ignored")

    def _p_heartbeat(self, peer: str, msg: messages.Heartbeat, now: float, since: float) -> None:
        # D may heartbeat a request before this rank has folded its export
        # (the plan arrives with the next engine step).  Answering "gone" then
        # would fail a good read, so those ids wait here for the export; one
        # lease later they are answered for what they are.
        waiting = tuple(rid for rid in msg.request_ids
                        if isinstance(rec := self._rec(rid), ProducerRecord)
                        and rec.state is PState.PREFILLING)
        if waiting and now - since < self.cfg.lease_s:
            self._deferred.append((since, peer, messages.Heartbeat(
                msg.engine, msg.rank, msg.sent_at, waiting,
                tuple(msg.token_of(msg.request_ids.index(r)) for r in waiting) if msg.tokens else ())))
        left: dict[str, float] = {}
        for i, rid in enumerate(msg.request_ids):
            if rid in waiting and now - since < self.cfg.lease_s:
                continue
            token = msg.token_of(i)
            rec = self._rec(rid)
            if (isinstance(rec, ProducerRecord) and rec.state is PState.EXPORTED
                    and (not rec.token or rec.token == token)):
                self._count("leases_extended")
            self._record(HeartbeatReceived, rid, now, from_engine=msg.engine, token=token)
            left[rid] = lease_time_left(self.state, self.stream, rid, now, engine=msg.engine,
                                        token=token)
        if not left:
            return
        ack = messages.HeartbeatAck(self.engine_id, self.rank, msg.sent_at, left)
        try:
            self.transport.send_notif(peer, messages.encode(ack))
            self._count("acks_sent")
        except Exception as exc:
            log.warning("vllm.worker.ack_failed", peer=peer, error=str(exc))

    def _p_step(self, plan: StepPlan | None, now: float) -> set[str]:
        if plan is not None:
            for rid in plan.prefill_started:
                self._record(PrefillStarted, rid, now)
            for ex in plan.exports:
                if self._record(Exported, ex.request_id, now, lease_s=self.cfg.lease_s,
                                consumer_ranks=(self.rank,), num_blocks=ex.num_blocks,
                                token=ex.token):
                    self._count("leases_exported")
            for rid in plan.aborted:
                if self._record(Aborted, rid, now, reason="finished on P before export"):
                    self._record(Freed, rid, now)  # vLLM freed these blocks itself
        self._p_handle_notifs(now)
        for rid in expired_leases(self.state, self.stream, now):
            if self._record(LeaseExpired, rid, now):
                self._count("leases_expired")
                log.warning("vllm.worker.lease_expired", request_id=rid, lease_s=self.cfg.lease_s)
        finished: set[str] = set()
        for rid in to_free(self.state, self.stream):
            rec = self._rec(rid)
            ended = "released" if rec.state is PState.RELEASED else rec.ended
            if self._record(Freed, rid, now):
                self._count("frees")
                if ended == "released":
                    self._count("leases_released")
                finished.add(rid)
        return finished

    # ---- D: admission, reads, heartbeats ----------------------------------

    def _peer_for(self, remote: RemotePrefill, now: float) -> _Peer:
        key = (remote.host, remote.port + self.rank)
        peer = self._peers.get(key)
        if peer is not None:
            return peer
        refused = self._refused.get(key)
        if refused is not None and now - refused[0] < 10.0:
            raise MalformedTransferParams(f"P at {key[0]}:{key[1]} unreachable: {refused[1]}")
        try:
            hello, md = handshake(remote.host, remote.port + self.rank, self.engine_id, self.rank,
                                  self.compat, self.transport.metadata(), self.cfg.handshake_timeout_s)
            agent = self.transport.add_peer(md)
        except GeometryMismatch:
            raise
        except Exception as exc:
            self._refused[key] = (now, f"{type(exc).__name__}: {exc}")
            raise MalformedTransferParams(f"handshake with {key[0]}:{key[1]} failed: {exc}") from None
        peer = _Peer(hello["engine_id"], agent, int(hello["compat"].get("num_blocks", 0)),
                     int(hello["compat"].get("tp_size", 0)))
        self._peers[key] = peer
        log.info("vllm.worker.producer_connected", producer=peer.engine_id, agent=agent)
        return peer

    def _admit(self, a: Admit, now: float) -> None:
        from kvhandoff.adapters.vllm.params import parse_remote_prefill

        local_id = a.local_id
        inc = _Incoming(local_id, None)
        self._incoming[local_id] = inc
        try:
            if a.error and a.identity is None:
                raise MalformedTransferParams(a.error)
            if a.error:
                # Bad fields but a readable identity: admit, then reject, so
                # the right P hears a notify-only release and frees at once.
                engine, prid, host, port, token = a.identity
                remote = RemotePrefill(engine, prid, host, port, 0, (), 0, self.cfg.lease_s,
                                       token=token)
            else:
                remote = parse_remote_prefill(a.params)
            inc.remote = remote
            peer = self._peer_for(remote, now)
            if peer.engine_id != remote.engine_id:
                raise GeometryMismatch("remote_engine_id (unknown engine at that address)",
                                       expected=peer.engine_id, found=remote.engine_id)
            if remote.request_id in self._by_remote:
                raise MalformedTransferParams(
                    f"remote_request_id {remote.request_id!r} is already being read by "
                    f"local request {self._by_remote[remote.request_id]!r}")
        except (MalformedMessage, GeometryMismatch) as exc:
            inc.error = f"{type(exc).__name__}: {exc}"
            inc.remote = None
            self._count("rejected")
            log.error("vllm.worker.request_rejected", local_request_id=local_id, error=inc.error)
            return
        rid = remote.request_id
        if not self._record(Admitted, rid, now, remote_engine=remote.engine_id,
                            remote_ranks=(self.rank,), num_blocks=len(remote.block_ids),
                            lease_s=remote.lease_s, lease_margin_s=self.cfg.lease_margin_s,
                            local_request_id=local_id):
            inc.error = "admission refused by the lifecycle"
            self._count("rejected")
            return
        inc.admitted = True
        self._by_remote[rid] = local_id
        self._fresh.add(rid)
        reason = a.error or self._geometry_problem(remote, peer, a.num_prompt_tokens)
        if reason:
            inc.error = reason
            self._count("rejected")
            log.error("vllm.worker.request_rejected", local_request_id=local_id, request_id=rid,
                      error=reason)
            self._record(Rejected, rid, now, reason=reason)
            self._release(rid, now, notify_only=True)
        else:
            self._record(Validated, rid, now)

    def _geometry_problem(self, remote: RemotePrefill, peer: _Peer, num_prompt_tokens: int) -> str:
        bs = int(self.compat["block_size"])
        checks = [
            ("tp_size", peer.tp_size, remote.tp_size),
            ("remote_num_tokens (D's prompt length)", num_prompt_tokens, remote.num_tokens),
            ("len(remote_block_ids)", math.ceil(remote.num_tokens / bs), len(remote.block_ids)),
        ]
        for what, expected, found in checks:
            if expected != found:
                return str(GeometryMismatch(what, expected=expected, found=found))
        bad = [b for b in remote.block_ids if b >= peer.num_blocks]
        if bad:
            return str(GeometryMismatch("remote_block_ids", expected=f"0..{peer.num_blocks - 1}",
                                        found=bad[0]))
        return ""

    def _release(self, rid: str, now: float, notify_only: bool) -> None:
        inc = self._incoming.get(self._by_remote.get(rid, ""))
        remote = inc.remote if inc else None
        peer = self._peers.get((remote.host, remote.port + self.rank)) if remote else None
        if peer is not None:
            msg = messages.Release(rid, self.engine_id, self.rank, remote.token)
            try:
                self.transport.send_notif(peer.agent, messages.encode(msg))
            except Exception as exc:  # P gone: its lease will lapse on its own
                log.warning("vllm.worker.release_failed", request_id=rid, error=str(exc))
        if self._record(ReleaseSent, rid, now, notify_only=notify_only):
            self._count("releases_sent")
            if notify_only:
                self._count("notify_only_releases")
        self._fresh.discard(rid)

    def _cancel(self, local_id: str, now: float) -> None:
        inc = self._incoming.get(local_id)
        if inc is None:
            return
        rid = inc.remote.request_id if inc.admitted and inc.remote else None
        rec = self._rec(rid) if rid else None
        if isinstance(rec, ConsumerRecord) and rec.state is not DState.DONE:
            self._record(ClientCancelled, rid, now)
            if self._rec(rid).state is DState.CANCELLED:
                self._release(rid, now, notify_only=True)
        if not inc.read_entry:
            # vLLM is not waiting for a completion: nothing more to report.
            # With reads in flight the request stays until they drain.
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
            return
        inc.read_entry = awaiting
        rid = inc.remote.request_id if inc.admitted and inc.remote else None
        rec = self._rec(rid) if rid else None
        if not isinstance(rec, ConsumerRecord) or rec.state is not DState.VALIDATED:
            if awaiting:
                self._fail_now.append(local_id)
            else:
                self._forget(local_id)
            return
        if not awaiting:  # full local prefix hit: nothing to read, P may free now
            self._release(rid, now, notify_only=True)
            self._forget(local_id)
            return
        remote_ids = inc.remote.block_ids
        local = list(local_block_ids[0]) if local_block_ids else []
        self._record(ReadsPosted, rid, now, split_ranks=(self.rank,))
        inc.posted_at = now
        if len(local) < len(remote_ids):
            self._record(SplitFailed, rid, now, split=0,
                         reason=str(GeometryMismatch("local blocks", expected=len(remote_ids),
                                                     found=len(local))))
            self._count("reads_failed")
            return
        local = local[:len(remote_ids)]
        peer = self._peers[(inc.remote.host, inc.remote.port + self.rank)]
        try:
            handle = self.transport.post_read(peer.agent, ReadRequest(coalesce(remote_ids, local)))
        except Exception as exc:
            self._record(SplitFailed, rid, now, split=0, reason=f"post failed: {exc}")
            self._count("reads_failed")
            return
        inc.handles[handle] = 0
        inc.bytes = len(remote_ids) * self.block_bytes_total
        self._count("reads_posted")

    def _d_plan(self, plan: StepPlan, now: float) -> None:
        for a in plan.admits:
            self._admit(a, now)
        for r in plan.reads:
            self._post_read(r.local_id, r.local_block_ids, r.awaiting, now)
        for local_id in plan.cancels:
            self._cancel(local_id, now)

    def _local_of(self, handle: int) -> _Incoming | None:
        for inc in self._incoming.values():
            if handle in inc.handles:
                return inc
        return None

    def _d_poll(self, now: float) -> None:
        for c in self.transport.poll():
            inc = self._local_of(c.handle)
            if inc is None:
                log.warning("vllm.worker.completion_for_unknown_handle", handle=c.handle)
                continue
            delay = self.cfg.debug_read_delay_s
            if self.cfg.debug_read_delay_param and inc.remote is not None:
                delay = max(delay, inc.remote.debug_read_delay_s)
            inc.held.append((inc.posted_at + delay, c.handle, c.ok, c.reason))
        for inc in list(self._incoming.values()):
            rid = inc.remote.request_id if inc.remote else ""
            keep = []
            for due, handle, ok, reason in inc.held:
                if now < due:
                    keep.append((due, handle, ok, reason))
                    continue
                split = inc.handles.pop(handle)
                if inc.timed_out:
                    continue  # already failed on timeout; the bytes drained now
                if ok:
                    self._record(SplitCompleted, rid, now, split=split)
                    self._count("reads_completed")
                    self._count("bytes_read", inc.bytes)
                    for bucket in (self.stats, self.total):
                        bucket["read_s"].append(now - inc.posted_at)
                        bucket["read_bytes"].append(inc.bytes)
                    self._urgent.add(inc.remote.engine_id)
                else:
                    self._record(SplitFailed, rid, now, split=split, reason=reason or "read failed")
                    self._count("reads_failed")
            inc.held = keep
            if inc.handles and not inc.timed_out and now - inc.posted_at > self.cfg.read_timeout_s:
                inc.timed_out = True
                for split in sorted(set(inc.handles.values())):
                    self._record(SplitFailed, rid, now, split=split,
                                 reason=f"read timeout after {self.cfg.read_timeout_s}s")
                self._count("reads_failed")

    def _d_notifs(self, now: float) -> None:
        for note in self.transport.recv_notifs():
            try:
                msg = messages.decode(note.message)
            except MalformedMessage as exc:
                self._count("notifications_ignored")
                log.warning("vllm.worker.malformed_notification", peer=note.peer, error=str(exc))
                continue
            if not isinstance(msg, messages.HeartbeatAck):
                self._count("notifications_ignored")
                continue
            self._count("acks_received")
            for rid, left in sorted(msg.time_left.items()):
                rec = self._rec(rid)
                if isinstance(rec, ConsumerRecord) and rec.remote_engine == msg.engine:
                    self._record(LeaseAcknowledged, rid, now, p_rank=msg.rank,
                                 sent_at=msg.sent_at, time_left=left)
                else:
                    self._count("notifications_ignored")

    def _awaiting_word(self) -> set[str]:
        """P engines owing an answer: a request's reads drained, the verdict still PENDING."""
        out: set[str] = set()
        ss = self.state.streams.get(self.stream)
        for rid, rec in (ss.requests.items() if ss else ()):
            if (isinstance(rec, ConsumerRecord)
                    and rec.state in (DState.READING, DState.CANCELLED_READING)
                    and rec.split_done and all(d is not None for d in rec.split_done)
                    and read_verdict(self.state, self.stream, rid) is Verdict.PENDING):
                out.add(rec.remote_engine)
        return out

    def _d_heartbeats(self, now: float) -> None:
        waiting = self._awaiting_word() if self._urgent or self._reasked else set()
        self._reasked &= waiting
        for engine, rids in sorted(heartbeat_due(self.state, self.stream).items()):
            since = now - self._last_hb.get(engine, -math.inf)
            due = since >= self.cfg.heartbeat_interval_s
            fresh = any(r in self._fresh for r in rids)
            # Reads drained but unconfirmed: ask at once, then every quarter
            # interval (an acknowledgement can be lost like any notification).
            urgent = engine in waiting and since >= (
                self.cfg.heartbeat_interval_s / 4 if engine in self._reasked else 0.005)
            if not (due or fresh or urgent):
                continue
            inc = self._incoming.get(self._by_remote.get(rids[0], ""))
            if inc is None or inc.remote is None:
                continue
            peer = self._peers.get((inc.remote.host, inc.remote.port + self.rank))
            if peer is None:
                continue
            ordered = tuple(sorted(rids))
            tokens = tuple(self._token_of(r) for r in ordered)
            hb = messages.Heartbeat(self.engine_id, self.rank, now, ordered,
                                    tokens if any(tokens) else ())
            try:
                self.transport.send_notif(peer.agent, messages.encode(hb))
            except Exception as exc:
                log.warning("vllm.worker.heartbeat_failed", producer=engine, error=str(exc))
                continue
            self._last_hb[engine] = now
            if urgent:
                self._reasked.add(engine)
            self._urgent.discard(engine)
            self._count("heartbeats_sent")
            for rid in sorted(rids):
                self._record(HeartbeatSent, rid, now)
                self._fresh.discard(rid)

    def _token_of(self, rid: str) -> str:
        inc = self._incoming.get(self._by_remote.get(rid, ""))
        return inc.remote.token if inc is not None and inc.remote is not None else ""

    def _prune(self, now: float) -> None:
        # Keep finished records one lease (late notifications get precise
        # answers), then forget them so a long-running engine stays bounded.
        if now - self._last_prune >= self.cfg.lease_s:
            self._last_prune = now
            prune_terminal(self.state, self.stream, now - 2 * self.cfg.lease_s)

    def _d_report(self, now: float) -> tuple[set[str], set[str]]:
        finished: set[str] = set()
        failed: set[str] = set()
        for local_id in self._fail_now:
            finished.add(local_id)
            failed.add(local_id)
            self._forget(local_id)
        self._fail_now = []
        due = list(reads_to_report(self.state, self.stream))
        for inc in self._incoming.values():
            # Reads drained but no acknowledgement proves P still held the
            # source (P silent or gone): past the read timeout the verdict
            # stays unproven and the request fails instead of waiting forever.
            rec = self._rec(inc.remote.request_id) if inc.admitted and inc.remote else None
            if (isinstance(rec, ConsumerRecord) and not inc.handles and inc.posted_at
                    and rec.state in (DState.READING, DState.CANCELLED_READING)
                    and all(d is not None for d in rec.split_done)
                    and now - inc.posted_at > self.cfg.read_timeout_s
                    and inc.remote.request_id not in due):
                due.append(inc.remote.request_id)
        for rid in due:
            local_id = self._by_remote.get(rid)
            inc = self._incoming.get(local_id or "")
            if inc is None or inc.handles:
                continue  # a timed-out READ still owns D's pages: wait for it to drain
            self._record(FinishedRecving, rid, now)
            ok = self._rec(rid).state is DState.RECEIVED
            self._release(rid, now, notify_only=not ok)
            if inc.read_entry:
                finished.add(inc.local_id)
                if not ok:
                    failed.add(inc.local_id)
            self._forget(inc.local_id)
        return finished, failed

    # ---- the two per-step entry points ------------------------------------

    def start_step(self, plan: StepPlan | None) -> None:
        """``start_load_kv``: act on the scheduler's plan for this step."""
        if plan is None or plan.empty():
            return
        with self.lock:
            now = time.monotonic()
            if self.side is Side.P:
                self._pending_plan = plan
            else:
                self._d_plan(plan, now)
                self._d_heartbeats(now)

    _pending_plan: StepPlan | None = None

    def finish_step(self) -> tuple[set[str], set[str], set[str]]:
        """``get_transfer_results``: (finished_sending, finished_recving, failed_recving)."""
        with self.lock:
            now = time.monotonic()
            self._prune(now)
            if self.side is Side.P:
                plan, self._pending_plan = self._pending_plan, None
                return self._p_step(plan, now), set(), set()
            self._d_poll(now)
            self._d_notifs(now)
            self._d_heartbeats(now)
            recving, failed = self._d_report(now)
            return set(), recving, failed

    def close(self) -> None:
        self._stop.set()
        if self._notif_thread is not None:
            self._notif_thread.join(timeout=2)
        if self._server is not None:
            self._server.close()
        with self.lock:
            self.writer.flush()
            self.writer.close()
            if self.transport is not None:
                self.transport.close()

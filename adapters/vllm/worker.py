"""The worker half: KV registration, handshakes, READs, notifications, the event log.

Theory of operation
-------------------
The two halves live in `producer` (P) and `consumer` (D); this module owns
what they share.  Each worker rank owns one stream (engine, side, rank) of the lifecycle: a
`Ledger` whose fold is the only state that decides anything, and an event
log it writes.  The adapter here translates between vLLM, the transport and
that fold:

* P (producer): the scheduler's plan says a prefill started, finished
  (``Export``) or was aborted; `core.producer.ProducerEngine` pins the
  export under a lease.  A notification thread hands it D's heartbeats and
  releases and sends the acknowledgements it returns; each engine step polls
  it for what to free, reported to vLLM in ``finished_sending`` exactly once.
* D (consumer): a request is admitted when it arrives (after a handshake
  with its P rank and identity checks), validated against P's geometry,
  and read when vLLM has allocated its blocks; `core.consumer.ConsumerEngine`
  decides what to heartbeat and when, when a READ or P's word is given up,
  what is reported in ``finished_recving`` and what P is told to release.  A
  client cancel with reads in flight keeps heartbeating until they drained:
  vLLM keeps D's destination blocks too, because the scheduler half answered
  ``delay_free`` for it.

NIXL's progress thread runs on P only (transports/nixl/agent.py): D's engine
step progresses its own READs and collects P's answers in one hop, and a
small thread of D's (`transports.nixl.progress.ReadProgress`) moves READs in flight
between engine steps.  All ledger and transport calls go through one lock:
the engine thread and P's notification thread or D's READ thread share both.  Time is the
worker's ``clock`` (``time.monotonic`` in vLLM; a test may skip it ahead), passed into the core.

The event log is written to the OS (``write``, not ``fsync``) at the end of
every ``start_step`` / ``finish_step`` and every pass of P's notification
thread (at most ``idle_poll_s`` apart): a live engine's log is current to its
last step, and a ``kill -9`` loses at most the step in progress (and may tear
the last line).  SIGTERM / SIGINT flush too (`connector.flush_all_logs`).  A
write that fails (``OSError``) is counted and the log marked degraded
(`_flush_log`); it never reaches vLLM's engine loop.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvhandoff.adapters.vllm import stats as kstats
from kvhandoff.adapters.vllm.config import HandoffConfig, UnsupportedTopology, make_log_dir
from kvhandoff.adapters.vllm.consumer import ConsumerHalf, IncomingHandoff, ProducerLink
from kvhandoff.adapters.vllm.metadata import StepPlan
from kvhandoff.adapters.vllm.producer import ProducerHalf
from kvhandoff.adapters.vllm.side_channel import SideChannelServer
from kvhandoff.adapters.vllm.transport import make_transport
from kvhandoff.adapters.vllm.trust import TrustedConsumers, TrustedProducers
from kvhandoff.core import messages
from kvhandoff.core.consumer import ConsumerEngine
from kvhandoff.core.errors import MalformedMessage
from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import LANDING_SLOTS
from kvhandoff.core.groups import CacheLayout
from kvhandoff.core.lifecycle import LifecycleState
from kvhandoff.core.log import LogWriter, log_name
from kvhandoff.core.planning import prefill_backoff
from kvhandoff.core.producer import ProducerEngine
from kvhandoff.core.safelog import get_logger
from kvhandoff.transports.base import FenceReader, RegionMismatch, fence_region
from kvhandoff.transports.caches import kv_regions
from kvhandoff.transports.nixl.progress import ReadProgress

log = get_logger(__name__)


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.replace(".", " ").split())


def _rotate_previous_log(path: str) -> None:
    """An engine restarted with the same engine id starts a new stream from seq 0.

    Its predecessor's log is moved aside (``<name>.<unix time>.jsonl``) so each
    file stays a valid log; replay them separately (their streams share a name).
    """
    p = Path(path)
    if p.exists() and p.stat().st_size > 0:
        stamp, n = int(time.time()), 0
        moved = p.with_name(f"{p.stem}.{stamp}.jsonl")
        while moved.exists():  # restarted twice within a second: keep both predecessors
            n += 1
            moved = p.with_name(f"{p.stem}.{stamp}-{n}.jsonl")
        p.rename(moved)
        log.warning("vllm.worker.previous_log_moved", path=path, moved_to=str(moved))


class HandoffWorker(ProducerHalf, ConsumerHalf):
    def __init__(self, cfg: HandoffConfig, engine_id: str, side: Side, rank: int, tp_size: int,
                 compat: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # every time the engines are given (both threads); never the I/O's timeouts
        self.cfg, self.engine_id, self.side, self.rank, self.tp_size = cfg, engine_id, side, rank, tp_size
        self.stream = Stream(engine_id, side, rank)
        make_log_dir(cfg.log_dir, engine_id)
        self.log_path = str(Path(cfg.log_dir) / log_name(self.stream))
        _rotate_previous_log(self.log_path)
        self.writer = LogWriter(self.log_path)
        self._log_dropped_seen = 0  # of writer.dropped, counted in the stats
        self.log_degraded = False
        self.state = LifecycleState()
        self._last_prune = 0.0
        # Every lifecycle decision is the side's engine's; this worker is its I/O.
        self.producer = (ProducerEngine(self.stream, cfg.lease_s, self.state, sink=self.writer)
                         if side is Side.P else None)
        self.consumer = (ConsumerEngine(self.stream, cfg.timing, self.state, sink=self.writer)
                         if side is Side.D else None)
        self.engine = self.producer or self.consumer
        self.ledger = self.engine.ledger
        self._engine_counts_seen: Counter[str] = Counter()
        self.lock = threading.RLock()
        self.compat = dict(compat)
        self.trusted = TrustedProducers(cfg.trusted_producers)
        self.transport: Any = None
        self.num_blocks = 0
        self.layout: CacheLayout | None = None
        self._kv_caches: dict[str, Any] = {}  # what NIXL has registered: kept alive
        self.backoff = 0  # prompt tokens D computes itself (core.planning.prefill_backoff)
        self.stats = kstats.empty()
        self.total = kstats.empty()
        # P
        self._server: SideChannelServer | None = None
        self._notif_thread: threading.Thread | None = None  # P
        self._read_progress: ReadProgress | None = None  # D without NIXL's progress thread
        self._stop = threading.Event()
        self._report_sending: set[str] = set()  # freed, vLLM not told yet
        self.fence: Any = None  # P: its fence slots (`core.fence`)
        self._consumers: set[str] = set()  # P: D agents connected by a hello (bounded)
        # D
        self._peers: dict[tuple[str, int], ProducerLink] = {}  # (host, port) -> peer
        self._refused: dict[tuple[str, int], tuple[float, str, str]] = {}  # (when, why, class)
        self._handshakes: dict[tuple[str, int], dict[str, Any]] = {}  # address -> running handshake
        self._parked: dict[tuple[str, int], list[Any]] = {}  # address -> admissions waiting on it
        self._incoming: dict[str, IncomingHandoff] = {}  # local id -> adapter handle
        self._by_remote: dict[str, str] = {}  # P's request id -> local id
        self._fail_now: list[str] = []  # local ids to report failed this step
        self._report_recving: set[str] = set()  # finished_recving, vLLM not told yet
        self._report_failed: set[str] = set()  # of those, failed
        self.fence_reader: FenceReader | None = None  # D: its fence READs, once registered
        self._fence_landed: list[tuple[str, int | None, float]] = []  # for the engine
        self._d_received: list[tuple[str, messages.Message]] = []  # D: notifications, for it
        log.info("vllm.worker.started", engine=engine_id, side=side.value, rank=rank,
                 event_log=self.log_path)

    # ---- bookkeeping -------------------------------------------------------

    def _count(self, key: str, n: int | float = 1) -> None:
        self.stats[key] += n
        self.total[key] += n

    def _rec(self, rid: str) -> Any:
        return self.state.record(self.stream, rid)

    def _notifications(self) -> list[tuple[str, messages.Message]]:
        """Received notifications as (peer, message); garbled ones are counted and logged."""
        out = []
        for note in self.transport.recv_notifs():
            try:
                out.append((note.peer, messages.decode(note.message)))
            except MalformedMessage as exc:
                self._count("notifications_ignored")
                log.warning("vllm.worker.malformed_notification", peer=note.peer, error=str(exc))
            except Exception as exc:  # a decoder bug: costs this note, never the batch
                self._count("notifications_ignored")
                log.error("vllm.worker.notification_error", peer=note.peer, error=str(exc),
                          error_type=type(exc).__name__)
        return out

    def take_stats(self) -> dict[str, Any]:
        with self.lock:
            gained = self.engine.counts - self._engine_counts_seen
            self._engine_counts_seen = self.engine.counts.copy()
            for key, n in gained.items():
                self._count(key, n)
            out, self.stats = self.stats, kstats.empty()
            ss = self.state.streams.get(self.stream)
            ignored = sum(ss.ignored.values()) if ss else 0
            out["notifications_ignored"] += ignored - self.total.get("_ignored_seen", 0)
            self.total["notifications_ignored"] += ignored - self.total.get("_ignored_seen", 0)
            self.total["_ignored_seen"] = ignored
        return out

    def flush(self) -> str:
        with self.lock:
            self._flush_log()
        return self.log_path

    def _flush_log(self) -> None:
        """Hand the buffered events to the OS; a failing write never reaches vLLM.

        The engine keeps serving with its log degraded (``log_write_errors``
        in the stats, one loud log line): the log is the record, not the
        mechanism.  What the buffer still holds is written by the next flush
        that succeeds; what it dropped (past 64 MiB unwritten) is counted
        (``log_events_dropped``).
        """
        try:
            self.writer.flush()
        except OSError as exc:
            self._count("log_write_errors")
            if not self.log_degraded:
                self.log_degraded = True
                log.critical("vllm.worker.event_log_degraded", event_log=self.log_path,
                             error=str(exc), error_type=type(exc).__name__)
        dropped = self.writer.dropped - self._log_dropped_seen
        if dropped:
            self._log_dropped_seen += dropped
            self._count("log_events_dropped", dropped)

    def _stage(self, name: str, step: Any, *args: Any) -> None:
        """Run one stage of an engine step; its error costs that stage only, this step."""
        try:
            step(*args)
        except Exception as exc:  # per-request errors are contained below this
            log.error("vllm.worker.step_error", stage=name, error=str(exc),
                      error_type=type(exc).__name__)

    def _one(self, what: str, step: Any, *args: Any, peer: str = "",
             request_id: str = "") -> bool:
        """Run one notification's or one request's ``step``; an error costs only that one.
        False when it raised."""
        try:
            step(*args)
            return True
        except Exception as exc:
            if what == "notification":
                self._count("notifications_ignored")
            log.error(f"vllm.worker.{what}_error", peer=peer or None,
                      request_id=request_id or None, error=str(exc),
                      error_type=type(exc).__name__)
            return False

    # ---- registration ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], layout: CacheLayout) -> None:
        """Register the caches ``layout`` describes: each physical range once.

        ``kv_caches`` is what vLLM hands the connector (layer name -> a view of
        the one backing allocation); ``layout`` is that allocation's groups and
        regions (`adapters.vllm.layout.cache_layout`).  Groups that vLLM lays
        over the same bytes share regions, so they are registered once.  The
        layout goes into the handshake, where D checks P's group by group.
        """
        try:
            # A host pool shared by the local TP ranks: rank 0 registers and reads it.
            regions = kv_regions(kv_caches, layout,
                                 host_pool=self.rank == 0 or not layout.shared_host_pool)
        except RegionMismatch as exc:
            raise UnsupportedTopology(f"KV caches do not match their layout: {exc}") from None
        # NIXL reads and writes this memory for as long as it is registered: hold it
        # (vLLM's model runner does too, but a caller that let go would have READs land
        # in freed memory).
        self._kv_caches = kv_caches
        self.layout, self.backoff = layout, prefill_backoff(layout)
        self.num_blocks = layout.groups[0].num_blocks
        first = kv_caches[layout.groups[0].layers[0]]
        self.compat.update(num_blocks=self.num_blocks, cache_dtype=str(first.dtype),
                           cache_layout=layout.to_wire())
        # The fence: P's slots (the handshake tells D how many), or D's landing slots for
        # the fence READs in flight (`core.fence`).
        if self.side is Side.D:
            self.fence_reader = FenceReader(LANDING_SLOTS)
            regions = [*regions, self.fence_reader.region]
        elif self.cfg.fence_slots:
            region, self.fence = fence_region(self.cfg.fence_slots)
            regions = [*regions, region]
            self.compat.update(fence_slots=self.cfg.fence_slots)
        agent = f"{self.engine_id}-{self.side.value}{self.rank}-{uuid.uuid4().hex[:8]}"
        # NIXL's progress thread on P only (transports/nixl/agent.py, "Without the
        # progress thread"): D's engine step progresses its own READs and answers.
        self.transport = make_transport(agent, progress_thread_otherwise=self.side is Side.P)
        self.transport.register(regions)
        log.info("vllm.worker.registered", regions=len(regions), num_blocks=self.num_blocks,
                 groups=[g.kind.value for g in layout.groups], agent=agent)
        if self.side is Side.P:
            trusted = self.cfg.trusted_consumers
            self._server = SideChannelServer(
                self.cfg.side_channel_host, self.cfg.side_channel_port + self.rank,
                self.engine_id, self.rank, self.compat, self._on_hello,
                TrustedConsumers(trusted).allows if trusted else None)
            self._notif_thread = threading.Thread(target=self._notif_loop, daemon=True,
                                                  name="kvhandoff-notifications")
            self._notif_thread.start()
        elif not self.transport.options.progress_thread:
            self._read_progress = ReadProgress(self.transport, self.lock, self.cfg.notif_poll_s,
                                               self.cfg.idle_poll_s).start()

    def _prune(self, now: float) -> None:
        """Forget finished records `to_forget` names (two leases after they ended, the
        request's lease if longer than this engine's), each a `Forgotten` event in the log.

        Until then late notifications get precise answers and, on D, the
        request's transfer parameters stay single-use (`check_unused`) for as long
        as P may still hold its blocks; after it a re-use is a new request,
        in the live fold and in the replayed one alike.  Checked once a lease.
        """
        if now - self._last_prune < self.cfg.lease_s:
            return
        self._last_prune = now
        self.engine.forget(now)

    # ---- the two per-step entry points ------------------------------------

    def start_step(self, plan: StepPlan | None) -> None:
        """``start_load_kv``: act on the scheduler's plan for this step."""
        if plan is None or plan.empty():
            return
        with self.lock:
            now = self.clock()
            if self.side is Side.P:
                self._stage("plan", self._p_plan, plan, now)
            else:
                self._stage("lost_producers", self._drop_lost_producers)
                self._stage("handshakes", self._finish_handshakes, now)
                self._stage("plan", self._d_plan, plan, now)
                self._stage("engine", self._d_engine, now)
                if self._read_progress is not None:
                    self._read_progress.wake()
            self._flush_log()

    def finish_step(self) -> tuple[set[str], set[str], set[str]]:
        """``get_transfer_results``: (finished_sending, finished_recving, failed_recving)."""
        # Each stage runs whatever an earlier one raised: reporting and
        # freeing never starve.  What vLLM must hear waits on self until it
        # is returned here.
        with self.lock:
            now = self.clock()
            self._stage("prune", self._prune, now)
            if self.side is Side.P:
                self._p_step(now)
            else:
                self._stage("lost_producers", self._drop_lost_producers)
                self._stage("handshakes", self._finish_handshakes, now)
                self._stage("poll", self._d_poll)
                self._stage("receive", self._d_receive)
                # Read after the receipt: what the poll and the receive brought in is
                # stamped no earlier than it arrived (a READ's completion time decides
                # whether it was safe; an acknowledgement never precedes P's receipt
                # of the heartbeat it answers).
                now = max(now, self.clock())
                self._stage("drain", self._d_drain, now)
                self._stage("notifications", self._d_notifs, now)
                self._stage("engine", self._d_engine, now)
                if self.fence_reader is not None and self.fence_reader.in_flight:
                    # A fence READ is 8 bytes: on one host UCX often completes it while
                    # posting, so look once more now rather than a whole engine step later.
                    self._stage("poll", self._d_poll)
                    now = max(now, self.clock())
                    self._stage("drain", self._d_drain, now)
                    self._stage("engine", self._d_engine, now)
                if self._read_progress is not None:
                    self._read_progress.wake()
            self._flush_log()
            sending, self._report_sending = self._report_sending, set()
            recving, self._report_recving = self._report_recving, set()
            failed, self._report_failed = self._report_failed, set()
            return sending, recving, failed

    def close(self) -> None:
        self._stop.set()
        if self._read_progress is not None:
            self._read_progress.close()
        if self._notif_thread is not None:
            self._notif_thread.join(timeout=2)
        if self._server is not None:
            self._server.close()
        with self.lock:
            self._flush_log()
            try:
                self.writer.close()
            except OSError:  # its last flush failed: counted and logged above
                pass
            if self.transport is not None:
                self.transport.close()

"""P's half of the worker: I/O around `core.producer.ProducerEngine`.

A mixin of `HandoffWorker` (which owns the transport, the event log and the
lock; see its module docstring).  Every lifecycle decision of P is the
engine's (`self.producer`): this half decodes notifications and hands them
over with the sender the transport vouches for, sends the answers the engine
returns, tells it what the scheduler saw, and reports the frees it names to
vLLM (``finished_sending``).  The notification thread runs `_notif_loop`; the
engine thread runs `_p_step` once per engine step.  Each notification and
each request's step runs contained (`_one`): an error costs only that
one, never the thread or vLLM's engine loop.

The notification thread and the GIL
-----------------------------------
While P holds a delayed free (every exported request, until D's release),
vLLM's engine loop steps without pause, in Python, holding the GIL.  A
thread woken by a timer must then wait for CPython's switch interval (5 ms
by default) before the engine thread is made to hand the GIL over: D's
heartbeat waited about that long for its answer (measured, docs/benchmarks.md,
bench vllm co-located).  `_notif_loop` therefore lowers the process's switch
interval to ``notif_poll_s`` while it runs (`_FastGilSwitch`; restored when
the last P worker of the process stops): the thread wakes every
``notif_poll_s`` with live leases, so it gets the GIL within about one period,
and only a thread that asks for the GIL makes the engine thread switch.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from kvhandoff.adapters.vllm.metadata import StepPlan
from kvhandoff.core import messages
from kvhandoff.core.lifecycle import PState
from kvhandoff.core.producer import ProducerStep
from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)

# D agents one P rank keeps connected (a NIXL remote agent each, with its connection):
# a hello beyond it is refused until the liveness probes find connected ones gone.
MAX_CONSUMERS = 4096


class _FastGilSwitch:
    """The process's GIL switch interval, at most ``interval_s`` while any P worker's
    notification thread runs; the interval found before the first is restored after
    the last.  (The interval is one value per process: this counts its users.)"""

    _lock = threading.Lock()
    _users = 0
    _saved = 0.0

    @classmethod
    def enter(cls, interval_s: float) -> None:
        with cls._lock:
            if cls._users == 0:
                cls._saved = sys.getswitchinterval()
            cls._users += 1
            sys.setswitchinterval(min(sys.getswitchinterval(), interval_s))

    @classmethod
    def exit(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                sys.setswitchinterval(cls._saved)


class ProducerHalf:
    def _on_hello(self, hello: dict[str, Any], metadata: bytes) -> bytes:
        with self.lock:
            agent = self.transport.add_peer(metadata)
            if agent not in self._consumers and len(self._consumers) >= MAX_CONSUMERS:
                self.transport.remove_peer(agent)  # (NIXL connects as it loads: bounded after)
                raise ConnectionRefusedError(
                    f"this P rank has {len(self._consumers)} consumers connected (at most "
                    f"{MAX_CONSUMERS}); one found gone makes room")
            self._consumers.add(agent)
            log.info("vllm.worker.consumer_connected", consumer=hello["engine_id"], agent=agent)
            return self.transport.metadata()

    def _notif_loop(self) -> None:
        _FastGilSwitch.enter(self.cfg.notif_poll_s)  # see the module docstring
        try:
            while not self._stop.is_set():
                with self.lock:
                    try:
                        self._p_handle_notifs()
                    except Exception as exc:  # never let the thread die silently
                        log.error("vllm.worker.notif_loop_error", error=str(exc),
                                  error_type=type(exc).__name__)
                    self._flush_log()  # durable within one poll period
                    live = self.producer.live()
                self._stop.wait(self.cfg.notif_poll_s if live else self.cfg.idle_poll_s)
        finally:
            _FastGilSwitch.exit()

    def _p_handle_notifs(self) -> None:
        notes = self._notifications()
        # Read the clock after the receipt: a release is stamped (and its
        # blocks freed) no earlier than it arrived, or replay would see P
        # free before D's read completed.
        now = self.clock()
        for peer, msg in notes:
            # one peer's odd message must not cost the others theirs.  The
            # sender is the peer agent (unique per process), not what the
            # message claims: a restarted D or a replayed request is another peer.
            self._one("notification", self._p_notification, peer, msg, now, peer=peer)

    def _p_notification(self, peer: str, msg: messages.Message, now: float) -> None:
        self._p_send(self.producer.on_notification(peer, msg, now))

    def _p_send(self, step: ProducerStep) -> None:
        for peer, ack in step.acks:
            try:
                self.transport.send_notif(peer, messages.encode(ack))
                self._count("acks_sent")
            except Exception as exc:
                log.warning("vllm.worker.ack_failed", peer=peer, error=str(exc))

    def _p_plan(self, plan: StepPlan, now: float) -> None:
        """What the scheduler saw this step: prefills started, exported, aborted."""
        engine = self.producer
        for rid in plan.prefill_started:
            self._one("plan", engine.prefill_started, rid, now, request_id=rid)
        for ex in plan.exports:
            slot = ex.fence_slot
            if self.fence is None or slot is None or not 0 <= slot < len(self.fence):
                slot = None
                if self.fence is not None:  # every slot was live: D proves it by asking P
                    self._count("exports_unfenced")
            if self._one("plan", engine.exported, ex.request_id, now, ex.num_blocks,
                         (self.rank,), ex.token, None, slot, request_id=ex.request_id):
                continue  # taken, or refused and named freed by the engine's next poll
            rec = engine.state.record(engine.stream, ex.request_id)
            if rec is None or rec.state in (PState.NEW, PState.PREFILLING):
                # The export raised before the fold took it: no lease, so nothing vouches
                # for these blocks, and vLLM keeps them until they are named: name them now.
                self._report_sending.add(ex.request_id)
                log.error("vllm.worker.export_failed_freed_now", request_id=ex.request_id)
                # End its record (aborted: freed by the host engine, not named again), so
                # P does not count it live nor hold D's heartbeat for it back a lease.
                self._one("plan", engine.aborted, ex.request_id, now, "export failed",
                                  request_id=ex.request_id)
        for rid in plan.aborted:
            self._one("plan", engine.aborted, rid, now, "finished on P before export",
                              request_id=rid)

    def _p_step(self, now: float) -> None:
        """Answer notifications, then let the engine reap and free into ``_report_sending``.

        Each stage runs whatever an earlier one raised (`_stage`); `finish_step`
        returns ``_report_sending`` to vLLM and only then empties it.
        """
        self._stage("notifications", self._p_handle_notifs)
        now = max(now, self.clock())  # frees follow the releases just stamped
        self._stage("lost_consumers", self._p_drop_lost_consumers)
        self._stage("poll", self._p_poll, now)

    def _p_poll(self, now: float) -> None:
        step = self.producer.poll(now)
        for slot, value in step.fences:  # before vLLM hears of a free: a cleared slot first
            self.fence[slot] = value
        self._report_sending.update(step.freed)  # then: vLLM must hear of every free
        self._p_send(step)

    def _p_drop_lost_consumers(self) -> None:
        for agent in self.transport.lost_peers():  # a D that died: its leases lapse on their own
            self.transport.remove_peer(agent)
            self._consumers.discard(agent)
            log.warning("vllm.worker.consumer_lost", agent=agent)

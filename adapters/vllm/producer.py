"""P's half of the worker: answer heartbeats, note releases, reap leases, free once.

A mixin of `HandoffWorker` (which owns the ledger, the transport and the
lock; see its module docstring).  The notification thread runs
`_notif_loop`; the engine thread runs `_p_step` once per engine step.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from kvhandoff.adapters.vllm.metadata import StepPlan
from kvhandoff.core import messages
from kvhandoff.core.events import (
    Aborted,
    Exported,
    Freed,
    HeartbeatReceived,
    LeaseExpired,
    PrefillStarted,
    ReleaseNotified,
)
from kvhandoff.core.lifecycle import (
    ProducerRecord,
    PState,
)
from kvhandoff.core.policy import (
    expired_leases,
    lease_time_left,
    to_free,
)

log = structlog.get_logger(__name__)


class ProducerHalf:
    def _on_hello(self, hello: dict[str, Any], metadata: bytes) -> bytes:
        with self.lock:
            agent = self.transport.add_peer(metadata)
            log.info("vllm.worker.consumer_connected", consumer=hello["engine_id"], agent=agent)
            return self.transport.metadata()

    def _notif_loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                try:
                    self._p_handle_notifs()
                except Exception as exc:  # never let the thread die silently
                    log.error("vllm.worker.notif_loop_error", error=str(exc),
                              error_type=type(exc).__name__)
                self._flush_log()  # durable within one poll period
                ss = self.state.streams.get(self.stream)
                live = ss is not None and any(r.state in (PState.EXPORTED, PState.PREFILLING)
                                              for r in ss.requests.values())
            self._stop.wait(self.cfg.notif_poll_s if live else self.cfg.idle_poll_s)

    def _p_handle_notifs(self) -> None:
        notes = self._notifications()
        # Read the clock after the receipt: a release is stamped (and its
        # blocks freed) no earlier than it arrived, or replay would see P
        # free before D's read completed.
        now = time.monotonic()
        deferred, self._deferred = self._deferred, []
        for since, peer, hb in deferred:
            self._p_contained("deferred_heartbeat", self._p_heartbeat, peer, hb, now, since,
                              peer=peer)
        for peer, msg in notes:
            # one peer's odd message must not cost the others theirs
            self._p_contained("notification", self._p_notification, peer, msg, now, peer=peer)

    def _p_contained(self, what: str, step: Any, *args: Any, peer: str = "",
                     request_id: str = "") -> None:
        """Run one notification's or one request's ``step``; an error costs only that one."""
        try:
            step(*args)
        except Exception as exc:
            if what in ("notification", "deferred_heartbeat"):
                self._count("notifications_ignored")
            log.error(f"vllm.worker.{what}_error", peer=peer or None,
                      request_id=request_id or None, error=str(exc),
                      error_type=type(exc).__name__)

    def _p_notification(self, peer: str, msg: messages.Message, now: float) -> None:
        if isinstance(msg, messages.Heartbeat):
            self._count("heartbeats_received")
            self._p_heartbeat(peer, msg, now, now)
        elif isinstance(msg, messages.Release):
            # The sender is the peer agent (unique per process), not what the
            # message claims: a restarted D or a replayed request is another peer.
            self._record(ReleaseNotified, msg.request_id, now, from_engine=peer,
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
            before = rec.deadline if isinstance(rec, ProducerRecord) else None
            self._record(HeartbeatReceived, rid, now, from_engine=peer, token=token)
            if before is not None and rec.deadline > before:  # the fold accepted it
                self._count("leases_extended")
            left[rid] = lease_time_left(self.state, self.stream, rid, now, engine=peer,
                                        token=token)
        if not left:
            return
        ack = messages.HeartbeatAck(self.engine_id, self.rank, msg.sent_at, left)
        try:
            self.transport.send_notif(peer, messages.encode(ack))
            self._count("acks_sent")
        except Exception as exc:
            log.warning("vllm.worker.ack_failed", peer=peer, error=str(exc))

    def _p_plan(self, plan: StepPlan, now: float) -> None:
        """What the scheduler saw this step: prefills started, exported, aborted."""
        for rid in plan.prefill_started:
            self._p_contained("plan", self._record, PrefillStarted, rid, now, request_id=rid)
        for ex in plan.exports:
            self._p_contained("plan", self._p_export, ex, now, request_id=ex.request_id)
        for rid in plan.aborted:
            self._p_contained("plan", self._p_abort, rid, now, request_id=rid)

    def _p_export(self, ex: Any, now: float) -> None:
        if self._record(Exported, ex.request_id, now, lease_s=self.cfg.lease_s,
                        consumer_ranks=(self.rank,), num_blocks=ex.num_blocks, token=ex.token):
            self._count("leases_exported")

    def _p_abort(self, rid: str, now: float) -> None:
        if self._record(Aborted, rid, now, reason="finished on P before export"):
            self._record(Freed, rid, now)  # vLLM freed these blocks itself

    def _p_step(self, now: float) -> None:
        """Answer notifications, reap expired leases, free into ``_report_sending``.

        Each stage runs whatever an earlier one raised (`_stage`); `finish_step`
        returns ``_report_sending`` to vLLM and only then empties it.
        """
        self._stage("notifications", self._p_handle_notifs)
        now = max(now, time.monotonic())  # frees follow the releases just stamped
        self._stage("lost_consumers", self._p_drop_lost_consumers)
        self._stage("expire", self._p_expire, now)
        self._stage("free", self._p_free, now)

    def _p_drop_lost_consumers(self) -> None:
        for agent in self.transport.lost_peers():  # a D that died: its leases lapse on their own
            self.transport.remove_peer(agent)
            log.warning("vllm.worker.consumer_lost", agent=agent)

    def _p_expire(self, now: float) -> None:
        for rid in expired_leases(self.state, self.stream, now):
            self._p_contained("expire", self._p_expire_one, rid, now, request_id=rid)

    def _p_expire_one(self, rid: str, now: float) -> None:
        if self._record(LeaseExpired, rid, now):
            self._count("leases_expired")
            log.warning("vllm.worker.lease_expired", request_id=rid, lease_s=self.cfg.lease_s)

    def _p_free(self, now: float) -> None:
        for rid in to_free(self.state, self.stream):
            self._p_contained("free", self._p_free_one, rid, now, request_id=rid)

    def _p_free_one(self, rid: str, now: float) -> None:
        rec = self._rec(rid)
        ended = "released" if rec.state is PState.RELEASED else rec.ended
        if self._record(Freed, rid, now):
            self._report_sending.add(rid)  # before anything else can raise: vLLM must hear it
            self._count("frees")
            if ended == "released":
                self._count("leases_released")


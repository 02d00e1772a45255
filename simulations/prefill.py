"""The prefill engine (P) model: prefill, export with a lease, serve heartbeats, free once.

P has ``tp`` ranks.  Its scheduler allocates block ids once for all ranks
(as vLLM's does); each rank is one transport agent holding its shard of the
KV in its own memory and drives one `core.producer.ProducerEngine` (its own
stream): the same object the vLLM connector's P worker drives, so every
decision (the lease, what to answer a heartbeat, which leases expired, what
to free, exactly once) is the shipped code's.  What stays here is I/O and
the model of vLLM 0.32's P (`DecodePolicy`): whom it names as a message's
sender, whether it answers heartbeats, the lease it exports.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvhandoff.core.errors import MalformedMessage
from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import FenceSlots
from kvhandoff.core.lifecycle import LifecycleState, PState
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Release, decode, encode
from kvhandoff.core.producer import ProducerEngine
from kvhandoff.simulations import kv
from kvhandoff.simulations.config import RunConfig
from kvhandoff.simulations.loop import EngineLoop
from kvhandoff.simulations.policies import KVHANDOFF, DecodePolicy
from kvhandoff.transports.base import fence_region
from kvhandoff.transports.sim import SendRefused, SimBlockPool, SimNetwork


@dataclass(slots=True)
class SimRequest:
    """One client request as the world tracks it."""

    rid: str
    serial: int
    num_blocks: int
    arrival: float
    malformed: bool = False
    prefix_hit: bool = False
    stage: str = "new"  # new, prefill, proxy, decode, done
    outcome: str = ""  # served, failed, rejected, cancelled, orphaned
    cancelled: bool = False
    cancel_phase: str = ""  # the phase after which this client cancels ("" never)
    num_tokens: int = 0  # hybrid runs: the prompt's tokens (num_blocks: every group's blocks)
    held_groups: tuple[int, ...] = ()  # hybrid runs: groups whose blocks D holds already


@dataclass(slots=True)
class TransferParams:
    """What P hands D through the proxy (vLLM's ``kv_transfer_params``)."""

    request_id: str
    remote_engine: str
    remote_ranks: tuple[int, ...]
    block_ids: list  # hybrid runs: one list per cache group (vLLM's ``remote_block_ids``)
    num_blocks: int
    token: str = ""  # the release capability P minted for this request
    num_tokens: int = 0  # hybrid runs: the tokens P computed, for D's planner
    fence_slot: int | None = None  # the export's fence slot (`core.fence`), None: none


class PrefillEngine:
    def __init__(self, name: str, cfg: RunConfig, net: SimNetwork, rng: random.Random,
                 sink: Callable, on_exported: Callable[[SimRequest, TransferParams], None],
                 policy: DecodePolicy = KVHANDOFF) -> None:
        self.name, self.cfg, self.net = name, cfg, net
        self.clock = net.clock
        self.on_exported = on_exported
        self.policy = policy
        # Who each transport peer is (engine, rank), learned at the handshake
        # (the side channel), never from what a notification claims.
        self.peer_identity: dict[str, tuple[str, int]] = {}
        self.agents = [net.agent(f"{name}.r{r}") for r in range(cfg.tp)]
        self.words: list[np.ndarray] = []  # per rank: (regions, blocks, words) of its memory
        k = cfg.heads_per_p_rank  # head groups per P rank: one per D rank reading it
        names = kv.region_names(cfg.regions, range(k), k)
        fence_slots = cfg.fence_slots if policy.fences else 0
        self.fences: list[np.ndarray] = []  # per rank: its fence slots (`core.fence`)
        for agent in self.agents:
            regions, words = kv.rank_memory(names, cfg.p_blocks, cfg.block_bytes)
            if fence_slots:
                region, slots = fence_region(fence_slots)
                regions.append(region)
                self.fences.append(slots)
            agent.register(regions)
            self.words.append(words)
        # Hybrid models: every group overlaid on these regions, ids from the one pool.
        self.layout = (kv.cache_layout(cfg.groups, names, cfg.p_blocks, cfg.block_bytes)
                       if cfg.hybrid else None)
        # Terminal records are kept: P answers a late heartbeat for a request it
        # released with "released" (0), not "unknown" (< 0).
        self.state = LifecycleState()  # keeps FREED / DONE records: runs are short
        self.streams = [Stream(name, Side.P, r) for r in range(cfg.tp)]
        # The D ranks that read each P rank, and so must each release it.
        self.consumers = [tuple(range(r * k, (r + 1) * k)) for r in range(cfg.tp)]
        # (vLLM extends by 2/3 of the lease; the core extends by the exported
        # lease, so that model exports 2/3 of it: docs/simulation.md.)
        self.engines = [ProducerEngine(s, cfg.lease_s * policy.lease_extension, self.state, sink)
                        for s in self.streams]
        # One slot per live export, the same on every rank (as vLLM's scheduler hands it
        # out), back once every rank freed the request.
        self.fence_slots = FenceSlots(fence_slots)
        self.slot_of: dict[str, list[int]] = {}  # rid -> [slot, ranks that still hold it]
        self.pool = SimBlockPool(self.agents, cfg.p_blocks)
        self.queue: deque[SimRequest] = deque()
        self.prefilling: dict[str, SimRequest] = {}
        self.prefilled: list[SimRequest] = []
        self.aborts: list[str] = []
        # Exports whose parameters went out, for the worker to fold next step
        # (``cfg.export_next_step``): (rid, blocks, token, fence slot).
        self.exporting: list[tuple[str, int, str, int | None]] = []
        self.blocks: dict[str, list[int]] = {}
        self.requests: dict[str, SimRequest] = {}
        self.malformed = 0
        self.rng = rng
        self.loop = EngineLoop(self.clock, rng, self._step, cfg.p_step_s, cfg.step_jitter,
                               cfg.p_stall, cfg.p_stall_s)

    # -- inputs -------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        req.stage = "prefill"
        self.requests[req.rid] = req
        self.queue.append(req)
        self.loop.wake()

    def cancel(self, req: SimRequest) -> None:
        if req in self.queue:
            self.queue.remove(req)  # never started: nothing to log, nothing held
        elif (req.rid in self.prefilling or req in self.prefilled) and req.rid not in self.aborts:
            self.aborts.append(req.rid)
        self.loop.wake()

    def _prefill_done(self, req: SimRequest) -> None:
        if self.prefilling.pop(req.rid, None) is not None:
            self.prefilled.append(req)
            self.loop.wake()

    # -- one scheduler step ------------------------------------------------------

    def _step(self) -> bool:
        now = self.clock.now
        cfg = self.cfg
        for rank, agent in enumerate(self.agents):
            if agent.notifs_waiting:
                for n in agent.recv_notifs():
                    self._on_notification(rank, n.peer, n.message, now)
        exporting, self.exporting = self.exporting, []
        for export in exporting:  # last step's: after what arrived meanwhile
            self._fold_export(*export, now)
        for rid in self.aborts:
            self.prefilling.pop(rid, None)
            self.prefilled = [r for r in self.prefilled if r.rid != rid]
            for rank, engine in enumerate(self.engines):
                engine.aborted(rid, now, reason="client cancelled during prefill")
                self.pool.free(self.blocks[rid], rank)  # the host engine frees an abort itself
        self.aborts.clear()
        for req in self.prefilled:
            ids = self.blocks[req.rid]
            # Only the engine that receives the transfer parameters can release.
            token = f"{self.rng.getrandbits(64):016x}" if self.policy.mint_tokens else ""
            per_group = self._group_lists(req, ids)
            slot = self.fence_slots.take() if token else None
            if slot is not None:
                self.slot_of[req.rid] = [slot, len(self.engines)]
            for rank in range(len(self.engines)):
                if per_group is None:
                    kv.write(self.words[rank], ids, req.serial, rank)
                else:
                    for g, group_ids in zip(self.layout.groups, per_group, strict=True):
                        first = kv.group_positions(g, req.num_tokens).start
                        kv.write(self.words[rank], group_ids, req.serial,
                                 kv.copy_rank(g, rank), g.index, first)
            if cfg.export_next_step:
                self.exporting.append((req.rid, len(ids), token, slot))
                self.loop.wake()
            else:
                self._fold_export(req.rid, len(ids), token, slot, now)
            block_ids = list(ids) if per_group is None else [list(g) for g in per_group]
            self.on_exported(req, TransferParams(req.rid, self.name, tuple(range(cfg.tp)),
                                                 block_ids, len(ids), token, req.num_tokens,
                                                 slot))
        self.prefilled.clear()
        freed = self._reap(now)
        while self.queue:
            ids = self.pool.allocate(self.queue[0].num_blocks)
            if ids is None:
                break
            req = self.queue.popleft()
            self.blocks[req.rid] = ids
            for engine in self.engines:
                engine.prefill_started(req.rid, now)
            self.prefilling[req.rid] = req
            self.clock.call_at(now + cfg.prefill_s_per_block * len(ids), self._prefill_done, req)
        due = math.inf  # the first lease that may run out
        for engine in self.engines:
            at = engine.due_at
            if at < due:
                due = at
        if due < math.inf:
            self.loop.wake_at(due)
        return bool(freed and self.queue)

    def _fold_export(self, rid: str, n: int, token: str, slot: int | None, now: float) -> None:
        """Every rank's worker takes the export.  One lease, one free for every group of the
        request (vLLM delays the free of all groups at once: docs/hybrid.md 1.5)."""
        for rank, engine in enumerate(self.engines):
            engine.exported(rid, now, n, self.consumers[rank], token, fence_slot=slot)

    def _group_lists(self, req: SimRequest, ids: list[int]) -> list[list[int]] | None:
        """A hybrid request's block ids, one list per group: what P holds of each group,
        clipped to what D will read (the window's blocks, the state slot), as NixlConnector
        clips its exchanged lists (docs/hybrid.md 1.6); None for a one-group run."""
        if self.layout is None:
            return None
        out, at = [], 0
        for g in self.layout.groups:
            n = len(kv.group_positions(g, req.num_tokens))
            out.append(ids[at:at + n])
            at += n
        assert at == len(ids), f"{req.rid}: {len(ids)} blocks allocated, groups hold {at}"
        return out

    def add_consumer(self, agent: str, engine: str, rank: int) -> None:
        """The handshake told us that transport peer ``agent`` is ``engine``'s rank ``rank``."""
        self.peer_identity[agent] = (engine, rank)

    def _sender(self, rank: int, peer: str,
                msg: Release | Heartbeat) -> tuple[Release | Heartbeat, str]:
        """``msg`` as its sender is vouched for, and who that is: the transport peer (engine
        and rank from the handshake), or (vLLM) nobody in particular.

        vLLM counts every ``"<req_id>:<N>"`` notification with no sender check
        and no per-rank dedupe: the model names every sender alike and gives
        each release the next consumer rank P still waits for.
        """
        if self.policy.checks_sender:  # the handshake vouches for engine and rank
            engine, rank = self.peer_identity.get(peer, (f"unknown:{peer}", -1))
            if isinstance(msg, Release):
                msg = Release(msg.request_id, msg.engine, rank, msg.token)
            return msg, engine
        if isinstance(msg, Release):
            rec = self.state.record(self.streams[rank], msg.request_id)
            waiting = [r for r in getattr(rec, "expected", ()) if r not in rec.notified]
            msg = Release(msg.request_id, msg.engine, waiting[0] if waiting else 0, msg.token)
        return msg, "any"

    def _on_notification(self, rank: int, peer: str, message: bytes, now: float) -> None:
        try:
            msg = decode(message)
        except MalformedMessage:
            self.malformed += 1
            return
        if isinstance(msg, HeartbeatAck):
            self.malformed += 1  # P never expects an acknowledgement
            return
        msg, sender = self._sender(rank, peer, msg)
        step = self.engines[rank].on_notification(sender, msg, now)
        if self.policy.acknowledges:
            for _, ack in step.acks:
                try:
                    self.agents[rank].send_notif(peer, encode(ack))
                except SendRefused:
                    pass  # lost, as P's worker logs it: D asks again

    def _reap(self, now: float) -> int:
        freed = 0
        for rank, engine in enumerate(self.engines):
            step = engine.poll(now)
            for slot, value in step.fences:  # before any free: a cleared slot proves nothing
                self.fences[rank][slot] = value
            for rid in step.freed:
                self.pool.free(self.blocks[rid], rank)
                freed += 1
                held = self.slot_of.get(rid)
                if held is not None:
                    held[1] -= 1
                    if not held[1]:  # cleared on every rank: the slot may go to another export
                        self.fence_slots.give_back(held[0])
                        del self.slot_of[rid]
        return freed

    # -- end of run -----------------------------------------------------------------

    def unfinished(self) -> list[str]:
        """Requests this engine has not freed (on any rank)."""
        out = []
        for ss in (self.state.stream(s) for s in self.streams):
            out.extend(f"{ss.stream}:{rid}" for rid, rec in ss.requests.items()
                       if rec.state is not PState.FREED)
        return out

"""The simulated decode engine (D): a driver of one `ConsumerEngine` per rank.

D has ``tp`` worker ranks; rank d READs P rank d // k (rank-local reads, k
D ranks per P rank), and each rank is one `core.consumer.ConsumerEngine`,
the very object the vLLM connector's D worker drives: every lifecycle
decision (single-use parameters, what to heartbeat and when, when to give up
on a READ or on P's word, when to report, what to release) is that engine's.
This module is I/O: it hands the engines what happened on the simulated
fabric and carries out what they return, and it models what vLLM's
scheduler does around them (D's pages, one outcome per request once every
rank reported, as vLLM's output aggregator does).

A hybrid model's request (``RunConfig.groups``) is one split per (rank,
cache group) that needs a read: `plan_group_reads` decides which groups read
what (every block of full attention, the window's blocks of a sliding
window, the state slot), and a request where no group needs a read is a
notify-only release.  D runs HiSparse where a group is in its host pool
(`SimGroup.host_pool`); with the pool shared by its ranks
(``RunConfig.shared_host_pool``) rank 0 alone reads it, so the other ranks
post fewer splits and report (and release their P rank) without waiting for it.

The model of vLLM 0.32 (``DecodePolicy``) is driver choices on top of the
same engines: it drops cancelled requests from the heartbeats it sends
(``stop_heartbeat_on_cancel``), reports READs as soon as they drained
without P's word (``acknowledges`` off, ``serve_unconfirmed``), and lets
each READ carry its rank's release (``release_with_reads``).  Every answer P
gives is also noted in a `ProofLedger` apart from the fold, so what D serves
is checked against P's answers rather than against the core's own verdict.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvhandoff.core.consumer import ConsumerEngine, ConsumerStep, Finished
from kvhandoff.core.errors import GeometryMismatch, MalformedMessage
from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import LANDING_SLOTS, fence_of
from kvhandoff.core.lifecycle import DState, LifecycleState
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Release, decode, encode
from kvhandoff.core.planning import (
    GroupRead,
    blocks_needed,
    coalesce,
    plan_group_reads,
    validate_block_ids,
)
from kvhandoff.core.replay import ProofLedger
from kvhandoff.simulations import kv
from kvhandoff.simulations.config import RunConfig
from kvhandoff.simulations.loop import EngineLoop
from kvhandoff.simulations.policies import DecodePolicy
from kvhandoff.simulations.prefill import SimRequest, TransferParams
from kvhandoff.transports.base import FenceReader, ReadRequest, TransportError, group_splits
from kvhandoff.transports.sim import SendRefused, SimBlockPool, SimNetwork


@dataclass(slots=True)
class Import:
    """D's working data for one request (the lifecycle lives in the ranks' folds)."""

    req: SimRequest
    params: TransferParams
    remote_ids: tuple[int, ...] = ()
    local_ids: list[int] | None = None
    failed_ranks: set[int] = field(default_factory=set)  # D ranks with a failed split
    # Hybrid runs: P's ids per group, D's pages per group, and each split's planned read.
    remote_lists: list[list[int]] = field(default_factory=list)
    group_pages: list[int] = field(default_factory=list)
    reads: list[tuple[int, GroupRead]] = field(default_factory=list)  # (D rank, read)
    rank_open: dict[int, int] = field(default_factory=dict)  # D rank -> READs in flight
    # D rank -> READs posted whose completion the driver has not seen yet (`handles`)
    unlanded: dict[int, int] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)  # D rank -> its report
    unproven: bool = False  # a rank reported ok what P's answers by then did not prove


class DecodeEngine:
    def __init__(self, name: str, cfg: RunConfig, net: SimNetwork, rng: random.Random,
                 sink: Callable, policy: DecodePolicy, p_name: str, p_num_blocks: int,
                 on_phase: Callable[[SimRequest, str], None],
                 on_done: Callable[[SimRequest, str], None]) -> None:
        self.name, self.cfg, self.net, self.policy = name, cfg, net, policy
        self.clock = net.clock
        self.p_name, self.p_num_blocks = p_name, p_num_blocks
        self.on_phase, self.on_done = on_phase, on_done
        k = self.k = cfg.heads_per_p_rank
        self.agents = [net.agent(f"{name}.r{d}") for d in range(cfg.decode_tp)]
        self.p_peers = [f"{p_name}.r{r}" for r in range(cfg.tp)]
        self.peers = [self.p_peers[d // k] for d in range(cfg.decode_tp)]  # whom rank d reads
        # Which of P's regions rank d's regions are (its head group of every layer).
        self.rows = [[layer * k + d % k for layer in range(cfg.regions)]
                     for d in range(cfg.decode_tp)]
        self.words: list[np.ndarray] = []  # per rank: (regions, blocks, words) of its memory
        # Hybrid models: per D rank, its layout and its view of P's (P's pool size;
        # the region pairs a read posts are the local group's, as P names them too).
        self.layouts: list | None = [] if cfg.hybrid else None
        self.remote_layouts: list = []
        # The fence (`core.fence`): P's slots, and per rank the landing slots free for the
        # fence READs it posts (one per request whose READs drained, until it lands).
        self.fences = policy.fences
        self.fence_readers: list[FenceReader] = []
        self.fences_landed = 0  # fence READs that completed (each moved FENCE_BYTES)
        for d, agent in enumerate(self.agents):
            names = kv.region_names(cfg.regions, [d % k], k)
            regions, words = kv.rank_memory(names, cfg.d_blocks, cfg.block_bytes)
            if self.fences:
                self.fence_readers.append(FenceReader(LANDING_SLOTS))
                regions.append(self.fence_readers[d].region)
            agent.register(regions)
            self.words.append(words)
            if self.layouts is not None:
                self.layouts.append(kv.cache_layout(cfg.groups, names, cfg.d_blocks,
                                                    cfg.block_bytes, hisparse=True,
                                                    shared_host_pool=cfg.shared_host_pool))
                self.remote_layouts.append(kv.cache_layout(cfg.groups, names, p_num_blocks,
                                                           cfg.block_bytes))
        self.state = LifecycleState()  # keeps DONE records: runs are short
        self.streams = [Stream(name, Side.D, d) for d in range(cfg.decode_tp)]
        # vLLM 0.32's D never gives up on a READ, nor waits for P's word (`report_now`).
        timing = cfg.timing if policy.acknowledges else replace(cfg.timing,
                                                                read_timeout_s=math.inf)
        self.engines = [ConsumerEngine(stream, timing, self.state, sink)
                        for stream in self.streams]
        self.pool = SimBlockPool(self.agents, cfg.d_blocks, source=False)
        self.inbox: list[tuple[SimRequest, TransferParams]] = []
        self.cancels: list[SimRequest] = []
        self.waiting: dict[str, Import] = {}  # validated, waiting for pages
        self.reading: dict[str, Import] = {}  # READs posted, not every rank reported
        self.handles: dict[tuple[int, int], tuple[str, int]] = {}  # (rank, handle) -> split
        self.tokens: dict[str, str] = {}  # each request's release token, from its params
        # When a heartbeat naming each (request, P rank) last left, whatever became
        # of it: what the measured heartbeat check (World.check_heartbeats) reads.
        self.last_beat: dict[tuple[str, int], float] = {}
        self.served = self.served_corrupt = self.served_unproven = self.malformed = 0
        # What P's answers prove, apart from the core's verdict (the effect check).
        self.proofs = ProofLedger()
        self.loop = EngineLoop(self.clock, rng, self._step, cfg.d_step_s, cfg.step_jitter,
                               cfg.stall, cfg.stall_s)

    # -- inputs -------------------------------------------------------------

    def submit(self, req: SimRequest, params: TransferParams) -> None:
        req.stage = "decode"
        self.inbox.append((req, params))
        self.loop.wake()

    def cancel(self, req: SimRequest) -> None:
        self.cancels.append(req)
        self.loop.wake()

    # -- one scheduler step ------------------------------------------------------

    def _step(self) -> bool:
        now = self.clock.now
        agents = self.agents
        # Most steps find no notification or completion on most ranks: skip the
        # calls then (a crashed agent still goes through them, and raises).
        for d, agent in enumerate(agents):
            if agent.notifs_waiting:
                for n in agent.recv_notifs():
                    self._on_notification(d, n.peer, n.message, now)
        for d, agent in enumerate(agents):
            if not agent.completions_waiting:
                continue
            for c in agent.poll():
                fence = self.fence_readers[d].landed(c) if self.fences else None
                if fence is not None:
                    self._fence_landed(d, *fence, now)
                    continue
                rid, split = self.handles.pop((d, c.handle))
                self.engines[d].split_done(rid, split, now, c.ok, c.reason)
                imp = self.reading.get(rid)
                if imp is not None:
                    imp.unlanded[d] -= 1
                if not c.ok:
                    self.reading[rid].failed_ranks.add(d)
                if self.layouts is not None:
                    self._group_read_landed(rid, d)
        if self.cancels:
            for req in self.cancels:
                self._cancel(req, now)
            self.cancels.clear()
        if self.inbox:
            for req, params in self.inbox:
                self._admit(req, params, now)
            self.inbox.clear()
        if self.waiting:
            self._post_reads(now)
        free_before = self.pool.free_blocks
        engines = self.engines
        # vLLM 0.32 serves what drained, unproven
        report_now = not self.policy.acknowledges and bool(self.reading)
        for d, engine in enumerate(engines):
            self._carry_out(d, engine.poll(now), now)
            if report_now:
                # ``report_now`` reports only what drained, and a rank reports a request
                # once: asking while a READ of the rank is in flight, or after it reported,
                # decides nothing.
                for rid, imp in list(self.reading.items()):
                    if d not in imp.finished and not imp.unlanded.get(d):
                        self._carry_out(d, engine.report_now(rid, now), now)
        due = math.inf
        for engine in engines:
            at = engine.due_at
            if at < due:
                due = at
        if due < math.inf:
            self.loop.wake_at(max(due, now + self.cfg.d_step_s))
        # Pages freed by drained imports may let waiting ones post: step again.
        return bool(self.waiting) and self.pool.free_blocks > free_before

    def _on_notification(self, d: int, peer: str, message: bytes, now: float) -> None:
        try:
            msg = decode(message)
        except MalformedMessage:
            self.malformed += 1
            return
        if not isinstance(msg, HeartbeatAck):
            self.malformed += 1  # D expects nothing else from P
            return
        self.engines[d].on_notification(peer, msg, now)
        if peer != self.peers[d]:
            return  # proves nothing: only the P rank a request reads may vouch for it
        for rid, left in msg.time_left.items():
            rec = self.state.record(self.streams[d], rid)
            if rec is not None and rec.t0 <= msg.sent_at <= rec.last_heartbeat:
                self.proofs.note((d, rid, msg.rank), msg.sent_at, left, rec.lease_s, rec.margin)

    def _fence_landed(self, d: int, rid: str, slot: int, value: int | None, posted_at: float,
                      now: float) -> None:
        """Rank ``d``'s fence READ (planned at ``posted_at``) completed: what it found goes
        to the engine, and (checked apart from the fold, as P's answers are) into the
        proofs when it is the request's."""
        self.fences_landed += value is not None
        imp = self.reading.get(rid)
        expected = fence_of(rid, self.tokens.get(rid, ""),
                            imp.params.fence_slot if imp is not None else None)
        if expected is not None and value == expected[1] and slot == expected[0]:
            self.proofs.fence((d, rid, d // self.k), posted_at)
        self.engines[d].fence_read(rid, value, now, posted_at)

    def _post_fence(self, d: int, rid: str, peer: str, slot: int, planned: float,
                    now: float) -> None:
        """Post the fence READ rank ``d``'s engine planned; one that cannot be posted proves
        nothing (the engine asks P instead)."""
        try:
            posted = self.fence_readers[d].post(self.agents[d], peer, rid, slot, planned)
        except TransportError:
            posted = False
        if not posted:
            self.engines[d].fence_read(rid, None, now, planned)

    def _carry_out(self, d: int, step: ConsumerStep, now: float) -> None:
        """Send what rank ``d``'s engine decided; conclude requests every rank reported."""
        if not step:
            return  # most polls decide nothing
        for rid, peer, _rank, slot, planned in step.fences:
            self._post_fence(d, rid, peer, slot, planned, now)
        agent = self.agents[d]
        for peer, hb, urgent in step.heartbeats:
            if self.policy.stop_heartbeat_on_cancel:  # vLLM: a cancel ends the heartbeat
                requests = self.state.stream(self.streams[d]).requests
                ids = tuple(rid for rid in hb.request_ids if not requests[rid].cancelled)
                hb = Heartbeat(hb.engine, hb.rank, hb.sent_at, ids,
                               tuple(self.tokens.get(rid, "") for rid in ids) if hb.tokens else ())
            if hb.request_ids:
                try:
                    agent.send_notif(peer, encode(hb))
                except SendRefused:
                    continue  # not recorded: the engine plans it again (as the worker does)
                for rid in hb.request_ids:
                    self.last_beat[(rid, d // self.k)] = now
            self.engines[d].heartbeat_sent(peer, hb, now, urgent)
        reported = {f.request_id for f in step.finished}
        for peer, release in step.releases:
            imp = self.reading.get(release.request_id)
            if (self.policy.release_with_reads and release.request_id in reported
                    and imp is not None and d not in imp.failed_ranks):
                continue  # vLLM: the rank's READs carried it
            try:
                agent.send_notif(peer, encode(release))
            except SendRefused:  # the engine plans it again (as the worker tells it)
                self.engines[d].release_unsent(peer, release, now)
        for f in step.finished:
            imp = self.reading.get(f.request_id)
            if imp is not None:
                imp.finished[d] = f
                # Checked as the rank reports: a later answer ("released") proves less.
                rec = self.state.record(self.streams[d], f.request_id)
                imp.unproven |= bool(self.proofs.unproven(
                    lambda r, d=d, rid=f.request_id: (d, rid, r), rec))
                if len(imp.finished) == len(self.engines):
                    self._conclude(f.request_id, imp)

    def _each(self, call: str, rid: str, now: float, *args: str) -> None:
        """Every rank's engine hears the same input (admission-time decisions of the scheduler)."""
        for d, engine in enumerate(self.engines):
            self._carry_out(d, getattr(engine, call)(rid, now, *args), now)

    def _cancel(self, req: SimRequest, now: float) -> None:
        rec = self.state.record(self.streams[0], req.rid)
        if rec is None:  # not admitted yet: `_admit` sees ``req.cancelled`` and releases
            return
        self._each("cancel", req.rid, now)
        if self.state.record(self.streams[0], req.rid).state is DState.DONE and (
                self.waiting.pop(req.rid, None) is not None):
            self.on_done(req, "cancelled")  # nothing was posted: released at once
        # CANCELLED_READING: the reads own P's blocks and our pages until they drain.

    def _end_without_reads(self, req: SimRequest, rid: str, call: str, outcome: str,
                           now: float, *reason: str) -> None:
        self._each(call, rid, now, *reason)
        self.on_done(req, outcome)

    def _admit(self, req: SimRequest, params: TransferParams, now: float) -> None:
        cfg = self.cfg
        rid = params.request_id
        try:
            for engine in self.engines:
                engine.check_unused(rid, params.remote_engine)
        except MalformedMessage:
            # The same parameters again (a client retry): P's blocks were, or are
            # being, released on the first admission's account; never read them twice.
            self.on_done(req, "failed")
            return
        self.tokens[rid] = params.token
        for d, engine in enumerate(self.engines):
            engine.admit(rid, now, peer=self.peers[d], remote_engine=params.remote_engine,
                         remote_ranks=(d // self.k,), num_blocks=params.num_blocks,
                         lease_s=cfg.lease_s, token=params.token, local_id=f"local-{req.serial}",
                         fence_slot=params.fence_slot if self.fences else None,
                         fence_slots=cfg.fence_slots)
        if req.cancelled:  # cancelled before this step admitted it: release P at once
            self._end_without_reads(req, rid, "cancel", "cancelled", now)
            return
        self.on_phase(req, "admitted")
        if self.layouts is not None:
            self._admit_groups(req, params, now)
            return
        try:
            ids = validate_block_ids(params.block_ids, self.p_num_blocks, "remote_block_ids")
            if len(ids) != params.num_blocks:
                raise GeometryMismatch("number of remote blocks", params.num_blocks, len(ids))
            if params.remote_ranks != tuple(range(cfg.tp)):
                raise GeometryMismatch("remote TP ranks", tuple(range(cfg.tp)), params.remote_ranks)
            if len(ids) > self.pool.num_blocks:  # it would wait for pages forever
                raise GeometryMismatch("pages needed", f"<= {self.pool.num_blocks}", len(ids))
        except GeometryMismatch as e:
            self._end_without_reads(req, rid, "rejected", "rejected", now, str(e))
            return
        for engine in self.engines:
            engine.validated(rid, now)
        if req.prefix_hit:  # D already holds all of it: nothing to read
            self._end_without_reads(req, rid, "nothing_to_read", "served", now)
            return
        self.waiting[rid] = Import(req, params, ids)

    def _admit_groups(self, req: SimRequest, params: TransferParams, now: float) -> None:
        """Admission of a hybrid request: what each group reads, or a notify-only release."""
        rid = params.request_id
        try:
            pages = self._check_groups(req, params)
        except GeometryMismatch as e:
            self._end_without_reads(req, rid, "rejected", "rejected", now, str(e))
            return
        for engine in self.engines:
            engine.validated(rid, now)
        if not any(pages):  # D holds every group already: nothing to read
            self._end_without_reads(req, rid, "nothing_to_read", "served", now)
            return
        self.waiting[rid] = Import(req, params, remote_lists=[list(x) for x in params.block_ids],
                                   group_pages=pages)

    def _check_groups(self, req: SimRequest, params: TransferParams) -> list[int]:
        """D's pages per group (none for a group it holds); the request's ids checked by a
        dry run of the plan (`GroupMismatch`, a `GeometryMismatch`, names the group)."""
        cfg, local = self.cfg, self.layouts[0]
        lists = params.block_ids
        if not isinstance(lists, list) or len(lists) != len(local.groups):
            raise GeometryMismatch("remote block id lists", len(local.groups),
                                   len(lists) if isinstance(lists, list) else lists)
        if params.remote_ranks != tuple(range(cfg.tp)):
            raise GeometryMismatch("remote TP ranks", tuple(range(cfg.tp)), params.remote_ranks)
        if sum(len(x) for x in lists) != params.num_blocks:
            raise GeometryMismatch("number of remote blocks", params.num_blocks,
                                   sum(len(x) for x in lists))
        pages = [0 if g.index in req.held_groups else blocks_needed(g, params.num_tokens)
                 for g in local.groups]
        if sum(pages) > self.pool.num_blocks:  # it would wait for pages forever
            raise GeometryMismatch("pages needed", f"<= {self.pool.num_blocks}", sum(pages))
        plan_group_reads(self.remote_layouts[0], local, lists, _split(range(sum(pages)), pages),
                         params.num_tokens)
        return pages

    def _post(self, d: int, rid: str, imp: Import, split: int, now: float, *args) -> None:
        """Post one READ of rank ``d`` (``post_split_read`` with the request's splits, or
        ``post_read`` with a READ and its notification); one the fabric refuses drains at
        once, failed."""
        agent = self.agents[d]
        try:
            handle = (agent.post_split_read if isinstance(args[0], list) else agent.post_read)(
                self.peers[d], *args)
        except TransportError as e:
            imp.failed_ranks.add(d)
            self.engines[d].split_done(rid, split, now, ok=False, reason=f"post: {e}")
        else:
            self.handles[(d, handle)] = (rid, split)
            imp.rank_open[d] = imp.rank_open.get(d, 0) + 1
            imp.unlanded[d] = imp.unlanded.get(d, 0) + 1

    def _post_group_reads(self, rid: str, imp: Import, local: list[int], now: float) -> None:
        """One READ per (D rank, group that needs a read), as `plan_group_reads` plans it
        for rank ``d`` (``local_rank``: a host pool shared by D's ranks is rank 0's to read,
        so another rank posts no split for its groups)."""
        cfg, k = self.cfg, self.k
        lists = _split(local, imp.group_pages)
        default = self.net.read_faults
        for d in range(len(self.agents)):
            plan = plan_group_reads(self.remote_layouts[d], self.layouts[d], imp.remote_lists,
                                    lists, imp.params.num_tokens, rank=d // k, local_rank=d)
            if plan.notify_only:  # rank 0 reads the shared pool, D holds this rank's rest
                self.engines[d].nothing_posted(rid, now, d // k)
                imp.rank_open[d] = 1
                self._group_read_landed(rid, d)
                continue
            imp.reads.extend((d, read) for read in plan.reads)
            self.engines[d].reads_posted(rid, now, tuple(read.rank for read in plan.reads),
                                         tuple(read.group for read in plan.reads))
            for split, read in enumerate(plan.reads):
                # A group's READs may be slower than others' (a state group's): the
                # fabric draws each READ's faults when it is posted.
                self.net.read_faults = cfg.groups[read.group].read_faults or default
                try:
                    self._post(d, rid, imp, split, now, group_splits([read]))
                finally:
                    self.net.read_faults = default

    def _group_read_landed(self, rid: str, d: int) -> None:
        """vLLM 0.32 reads every group of a rank in one transfer, whose notification (the
        rank's release) follows its last descriptor: the model, one READ per group, sends
        it when the rank's last group READ landed, unless one of them failed."""
        imp = self.reading[rid]
        imp.rank_open[d] -= 1
        if imp.rank_open[d] or not self.policy.release_with_reads:
            return
        if d not in imp.failed_ranks:
            try:
                self.agents[d].send_notif(self.peers[d], encode(
                    Release(rid, self.name, d, self.tokens.get(rid, ""))))
            except SendRefused:
                pass  # lost: P's lease runs out (vLLM's rides on the READ and cannot be
                # refused; no scenario refuses releases with this model's hybrid layouts)

    def _post_reads(self, now: float) -> None:
        posted = []
        for rid, imp in self.waiting.items():
            local = self.pool.allocate(sum(imp.group_pages) if imp.group_pages
                                       else len(imp.remote_ids))
            if local is None:
                break  # pages free up as other imports drain
            imp.local_ids = local
            posted.append(rid)
            self.reading[rid] = imp
            if imp.group_pages:
                self._post_group_reads(rid, imp, local, now)
                self.on_phase(imp.req, "reads_posted")
                continue
            # Rank d's one READ, from P rank d // k.
            read = ReadRequest(runs=coalesce(imp.remote_ids, local))
            for d in range(len(self.agents)):
                self.engines[d].reads_posted(rid, now, (d // self.k,))
                # kvhandoff releases after finished_recving; vLLM's READ carries it.
                release = (encode(Release(rid, self.name, d, imp.params.token))
                           if self.policy.release_with_reads else None)
                self._post(d, rid, imp, 0, now, read, release)
            self.on_phase(imp.req, "reads_posted")
        for rid in posted:
            del self.waiting[rid]

    def _conclude(self, rid: str, imp: Import) -> None:
        """Every rank reported: the request's outcome, as vLLM's scheduler sees it."""
        del self.reading[rid]
        req = imp.req
        cancelled = req.cancelled or any(
            self.state.record(s, rid).cancelled for s in self.streams)
        if all(f.ok for f in imp.finished.values()):
            serve = not cancelled
        else:
            serve = self.policy.serve_unconfirmed and not cancelled and not imp.failed_ranks
        if serve:
            self.served += 1
            if not self._bytes_match(imp):
                self.served_corrupt += 1
            if imp.unproven:
                self.served_unproven += 1
        outcome = "served" if serve else ("cancelled" if cancelled else "failed")
        for d in range(len(self.agents)):
            self.pool.free(imp.local_ids, d)
        self.on_done(req, outcome)

    def _bytes_match(self, imp: Import) -> bool:
        serial = imp.req.serial
        k = self.k
        if imp.reads:  # hybrid: each group's blocks from the positions that group holds
            n = imp.params.num_tokens
            groups = self.layouts[0].groups
            return all(kv.matches(self.words[d], read.local_ids, serial,
                                  kv.copy_rank(groups[read.group], d // k),
                                  None if k == 1 else self.rows[d], read.group,
                                  kv.group_positions(groups[read.group], n).start)
                       for d, read in imp.reads)
        return all(kv.matches(words, imp.local_ids, serial, d // k,
                              None if k == 1 else self.rows[d])
                   for d, words in enumerate(self.words))

    # -- end of run -----------------------------------------------------------------

    def unfinished(self) -> list[str]:
        return [f"{stream}:{rid}" for stream in self.streams
                for rid, rec in self.state.stream(stream).requests.items()
                if rec.state is not DState.DONE]

    @property
    def refused_events(self) -> int:
        return sum(engine.counts["refused_events"] for engine in self.engines)


def _split(ids, sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into consecutive lists of ``sizes`` (a request's pages, one list per group)."""
    out, at = [], 0
    for n in sizes:
        out.append(list(ids[at:at + n]))
        at += n
    return out

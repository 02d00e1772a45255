"""The decode engine (D) model: admit, validate, read, heartbeat, verify, release.

D has ``tp`` worker ranks; rank r READs rank r of P (rank-local reads), so a
request is ``tp`` READ splits.  A hybrid model's request (``RunConfig.groups``)
is one split per (rank, cache group) that needs a read: `plan_group_reads`
decides which groups read what (every block of full attention, the window's
blocks of a sliding window, the state slot), and a request where no group
needs a read is a notify-only release.  The scheduler keeps one `Ledger` stream for
the whole request; the workers post the READs and poll their completions.
Every decision comes from the core: what to heartbeat (`heartbeat_due`),
whether drained reads may be passed on (`read_verdict_of`), what the
lifecycle allows next (the fold refuses anything else).

D heartbeats a request as soon as it is admitted, not only every
``heartbeat_s``: P's answer is what proves the source alive when the reads
complete, and a request that waits a whole heartbeat period for it is slow.
When reads drain with the verdict still PENDING, D asks again at once.

D releases a request only after ``finished_recving`` (every split drained),
to every P rank at once; only the vLLM 0.32 model lets each READ carry its
rank's release (``DecodePolicy.release_with_reads``).  Every answer P gives
is also noted in a `ProofLedger` apart from the fold, so what D serves is
checked against P's answers rather than against the core's own verdict.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvhandoff.core.errors import GeometryMismatch, MalformedMessage
from kvhandoff.core.events import (
    Admitted,
    ClientCancelled,
    FinishedRecving,
    HeartbeatSent,
    LeaseAcknowledged,
    ReadsPosted,
    Rejected,
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
    Verdict,
    read_verdict_of,
)
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Release, decode, encode
from kvhandoff.core.planning import (
    GroupRead,
    blocks_needed,
    coalesce,
    plan_group_reads,
    validate_block_ids,
)
from kvhandoff.core.policy import heartbeat_due, heartbeat_period
from kvhandoff.core.replay import ProofLedger
from kvhandoff.simulations import kv
from kvhandoff.simulations.config import RunConfig
from kvhandoff.simulations.loop import EngineLoop
from kvhandoff.simulations.policies import DecodePolicy
from kvhandoff.simulations.prefill import SimRequest, TransferParams
from kvhandoff.transports.base import ReadRequest, TransportError, group_splits
from kvhandoff.transports.sim import SimBlockPool, SimNetwork


@dataclass(slots=True)
class Import:
    """D's working data for one request (the lifecycle itself lives in the fold)."""

    req: SimRequest
    params: TransferParams
    remote_ids: tuple[int, ...] = ()
    local_ids: list[int] | None = None
    drained_at: float | None = None
    asked_at: float = -1.0
    splits_failed: list[int] = field(default_factory=list)
    split_dranks: list[int] = field(default_factory=list)  # per split: the D rank posting it
    # Hybrid runs: P's ids per group, D's pages per group, and each split's planned read.
    remote_lists: list[list[int]] = field(default_factory=list)
    group_pages: list[int] = field(default_factory=list)
    reads: list[tuple[int, GroupRead]] = field(default_factory=list)  # (D rank, read)
    rank_open: dict[int, int] = field(default_factory=dict)  # D rank -> READs in flight


def _stale(rec: ConsumerRecord, before: float) -> bool:
    """Whether some P rank's last proof of the lease runs out before ``before``."""
    proofs = rec.safe_until
    return len(proofs) < len(rec.remote_ranks) or min(proofs.values()) < before


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
        for d, agent in enumerate(self.agents):
            names = kv.region_names(cfg.regions, [d % k], k)
            regions, words = kv.rank_memory(names, cfg.d_blocks, cfg.block_bytes)
            agent.register(regions)
            self.words.append(words)
            if self.layouts is not None:
                self.layouts.append(kv.cache_layout(cfg.groups, names, cfg.d_blocks,
                                                    cfg.block_bytes))
                self.remote_layouts.append(kv.cache_layout(cfg.groups, names, p_num_blocks,
                                                           cfg.block_bytes))
        self.state = LifecycleState()  # keeps FREED / DONE records: runs are short
        self.stream = Stream(name, Side.D, 0)
        self.ledger = Ledger(self.stream, self.state, sink)
        self.pool = SimBlockPool(self.agents, cfg.d_blocks, source=False)
        self.inbox: list[tuple[SimRequest, TransferParams]] = []
        self.cancels: list[SimRequest] = []
        self.waiting: dict[str, Import] = {}  # validated, waiting for pages
        self.reading: dict[str, Import] = {}
        self.handles: dict[tuple[int, int], tuple[str, int]] = {}
        self.urgent: dict[str, None] = {}  # heartbeat at the end of this step
        self.tokens: dict[str, str] = {}  # each request's release token, from its params
        self.next_heartbeat = 0.0
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
        record = self.ledger.record
        for agent in self.agents:
            for n in agent.recv_notifs():
                self._on_notification(n.message, now)
        for rank, agent in enumerate(self.agents):
            for c in agent.poll():
                rid, split = self.handles.pop((rank, c.handle))
                if c.ok:
                    record(SplitCompleted, rid, now, split=split)
                else:
                    record(SplitFailed, rid, now, split=split, reason=c.reason)
                    self.reading[rid].splits_failed.append(split)
                if self.layouts is not None:
                    self._group_read_landed(rid, rank)
        lost = ({p for agent in self.agents for p in agent.lost_peers()}
                if self.net.has_dead else ())
        for req in self.cancels:
            self._cancel(req, now)
        self.cancels.clear()
        for req, params in self.inbox:
            self._admit(req, params, now)
        self.inbox.clear()
        self._post_reads(now)
        free_before = self.pool.free_blocks
        self._report(now, lost)
        self._heartbeat(now)
        # Pages freed by drained imports may let waiting ones post: step again.
        return bool(self.waiting) and self.pool.free_blocks > free_before

    def _on_notification(self, message: bytes, now: float) -> None:
        try:
            msg = decode(message)
        except MalformedMessage:
            self.malformed += 1
            return
        if not isinstance(msg, HeartbeatAck):
            self.malformed += 1  # D expects nothing else from P
            return
        for rid, left in msg.time_left.items():
            self.ledger.record(LeaseAcknowledged, rid, now, p_rank=msg.rank,
                               sent_at=msg.sent_at, time_left=left)
            rec = self.state.record(self.stream, rid)
            if rec is not None and msg.sent_at <= rec.last_heartbeat:
                self.proofs.note((rid, msg.rank), msg.sent_at, left, rec.lease_s, rec.margin)

    def _release(self, rid: str, ranks) -> None:
        token = self.tokens.get(rid, "")
        for rank in ranks:
            self.agents[rank].send_notif(self.peers[rank],
                                         encode(Release(rid, self.name, rank, token)))

    def _finish_without_reads(self, imp_req: SimRequest, rid: str, outcome: str, now: float) -> None:
        self.ledger.record(ReleaseSent, rid, now, notify_only=True)
        self._release(rid, range(self.cfg.decode_tp))
        self.on_done(imp_req, outcome)

    def _cancel(self, req: SimRequest, now: float) -> None:
        rec = self.state.record(self.stream, req.rid)
        if rec is None:  # not admitted yet: `_admit` sees ``req.cancelled`` and releases
            return
        self.ledger.record(ClientCancelled, req.rid, now)
        if rec.state is DState.CANCELLED:  # nothing was posted: release at once
            self.waiting.pop(req.rid, None)
            self._finish_without_reads(req, req.rid, "cancelled", now)
        # CANCELLED_READING: the reads own P's blocks and our pages until they drain.

    def _admit(self, req: SimRequest, params: TransferParams, now: float) -> None:
        cfg = self.cfg
        rid = params.request_id
        if self.state.record(self.stream, rid) is not None:
            # The same parameters again (a client retry): P's blocks were, or are
            # being, released on the first admission's account; never read them twice.
            self.on_done(req, "failed")
            return
        self.tokens[rid] = params.token
        self.ledger.record(Admitted, rid, now, remote_engine=params.remote_engine,
                           remote_ranks=tuple(range(cfg.tp)), num_blocks=params.num_blocks,
                           lease_s=cfg.lease_s, lease_margin_s=cfg.margin_s,
                           local_request_id=f"local-{req.serial}")
        if req.cancelled:  # cancelled before this step admitted it: release P at once
            self.ledger.record(ClientCancelled, rid, now)
            self._finish_without_reads(req, rid, "cancelled", now)
            return
        self.on_phase(req, "admitted")
        self.urgent[rid] = None
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
            self.ledger.record(Rejected, rid, now, reason=str(e))
            self._finish_without_reads(req, rid, "rejected", now)
            return
        self.ledger.record(Validated, rid, now)
        if req.prefix_hit:  # D already holds all of it: nothing to read
            self._finish_without_reads(req, rid, "served", now)
            return
        self.waiting[rid] = Import(req, params, ids)

    def _admit_groups(self, req: SimRequest, params: TransferParams, now: float) -> None:
        """Admission of a hybrid request: what each group reads, or a notify-only release."""
        rid = params.request_id
        try:
            pages = self._check_groups(req, params)
        except GeometryMismatch as e:
            self.ledger.record(Rejected, rid, now, reason=str(e))
            self._finish_without_reads(req, rid, "rejected", now)
            return
        self.ledger.record(Validated, rid, now)
        if not any(pages):  # D holds every group already: nothing to read
            self._finish_without_reads(req, rid, "served", now)
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

    def _post_group_reads(self, rid: str, imp: Import, local: list[int], now: float) -> None:
        """One READ per (D rank, group that needs a read), as `plan_group_reads` plans it."""
        cfg, k = self.cfg, self.k
        lists = _split(local, imp.group_pages)
        for d in range(len(self.agents)):
            plan = plan_group_reads(self.remote_layouts[d], self.layouts[d], imp.remote_lists,
                                    lists, imp.params.num_tokens, rank=d // k)
            imp.reads.extend((d, read) for read in plan.reads)
        self.ledger.record(ReadsPosted, rid, now,
                           split_ranks=tuple(read.rank for _, read in imp.reads),
                           split_groups=tuple(read.group for _, read in imp.reads))
        self.reading[rid] = imp
        default = self.net.read_faults
        for split, (d, read) in enumerate(imp.reads):
            imp.split_dranks.append(d)
            # A group's READs may be slower than others' (a state group's): the
            # fabric draws each READ's faults when it is posted.
            self.net.read_faults = cfg.groups[read.group].read_faults or default
            try:
                handle = self.agents[d].post_split_read(self.peers[d], group_splits([read]))
            except TransportError as e:
                self.ledger.record(SplitFailed, rid, now, split=split, reason=f"post: {e}")
                imp.splits_failed.append(split)
            else:
                self.handles[(d, handle)] = (rid, split)
                imp.rank_open[d] = imp.rank_open.get(d, 0) + 1
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
        if all(imp.split_dranks[s] != d for s in imp.splits_failed):
            self._release(rid, (d,))

    def _post_reads(self, now: float) -> None:
        posted = []
        for rid, imp in self.waiting.items():
            local = self.pool.allocate(sum(imp.group_pages) if imp.group_pages
                                       else len(imp.remote_ids))
            if local is None:
                break  # pages free up as other imports drain
            imp.local_ids = local
            posted.append(rid)
            if imp.group_pages:
                self._post_group_reads(rid, imp, local, now)
                self.on_phase(imp.req, "reads_posted")
                continue
            # Split d is D rank d's READ, from P rank d // k.
            self.ledger.record(ReadsPosted, rid, now,
                               split_ranks=tuple(d // self.k for d in range(len(self.agents))))
            self.reading[rid] = imp
            read = ReadRequest(runs=coalesce(imp.remote_ids, local))
            params_token = imp.params.token
            carry = self.policy.release_with_reads
            imp.split_dranks = list(range(len(self.agents)))
            for rank, agent in enumerate(self.agents):
                # kvhandoff releases after finished_recving; vLLM's READ carries it.
                release = encode(Release(rid, self.name, rank, params_token)) if carry else None
                try:
                    handle = agent.post_read(self.peers[rank], read, release)
                except TransportError as e:
                    self.ledger.record(SplitFailed, rid, now, split=rank, reason=f"post: {e}")
                    imp.splits_failed.append(rank)
                else:
                    self.handles[(rank, handle)] = (rid, rank)
            self.on_phase(imp.req, "reads_posted")
        for rid in posted:
            del self.waiting[rid]

    def _report(self, now: float, lost) -> None:
        cfg = self.cfg
        done = []
        for rid, imp in self.reading.items():
            rec = self.state.record(self.stream, rid)
            assert isinstance(rec, ConsumerRecord)
            if not rec.drained:
                continue
            if imp.drained_at is None:
                imp.drained_at = now
            verdict = read_verdict_of(rec)
            if verdict is Verdict.PENDING and not rec.cancelled and self.policy.acknowledges:
                # (A cancelled request's bytes go nowhere: no proof needed, its
                # pages are released as soon as the reads drained.)
                peer_gone = any(self.p_peers[r] in lost for r in rec.split_ranks)
                if not peer_gone and now - imp.drained_at < cfg.confirm_timeout_s:
                    # The bytes are here and wait only for P's word: ask again
                    # well before the next period, in case a message was lost.
                    again = cfg.heartbeat_s / 4
                    if imp.asked_at < 0 or now - imp.asked_at >= again:
                        imp.asked_at = now
                        self.urgent[rid] = None
                    self._arm(imp.asked_at + again)
                    self._arm(imp.drained_at + cfg.confirm_timeout_s)
                    continue
            done.append(rid)
            self._finish_reads(rid, imp, rec, verdict, now)
        for rid in done:
            del self.reading[rid]

    def _finish_reads(self, rid: str, imp: Import, rec: ConsumerRecord, verdict: Verdict,
                      now: float) -> None:
        record = self.ledger.record
        record(FinishedRecving, rid, now)
        req = imp.req
        serve = False
        received = rec.state is DState.RECEIVED
        record(ReleaseSent, rid, now, notify_only=not received)
        if not self.policy.release_with_reads:
            self._release(rid, range(len(self.agents)))  # every read drained: P may free
        else:  # vLLM: the READs carried it, but failed splits never delivered theirs
            self._release(rid, list(dict.fromkeys(imp.split_dranks[s] for s in imp.splits_failed)))
        if received:
            serve = not rec.cancelled
        else:
            serve = (self.policy.serve_unconfirmed and not rec.cancelled
                     and not imp.splits_failed)
        if serve:
            self.served += 1
            if not self._bytes_match(imp):
                self.served_corrupt += 1
            if self.proofs.unproven(lambda r: (rid, r), rec):
                self.served_unproven += 1
        outcome = "served" if serve else ("cancelled" if rec.cancelled else "failed")
        for rank in range(len(self.agents)):
            self.pool.free(imp.local_ids, rank)
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

    def _heartbeat(self, now: float) -> None:
        periodic = now >= self.next_heartbeat
        if not periodic and not self.urgent:
            return
        due = heartbeat_due(self.state, self.stream).get(self.p_name, [])
        if self.policy.stop_heartbeat_on_cancel:
            requests = self.state.stream(self.stream).requests
            due = [rid for rid in due if not requests[rid].cancelled]
        if not periodic:
            # An urgent heartbeat (an admission, drained reads waiting for proof)
            # also carries every due request whose proof of life is going stale:
            # a request must not depend on periodic messages alone when those are
            # the ones being lost (a lease died that way while urgent messages in
            # between got through).
            stale = now + 0.5 * self.cfg.lease_s
            requests = self.state.stream(self.stream).requests
            due = [rid for rid in due if rid in self.urgent or _stale(requests[rid], stale)]
        self.urgent.clear()
        if periodic:
            requests = self.state.stream(self.stream).requests
            self.next_heartbeat = now + heartbeat_period(
                self.cfg.heartbeat_s, (requests[rid].lease_s for rid in due))
        if not due:
            return
        for rid in due:
            self.ledger.record(HeartbeatSent, rid, now)
        # Every P rank holds the request until D's release after finished_recving,
        # even one whose READ already completed under proof: heartbeat them all.
        ids = tuple(due)
        tokens = tuple(self.tokens.get(rid, "") for rid in ids)
        for p_rank, peer in enumerate(self.p_peers):
            d = p_rank * self.k  # the first D rank reading that P rank speaks for all
            self.agents[d].send_notif(peer, encode(Heartbeat(self.name, d, now, ids, tokens)))
            for rid in ids:
                self.last_beat[(rid, p_rank)] = now
        # Whatever made us send, these requests are due again at the next period.
        # (Arming only after periodic rounds lost the period of a request whose
        # first heartbeat was its admission one: found by Hypothesis.)
        self._arm(self.next_heartbeat)

    def _arm(self, t: float) -> None:
        self.loop.wake_at(t)

    # -- end of run -----------------------------------------------------------------

    def unfinished(self) -> list[str]:
        return [f"{self.stream}:{rid}" for rid, rec in self.state.stream(self.stream).requests.items()
                if rec.state is not DState.DONE]


def _split(ids, sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into consecutive lists of ``sizes`` (a request's pages, one list per group)."""
    out, at = [], 0
    for n in sizes:
        out.append(list(ids[at:at + n]))
        at += n
    return out

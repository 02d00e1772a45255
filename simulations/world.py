"""One simulated run: a P engine, a D engine, clients, a faulty fabric, one seed.

`World(cfg).run()` builds everything from ``cfg`` (drawn by a scenario from
a seed), plays the clients' requests through P → proxy → D, injects the
scenario's faults, runs until nothing is left to happen (the liveness phase:
partitions have healed, leases have run out) and measures what the issue
asks for.  Both engines write real event logs through their `Ledger`s; the
run's ``log_hash`` is a hash of exactly those bytes.

Everything random comes from ``random.Random`` seeded with sub-seeds of the
run seed (`sub_seed`), and time is the `SimClock`'s: a seed replays bit for
bit, in this process or another.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvhandoff.core.lifecycle import PState
from kvhandoff.core.log import encode_event
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Release, encode
from kvhandoff.simulations import kv
from kvhandoff.simulations.config import RunConfig
from kvhandoff.simulations.decode import DecodeEngine
from kvhandoff.simulations.policies import POLICY_BY_NAME
from kvhandoff.simulations.prefill import PrefillEngine, SimRequest, TransferParams
from kvhandoff.transports.base import KVRegion
from kvhandoff.transports.sim import SendRefused, SimClock, SimNetwork, sub_seed

MAX_CLOCK_STEPS = 2_000_000  # a run that needs more is livelocked: reported as stuck

# Each of these above zero is a violation (``freed_under_read`` too, unless the scenario
# lets a fault outlast the lease).
VIOLATION_METRICS = ("served_corrupt", "served_unproven", "double_frees", "leaks", "stuck",
                     "overwritten_under_read", "refused_events")
METRICS = ("requests", "served", "failed", "rejected", "cancelled", "freed_under_read",
           *VIOLATION_METRICS, "ignored_notifications", "lease_expiries", "events")


def _message_kind(message: bytes) -> str:
    """The wire kind ("hb", "ack", "rel") for per-kind faults, without a full parse."""
    at = message.find(b'"k":"')
    if at < 0:
        return "?"
    end = message.find(b'"', at + 5)
    return message[at + 5:end].decode() if end > 0 else "?"


def _line_sink(lines: list[bytes]) -> Callable:
    """An engine's event log: each event's line, as `core.log.LogWriter` writes it."""
    append = lines.append

    def sink(event) -> None:
        append(encode_event(event))

    return sink


def _log_bytes(lines: list[bytes]) -> bytes:
    """The JSONL file of ``lines``: each line ends with a newline."""
    return b"\n".join(lines) + b"\n" if lines else b""


@dataclass
class RunResult:
    scenario: str
    seed: int
    policy: str
    metrics: dict[str, int]
    violations: list[dict]
    log_hash: str
    p_log: bytes = b""
    d_log: bytes = b""
    sim_time: float = 0.0
    clock_steps: int = 0


class World:
    def __init__(self, cfg: RunConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.policy = POLICY_BY_NAME[cfg.policy]
        self.clock = SimClock()
        self.rng = random.Random(sub_seed(cfg.seed, "world"))
        self.net = SimNetwork(self.clock, sub_seed(cfg.seed, "fabric"), cfg.link,
                              kind_of=_message_kind)
        for kind, faults in cfg.notif_faults.items():
            self.net.set_notif_faults(faults, kind)
        self.net.read_faults = cfg.read_faults
        self.p_lines: list[bytes] = []
        self.d_lines: list[bytes] = []
        self._p_sink = _line_sink(self.p_lines)
        self._d_sink = _line_sink(self.d_lines)
        self.p = PrefillEngine("prefill-0", cfg, self.net, random.Random(sub_seed(cfg.seed, "P")),
                               self._p_sink, self._exported, self.policy)
        self.d = DecodeEngine("decode-0", cfg, self.net, random.Random(sub_seed(cfg.seed, "D")),
                              self._d_sink, self.policy, self.p.name, cfg.p_blocks,
                              self._phase, self._done)
        # A second decode engine, only for clients that retry finished requests
        # there with the same transfer parameters (a second reader of them).
        self.d2 = DecodeEngine("decode-1", cfg, self.net,
                               random.Random(sub_seed(cfg.seed, "D1")), self._d_sink,
                               self.policy, self.p.name, cfg.p_blocks,
                               lambda req, phase: None, self._retry_done) if cfg.retries else None
        self.decoders = [self.d] if self.d2 is None else [self.d, self.d2]
        self.params: dict[str, TransferParams] = {}
        self.retry_outcomes: Counter[str] = Counter()
        self._handshake()
        owners = {a.name: self.p.loop for a in self.p.agents}
        for d in self.decoders:
            owners.update({a.name: d.loop for a in d.agents})
        self.net.on_deliver = lambda name: (loop := owners.get(name)) and loop.wake()
        self.requests: list[SimRequest] = []
        self.outcomes: Counter[str] = Counter()  # how client requests ended
        self._plan()

    # -- set-up -------------------------------------------------------------

    def _handshake(self) -> None:
        # Rank-local: D rank d talks only to the P rank it reads (metadata over a
        # side channel); with equal TP that is P rank d.
        k = self.cfg.heads_per_p_rank
        for engine in self.decoders:
            for d, d_agent in enumerate(engine.agents):
                p_agent = self.p.agents[d // k]
                d_agent.add_peer(p_agent.metadata())
                p_agent.add_peer(d_agent.metadata())
                self.p.add_consumer(d_agent.name, engine.name, d)
        self.stray = None
        if self.cfg.wrong_peer_releases or self.cfg.impersonation or self.cfg.forged_acks:
            # A decode engine that is not the request's consumer (restarted with
            # stale state, or misrouted) and sends releases P must not honour.
            self.stray = self.net.agent("decode-stray.r0")
            self.stray.register([KVRegion("kv0", np.zeros((1, 8), np.uint8), 1, 8)])
            for p_agent in self.p.agents:
                self.stray.add_peer(p_agent.metadata())
                p_agent.add_peer(self.stray.metadata())
            self.p.add_consumer(self.stray.name, "decode-stray", 0)
            for d_agent in self.d.agents:  # it can reach D too (`_forge_ack`)
                self.stray.add_peer(d_agent.metadata())

    def _plan(self) -> None:
        cfg, rng, clock = self.cfg, self.rng, self.clock
        t = 0.0
        lo, hi = cfg.blocks_per_request
        layout = self.p.layout
        for i in range(cfg.requests):
            t += rng.expovariate(1.0 / cfg.inter_arrival_s)
            if layout is None:
                req = SimRequest(f"req-{i}", i, rng.randint(lo, hi), t)
            else:  # a hybrid prompt: its blocks are what every group holds of it
                n = rng.randint(*cfg.tokens_per_request)
                req = SimRequest(f"req-{i}", i, sum(len(kv.group_positions(g, n))
                                                    for g in layout.groups), t, num_tokens=n)
            req.malformed = rng.random() < cfg.invalid_geometry
            req.prefix_hit = rng.random() < cfg.prefix_hit
            if cfg.cancel.rate and rng.random() < cfg.cancel.rate:
                req.cancel_phase = rng.choice(cfg.cancel.phases)
            if layout is not None:
                # D holds every group of a prefix hit, and some groups of others.
                req.held_groups = tuple(
                    k for k, g in enumerate(cfg.groups)
                    if req.prefix_hit or (g.held_by_d and rng.random() < g.held_by_d))
            self.requests.append(req)
            clock.call_at(t, self._arrive, req)
        self.last_arrival = t
        fault_end = t
        for start, duration in cfg.partitions:
            for pa in self.p.agents:
                for da in self.d.agents:
                    self.net.partition(pa.name, da.name, start, start + duration)
            fault_end = max(fault_end, start + duration)
        if cfg.crash_p_at is not None:
            clock.call_at(cfg.crash_p_at, self._crash_p)
        if cfg.crash_d_at is not None:
            clock.call_at(cfg.crash_d_at, self._crash_d)
        self.horizon = fault_end + 6 * cfg.lease_s + cfg.link.read_timeout_s + cfg.read_timeout_s

    # -- clients and proxy ---------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        self._maybe_cancel(req, "arrival")
        if req.stage == "new":
            if self.p.loop.dead:
                self._done(req, "failed")
            else:
                self.p.submit(req)

    def _maybe_cancel(self, req: SimRequest, phase: str) -> None:
        if req.cancel_phase != phase:
            return
        lo, hi = self.cfg.cancel.delay_s
        self.clock.call_at(self.clock.now + lo + self.rng.random() * (hi - lo), self._cancel, req)

    def _cancel(self, req: SimRequest) -> None:
        if req.cancelled:
            return
        req.cancelled = True
        if req.stage == "prefill":
            self.p.cancel(req)
            self._done(req, "cancelled")
        elif req.stage == "new":
            self._done(req, "cancelled")
        elif req.stage in ("decode", "done") and not self.d.loop.dead and req.outcome != "orphaned":
            self.d.cancel(req)  # after "done" this is the harmless late cancel
        # "proxy": the proxy drops it; P's lease runs out (the orphan path)

    def _exported(self, req: SimRequest, params: TransferParams) -> None:
        if req.stage != "prefill":
            return  # cancelled while prefilling: the abort is on its way
        req.stage = "proxy"
        if self.stray is not None and self.rng.random() < self.cfg.wrong_peer_releases:
            self.clock.call_at(self.clock.now + self.rng.random() * 0.02, self._stray_release,
                               req.rid)
        if req.malformed:
            params = self._corrupt(params)
        lo, hi = self.cfg.proxy_delay_s
        self.clock.call_at(self.clock.now + lo + self.rng.random() * (hi - lo),
                           self._forward, req, params)
        self._maybe_cancel(req, "exported")

    def _forward(self, req: SimRequest, params: TransferParams) -> None:
        if req.cancelled:
            req.stage = "done"
            self.outcomes["orphaned"] += 1
            req.outcome = "orphaned"
            return
        if self.d.loop.dead:
            self._done(req, "failed")
            return
        self.params[req.rid] = params
        self.d.submit(req, params)

    def _corrupt(self, params: TransferParams) -> TransferParams:
        ids = list(params.block_ids)
        how = self.rng.randrange(5)
        if how == 0:
            ids[self.rng.randrange(len(ids))] = self.cfg.p_blocks + self.rng.randrange(100)
        elif how == 1:
            ids[self.rng.randrange(len(ids))] = -1
        elif how == 2:
            ids.append(ids[0])  # a duplicate block
            return TransferParams(params.request_id, params.remote_engine, params.remote_ranks,
                                  ids, len(ids), params.token)
        elif how == 3:
            ids[0] = str(ids[0])  # a wrong type from a hostile client
        else:
            return TransferParams(params.request_id, params.remote_engine,
                                  params.remote_ranks, ids, len(ids) + 1, params.token)
        return TransferParams(params.request_id, params.remote_engine, params.remote_ranks,
                              ids, params.num_blocks, params.token)

    def _stray_send(self, dst: str, msg: Release | Heartbeat | HeartbeatAck) -> None:
        """The impostor's send; a refused one is simply lost (it does not try again)."""
        try:
            self.stray.send_notif(dst, encode(msg))
        except SendRefused:
            pass

    def _stray_release(self, rid: str) -> None:
        if self.stray is None or self.p.loop.dead:
            return
        for rank, p_agent in enumerate(self.p.agents):
            self._stray_send(p_agent.name, Release(rid, "decode-stray", rank))

    def _impersonate(self, rid: str) -> None:
        """An impostor copies the consumer's name, D ranks and token (the params leaked).

        It speaks once the consumer has bound the request on every P rank still
        holding it: a token-holding impostor that reaches P before the consumer
        (say, while D is partitioned from P) binds it instead, and P frees under
        the consumer's READ — which D then fails, never serves (docs/simulation.md).
        """
        if self.p.loop.dead or self.stray is None:
            return
        records = (self.p.state.record(stream, rid) for stream in self.p.streams)
        if any(rec is not None and rec.state is PState.EXPORTED and not rec.consumer
               for rec in records):
            self.clock.call_at(self.clock.now + 0.1, self._impersonate, rid)
            return
        token = self.d.tokens.get(rid, "")
        k = self.cfg.heads_per_p_rank
        for rank, p_agent in enumerate(self.p.agents):
            for d in range(rank * k, (rank + 1) * k):
                self._stray_send(p_agent.name, Release(rid, self.d.name, d, token))
            self._stray_send(p_agent.name, Heartbeat(self.d.name, rank * k, self.clock.now,
                                                     (rid,), (token,)))

    def _forge_ack(self, rid: str) -> None:
        """An impostor answers D's last heartbeat for ``rid`` as P rank would: "alive for a
        lease", naming P's engine and the rank each D rank reads.  Only the P rank itself
        may vouch for its lease: D must ignore it (and the proof ledger never counts it)."""
        if self.stray is None or self.d.loop.dead:
            return
        k = self.cfg.heads_per_p_rank
        for d, agent in enumerate(self.d.agents):
            rec = self.d.state.record(self.d.streams[d], rid)
            if rec is not None:
                self._stray_send(agent.name, HeartbeatAck(self.p.name, d // k, rec.last_heartbeat,
                                                          {rid: self.cfg.lease_s}))

    def _phase(self, req: SimRequest, phase: str) -> None:
        if (phase == "reads_posted" and self.cfg.forged_acks
                and self.rng.random() < self.cfg.forged_acks):
            for i in range(5):  # P's own answers are being lost: so may these
                self.clock.call_at(self.clock.now + 0.0005 * i, self._forge_ack, req.rid)
        if (phase == "admitted" and self.cfg.impersonation
                and self.rng.random() < self.cfg.impersonation):
            self.clock.call_at(self.clock.now + self.rng.uniform(0.005, 1.0), self._impersonate,
                               req.rid)
        self._maybe_cancel(req, phase)

    def _done(self, req: SimRequest, outcome: str) -> None:
        if req.outcome:
            return
        req.outcome = outcome
        req.stage = "done"
        self.outcomes[outcome] += 1
        if (self.d2 is not None and outcome in ("served", "failed") and req.rid in self.params
                and self.rng.random() < self.cfg.retries):
            self.clock.call_at(self.clock.now + self.rng.uniform(0.01, 0.5 * self.cfg.lease_s),
                               self._retry, req)
        self._maybe_cancel(req, "finished")

    def _retry(self, req: SimRequest) -> None:
        """The client sends the same transfer parameters again, to the second D engine."""
        if self.d2 is not None and not self.d2.loop.dead:
            again = SimRequest(req.rid, req.serial, req.num_blocks, self.clock.now,
                               num_tokens=req.num_tokens, held_groups=req.held_groups)
            self.d2.submit(again, self.params[req.rid])

    def _retry_done(self, req: SimRequest, outcome: str) -> None:
        self.retry_outcomes[outcome] += 1

    # -- crashes --------------------------------------------------------------------

    def _crash_p(self) -> None:
        for agent in self.p.agents:
            self.net.crash(agent.name)
        self.p.loop.dead = True
        for req in self.requests:
            if req.stage == "prefill":
                self._done(req, "failed")

    def _crash_d(self) -> None:
        for agent in self.d.agents:
            self.net.crash(agent.name)
        self.d.loop.dead = True
        for req in self.requests:
            if req.stage == "decode":
                self._done(req, "failed")

    # -- running -----------------------------------------------------------------------

    def run(self, on_step: Callable[[World], None] | None = None) -> RunResult:
        clock, horizon = self.clock, self.horizon
        if on_step is None:
            clock.run_through(horizon, MAX_CLOCK_STEPS)
        else:  # one callback at a time, the observer after each
            for _ in range(MAX_CLOCK_STEPS):
                if not clock.run_through(horizon, 1):
                    break
                on_step(self)
        self.net.heal_all()
        return self.result()

    def result(self) -> RunResult:
        cfg, p, net, decoders = self.cfg, self.p, self.net, self.decoders
        counts = self.outcomes
        stuck = sum(1 for r in self.requests if not r.outcome)
        leaks = 0
        if not p.loop.dead:
            stuck += len(p.unfinished())
            leaks += p.pool.used_blocks
        for d in decoders:
            if not d.loop.dead:
                stuck += len(d.unfinished())
                leaks += d.pool.used_blocks
        ignored = p.malformed + sum(d.malformed + sum(e.counts["notifications_ignored"]
                                                      for e in d.engines) for d in decoders)
        expiries = 0
        streams = [*p.state.streams.values()]
        for d in decoders:
            streams.extend(d.state.streams.values())
        for ss in streams:
            ignored += sum(ss.ignored.values())
            for rec in ss.requests.values():
                if getattr(rec, "ended", "") == "expired":
                    expiries += 1
        metrics = {
            "requests": cfg.requests,
            "served": counts.get("served", 0),
            "failed": counts.get("failed", 0),
            "rejected": counts.get("rejected", 0),
            "cancelled": counts.get("cancelled", 0) + counts.get("orphaned", 0),
            "freed_under_read": net.stats.freed_under_read,
            "served_corrupt": sum(d.served_corrupt for d in decoders),
            "served_unproven": sum(d.served_unproven for d in decoders),
            "double_frees": net.stats.double_frees,
            "leaks": leaks,
            "stuck": stuck,
            "overwritten_under_read": net.stats.overwritten_under_read,
            "ignored_notifications": ignored,
            "lease_expiries": expiries,
            "events": len(self.p_lines) + len(self.d_lines),
            # events P's engines refused (a bug of the driver or the engine: never expected)
            "refused_events": (sum(e.counts["refused_events"] for e in p.engines)
                               + sum(d.refused_events for d in decoders)),
        }
        p_log, d_log = _log_bytes(self.p_lines), _log_bytes(self.d_lines)
        h = hashlib.blake2b(digest_size=16)
        h.update(p_log)
        h.update(b"\x00")
        h.update(d_log)
        return RunResult(cfg.scenario, cfg.seed, cfg.policy, metrics, self.violations(metrics),
                         h.hexdigest(), p_log, d_log, self.clock.now, self.clock.steps)

    def violations(self, m: dict[str, int]) -> list[dict]:
        out = []
        for name in VIOLATION_METRICS:
            if m[name]:
                out.append({"invariant": name, "count": m[name]})
        if m["freed_under_read"] and not self.cfg.exceeds_lease:
            out.append({"invariant": "freed_under_read", "count": m["freed_under_read"]})
        return out

    # -- safety, checked after every step by the Hypothesis tests ------------------------

    def check_heartbeats(self) -> None:
        """The rule, on effects: while a READ owns P's blocks, heartbeats for it really leave.

        For every READ in flight, the time since D last sent a heartbeat naming
        its request to the P rank it reads (or, before the first, since D admitted
        it: with a fence D asks nothing at admission, and its first keep-alive
        comes within a period) must stay under the lease — whatever state the
        fold is in (measured on what D sent, not on its states).
        """
        now, lease = self.clock.now, self.cfg.lease_s
        for d in self.decoders:
            if d.loop.dead:
                continue
            for (rank, _), (rid, _) in d.handles.items():
                p_rank = rank // d.k
                last = d.last_beat.get((rid, p_rank))
                if last is None:
                    last = d.state.record(d.streams[rank], rid).t0
                assert now - last < lease, (
                    f"{d.name} {rid}: READ from P rank {p_rank} in flight, no heartbeat sent "
                    f"to it for {now - (last if last is not None else 0.0):.3f}s (lease {lease}s)")

    def check_safety(self) -> None:
        """Raise AssertionError naming the first broken invariant (see docs/simulation.md)."""
        cfg, p, net = self.cfg, self.p, self.net
        assert net.stats.double_frees == 0, "a block was freed twice"
        assert net.stats.overwritten_under_read == 0, "D reused pages a READ was writing"
        if cfg.policy == "kvhandoff":
            for d in self.decoders:
                assert d.served_corrupt == 0, "D served bytes that differ from what P computed"
                assert d.served_unproven == 0, "D served reads P's answers do not prove"
            if not cfg.exceeds_lease:
                assert net.stats.freed_under_read == 0, "P freed blocks under a READ"
            self.check_heartbeats()
        if not p.loop.dead:
            # P's pool holds exactly the blocks of the requests its fold says it holds.
            for rank, stream in enumerate(p.streams):
                held = sum(len(p.blocks[rid]) for rid, rec in p.state.stream(stream).requests.items()
                           if rec.state is not PState.FREED)
                assert held == p.pool.held(rank), \
                    f"P rank {rank}: pool holds {p.pool.held(rank)} blocks, the fold {held}"
        for d in self.decoders:
            if not d.loop.dead:
                pages = sum(len(imp.local_ids) for imp in d.reading.values())
                assert pages == d.pool.used_blocks, \
                    f"{d.name} holds {d.pool.used_blocks} pages, its imports {pages}"

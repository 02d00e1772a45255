"""`kvhandoff bench fleet`: ``--p`` P ranks and ``--d`` D ranks in one process (issue #14).

Every P rank is a `core.producer.ProducerEngine`, every D rank a
`core.consumer.ConsumerEngine`, driven as the simulator's drivers
(`simulations.prefill`, `simulations.decode`) drive them, on a simulated
clock (every engine call gets the tick's time; the wall clock only measures).
Their messages (heartbeats, acknowledgements, releases) go through the real
wire codec (`core.messages.encode` / `decode`) over in-memory queues that
deliver ``--delay`` seconds later; the transfer parameters reach D through
the same delay (the proxy).  There is no transport and no bytes: a READ is
one split that completes after a sampled duration (seeded RNG).

Workload: requests arrive at a constant rate; each picks a D rank at random
and a P rank at random, except that a share ``--hot-share`` of them goes to
one hot P rank, so that it holds about ``--hot-leases`` live leases once the
first READs drain (Little's law: the rate is chosen for that).  The fleet
ramps up for one READ's longest duration, runs ``--peak-intervals``
heartbeat intervals at the peak, is measured there, then drains (no new
requests) until every export was freed.

Measured: traced memory (tracemalloc) of the hot P's engine and of the
largest D engine at the peak, as a copy of each (`engine_bytes`: pickled and
loaded under tracemalloc, so the run itself is untraced); heartbeat messages per (D rank, P rank) pair per heartbeat interval
over the peak's intervals, split by why D sent them (`classify`); events
logged per engine; then every engine's log is replayed with what ``kvhandoff
replay --check --json`` runs (its exit code and its events/s).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import io
import math
import os
import pickle
import random
import statistics
import tempfile
import time
import tracemalloc
from collections import Counter, deque

import numpy as np
import orjson

from kvhandoff.core.consumer import ConsumerEngine
from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import FENCE_SLOTS, FenceSlots
from kvhandoff.core.log import LogWriter
from kvhandoff.core.messages import HeartbeatAck, Release, decode, encode
from kvhandoff.core.policy import HEARTBEATS_PER_LEASE, TimingConfig
from kvhandoff.core.producer import ProducerEngine

P_ENGINE, D_ENGINE = "prefill", "decode"
KINDS = ("periodic", "admission", "reask")


def classify(since: float, period: float, fresh: bool) -> str:
    """Why D sent a heartbeat to one P rank, ``since`` seconds after its last keep-alive
    there: ``periodic`` (the keep-alive, naming every request due there) when the pair's
    period had run (the first one too), else an ask naming only some: ``admission`` when it
    names a request never heartbeated before (D asks at once for a new request), else
    ``reask`` (drained READs waiting for P's word).  Only a ``periodic`` one restarts the
    pair's timer (`policy.heartbeat_plan`)."""
    if since >= period:
        return "periodic"
    return "admission" if fresh else "reask"


def _copy(s: str) -> str:
    """An equal string that is another object (each engine owns its own copies)."""
    return (s + " ")[:-1]


class Fleet:
    def __init__(self, p: int, d: int, hot_leases: int, hot_share: float, read_s: float,
                 interval_s: float, step_s: float, delay_s: float, peak_intervals: int,
                 seed: int, log_dir: str) -> None:
        self.np, self.nd = p, d
        self.hot = 0
        self.hot_share = hot_share if p > 1 else 1.0
        self.read_s, self.step_s, self.delay_s = read_s, step_s, delay_s
        self.interval_s = interval_s
        self.lease_s = interval_s * HEARTBEATS_PER_LEASE  # the period is the interval
        self.timing = TimingConfig(self.lease_s, interval_s, 1.0, 4 * self.lease_s)
        self.period = min(interval_s, self.lease_s / HEARTBEATS_PER_LEASE)
        self.rng = random.Random(seed)
        # Held: from the arrival until P frees (prefill step, proxy, READ, release).
        held = read_s + 2 * delay_s + 2 * step_s
        self.rate = hot_leases / (self.hot_share * held)  # requests per second, fleet-wide
        self.ramp_s = math.ceil((1.5 * read_s + 2 * delay_s + 2 * step_s) / interval_s) * interval_s
        self.peak_end = self.ramp_s + peak_intervals * interval_s
        self.log_dir = log_dir
        self.p_paths = [os.path.join(log_dir, f"{P_ENGINE}.r{r}.jsonl") for r in range(p)]
        self.d_paths = [os.path.join(log_dir, f"{D_ENGINE}.r{r}.jsonl") for r in range(d)]
        self.writers = [LogWriter(path, 1 << 20) for path in self.p_paths + self.d_paths]
        self.p_eng: list = [ProducerEngine(Stream(P_ENGINE, Side.P, r), self.lease_s, None, w)
                            for r, w in enumerate(self.writers[:p])]
        self.d_eng: list = [ConsumerEngine(Stream(D_ENGINE, Side.D, r), self.timing, None, w)
                            for r, w in enumerate(self.writers[p:])]
        # Each P rank's fence slots (`core.fence`), written as its engine says; a fence READ
        # reads its slot ``delay_s`` after D posted it.
        self.fence = [np.zeros(FENCE_SLOTS, np.uint64) for _ in range(p)]
        self.fence_free = [FenceSlots(FENCE_SLOTS) for _ in range(p)]  # as vLLM's scheduler
        self.fence_slot: dict[str, int] = {}  # rid -> its slot, until P frees it
        self.fence_reads: list = []  # heap of (done at, D rank, rid, P rank, slot)
        self.fences_held = self.fences_missed = 0
        self.p_peer = [f"{P_ENGINE}.r{r}" for r in range(p)]  # D's name of each P rank
        self.wire: deque = deque()  # (deliver at, to P?, index, from index, bytes)
        self.proxy: deque = deque()  # (deliver at, D rank, rid, P rank, token, blocks)
        self.p_in: list[list] = [[] for _ in range(p)]
        self.d_in: list[list] = [[] for _ in range(d)]
        self.prefilling: list[list] = [[] for _ in range(p)]  # exported at P's next step
        self.reads: list = []  # heap of (done at, D rank, rid)
        self.dest: dict[str, tuple[int, int]] = {}  # rid -> (P rank, D rank)
        self.fresh: list[set] = [set() for _ in range(d)]  # admitted, not heartbeated yet
        self.last_hb: dict[tuple[int, int], float] = {}  # per (D, P) pair: last keep-alive
        self.hb: Counter = Counter()  # (D rank, P rank, interval, kind) -> messages
        self.hb_ids = Counter()  # kind -> request ids named
        self.exported = self.freed = self.double_frees = self.acks = self.releases = 0
        self.finished_ok = self.finished_failed = self.expired = self.serial = 0
        self.freed_ids: set[str] = set()
        self.live_hot_peak = 0
        self._due = 0.0

    # -- the wire --------------------------------------------------------------

    def _send(self, now: float, to_p: bool, index: int, src: int, msg) -> None:
        self.wire.append((now + self.delay_s, to_p, index, src, encode(msg)))

    def _deliver(self, now: float) -> None:
        wire = self.wire
        while wire and wire[0][0] <= now:
            _, to_p, index, src, data = wire.popleft()
            (self.p_in if to_p else self.d_in)[index].append((src, data))

    # -- P rank: the simulator's `PrefillEngine._step` ------------------------------------

    def _p_step(self, r: int, now: float, arrivals: list) -> None:
        engine = self.p_eng[r]
        for src, data in self.p_in[r]:
            msg = decode(data)
            if isinstance(msg, Release):  # the handshake vouches for the sender's rank
                msg = Release(msg.request_id, msg.engine, src, msg.token)
            step = engine.on_notification(D_ENGINE, msg, now)
            for _, ack in step.acks:
                self._send(now, False, src, r, ack)
                self.acks += 1
        self.p_in[r].clear()
        for rid, d, token in self.prefilling[r]:
            slot = self.fence_free[r].take()
            if slot is not None:
                self.fence_slot[rid] = slot
            engine.exported(rid, now, 8, (d,), token, fence_slot=slot)
            self.exported += 1
            self.proxy.append((now + self.delay_s, d, _copy(rid), r, _copy(token), 8, slot))
        self.prefilling[r].clear()
        step = engine.poll(now)
        fence = self.fence[r]
        for slot, value in step.fences:  # before the frees, as every driver does
            fence[slot] = value
        for _, ack in step.acks:  # held-back heartbeats (none here: exports come first)
            self._send(now, False, self.dest[next(iter(ack.time_left))][1],
                       r, ack)
        self.expired += len(step.expired)
        for rid in step.freed:
            slot = self.fence_slot.pop(rid, None)
            if slot is not None:
                self.fence_free[r].give_back(slot)
            if rid in self.freed_ids:
                self.double_frees += 1
            self.freed_ids.add(rid)
            self.freed += 1
        for rid, d, token in arrivals:
            engine.prefill_started(rid, now)
            self.prefilling[r].append((rid, d, token))

    # -- D rank: the simulator's `DecodeEngine._step` -------------------------------------

    def _d_step(self, d: int, now: float, admits: list, drained: list, fenced: list) -> None:
        engine = self.d_eng[d]
        for src, data in self.d_in[d]:
            msg = decode(data)
            if isinstance(msg, HeartbeatAck):
                engine.on_notification(self.p_peer[src], msg, now)
        self.d_in[d].clear()
        for rid in drained:
            engine.split_done(rid, 0, now)
        for rid, value, planned in fenced:
            if engine.fence_read(rid, value, now, planned):
                self.fences_held += 1
            else:
                self.fences_missed += 1
        for rid, p, token, blocks, slot in admits:
            engine.check_unused(rid, P_ENGINE)
            engine.admit(rid, now, peer=self.p_peer[p], remote_engine=P_ENGINE,
                         remote_ranks=(p,), num_blocks=blocks, lease_s=self.lease_s,
                         token=token, local_id=rid, fence_slot=slot, fence_slots=FENCE_SLOTS)
            engine.validated(rid, now)
            self.fresh[d].add(rid)
        for rid, p, *_ in admits:  # pages are never short here: every READ posts at once
            engine.reads_posted(rid, now, (p,))
            done = now + self.read_s * self.rng.uniform(0.5, 1.5)
            heapq.heappush(self.reads, (done, d, rid))
        step = engine.poll(now)
        for rid, _, p, slot, planned in step.fences:
            heapq.heappush(self.fence_reads, (now + self.delay_s, d, rid, p, slot, planned))
        if not step:
            return
        fresh = self.fresh[d]
        bucket = int(now // self.interval_s)
        for peer, hb, urgent in step.heartbeats:
            p = int(peer.rpartition(".r")[2])
            since = now - self.last_hb.get((d, p), -math.inf)
            new = not fresh.isdisjoint(hb.request_ids)
            kind = classify(since, self.period, new)
            self.hb[(d, p, bucket, kind)] += 1
            self.hb_ids[kind] += len(hb.request_ids)
            fresh.difference_update(hb.request_ids)
            if kind == "periodic":
                self.last_hb[(d, p)] = now
            self._send(now, True, p, d, hb)
            engine.heartbeat_sent(peer, hb, now, urgent)
        for peer, release in step.releases:
            self._send(now, True, int(peer.rpartition(".r")[2]), d, release)
            self.releases += 1
        for f in step.finished:
            if f.ok:
                self.finished_ok += 1
            else:
                self.finished_failed += 1

    # -- the clock -----------------------------------------------------------------------

    def tick(self, now: float, arriving: bool) -> None:
        self._deliver(now)
        arrivals: list[list] = [[] for _ in range(self.np)]
        if arriving:
            self._due += self.rate * self.step_s
            rng = self.rng
            while self._due >= 1:
                self._due -= 1
                d = rng.randrange(self.nd)
                p = (self.hot if rng.random() < self.hot_share
                     else rng.choice([r for r in range(self.np) if r != self.hot]))
                rid = f"req-{self.serial:08d}"
                self.serial += 1
                token = f"{rng.getrandbits(64):016x}"
                self.dest[rid] = (p, d)
                arrivals[p].append((rid, d, token))
        for r in range(self.np):
            self._p_step(r, now, arrivals[r])
        admits: list[list] = [[] for _ in range(self.nd)]
        while self.proxy and self.proxy[0][0] <= now:
            _, d, rid, p, token, blocks, slot = self.proxy.popleft()
            admits[d].append((rid, p, token, blocks, slot))
        drained: list[list] = [[] for _ in range(self.nd)]
        while self.reads and self.reads[0][0] <= now:
            _, d, rid = heapq.heappop(self.reads)
            drained[d].append(rid)
        fenced: list[list] = [[] for _ in range(self.nd)]
        while self.fence_reads and self.fence_reads[0][0] <= now:
            _, d, rid, p, slot, planned = heapq.heappop(self.fence_reads)
            fenced[d].append((rid, int(self.fence[p][slot]), planned))
        for d in range(self.nd):
            self._d_step(d, now, admits[d], drained[d], fenced[d])

    def live(self, r: int) -> int:
        from kvhandoff.core.lifecycle import PState
        return sum(rec.state is PState.EXPORTED for rec in self.p_eng[r]._records.values())

    def busy(self) -> bool:
        return bool(self.wire or self.proxy or self.reads or self.fence_reads
                    or any(self.prefilling)
                    or self.freed < self.exported)

    def close(self) -> None:
        for w in self.writers:
            w.close()


class _Shared(pickle.Pickler):
    """Pickles an engine, leaving code (functions, classes, the log sink) shared, not copied."""

    def __init__(self, file, shared: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def persistent_id(self, obj):
        if callable(obj) or isinstance(obj, io.IOBase):
            self.shared.append(obj)
            return len(self.shared) - 1
        return None


class _Unshared(pickle.Unpickler):
    def __init__(self, file, shared: list) -> None:
        super().__init__(file)
        self.shared = shared

    def persistent_load(self, pid):
        return self.shared[pid]


def engine_bytes(engine) -> int:
    """Traced memory of a copy of ``engine`` (its fold and working data, strings included;
    code and its log sink shared): pickled, then loaded under tracemalloc."""
    shared: list = []
    buf = io.BytesIO()
    _Shared(buf, shared).dump(engine)
    gc.collect()
    tracemalloc.start()
    copy = _Unshared(io.BytesIO(buf.getbuffer()), shared).load()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(copy.state.stream(copy.stream).requests) == len(engine._records)
    del copy
    return used


def _stats(counts: list[int]) -> dict:
    ordered = sorted(counts)
    return {"max": ordered[-1] if ordered else 0,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0,
            "mean": round(statistics.fmean(ordered), 3) if ordered else 0.0}


def heartbeat_stats(hb: Counter, d: int, p: int, buckets: range) -> dict:
    """Messages per (D rank, P rank) pair per interval over ``buckets``: every pair and
    interval is a cell (zero included); max, p99, mean per kind and for all together."""
    out = {}
    for kind in (*KINDS, "all"):
        kinds = KINDS if kind == "all" else (kind,)
        cells = [sum(hb.get((dd, pp, b, k), 0) for k in kinds)
                 for dd in range(d) for pp in range(p) for b in buckets]
        out[kind] = _stats(cells)
    return out


def replay_check(paths: list[str]) -> tuple[int, dict, float]:
    """``kvhandoff replay --check --json PATHS``: (exit code, its JSON, seconds)."""
    from kvhandoff.adapters.commands import replay as command

    args = argparse.Namespace(logs=paths, request=None, until=None, check=True, partial=False,
                              json=True, trace=None, svg=None)
    out = io.StringIO()
    gc.collect()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = command.run(args)
    seconds = time.perf_counter() - start
    return rc, orjson.loads(out.getvalue()), seconds


def run_fleet(p: int = 64, d: int = 64, hot_leases: int = 100_000, hot_share: float = 0.8,
              read_s: float = 10.0, interval_s: float = 5.0, step_s: float = 1.0,
              delay_s: float = 0.01, peak_intervals: int = 3, seed: int = 0,
              log_dir: str | None = None, keep_logs: bool = False) -> dict:
    wall = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvhandoff-fleet-"))
        else:
            os.makedirs(log_dir, exist_ok=True)
        result = _run(p, d, hot_leases, hot_share, read_s, interval_s, step_s, delay_s,
                      peak_intervals, seed, log_dir)
        if keep_logs:
            result["log_dir"] = log_dir
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    return result


def _run(p, d, hot_leases, hot_share, read_s, interval_s, step_s, delay_s, peak_intervals,
         seed, log_dir) -> dict:
    start = time.perf_counter()
    fleet = Fleet(p, d, hot_leases, hot_share, read_s, interval_s, step_s, delay_s,
                  peak_intervals, seed, log_dir)
    n = 0
    while n * step_s < fleet.peak_end:
        fleet.tick(n * step_s, True)
        n += 1
    peak_t = (n - 1) * step_s
    live = [fleet.live(r) for r in range(p)]
    d_records = [len(e._records) for e in fleet.d_eng]
    big_d = max(range(d), key=d_records.__getitem__)
    hot_records = len(fleet.p_eng[fleet.hot]._records)
    hot_bytes = engine_bytes(fleet.p_eng[fleet.hot])
    d_bytes = engine_bytes(fleet.d_eng[big_d])
    to_peak_s = time.perf_counter() - start
    while fleet.busy():  # no new requests: every export must be freed
        fleet.tick(n * step_s, False)
        n += 1
    end_t = (n - 1) * step_s
    fleet.close()
    run_s = time.perf_counter() - start
    first = int(fleet.ramp_s // interval_s)
    buckets = range(first, first + peak_intervals)
    events = {}
    for path in fleet.p_paths + fleet.d_paths:
        with open(path, "rb") as f:
            events[os.path.basename(path)[:-len(".jsonl")]] = sum(
                chunk.count(b"\n") for chunk in iter(lambda f=f: f.read(1 << 22), b""))
    rc, summary, replay_s = replay_check(fleet.p_paths + fleet.d_paths)
    p_events = [events[f"{P_ENGINE}.r{r}"] for r in range(p)]
    d_events = [events[f"{D_ENGINE}.r{r}"] for r in range(d)]
    unfreed = [rid for rid in fleet.dest if rid not in fleet.freed_ids]
    return {
        "p_ranks": p, "d_ranks": d, "hot_p_rank": fleet.hot, "hot_share": fleet.hot_share,
        "requests_per_s": round(fleet.rate, 1), "read_s": f"{read_s} x U(0.5, 1.5)",
        "heartbeat_interval_s": interval_s, "lease_s": fleet.lease_s, "step_s": step_s,
        "delay_s": delay_s, "seed": seed,
        "peak_at_s": peak_t, "peak_intervals": [b * interval_s for b in buckets],
        "hot_p_live_leases": live[fleet.hot],
        "hot_p_records": hot_records,
        "hot_p_bytes": hot_bytes,
        "hot_p_bytes_per_live_lease": round(hot_bytes / max(1, live[fleet.hot])),
        "other_p_live_leases_max": max((v for r, v in enumerate(live) if r != fleet.hot),
                                       default=0),
        "fleet_live_leases": sum(live),
        "largest_d_rank": big_d, "largest_d_records": d_records[big_d],
        "largest_d_bytes": d_bytes,
        "heartbeats_per_pair_interval": heartbeat_stats(fleet.hb, d, p, buckets),
        "hot_pair_heartbeats_per_interval": heartbeat_stats(fleet.hb, d, 1, buckets)["all"],
        "heartbeat_ids_named": dict(fleet.hb_ids),
        "heartbeat_messages": {k: sum(v for key, v in fleet.hb.items() if key[3] == k)
                               for k in KINDS},
        "acks": fleet.acks, "releases": fleet.releases,
        "fences_held": fleet.fences_held, "fences_missed": fleet.fences_missed,
        "requests": fleet.serial, "exported": fleet.exported, "freed": fleet.freed,
        "double_frees": fleet.double_frees, "unfreed": len(unfreed),
        "leases_expired": fleet.expired,
        "finished_ok": fleet.finished_ok, "finished_failed": fleet.finished_failed,
        "refused_events": sum(e.counts["refused_events"] for e in fleet.p_eng + fleet.d_eng),
        "drained_at_s": end_t,
        "events_logged": sum(events.values()),
        "events_per_p": {"hot": p_events[fleet.hot], **_stats(p_events)},
        "events_per_d": _stats(d_events),
        "replay_events": summary["events"],
        "replay_s": round(replay_s, 2),
        "replay_events_per_s": round(summary["events"] / replay_s),
        "replay_check_rc": rc,
        "replay_violations": len(summary["violations"]),
        "replay_freed_under_read": summary["freed_under_read"],
        "run_to_peak_s": round(to_peak_s, 1), "run_s": round(run_s, 1),
        "targets": {"engine_bytes": 100_000_000, "heartbeats_per_pair_interval": 1,
                    "replay_events_per_s": 1_000_000},
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
        "date": time.strftime("%Y-%m-%d"),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--p", type=int, default=64, help="P ranks (default 64)")
    parser.add_argument("--d", type=int, default=64, help="D ranks (default 64)")
    parser.add_argument("--hot-leases", type=int, default=100_000,
                        help="live leases the hot P rank holds at the peak (default 100,000)")
    parser.add_argument("--hot-share", type=float, default=0.8,
                        help="share of requests the hot P rank serves (default 0.8)")
    parser.add_argument("--read-s", type=float, default=10.0,
                        help="mean READ duration, uniform in [0.5, 1.5] x this (default 10)")
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat interval (s)")
    parser.add_argument("--step", type=float, default=1.0,
                        help="every engine's step on the simulated clock (default 1 s)")
    parser.add_argument("--delay", type=float, default=0.01, help="message delivery delay (s)")
    parser.add_argument("--peak-intervals", type=int, default=3,
                        help="heartbeat intervals measured at the peak (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true",
                        help="a CI-sized fleet: 4 P x 4 D, 2,000 hot leases")
    parser.add_argument("--log-dir", help="keep every engine's event log here")


def run(args) -> dict:
    if args.small:
        args.p, args.d, args.hot_leases = 4, 4, 2_000
    return run_fleet(args.p, args.d, args.hot_leases, args.hot_share, args.read_s,
                     args.interval, args.step, args.delay, args.peak_intervals, args.seed,
                     args.log_dir, keep_logs=args.log_dir is not None)

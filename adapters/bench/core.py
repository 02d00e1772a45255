"""`kvhandoff bench core`: the fold's speed and memory, against a `transitions` baseline.

* ``apply_events_per_s`` — a realistic mix of whole lifecycles (normal
  hand-offs with TP-2 split reads, heartbeats and acks, client cancels during
  reads, rejections, expired leases, stale notifications) folded with the
  public ``apply``; events are built before timing.
* ``replay_events_per_s`` — a 1,000,000-event log written to disk, then
  streamed (parsing and every check included) and folded.
* ``replay_command_events_per_s`` — the same log through what ``kvhandoff
  replay --json`` does: read, merged by time, folded with the cross-engine
  invariant checks, summarised (state hash included).
* ``bytes_per_live_request`` — traced memory of the fold per live transfer
  (P's record exported + D's record reading) at 100,000 live transfers.
* ``transitions_machine_per_request_events_per_s`` — the same mix driven
  through one ``transitions.Machine`` per request, the baseline.
* ``hot_p_*`` — one P rank's `ProducerEngine` with ``--live`` leases read by
  ``--hot-p-d-ranks`` D ranks: memory per lease, a heartbeat interval, and
  an idle ``poll`` against the full fold scan it avoids (`bench_hot_p`).
Each rate is the median of ``--repeat`` runs.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
import tracemalloc

from kvhandoff.core.events import (
    Admitted,
    ClientCancelled,
    Event,
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
    Stream,
    Validated,
)
from kvhandoff.core.lifecycle import D_GRAPH, P_GRAPH, DState, LifecycleState, PState, apply, fold
from kvhandoff.core.log import iter_log, read_logs, write_log
from kvhandoff.core.replay import replay

P = Stream("prefill-0", Side.P, 0)
D = Stream("decode-0", Side.D, 0)
LEASE = 30.0


class _Streams:
    def __init__(self) -> None:
        self.seq = {P: 0, D: 0}
        self.events: list[Event] = []

    def add(self, stream: Stream, cls, rid: str, t: float, **kw) -> None:
        self.events.append(cls(rid, stream, self.seq[stream], t, **kw))
        self.seq[stream] += 1


def lifecycle_mix(transfers: int) -> list[Event]:
    """Whole lifecycles: 80 % normal, 10 % cancelled mid-read, 5 % rejected, 5 % expired."""
    s = _Streams()
    t = 0.0
    for i in range(transfers):
        rid = f"req-{i}"
        t += 0.001
        s.add(P, PrefillStarted, rid, t)
        s.add(P, Exported, rid, t, lease_s=LEASE, consumer_ranks=(0,), num_blocks=8)
        kind = i % 20
        if kind == 19:  # D never shows up: the lease expires
            s.add(P, LeaseExpired, rid, t + LEASE)
            s.add(P, Freed, rid, t + LEASE)
            s.add(P, ReleaseNotified, rid, t + LEASE + 1, from_engine="decode-0", consumer_rank=0)
            continue
        s.add(D, Admitted, rid, t, remote_engine="prefill-0", remote_ranks=(0,), num_blocks=8,
              lease_s=LEASE, lease_margin_s=1.0, local_request_id=rid)
        if kind == 18:
            s.add(D, Rejected, rid, t, reason="block id out of range")
            s.add(D, ReleaseSent, rid, t, notify_only=True)
        else:
            s.add(D, Validated, rid, t)
            s.add(D, HeartbeatSent, rid, t)
            s.add(P, HeartbeatReceived, rid, t, from_engine="decode-0")
            s.add(D, LeaseAcknowledged, rid, t, p_rank=0, sent_at=t, time_left=LEASE)
            s.add(D, ReadsPosted, rid, t, split_ranks=(0, 0))
            if kind in (16, 17):
                s.add(D, ClientCancelled, rid, t)
                s.add(D, HeartbeatSent, rid, t)
                s.add(P, HeartbeatReceived, rid, t, from_engine="decode-0")
                s.add(D, LeaseAcknowledged, rid, t, p_rank=0, sent_at=t, time_left=LEASE)
            s.add(D, SplitCompleted, rid, t, split=0)
            s.add(D, SplitCompleted, rid, t, split=1)
            s.add(D, FinishedRecving, rid, t)
            s.add(D, ReleaseSent, rid, t, notify_only=False)
        s.add(P, ReleaseNotified, rid, t, from_engine="decode-0", consumer_rank=0)
        s.add(P, Freed, rid, t)
        if kind == 0:  # a duplicate, stale notification
            s.add(P, ReleaseNotified, rid, t, from_engine="decode-0", consumer_rank=0)
    return s.events


def _median_rate(n: int, run, repeat: int) -> float:
    rates = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        run()
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_apply(transfers: int, repeat: int) -> float:
    events = lifecycle_mix(transfers)

    def run():
        state = LifecycleState()
        for e in events:
            apply(state, e)

    return _median_rate(len(events), run, repeat)


def bench_replay(n_events: int, repeat: int) -> tuple[float, float, int]:
    """(fold of the streamed log, the whole ``replay --json`` path, log bytes)."""
    per_transfer = len(lifecycle_mix(20)) / 20
    events = lifecycle_mix(int(n_events / per_transfer) + 1)[:n_events]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        write_log(path, events)
        n = len(events)
        del events
        size = os.path.getsize(path)
        rate = _median_rate(n, lambda: fold(iter_log(path)), repeat)
        command = _median_rate(n, lambda: replay(read_logs([path])).summary(), repeat)
    return rate, command, size


def bench_memory(live: int) -> float:
    state = LifecycleState()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    seq_p = seq_d = 0
    for i in range(live):
        rid = f"req-{i:07d}"
        apply(state, Exported(rid, P, seq_p, 1.0, lease_s=LEASE, consumer_ranks=(0,),
                              num_blocks=8))
        apply(state, Admitted(rid, D, seq_d, 1.0, remote_engine="prefill-0", remote_ranks=(0,),
                              num_blocks=8, lease_s=LEASE, lease_margin_s=1.0,
                              local_request_id=rid))
        apply(state, Validated(rid, D, seq_d + 1, 1.0))
        apply(state, ReadsPosted(rid, D, seq_d + 2, 1.0, split_ranks=(0, 0)))
        seq_p, seq_d = seq_p + 1, seq_d + 3
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert state.record(P, "req-0000000").state is PState.EXPORTED
    assert state.record(D, "req-0000000").state is DState.READING
    return used / live


def bench_hot_p(live: int, d_ranks: int, repeat: int) -> dict:
    """One P rank's `ProducerEngine` holding ``live`` leases read by ``d_ranks`` D ranks.

    Memory per live lease (the engine and its fold), one heartbeat interval
    (each D rank's one batched heartbeat naming all of its requests: what P
    answers per second, one answer per message), and ``poll`` on an engine
    step with nothing due, against the full scan of the fold that a poll
    without the engine's hints would make (`expired_leases` + `to_free`),
    measured in the same run.
    """
    from kvhandoff.core.messages import Heartbeat
    from kvhandoff.core.policy import expired_leases, to_free
    from kvhandoff.core.producer import ProducerEngine

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine = ProducerEngine(P, LEASE)
    rids = [f"req-{i:07d}" for i in range(live)]
    for rid in rids:
        engine.exported(rid, 0.0, 8, (0,), "tok")
    gc.collect()
    per_lease = (tracemalloc.get_traced_memory()[0] - before) / live
    tracemalloc.stop()
    shares = [(f"d{d}", Heartbeat("decode-0", d, 1.0, tuple(rids[d::d_ranks]),
                                  ("tok",) * len(rids[d::d_ranks]))) for d in range(d_ranks)]
    answers = 0

    def interval():
        nonlocal answers
        for sender, hb in shares:
            answers += len(engine.on_notification(sender, hb, 1.0).acks)

    interval()  # binds each request to its reader before timing
    hb_rate = _median_rate(live, interval, repeat)
    engine.poll(1.0)  # settles the scan hint
    polls = 1000
    poll_rate = _median_rate(polls, lambda: [engine.poll(1.0) for _ in range(polls)], repeat)
    scans = 20
    scan_rate = _median_rate(scans, lambda: [(expired_leases(engine.state, P, 1.0),
                                              to_free(engine.state, P)) for _ in range(scans)],
                             repeat)
    assert engine.counts["refused_events"] == 0 and engine.counts["frees"] == 0
    return {"hot_p_live_leases": live, "hot_p_d_ranks": d_ranks,
            "hot_p_bytes_per_live_lease": round(per_lease),
            "hot_p_heartbeat_ids_per_s": round(hb_rate),
            "hot_p_answers_per_heartbeat": answers / ((repeat + 1) * d_ranks),
            "hot_p_poll_us": round(1e6 / poll_rate, 2),
            "hot_p_full_scan_us": round(1e6 / scan_rate, 1)}


class _Request:
    """The baseline's model object: one per request, each with its own Machine."""


def bench_transitions_baseline(transfers: int, repeat: int) -> float:
    from transitions import Machine

    events = lifecycle_mix(transfers)
    specs = {}
    for side, graph, states in ((Side.P, P_GRAPH, PState), (Side.D, D_GRAPH, DState)):
        specs[side] = ([s.value for s in states], [
            {"trigger": trig, "source": [s.value for s in srcs], "dest": dst}
            for trig, srcs, dst, _, guard in graph if guard is None or dst != "="])

    def run():
        models: dict[tuple, _Request] = {}
        for e in events:
            key = (e.stream, e.request_id)
            model = models.get(key)
            if model is None:
                model = models[key] = _Request()
                states, transitions = specs[e.stream.side]
                Machine(model=model, states=states, transitions=transitions, initial="NEW",
                        auto_transitions=False)
            model.trigger(e.kind)

    return _median_rate(len(events), run, repeat)


def add_arguments(parser) -> None:
    parser.add_argument("--transfers", type=int, default=50_000,
                        help="lifecycles in the apply mix (default 50,000)")
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=100_000, help="live transfers for memory")
    parser.add_argument("--baseline-transfers", type=int, default=2_000)
    parser.add_argument("--hot-p-d-ranks", type=int, default=64,
                        help="D ranks reading the hot P (default 64); its leases: --live")
    parser.add_argument("--repeat", type=int, default=3)


def run(args) -> dict:
    apply_rate = bench_apply(args.transfers, args.repeat)
    baseline = bench_transitions_baseline(args.baseline_transfers, args.repeat)
    replay_rate, command_rate, log_bytes = bench_replay(args.replay_events, args.repeat)
    per_request = bench_memory(args.live)
    hot_p = bench_hot_p(args.live, args.hot_p_d_ranks, args.repeat)
    return {
        **hot_p,
        "apply_events_per_s": round(apply_rate),
        "replay_events_per_s": round(replay_rate),
        "replay_command_events_per_s": round(command_rate),
        "replay_events": args.replay_events,
        "replay_log_bytes": log_bytes,
        "bytes_per_live_request": round(per_request),
        "live_requests": args.live,
        "transitions_machine_per_request_events_per_s": round(baseline),
        "apply_vs_transitions_ratio": round(apply_rate / baseline, 1),
        "targets": {"apply_events_per_s": 300_000, "replay_events_per_s": 200_000,
                    "bytes_per_live_request": 2048, "hot_p_bytes_per_live_lease": 1000,
                    "hot_p_answers_per_heartbeat": 1},
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
        "date": time.strftime("%Y-%m-%d"),
    }

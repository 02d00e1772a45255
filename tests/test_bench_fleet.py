"""`kvhandoff bench fleet` on a small fleet: every export freed once, replay clean, and the
heartbeat counts it reports agree with what the engines' logs say (issue #14)."""

from __future__ import annotations

import os
from collections import Counter

import orjson

from kvhandoff.adapters.bench.fleet import KINDS, classify, heartbeat_stats, run_fleet
from kvhandoff.adapters.cli import main
from kvhandoff.core.events import Admitted, Exported, Freed, HeartbeatSent, Side
from kvhandoff.core.log import read_logs

P, D, INTERVAL = 4, 4, 5.0


def test_small_fleet_frees_once_replays_clean_and_heartbeats_agree_with_its_logs(tmp_path):
    out = run_fleet(p=P, d=D, hot_leases=1000, interval_s=INTERVAL, peak_intervals=2,
                    log_dir=str(tmp_path), keep_logs=True)
    assert out["hot_p_live_leases"] > 700 and out["exported"] > 2000
    assert out["exported"] == out["freed"] == out["requests"] == out["finished_ok"]
    assert out["double_frees"] == out["unfreed"] == out["refused_events"] == 0
    assert out["leases_expired"] == 0
    assert out["replay_check_rc"] == 0 and out["replay_violations"] == 0
    assert out["replay_freed_under_read"] == 0
    assert out["replay_events"] == out["events_logged"] > 0
    assert 0 < out["hot_p_bytes"] < out["targets"]["engine_bytes"]
    assert 0 < out["largest_d_bytes"] < out["targets"]["engine_bytes"]

    events = read_logs(sorted(os.path.join(tmp_path, f) for f in os.listdir(tmp_path)))
    # Every export freed exactly once, from the logs.
    exported = Counter((e.stream, e.request_id) for e in events if isinstance(e, Exported))
    freed = Counter((e.stream, e.request_id) for e in events if isinstance(e, Freed))
    assert exported == freed and set(freed.values()) == {1}
    assert len(exported) == out["exported"]

    # Heartbeat messages from D's logs: one message = one D rank's HeartbeatSent events at
    # one time for requests of one P rank (a batched heartbeat names all of them).
    p_of: dict[str, int] = {}
    messages: dict[tuple[int, int, float], list[str]] = {}
    for e in events:
        if e.stream.side is not Side.D:
            continue
        if isinstance(e, Admitted):
            (p_of[e.request_id],) = e.remote_ranks
        elif isinstance(e, HeartbeatSent):
            messages.setdefault((e.stream.rank, p_of[e.request_id], e.t), []).append(
                e.request_id)
    period = min(INTERVAL, out["lease_s"] / 6)
    seen: set[str] = set()
    last: dict[tuple[int, int], float] = {}
    counts: Counter = Counter()
    for (d, p, t), rids in sorted(messages.items(), key=lambda kv: kv[0][2]):
        kind = classify(t - last.get((d, p), float("-inf")), period,
                        not seen.issuperset(rids))
        seen.update(rids)
        if kind == "periodic":  # asks between keep-alives leave the pair's timer alone
            last[(d, p)] = t
        counts[(d, p, int(t // INTERVAL), kind)] += 1
    buckets = range(int(out["peak_intervals"][0] // INTERVAL),
                    int(out["peak_intervals"][-1] // INTERVAL) + 1)
    assert heartbeat_stats(counts, D, P, buckets) == out["heartbeats_per_pair_interval"]
    assert {k: sum(v for key, v in counts.items() if key[3] == k) for k in KINDS} == \
        out["heartbeat_messages"]
    # The keep-alive: at most one per pair per interval, over the whole run, naming every
    # request due at that pair.  D never asks: a drained READ is proven by the lease P
    # granted in answer to a keep-alive, or else by reading P's fence (a slot for every
    # live export here), so every heartbeat message is a keep-alive.
    assert max(v for key, v in counts.items() if key[3] == "periodic") <= 1
    assert out["heartbeats_per_pair_interval"]["all"]["max"] <= 1
    assert set(out["heartbeat_ids_named"]) == {"periodic"}
    assert out["finished_ok"] == out["requests"] and out["fences_missed"] == 0


def test_bench_fleet_command_line(capsys):
    code = main(["bench", "fleet", "--json", "--p", "2", "--d", "2", "--hot-leases", "200",
                 "--peak-intervals", "1"])
    out = orjson.loads(capsys.readouterr().out)
    assert code == 0
    assert out["p_ranks"] == out["d_ranks"] == 2
    assert out["exported"] == out["freed"] and out["replay_check_rc"] == 0

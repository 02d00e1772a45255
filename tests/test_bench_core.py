"""`kvhandoff bench core` runs as documented (a small run: the numbers are docs/benchmarks.md's)."""

from __future__ import annotations

import orjson

from kvhandoff.adapters.cli import main


def test_bench_core_reports_the_fold_and_the_hot_p(capsys):
    code = main(["bench", "core", "--json", "--transfers", "300", "--replay-events", "3000",
                 "--live", "2000", "--baseline-transfers", "50", "--repeat", "1",
                 "--hot-p-d-ranks", "8"])
    out = orjson.loads(capsys.readouterr().out)
    assert code == 0
    assert out["apply_events_per_s"] > 0 and out["replay_events_per_s"] > 0
    assert 0 < out["bytes_per_live_request"] < out["targets"]["bytes_per_live_request"]
    assert out["hot_p_live_leases"] == 2000 and out["hot_p_d_ranks"] == 8
    assert out["hot_p_answers_per_heartbeat"] == 1  # one answer per batched heartbeat
    assert 0 < out["hot_p_bytes_per_live_lease"] < out["targets"]["hot_p_bytes_per_live_lease"]
    assert out["hot_p_poll_us"] > 0 and out["hot_p_full_scan_us"] > 0

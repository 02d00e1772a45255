"""A seed is a run: the same scenario, seed and policy give the same event logs.

Checked in one process, across two processes (with different string-hash
seeds, so no set iteration order can leak in), and across worker counts.
The simulator never reads the wall clock to decide anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest

from kvhandoff.simulations.runner import run_one, sweep
from kvhandoff.simulations.scenarios import names


@pytest.mark.parametrize("scenario", names())
def test_the_same_seed_gives_the_same_log_in_one_process(scenario):
    for policy in ("kvhandoff", "vllm-0.32"):
        first, second = run_one(scenario, 5, policy), run_one(scenario, 5, policy)
        assert first.log_hash == second.log_hash
        assert first.p_log == second.p_log and first.d_log == second.d_log
        assert first.metrics == second.metrics


def test_different_seeds_give_different_runs():
    hashes = {run_one("swarm", seed).log_hash for seed in range(20)}
    assert len(hashes) == 20


def test_policies_give_different_logs_where_they_differ():
    assert run_one("cancel_during_read", 3, "kvhandoff").log_hash != \
        run_one("cancel_during_read", 3, "vllm-0.32").log_hash


def _simulate_in_subprocess(hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff.adapters.cli", "simulate", "--scenario", "swarm",
         "--seeds", "0..9", "--json"],
        capture_output=True, env=env, check=True, timeout=120)
    return orjson.loads(out.stdout)


def test_the_same_seeds_give_the_same_log_hash_in_two_processes():
    a, b = _simulate_in_subprocess("1"), _simulate_in_subprocess("2")
    here = sweep(["swarm"], range(10), "kvhandoff").as_dict()
    assert a["log_hash"] == b["log_hash"] == here["log_hash"]
    for key in ("runs", "requests", "freed_under_read", "served_corrupt", "ignored_notifications"):
        assert a[key] == b[key] == here[key]


def test_worker_processes_do_not_change_the_result():
    one = sweep(["steady_state", "swarm"], range(12), "kvhandoff", jobs=1).as_dict()
    two = sweep(["steady_state", "swarm"], range(12), "kvhandoff", jobs=2).as_dict()
    for key in ("log_hash", "runs", "requests", "events", "violations", "per_scenario"):
        assert one[key] == two[key]


def test_a_run_never_reads_the_wall_clock(monkeypatch):
    def wall_clock():
        raise AssertionError("the simulation read the wall clock")

    expected = run_one("swarm", 7).log_hash
    for name in ("time", "monotonic", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, wall_clock)
    assert run_one("swarm", 7).log_hash == expected

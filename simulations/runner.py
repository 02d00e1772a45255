"""Sweeps: many seeds of many scenarios under one policy, summed up.

`run_one` is one seed of one scenario; `sweep` runs a range of seeds over a
list of scenarios, adds the metrics up, collects each violation with the
exact command that reproduces it, hashes all runs' logs into one
``log_hash`` and, with ``log_dir``, writes every run's P and D event logs
(``<scenario>.<policy>.s<seed>.P.jsonl`` / ``.D.jsonl``) for
``kvhandoff replay --check``.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvhandoff.core.log import read_logs
from kvhandoff.core.replay import replay
from kvhandoff.simulations.scenarios import build
from kvhandoff.simulations.world import METRICS, RunResult, World

SUMMED = tuple(m for m in METRICS if m != "requests")


def repro_command(scenario: str, seed: int, policy: str) -> str:
    return (f"kvhandoff simulate --scenario {scenario} --seeds {seed}..{seed} "
            f"--policy {policy} --log-dir /tmp/kvh-repro --check")


def run_one(scenario: str, seed: int, policy: str = "kvhandoff",
            on_step: Callable[[World], None] | None = None) -> RunResult:
    return World(build(scenario, seed, policy)).run(on_step)


def log_paths(log_dir: str, scenario: str, seed: int, policy: str) -> tuple[str, str]:
    stem = os.path.join(log_dir, f"{scenario}.{policy}.s{seed}")
    return stem + ".P.jsonl", stem + ".D.jsonl"


@dataclass
class Summary:
    policy: str
    scenarios: list[str]
    seeds: tuple[int, int]
    runs: int = 0
    requests: int = 0
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUMMED, 0))
    per_scenario: dict[str, dict[str, int]] = field(default_factory=dict)
    violations: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    jobs: int = 1
    _hash: object = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def add(self, result: RunResult) -> None:
        self.runs += 1
        self.requests += result.metrics["requests"]
        row = self.per_scenario.setdefault(result.scenario,
                                           {"runs": 0, "requests": 0, **dict.fromkeys(SUMMED, 0)})
        row["runs"] += 1
        row["requests"] += result.metrics["requests"]
        for name in SUMMED:
            self.totals[name] += result.metrics[name]
            row[name] += result.metrics[name]
        self._hash.update(result.log_hash.encode())
        for v in result.violations:
            self.violations.append({"scenario": result.scenario, "seed": result.seed,
                                    "policy": result.policy, **v,
                                    "repro": repro_command(result.scenario, result.seed,
                                                           result.policy)})

    @property
    def log_hash(self) -> str:
        return self._hash.hexdigest()

    def as_dict(self, max_violations: int = 50) -> dict:
        return {
            "policy": self.policy,
            "scenarios": self.scenarios,
            "seeds": f"{self.seeds[0]}..{self.seeds[1]}",
            "runs": self.runs,
            "requests": self.requests,
            **self.totals,
            "log_hash": self.log_hash,
            "requests_per_s": round(self.requests / self.wall_s, 1) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 3),
            "jobs": self.jobs,
            "violation_count": len(self.violations),
            "violations": self.violations[:max_violations],
            "per_scenario": self.per_scenario,
        }


def _run_task(task: tuple[str, int, str, str | None, bool]) -> RunResult | dict:
    """One run of a sweep (in this process or a worker): the result, or the exception."""
    scenario, seed, policy, log_dir, replay_check = task
    try:
        result = run_one(scenario, seed, policy)
    except Exception as e:  # a crash of the model or the core is a finding too
        return {"scenario": scenario, "seed": seed, "policy": policy,
                "invariant": "exception", "count": 1,
                "detail": "".join(traceback.format_exception_only(e)).strip(),
                "repro": repro_command(scenario, seed, policy)}
    if log_dir or replay_check:
        _write_and_replay(result, log_dir, replay_check)
    if not log_dir:
        result.p_log = result.d_log = b""  # do not ship the bytes back from a worker
    return result


def _write_and_replay(result: RunResult, log_dir: str | None, replay_check: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kvh-sim-") as tmp:
        p_path, d_path = log_paths(log_dir or tmp, result.scenario, result.seed, result.policy)
        with open(p_path, "wb") as f:
            f.write(result.p_log)
        with open(d_path, "wb") as f:
            f.write(result.d_log)
        if replay_check:
            checked = replay(read_logs([p_path, d_path]))
            names: dict[str, int] = {}
            for v in checked.violations:
                names[v.invariant] = names.get(v.invariant, 0) + 1
            for name, count in names.items():
                first = next(v for v in checked.violations if v.invariant == name)
                result.violations.append({"invariant": f"replay:{name}", "count": count,
                                          "detail": f"{first.event}: {first.detail}"})


def sweep(scenarios: Iterable[str], seeds: range, policy: str = "kvhandoff",
          log_dir: str | None = None, jobs: int = 1, replay_check: bool = False) -> Summary:
    """Run every seed of every scenario; ``jobs`` > 1 spreads the runs over processes.

    The summary, its ``log_hash`` included, does not depend on ``jobs``: runs
    are added in (scenario, seed) order whoever ran them.
    """
    scenarios = list(scenarios)
    summary = Summary(policy, scenarios, (seeds.start, seeds.stop - 1), jobs=jobs)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    # Made as the workers take them: a sweep of many seeds holds no list of its runs.
    tasks = ((sc, seed, policy, log_dir, replay_check) for sc in scenarios for seed in seeds)
    count = len(scenarios) * len(seeds)
    start = time.perf_counter()  # wall time only measures the simulator's speed
    if jobs > 1 and count > 1:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                          else "spawn")
        # Forked workers inherit the parent's objects, garbage included; a collection in
        # a worker that finalizes one (a NIXL agent the parent dropped: its threads are
        # not in the child) aborts the worker.  Frozen, they are never collected there.
        gc.freeze()
        try:
            pool = ctx.Pool(jobs)
        finally:
            gc.unfreeze()
        with pool:
            # Small chunks: a run lasts milliseconds, and a large last chunk leaves the
            # other workers idle at the end of the sweep.
            results = pool.imap(_run_task, tasks, chunksize=max(1, min(8, count // (jobs * 8))))
            _collect(summary, results)
    else:
        _collect(summary, map(_run_task, tasks))
    summary.wall_s = time.perf_counter() - start
    return summary


def _collect(summary: Summary, results: Iterable[RunResult | dict]) -> None:
    for result in results:
        if isinstance(result, dict):
            summary.runs += 1
            summary.violations.append(result)
        else:
            summary.add(result)

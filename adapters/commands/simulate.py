"""`kvhandoff simulate [--scenario NAME|all|swarm] [--seeds A..B] [--policy ...] [--log-dir DIR] [--check] [--json] [--engine-logs]`.

Runs the deterministic simulator (`kvhandoff.simulations`) over a range of
seeds and prints what it measured; with ``--check`` the exit status is 1 when
any run broke an invariant, and each violation comes with the exact command
that reproduces it.  docs/simulation.md explains the scenarios and metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import orjson
import structlog

from kvhandoff.core.safelog import printable
from kvhandoff.simulations.config import POLICIES
from kvhandoff.simulations.runner import sweep
from kvhandoff.simulations.scenarios import SCENARIOS, names
from kvhandoff.simulations.world import VIOLATION_METRICS


def parse_seeds(text: str) -> range:
    """``A..B`` (inclusive) or a single seed ``N``."""
    try:
        if ".." in text:
            a, b = text.split("..", 1)
            lo, hi = int(a), int(b)
        else:
            lo = hi = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds {text!r}: expected A..B or N") from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"seeds {text!r}: expected 0 <= A <= B")
    return range(lo, hi + 1)


MAX_JOBS = 64


def parse_jobs(text: str) -> int:
    """Worker processes: 0 (one per core for a large sweep) up to `MAX_JOBS`."""
    try:
        jobs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"jobs {text!r}: expected a whole number") from None
    if not 0 <= jobs <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"jobs {jobs}: expected 0 (one per core) to {MAX_JOBS}")
    return jobs


def log_dir(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty directory name")
    return text


def scenario_list(name: str) -> list[str]:
    if name == "all":
        return names()
    if name not in SCENARIOS:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {name!r}; known: all, {', '.join(names())}")
    return [name]


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="deterministic P/D simulation: find the races",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="all", type=scenario_list, metavar="NAME|all|swarm",
                   help="a scenario of the catalogue (see --list), all of them, or swarm "
                        "(default: all)")
    p.add_argument("--seeds", default="0..99", type=parse_seeds, metavar="A..B",
                   help="seeds to run, inclusive (default: 0..99)")
    p.add_argument("--policy", default="kvhandoff", choices=POLICIES,
                   help="decode-side policy: this project's, or a model of vLLM 0.32's")
    p.add_argument("--log-dir", metavar="DIR", type=log_dir,
                   help="write each run's P and D event logs here (for kvhandoff replay)")
    p.add_argument("--replay", action="store_true",
                   help="also fold each run's logs with `kvhandoff replay --check`'s checker "
                        "and report its violations")
    p.add_argument("--jobs", type=parse_jobs, default=0, metavar="N",
                   help="worker processes; 0 (default): one per core for sweeps of 64 runs or "
                        "more. Results, log_hash included, do not depend on N")
    p.add_argument("--check", action="store_true", help="exit 1 on any violation")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--engine-logs", action="store_true",
                   help="print the simulated engines' warnings too (a lease expired, an export "
                        "refused: expected by the fault scenarios); errors are always printed")


@contextlib.contextmanager
def engine_logs(warnings: bool) -> Iterator[None]:
    """The simulated engines log what a real engine would (`producer.lease_expired`, ...):
    thousands of lines a sweep, all expected. Keep errors only, unless asked, and put
    structlog's configuration back afterwards."""
    if warnings:
        yield
        return
    before = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        yield
    finally:
        structlog.configure(**before)


def run(args) -> int:
    if args.list:
        if args.json:
            print(orjson.dumps({"scenarios": {n: what for n, (what, _) in SCENARIOS.items()}})
                  .decode())
        else:
            for name, (what, _) in SCENARIOS.items():
                print(f"{name:32s} {what}")
        return 0
    jobs = args.jobs
    if jobs <= 0:
        runs = len(args.scenario) * len(args.seeds)
        jobs = min(os.cpu_count() or 1, 8) if runs >= 64 else 1
    try:
        with engine_logs(args.engine_logs):
            summary = sweep(args.scenario, args.seeds, args.policy, log_dir=args.log_dir,
                            jobs=jobs, replay_check=args.replay)
    except OSError as e:  # the logs could not be written where --log-dir says
        if not (args.log_dir and e.filename and _under(os.fspath(e.filename), args.log_dir)):
            raise
        print(f"kvhandoff simulate: --log-dir {printable(args.log_dir)}: {e.strerror or e} "
              f"({printable(e.filename)})", file=sys.stderr)
        return 2
    result = summary.as_dict()
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        _print(result, args.log_dir)
    return 1 if args.check and summary.violations else 0


def _under(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


COLUMNS = ("runs", "requests", "served", "failed", "cancelled", "freed_under_read",
           *VIOLATION_METRICS, "ignored_notifications")
SHORT = {"freed_under_read": "freed_u_read", "served_corrupt": "corrupt",
         "served_unproven": "unproven", "double_frees": "dbl_free",
         "overwritten_under_read": "overwritten", "refused_events": "refused",
         "ignored_notifications": "ignored"}


def _print(result: dict, log_dir: str | None) -> None:
    heads = [SHORT.get(c, c) for c in COLUMNS]
    width = max(len(s) for s in result["per_scenario"]) if result["per_scenario"] else 8
    print(f"policy {result['policy']}, seeds {result['seeds']}")
    print(f"{'scenario':{width}s} " + " ".join(f"{h:>12s}" for h in heads))
    for name, row in result["per_scenario"].items():
        print(f"{name:{width}s} " + " ".join(f"{row[c]:>12d}" for c in COLUMNS))
    print(f"\n{result['runs']} runs, {result['requests']} requests in {result['wall_s']} s "
          f"({result['requests_per_s']} requests/s), log hash {result['log_hash']}")
    if log_dir:
        print(f"event logs in {log_dir} (kvhandoff replay DIR/<run>.P.jsonl DIR/<run>.D.jsonl --check)")
    shown = result["violations"]
    if shown:
        print(f"\n{result['violation_count']} violations" +
              (f" (first {len(shown)} shown)" if len(shown) < result["violation_count"] else ""))
        for v in shown:
            detail = f" ({v['detail']})" if v.get("detail") else ""
            print(f"  {v['scenario']} seed {v['seed']}: {v['invariant']} x{v['count']}{detail}\n"
                  f"    repro: {v['repro']}")
    else:
        print("no violations")

"""The `kvhandoff` command line.

Each subcommand lives in its own module and is imported only when used, so
`kvhandoff replay` never pays for torch, NIXL or vLLM.  A module provides
``add_parser(subparsers)`` / ``run(args) -> int`` (commands) or
``add_arguments(parser)`` / ``run(args) -> dict`` (benchmarks).
With ``--json`` a command prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

import orjson
import structlog

COMMANDS = ("replay", "diagram", "simulate", "demo")
BENCHMARKS = ("core", "nixl", "vllm", "serve", "fleet")


def _command(name: str):
    return importlib.import_module(f"kvhandoff.adapters.commands.{name}")


def _benchmark(name: str):
    return importlib.import_module(f"kvhandoff.adapters.bench.{name}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvhandoff", description="Safe, observable, fast KV hand-off between P and D.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name in COMMANDS:
        if wanted in (None, name) or wanted.startswith("-"):
            try:
                _command(name).add_parser(sub)
            except ModuleNotFoundError as e:  # a part not installed: say so when asked for
                if not e.name or not e.name.startswith("kvhandoff"):
                    raise
                sub.add_parser(name, help=f"(unavailable: {e.name} missing)")
        else:
            sub.add_parser(name)
    bench = sub.add_parser("bench", help="benchmarks: core, nixl, vllm, serve, fleet (see docs/benchmarks.md)")
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name in BENCHMARKS:
        p = targets.add_parser(name)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if len(argv) > 1 and argv[0] == "bench" and argv[1] == name:
            _benchmark(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not structlog.is_configured():
        # The command line is an application, so it may configure logging: logs
        # go to stderr, leaving stdout to the one JSON object of --json.
        # The stream is looked up per logger, not bound once, so a caller that
        # swaps sys.stderr (a test harness, an embedding app) is followed.
        structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))
    args = build_parser(argv).parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit
    except BrokenPipeError:  # the reader left (``kvhandoff replay LOG | head``): not an error
        _stdout_to_devnull()
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
            raise
        print(f"kvhandoff: cannot write the output: {e.strerror}", file=sys.stderr)
        _stdout_to_devnull()
        return 1
    return status


def _stdout_to_devnull() -> None:
    """What stdout still buffers goes nowhere: its flush at exit would raise again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        result = _benchmark(args.target).run(args)
        if args.json:
            sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            _print_table(result)
        return 0
    return _command(args.command).run(args)


def _print_table(result: dict) -> None:
    for key, value in result.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{key}:")
            for row in value:
                print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    raise SystemExit(main())

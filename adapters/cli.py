"""The `kvhandoff` command line.

Each subcommand lives in its own module and is imported only when used, so
`kvhandoff replay` never pays for torch, NIXL or vLLM.  A module provides
``add_parser(subparsers)`` / ``run(args) -> int`` (commands) or
``add_arguments(parser)`` / ``run(args) -> dict`` (benchmarks).
With ``--json`` a command prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TextIO

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
    real, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        status = _run(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit
    except _StdoutFailed as failed:
        error = failed.__cause__
        if not isinstance(error, BrokenPipeError):  # (the reader left: `| head`, no error)
            print(f"kvhandoff: cannot write the output: {error.strerror or error}", file=sys.stderr)
        _quiet(real)
        return 1
    finally:
        sys.stdout = real
    return status


class _StdoutFailed(Exception):
    """Writing the command's output failed (the OSError is its cause)."""


class _Stdout:
    """``sys.stdout`` while a command runs: its write errors are told apart from any other
    OSError (a socket, a log file), which stays the command's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutFailed from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise _StdoutFailed from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _quiet(stream: TextIO) -> None:
    """What the failed output still buffers goes nowhere: its flush at exit would raise."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's or an application's stream)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


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

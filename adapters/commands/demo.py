"""``kvhandoff demo [--http] [--json]``: a real P/D hand-off inside two vLLM engines.

Exposes ``add_parser(subparsers)`` and ``run(args) -> int`` for the CLI;
also runnable as ``python -m kvhandoff.adapters.commands.demo``.
Exit status 0 when every completed request matched the reference, the
replay check found nothing and P freed every exported request exactly once
(with ``--http`` also: every cancel landed mid-read, the malformed request
failed, no engine process died or restarted; ``adapters.vllm.http_demo``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from kvhandoff.adapters.vllm.config import HandoffConfig
from kvhandoff.adapters.vllm.tiny_model import REFERENCE_MODEL_KINDS

DESCRIPTION = (
    "Write a tiny seeded model (--model: a Llama, a Gemma-3 with sliding-window and full "
    "attention groups, or a Mamba2 with a state group), start a prefill and a decode vLLM engine with "
    "KVHandoffConnector over NIXL host memory, send a batch P -> D (some cancelled "
    "mid-read, one with malformed transfer parameters), check the tokens against a "
    "single-engine reference, replay both event logs with the invariant check. "
    "With --http the same runs over HTTP: two `vllm serve` servers (P on core 0, D on core 1) "
    "and the example router, text prompts, the reference decoded by P alone. "
    "Exit 0 when all of that holds.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--http", action="store_true",
                   help="run it through two `vllm serve` servers and the example router "
                        "(the route operators run) instead of in-process engine handles")
    p.add_argument("--model", choices=REFERENCE_MODEL_KINDS, default="llama",
                   help="the tiny model: llama (one KV cache group, default), gemma3 (sliding "
                        "window + full attention), mamba2 (Mamba state)")
    p.add_argument("--requests", type=int, default=12, help="requests in the batch (default 12)")
    p.add_argument("--cancel", type=int, default=3,
                   help="requests cancelled by the client mid-read (default 3)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--lease", type=float, default=HandoffConfig().lease_s,
                   help="P's lease in seconds (default: the connector's, %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where model, engine logs and event logs go")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="a real P/D hand-off inside two vLLM engines (CPU)",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _e(value: Any) -> str:
    """``value`` as text rich prints as it is (a path, an id or an error may hold ``[``)."""
    from rich.markup import escape

    return escape(str(value))


def _print_p_and_replay(s: dict[str, Any], console: Any) -> None:
    """What P did and what replay found: the same lines for both demos."""
    console.print(f"  P: exported {s['p_exports']}, freed {s['p_frees']}, double frees "
                  f"{s['double_frees']}, lease expiries {s['lease_expiries']}, "
                  f"notify-only releases {s['notify_only_releases']}")
    console.print(f"  replay --check: {s['replay_violations']} violations "
                  f"(state {s['state_hash'][:12]})")
    for v in s["violations"]:
        console.print(f"    [red]{_e(v['invariant'])}[/] {_e(v['event'])}: {_e(v['detail'])}")


def _print_human(s: dict[str, Any], console: Any) -> None:
    ok = "[green]yes[/]" if s["tokens_match"] else "[red]NO[/]"
    console.print(f"\n[bold]kvhandoff demo[/] — tiny {s['model']}, P → D over NIXL host memory, "
                  f"vLLM engines with KVHandoffConnector (engines up in {s['engine_start_s']}s)")
    console.print(f"  requests {s['requests']}: completed {s['completed']}, "
                  f"cancelled mid-read {s['cancelled']}, rejected (malformed params) {s['rejected']}")
    console.print(f"  tokens equal the single-engine greedy reference: {ok} "
                  f"({s['distinct_outputs']} distinct outputs)")
    _print_p_and_replay(s, console)
    console.print(f"  D time to first token median {s['d_ttft_ms_median']} ms, "
                  f"transfer median {s['transfer_ms_median']} ms")
    console.print(f"  event logs: {_e(' '.join(s['event_logs']))}")
    console.print(f"  replay them: {_e(s['replay_command'])}")


def _print_http_human(s: dict[str, Any], console: Any) -> None:
    def yes(ok: bool) -> str:
        return "[green]yes[/]" if ok else "[red]NO[/]"
    console.print(f"\n[bold]kvhandoff demo --http[/] — tiny {s['model']}, `vllm serve` P (core 0) "
                  f"and D (core 1) with KVHandoffConnector, the example router "
                  f"(servers up in {s['engine_start_s']}s)")
    console.print(f"  requests {s['requests']}: through the router {s['through_router']} "
                  f"({s['streamed']} streamed), completed {s['completed']}, cancelled mid-read "
                  f"{s['cancelled']}/{s['cancel_planned']}, malformed params rejected "
                  f"{s['rejected']} (HTTP {s['malformed_status']})")
    for i, r in s["failed"].items():
        console.print(f"    [red]request {_e(i)} failed[/]: {_e(r)}")
    for m in s["cancel_missed"]:  # tried again with a new request
        console.print(f"    [yellow]hang-up never reached D while its READ was held[/]: "
                      f"{_e(m['rid'])} "
                      f"(D's API server logged the abort: {m['d_api_server_abort']})")
    console.print(f"  text and token ids equal P's own greedy decode: {yes(s['tokens_match'])} "
                  f"({s['distinct_outputs']} distinct outputs; latency median "
                  f"{s['latency_ms_median']} ms)")
    console.print(f"  engine processes died or restarted: {s['engine_restarts']} "
                  f"(exit codes after Ctrl-C: {s['exit_codes']})")
    _print_p_and_replay(s, console)
    console.print(f"  server logs: {_e(' '.join(s['serve_logs']))}")
    console.print(f"  replay them: {_e(s['replay_command'])}")


def _logs_to_stderr() -> None:
    """stdout carries the --json object: route structlog to stderr unless the app chose."""
    import structlog

    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvhandoff.adapters.vllm.demo import DemoOptions, demo_problems, run_demo

    _logs_to_stderr()

    console = Console(stderr=bool(args.json))
    opts = DemoOptions(model=args.model, requests=args.requests, cancel=args.cancel,
                       output_tokens=args.output_tokens, lease_s=args.lease, seed=args.seed,
                       workdir=args.workdir)
    if getattr(args, "http", False):
        from kvhandoff.adapters.vllm.http_demo import http_demo_problems, run_http_demo

        if args.requests < args.cancel + 2:
            sys.stderr.write(f"kvhandoff demo --http: --requests {args.requests} needs at least "
                             f"--cancel ({args.cancel}) + 2: one through the router, one "
                             f"malformed\n")
            return 2
        run_it, problems, show = run_http_demo, http_demo_problems, _print_http_human
    else:
        run_it, problems, show = run_demo, demo_problems, _print_human
    with console.status("starting…") as status:
        def progress(stage: str, detail: str = "") -> None:
            status.update(f"[bold]{_e(stage)}[/] {_e(detail)}")

        summary = run_it(opts, progress)
    summary["problems"] = problems(summary)
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        show(summary, console)
        for why in summary["problems"]:
            console.print(f"  [red]check failed[/]: {_e(why)}")
    # kept with the logs it describes (a test's captured output is gone once it passed)
    try:
        (Path(summary["workdir"]) / "summary.json").write_bytes(orjson.dumps(summary))
    except OSError as exc:
        sys.stderr.write(f"kvhandoff demo: the summary was not kept in its directory: {exc}\n")
    return 1 if summary["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvhandoff demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

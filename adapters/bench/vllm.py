"""``kvhandoff bench vllm [--json]``: kvhandoff's connector vs vLLM's NixlConnector.

Two P/D pairs run side by side on this machine, one with
`KVHandoffConnector`, one with vLLM's own ``NixlConnector`` (wrapped only to
time it: `timing.TimedNixlConnector`), same model, same engine settings
(``VLLM_CPU_OMP_THREADS_BIND=0``, in-process engine core, no prefix cache).
The same requests go through both, alternating per request (and which goes
first alternates too), one request at a time so neither pair's work
overlaps a measurement of the other.  By default the pair not being measured
is frozen (SIGSTOP) meanwhile: NixlConnector's idle engines busy-spin a core
each, which on a small machine would slow whichever pair is measured next to
them; ``--co-located`` keeps both pairs running instead.
``--progress-thread`` says which of kvhandoff's engines start NIXL's
progress thread: ``p`` (as shipped: P's, not D's), ``both`` or ``none``
(``KVHANDOFF_NIXL_PROGRESS_THREAD`` unset, ``1``, ``0``; docs/nixl.md).

Measured per request on D, the same way for both connectors:
``d_ttft_ms`` (D received the request → first token) and ``transfer_ms``
(D's scheduler handed the read to its worker → the worker reported
``finished_recving``).  Medians, and kvhandoff / NixlConnector ratios.
Then every engine sits idle for ``--idle-seconds`` and its process CPU is
sampled (``idle_cpu_percent``, 100 = one core).  Every D output is checked
against a single-engine greedy reference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvhandoff.adapters.vllm.cluster import EngineHandle, PDConfig, PDPair
from kvhandoff.adapters.vllm.demo import prompts_for
from kvhandoff.adapters.vllm.tiny_model import REFERENCE_MODEL_KINDS, write_tiny_model
from kvhandoff.transports.nixl.agent import PROGRESS_THREAD_ENV

# --progress-thread: the environment variable's value for kvhandoff's engines (None: unset).
PROGRESS_THREAD_CHOICES = {"p": None, "both": "1", "none": "0"}

MODELS = {"llama": "tiny seeded Llama (2 layers, 2 KV heads, head 64, fp32)",
          "gemma3": "tiny seeded Gemma-3 (4 layers: sliding window 64 / full attention, fp32)",
          "mamba2": "tiny seeded Mamba2 (2 layers, state 16, fp32)"}

CONNECTORS = ("kvhandoff", "nixl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=REFERENCE_MODEL_KINDS, default="llama",
                   help="the tiny model both pairs serve (default llama)")
    p.add_argument("--requests", type=int, default=16, help="requests per connector (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default 512)")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens decoded on D (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per connector first")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU sampling window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--co-located", action="store_true",
                   help="keep the other pair running during each measurement")
    p.add_argument("--progress-thread", choices=tuple(PROGRESS_THREAD_CHOICES), default="p",
                   help="kvhandoff's engines with NIXL's progress thread: p (default, as "
                        "shipped), both, none (KVHANDOFF_NIXL_PROGRESS_THREAD; docs/nixl.md)")
    p.add_argument("--workdir", default=None)


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _p90(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3) if xs else None


def _one(pair: PDPair, rid: str, prompt: list[int], out_tokens: int) -> dict[str, Any]:
    pre = pair.prefill([rid], [prompt])[rid]
    pair.d.add(rid, prompt, out_tokens, pre["kv_transfer_params"])
    return pair.d.wait_done([rid])[rid]


def _per_read_request(d_stats: dict[str, Any]) -> int | None:
    n = d_stats.get("releases_sent", 0) - d_stats.get("notify_only_releases", 0)
    return round(d_stats.get("bytes_read", 0) / n) if n > 0 else None


def _idle_cpu(handles: list[EngineHandle], seconds: float) -> dict[str, float]:
    start = {h.name: h.cpu_seconds() for h in handles}
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for h in handles:
            h.pump(0.0)
        time.sleep(0.05)
    wall = time.monotonic() - t0
    return {h.name: round(100.0 * (h.cpu_seconds() - start[h.name]) / wall, 1) for h in handles}


def _logs_to_stderr() -> None:
    """stdout carries the --json object: route structlog to stderr unless the app chose."""
    import structlog

    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def run(args: argparse.Namespace) -> dict[str, Any]:
    _logs_to_stderr()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvhandoff-bench-vllm-"))
    model = write_tiny_model(args.model, workdir / f"model-{args.model}")
    # Read by kvhandoff's transport only, in the engines it starts.
    os.environ.pop(PROGRESS_THREAD_ENV, None)
    if PROGRESS_THREAD_CHOICES[args.progress_thread] is not None:
        os.environ[PROGRESS_THREAD_ENV] = PROGRESS_THREAD_CHOICES[args.progress_thread]
    load_before = os.getloadavg()
    # No prefix cache: every request moves its whole prompt, for both connectors.
    pairs = {c: PDPair(PDConfig(model_dir=str(model), connector=c, workdir=str(workdir / c), tag=c,
                                enable_prefix_caching=False))
             for c in CONNECTORS}
    try:
        t0 = time.monotonic()
        for pair in pairs.values():
            pair.wait_ready()
        start_s = time.monotonic() - t0
        n = args.requests
        prompts = prompts_for(n + args.warmup, args.prompt_tokens, args.prompt_tokens, args.seed)
        ref_pair = pairs["kvhandoff"]
        for i, p in enumerate(prompts):
            ref_pair.p.add(f"ref-{i}", p, args.output_tokens)
        ref = ref_pair.p.wait_done([f"ref-{i}" for i in range(len(prompts))])
        results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONNECTORS}
        for i, prompt in enumerate(prompts):
            order = CONNECTORS if i % 2 == 0 else CONNECTORS[::-1]
            for c in order:
                if not args.co_located:
                    for other in CONNECTORS:
                        (pairs[other].thaw if other == c else pairs[other].freeze)()
                out = _one(pairs[c], f"{c}-{i}", prompt, args.output_tokens)
                time.sleep(0.1)  # the release reaches P before this pair is frozen
                out["match"] = out["token_ids"] == ref[f"ref-{i}"]["token_ids"]
                if i >= args.warmup:
                    results[c].append(out)
        for pair in pairs.values():
            pair.thaw()
        time.sleep(1.0)  # let releases land before sampling idle CPU
        handles = [h for c in CONNECTORS for h in (pairs[c].p, pairs[c].d)]
        idle = _idle_cpu(handles, args.idle_seconds)
        kvh_stats = {k: v for d in (pairs["kvhandoff"].p.stats(), pairs["kvhandoff"].d.stats())
                     for k, v in d.items()}
    finally:
        for pair in pairs.values():
            pair.stop()

    rows = []
    for c in CONNECTORS:
        rs = results[c]
        rows.append({
            "connector": "KVHandoffConnector" if c == "kvhandoff" else "NixlConnector (vLLM 0.32)",
            "requests": len(rs),
            "tokens_match": all(r["match"] for r in rs) and bool(rs),
            "d_ttft_ms_median": _median([r["ttft_ms"] for r in rs]),
            "d_ttft_ms_p90": _p90([r["ttft_ms"] for r in rs]),
            "transfer_ms_median": _median([r["transfer_ms"] for r in rs]),
            "transfer_ms_p90": _p90([r["transfer_ms"] for r in rs]),
            "p_idle_cpu_percent": idle[pairs[c].p.name],
            "d_idle_cpu_percent": idle[pairs[c].d.name],
        })
    kvh, nixl = rows

    def ratio(key: str) -> float | None:
        a, b = kvh[key], nixl[key]
        return round(a / b, 3) if a is not None and b else None

    d_stats = next((v for k, v in kvh_stats.items() if ".D" in Path(k).name), {})
    return {
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "warmup": args.warmup,
                     "model": MODELS[args.model],
                     "progress_thread": args.progress_thread,
                     "VLLM_CPU_OMP_THREADS_BIND": "0"},
        "engine_start_s": round(start_s, 1),
        "isolated": not args.co_located,
        "load_average_1m": {"before": round(load_before[0], 2),
                            "after": round(os.getloadavg()[0], 2)},
        "rows": rows,
        "ratio_d_ttft": ratio("d_ttft_ms_median"),
        "ratio_transfer": ratio("transfer_ms_median"),
        "kvhandoff_read_ms_median": d_stats.get("read_ms_median"),
        "kvhandoff_read_GBps_median": d_stats.get("read_GBps_median"),
        # per request that read (every request but notify-only releases), warm-up included
        "kvhandoff_bytes_read_per_request": _per_read_request(d_stats),
        "workdir": str(workdir),
    }

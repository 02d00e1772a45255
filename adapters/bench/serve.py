"""``kvhandoff bench serve [--json]``: the serve route under load, kvhandoff vs NixlConnector.

For each connector in turn (``--connectors``, default kvhandoff then
NixlConnector; never both at once: the engines would share the cores), the
route an operator runs: ``vllm serve`` P pinned to core 0 and D to core 1
(`adapters.vllm.serve`, the same tiny model and flags for both connectors,
no prefix cache so every request moves its whole prompt), the example router
(``python -m kvhandoff.adapters.vllm.router``, its own process), then:

* vLLM's own benchmark client, ``vllm bench serve`` (random dataset,
  ``--ignore-eos``, streamed completions) against the router at each
  ``--concurrency``: requests/s, TTFT and ITL p50/p99, failed requests, as
  its ``--save-result`` JSON gives them;
* a cancelling run: this module's async client (httpx) streams
  ``--cancel-requests`` completions through the router and, for a random
  ``--cancel-share`` of them, closes the connection at a random moment: on
  the response's headers (D has the request, its KV may still be in flight)
  or after a random number of tokens (fewer than ``--cancel-within``, the
  whole output by default).  Counted: requests closed before the
  stream's finishing chunk, the tokens D generated (its
  ``vllm:generation_tokens_total``; vLLM 0.32 counts no aborts) against what
  it would have generated with no cancel, failures;
* then P is given until its lease (+ 30 s) to let go of every block
  (kvhandoff: every ``exported`` request in P's event log ``freed``;
  NixlConnector, which keeps no event log: P's ``vllm:kv_cache_usage_perc``
  back to 0), the servers are stopped, and for kvhandoff P's exports and
  frees are counted from the logs and ``kvhandoff replay --check --json``
  runs over P's and D's logs.  NixlConnector's P reports its lease
  expiries (``vllm:nixl_num_kv_expired_reqs``) and the notifications that D
  read blocks P had already freed at expiry
  (``vllm:nixl_num_notifications_after_expiry``); exports/frees and replay
  are n/a for it.

Ratios are kvhandoff / NixlConnector per concurrency and metric.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvhandoff.adapters.bench.vllm import CONNECTORS, MODELS, _logs_to_stderr
from kvhandoff.adapters.vllm.cluster import EngineFailed, free_port, open_private_log
from kvhandoff.adapters.vllm.demo import _events, _wait, analyse_logs
from kvhandoff.adapters.vllm.http_demo import completion_chunk
from kvhandoff.adapters.vllm.serve import ServeProcess, ServeSpec
from kvhandoff.adapters.vllm.tiny_model import REFERENCE_MODEL_KINDS, write_tiny_model

NAMES = {"kvhandoff": "KVHandoffConnector", "nixl": "NixlConnector (vLLM 0.32)"}
LEASE_S = {"kvhandoff": 30.0, "nixl": 30.0}  # both connectors' defaults
SERVE_ARGS = ("--no-enable-prefix-caching",)
METRICS = ("request_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=REFERENCE_MODEL_KINDS, default="llama",
                   help="the tiny model both routes serve (default llama)")
    p.add_argument("--connectors", default="kvhandoff,nixl",
                   help="comma-separated, run in this order (default kvhandoff,nixl)")
    p.add_argument("--concurrency", default="1,4,8",
                   help="`vllm bench serve --max-concurrency` values (default 1,4,8)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests per `vllm bench serve` run (default 100)")
    p.add_argument("--input-len", type=int, default=400, help="prompt tokens (default 400)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens (default 16)")
    p.add_argument("--cancel-requests", type=int, default=40,
                   help="requests of the cancelling run (default 40; 0: no such run)")
    p.add_argument("--cancel-share", type=float, default=0.5,
                   help="share of them closed at a random moment (default 0.5)")
    p.add_argument("--cancel-within", type=int, default=0,
                   help="close each of them before this many tokens (default 0: anywhere in "
                        "the output)")
    p.add_argument("--cancel-concurrency", type=int, default=4, help="(default 4)")
    p.add_argument("--cancel-output-len", type=int, default=64,
                   help="output tokens of the cancelling run's requests (default 64)")
    p.add_argument("--warmups", type=int, default=2,
                   help="`vllm bench serve --num-warmups` per run (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)


# ---- the route -----------------------------------------------------------------------


def _nixl_config(role: str, engine_id: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                       "kv_load_failure_policy": "fail"})


def _specs(connector: str, model: str, log_dir: Path) -> tuple[ServeSpec, ServeSpec]:
    """P (core 0) and D (core 1) as the serve tests start them, with ``connector``."""
    if connector == "kvhandoff":
        side = free_port()
        common = {"lease_s": LEASE_S[connector], "log_dir": str(log_dir)}
        return (ServeSpec("P-kvhandoff", "prefill", model, "bench-P", dict(common),
                          side_channel_port=side, cpus="0", extra_args=SERVE_ARGS),
                ServeSpec("D-kvhandoff", "decode", model, "bench-D", {
                    **common, "trusted_producers": [f"127.0.0.1:{side}"]}, cpus="1",
                    extra_args=SERVE_ARGS))
    # NixlConnector: no connector of ours ("plain"), vLLM's own config; each engine's
    # handshake listener on a port of its own (both run on this host).
    return tuple(ServeSpec(
        f"{r}-nixl", "plain", model, cpus=cpu,
        extra_args=(*SERVE_ARGS, "--kv-transfer-config", _nixl_config(role, f"bench-{r}-nixl")),
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
        for r, role, cpu in (("P", "kv_producer", "0"), ("D", "kv_consumer", "1")))


class _Route:
    """P, D and the example router (its own process) for one connector."""

    def __init__(self, connector: str, model: str, workdir: Path) -> None:
        self.connector, self.model, self.workdir = connector, model, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir = workdir / "events"
        self.p_log = self.log_dir / "bench-P.P0.jsonl"
        self.d_log = self.log_dir / "bench-D.D0.jsonl"
        p_spec, d_spec = _specs(connector, model, self.log_dir)
        self.p = ServeProcess(p_spec, workdir)
        self.d = ServeProcess(d_spec, workdir)
        self.router: subprocess.Popen | None = None
        self.router_url = ""

    def start(self) -> float:
        import httpx

        t0 = time.monotonic()
        self.p.wait_ready()
        self.d.wait_ready()
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        with open_private_log(self.workdir / "router.log") as logf:
            self.router = subprocess.Popen(
                [sys.executable, "-m", "kvhandoff.adapters.vllm.router", "--prefill", self.p.url,
                 "--decode", self.d.url, "--port", str(port)], stdout=logf,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def up() -> bool:
            if self.router.poll() is not None:
                raise EngineFailed(f"the router exited; see {self.workdir / 'router.log'}")
            try:
                return httpx.get(f"{self.router_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        _wait(up, 60, "the router", 0.2)
        return time.monotonic() - t0

    def stop(self) -> dict[str, int | None]:
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGINT)
            try:
                self.router.wait(30)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(30)
        return {s.spec.name: s.stop(signal.SIGINT, timeout_s=60) if s.alive()
                else s.proc.returncode for s in (self.d, self.p)}


def _metric(url: str, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples on a server's /metrics (those with ``labels``)."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total, seen = total + float(value), True
    return total if seen else None


# ---- vLLM's benchmark client ---------------------------------------------------------


def bench_serve_argv(url: str, model: str, concurrency: int, args: argparse.Namespace,
                     result_dir: Path, filename: str) -> list[str]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    return [vllm, "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", str(args.seed), "--num-warmups", str(args.warmups),
            "--percentile-metrics", "ttft,itl",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", filename]


def _bench_serve(route: _Route, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"{route.connector}-c{concurrency}.json"
    argv = bench_serve_argv(route.router_url, route.model, concurrency, args, route.workdir, name)
    log = route.workdir / f"bench-serve-c{concurrency}.log"
    with open(log, "wb") as logf:
        rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, check=False,
                            env=os.environ | {"TOKENIZERS_PARALLELISM": "false"}).returncode
    if rc != 0 or not (route.workdir / name).exists():
        raise EngineFailed(f"`vllm bench serve` exited with {rc}; see {log}")
    r = json.loads((route.workdir / name).read_text())

    def ms(key: str) -> float | None:
        # 4 significant digits, not 2 decimals: tokens that reach the client in one burst
        # are microseconds apart, and a median ITL of 0.003 ms is not 0.
        return float(f"{r[key]:.4g}") if r.get(key) is not None else None
    return {"connector": NAMES[route.connector], "concurrency": concurrency,
            "requests": args.num_prompts, "completed": r["completed"],
            "failed": r.get("failed", args.num_prompts - r["completed"]),
            "request_throughput": round(r["request_throughput"], 3),
            "ttft_p50_ms": ms("median_ttft_ms"), "ttft_p99_ms": ms("p99_ttft_ms"),
            "itl_p50_ms": ms("median_itl_ms"), "itl_p99_ms": ms("p99_itl_ms"),
            "duration_s": round(r["duration"], 2)}


# ---- the cancelling client -------------------------------------------------------------


def cancel_plan(n: int, share: float, output_len: int, seed: int,
                within: int = 0) -> list[int | None]:
    """Per request: None (read to the end) or how many tokens to take before hanging up
    (0: on the response's headers, before the first token), fewer than ``within`` (0: the
    whole ``output_len``)."""
    rng = random.Random(seed)
    end = min(within, output_len) if within > 0 else output_len
    return [rng.randrange(end) if rng.random() < share else None for _ in range(n)]


async def _stream_one(client: Any, url: str, body: dict[str, Any],
                      cancel_after: int | None) -> dict[str, Any]:
    tokens, finished = 0, False
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "tokens": 0, "error": r.text[:300]}
        if cancel_after == 0:
            return {"status": 200, "tokens": 0, "closed": True}
        async for line in r.aiter_lines():
            if (chunk := completion_chunk(line)) is None:
                continue
            if "error" in chunk:  # vLLM's word for a request that failed mid-stream
                return {"status": 200, "tokens": tokens, "closed": False, "error": chunk["error"]}
            tokens += len(chunk["token_ids"]) or 1
            finished = finished or bool(chunk["finish_reason"])
            if cancel_after is not None and tokens >= cancel_after and not finished:
                return {"status": 200, "tokens": tokens, "closed": True}
    return {"status": 200, "tokens": tokens, "closed": False}


async def cancelling_client(url: str, bodies: list[dict[str, Any]], plan: list[int | None],
                            concurrency: int) -> list[dict[str, Any]]:
    """Stream every body to ``url`` (``concurrency`` at a time); hang up where ``plan`` says,
    by leaving the response early, which closes the connection."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300.0) as client:
        async def one(body: dict[str, Any], cancel_after: int | None) -> dict[str, Any]:
            async with gate:
                try:
                    return await _stream_one(client, url, body, cancel_after)
                except httpx.HTTPError as exc:
                    return {"status": None, "tokens": 0, "error": f"{type(exc).__name__}: {exc}"}
        return list(await asyncio.gather(*(one(b, c) for b, c in zip(bodies, plan, strict=True))))


def _cancel_run(route: _Route, args: argparse.Namespace) -> dict[str, Any]:
    from kvhandoff.adapters.vllm.demo import prompts_for

    n, out = args.cancel_requests, args.cancel_output_len
    prompts = prompts_for(n, args.input_len, args.input_len, args.seed + 1)
    bodies = [{"model": route.model, "prompt": p, "max_tokens": out, "temperature": 0,
               "ignore_eos": True, "stream": True, "return_token_ids": True} for p in prompts]
    plan = cancel_plan(n, args.cancel_share, out, args.seed, args.cancel_within)
    generated_before = _metric(route.d.url, "vllm:generation_tokens_total") or 0.0
    t0 = time.monotonic()
    got = asyncio.run(cancelling_client(f"{route.router_url}/v1/completions", bodies, plan,
                                        args.cancel_concurrency))
    wall = time.monotonic() - t0
    running_at_close = _metric(route.d.url, "vllm:num_requests_running")
    (route.workdir / "cancel.json").write_text(json.dumps(
        [{"cancel_after": c, **g} for c, g in zip(plan, got, strict=True)], indent=1))
    # vLLM 0.32 counts no aborts in its metrics; what D generated shows where it stopped.
    # D aborts a request once its API server noticed the closed stream: wait for that.
    _wait(lambda: _metric(route.d.url, "vllm:num_requests_running") == 0, 60,
          "D to finish or abort every request", 0.2)
    idle_after = time.monotonic() - t0 - wall
    generated = (_metric(route.d.url, "vllm:generation_tokens_total") or 0.0) - generated_before
    planned = [i for i in range(n) if plan[i] is not None]
    kept = [i for i in range(n) if plan[i] is None]
    closed = [i for i in planned if got[i].get("closed")]
    return {"connector": NAMES[route.connector], "requests": n, "output_len": out,
            "cancel_planned": len(planned),
            "closed_before_finish": len(closed),
            "closed_before_first_token": sum(1 for i in closed if got[i]["tokens"] == 0),
            "tokens_received": sum(g["tokens"] for g in got),
            "d_tokens_generated": int(generated),
            "d_tokens_if_none_cancelled": n * out,
            "completed": sum(1 for i in kept if got[i]["status"] == 200
                             and got[i]["tokens"] == out and "error" not in got[i]),
            "failed": sum(1 for i in range(n) if got[i]["status"] != 200 or "error" in got[i]),
            "wall_s": round(wall, 2),
            # D's requests still running as the client closed its last stream (0: D had
            # finished or aborted each already), and the time until none was
            "d_running_at_last_close": running_at_close,
            "d_idle_after_s": round(idle_after, 2)}


# ---- P's frees and the replay --------------------------------------------------------


def _all_freed(route: _Route) -> bool:
    if route.connector == "kvhandoff":
        evs = _events(route.p_log)
        exported = {e.request_id for e in evs if e.kind == "exported"}
        return bool(exported) and exported <= {e.request_id for e in evs if e.kind == "freed"}
    return _metric(route.p.url, "vllm:kv_cache_usage_perc") == 0.0


def _replay_check(logs: list[str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "kvhandoff.adapters.cli", "replay", "--check", "--json", *logs]
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    summary = json.loads(r.stdout) if r.stdout.strip() else {}
    # (``states`` counts the requests the fold still holds at the end: it forgets
    # finished ones after a while, so it is no count of every request.)
    return {"exit_code": r.returncode, "violations": len(summary.get("violations", [])),
            "events": summary.get("events"), "freed_under_read": summary.get("freed_under_read"),
            "states": summary.get("states"),
            "command": "kvhandoff replay --check --json " + " ".join(logs)}


def _handoff(route: _Route, exit_codes: dict[str, int | None], freed_in_s: float | None,
             p_metrics: dict[str, float | None]) -> dict[str, Any]:
    row: dict[str, Any] = {"connector": NAMES[route.connector], **p_metrics,
                           "all_freed_after_s": freed_in_s,
                           "exit_codes": exit_codes}
    if route.connector != "kvhandoff":
        return row | {"p_exports": None, "p_frees": None, "double_frees": None,
                      "replay_check": None}
    logs = [str(route.p_log), str(route.d_log)]
    a = analyse_logs(logs)
    return row | {"p_exports": a["p_exports"], "p_frees": a["p_frees"],
                  "double_frees": a["double_frees"], "lease_expiries": a["lease_expiries"],
                  "d_cancelled": a["d_cancelled"], "replay_check": _replay_check(logs)}


def _one_connector(connector: str, model: str, args: argparse.Namespace,
                   concurrencies: list[int], workdir: Path) -> dict[str, Any]:
    from kvhandoff.core.safelog import get_logger

    say = get_logger("kvhandoff.bench.serve").info
    route = _Route(connector, model, workdir)
    rows, cancel, freed_in = [], None, None
    try:
        start_s = route.start()
        say("bench.serve.ready", connector=connector, start_s=round(start_s, 1),
            router=route.router_url)
        for c in concurrencies:
            rows.append(_bench_serve(route, c, args))
            say("bench.serve.run", **rows[-1])
        if args.cancel_requests:
            cancel = _cancel_run(route, args)
            say("bench.serve.cancel", **cancel)
        t0 = time.monotonic()
        try:
            _wait(lambda: _all_freed(route), LEASE_S[connector] + 30, "P to free every block", 0.2)
            freed_in = round(time.monotonic() - t0, 2)
        except TimeoutError:
            pass
        p_metrics = {
            "p_kv_cache_usage_after": _metric(route.p.url, "vllm:kv_cache_usage_perc"),
            "p_nixl_expired_reqs": _metric(route.p.url, "vllm:nixl_num_kv_expired_reqs_total"),
            # a D's "done reading" for blocks P already let go of at lease expiry
            "p_nixl_notifications_after_expiry": _metric(
                route.p.url, "vllm:nixl_num_notifications_after_expiry_total"),
            "p_prefills_ok": _metric(route.p.url, "vllm:request_success_total",
                                     finished_reason="length")}
    finally:
        exit_codes = route.stop()
    return {"start_s": round(start_s, 1), "rows": rows, "cancel": cancel,
            "handoff": _handoff(route, exit_codes, freed_in, p_metrics),
            "workdir": str(workdir)}


def _commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], check=False)
    return r.stdout.strip() or None


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["connector"], r["concurrency"]): r for r in rows}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        kvh, nixl = by.get((NAMES["kvhandoff"], c)), by.get((NAMES["nixl"], c))
        if kvh and nixl:
            out.append({"concurrency": c, **{m: round(kvh[m] / nixl[m], 3) if kvh[m] is not None
                                             and nixl[m] else None for m in METRICS}})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    _logs_to_stderr()
    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown:
        raise SystemExit(f"kvhandoff bench serve: unknown connector {unknown[0]!r} "
                         f"(choose from {', '.join(CONNECTORS)})")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvhandoff-bench-serve-"))
    model = str(write_tiny_model(args.model, workdir / f"model-{args.model}"))
    load_before = os.getloadavg()
    per = {c: _one_connector(c, model, args, concurrencies, workdir / c) for c in connectors}
    rows = [r for c in connectors for r in per[c]["rows"]]
    return {
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "settings": {"model": MODELS[args.model], "connectors": connectors,
                     "concurrency": concurrencies, "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "cancel_requests": args.cancel_requests, "cancel_share": args.cancel_share,
                     "cancel_concurrency": args.cancel_concurrency,
                     "cancel_within": args.cancel_within,
                     "cancel_output_len": args.cancel_output_len, "warmups": args.warmups,
                     "seed": args.seed,
                     "serve_args": list(SERVE_ARGS), "lease_s": LEASE_S},
        "bench_serve_command": " ".join(bench_serve_argv(
            "ROUTER", model, concurrencies[0], args, Path("DIR"), "FILE")) if concurrencies else None,
        "load_average_1m": {"before": round(load_before[0], 2),
                            "after": round(os.getloadavg()[0], 2)},
        "engine_start_s": {c: per[c]["start_s"] for c in connectors},
        "rows": rows,
        "ratios": _ratios(rows),
        "cancel": [per[c]["cancel"] for c in connectors if per[c]["cancel"]],
        "handoff": [per[c]["handoff"] for c in connectors],
        "workdir": str(workdir),
    }

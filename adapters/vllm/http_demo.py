"""`kvhandoff demo --http`: the demo on the serve route, as operators run it.

Two ``vllm serve`` processes with `KVHandoffConnector` (P pinned to core 0,
D to core 1, `adapters.vllm.serve`) and the example router
(`adapters.vllm.router.build_app`, in this process under uvicorn), talking
HTTP only:

* the reference: P decodes each text prompt by itself (a plain request, no
  hand-off), greedy;
* the batch, all at once: most requests go through the router (every other
  one streamed) and must equal the reference, text and token ids;
* some are cancelled mid-read: the router's two halves by hand (P prefills,
  then D gets P's parameters plus ``kvhandoff_debug_read_delay_s`` and
  ``kvhandoff_debug_hold_read_until_cancelled``, so that its READ is held
  until that long after the client left; the router passes P's parameters
  unchanged, so the delay cannot ride through it) and the client hangs up
  once D's event log shows the READ posted; D's log must show the cancel
  between the READ's post and its completion;
* one request gives D garbage ``kv_transfer_params`` directly: it must fail
  (non-2xx) and the engines go on;
* then P must free every exported request exactly once, no engine process
  may have died or restarted, and both event logs replay clean
  (`core.replay`).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvhandoff.adapters.vllm.cluster import EngineFailed, free_port
from kvhandoff.adapters.vllm.demo import (
    DemoOptions,
    _events,
    _wait,
    analyse_logs,
    p_and_replay_problems,
    reported,
)
from kvhandoff.adapters.vllm.params import DEBUG_DELAY_KEY, DEBUG_HOLD_KEY, UNCANCELLED_HOLD_S
from kvhandoff.adapters.vllm.serve import ServeProcess, ServeSpec
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model
from kvhandoff.core.safelog import get_logger

WORDS = ("the rain in spain falls mainly on a plain while old ships sail north past quiet "
         "harbours and bright towers of glass hum with the songs of distant engines").split()
HTTP_TIMEOUT_S = 300.0
CANCEL_ATTEMPTS = 3  # per cancelled request: a hang-up vLLM's API server never reported
# D's read timeout in the demo: longer than a READ is held for a hang-up that never comes.
D_READ_TIMEOUT_S = UNCANCELLED_HOLD_S + 30


def text_prompts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` text prompts of ``lo``..``hi`` words (the tiny tokenizer: ~2-4 tokens a word)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def _processes(server: ServeProcess) -> set[tuple[int, float, str]]:
    """(pid, start time, name) of a server's API process and every process below it."""
    import psutil

    root = psutil.Process(server.proc.pid)
    procs = [root, *root.children(recursive=True)]
    out = set()
    for p in procs:
        try:
            out.add((p.pid, p.create_time(), p.name()))
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(procs: set[tuple[int, float, str]]) -> list[str]:
    """Those of ``procs`` that no longer run (a restarted process has a new start time),
    as ``name(pid)``."""
    import psutil

    gone = []
    for pid, created, name in sorted(procs):
        try:
            alive = psutil.Process(pid).create_time() == created
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            gone.append(f"{name}({pid})")
    return gone


class _Router:
    """The example router in this process (uvicorn on a thread), as the serve tests run it."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        import uvicorn

        from kvhandoff.adapters.vllm.router import build_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(prefill_url, decode_url),
                                                    host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="router")
        self.thread.start()
        _wait(lambda: self.server.started or not self.thread.is_alive(), 30, "the router")
        if not self.server.started:
            raise EngineFailed(f"the router did not start on port {self.port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class _Watch:
    """The longest stall seen during the batch, per process: this one (how late a 0.25 s
    tick woke: the GIL held, the process descheduled or paged in) and each server's API
    server (how long its ``/health`` took to answer, this process's own stall included;
    vLLM's ``/health`` answers from the API server's event loop, not its engine core).
    A stall longer than the lease frees what D had yet to read, and D then fails those
    requests: this tells which process stood still.  Each measure runs on its own thread."""

    TICK_S = 0.25

    def __init__(self, servers: dict[str, str]) -> None:
        import httpx

        self.worst = {"demo": 0.0} | dict.fromkeys(servers, 0.0)
        self._servers, self._client = servers, httpx.Client(timeout=HTTP_TIMEOUT_S)
        self._asking: tuple[str, float] | None = None  # (server, since) while a call waits
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=run, daemon=True, name=f"stall-watch-{name}")
                         for name, run in (("tick", self._tick), ("health", self._health))]
        for thread in self._threads:
            thread.start()

    def _took(self, name: str, since: float) -> None:
        self.worst[name] = max(self.worst[name], time.monotonic() - since)

    def _tick(self) -> None:
        while True:
            t = time.monotonic()
            if self._stop.wait(self.TICK_S):
                return
            self._took("demo", t + self.TICK_S)

    def _health(self) -> None:
        while not self._stop.wait(self.TICK_S):
            for name, url in self._servers.items():
                self._asking = (name, time.monotonic())
                try:
                    self._client.get(f"{url}/health")
                except Exception:  # a server gone is counted elsewhere (engine_restarts)
                    pass
                self._took(*self._asking)
                self._asking = None

    def stop(self) -> dict[str, float]:
        """The worst per process (a call still unanswered counts as long as it waited)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(2.0)
        if (asking := self._asking) is not None:
            self._took(*asking)
        if not self._threads[1].is_alive():  # (else the daemon thread's call still uses it)
            self._client.close()
        return {name: round(s, 2) for name, s in self.worst.items()}


class _Run:
    """One run: the servers, the router and the request bodies."""

    def __init__(self, opts: DemoOptions, workdir: Path, model: str) -> None:
        self.opts, self.workdir, self.model = opts, workdir, model
        self.log_dir = workdir / "events"
        self.p_log = self.log_dir / "demo-P.P0.jsonl"
        self.d_log = self.log_dir / "demo-D.D0.jsonl"
        self.servers: list[ServeProcess] = []
        self.router: _Router | None = None

    def start(self) -> tuple[ServeProcess, ServeProcess]:
        serve_args = ("--no-enable-prefix-caching",) if self.opts.model == "mamba2" else ()
        side_port = free_port()
        common = {"lease_s": self.opts.lease_s, "log_dir": str(self.log_dir)}
        # vLLM's CPU workers pin themselves to VLLM_CPU_OMP_THREADS_BIND: P and D
        # on one core time out every hand-off's handshake.
        p = ServeProcess(ServeSpec("P", "prefill", self.model, "demo-P", dict(common),
                                   side_channel_port=side_port, cpus="0",
                                   extra_args=serve_args), self.workdir)
        self.servers.append(p)
        # The cancelled requests' READs are held until their client's hang-up reaches D
        # (DEBUG_HOLD_KEY), however late a loaded API server reports it: D's read timeout
        # must outlast that hold, or it fails the READ before the cancel lands.
        d = ServeProcess(ServeSpec("D", "decode", self.model, "demo-D", {
            **common, "debug_read_delay_param": True,
            "read_timeout_s": D_READ_TIMEOUT_S,
            "trusted_producers": [f"127.0.0.1:{side_port}"]}, cpus="1",
            # --enable-log-requests: D's log says when its API server aborted a request
            extra_args=(*serve_args, "--enable-log-requests")), self.workdir)
        self.servers.append(d)
        return p, d

    def stop(self) -> dict[str, int | None]:
        if self.router is not None:
            self.router.stop()
        codes: dict[str, int | None] = {}
        for s in reversed(self.servers):
            codes[s.spec.name] = s.stop(signal.SIGINT, timeout_s=60) if s.alive() else s.proc.returncode
        return codes

    def body(self, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}


def _completion(r: Any) -> dict[str, Any]:
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:300]}
    choice = r.json()["choices"][0]
    return {"status": 200, "text": choice["text"], "token_ids": choice.get("token_ids"),
            "finish_reason": choice.get("finish_reason")}


def completion_chunk(line: str) -> dict[str, Any] | None:
    """One line of vLLM's streamed ``/v1/completions`` answer, as the clients here read
    it: ``None`` for a line with no chunk (blank, ``data: [DONE]``), else the first
    choice's ``text``, ``token_ids`` and ``finish_reason``, or vLLM's ``error`` (the
    chunk vLLM sends, with no choices, for a request that failed mid-stream)."""
    if not line.startswith("data: {"):
        return None
    chunk = json.loads(line[6:])
    if "error" in chunk:
        return {"error": chunk["error"]}
    choice = chunk["choices"][0]
    return {"text": choice.get("text") or "", "token_ids": choice.get("token_ids") or [],
            "finish_reason": choice.get("finish_reason")}


def _streamed(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    text, token_ids, finish = "", [], None
    with client.stream("POST", url, json=body | {"stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.text[:300]}
        for line in r.iter_lines():
            if (chunk := completion_chunk(line)) is None:
                continue
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"], "text": text,
                        "token_ids": token_ids, "finish_reason": "error", "streamed": True}
            text += chunk["text"]
            token_ids += chunk["token_ids"]
            finish = chunk["finish_reason"] or finish
    return {"status": 200, "text": text, "token_ids": token_ids, "finish_reason": finish,
            "streamed": True}


def _timeline(evs: list, beats: bool = False) -> list[tuple[str, float, str]]:
    """One request's events in D's log as (kind, seconds after its first, reason or ""),
    its heartbeats and acknowledgements left out unless ``beats``."""
    t0 = evs[0].t if evs else 0.0
    return [(e.kind, round(e.t - t0, 3), getattr(e, "reason", "")) for e in evs
            if beats or e.kind not in ("heartbeat_sent", "lease_acknowledged")]


def _failures(evs: list) -> dict[str, list[tuple[str, float, str]]]:
    """Every event of each request D failed (rejected, a READ failed, or released without
    serving, the client still there): its `_timeline`, heartbeats included."""
    failed = {e.request_id for e in evs if e.kind in ("rejected", "split_failed")
              or (e.kind == "release_sent" and e.notify_only)}
    failed -= {e.request_id for e in evs if e.kind == "client_cancelled"}
    return {rid: _timeline([e for e in evs if e.request_id == rid], beats=True)
            for rid in sorted(failed)}


def _landed_mid_read(kinds: list[str]) -> bool:
    """D heard the client's cancel after posting the READ and before it completed."""
    return ("reads_posted" in kinds and "client_cancelled" in kinds and "split_completed" in kinds
            and kinds.index("reads_posted") < kinds.index("client_cancelled")
            < kinds.index("split_completed"))


def abort_logged(serve_log: Path, local_id: str) -> bool:
    """Whether D's API server logged its abort of D's request ``local_id`` (vLLM's
    ``Request <id> aborted.`` under ``--enable-log-requests``; the id without the suffix
    vLLM adds to a request's own)."""
    text = serve_log.read_text(errors="replace") if serve_log.exists() and local_id else ""
    return f"Request {local_id.rsplit('-', 1)[0]} aborted." in text


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def run_http_demo(opts: DemoOptions, progress: Any = None) -> dict[str, Any]:
    """Run the demo on the serve route; ``progress(stage, detail)`` is told what is happening."""
    import httpx

    say = progress or (lambda stage, detail="": None)
    n = opts.requests
    if n < opts.cancel + 2:
        raise ValueError(f"--requests {n}: needs at least --cancel ({opts.cancel}) + 2 "
                         f"(one completed through the router, one malformed)")
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="kvhandoff-demo-http-"))
    model = str(write_tiny_model(opts.model, workdir / f"model-{opts.model}"))
    say("model", model)
    run = _Run(opts, workdir, model)
    prompts = text_prompts(n, 40, 120, opts.seed)
    rids = list(range(n))
    cancel = set(rids[1:1 + 3 * opts.cancel:3][:opts.cancel])
    malformed = rids[-1]
    routed = [i for i in rids if i not in cancel and i != malformed]
    out = opts.output_tokens
    t0 = time.monotonic()
    watch: _Watch | None = None
    try:
        p, d = run.start()
        say("starting", f"vllm serve P (core 0) and D (core 1); logs in {workdir}")
        p.wait_ready()
        d.wait_ready()
        start_s = time.monotonic() - t0
        run.router = _Router(p.url, d.url)
        say("ready", f"engines up in {start_s:.0f}s; router at {run.router.url}")
        procs = _processes(p) | _processes(d)
        watch = _Watch({"P": p.url, "D": d.url})
        client = httpx.Client(timeout=HTTP_TIMEOUT_S)

        say("reference", f"{n} prompts decoded by P alone")
        with ThreadPoolExecutor(n) as pool:
            ref = list(pool.map(lambda i: _completion(client.post(
                f"{p.url}/v1/completions", json=run.body(prompts[i], out))), rids))
        bad_ref = [i for i in rids if ref[i]["status"] != 200]
        if bad_ref:
            raise EngineFailed(f"P's reference answers failed: {ref[bad_ref[0]]}")

        def prefill(i: int) -> dict[str, Any]:
            return prefill_prompt(prompts[i])

        def prefill_prompt(prompt: str) -> dict[str, Any]:
            """The router's first half: P prefills, its answer carries D's parameters."""
            r = client.post(f"{p.url}/v1/completions", json=run.body(
                prompt, 1, kv_transfer_params={"do_remote_decode": True}))
            r.raise_for_status()
            return r.json()["kv_transfer_params"]

        def through_router(i: int) -> dict[str, Any]:
            url, body = f"{run.router.url}/v1/completions", run.body(prompts[i], out)
            t = time.monotonic()
            res = (_streamed(client, url, body) if routed.index(i) % 2
                   else _completion(client.post(url, json=body)))
            return res | {"latency_ms": (time.monotonic() - t) * 1e3}

        def cancel_once(i: int, attempt: int) -> tuple[str, list]:
            """Prefill, send D the request, hang up once D posted the READ: (P's request
            id, D's events up to the release)."""
            prompt = prompts[i] if attempt == 0 else f"{prompts[i]} {WORDS[attempt]}"
            params = prefill_prompt(prompt)
            rid = params["remote_request_id"]
            data = json.dumps(run.body(prompt, out, kv_transfer_params={
                **params, DEBUG_DELAY_KEY: opts.slow_read_s, DEBUG_HOLD_KEY: True})).encode()
            # A raw socket: an HTTP client would wait for the answer's headers, which a
            # non-streaming request only gets at the end.
            with socket.create_connection(("127.0.0.1", d.spec.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
                _wait(lambda: any(e.kind == "reads_posted" for e in _events(run.d_log, rid)),
                      60, f"D to post the READ of {rid}")
            # closed: vLLM's API server aborts the request; D holds the READ until then
            return rid, _wait(lambda: (evs := _events(run.d_log, rid)) and any(
                e.kind == "release_sent" for e in evs) and evs,
                D_READ_TIMEOUT_S + 30, f"D to release {rid}", 0.2)

        def cancelled_mid_read(i: int) -> dict[str, Any]:
            """A client gone while D's READ is in flight.  An attempt whose hang-up did not
            reach D's engine while the READ was held (`UNCANCELLED_HOLD_S`: vLLM's API
            server reported it late or never) never made the scenario: it is named in
            the summary and another is made, up to `CANCEL_ATTEMPTS`."""
            missed = []
            for attempt in range(CANCEL_ATTEMPTS):
                rid, evs = cancel_once(i, attempt)
                if _landed_mid_read([e.kind for e in evs]):
                    break
                missed.append({"rid": rid, "events": _timeline(evs), "local_id": next(
                    (e.local_request_id for e in evs if e.kind == "admitted"), "")})
            return {"rid": rid, "missed": missed}

        def garbage(i: int) -> dict[str, Any]:
            params = prefill(i)
            bad = {**params, "remote_block_ids": [[-1, "not-a-block"]]}
            r = client.post(f"{d.url}/v1/completions",
                            json=run.body(prompts[i], out, kv_transfer_params=bad))
            return {"rid": params["remote_request_id"], "status": r.status_code,
                    "error": r.text[:300]}

        say("batch", f"{n} requests: {len(routed)} through the router, {len(cancel)} cancelled "
                     f"mid-read, 1 malformed")
        jobs = {i: (cancelled_mid_read if i in cancel else garbage if i == malformed
                    else through_router) for i in rids}
        with ThreadPoolExecutor(n) as pool:
            got = dict(zip(rids, pool.map(lambda i: jobs[i](i), rids), strict=True))

        say("draining", "waiting for P to free every exported request")

        def all_freed() -> bool:
            evs = _events(run.p_log)
            exported = {e.request_id for e in evs if e.kind == "exported"}
            freed = {e.request_id for e in evs if e.kind == "freed"}
            return bool(exported) and exported <= freed
        t_batch = time.monotonic()
        try:
            _wait(all_freed, opts.lease_s + 30, "P to free every exported request", 0.2)
            freed_after_s: float | None = round(time.monotonic() - t_batch, 2)
        except TimeoutError:
            freed_after_s = None  # counted below: p_frees < p_exports
        gone = _gone(procs)
        engine_restarts = len(gone) + sum(not s.alive() for s in run.servers)
        # A restarted engine moves its predecessor's log aside (<engine>.P0.<time>.jsonl).
        engine_restarts += len(list(run.log_dir.glob("demo-*.*.*.jsonl")))
        client.close()
    finally:
        try:
            stalls = watch.stop() if watch is not None else {}
            # on stderr also when the batch raised (no summary then)
            get_logger(__name__).info("demo.longest_stall_s", **stalls)
        finally:
            exit_codes = run.stop()
    logs = [str(run.p_log), str(run.d_log)]
    say("replay", " ".join(logs))
    analysis = analyse_logs(logs)

    completed = [i for i in routed if got[i]["status"] == 200
                 and got[i]["finish_reason"] == "length"]
    mismatched = [i for i in completed if (got[i]["text"], got[i]["token_ids"])
                  != (ref[i]["text"], ref[i]["token_ids"])]
    failed = {i: got[i] for i in routed if i not in completed}

    d_kinds = {i: [e.kind for e in _events(run.d_log, got[i]["rid"])] for i in cancel}

    def mid_read(i: int) -> bool:
        return _landed_mid_read(d_kinds[i])
    m = got[malformed]
    return {
        "model": opts.model,
        "route": "http",
        "requests": n,
        "through_router": len(routed),
        "streamed": sum(1 for i in routed if got[i].get("streamed")),
        "completed": len(completed),
        "failed": {str(i): r for i, r in failed.items()},
        "tokens_match": bool(completed) and not mismatched,
        "mismatched": mismatched,
        "distinct_outputs": len({tuple(got[i]["token_ids"]) for i in completed}),
        # what D's log says went wrong, per request (the malformed one's rejection included)
        "d_failures": _failures(_events(run.d_log)),
        "cancel_planned": len(cancel),
        "cancelled": sum(mid_read(i) for i in cancel),
        "cancel_events": {got[i]["rid"]: _timeline(_events(run.d_log, got[i]["rid"]))
                          for i in sorted(cancel) if not mid_read(i)},
        # attempts whose hang-up never reached D while the READ was held (tried again)
        "cancel_missed": [{"rid": m["rid"], "events": m["events"], "d_api_server_abort":
                           abort_logged(d.log_path, m["local_id"])}
                          for i in sorted(cancel) for m in got[i]["missed"]],
        "rejected": int(m["status"] >= 400),
        "malformed_status": m["status"],
        "malformed_rejected_in_d_log": any(e.kind == "rejected"
                                           for e in _events(run.d_log, m["rid"])),
        "engine_restarts": engine_restarts,
        "longest_stall_s": stalls,
        "engine_processes_gone": gone,
        "p_all_freed_after_s": freed_after_s,
        "exit_codes": exit_codes,
        **reported(analysis),
        "latency_ms_median": _median([got[i]["latency_ms"] for i in completed]),
        "engine_start_s": round(start_s, 1),
        "event_logs": logs,
        "replay_command": "kvhandoff replay --check " + " ".join(logs),
        "serve_logs": [str(s.log_path) for s in run.servers],
        "workdir": str(workdir),
    }


def http_demo_problems(s: dict[str, Any]) -> list[str]:
    """The HTTP demo's checks that failed, each named with what was found (empty: all held)."""
    return [why for failed, why in [
        (s["completed"] != s["through_router"],
         f"{s['completed']} of {s['through_router']} requests through the router completed "
         f"(failed: {s['failed']}; D's failures: {s['d_failures']}; longest stall per "
         f"process, s: {s.get('longest_stall_s')})"),
        (not s["tokens_match"], f"tokens do not equal P's own (mismatched: {s['mismatched']})"),
        (s["cancelled"] != s["cancel_planned"],
         f"{s['cancelled']} of {s['cancel_planned']} cancels landed mid-read "
         f"(D's events per cancelled request: {s['cancel_events']}; attempts whose hang-up "
         f"never reached D: {s['cancel_missed']}; longest stall per process, s: "
         f"{s.get('longest_stall_s')})"),
        (s["rejected"] != 1, f"the malformed request was answered {s['malformed_status']}"),
        (s["engine_restarts"] != 0, f"{s['engine_restarts']} engine processes died or restarted "
                                        f"(gone: {s['engine_processes_gone']})"),
        (s["p_exports"] == 0, "P exported nothing"),
    ] if failed] + p_and_replay_problems(s)

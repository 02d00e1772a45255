"""End-to-end on the serve route: ``vllm serve`` P and D behind the example router.

What users run (docs/operator-guide.md): two OpenAI servers with
``--kv-transfer-config`` and a router that hands P's ``kv_transfer_params`` to
D unchanged, plus a plain ``vllm serve`` of the same model as the reference.
One P, one D and one reference serve the whole module and
test_vllm_toy_proxy (conftest's ``serve_route``: engine start dominates the
cost).  The order is explicit (``phase`` and ``engines`` markers, conftest):
the check over every export runs after all traffic, then, after the toy
proxy's tests too, D is killed, then P is stopped.

The evidence is what users would look at: HTTP status codes, D's text and
token ids against the reference engine, and the event logs on disk while
the engines run (they are written every engine step; nothing here asks an
engine to flush).  The last tests check that P freed every exported request
exactly once and that ``kvhandoff replay --check`` over both logs is clean,
then kill D with ``kill -9`` and stop P with Ctrl-C and replay what is left
(SIGTERM / SIGINT flushing the log is checked without engines in
test_vllm_units).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest
from conftest import counting_listener, wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.adapters.vllm.http_demo import abort_logged  # noqa: E402
from kvhandoff.adapters.vllm.params import (  # noqa: E402
    DEBUG_DELAY_KEY,
    DEBUG_HOLD_KEY,
    UNCANCELLED_HOLD_S,
)
from kvhandoff.adapters.vllm.serve import ServeProcess, ServeSpec  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model  # noqa: E402
from kvhandoff.core.log import read_log  # noqa: E402

LEASE_S = 20.0  # > the time a request waits for D's admission on a loaded 2-core host
READ_TIMEOUT_S = 30.0  # D fails a READ still in flight after this
SLOW_READ_S = 2.5
OUT = 8
pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("serve_route")]

WORDS = ("the rain in spain falls mainly on a plain while old ships sail north past quiet "
         "harbours and bright towers of glass hum with the songs of distant engines").split()


def text_prompt(seed: int, words: int = 60) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Route:
    """The engines, the router and the log files of the module (``kind``: the tiny model;
    ``serve_args``: more ``vllm serve`` flags for all three engines)."""

    def __init__(self, workdir: Path, kind: str = "llama", serve_args: tuple[str, ...] = (),
                 api_key: str | None = None) -> None:
        self.workdir = workdir
        # ``vllm serve --api-key``: every /v1 call needs it, the router passes it on.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            serve_args = (*serve_args, "--api-key", api_key)
        self.model = str(write_tiny_model(kind, workdir / "model"))
        self.log_dir = workdir / "events"
        self.side_port = free_port()
        common = {"lease_s": LEASE_S, "heartbeat_interval_s": 1.0, "lease_margin_s": 0.5,
                  "read_timeout_s": READ_TIMEOUT_S, "handshake_timeout_s": 10.0,
                  "log_dir": str(self.log_dir)}
        # vLLM's CPU workers pin themselves to these cores and spin while their
        # engine holds any request (a P holding a lease included): P alone on
        # core 0, or the reference starves behind a P that holds a lease.
        self.p = ServeProcess(ServeSpec("P", "prefill", self.model, "serve-P", dict(common),
                                        side_channel_port=self.side_port, cpus="0",
                                        extra_args=serve_args), workdir)
        self.d = ServeProcess(ServeSpec("D", "decode", self.model, "serve-D", {
            **common, "debug_read_delay_param": True,
            "trusted_producers": [f"127.0.0.1:{self.side_port}", "127.0.0.1:1"]}, cpus="1",
            # --enable-log-requests: D's log says when its API server aborted a request
            extra_args=(*serve_args, "--enable-log-requests")), workdir)
        self.ref = ServeProcess(ServeSpec("REF", "plain", self.model, cpus="1",
                                          extra_args=serve_args), workdir)
        self.p_log = self.log_dir / "serve-P.P0.jsonl"
        self.d_log = self.log_dir / "serve-D.D0.jsonl"
        self.router_url = ""
        self._router = None

    def start(self) -> None:
        for e in (self.p, self.d, self.ref):
            e.wait_ready()
        self._start_router()

    def _start_router(self) -> None:
        import uvicorn

        from kvhandoff.adapters.vllm.router import build_app

        port = free_port()
        self._router = uvicorn.Server(uvicorn.Config(build_app(self.p.url, self.d.url),
                                                     host="127.0.0.1", port=port,
                                                     log_level="warning"))
        threading.Thread(target=self._router.run, daemon=True, name="router").start()
        wait_for(lambda: self._router.started, 30, "the router to start")
        self.router_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._router is not None:
            self._router.should_exit = True
        for e in (self.d, self.p, self.ref):
            if e.alive():
                e.stop(signal.SIGINT, timeout_s=60)


@pytest.fixture(scope="module")
def route(serve_route):
    return serve_route  # conftest: one route for this module and test_vllm_toy_proxy


# ---- helpers ---------------------------------------------------------------

def body(route: Route, prompt: str, max_tokens: int = OUT, **extra) -> dict:
    return {"model": route.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def reference(route: Route, prompt: str, max_tokens: int = OUT) -> dict:
    r = httpx.post(f"{route.ref.url}/v1/completions", json=body(route, prompt, max_tokens),
                   headers=route.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def prefill(route: Route, prompt: str) -> dict:
    """The router's first half: P prefills, its answer carries D's parameters."""
    r = httpx.post(f"{route.p.url}/v1/completions", timeout=120, headers=route.headers, json=body(
        route, prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True
    return params


def decode(route: Route, prompt: str, params, max_tokens: int = OUT) -> httpx.Response:
    return httpx.post(f"{route.d.url}/v1/completions", timeout=120, headers=route.headers,
                      json=body(route, prompt, max_tokens, kv_transfer_params=params))


def events(path: Path, rid: str | None = None) -> list:
    if not path.exists():
        return []
    evs = read_log(path)  # a live log: a torn last line is dropped with a warning
    return evs if rid is None else [e for e in evs if e.request_id == rid]


def kinds(evs: list) -> list[str]:
    return [e.kind for e in evs]


def wait_event(path: Path, rid: str, kind: str, timeout: float = 30.0) -> list:
    return wait_for(lambda: (evs := events(path, rid)) and kind in kinds(evs) and evs,
                    timeout, f"{kind!r} for {rid} in {path.name}")


def assert_freed_once(route: Route, rid: str, released: bool | None = None) -> list:
    """P frees ``rid`` (within a lease when nobody releases it), once."""
    evs = wait_event(route.p_log, rid, "freed", LEASE_S + 10)
    assert kinds(evs).count("freed") == 1, kinds(evs)
    if released is not None:
        assert ("release_notified" in kinds(evs)) is released, kinds(evs)
        assert ("lease_expired" in kinds(evs)) is not released, kinds(evs)
    return evs


def assert_serves(route: Route, seed: int) -> None:
    """Both engines still serve: a clean hand-off through the router matches the reference."""
    prompt = text_prompt(seed, 40)
    ref = reference(route, prompt, 4)
    r = httpx.post(f"{route.router_url}/v1/completions", json=body(route, prompt, 4),
                   headers=route.headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref["token_ids"]


def serve_log(e: ServeProcess) -> str:
    return e.log_path.read_text(errors="replace")


# ---- clean hand-offs ---------------------------------------------------------

def through_router(route: Route, prompt: str, stream: bool) -> tuple[str, list[int]]:
    """A completion through the router: (text, token ids), streamed chunk by chunk or not."""
    if not stream:
        r = httpx.post(f"{route.router_url}/v1/completions", json=body(route, prompt),
                       headers=route.headers, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        return got["text"], got["token_ids"]
    text, token_ids = "", []
    with httpx.stream("POST", f"{route.router_url}/v1/completions", timeout=120,
                      headers=route.headers, json=body(route, prompt, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()["choices"][0]
                text += chunk["text"]
                token_ids += chunk.get("token_ids") or []
    return text, token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_clean_handoffs_through_the_router_match_the_reference(route, stream):
    prompts = [text_prompt(100 + i + 10 * stream, 30 + 70 * i) for i in range(3)]
    refs = [reference(route, p) for p in prompts]
    assert len({tuple(r["token_ids"]) for r in refs}) == len(refs), "the model ignores its prompt"
    for prompt, ref in zip(prompts, refs, strict=True):
        assert through_router(route, prompt, stream) == (ref["text"], ref["token_ids"])
    # The logs on disk (written while serving) show each hand-off: read, released, freed once.
    exported = [e.request_id for e in events(route.p_log) if e.kind == "exported"]
    for rid in exported[-3:]:
        assert "split_completed" in kinds(events(route.d_log, rid))
        assert_freed_once(route, rid, released=True)


def test_behind_an_api_key_the_router_passes_it_on_and_d_alone_gets_min_tokens(route):
    """The engines run with ``vllm serve --api-key`` (conftest's route).  A client's
    ``Authorization`` reaches P and D through the router; without it P refuses the request
    (401, passed on) and nothing is exported.  ``min_tokens`` and ``stream_options`` go to
    D only: P is asked for one token, which a ``min_tokens`` of 2 or more makes a 400."""
    assert route.headers, "the shared route runs without --api-key"
    prompt = text_prompt(150, 60)
    exported = kinds(events(route.p_log)).count("exported")
    r = httpx.post(f"{route.router_url}/v1/completions", json=body(route, prompt), timeout=120)
    assert r.status_code == 401, r.text
    assert kinds(events(route.p_log)).count("exported") == exported  # P prefilled nothing
    ref = reference(route, prompt)
    r = httpx.post(f"{route.router_url}/v1/completions", headers=route.headers, timeout=120,
                   json=body(route, prompt, min_tokens=OUT))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref["token_ids"]
    token_ids, usage = [], None
    with httpx.stream("POST", f"{route.router_url}/v1/completions", headers=route.headers,
                      timeout=120, json=body(route, prompt, min_tokens=OUT, stream=True,
                                             stream_options={"include_usage": True})) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    token_ids += choice.get("token_ids") or []
    assert token_ids == ref["token_ids"]
    assert usage["completion_tokens"] == OUT  # D's usage, as the client asked
    rids = [e.request_id for e in events(route.p_log) if e.kind == "exported"][exported:]
    assert len(rids) == 2
    for rid in rids:
        assert_freed_once(route, rid, released=True)


# ---- clients that go away ----------------------------------------------------

def _request_then_disconnect(route: Route, prompt: str, params: dict, stream: bool,
                             when) -> None:
    """Send D the request and drop the connection once ``when()`` holds.

    A raw socket: an HTTP client would wait for the response headers, which a
    non-streaming request only gets at the end.
    """
    data = json.dumps(body(route, prompt, 200, kv_transfer_params=params, stream=stream)).encode()
    with socket.create_connection(("127.0.0.1", route.d.spec.port)) as sock:
        auth = "".join(f"{k}: {v}\r\n" for k, v in route.headers.items()).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\n" + auth
                     + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
                     + data)
        when()
    # closed: vLLM's API server sees the disconnect and aborts the request


def cancel_during_read(route: Route, seed: int, stream: bool, attempts: int = 3) -> tuple[str, list]:
    """A client that leaves while D's READ is in flight: (P's request id, D's events
    up to its release), for the caller's oracle to judge.

    D holds the READ until the client's cancel reaches its worker (`DEBUG_HOLD_KEY`)
    and then `SLOW_READ_S` longer, so the cancel lands mid-read however late vLLM's
    API server reports the hang-up, unless that is later than D's read_timeout_s:
    D then fails the READ by its timeout before any ``client_cancelled`` (and releases
    P once the held READ ends: `SLOW_READ_S` after the cancel, or `UNCANCELLED_HOLD_S`
    after the post), and the scenario never happened.  Such an attempt is still checked
    (P frees it once, on D's release) and another is made; any other outcome, a READ
    that failed for any other reason included, is returned as it is.
    """
    missed = []
    for attempt in range(attempts):
        prompt = text_prompt(seed + 1000 * attempt, 120)
        params = prefill(route, prompt)
        rid = params["remote_request_id"]
        slow = {**params, DEBUG_DELAY_KEY: SLOW_READ_S, DEBUG_HOLD_KEY: True}
        _request_then_disconnect(route, prompt, slow, stream,
                                 lambda rid=rid: wait_event(route.d_log, rid, "reads_posted"))
        d_evs = wait_event(route.d_log, rid, "release_sent", UNCANCELLED_HOLD_S + 10)
        k = kinds(d_evs)
        failed = next((e for e in d_evs if e.kind == "split_failed"), None)
        if (failed is None or not failed.reason.startswith("read timeout")
                or ("client_cancelled" in k and
                    k.index("client_cancelled") < k.index("split_failed"))):
            return rid, d_evs
        assert_freed_once(route, rid, released=True)
        t0 = d_evs[0].t
        missed.append([(e.kind, round(e.t - t0, 3)) for e in d_evs])
        local = next((e.local_request_id for e in d_evs if e.kind == "admitted"), "")
        warnings.warn(f"a hang-up never reached D's worker within read_timeout_s (attempt "
                      f"{attempt + 1} of {attempts}, tried again; D's API server logged the "
                      f"abort: {abort_logged(route.d.log_path, local)}): {missed[-1]}",
                      stacklevel=1)
    raise AssertionError(f"no cancel reached D's worker within read_timeout_s in {attempts} "
                         f"attempts (D's events, seconds after admission): {missed}")


def assert_p_outlived_the_reads(route: Route, rid: str, d_evs: list) -> list:
    """The promise for a client gone during the reads (`cancel_during_read`'s outcome): D
    heard the cancel after posting its READs and before any completed, and P freed the
    blocks once, on D's release, no earlier than D's last READ completed.  P's events."""
    k = kinds(d_evs)
    assert k.index("reads_posted") < k.index("client_cancelled") < k.index("split_completed"), k
    last_read = max(e.t for e in d_evs if e.kind == "split_completed")
    p_evs = assert_freed_once(route, rid, released=True)
    assert next(e.t for e in p_evs if e.kind == "freed") >= last_read
    return p_evs


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("stage", ["before_read", "during_read", "after_read"])
def test_client_disconnects_never_free_blocks_under_a_read(route, stage, stream):
    seed = 200 + 2 * ["before_read", "during_read", "after_read"].index(stage) + stream
    if stage == "during_read":
        p_evs = assert_p_outlived_the_reads(route, *cancel_during_read(route, seed, stream))
    else:
        prompt = text_prompt(seed, 120)
        params = prefill(route, prompt)
        rid = params["remote_request_id"]
    if stage == "before_read":
        # Gone before D took the request: nothing reaches D's engine but vLLM's
        # clean-up request (notify_kv_transfer_request_rejected), or the
        # request is aborted before its read is posted.  Which one ran depends
        # on timing; each has its own evidence.
        _request_then_disconnect(route, prompt, params, stream, lambda: None)
        p_evs = assert_freed_once(route, rid)
        d_evs = wait_event(route.d_log, rid, "release_sent")
        k = kinds(d_evs)
        (release,) = [e for e in d_evs if e.kind == "release_sent"]
        if "reads_posted" in k:  # the read went out first: it drained, then P was released
            assert k.index("reads_posted") < k.index("finished_recving") < k.index("release_sent")
        else:  # never read: a notify-only release, nothing reported to vLLM as received
            assert release.notify_only and "finished_recving" not in k, k
            assert "client_cancelled" in k and "rejected" not in k, k
    elif stage == "after_read":
        def after_read():
            wait_event(route.d_log, rid, "release_sent")
        _request_then_disconnect(route, prompt, params, stream, after_read)
        d_evs = events(route.d_log, rid)
        assert "client_cancelled" not in kinds(d_evs)
        p_evs = assert_freed_once(route, rid, released=True)
    assert "lease_expired" not in kinds(p_evs) or stage == "before_read"
    assert_serves(route, 300 + len(stage) + stream)


def test_the_same_params_twice_are_read_once(route):
    prompt = text_prompt(400, 80)
    ref = reference(route, prompt)
    params = prefill(route, prompt)
    first = decode(route, prompt, params)
    assert first.status_code == 200 and first.json()["choices"][0]["token_ids"] == ref["token_ids"]
    again = decode(route, prompt, params)  # a client retry after the release went out
    assert again.status_code >= 400, again.text
    # Both at once: exactly one is served, the other fails.
    params2 = prefill(route, prompt)
    with httpx.Client(timeout=120, headers=route.headers) as client:
        out: list = [None, None]

        def send(i: int) -> None:
            out[i] = client.post(f"{route.d.url}/v1/completions",
                                 json=body(route, prompt, kv_transfer_params=params2))
        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(r.status_code >= 400 for r in out) == [False, True], [r.text for r in out]
    for p in (params, params2):
        d_evs = events(route.d_log, p["remote_request_id"])
        assert kinds(d_evs).count("admitted") == 1 and kinds(d_evs).count("reads_posted") == 1
        assert_freed_once(route, p["remote_request_id"], released=True)
    assert "single-use" in serve_log(route.d)
    assert_serves(route, 401)


def test_a_batch_with_random_disconnects(route):
    rng = random.Random(7)
    prompts = [text_prompt(500 + i, rng.randint(20, 150)) for i in range(8)]
    refs = [reference(route, p) for p in prompts]
    leave = {i: rng.uniform(0.05, 1.5) for i in rng.sample(range(8), 3)}
    results: dict[int, object] = {}

    def client(i: int) -> None:
        timeout = leave.get(i, 120.0)
        try:
            with httpx.Client(timeout=timeout, headers=route.headers) as c:
                results[i] = c.post(f"{route.router_url}/v1/completions",
                                    json=body(route, prompts[i], 32))
        except httpx.TimeoutException:
            results[i] = "left"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, ref in enumerate(refs):
        r = results[i]
        if r == "left":
            continue
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference(route, prompts[i], 32)["token_ids"]
        assert ref["token_ids"] == r.json()["choices"][0]["token_ids"][:OUT]
    assert_serves(route, 501)


# ---- malformed and hostile parameters ----------------------------------------

# case: (what the router would have sent instead of P's parameters, what D's log says)
HOSTILE = {
    "missing_block_ids": (lambda p, o: {k: v for k, v in p.items() if k != "remote_block_ids"},
                          "missing field 'remote_block_ids'"),
    "missing_engine": (lambda p, o: {k: v for k, v in p.items() if k != "remote_engine_id"},
                       "missing field 'remote_engine_id'"),
    "port_is_text": (lambda p, o: {**p, "remote_port": "5600"}, "remote_port"),
    "port_out_of_range": (lambda p, o: {**p, "remote_port": 70000}, "remote_port"),
    "tp_size_zero": (lambda p, o: {**p, "tp_size": 0}, "tp_size"),
    "tp_size_two": (lambda p, o: {**p, "tp_size": 2}, "tp_size"),
    "num_tokens_wrong": (lambda p, o: {**p, "remote_num_tokens": p["remote_num_tokens"] + 1},
                         "remote_num_tokens"),
    "num_tokens_text": (lambda p, o: {**p, "remote_num_tokens": "many"}, "remote_num_tokens"),
    "lease_negative": (lambda p, o: {**p, "lease_s": -1}, "lease_s"),
    "negative_block": (lambda p, o: {**p, "remote_block_ids": [[-5, *p["remote_block_ids"][0][1:]]]},
                       "remote_block_ids"),
    "block_beyond_pool": (lambda p, o: {**p, "remote_block_ids": [[10**9, *p["remote_block_ids"][0][1:]]]},
                          "remote_block_ids"),
    "block_is_float": (lambda p, o: {**p, "remote_block_ids": [[1.5, *p["remote_block_ids"][0][1:]]]},
                       "remote_block_ids"),
    "blocks_flat": (lambda p, o: {**p, "remote_block_ids": p["remote_block_ids"][0]},
                    "remote_block_ids"),
    "blocks_two_groups": (lambda p, o: {**p, "remote_block_ids": p["remote_block_ids"] * 2},
                          "remote_block_ids"),
    "blocks_nested": (lambda p, o: {**p, "remote_block_ids": [[p["remote_block_ids"][0]]]},
                      "remote_block_ids"),
    "blocks_duplicate": (lambda p, o: {**p, "remote_block_ids": [[p["remote_block_ids"][0][0]] * len(p["remote_block_ids"][0])]},
                         "duplicate block id"),
    "blocks_too_few": (lambda p, o: {**p, "remote_block_ids": [p["remote_block_ids"][0][:-1]]},
                       "remote_block_ids"),
    "a_million_blocks": (lambda p, o: {**p, "remote_block_ids": [list(range(10**6))]},
                         "remote_block_ids"),
    "unknown_engine": (lambda p, o: {**p, "remote_engine_id": "no-such-engine"}, "remote_engine_id"),
    "other_live_request": (lambda p, o: {**p, "remote_request_id": o["remote_request_id"]},
                           "single-use"),
    "wrong_release_token": (lambda p, o: {**p, "release_token": "0" * 32}, "UNSAFE"),
    "token_too_long": (lambda p, o: {**p, "release_token": "x" * 1000}, "release_token"),
    "other_protocol": (lambda p, o: {**p, "protocol": "nixl/9"}, "protocol"),
    "params_a_list": (lambda p, o: [p], "valid dictionary"),  # vLLM's API server refuses it
    "do_remote_prefill_text": (lambda p, o: {**p, "do_remote_prefill": "yes"}, "do_remote_prefill"),
    "empty_request_id": (lambda p, o: {**p, "remote_request_id": ""}, "remote_request_id"),
    "address_of_no_p": (None, "trusted_producers"),  # the test's loopback listener, not trusted
    "untrusted_host": (lambda p, o: {**p, "remote_host": "10.255.255.1"}, "trusted_producers"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_params_fail_that_request_and_everything_else_goes_on(route, case):
    prompt = text_prompt(600 + sorted(HOSTILE).index(case), 90)
    params = prefill(route, prompt)
    rid = params["remote_request_id"]
    other = None
    if case == "other_live_request":  # a request D is reading right now, slowly
        other = prefill(route, text_prompt(700, 90))
        slow = threading.Thread(target=decode, args=(route, text_prompt(700, 90),
                                                     {**other, DEBUG_DELAY_KEY: SLOW_READ_S}))
        slow.start()
        wait_event(route.d_log, other["remote_request_id"], "reads_posted")
    listener, attempts = counting_listener()
    mutate, reason = HOSTILE[case]
    seen = len(serve_log(route.d))
    try:
        if case == "address_of_no_p":
            bad = {**params, "remote_port": listener.getsockname()[1]}
        else:
            bad = mutate(params, other)
        r = decode(route, prompt, bad)
        assert r.status_code >= 400, (r.status_code, r.text[:300])
    finally:
        listener.close()
    # D's log names what was wrong (the worker's stdout is D's server log), or
    # vLLM's API server refused the request before the engine saw it.
    wait_for(lambda: reason in r.text or any(
        reason in line for line in serve_log(route.d)[seen:].splitlines() if "[error" in line),
        30, f"D's log or answer to say {reason!r}")
    assert attempts == [], "D connected to an address outside trusted_producers"
    if other is not None:
        slow.join(60)
        assert_freed_once(route, other["remote_request_id"], released=True)
    # P gets its blocks back once: at once when D could name the request, else after a lease.
    d_evs = events(route.d_log, rid)
    if "rejected" in kinds(d_evs):  # D could name P's request: P is released at once
        assert next(e for e in d_evs if e.kind == "rejected").reason
        assert_freed_once(route, rid, released=True)
    # otherwise P frees by lease: test_every_export_so_far_is_freed_exactly_once checks it
    assert_serves(route, 800 + sorted(HOSTILE).index(case))


# ---- what operators alert on ------------------------------------------------

def _metrics(url: str) -> dict[str, float]:
    """An engine's /metrics as {sample with its labels: value}."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in r.text.splitlines() if line and not line.startswith("#")}


def _total(samples: dict[str, float], name: str, where: str = "") -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and where in k)


def test_the_dashboard_and_alerts_name_only_metrics_the_engines_export(route):
    """Every metric the docs/monitoring dashboard and alert rules query is on P's and D's
    /metrics; a rejection shows up there by its class, a hand-off as P's export and D's read."""
    from test_vllm_units import monitoring_expressions, promql_metric_names

    from kvhandoff.adapters.vllm.stats import REJECT_REASONS

    assert_serves(route, 960)
    d_before = _metrics(route.d.url)
    prompt = text_prompt(961, 90)
    params = prefill(route, prompt)
    bad = decode(route, prompt, {**params, "remote_num_tokens": params["remote_num_tokens"] + 1})
    assert bad.status_code >= 400, bad.text
    rejected = 'reason="geometry"'
    d = wait_for(lambda: (m := _metrics(route.d.url)) and _total(
        m, "vllm:kvhandoff_rejected_by_reason_total", rejected) > _total(
        d_before, "vllm:kvhandoff_rejected_by_reason_total", rejected) and m,
        60, "D's /metrics to count the rejection as geometry")
    p = wait_for(lambda: (m := _metrics(route.p.url)) and _total(
        m, "vllm:kvhandoff_leases_exported_total") > 0 and m, 60, "P's /metrics to count exports")
    assert _total(d, "vllm:kvhandoff_reads_completed_total") > 0
    assert _total(d, "vllm:kvhandoff_rejected_by_reason_total") == _total(
        d, "vllm:kvhandoff_rejected_total")
    reasons = {k.split('reason="')[1].split('"')[0] for k in d
               if k.startswith("vllm:kvhandoff_rejected_by_reason_total{")}
    assert reasons == set(REJECT_REASONS), reasons  # every class, at zero or more; no others
    names = {where: promql_metric_names(expr) for where, expr in monitoring_expressions()}
    assert len(names) > 20 and all(names.values()), names
    for engine, samples in (("P", p), ("D", d)):
        exported = {k.split("{")[0] for k in samples}
        missing = {where: n - exported for where, n in names.items() if n - exported}
        assert not missing, (engine, missing)
    assert_freed_once(route, params["remote_request_id"], released=True)


# ---- the logs tell the truth; engines stopped the way operators stop them ----

def _replay_check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhandoff.adapters.cli", "replay", "--check",
                           *map(str, paths)], capture_output=True, text=True, timeout=300)


@pytest.mark.phase(1)  # after all traffic: it checks every export the module made
def test_every_export_so_far_is_freed_exactly_once_and_replay_is_clean(route):
    assert_serves(route, 950)  # at least one hand-off, whichever tests ran before
    def all_freed():
        evs = events(route.p_log)
        exported = {e.request_id for e in evs if e.kind == "exported"}
        frees = Counter(e.request_id for e in evs if e.kind == "freed")
        return exported and all(frees[r] for r in exported) and (exported, frees)
    exported, frees = wait_for(all_freed, LEASE_S * 3, "P to free every exported request")
    assert all(frees[r] == 1 for r in exported), {r: c for r, c in frees.items() if c != 1}
    result = _replay_check(route.p_log, route.d_log)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "EngineCore encountered a fatal error" not in serve_log(route.d) + serve_log(route.p)
    assert route.p.alive() and route.d.alive()


@pytest.mark.phase(2)  # kills D
def test_kill_9_of_d_keeps_what_reached_the_os_and_p_frees_by_lease(route):
    prompt = text_prompt(900, 100)
    params = prefill(route, prompt)
    rid = params["remote_request_id"]

    def send() -> None:
        try:
            decode(route, prompt, {**params, DEBUG_DELAY_KEY: 30.0})
        except httpx.HTTPError:
            pass  # D died under it
    sender = threading.Thread(target=send)
    sender.start()
    n = kinds(wait_event(route.d_log, rid, "heartbeat_sent")).count("heartbeat_sent")

    def newer_heartbeat():  # D's latest steps, on disk with no flush asked of anyone
        evs = events(route.d_log)
        return kinds([e for e in evs if e.request_id == rid]).count("heartbeat_sent") > n and evs
    before = wait_for(newer_heartbeat, 10, "a newer heartbeat in D's log")
    route.d.kill()  # kill -9 of the API server, the engine core and its worker
    sender.join(60)
    after = read_log(route.d_log)  # a torn last line is dropped with a warning
    assert after[:len(before)] == before, "events on disk before the kill were lost"
    d_evs = [e for e in after if e.request_id == rid]
    assert {"admitted", "validated", "reads_posted", "heartbeat_sent"} <= set(kinds(d_evs))
    p_evs = assert_freed_once(route, rid, released=False)  # the lease lapsed: D is gone
    assert "heartbeat_received" in kinds(p_evs)
    result = _replay_check(route.p_log, route.d_log)  # over what the kill left
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.phase(3)  # stops P
def test_ctrl_c_on_p_exits_cleanly_and_leaves_a_complete_log(route):
    before = events(route.p_log)
    route.p.signal_group(signal.SIGINT)
    returncode = route.p.proc.wait(timeout=60)  # no kill -9 fallback: it must exit by itself
    assert returncode == 0, (returncode, serve_log(route.p)[-2000:])
    data = route.p_log.read_bytes()
    assert data.endswith(b"\n"), "P's log ends in a torn line after Ctrl-C"
    after = read_log(route.p_log)
    assert after[:len(before)] == before
    result = _replay_check(route.p_log, route.d_log)
    assert result.returncode == 0, result.stdout + result.stderr

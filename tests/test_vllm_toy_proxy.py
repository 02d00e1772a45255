"""vLLM's toy proxy's contract: the hand-off driven exactly as vLLM drives NixlConnector's.

vLLM tests its P/D connectors through ``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``, and proxies written for NixlConnector copy it.  That file lives in
vLLM's test tree and is not in the vllm wheel, so `toy_proxy_app` below is its minimal
equivalent, request for request (completions):

* P gets the client's body with ``kv_transfer_params = {"do_remote_decode": true,
  "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
  "remote_host": null, "remote_port": null}``, ``stream: false``, ``max_tokens: 1``
  (and ``max_completion_tokens: 1`` when present), no ``stream_options``, ``min_tokens`` and
  ``min_completion_tokens`` removed, and the headers ``Authorization: Bearer
  $OPENAI_API_KEY`` and ``X-Request-Id: <a fresh uuid4>``;
* D gets the client's body unchanged but for ``kv_transfer_params``, P's answer's copied in,
  with the same two headers (the same X-Request-Id);
* D's answer goes back as a stream of its bytes (``StreamingResponse``), whatever the
  client asked.

(One difference that is the proxy's business, not the hand-off's: a client per request
instead of its pool of kept-alive connections, which race vLLM's keep-alive timeout.)

It runs against real ``vllm serve`` P and D with kvhandoff (test_vllm_serve's engines and
plain reference engine, shared through conftest's ``serve_route``): the tokens equal the
reference's, streamed or not, ``min_tokens`` honoured on D; the shared X-Request-Id is in
both engines' request ids; P frees every export once on D's release; ``kvhandoff replay
--check`` is clean.  Run it under ``flock /tmp/vllm.lock`` (it starts three engines; with test_vllm_serve in
the same run, they start once for both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest
from conftest import SERVE_API_KEY, wait_for
from trace_format import check_trace

pytest.importorskip("vllm")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402  (module level: FastAPI resolves the annotation)
from fastapi.responses import StreamingResponse  # noqa: E402
from test_vllm_serve import (  # noqa: E402
    Route,
    assert_freed_once,
    events,
    kinds,
    reference,
    text_prompt,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("serve_route")]
OUT = 8


def toy_proxy_app(prefill_url: str, decode_url: str):
    """vLLM's toy_proxy_server.py for one P and one D (its round robin over one of each),
    completions only; the X-Request-Id of each request is appended to ``app.state.ids``."""
    app = FastAPI()
    app.state.ids = []

    def headers(request_id: str) -> dict:
        return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}",
                "X-Request-Id": request_id}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req_data = await request.json()
        request_id = str(uuid.uuid4())
        app.state.ids.append(request_id)
        p_data = req_data.copy()
        p_data["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
        p_data["stream"] = False
        p_data["max_tokens"] = 1
        if "max_completion_tokens" in p_data:
            p_data["max_completion_tokens"] = 1
        p_data.pop("stream_options", None)
        p_data.pop("min_tokens", None)
        p_data.pop("min_completion_tokens", None)
        async with httpx.AsyncClient(timeout=None, base_url=f"{prefill_url}/v1") as p:
            response = await p.post("/completions", json=p_data, headers=headers(request_id))
            response.raise_for_status()
            kv_transfer_params = response.json().get("kv_transfer_params", {})
        if kv_transfer_params:
            req_data["kv_transfer_params"] = kv_transfer_params

        async def generate_stream():
            async with httpx.AsyncClient(timeout=None, base_url=f"{decode_url}/v1") as d, \
                    d.stream("POST", "/completions", json=req_data,
                             headers=headers(request_id)) as response:
                response.raise_for_status()
                async for chunk in response.aiter_bytes():
                    yield chunk

        return StreamingResponse(generate_stream(), media_type="application/json")

    return app


@pytest.fixture(scope="module")
def route(serve_route):
    return serve_route  # conftest: test_vllm_serve's engines, before its tests stop them


@pytest.fixture(scope="module")
def proxy(route):
    import uvicorn

    from kvhandoff.adapters.vllm.cluster import free_port

    app = toy_proxy_app(route.p.url, route.d.url)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    with pytest.MonkeyPatch.context() as env:
        # The toy proxy sends ``Authorization: Bearer $OPENAI_API_KEY`` to P and D, as
        # vLLM's does: the shared route's engines run with --api-key.
        env.setenv("OPENAI_API_KEY", SERVE_API_KEY)
        threading.Thread(target=server.run, daemon=True, name="toy-proxy").start()
        wait_for(lambda: server.started, 30, "the toy proxy to start")
        yield f"http://127.0.0.1:{port}", app
        server.should_exit = True


def _client_body(route: Route, prompt: str, stream: bool) -> dict:
    body = {"model": route.model, "prompt": prompt, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True, "min_tokens": OUT, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _through_proxy(url: str, body: dict) -> tuple[str, list[int]]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    if not body["stream"]:
        choice = json.loads(raw)["choices"][0]
        return choice["text"], choice["token_ids"]
    text, token_ids = "", []
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                token_ids += choice.get("token_ids") or []
    assert raw.rstrip().endswith("data: [DONE]"), raw[-200:]
    return text, token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_the_toy_proxy_hands_off_and_d_answers_as_the_reference(route, proxy, stream):
    url, app = proxy
    prompts = [text_prompt(1100 + 10 * stream + i, 40 + 50 * i) for i in range(2)]
    for prompt in prompts:
        ref = reference(route, prompt)
        got = _through_proxy(url, _client_body(route, prompt, stream))
        assert got == (ref["text"], ref["token_ids"])
        # (P answered although the client asked min_tokens > P's max_tokens: stripped for P)
    # The shared X-Request-Id names the request on both engines; D read from P and
    # released; P freed once.
    for request_id in app.state.ids[-len(prompts):]:
        exported = [e for e in events(route.p_log) if e.kind == "exported"
                    and request_id in e.request_id]
        assert len(exported) == 1, (request_id, [e.request_id for e in events(route.p_log)])
        rid = exported[0].request_id
        d_evs = events(route.d_log, rid)
        admitted = [e for e in d_evs if e.kind == "admitted"]
        assert len(admitted) == 1 and request_id in admitted[0].local_request_id
        assert "split_completed" in kinds(d_evs)
        assert_freed_once(route, rid, released=True)


@pytest.mark.phase(1)  # after the traffic
def test_every_toy_proxy_hand_off_is_freed_once_and_replay_is_clean(route, proxy):
    url, app = proxy
    prompt = text_prompt(1200, 60)
    assert _through_proxy(url, _client_body(route, prompt, True))[1] == reference(
        route, prompt)["token_ids"]
    exported = {e.request_id for e in events(route.p_log) if e.kind == "exported"
                and any(request_id in e.request_id for request_id in app.state.ids)}
    assert len(exported) == len(app.state.ids)  # one hand-off per proxied request
    for rid in exported:
        assert_freed_once(route, rid, released=True)
    result = subprocess.run([sys.executable, "-m", "kvhandoff.adapters.cli", "replay",
                             "--check", str(route.p_log), str(route.d_log)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # The same logs as a trace (issue #18): real `vllm serve` engines' logs are well formed.
    trace = route.workdir / "toy-proxy.trace.json"
    result = subprocess.run([sys.executable, "-m", "kvhandoff.adapters.cli", "replay",
                             "--trace", str(trace), str(route.p_log), str(route.d_log)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    got = check_trace(json.loads(trace.read_text()))
    assert set(got["threads"].values()) >= exported and got["flows"]["heartbeat"] >= 1

"""The example router's own promises, against stand-in upstreams (no engines).

The serve-route tests (`test_vllm_serve.py`) drive it in front of real
``vllm serve`` engines; here P and D are small HTTP servers that answer, hang
up or do not exist, so each failure of an upstream is produced on purpose.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvhandoff.adapters.vllm.router import KEEPALIVE_S, build_app

PARAMS = {"remote_request_id": "p-1", "remote_block_ids": [[1, 2]]}


class Upstream:
    """An HTTP server on loopback; ``mode``: "prefill" answers with P's params,
    "echo" returns the body it got, "hang_up" closes without an answer."""

    def __init__(self, mode: str) -> None:
        self.bodies: list[dict] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.bodies.append(body)
                if mode == "hang_up":
                    self.close_connection = True
                    return
                answer = {"kv_transfer_params": PARAMS} if mode == "prefill" else body
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstreams(request):
    made: list[Upstream] = []

    def make(mode: str) -> Upstream:
        made.append(Upstream(mode))
        return made[-1]

    yield make
    for u in made:
        u.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def complete(prefill_url: str, decode_url: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_app(prefill_url, decode_url, timeout_s=10)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(go())


def test_d_gets_the_original_request_with_the_params_p_answered(upstreams):
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": False})
    assert r.status_code == 200
    assert p.bodies[0]["max_tokens"] == 1
    assert p.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert r.json() == {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": False,
                        "kv_transfer_params": PARAMS}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failing", ["prefill", "decode"])
@pytest.mark.parametrize("how", ["unreachable", "hang_up"])
def test_an_upstream_that_fails_is_a_502_naming_it(upstreams, failing, how, stream):
    bad = closed_port_url() if how == "unreachable" else upstreams("hang_up").url
    p = bad if failing == "prefill" else upstreams("prefill").url
    d = bad if failing == "decode" else upstreams("echo").url
    r = complete(p, d, {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": stream})
    assert r.status_code == 502
    error = r.json()["error"]
    assert (error["type"], error["upstream"], error["url"]) == ("upstream_failed", failing, bad)
    assert error["reason"].split(":")[0] in {"ConnectError", "RemoteProtocolError", "ReadError"}


def test_the_router_lets_idle_connections_go_before_vllms_server_does():
    """A pooled connection that vLLM's API server closes as the router reuses it
    resets the request (seen in CI as a 500); letting go first avoids the race."""
    from vllm import envs

    assert 0 < KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE

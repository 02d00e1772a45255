"""The example router's own promises, against stand-in upstreams (no engines).

The serve-route tests (`test_vllm_serve.py`) drive it in front of real
``vllm serve`` engines; here P and D are small HTTP servers that answer, hang
up or do not exist, so each failure of an upstream is produced on purpose.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import wait_for

from kvhandoff.adapters.vllm.router import KEEPALIVE_S, build_app

PARAMS = {"remote_request_id": "p-1", "remote_block_ids": [[1, 2]]}


class Upstream:
    """An HTTP server on loopback; ``mode``: "prefill" answers with P's params,
    "echo" returns the body it got, "hang_up" closes without an answer, "not_json"
    and "json_list" answer 200 with a body that is no JSON object, "nan_params" P's params
    with a NaN in them, "slow_echo" echoes after 1 s, "slow_headers"
    answers nothing until the router closes the connection (``closed`` is set then),
    "stream" streams events until the router closes the connection (``closed`` again)."""

    def __init__(self, mode: str) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each request's, names in lower case
        self.closed = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.bodies.append(body)
                upstream.headers.append({k.lower(): v for k, v in self.headers.items()})
                if mode == "slow_echo":
                    upstream.closed.wait(1.0)  # never set here: a 1 s wait for the router
                if mode == "hang_up":
                    self.close_connection = True
                    return
                if mode == "slow_headers":  # until the peer closes (bounded: 60 s)
                    for _ in range(1200):
                        if (select.select([self.connection], [], [], 0.05)[0]
                                and self.connection.recv(1, socket.MSG_PEEK) == b""):
                            upstream.closed.set()
                            break
                    self.close_connection = True
                    return
                if mode == "stream":  # an event every 10 ms until the peer is gone (60 s)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    try:
                        for i in range(6000):
                            self.wfile.write(b'data: {"choices": [{"text": "%d"}]}\n\n' % i)
                            self.wfile.flush()
                            if select.select([self.connection], [], [], 0.01)[0] and \
                                    self.connection.recv(1, socket.MSG_PEEK) == b"":
                                break
                    except OSError:
                        pass
                    upstream.closed.set()
                    self.close_connection = True
                    return
                answer = ({"kv_transfer_params": PARAMS} if mode == "prefill" else
                          [PARAMS] if mode == "json_list" else body)
                data = (b"<html>busy</html>" if mode == "not_json" else
                        b'{"kv_transfer_params": {"remote_block_ids": NaN}}'
                        if mode == "nan_params" else json.dumps(answer).encode())
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

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


def complete(prefill_url: str, decode_url: str, body: object,
             path: str = "/v1/completions", headers: dict[str, str] | None = None,
             read_timeout_s: float = 10) -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_app(prefill_url, decode_url, read_timeout_s=read_timeout_s)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            if isinstance(body, bytes):
                return await client.post(path, content=body, headers={
                    "content-type": "application/json", **(headers or {})})
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(go())


def test_d_gets_the_original_request_with_the_params_p_answered(upstreams):
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": False})
    assert r.status_code == 200
    assert p.bodies[0]["max_tokens"] == 1
    assert p.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert r.json() == {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": False,
                        "kv_transfer_params": PARAMS}


def test_p_gets_no_min_tokens_and_d_gets_the_request_as_sent(upstreams):
    """vLLM refuses min_tokens above max_tokens: P's max_tokens is 1, so P must not get
    the client's min_tokens (a plain request with min_tokens 10 was a 400 from P)."""
    p, d = upstreams("prefill"), upstreams("echo")
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "min_tokens": 10, "stream": False}
    r = complete(p.url, d.url, body)
    assert r.status_code == 200
    assert "min_tokens" not in p.bodies[0] and p.bodies[0]["max_tokens"] == 1
    assert d.bodies[0] == body | {"kv_transfer_params": PARAMS}


def test_the_api_key_and_the_request_id_reach_p_and_d_and_no_other_header(upstreams):
    """Behind ``vllm serve --api-key`` every request was a 401 from P: no header was
    passed on.  The request id names the request in both engines' logs."""
    p, d = upstreams("prefill"), upstreams("echo")
    sent = {"Authorization": "Bearer k-1", "X-Request-Id": "client-7", "X-Other": "no"}
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi"}, headers=sent)
    assert r.status_code == 200
    for upstream in (p, d):
        (got,) = upstream.headers
        assert got["authorization"] == "Bearer k-1" and got["x-request-id"] == "client-7"
        assert "x-other" not in got


@pytest.mark.parametrize("header", ["Authorization", "X-Request-Id"])
def test_a_passed_header_with_bytes_outside_ascii_is_a_400_before_any_upstream_call(
        upstreams, header):
    """HTTP lets a client send such bytes; the router could not pass them on (a bare 500)."""
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi"}, headers={header: b"caf\xe9"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == header.lower() and "ASCII" in r.json()["error"]["message"]
    assert p.bodies == [] and d.bodies == []


def test_p_params_with_a_nan_are_a_502_naming_p_not_the_client_s_400(upstreams):
    p, d = upstreams("nan_params"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi"})
    assert r.status_code == 502 and r.json()["error"]["upstream"] == "prefill"
    assert "NaN" in r.json()["error"]["reason"] and d.bodies == []


def test_a_read_timeout_when_set_is_a_502_naming_the_silent_upstream(upstreams):
    """Off by default (a long generation sends nothing until it ends); when an operator
    sets one, a silent D is a 502 naming D."""
    p, d = upstreams("prefill"), upstreams("slow_echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi"}, read_timeout_s=0.2)
    assert r.status_code == 502 and r.json()["error"]["upstream"] == "decode"
    assert r.json()["error"]["reason"].startswith("ReadTimeout")


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


# (path, what the client adds to a plain request, the field the 400 names, words it says)
NOT_ONE_HAND_OFF = {
    "two_text_prompts": ("/v1/completions", {"prompt": ["a", "b"]}, "prompt",
                         "single string or a single list of token ids"),
    "two_token_prompts": ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt",
                          "batch of 2 prompts"),
    "two_embeds": ("/v1/completions", {"prompt_embeds": ["AAAA", "AAAA"]}, "prompt_embeds",
                   "batch of 2"),
    "prompt_and_embeds": ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds",
                          "together are two prompts"),
    "n_completions": ("/v1/completions", {"n": 2}, "n", "`n` must be 1"),
    "n_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3},
               "n", "`n` must be 1"),
    # vLLM's request models read a numeric string as the number: "2" would be 2 sequences
    "n_as_a_string": ("/v1/completions", {"n": "2"}, "n", "`n` must be 1, found '2'"),
    "n_fractional": ("/v1/completions", {"n": 1.5}, "n", "`n` must be 1"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(NOT_ONE_HAND_OFF))
def test_a_request_that_is_not_one_hand_off_is_a_400_before_any_upstream_call(
        upstreams, case, stream):
    """P answers one kv_transfer_params and D takes each once: a batch or n > 1 was a bare
    500 (D refused the second sub-request as reused params); now it is refused up front."""
    path, extra, field, words = NOT_ONE_HAND_OFF[case]
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": stream}
                 | extra, path=path)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == 400
    assert words in error["message"] and "one request hands off one KV cache" in error["message"]
    assert p.bodies == [] and d.bodies == []  # neither P nor D saw it


@pytest.mark.parametrize("body", [
    b"{not json", b"[1, 2]", b'"hi"',
    b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
    b"[" * 100_000 + b"]" * 100_000,  # nesting past any parser's recursion
    b"{\"prompt\": \"\xff\"}",  # not UTF-8
], ids=["not_json", "list", "string", "nan", "infinity", "deep", "not_utf8"])
def test_a_body_that_is_not_a_json_object_is_a_400_before_any_upstream_call(upstreams, body):
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, body)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert p.bodies == [] and d.bodies == []


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": "hi", "priority": 18446744073709551617}',  # past 64 bits
    b'{"model": "m", "prompt": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}",
    b'\xef\xbb\xbf{"model": "m", "prompt": "hi"}',  # a UTF-8 byte-order mark
], ids=["big_int", "nested_300", "bom"])
def test_what_vllm_itself_reads_is_passed_on_exactly(upstreams, body):
    """The router parses as vLLM's API server does (Python's json): nothing it would take
    is refused or changed on the way."""
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, body)
    assert r.status_code == 200, r.text[:300]
    sent = json.loads(body)
    assert r.json() == sent | {"kv_transfer_params": PARAMS}
    assert {k: v for k, v in p.bodies[0].items() if k not in ("max_tokens", "max_completion_tokens",
            "stream", "kv_transfer_params")} == sent


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", ["not_json", "json_list"])
def test_a_p_whose_200_is_no_json_object_is_a_502_naming_it(upstreams, answer, stream):
    p, d = upstreams(answer), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": stream})
    assert r.status_code == 502
    error = r.json()["error"]
    assert (error["type"], error["upstream"], error["url"]) == ("upstream_failed", "prefill", p.url)
    assert d.bodies == []


@pytest.mark.parametrize("n", [1, 1.0, None])
def test_n_of_one_in_any_of_its_shapes_is_handed_off(upstreams, n):
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": "hi", "max_tokens": 7, "n": n})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] == PARAMS


def test_a_client_gone_before_d_starts_its_stream_closes_the_connection_to_d(upstreams):
    """The client leaves while D has the request but has not answered its headers: the router
    closes D's connection (vLLM's API server aborts the request on that), answering 499."""
    p, d = upstreams("prefill"), upstreams("slow_headers")
    app = build_app(p.url, d.url, read_timeout_s=60)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 7, "stream": True}).encode()
    given: list[bool] = []
    sent: list[dict] = []

    async def receive() -> dict:
        if not given:
            given.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        if d.bodies:  # D has it: the client leaves now
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # nothing yet (the router's check cancels this wait)
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path":
             b"/v1/completions", "query_string": b"", "root_path": "", "server":
             ("router", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    asyncio.run(app(scope, receive, send))
    assert d.closed.wait(30), "D's connection stayed open after the client left"
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


def test_a_client_gone_mid_stream_closes_the_connection_to_d(upstreams):
    """The router as users run it (uvicorn): a client that reads a few events of D's stream
    and hangs up makes the router close D's connection, on which vLLM aborts the request."""
    import uvicorn

    p, d = upstreams("prefill"), upstreams("stream")
    server = uvicorn.Server(uvicorn.Config(build_app(p.url, d.url, read_timeout_s=60),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the router to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        body = {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            assert [next(events) for _ in range(3)] == [
                f'data: {{"choices": [{{"text": "{i}"}}]}}' for i in range(3)]
            assert not d.closed.is_set()
        assert d.closed.wait(30), "D's stream went on after the client left the router"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("prompt", [[5, 6, 7], ["hi"], [[5, 6, 7]]])
def test_one_prompt_in_any_of_its_shapes_is_handed_off(upstreams, prompt):
    p, d = upstreams("prefill"), upstreams("echo")
    r = complete(p.url, d.url, {"model": "m", "prompt": prompt, "max_tokens": 7, "n": 1})
    assert r.status_code == 200
    assert p.bodies[0]["prompt"] == prompt and r.json()["kv_transfer_params"] == PARAMS


def test_the_router_lets_idle_connections_go_before_vllms_server_does():
    """A pooled connection that vLLM's API server closes as the router reuses it
    resets the request (seen in CI as a 500); letting go first avoids the race."""
    from vllm import envs

    assert 0 < KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE

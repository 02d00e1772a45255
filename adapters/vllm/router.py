"""An example disaggregating router: exactly what docs/operator-guide.md describes.

``POST /v1/completions`` (and ``/v1/chat/completions``): send the request to
P with ``max_tokens: 1`` and ``"kv_transfer_params": {"do_remote_decode":
true}``, take the ``kv_transfer_params`` from P's answer and send the
original request to D with those parameters, unchanged.  D's answer goes
back to the client as it is (status, body, or the event stream).  A client
that goes away is passed on: the connection to P or D is closed, which is
how vLLM's API server learns of the disconnect and aborts the request.

Run it with::

    python -m kvhandoff.adapters.vllm.router --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

It keeps no state and does no load balancing: one P, one D.  The end-to-end
tests run it in-process (`build_app`).

Two details a router of your own needs too:

* Idle upstream connections are dropped after ``KEEPALIVE_S``, before vLLM's
  API server closes them (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s).  A pooled
  connection the server is closing at the moment it is reused fails the
  request with a reset (``httpx.ReadError``) that no retry may hide: P may
  already have started the prefill.
* An upstream that cannot be reached or hangs up, or a P whose ``200`` is
  not a JSON object, answers the client ``502`` with a JSON body naming the
  upstream and the error, never a bare ``500``.
* One request hands off one KV cache: P answers one ``kv_transfer_params``
  and D accepts each only once.  A batched ``prompt`` (a list of strings or
  of token-id lists, or several ``prompt_embeds``) or ``n`` > 1 (vLLM runs
  ``n`` child requests with the same parameters) would fail on D, so the
  router answers ``400`` with a JSON body naming the field before calling
  P or D (`one_hand_off_problem`).  So does a body that is not a JSON object
  or not strict JSON (``NaN``, ``Infinity``, nesting past Python's recursion
  limit); integers of any size pass on exactly, as vLLM's own parser reads
  them.
  ``n`` must be absent, ``null`` or the number 1: vLLM reads ``"2"`` as 2.
  (``best_of`` is no field of vLLM 0.32's completion requests: it is ignored.)
* The client's disconnect is passed on at every stage, waiting for D's
  stream to start included.  No read timeout by default: a long generation
  sends nothing until it ends (``--read-timeout-s`` sets one).
* P gets the request without ``min_tokens`` (vLLM refuses one above P's
  ``max_tokens: 1``) and ``stream_options``; P and D get the client's
  ``Authorization`` and ``X-Request-Id`` headers, no others.
* ``prompt`` and ``prompt_embeds`` together are two prompts: ``400`` too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

KEEPALIVE_S = 2.0  # < vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): the router lets go first

# Sent to P on top of the client's request; ``min_tokens`` goes (vLLM refuses one above
# max_tokens, and the toy proxy drops it too), as does ``stream_options``.
NOT_FOR_P = ("stream_options", "min_tokens")
# The client's headers passed on to P and D: an API key (``vllm serve --api-key``) and the
# request id vLLM names the request by.  No others: hop-by-hop headers and the body's length
# belong to each connection.
PASSED_HEADERS = ("authorization", "x-request-id")
PREFILL_ONLY = {"max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True}}


async def _until_disconnected(request: Request, work: asyncio.Task) -> Any:
    """Await ``work``; cancel it (closing its upstream connection) if the client leaves."""
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            break
        await asyncio.wait({work}, timeout=0.05)
    return await work


def one_hand_off_problem(body: Any) -> tuple[str, str] | None:
    """(field, why) when ``body`` is not one prompt and one sequence, else None.

    Only what would break the hand-off is refused; everything else (a missing
    prompt, a wrong type) is left to vLLM, which answers it itself.
    """
    if not isinstance(body, dict):
        return "", f"the request body must be a JSON object, found {type(body).__name__}"
    prompt = body.get("prompt")
    if (isinstance(prompt, list) and len(prompt) > 1
            and any(isinstance(p, str | list) for p in prompt)):
        return "prompt", (f"`prompt` must be a single string or a single list of token ids, "
                          f"found a batch of {len(prompt)} prompts: one request hands off one "
                          f"KV cache (send one request per prompt)")
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > 1:
        return "prompt_embeds", (f"`prompt_embeds` must be a single prompt, found a batch of "
                                 f"{len(embeds)}: one request hands off one KV cache (send one "
                                 f"request per prompt)")
    if embeds is not None and prompt is not None:
        return "prompt_embeds", ("`prompt` and `prompt_embeds` together are two prompts (vLLM "
                                 "runs both): one request hands off one KV cache (send one "
                                 "request per prompt)")
    n = body.get("n")
    if n is not None and not (type(n) in (int, float) and n == 1):
        return "n", (f"`n` must be 1, found {n!r}: one request hands off one KV cache, and D "
                     f"would run n sequences on one prefill's parameters, which D accepts "
                     f"once (send one request per sequence)")
    return None


def _header_problem(request: Request) -> tuple[str, str] | None:
    """(header, why) when a header the router passes on cannot be: the upstream connection
    sends header values as ASCII, and HTTP lets a client send other bytes (read as
    Latin-1 here)."""
    for name in PASSED_HEADERS:
        value = request.headers.get(name)
        if value is not None and not value.isascii():
            return name, f"header {name!r}: expected ASCII characters only"
    return None


def _bad_request(param: str, message: str) -> Response:
    # The shape of vLLM's own errors, so a client reads the router's the same way.
    return JSONResponse({"error": {"type": "BadRequestError", "message": message,
                                   "param": param or None, "code": 400}}, status_code=400)


def _upstream_failed(name: str, url: str, exc: Exception) -> Response:
    return JSONResponse({"error": {"type": "upstream_failed", "upstream": name, "url": url,
                                   "reason": f"{type(exc).__name__}: {exc}"}}, status_code=502)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _encoded(body: dict) -> bytes:
    """``body`` as strict JSON (ValueError, RecursionError: it cannot be)."""
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def _params_of(p: httpx.Response) -> Any:
    """P's ``kv_transfer_params`` from its ``200``; ValueError if the body is no JSON object."""
    answer = json.loads(p.content, parse_constant=_no_constant)
    if not isinstance(answer, dict):
        raise ValueError(f"P's answer must be a JSON object, found {type(answer).__name__}")
    return answer.get("kv_transfer_params")


def build_app(prefill_url: str, decode_url: str, read_timeout_s: float | None = None,
              keepalive_s: float = KEEPALIVE_S, connect_timeout_s: float = 10.0) -> FastAPI:
    """``read_timeout_s``: None (the default) waits as long as the client does: a long
    generation sends nothing until it ends, and a client that leaves is passed on anyway."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
                               limits=httpx.Limits(keepalive_expiry=keepalive_s))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvhandoff example router", lifespan=lifespan)

    async def post(name: str, base: str, path: str, body: dict, request: Request,
                   stream: bool = False) -> httpx.Response | Response:
        """POST to an upstream (``stream``: return once its headers came); the client's
        disconnect (499) or the upstream's failure (502) comes back as the router's own
        answer."""
        try:
            content = _encoded(body)
        except (ValueError, RecursionError) as exc:
            return _bad_request("", f"the request cannot be passed on as JSON ({exc})")
        headers = {"content-type": "application/json"} | {
            h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}
        call = asyncio.ensure_future(client.send(
            client.build_request("POST", f"{base}{path}", content=content, headers=headers),
            stream=stream))
        try:
            return await _until_disconnected(request, call)
        except asyncio.CancelledError:
            return Response(status_code=499)
        except httpx.TransportError as exc:
            return _upstream_failed(name, base, exc)

    def passed_on(r: httpx.Response | Response) -> Response:
        if isinstance(r, Response):
            return r
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    async def handle(path: str, request: Request) -> Response:
        try:  # as vLLM parses it (any integer exactly, a UTF-8 BOM), but strict: no NaN
            body = json.loads(await request.body(), parse_constant=_no_constant)
            _encoded(body)  # what cannot be passed on is refused before P is called
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            return _bad_request("", f"the request body is not JSON ({exc})")
        problem = one_hand_off_problem(body) or _header_problem(request)
        if problem is not None:
            return _bad_request(*problem)
        p_body = {k: v for k, v in body.items() if k not in NOT_FOR_P} | PREFILL_ONLY
        p = await post("prefill", prefill_url, path, p_body, request)
        if isinstance(p, Response) or p.status_code != 200:
            return passed_on(p)
        try:
            d_body = body | {"kv_transfer_params": _params_of(p)}
        except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
            return _upstream_failed("prefill", prefill_url, exc)
        if not body.get("stream"):
            return passed_on(await post("decode", decode_url, path, d_body, request))
        upstream = await post("decode", decode_url, path, d_body, request, stream=True)
        if isinstance(upstream, Response):
            return upstream
        return StreamingResponse(_relay(upstream), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
        # Starlette stops iterating when the client disconnects; ``finally``
        # then closes D's connection, and D aborts the request.
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"prefill": prefill_url, "decode": decode_url})

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="D's base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--read-timeout-s", type=float, default=None,
                        help="give up on a P or D silent this long (default: wait as long as "
                             "the client does)")
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.read_timeout_s),
                host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

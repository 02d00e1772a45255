"""The serve route as two hosts on one machine: ``vllm serve`` P on 127.0.0.2, D on 127.0.0.1.

P's HTTP server, side channel and advertised address are ``127.0.0.2``; D
(``127.0.0.1``) trusts ``127.0.0.2:PORT`` only; both engines run UCX on its
network transport alone (`two_hosts.UCX_ENV`: tcp on lo, no cma, shared
memory or CUDA IPC), and UCX's protocol report in their logs shows each READ
as a GET over tcp.  The settings are the operator guide's multi-node block
(`two_hosts.guide_block`), plus the test tunings the one-host route uses.

Cheap on purpose (engine start is ~40 s each on 2 cores): one P and one D for
the module and no separate reference engine: P decoding a prompt alone (no
``kv_transfer_params``) is the single-engine reference, the same model and
seed as D, greedy.  The helpers and the last-phase checks are the one-host
route's (tests/test_vllm_serve.py), run on this route: every export freed
once and ``replay --check`` clean, then ``kill -9`` of D.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import counting_listener, wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

import test_vllm_serve as one_host  # noqa: E402
import two_hosts as th  # noqa: E402
from test_vllm_serve import (  # noqa: E402
    assert_freed_once,
    assert_serves,
    decode,
    events,
    kinds,
    prefill,
    reference,
    serve_log,
    text_prompt,
    through_router,
)
from two_hosts import D_HOST, P_HOST, STRANGER  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.adapters.vllm.serve import ServeProcess, ServeSpec  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)


class TwoHostRoute:
    """What the one-host route's helpers use (`test_vllm_serve.Route`), on two "hosts"."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.model = str(write_tiny_model("llama", workdir / "model"))
        self.log_dir = workdir / "events"
        self.side_port = free_port(P_HOST)
        common = {"lease_s": one_host.LEASE_S, "heartbeat_interval_s": 1.0,
                  "lease_margin_s": 0.5, "read_timeout_s": one_host.READ_TIMEOUT_S, "handshake_timeout_s": 10.0,
                  "log_dir": str(self.log_dir)}
        env = {**th.UCX_ENV, **th.EVIDENCE_ENV}
        # P alone on core 0, D on core 1 (as the one-host route pins them).
        self.p = ServeProcess(ServeSpec("P", "prefill", self.model, "serve-P",
                                        {**common, **th.p_extra(self.side_port)},
                                        side_channel_port=self.side_port, cpus="0",
                                        host=P_HOST, env=env), workdir)
        self.d = ServeProcess(ServeSpec("D", "decode", self.model, "serve-D", {
            **common, "debug_read_delay_param": True, **th.d_extra(self.side_port)}, cpus="1",
            host=D_HOST, env=env), workdir)
        self.ref = self.p  # P decoding alone: the single-engine reference
        self.p_log = self.log_dir / "serve-P.P0.jsonl"
        self.d_log = self.log_dir / "serve-D.D0.jsonl"
        self.router_url = ""
        self._router = None
        self.headers: dict[str, str] = {}  # no --api-key here (test_vllm_serve's route has one)

    def start(self) -> None:
        for e in (self.p, self.d):
            e.wait_ready()
        one_host.Route._start_router(self)

    def stop(self) -> None:
        one_host.Route.stop(self)


@pytest.fixture(scope="module")
def route(tmp_path_factory):
    r = TwoHostRoute(tmp_path_factory.mktemp("serve2h"))
    try:
        r.start()
        yield r
    finally:
        r.stop()


def test_the_engines_live_on_their_own_hosts(route):
    assert route.p.url.startswith(f"http://{P_HOST}:") and route.d.url.startswith(f"http://{D_HOST}:")
    with pytest.raises(httpx.ConnectError):  # P's HTTP server is not on D's address
        httpx.get(f"http://{D_HOST}:{route.p.spec.port}/health", timeout=5)
    params = prefill(route, text_prompt(10, 40))
    assert (params["remote_host"], params["remote_port"]) == (P_HOST, route.side_port)
    # nobody reads it: P frees it by lease (the phase 1 check waits for that)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_hand_offs_between_two_hosts_match_p_decoding_alone(route, stream):
    prompts = [text_prompt(1100 + i + 10 * stream, 30 + 70 * i) for i in range(2)]
    refs = [reference(route, p) for p in prompts]
    assert len({tuple(r["token_ids"]) for r in refs}) == len(refs), "the model ignores its prompt"
    for prompt, ref in zip(prompts, refs, strict=True):
        assert through_router(route, prompt, stream) == (ref["text"], ref["token_ids"])
    exported = [e.request_id for e in events(route.p_log) if e.kind == "exported"]
    for rid in exported[-2:]:  # D read them (over tcp), released P, P freed once
        assert "split_completed" in kinds(events(route.d_log, rid))
        assert_freed_once(route, rid, released=True)
    # UCX's own report, in the engines' logs: every READ a GET over tcp, no cma/shm.
    report = th.assert_reads_over_tcp(route.p.log_path, route.d.log_path)
    assert any(what.startswith("remote memory read") for _, what, _ in report.reads())


def test_a_cancel_during_a_read_between_two_hosts_keeps_p_s_lease(route):
    p_evs = one_host.assert_p_outlived_the_reads(
        route, *one_host.cancel_during_read(route, 1200, False))
    assert "lease_expired" not in kinds(p_evs)
    assert_serves(route, 1201)


def test_d_refuses_a_producer_on_another_loopback_host(route):
    """A client names 127.0.0.3 (not in D's trusted_producers): not one connection is made."""
    prompt = text_prompt(1300, 60)
    params = prefill(route, prompt)
    # something listens there, counting connections
    sock, attempts = counting_listener(STRANGER, route.side_port)
    seen = len(serve_log(route.d))
    try:
        r = decode(route, prompt, {**params, "remote_host": STRANGER})
        assert r.status_code >= 400, r.text[:300]
        wait_for(lambda: "trusted_producers" in serve_log(route.d)[seen:], 30,
                 "D's log to name trusted_producers")
    finally:
        sock.close()
    assert attempts == [], "D connected to 127.0.0.3, outside trusted_producers"
    assert f"{STRANGER}:{route.side_port}" in serve_log(route.d)[seen:]
    assert_serves(route, 1301)  # P's request frees by lease (the phase 1 check waits for it)


@pytest.mark.phase(1)  # after all traffic
def test_every_export_between_two_hosts_is_freed_once_and_replay_is_clean(route):
    one_host.test_every_export_so_far_is_freed_exactly_once_and_replay_is_clean(route)


@pytest.mark.phase(2)  # kills D
def test_kill_9_of_d_on_its_host_and_p_frees_by_lease(route):
    one_host.test_kill_9_of_d_keeps_what_reached_the_os_and_p_frees_by_lease(route)


@pytest.mark.phase(3)  # stops P
def test_ctrl_c_of_p_on_its_host_exits_cleanly_and_leaves_a_complete_log(route):
    one_host.test_ctrl_c_on_p_exits_cleanly_and_leaves_a_complete_log(route)

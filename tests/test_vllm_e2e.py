"""End-to-end: real vLLM engines (CPU), a P and a D with KVHandoffConnector over NIXL.

One P/D pair serves the whole module (engine start dominates the cost).  P
also serves as the single-engine greedy reference: a plain request to P
decodes by itself.  The seeded tiny model makes outputs depend on the
prompt, so "tokens equal" and the control below can fail.

Event logs are the evidence: P's log says when a lease was extended,
expired, released and freed; D's log says what D posted, cancelled,
acknowledged and released.
"""

from __future__ import annotations

import time

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvhandoff.adapters.vllm.cluster import PDConfig, PDPair  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs, prompts_for  # noqa: E402
from kvhandoff.adapters.vllm.params import DEBUG_DELAY_KEY, DEBUG_HOLD_KEY  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_llama  # noqa: E402
from kvhandoff.core.log import read_log  # noqa: E402

LEASE_S = 4.0
HANDSHAKE_S = 2.0
READ_TIMEOUT_S = 12.0
OUT = 8

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("pd")
    model = write_tiny_llama(work / "model")
    pd = PDPair(PDConfig(
        model_dir=str(model), connector="kvhandoff", workdir=str(work), tag="e2e",
        extra_config={"lease_s": LEASE_S, "heartbeat_interval_s": 0.5, "lease_margin_s": 0.3,
                      "read_timeout_s": READ_TIMEOUT_S, "handshake_timeout_s": HANDSHAKE_S},
        d_extra_config={"debug_read_delay_param": True},
    ))
    try:
        pd.wait_ready(timeout_s=600)
        yield pd
    finally:
        pd.stop()


_counter = iter(range(10_000))


def _rid(tag: str) -> str:
    return f"{tag}-{next(_counter)}"


def reference(pd: PDPair, prompts: list[list[int]]) -> list[list[int]]:
    rids = [_rid("ref") for _ in prompts]
    for rid, p in zip(rids, prompts, strict=True):
        pd.p.add(rid, p, OUT)
    done = pd.p.wait_done(rids)
    return [done[r]["token_ids"] for r in rids]


def prefill(pd: PDPair, prompts: list[list[int]], tag: str) -> tuple[list[str], list[dict]]:
    rids = [_rid(tag) for _ in prompts]
    done = pd.prefill(rids, prompts)
    params = [done[r]["kv_transfer_params"] for r in rids]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return rids, params


def p_events(pd: PDPair, p_request_id: str) -> list:
    (path,) = [p for p in pd.p.flush() if ".P0." in p]
    return [e for e in read_log(path) if e.request_id == p_request_id]


def d_events(pd: PDPair, p_request_id: str) -> list:
    (path,) = [p for p in pd.d.flush() if ".D0." in p]
    return [e for e in read_log(path) if e.request_id == p_request_id]


def wait_freed(pd: PDPair, p_request_id: str, timeout_s: float) -> list:
    """P's events for the request once it freed it (a second free fails replay at the end)."""
    return wait_for(lambda: (evs := p_events(pd, p_request_id))
                    and any(e.kind == "freed" for e in evs) and evs,
                    timeout_s, f"P to free {p_request_id}", interval=0.2)


def wait_d_event(pd: PDPair, p_request_id: str, kind: str, timeout_s: float = 30.0) -> None:
    wait_for(lambda: kind in kinds(d_events(pd, p_request_id)), timeout_s,
             f"D to record {kind} for {p_request_id}", interval=0.05)


def kinds(events: list) -> list[str]:
    return [e.kind for e in events]


def test_tokens_equal_single_engine_reference(pair):
    prompts = prompts_for(4, 150, 400, seed=11)
    ref = reference(pair, prompts)
    assert len({tuple(r) for r in ref}) == len(ref), "the model must not ignore its prompt"
    rids, params = prefill(pair, prompts, "eq")
    for rid, prompt, p in zip(rids, prompts, params, strict=True):
        pair.d.add(rid, prompt, OUT, p)
    done = pair.d.wait_done(rids)
    for rid, r in zip(rids, ref, strict=True):
        assert done[rid]["finish_reason"] == "length", done[rid]
        assert done[rid]["token_ids"] == r
    for p in params:
        freed = wait_freed(pair, p["remote_request_id"], LEASE_S + 5)
        assert kinds(freed).count("freed") == 1
        assert "release_notified" in kinds(freed) and "lease_expired" not in kinds(freed)


def _d_bytes_read(pd: PDPair) -> int:
    return sum(v.get("bytes_read", 0) for v in pd.d.stats().values())


def test_a_local_prefix_hit_on_d_reads_only_the_rest(pair):
    first, other = prompts_for(2, 300, 300, seed=24)
    second = first[:256] + other[:100]  # shares two 128-token blocks with ``first``
    ref_first, ref_second = reference(pair, [first, second])
    (r1,), (p1,) = prefill(pair, [first], "prefix-a")
    pair.d.add(r1, first, OUT, p1)
    assert pair.d.wait_done([r1])[r1]["token_ids"] == ref_first
    before = _d_bytes_read(pair)
    (r2,), (p2,) = prefill(pair, [second], "prefix-b")
    pair.d.add(r2, second, OUT, p2)
    assert pair.d.wait_done([r2])[r2]["token_ids"] == ref_second
    per_block = 2 * 2 * 128 * 2 * 64 * 4  # layers x KV heads x tokens x (K|V) x head x fp32
    assert _d_bytes_read(pair) - before == (3 - 2) * per_block  # 3 blocks, 2 held locally
    assert kinds(wait_freed(pair, p2["remote_request_id"], LEASE_S + 5)).count("freed") == 1


def test_control_d_follows_p_kv_not_its_own_prompt(pair):
    (prompt,) = prompts_for(1, 300, 300, seed=12)
    perturbed = list(prompt)
    for i in range(40, 200, 7):  # change the middle; keep the last token D computes itself
        perturbed[i] = (perturbed[i] + 101) % 509 + 3
    ref_own, ref_perturbed = reference(pair, [prompt, perturbed])
    assert ref_own != ref_perturbed, "control needs prompts with different greedy outputs"
    (rid,), (params,) = prefill(pair, [perturbed], "ctl")
    pair.d.add(rid, prompt, OUT, params)  # D is given the original prompt, P's KV is of the perturbed one
    out = pair.d.wait_done([rid])[rid]
    assert out["token_ids"] == ref_perturbed
    assert out["token_ids"] != ref_own


def test_abort_during_slow_read_keeps_lease_until_finished_recving(pair):
    (prompt,) = prompts_for(1, 250, 250, seed=13)
    (rid,), (params,) = prefill(pair, [prompt], "slow")
    slow = LEASE_S * 1.5  # the read outlasts a whole lease after the abort: only heartbeats keep P's blocks
    pair.d.add(rid, prompt, OUT, {**params, DEBUG_DELAY_KEY: slow, DEBUG_HOLD_KEY: True})
    wait_d_event(pair, params["remote_request_id"], "reads_posted")
    pair.d.abort([rid])
    assert pair.d.wait_done([rid])[rid]["finish_reason"] == "aborted"
    p_rid = params["remote_request_id"]
    p_evs = wait_freed(pair, p_rid, slow + LEASE_S + 5)
    assert "lease_expired" not in kinds(p_evs), "P's lease lapsed under a read in flight"
    d_evs = d_events(pair, p_rid)
    dk = kinds(d_evs)
    assert dk.index("client_cancelled") < dk.index("split_completed") < dk.index("finished_recving")
    t_cancel = next(e.t for e in d_evs if e.kind == "client_cancelled")
    t_recv = next(e.t for e in d_evs if e.kind == "finished_recving")
    assert sum(1 for e in d_evs if e.kind == "heartbeat_sent" and t_cancel < e.t < t_recv) >= 3
    assert kinds(p_evs).count("freed") == 1
    t_freed = next(e.t for e in p_evs if e.kind == "freed")
    assert t_freed >= t_recv, "P freed before D reported finished_recving"
    assert sum(1 for e in p_evs if e.kind == "heartbeat_received" and t_cancel < e.t) >= 3


def test_abort_before_scheduling_sends_notify_only_release(pair):
    (prompt,) = prompts_for(1, 200, 200, seed=14)
    (rid,), (params,) = prefill(pair, [prompt], "early")
    pair.d.add(rid, prompt, OUT, params, abort_immediately=True)
    assert pair.d.wait_done([rid])[rid]["finish_reason"] == "aborted"
    p_rid = params["remote_request_id"]
    p_evs = wait_freed(pair, p_rid, LEASE_S + 5)
    d_evs = d_events(pair, p_rid)
    assert "reads_posted" not in kinds(d_evs)
    releases = [e for e in d_evs if e.kind == "release_sent"]
    assert len(releases) == 1 and releases[0].notify_only
    assert kinds(p_evs).count("freed") == 1 and "lease_expired" not in kinds(p_evs)


@pytest.mark.parametrize("case", [
    "missing_field", "wrong_type", "negative_block", "out_of_range_block", "unknown_engine",
    "wrong_block_count",
])
def test_malformed_params_fail_that_request_engines_keep_serving(pair, case):
    (prompt,) = prompts_for(1, 260, 260, seed=15)
    (rid,), (params,) = prefill(pair, [prompt], f"bad-{case}")
    bad = dict(params)
    if case == "missing_field":
        del bad["remote_block_ids"]
    elif case == "wrong_type":
        bad["remote_port"] = "not-a-port"
    elif case == "negative_block":
        bad["remote_block_ids"] = [[-5, *bad["remote_block_ids"][0][1:]]]
    elif case == "out_of_range_block":
        bad["remote_block_ids"] = [[10**9, *bad["remote_block_ids"][0][1:]]]
    elif case == "unknown_engine":
        bad["remote_engine_id"] = "no-such-engine"
    elif case == "wrong_block_count":
        bad["remote_block_ids"] = [bad["remote_block_ids"][0][:-1]]
    pair.d.add(rid, prompt, OUT, bad)
    out = pair.d.wait_done([rid])[rid]
    assert out["finish_reason"] == "error", out
    assert out["token_ids"] == []
    # Both engines still serve: a good hand-off right after works and matches.
    (good,) = prompts_for(1, 180, 180, seed=16)
    (ref,) = reference(pair, [good])
    (rid2,), (params2,) = prefill(pair, [good], f"after-{case}")
    pair.d.add(rid2, good, OUT, params2)
    assert pair.d.wait_done([rid2])[rid2]["token_ids"] == ref
    # P gets its blocks back: at once when D could name the request to P
    # (notify-only release), within one lease otherwise.
    p_evs = wait_freed(pair, params["remote_request_id"], LEASE_S + 5)
    assert kinds(p_evs).count("freed") == 1
    if case in ("negative_block", "out_of_range_block", "wrong_block_count", "missing_field"):
        assert "release_notified" in kinds(p_evs)


def test_an_unreachable_p_fails_only_its_request_and_stalls_nothing(pair):
    from kvhandoff.adapters.vllm.cluster import free_port

    slow_prompt, good = prompts_for(2, 220, 220, seed=21)
    (ref,) = reference(pair, [good])
    (bad_rid, good_rid), (bad_params, good_params) = prefill(pair, [slow_prompt, good], "nowhere")
    pair.d.add(bad_rid, slow_prompt, OUT, {**bad_params, "remote_port": free_port()})
    pair.d.add(good_rid, good, OUT, good_params)
    done = pair.d.wait_done([bad_rid, good_rid])
    assert done[good_rid]["token_ids"] == ref
    assert done[good_rid]["e2e_ms"] < HANDSHAKE_S * 1e3 / 2, "the handshake stalled the engine"
    assert done[bad_rid]["finish_reason"] == "error"
    assert done[bad_rid]["e2e_ms"] >= HANDSHAKE_S * 1e3 * 0.9


def test_the_same_transfer_params_twice_are_read_once(pair):
    (prompt,) = prompts_for(1, 230, 230, seed=19)
    (ref,) = reference(pair, [prompt])
    (rid,), (params,) = prefill(pair, [prompt], "dup")
    pair.d.add(rid, prompt, OUT, params)
    pair.d.add(rid + "-again", prompt, OUT, params)  # a replayed / duplicated hand-off
    done = pair.d.wait_done([rid, rid + "-again"])
    reasons = sorted(d["finish_reason"] for d in done.values())
    assert reasons == ["error", "length"], done
    assert next(d for d in done.values() if d["finish_reason"] == "length")["token_ids"] == ref
    p_evs = wait_freed(pair, params["remote_request_id"], LEASE_S + 5)
    assert kinds(p_evs).count("freed") == 1


def test_recompute_policy_decodes_locally_when_the_read_is_refused(pair, tmp_path):
    from kvhandoff.adapters.vllm.cluster import EngineHandle, free_port
    from kvhandoff.adapters.vllm.engine_proc import EngineSpec

    spec = EngineSpec(name="D-recompute", role="decode", model_dir=pair.cfg.model_dir,
                      control="", engine_id=f"D-recompute-{time.time_ns() % 10**6}",
                      side_channel_port=free_port(), kv_load_failure_policy="recompute",
                      extra_config={"lease_s": LEASE_S, "log_dir": str(tmp_path / "events")})
    d = EngineHandle(spec, tmp_path)
    try:
        d.wait_ready(timeout_s=300)
        (prompt,) = prompts_for(1, 270, 270, seed=20)
        (ref,) = reference(pair, [prompt])
        (rid,), (params,) = prefill(pair, [prompt], "recompute")
        bad = {**params, "remote_block_ids": [[10**9, *params["remote_block_ids"][0][1:]]]}
        d.add(rid, prompt, OUT, bad)
        out = d.wait_done([rid])[rid]
        assert out["finish_reason"] == "length" and out["token_ids"] == ref
        p_evs = wait_freed(pair, params["remote_request_id"], LEASE_S + 5)
        assert "release_notified" in kinds(p_evs) and kinds(p_evs).count("freed") == 1
    finally:
        d.stop()


def test_replay_check_of_both_logs_is_clean(pair):
    logs = pair.p.flush() + pair.d.flush()
    a = analyse_logs(logs)
    assert a["replay_violations"] == 0, a["violations"]
    assert a["double_frees"] == 0


def test_d_restart_does_not_hold_p_blocks_past_one_lease(pair):
    (prompt,) = prompts_for(1, 240, 240, seed=17)
    (rid,), (params,) = prefill(pair, [prompt], "restart")
    pair.d.add(rid, prompt, OUT, {**params, DEBUG_DELAY_KEY: 60.0})
    wait_d_event(pair, params["remote_request_id"], "heartbeat_sent")  # read posted, heartbeating
    pair.restart_d(crash=True)
    p_rid = params["remote_request_id"]
    p_evs = wait_freed(pair, p_rid, LEASE_S * 2 + 5)
    k = kinds(p_evs)
    assert k.count("freed") == 1 and "lease_expired" in k
    last_hb = max(e.t for e in p_evs if e.kind in ("heartbeat_received", "exported"))
    t_expired = next(e.t for e in p_evs if e.kind == "lease_expired")
    assert t_expired - last_hb <= LEASE_S + 1.0
    # The restarted D serves hand-offs again.
    (good,) = prompts_for(1, 200, 200, seed=18)
    (ref,) = reference(pair, [good])
    (rid2,), (params2,) = prefill(pair, [good], "reborn")
    pair.d.add(rid2, good, OUT, params2)
    assert pair.d.wait_done([rid2])[rid2]["token_ids"] == ref


@pytest.mark.parametrize("extra, message", [
    ({"lease": 3}, "'lease'"),
    ({"producer_tp_size": 2}, "tensor_parallel_size=1"),
])
def test_bad_connector_settings_refuse_engine_start(tmp_path, extra, message):
    from kvhandoff.adapters.vllm.cluster import EngineFailed, EngineHandle, free_port
    from kvhandoff.adapters.vllm.engine_proc import EngineSpec

    model = write_tiny_llama(tmp_path / "model")
    spec = EngineSpec(name="D-bad", role="decode", model_dir=str(model), control="",
                      engine_id="D-bad", side_channel_port=free_port(),
                      extra_config=extra)
    h = EngineHandle(spec, tmp_path)
    try:
        with pytest.raises(EngineFailed):
            h.wait_ready(timeout_s=300)
        log = h.log_path.read_text()
        assert ("ConnectorConfigError" in log or "UnsupportedTopology" in log) and message in log
    finally:
        h.kill()


def test_p_crash_mid_read_fails_the_request_in_bounded_time(pair):
    """D never serves bytes it cannot prove P still held: P dies, the request fails, D serves on."""
    (prompt,) = prompts_for(1, 250, 250, seed=22)
    (rid,), (params,) = prefill(pair, [prompt], "p-crash")
    slow = LEASE_S * 1.5  # the bytes are held past what P's last answer vouches for
    pair.d.add(rid, prompt, OUT, {**params, DEBUG_DELAY_KEY: slow})
    wait_d_event(pair, params["remote_request_id"], "reads_posted")
    t0 = time.monotonic()
    pair.restart_p(crash=True)
    out = pair.d.wait_done([rid], timeout_s=READ_TIMEOUT_S + slow + 30)[rid]
    assert out["finish_reason"] == "error" and out["token_ids"] == []
    assert time.monotonic() - t0 < READ_TIMEOUT_S + slow + 20
    d_evs = d_events(pair, params["remote_request_id"])
    k = kinds(d_evs)
    assert "finished_recving" in k
    # D gives up one lease after P's last word (core.policy.read_deadline), before the
    # held bytes land: waiting longer would only hold its pages for bytes it must refuse.
    posted = next(e for e in d_evs if e.kind == "reads_posted")
    (failed,) = [e for e in d_evs if e.kind == "split_failed"]
    assert "read timeout" in failed.reason and failed.t < posted.t + slow, failed
    release = next(e for e in d_evs if e.kind == "release_sent")
    assert release.notify_only  # FAILED, not RECEIVED: the bytes were refused
    # D serves the restarted P.
    (good,) = prompts_for(1, 200, 200, seed=23)
    (ref,) = reference(pair, [good])
    (rid2,), (params2,) = prefill(pair, [good], "after-p-crash")
    pair.d.add(rid2, good, OUT, params2)
    assert pair.d.wait_done([rid2])[rid2]["token_ids"] == ref

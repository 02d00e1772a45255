"""Qwen4-exp-shaped KV cache configs, planned by vLLM 0.32 itself.

The seed's model family ships in the installed wheel as ``vllm/models/qwen4_exp/``.
Its layers cannot be built on CPU (the QSA backend needs CUDA kernels and
torchvision), so this module writes down, per layer, the spec each cache owner's
``get_kv_cache_spec`` returns, with the same formulas (cited per owner), and
hands the spec dicts to vLLM's own engine-core path: ``resolve_kv_cache_layout``
over the owners' backends, then ``get_kv_cache_configs``.  No group list, tensor
placement or block size here is hand-written; they are vLLM's.

Owners per decoder layer (``nvidia/model.py: Qwen4ExpDecoderLayer``), in the
order they register in the static forward context, which is the order
``get_kv_cache_spec`` reports them:

* ``model.layers.{i}.ple`` (``nvidia/ple_layer.py``): short-conv state,
  ``MambaSpec(tp_replicated=True)``, on the layers in ``ple_layer_ids``;
* ``model.layers.{i}.linear_attn`` (GDN, ``qwen_gdn_linear_attn.py``): ``MambaSpec``;
* a QSA layer (``nvidia/qsa.py``, ``nvidia/indexer_qsa.py``, ``common/qsa_cache.py``):
  ``...self_attn.indexer.raw_key_cache`` (``CircularBufferSpec``, capacity
  ``compress_ratio * cdiv(compress_ratio + num_speculative_tokens, compress_ratio)``),
  ``...self_attn.indexer.compressed_key_cache`` (``MLAAttentionSpec`` with
  ``tokens_per_state = compress_ratio``), then ``...self_attn.attn`` (``FullAttentionSpec``).
* MTP (``nvidia/mtp.py``): the draft's QSA layer registers after every target
  layer as ``mtp.layers.{num_layers}.self_attn...`` (PLE forced off).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2
PLE_LAYERS = (2,)  # 0-based decoder layer carrying the PLE state (config.ple_layer_ids is 1-based)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # QSA main attention
INDEXER_HEAD_DIM, COMPRESS_RATIO = 64, 4
GDN = {"num_k_heads": 4, "num_v_heads": 8, "head_k_dim": 32, "head_v_dim": 32, "conv_kernel": 4}
PLE_HIDDEN, HC_COUNT, PLE_CONV_KERNEL, NGRAM = 64, 2, 3, 2
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 48  # num_gpu_blocks_override: small pools for byte-exact tests


@dataclass(frozen=True)
class Variant:
    mtp: int = 0  # num_speculative_tokens (0: no drafter)
    prefix_caching: bool = False  # mamba_cache_mode 'align' when on, 'none' when off
    tp: int = 1

    @property
    def name(self) -> str:
        return f"mtp{self.mtp}-{'apc' if self.prefix_caching else 'noapc'}-tp{self.tp}"


VARIANTS = tuple(Variant(m, a, t) for m in (0, 2) for a in (False, True) for t in (1, 2))
SEED = Variant(mtp=2, prefix_caching=True, tp=2)  # the seed's serving configuration


def _tiny_model_dir() -> str:
    import tempfile

    from kvhandoff.adapters.vllm.tiny_model import write_tiny_model

    return str(write_tiny_model("llama", tempfile.mkdtemp(prefix="kvh-q4-")))


@functools.cache
def _model_config() -> Any:
    """A ModelConfig for the max length and dtype only (Qwen4-exp's needs CUDA to load)."""
    from vllm.config import ModelConfig

    return ModelConfig(model=_tiny_model_dir(), max_model_len=MAX_MODEL_LEN, dtype="bfloat16",
                       skip_tokenizer_init=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vllm_config(v: Variant, role: str | None = None, engine_id: str = "E") -> Any:
    """The engine's VllmConfig: block sizes set as vLLM's platform sets them for this model."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    cache = CacheConfig(block_size=16, enable_prefix_caching=v.prefix_caching,
                        mamba_cache_mode="align" if v.prefix_caching else "none",
                        num_gpu_blocks_override=NUM_BLOCKS)
    kvt = None
    if role is not None:
        kvt = KVTransferConfig(kv_connector="KVHandoffConnector", kv_role=role, engine_id=engine_id,
                               kv_connector_module_path="kvhandoff.adapters.vllm.connector")
    cfg = VllmConfig(model_config=_model_config(), cache_config=cache,
                     parallel_config=ParallelConfig(tensor_parallel_size=v.tp), kv_transfer_config=kvt)
    if v.mtp:
        # SpeculativeConfig(method="mtp") resolves the draft from the target's HF config,
        # which needs the real checkpoint; the planner reads these three fields only.
        spec = object.__new__(SpeculativeConfig)
        for k, val in (("method", "mtp"), ("num_speculative_tokens", v.mtp),
                       ("disable_eagle_block_drop", False)):
            object.__setattr__(spec, k, val)
        cfg.speculative_config = spec
    # platforms/interface.py `_align_hybrid_block_size`: raise the attention block (a
    # multiple of the kernel block, 16 for FlashAttention) until an attention page
    # holds the largest Mamba page, pad Mamba pages to it; 'align' checkpoints per block.
    attn_token = 2 * _kv_heads(v.tp) * HEAD_DIM * 2
    mamba_page = max(_page(s, torch.bfloat16) for s in (_gdn_shapes(v), _ple_shapes(v)))
    # The ring (capacity = ratio * cdiv(ratio + spec, ratio)) must divide the block.
    align = math_lcm(16, _ring_capacity(v))
    cache.block_size = max(cache.block_size, align * _cdiv(mamba_page, align * attn_token))
    cache.mamba_page_size_padded = cache.block_size * attn_token
    cache.mamba_block_size = cache.block_size if v.prefix_caching else MAX_MODEL_LEN
    return cfg


def math_lcm(a: int, b: int) -> int:
    import math

    return math.lcm(a, b)


def _kv_heads(tp: int) -> int:
    return max(1, KV_HEADS // tp)  # qsa.py: num_kv_heads = max(1, total // tp)


def _ring_capacity(v: Variant) -> int:
    return COMPRESS_RATIO * _cdiv(COMPRESS_RATIO + v.mtp, COMPRESS_RATIO)


def _ds_layout():
    """The conv state as (dim, state_len) per block (``VLLM_SSM_CONV_STATE_LAYOUT=DS``),
    which NixlConnector requires of Mamba / GDN models: P/D deployments run it."""
    from unittest import mock

    from vllm.model_executor.layers.mamba import mamba_utils

    return mock.patch.object(mamba_utils, "get_conv_state_layout", lambda: "DS")


def _gdn_shapes(v: Variant) -> tuple:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    with _ds_layout():
        return tuple(MambaStateShapeCalculator.gated_delta_net_state_shape(
            v.tp, GDN["num_k_heads"], GDN["num_v_heads"], GDN["head_k_dim"], GDN["head_v_dim"],
            GDN["conv_kernel"], v.mtp))


def _ple_shapes(v: Variant) -> tuple:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    conv_state_len = (PLE_CONV_KERNEL - 1) * NGRAM
    with _ds_layout():
        return tuple(MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=1, intermediate_size=PLE_HIDDEN * HC_COUNT,
            conv_kernel=conv_state_len + 1, num_spec=v.mtp))


def _dtypes(shapes: tuple, kind: str) -> tuple:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator as D

    if kind == "gdn":
        return D.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")[:len(shapes)]
    return D.short_conv_state_dtype(torch.bfloat16, "auto")[:len(shapes)]


def _page(shapes: tuple, dtype: Any) -> int:
    import math

    return sum(math.prod(s) for s in shapes) * dtype.itemsize


def kv_cache_specs(cfg: Any, v: Variant) -> dict[str, Any]:
    """One rank's ``{layer name: spec}``, in registration order, as the owners return them."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as M
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
    )

    cc = cfg.cache_config
    bs = cc.block_size

    def mamba(shapes: tuple, kind: str, mtype: Any, replicated: bool) -> Any:
        return MambaSpec(shapes=shapes, dtypes=_dtypes(shapes, kind), block_size=cc.mamba_block_size,
                         page_size_padded=cc.mamba_page_size_padded, mamba_type=mtype,
                         tp_replicated=replicated, mamba_cache_mode=cc.mamba_cache_mode,
                         num_speculative_blocks=cfg.num_speculative_tokens)

    def qsa(prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}.self_attn.indexer.raw_key_cache": CircularBufferSpec(
                block_size=_ring_capacity(v), num_kv_heads=1, head_size=INDEXER_HEAD_DIM,
                head_size_v=0, dtype=torch.bfloat16),
            f"{prefix}.self_attn.indexer.compressed_key_cache": MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=INDEXER_HEAD_DIM, dtype=torch.bfloat16,
                tokens_per_state=COMPRESS_RATIO),
            f"{prefix}.self_attn.attn": FullAttentionSpec(
                block_size=bs, num_kv_heads=_kv_heads(v.tp), head_size=HEAD_DIM,
                head_size_v=HEAD_DIM, dtype=torch.bfloat16),
        }

    out: dict[str, Any] = {}
    for i, kind in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{i}"
        if i in PLE_LAYERS:
            out[f"{prefix}.ple"] = mamba(_ple_shapes(v), "ple", M.SHORT_CONV, True)
        if kind == "linear_attention":
            out[f"{prefix}.linear_attn"] = mamba(_gdn_shapes(v), "gdn", M.GDN_ATTN, False)
        else:
            out.update(qsa(prefix))
    if v.mtp:
        out.update(qsa(f"mtp.layers.{len(LAYER_TYPES)}"))
    return out


def backends() -> list[Any]:
    """The owners' attention backends (the QSA main backend is FlashAttention's subclass,
    not importable on CPU: it declares no layouts of its own, like FlashAttention)."""
    from vllm.models.qwen4_exp.common.qsa_cache import QSAStateBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.attention.backends.short_conv_attn import PleShortConvAttentionBackend

    return [FlashAttentionBackend, QSAStateBackend, GDNAttentionBackend, PleShortConvAttentionBackend]


def plan(v: Variant, role: str | None = None, engine_id: str = "E") -> tuple[Any, list[Any], Any]:
    """``(vllm_config, per-rank KVCacheConfigs, scheduler KVCacheConfig)``, as the engine
    core builds them (``v1/engine/core.py: _initialize_kv_caches``)."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs

    cfg = vllm_config(v, role, engine_id)
    specs = [kv_cache_specs(cfg, v) for _ in range(v.tp)]
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends())]
    layout = resolve_kv_cache_layout(cfg, [names] * v.tp, [s for d in specs for s in d.values()])
    configs = get_kv_cache_configs(cfg, specs, [1 << 40] * v.tp)
    for c in configs:
        c.kv_cache_layout = layout.name
    return cfg, configs, generate_scheduler_kv_cache_config(configs)


def allocate(kv_cache_config: Any, device: str = "cpu", seed: int | None = None) -> tuple[dict, Any]:
    """The worker's tensors as vLLM allocates them (``v1/worker/utils.py``): one int8
    buffer, per-layer views; filled with seeded random bytes when ``seed`` is given."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    views = allocate_kv_cache(kv_cache_config, torch.device(device),
                              KVCacheLayout[kv_cache_config.kv_cache_layout])
    storage = next(iter(views.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.int8, device=device).set_(storage)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8).to(device))
    return views, raw


# ---- the plans as data: the worker-pair test runs where vLLM is not installed (the H200) ----

FIXTURE = "qwen4_plans.json"
BYTES_VARIANTS = (Variant(0, False, 1), Variant(2, True, 1), SEED)


def export_plans() -> dict[str, Any]:
    """What the worker-pair test needs of vLLM's plans, per variant and rank: the layout
    (wire form), the allocation's size and every layer's view (start, shape, strides)."""
    from kvhandoff.adapters.vllm.layout import cache_layout

    out: dict[str, Any] = {}
    for v in BYTES_VARIANTS:
        _, configs, _ = plan(v)
        ranks = []
        for kvc in configs:
            views, raw = allocate(kvc)
            base = raw.data_ptr()
            ranks.append({
                "layout": cache_layout(kvc).to_wire(), "size": raw.numel(),
                "views": {k: [t.data_ptr() - base, list(t.shape), list(t.stride()), str(t.dtype)]
                          for k, t in views.items()},
            })
        out[v.name] = {"variant": [v.mtp, v.prefix_caching, v.tp], "ranks": ranks}
    return out


def load_plan(data: dict[str, Any], v: Variant, rank: int) -> tuple[Any, Any]:
    """``(layout, allocate(device, seed))`` of one rank, from `export_plans`' data."""
    import dataclasses

    import torch

    from kvhandoff.core.groups import CacheLayout

    r = data[v.name]["ranks"][rank]
    layout = CacheLayout.from_wire(r["layout"])
    # Region offsets are local knowledge, never on the wire: a block row starts at byte 0.
    layout = dataclasses.replace(layout, groups=tuple(
        dataclasses.replace(g, regions=tuple(dataclasses.replace(x, offset=0) for x in g.regions))
        for g in layout.groups))

    def alloc(device: str, seed: int | None = None) -> tuple[dict, Any]:
        raw = torch.zeros(r["size"], dtype=torch.int8)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            raw = torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8)
        raw = raw.to(device)
        views = {}
        for k, (start, shape, stride, dtype) in r["views"].items():
            typed = raw.view(getattr(torch, dtype.removeprefix("torch.")))
            views[k] = typed.as_strided(shape, stride, start // typed.element_size())
        return views, raw

    return layout, alloc

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
    _set_mtp(cfg, v)
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


def _set_mtp(cfg: Any, v: Variant) -> None:
    """SpeculativeConfig(method="mtp") resolves the draft from the target's HF config,
    which needs the real checkpoint; the planner reads these three fields only."""
    if not v.mtp:
        return
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    for k, val in (("method", "mtp"), ("num_speculative_tokens", v.mtp),
                   ("disable_eagle_block_drop", False)):
        object.__setattr__(spec, k, val)
    cfg.speculative_config = spec


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


# ---- HiSparse on D (issue #16): a DSA-shaped attention stack -------------------------------
#
# vLLM 0.32's HiSparse serves sparse-MLA (DSA) models only: its planner needs MLA layers of
# role SPARSE and INDEXER (``v1/hisparse/layout.py: _partition_hisparse_specs``) and the HF
# config's ``index_topk``.  Qwen4-exp's QSA owners declare neither role (`kv_cache_specs`
# above), so vLLM refuses HiSparse for them; the HiSparse plans here keep the seed's
# attention layers (3 and 7, plus the MTP layer) and their cache owners' names, with the
# specs a DSA layer declares (``mla_attention.py: MLAAttention.get_kv_cache_spec``, the
# indexer's ``deepseek_v2.py: DeepseekV32IndexerCache.get_kv_cache_spec``), and drop the
# GDN / PLE state (NixlConnector's mixed host/device registration refuses Mamba layers).

DSA_LAYERS = tuple(i for i, kind in enumerate(LAYER_TYPES) if kind == "full_attention")
DSA_HEAD, DSA_INDEX_HEAD, DSA_BLOCK, INDEX_TOPK = 80, 32, 64, 64  # latent + rope; indexer key
HOST_POOL_GIB = 1 / 64  # HiSparseConnector's host_pool_gib: D's host pool
HS_NUM_BLOCKS = 256  # D's device pool (the resident window needs more than NUM_BLOCKS)
HS_VARIANTS = (*(Variant(m, False, t) for m in (0, 2) for t in (1, 2)), SEED)  # and the seed's own


def dsa_specs(v: Variant) -> dict[str, Any]:
    """One rank's ``{layer: spec}`` for the DSA-shaped stack (MLA: replicated on every rank)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    prefixes = [f"model.layers.{i}" for i in DSA_LAYERS]
    if v.mtp:
        prefixes.append(f"mtp.layers.{len(LAYER_TYPES)}")
    out: dict[str, Any] = {}
    for p in prefixes:
        out[f"{p}.self_attn.attn"] = MLAAttentionSpec(
            block_size=DSA_BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=DSA_HEAD,
            dtype=torch.bfloat16, cache_dtype_str="auto", is_index_group_leader=True)
        out[f"{p}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=DSA_BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=DSA_INDEX_HEAD,
            dtype=torch.bfloat16, cache_role=SparseCacheRole.INDEXER)
    return out


def _dsa_backends() -> dict[str, Any]:
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    return {"attn": FlashMLASparseBackend, "k_cache": DeepseekV32IndexerBackend}


def _shared_pool_platform(shared: bool) -> Any:
    """``use_shared_hisparse_host_pool`` asks ``current_platform.is_cuda_alike()``: a D on an
    H200 at TP 2 shares its host pool; on this CPU machine the planner is told so."""
    from unittest import mock

    from vllm.v1.hisparse import runtime

    return mock.patch.object(runtime.current_platform, "is_cuda_alike", lambda: shared)


def _mla_model() -> Any:
    """A DSA model is an MLA model (``ModelConfig.use_mla``): the tiny stand-in config says so
    while the layout is resolved, so connectors ask what they ask of MLA models
    (``KVHandoffConnector``: nothing; ``HiSparseConnector``: BLHNC)."""
    from unittest import mock

    from vllm.config import ModelConfig

    return mock.patch.object(ModelConfig, "use_mla", property(lambda self: True))


def hisparse_vllm_config(v: Variant, hisparse: bool, role: str | None = None,
                         engine_id: str = "E") -> Any:
    """P's (HiSparse off) or D's (HiSparse on) VllmConfig for the DSA-shaped stack.

    D's connector is ``MultiConnector(KVHandoffConnector, HiSparseConnector)``.  Built
    without HiSparse and switched on afterwards: ``VllmConfig.__post_init__`` refuses
    HiSparse off CUDA (``config/vllm.py``: "HiSparse currently requires NVIDIA CUDA.").
    """
    from vllm.config import (
        CacheConfig,
        HiSparseConfig,
        KVTransferConfig,
        ParallelConfig,
        VllmConfig,
    )

    model = _model_config()
    model.hf_config.index_topk = INDEX_TOPK
    cache = CacheConfig(block_size=DSA_BLOCK, enable_prefix_caching=v.prefix_caching,
                        num_gpu_blocks_override=HS_NUM_BLOCKS if hisparse else NUM_BLOCKS)
    cfg = VllmConfig(model_config=model, cache_config=cache,
                     parallel_config=ParallelConfig(tensor_parallel_size=v.tp,
                                                    distributed_executor_backend="mp"))
    _set_mtp(cfg, v)
    handoff = {"kv_connector": "KVHandoffConnector",
               "kv_connector_module_path": "kvhandoff.adapters.vllm.connector"}
    if hisparse:
        cfg.attention_config.hisparse_config = HiSparseConfig()
        cfg.kv_transfer_config = KVTransferConfig(
            kv_connector="MultiConnector", kv_role=role or "kv_consumer", engine_id=engine_id,
            kv_connector_extra_config={"connectors": [
                {**handoff, "kv_role": role or "kv_consumer"},
                {"kv_connector": "HiSparseConnector", "kv_role": role or "kv_consumer",
                 "kv_connector_extra_config": {"host_pool_gib": HOST_POOL_GIB}}]})
    elif role is not None:
        cfg.kv_transfer_config = KVTransferConfig(kv_role=role, engine_id=engine_id, **handoff)
    return cfg


def plan_hisparse(v: Variant, hisparse: bool, role: str | None = None,
                  engine_id: str = "E") -> tuple[Any, list[Any], Any]:
    """``(vllm_config, per-rank KVCacheConfigs, scheduler KVCacheConfig)`` of the DSA-shaped
    stack, HiSparse on (D) or off (P), through vLLM's engine-core path.  With HiSparse on
    each rank's spec dict is completed by ``resolve_hisparse_specs``, as the GPU worker
    does (``v1/worker/gpu/attn_utils.py``): it adds the resident / hot layers."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.hisparse.binding import resolve_hisparse_specs

    cfg = hisparse_vllm_config(v, hisparse, role, engine_id)
    backend = _dsa_backends()
    specs = dsa_specs(v)
    owners = {name: backend[name.rsplit(".", 1)[1]] for name in specs}
    layers = {name: SimpleNamespace(get_attn_backend=functools.partial(lambda b: b, b))
              for name, b in owners.items()}
    names = [layout.name for layout in get_supported_kv_cache_layouts(list(backend.values()))]
    with _mla_model():
        layout = resolve_kv_cache_layout(cfg, [names] * v.tp, list(specs.values()))
    with _shared_pool_platform(hisparse and v.tp > 1):
        if hisparse:
            specs = resolve_hisparse_specs(cfg, specs, layers)
        configs = get_kv_cache_configs(cfg, [dict(specs) for _ in range(v.tp)], [1 << 40] * v.tp)
    for c in configs:
        c.kv_cache_layout = layout.name
    return cfg, configs, generate_scheduler_kv_cache_config(configs)


def allocate_hisparse(kvc: Any) -> tuple[dict, Any, Any]:
    """D's tensors as vLLM's HiSparse allocator builds them (``v1/hisparse/binding.py:
    allocate_hisparse_kv_caches``), zeroed: ``(layer -> view, device buffer, host pool)``
    as int8 tensors.  Only the pinned host allocation is stood in: ``HiSparseHostPool.
    allocate`` pins with CUDA, here it is plain host memory."""
    import torch
    from vllm.v1.hisparse.binding import allocate_hisparse_kv_caches
    from vllm.v1.kv_cache_interface import KVCacheLayout

    class HostPool:  # HiSparseHostPool.allocate, unpinned
        def allocate(self, size: int) -> Any:
            self.backing = torch.zeros(size, dtype=torch.int8)
            return self.backing

    pool = HostPool()
    sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    views = allocate_hisparse_kv_caches(kvc, torch.device("cpu"),
                                        KVCacheLayout[kvc.kv_cache_layout], sizes, pool)
    host = pool.backing.untyped_storage().data_ptr()
    (device,) = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in views.values()
                 if t.untyped_storage().data_ptr() != host}.values()
    return views, torch.empty(0, dtype=torch.int8).set_(device), pool.backing



# ---- HiSparse plans as data: the worker pair on the H200 (issue #16), no vLLM there ----------

HS_FIXTURE = "hisparse_plans.json"
HS_BYTES_VARIANTS = (Variant(2, True, 1), SEED)


def _layout_locals(layout: Any) -> dict[str, Any]:
    """What `CacheLayout.to_wire` leaves out, as the engine knows it: each region's offset,
    pool and block stride; how vLLM's groups map to the layout's; the host pool's geometry."""
    return {
        "regions": [[[r.offset, r.memory.value, r.stride] for r in g.regions]
                    for g in layout.groups],
        "source_groups": list(layout.source_groups),
        "num_source_groups": layout.num_source_groups,
        "host_block_stride": layout.host_block_stride,
        "shared_host_pool": layout.shared_host_pool,
    }


def _with_locals(wire: dict[str, Any], local: dict[str, Any]) -> Any:
    """The layout `_layout_locals` was taken from: ``wire`` parsed, the local fields put back."""
    import dataclasses

    from kvhandoff.core.groups import CacheLayout, Memory

    layout = CacheLayout.from_wire(wire)
    groups = tuple(dataclasses.replace(g, regions=tuple(
        dataclasses.replace(r, offset=offset, memory=Memory(memory), stride=stride)
        for r, (offset, memory, stride) in zip(g.regions, regions, strict=True)))
        for g, regions in zip(layout.groups, local["regions"], strict=True))
    return dataclasses.replace(
        layout, groups=groups, source_groups=tuple(local["source_groups"]),
        num_source_groups=local["num_source_groups"],
        host_block_stride=local["host_block_stride"], shared_host_pool=local["shared_host_pool"])


def _view_spec(t: Any, base: int) -> list:
    return [t.data_ptr() - base, list(t.shape), list(t.stride()), str(t.dtype)]


def export_hisparse_plans() -> dict[str, Any]:
    """What the HiSparse worker-pair test needs of vLLM's plans, per variant and rank.

    P (HiSparse off): the layout (wire form and local fields), the allocation's size and
    every layer's view (start, shape, strides, dtype).  D (HiSparse on, vLLM's HiSparse
    allocator): the layout (wire form and local fields: pools, offsets, strides), the
    device buffer's and the host pool's sizes, and every transferred layer's view with the
    allocation it is in (``device`` or ``host``)."""
    from kvhandoff.adapters.vllm.layout import cache_layout

    out: dict[str, Any] = {}
    for v in HS_BYTES_VARIANTS:
        _, p_configs, _ = plan_hisparse(v, False)
        _, d_configs, _ = plan_hisparse(v, True)
        ranks = []
        for p_kvc, d_kvc in zip(p_configs, d_configs, strict=True):
            p_layout = cache_layout(p_kvc)
            views, raw = allocate(p_kvc)
            p = {"layout": p_layout.to_wire(), "local": _layout_locals(p_layout),
                 "size": raw.numel(),
                 "views": {k: _view_spec(t, raw.data_ptr()) for k, t in views.items()}}
            d_layout = cache_layout(d_kvc, host_pools=True)
            views, device, host = allocate_hisparse(d_kvc)
            pools = {device.data_ptr(): "device", host.data_ptr(): "host"}
            d_views = {}
            for layer in (x for g in d_layout.groups for x in g.layers):
                t = views[layer]
                base = t.untyped_storage().data_ptr()
                d_views[layer] = [pools[base], *_view_spec(t, base)]
            d = {"layout": d_layout.to_wire(), "local": _layout_locals(d_layout),
                 "device_size": device.numel(), "host_size": host.numel(), "views": d_views}
            ranks.append({"p": p, "d": d})
        out[v.name] = {"variant": [v.mtp, v.prefix_caching, v.tp], "ranks": ranks}
    return out


def _typed_view(buf: Any, spec: list) -> Any:
    import torch

    start, shape, stride, dtype = spec
    typed = buf.view(getattr(torch, dtype.removeprefix("torch.")))
    return typed.as_strided(shape, stride, start // typed.element_size())


def load_hisparse_plan(data: dict[str, Any], v: Variant, rank: int) -> tuple[tuple, tuple]:
    """``((P's layout, P's alloc(device, seed)), (D's layout, D's alloc(device)))`` of one
    rank, from `export_hisparse_plans`' data, the layouts' local fields included.

    P's alloc returns ``(views, raw)``: one int8 buffer on ``device``, random bytes from
    ``seed`` when given.  D's returns ``(views, device buffer, host pool)``, zeroed: the
    device buffer on ``device``, the host pool in host memory, pinned when ``device`` is
    CUDA (as ``HiSparseHostPool.allocate`` pins it)."""
    import torch

    r = data[v.name]["ranks"][rank]
    p, d = r["p"], r["d"]

    def p_alloc(device: str, seed: int | None = None) -> tuple[dict, Any]:
        raw = torch.zeros(p["size"], dtype=torch.int8)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            raw = torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8)
        raw = raw.to(device)
        return {k: _typed_view(raw, spec) for k, spec in p["views"].items()}, raw

    def d_alloc(device: str) -> tuple[dict, Any, Any]:
        buf = torch.zeros(d["device_size"], dtype=torch.int8, device=device)
        host = torch.zeros(d["host_size"], dtype=torch.int8,
                           pin_memory=torch.device(device).type == "cuda")
        pools = {"device": buf, "host": host}
        views = {k: _typed_view(pools[pool], spec) for k, (pool, *spec) in d["views"].items()}
        return views, buf, host

    return ((_with_locals(p["layout"], p["local"]), p_alloc),
            (_with_locals(d["layout"], d["local"]), d_alloc))

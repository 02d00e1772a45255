"""vLLM's ``KVCacheConfig`` as a `CacheLayout`: the groups and regions a hand-off moves.

Both halves of the connector build the same layout from the config vLLM
hands them (the scheduler to clip P's block ids and size D's loads, the
worker to register each physical range once and to announce its groups at
the handshake).  What the connector cannot serve is refused here, at engine
start-up, with `UnsupportedTopology` naming the group and its spec: kinds
other than full attention, sliding window and Mamba state (with
``mamba_cache_mode 'none'``), groups vLLM does not transfer, host-resident
caches, and windows that retain extra tokens.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.adapters.vllm.config import UnsupportedTopology
from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.groups import (
    CacheGroup,
    CacheKind,
    CacheLayout,
    TensorPlacement,
    tensor_regions,
)


def _kind(index: int, spec: Any) -> tuple[CacheKind, int, int]:
    """(kind, window, speculative slots) of one group's spec; refuse what we do not serve."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    name = type(spec).__name__
    if type(spec) is FullAttentionSpec:
        return CacheKind.FULL_ATTENTION, 0, 0
    if type(spec) is SlidingWindowSpec:
        if spec.extra_retained_tokens:
            raise UnsupportedTopology(f"KV cache group {index}: {name} with "
                                      f"extra_retained_tokens={spec.extra_retained_tokens}")
        return CacheKind.SLIDING_WINDOW, spec.sliding_window, 0
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode != "none":
            raise UnsupportedTopology(
                f"KV cache group {index}: {name} with mamba_cache_mode={spec.mamba_cache_mode!r} "
                "(needs 'none': vLLM picks 'align' when prefix caching is on; start the engine "
                "with --no-enable-prefix-caching)")
        return CacheKind.MAMBA_STATE, 0, spec.num_speculative_blocks
    raise UnsupportedTopology(f"KV cache group {index}: {name} is not supported (full "
                              "attention, sliding window and Mamba state are)")


def cache_layout(kv_cache_config: Any) -> CacheLayout:
    """The `CacheLayout` of an engine's ``KVCacheConfig`` (see the module docstring)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedTopology("the engine has no KV cache groups")
    num_blocks = kv_cache_config.num_blocks
    pages: dict[str, int] = {}
    for i, g in enumerate(groups):
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise UnsupportedTopology(f"KV cache group {i}: not transferable or host-resident")
        pages.update(dict.fromkeys(g.layer_names, g.kv_cache_spec.page_size_bytes))
    placements = []
    for i, t in enumerate(kv_cache_config.kv_cache_tensors):
        if getattr(t, "host_resident", False):
            raise UnsupportedTopology(f"kv_cache_tensors[{i}] is host-resident")
        placements.append(TensorPlacement(t.size, tuple(t.layers), t.layer_stride,
                                          t.block_stride, t.offset))
    try:
        regions = tensor_regions(placements, pages, num_blocks)
    except GeometryMismatch as exc:
        raise UnsupportedTopology(f"KV cache placement: {exc}") from None
    out = []
    for i, g in enumerate(groups):
        kind, window, spec_slots = _kind(i, g.kv_cache_spec)
        missing = [layer for layer in g.layer_names if layer not in regions]
        if missing:
            raise UnsupportedTopology(f"KV cache group {i}: layers {missing} have no tensor")
        mine = [regions[layer] for layer in g.layer_names]
        if len({r.name for r in mine}) == 1 and len(mine) > 1:
            mine = mine[:1]  # packed blocks: one region holds every layer's page
        out.append(CacheGroup(i, kind, g.kv_cache_spec.block_size, num_blocks, tuple(mine),
                              tuple(g.layer_names), window, spec_slots))
    return CacheLayout(tuple(out))

"""vLLM's ``KVCacheConfig`` as a `CacheLayout`: the groups and regions a hand-off moves.

Both halves of the connector build the same layout from the config vLLM
hands them (the scheduler to clip P's block ids and size D's loads, the
worker to register each physical range once and to announce its groups at
the handshake).  Only ``transfer_groups`` are described: a group with
``enable_kv_transfer=False`` is an accelerator-side replica vLLM rebuilds
after a load, never read, and the block-id lists vLLM hands a connector are
cut to the transfer groups (`transfer_block_ids`).

Each layer's spec maps to a `CacheKind` through one table, `SPEC_KINDS`
(spec class -> kind, and the spec fields that make it unsupported); a
``UniformTypeKVCacheSpecs`` group is mapped layer by layer, and its layers
must read alike (`core.groups.KIND_READS`).  What the connector cannot serve
is refused here, at engine start-up, with `UnsupportedTopology` naming the
group, the spec and the field: specs not in the table, host-resident
groups and tensors, windows that retain extra tokens, Mamba prefill
checkpoint slots.

Placements: layer-outermost tensors give each layer (or each layer slot
shared by overlaid groups) a region of its own; block-outermost ones
(BLNHC / BLHNC, which vLLM resolves for models mixing page sizes, as
Qwen4-exp's QSA owners do) pack every group's pages of block *b* into one
row of the allocation, and since a block id belongs to one group at a
time, the row is that group's: the layout then has one region, the row,
and a group's block is its whole row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.vllm.config import UnsupportedTopology
from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.groups import (
    KIND_READS,
    CacheGroup,
    CacheKind,
    CacheLayout,
    CacheRegion,
    Reads,
    TensorPlacement,
    tensor_regions,
)


@dataclass(frozen=True)
class SpecRule:
    """How one vLLM spec class maps to a kind.

    ``kind`` picks the kind from the spec; ``refuse`` lists ``(field, test,
    why)``: a spec whose ``field`` passes ``test`` is refused, naming it.  A
    ``test`` of two parameters also gets the spec (a field that matters only
    with another field's value).
    """

    kind: Callable[[Any], CacheKind]
    refuse: tuple[tuple[str, Callable[..., bool], str], ...] = ()


def _mla_kind(spec: Any) -> CacheKind:
    if spec.tokens_per_state != 1:
        return CacheKind.COMPRESSED_KEY  # QSACompressedKeyCache: one row per ratio tokens
    role = getattr(getattr(spec, "cache_role", None), "value", "sparse")
    return CacheKind.INDEXER if role == "indexer" else CacheKind.FULL_ATTENTION


def _mamba_kind(spec: Any) -> CacheKind:
    if spec.tp_replicated:
        return CacheKind.LAYER_EMBEDDING  # the PLE short-conv state: whole on every rank
    backend = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    return CacheKind.LINEAR_STATE if backend.startswith(("GDN", "LINEAR", "KDA")) \
        else CacheKind.MAMBA_STATE


_NEVER: tuple = ()
_DENSE = (("sliding_window", lambda v: v is not None, "a window on a full-attention spec "
           "(the hybrid allocator is off: start with HMA on)"),
          ("attention_chunk_size", lambda v: v is not None, "chunked local attention"))

# spec class name -> rule.  Checked by exact class (a subclass is its own row or refused).
SPEC_KINDS: dict[str, SpecRule] = {
    "FullAttentionSpec": SpecRule(lambda s: CacheKind.FULL_ATTENTION, _DENSE),
    "MLAAttentionSpec": SpecRule(_mla_kind, _DENSE + (
        ("non_causal_multi_token_decode", bool, "a non-causal drafter (DSpark)"),)),
    "SlidingWindowSpec": SpecRule(lambda s: CacheKind.SLIDING_WINDOW, (
        ("extra_retained_tokens", bool, "retained tokens behind the window (multi-module MTP)"),)),
    "SlidingWindowMLASpec": SpecRule(lambda s: CacheKind.SLIDING_WINDOW, (
        ("extra_retained_tokens", bool, "retained tokens behind the window (multi-module MTP)"),)),
    # A full-attention table whose decode-time gaps are nulled later: at P's finish every
    # prompt block is live, so it reads like full attention.
    "RSWASpec": SpecRule(lambda s: CacheKind.FULL_ATTENTION, _DENSE),
    "HiddenStateCacheSpec": SpecRule(lambda s: CacheKind.FULL_ATTENTION, _DENSE),
    "CircularBufferSpec": SpecRule(lambda s: CacheKind.KEY_RING),
    "MambaSpec": SpecRule(_mamba_kind, (
        # vLLM's Mamba2 mixer declares one checkpoint slot whatever the mode; vLLM
        # allocates and reads checkpoint slots in 'align' mode only.
        ("num_prefill_checkpoint_blocks", lambda n, spec: n > 0 and spec.mamba_cache_mode
         == "align", "prefill checkpoint slots with mamba_cache_mode 'align' (KDA, Mamba2 "
         "with prefix caching)"),
        ("mamba_cache_mode", lambda m: m not in ("none", "align"), "a mode other than 'none' "
         "and 'align'"),)),
}


def spec_kind(where: str, spec: Any) -> CacheKind:
    """The kind of one layer's spec; `UnsupportedTopology` naming spec and field otherwise."""
    name = type(spec).__name__
    rule = SPEC_KINDS.get(name)
    if rule is None:
        raise UnsupportedTopology(f"{where}: {name} is not supported (supported: "
                                  f"{', '.join(SPEC_KINDS)})")
    for field, test, why in rule.refuse:
        value = getattr(spec, field, None)
        takes_spec = getattr(test, "__code__", None) is not None and test.__code__.co_argcount == 2
        if test(value, spec) if takes_spec else test(value):
            raise UnsupportedTopology(f"{where}: {name}.{field}={value!r} is not supported ({why})")
    return rule.kind(spec)


def _layer_specs(group: Any) -> list[tuple[str, Any]]:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    if inner is not None:  # UniformTypeKVCacheSpecs: one spec per layer
        return [(layer, inner[layer]) for layer in group.layer_names]
    return [(layer, spec) for layer in group.layer_names]


def _group_kind(index: int, group: Any) -> tuple[CacheKind, dict[str, Any]]:
    """The group's kind and its compared fields, from every layer's spec."""
    kinds, fields = [], []
    for layer, spec in _layer_specs(group):
        kinds.append(spec_kind(f"KV cache group {index} ({layer})", spec))
        fields.append(spec)
    reads = {KIND_READS[k] for k in kinds}
    if len(reads) != 1:
        raise UnsupportedTopology(f"KV cache group {index}: layers that read differently in one "
                                  f"group ({sorted(k.value for k in set(kinds))})")
    # The group is its first layer's kind, vLLM's representative spec: the scheduler's
    # config keeps only that one (``generate_scheduler_kv_cache_config``), so both halves
    # of the connector must decide from it.
    kind, first = kinds[0], fields[0]
    out: dict[str, Any] = {"window": 0, "spec_slots": 0, "tokens_per_state": 1,
                           "tp_replicated": False}
    if kind is CacheKind.SLIDING_WINDOW:
        out["window"] = first.sliding_window
    if reads == {Reads.SLOT}:
        slots = {getattr(s, "num_speculative_blocks", 0) for s in fields}
        replicated = {bool(getattr(s, "tp_replicated", False)) for s in fields}
        if len(slots) != 1 or len(replicated) != 1:
            raise UnsupportedTopology(f"KV cache group {index}: state layers disagree on "
                                      "num_speculative_blocks / tp_replicated")
        out["spec_slots"], out["tp_replicated"] = slots.pop(), replicated.pop()
    else:
        out["tokens_per_state"] = int(getattr(first, "tokens_per_state", 1))
    owner = "+".join(dict.fromkeys(k.value for k in kinds))
    return kind, {**out, "owner": owner}


def transfer_groups(kv_cache_config: Any) -> list[tuple[int, Any]]:
    """``(vLLM group index, group)`` of every group a hand-off moves."""
    return [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if getattr(g, "enable_kv_transfer", True)]


def _speculative_tokens(kv_cache_config: Any, num_speculative_tokens: int | None) -> int:
    if num_speculative_tokens is not None:
        return num_speculative_tokens
    # Without the engine's config: Mamba managers co-allocate one scratch slot per draft token.
    slots = [getattr(s, "num_speculative_blocks", 0) for _, g in transfer_groups(kv_cache_config)
             for _, s in _layer_specs(g)]
    return max(slots, default=0)


def cache_layout(kv_cache_config: Any, num_speculative_tokens: int | None = None) -> CacheLayout:
    """The `CacheLayout` of an engine's ``KVCacheConfig`` (see the module docstring).

    ``num_speculative_tokens`` is the engine's (``vllm_config.num_speculative_tokens``),
    compared at the handshake; left out, it is read off the state specs' scratch slots.
    """
    groups = transfer_groups(kv_cache_config)
    if not groups:
        raise UnsupportedTopology("the engine has no transferable KV cache groups")
    num_blocks = kv_cache_config.num_blocks
    pages: dict[str, int] = {}
    for i, g in groups:
        if getattr(g, "host_resident", False):
            raise UnsupportedTopology(f"KV cache group {i}: host_resident=True is not supported "
                                      "(HiSparse host pools)")
        for layer, spec in _layer_specs(g):
            pages[layer] = spec.page_size_bytes
    wanted = set(pages)
    placements = []
    for i, t in enumerate(kv_cache_config.kv_cache_tensors):
        if getattr(t, "host_resident", False):
            raise UnsupportedTopology(f"kv_cache_tensors[{i}].host_resident=True is not supported")
        if not set(t.layers) & wanted:
            continue  # a non-transfer group's tensor
        placements.append(TensorPlacement(t.size, tuple(t.layers), t.layer_stride,
                                          t.block_stride, t.offset))
    rows = {p.block_stride for p in placements}
    # Block-outermost: one row stride for every tensor, layers side by side inside it.  (The
    # scheduler's config keeps one spec per group, so the tensors' strides are what count.)
    packed = len(rows) == 1 and all(len(p.layers) == 1 or p.layer_stride < p.block_stride
                                    for p in placements) \
        and any(p.block_stride != pages[p.layers[0]] for p in placements)
    if packed:
        (row,) = rows
        for i, p in enumerate(placements):
            page = p.layer_stride if len(p.layers) > 1 else min(pages[p.layers[0]], row)
            if p.offset + len(p.layers) * page > row or p.size < num_blocks * row:
                raise UnsupportedTopology(f"KV cache placement: kv_cache_tensors[{i}] does not "
                                          f"fit a {row}-byte row of {num_blocks} blocks")
        region = CacheRegion(sorted(pages)[0] + "@row", row, offset=0)
        regions = dict.fromkeys(pages, region)
    else:
        try:
            regions = tensor_regions(placements, pages, num_blocks)
        except GeometryMismatch as exc:
            raise UnsupportedTopology(f"KV cache placement: {exc}") from None
    out = []
    for n, (i, g) in enumerate(groups):
        kind, fields = _group_kind(i, g)
        missing = [layer for layer in g.layer_names if layer not in regions]
        if missing:
            raise UnsupportedTopology(f"KV cache group {i}: layers {missing} have no tensor")
        mine = [regions[layer] for layer in g.layer_names]
        if len({r.name for r in mine}) == 1 and len(mine) > 1:
            mine = mine[:1]  # packed blocks: one region holds every layer's page
        out.append(CacheGroup(n, kind, g.kv_cache_spec.block_size, num_blocks, tuple(mine),
                              tuple(g.layer_names), fields["window"], fields["spec_slots"],
                              fields["owner"], fields["tokens_per_state"],
                              fields["tp_replicated"], bool(getattr(g, "is_eagle_group", False))))
    return CacheLayout(tuple(out),
                       speculative_tokens=_speculative_tokens(kv_cache_config, num_speculative_tokens),
                       source_groups=tuple(i for i, _ in groups),
                       num_source_groups=len(kv_cache_config.kv_cache_groups))

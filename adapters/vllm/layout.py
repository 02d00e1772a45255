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
group, the spec and the field: specs not in the table, windows that retain
extra tokens, Mamba prefill checkpoint slots, and host-resident groups and
tensors unless the caller asks for host pools (``host_pools=True``: the
connector does on D, where READs land in the pool; P is read from the device).

HiSparse (vLLM 0.32, D only): the source group (a DSA model's ``SPARSE``
MLA layers) lives in a host pool of its own (``hisparse_host_num_blocks``
blocks, layer-outermost), the indexer group on the device, block-outermost
in rows shared with the resident / hot groups, which are not transfer
groups.  The source group's regions are `Memory.HOST` with the host pool's
block count; the indexer's are one per layer, ``stride`` the row (the row's
other bytes belong to groups never read).  A P with HiSparse off plans the
``SPARSE`` and ``INDEXER`` layers in one vLLM group (one block table); the
layout describes them as two groups, as D's planner does (`_split`), both
cut from that group's block list (`CacheLayout.select`), so the two plans
pair group by group and region by region.

Placements: layer-outermost tensors give each layer (or each layer slot
shared by overlaid groups) a region of its own; block-outermost ones
(BLNHC / BLHNC, which vLLM resolves for models mixing page sizes, as
Qwen4-exp's QSA owners do) pack every group's pages of block *b* into one
row of the allocation, and since a block id belongs to one group at a
time, the row is that group's: the layout then has one region, the row,
and a group's block is its whole row.
"""

from __future__ import annotations

import dataclasses
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
    Memory,
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


def _role(spec: Any) -> str:
    return getattr(getattr(spec, "cache_role", None), "value", "")


_ROLES = ("sparse", "indexer")


def _dsa_role(spec: Any) -> str:
    """``sparse`` / ``indexer`` for a DSA model's MLA spec, '' otherwise."""
    if type(spec).__name__ != "MLAAttentionSpec" or spec.tokens_per_state != 1:
        return ""
    return _role(spec) if _role(spec) in _ROLES else ""


def _split(group: Any, tensor_of: dict[str, int]) -> list[tuple[list[str], str]]:
    """``(layers, DSA role)`` of each group the layout makes of one vLLM group: one, or, for a DSA
    model's group of ``SPARSE`` and ``INDEXER`` MLA layers (HiSparse off), the sparse
    layers then the indexer's, as vLLM's HiSparse planner groups them
    (``v1/hisparse/layout.py: _partition_hisparse_specs``).

    The scheduler's config keeps one spec per group (the first layer's), so there the
    roles are told apart by tensor: vLLM gives each distinct spec of a group its own
    tensors, and the first layer's tensors hold its role's layers."""
    specs = _layer_specs(group)
    if isinstance(getattr(group.kv_cache_spec, "kv_cache_specs", None), dict):
        roles = {layer: _dsa_role(s) for layer, s in specs}
    else:
        first = _dsa_role(group.kv_cache_spec)
        other = _ROLES[1 - _ROLES.index(first)] if first else ""
        home = tensor_of.get(group.layer_names[0]) if group.layer_names else None
        roles = {layer: first if tensor_of.get(layer) == home else other for layer, _ in specs}
    if set(roles.values()) != set(_ROLES):
        return [(list(group.layer_names), "")]
    return [([layer for layer, _ in specs if roles[layer] == role], role) for role in _ROLES]


def _layer_page(spec: Any, tensor: Any, num_blocks: int) -> int:
    """A layer's page: its spec's; in the scheduler's config (one spec per group) a
    layer-outermost tensor's block stride where the group's spec does not fit it."""
    page = spec.page_size_bytes
    if tensor is None or page in (tensor.block_stride, tensor.layer_stride):
        return page
    if tensor.layer_stride >= num_blocks * tensor.block_stride:  # layer-outermost
        return tensor.block_stride
    return page


def _group_kind(index: int, group: Any, layers: list[str] | None = None, role: str = ""
                ) -> tuple[CacheKind, dict[str, Any]]:
    """The group's kind and its compared fields, from every layer's spec (of ``layers``;
    ``role``: the DSA role `_split` found for them, where the spec says another)."""
    kinds, fields = [], []
    specs = [(x, s) for x, s in _layer_specs(group) if layers is None or x in layers]
    if not specs:  # no layers: vLLM's group spec decides (a HiSparse resident / hot group)
        specs = [("no layers", group.kv_cache_spec)]
    specs = [(x, dataclasses.replace(s, cache_role=type(s.cache_role)(role))
              if role and _dsa_role(s) not in ("", role) else s) for x, s in specs]
    for layer, spec in specs:
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


def _host_pool(kv_cache_config: Any, groups: list[tuple[int, Any]], host_pools: bool) -> int:
    """The host pool's block count (0: none); refused unless ``host_pools``."""
    host = [i for i, g in groups if getattr(g, "host_resident", False)]
    tensors = [i for i, t in enumerate(kv_cache_config.kv_cache_tensors)
               if getattr(t, "host_resident", False)]
    if not host and not tensors:
        return 0
    if not host_pools:
        where = (f"KV cache group {host[0]}: host_resident=True" if host
                 else f"kv_cache_tensors[{tensors[0]}].host_resident=True")
        raise UnsupportedTopology(f"{where} is not supported on P (a HiSparse host pool is "
                                  "D's: P runs HiSparse off and is read from the device)")
    num = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    if len(host) != 1 or not num:
        raise UnsupportedTopology(f"host-resident KV cache groups {host} with "
                                  f"hisparse_host_num_blocks={num!r}: one host group and its "
                                  "pool size are required")
    return num


def cache_layout(kv_cache_config: Any, num_speculative_tokens: int | None = None,
                 host_pools: bool = False, prefill_lookahead: int = 0) -> CacheLayout:
    """The `CacheLayout` of an engine's ``KVCacheConfig`` (see the module docstring).

    ``num_speculative_tokens`` is the engine's (``vllm_config.num_speculative_tokens``),
    compared at the handshake; left out, it is read off the state specs' scratch slots.
    ``host_pools`` maps a HiSparse host pool instead of refusing it.
    ``prefill_lookahead`` is ``vllm_config.num_prefill_lookahead_tokens``.
    """
    groups = transfer_groups(kv_cache_config)
    if not groups:
        raise UnsupportedTopology("the engine has no transferable KV cache groups")
    num_blocks = kv_cache_config.num_blocks
    host_blocks = _host_pool(kv_cache_config, groups, host_pools)
    tensors = kv_cache_config.kv_cache_tensors
    tensor_of = {layer: i for i, t in enumerate(tensors) for layer in t.layers}
    pages: dict[str, int] = {}
    for _, g in groups:
        collapsed = not isinstance(getattr(g.kv_cache_spec, "kv_cache_specs", None), dict)
        pool = host_blocks if getattr(g, "host_resident", False) else num_blocks
        for layer, spec in _layer_specs(g):
            t = tensors[tensor_of[layer]] if collapsed and layer in tensor_of else None
            pages[layer] = _layer_page(spec, t, pool)
    wanted = set(pages)
    placements, host = [], []
    for t in tensors:
        if not set(t.layers) & wanted:
            continue  # a non-transfer group's tensor
        (host if getattr(t, "host_resident", False) else placements).append(TensorPlacement(
            t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset))
    regions = _device_regions(placements, pages, num_blocks, shared_rows=bool(host_blocks))
    if host:
        try:
            host_regions = tensor_regions(host, pages, host_blocks)
        except GeometryMismatch as exc:
            raise UnsupportedTopology(f"KV cache placement (host pool): {exc}") from None
        regions.update({layer: dataclasses.replace(r, memory=Memory.HOST)
                        for layer, r in host_regions.items()})
    out, sources = [], []
    for i, g in groups:
        for part, role in _split(g, tensor_of):
            n = len(out)
            kind, fields = _group_kind(i, g, part, role)
            missing = [layer for layer in part if layer not in regions]
            if missing:
                raise UnsupportedTopology(f"KV cache group {i}: layers {missing} have no tensor")
            mine = [regions[layer] for layer in part]
            if len({r.name for r in mine}) == 1 and len(mine) > 1:
                mine = mine[:1]  # packed blocks: one region holds every layer's page
            pool = host_blocks if getattr(g, "host_resident", False) else num_blocks
            out.append(CacheGroup(n, kind, g.kv_cache_spec.block_size, pool, tuple(mine),
                                  tuple(part), fields["window"], fields["spec_slots"],
                                  fields["owner"], fields["tokens_per_state"],
                                  fields["tp_replicated"],
                                  bool(getattr(g, "is_eagle_group", False))))
            sources.append(i)
    return CacheLayout(tuple(out),
                       speculative_tokens=_speculative_tokens(kv_cache_config, num_speculative_tokens),
                       prefill_lookahead=prefill_lookahead,
                       source_groups=tuple(sources),
                       num_source_groups=len(kv_cache_config.kv_cache_groups),
                       host_block_stride=(getattr(kv_cache_config, "hisparse_host_block_stride",
                                                  None) or 0) if host_blocks else 0,
                       shared_host_pool=bool(host_blocks and getattr(
                           kv_cache_config, "hisparse_shared_host_pool", False)))


def _device_regions(placements: list[TensorPlacement], pages: dict[str, int], num_blocks: int,
                    shared_rows: bool) -> dict[str, CacheRegion]:
    """Each device layer's region (see the module docstring: rows, and a HiSparse D's rows
    shared with groups that are not transferred: one region per layer, ``stride`` the row)."""
    if not placements:
        return {}
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
        if shared_rows:
            return {layer: CacheRegion(layer, pages[layer], offset=p.offset + k * p.layer_stride,
                                       stride=row)
                    for p in placements for k, layer in enumerate(p.layers)}
        region = CacheRegion(sorted(pages)[0] + "@row", row, offset=0)
        return {layer: region for p in placements for layer in p.layers}
    try:
        return tensor_regions(placements, pages, num_blocks)
    except GeometryMismatch as exc:
        raise UnsupportedTopology(f"KV cache placement: {exc}") from None

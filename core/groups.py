"""Cache groups: the several owners of one request's cache, as both engines describe them.

A hybrid model's cache is not one KV pool.  vLLM 0.32 splits it into *KV
cache groups* (full attention, sliding-window attention, Mamba / GDN state,
...), each with its own block table, all drawing on one block pool and often
on the same physical tensors; sparse-attention models add an indexer cache
next to the main KV, and some carry per-layer-embedding state.  This module
names those owners and their geometry so that P can announce them, D can
check them group by group, and `core.planning.plan_group_reads` can decide
what each group needs to read.

Theory of operation
-------------------
* A `CacheRegion` is one physical range the transport registers: ``name``
  (a tensor, or one half of a K/V-split tensor) viewed as blocks of
  ``block_bytes``.  Groups *refer* to regions by name, so a tensor shared by
  several groups (vLLM's hybrid allocator backs layer *i* of every group
  with tensor *i*) is one region, registered once; the groups keep apart by
  their block ids, which one block pool hands out.
* A `CacheGroup` is one owner: its index (vLLM's group index), its `CacheKind`,
  tokens per block, the regions it reads, the layers it serves, and, for a
  sliding window, the window in tokens; for state kinds, the trailing
  speculative scratch slots vLLM allocates after the running state.
* A region lives in one of the engine's pools (`Memory`): the device pool
  every group shares, or a host pool of its own (vLLM 0.32's HiSparse keeps
  a sparse-attention model's KV history in host DRAM on D: the group reading
  it numbers its blocks in that pool, ``num_blocks`` its size).  ``stride``
  is the bytes between two blocks of a region where they are not adjacent
  (a device row shared with groups that are not transferred).  Memory,
  stride and offset are this engine's knowledge: never on the wire, never
  compared (P's layout with HiSparse off pairs with D's with it on).
* A `CacheLayout` is every group of one rank plus the schema version.
  `to_wire` / `from_wire` carry it as plain JSON; `from_wire` refuses
  anything malformed with `MalformedGroups` naming the group and field, and
  `check_matches` refuses a peer whose groups cannot be paired with ours
  with `GroupMismatch`, likewise named.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvhandoff.core.errors import GeometryMismatch, MalformedMessage
from kvhandoff.core.safelog import bounded_repr

SCHEMA_VERSION = 1


class Memory(StrEnum):
    """Which of the engine's pools a region's blocks are in."""

    DEVICE = "device"  # the pool every group shares (GPU memory on a GPU engine)
    HOST = "host"  # a host (DRAM) pool of its own: vLLM's HiSparse source group on D


class Reads(StrEnum):
    """What a hand-off reads of a group, by position in its block list."""

    PROMPT = "prompt"  # every block holding a prompt token (block-aligned with the tokens)
    WINDOW = "window"  # the blocks covering the last ``window`` tokens
    SLOT = "slot"  # the one slot the request ends with; trailing scratch slots dropped


class CacheKind(StrEnum):
    """What a group holds, which decides what a hand-off reads of it (`KIND_READS`)."""

    FULL_ATTENTION = "full_attention"  # every block of the prompt
    SLIDING_WINDOW = "sliding_window"  # the blocks covering the last ``window`` tokens
    INDEXER = "indexer"  # a sparse-attention indexer cache: block-aligned with the main KV
    COMPRESSED_KEY = "compressed_key"  # one state per ``tokens_per_state`` tokens, main KV's table
    KEY_RING = "key_ring"  # a per-request ring of raw keys (capacity = block_size): one block
    MAMBA_STATE = "mamba_state"  # conv + SSM state: the slot the request ends with
    LINEAR_STATE = "linear_state"  # linear-attention (GDN) state: likewise one slot
    LAYER_EMBEDDING = "layer_embedding"  # per-layer-embedding state: one slot, every rank

    @property
    def reads(self) -> Reads:
        return KIND_READS[self]

    @property
    def reads_state(self) -> bool:
        return KIND_READS[self] is Reads.SLOT


# The one table of what each kind reads; planning (`core.planning`) asks it, never the kind.
KIND_READS: dict[CacheKind, Reads] = {
    CacheKind.FULL_ATTENTION: Reads.PROMPT,
    CacheKind.INDEXER: Reads.PROMPT,
    CacheKind.COMPRESSED_KEY: Reads.PROMPT,
    CacheKind.SLIDING_WINDOW: Reads.WINDOW,
    CacheKind.KEY_RING: Reads.SLOT,
    CacheKind.MAMBA_STATE: Reads.SLOT,
    CacheKind.LINEAR_STATE: Reads.SLOT,
    CacheKind.LAYER_EMBEDDING: Reads.SLOT,
}

# How a mismatch names a compared field, where a kind gives it a meaning of its own.
_FIELD_NAMES: dict[tuple[CacheKind, str], str] = {
    (CacheKind.KEY_RING, "block_size"): "block_size (ring capacity)",
    (CacheKind.COMPRESSED_KEY, "tokens_per_state"): "tokens_per_state (compress ratio)",
    (CacheKind.FULL_ATTENTION, "tokens_per_state"): "tokens_per_state (compress ratio of the "
                                                    "compressed keys in this group)",
}


class MalformedGroups(MalformedMessage):
    """A cache-group description that does not parse; names the group and field."""

    def __init__(self, group: int | None, field: str, problem: str) -> None:
        self.group, self.field, self.problem = group, field, problem
        where = "cache layout" if group is None else f"cache group {group}"
        super().__init__(f"{where}: field {field!r} {problem}")


class GroupMismatch(GeometryMismatch):
    """Two sides' groups (or a request's block ids) that cannot be paired; names the group."""

    def __init__(self, group: int | None, field: str, expected: object, found: object) -> None:
        self.group, self.field = group, field
        where = "cache layout" if group is None else f"cache group {group}"
        super().__init__(f"{where}: {field}", expected=expected, found=found)


@dataclass(frozen=True, slots=True)
class CacheRegion:
    """One registered range: ``name`` viewed as blocks of ``block_bytes``.

    ``parts`` optionally names sub-ranges of each block, ``(label, offset,
    nbytes)`` (conv and SSM state inside one Mamba page): documentation and
    checks only, the block is read whole.
    """

    name: str
    block_bytes: int
    parts: tuple[tuple[str, int, int], ...] = ()
    # Where block 0 sits in this engine's backing allocation (`tensor_regions`); local
    # knowledge, never on the wire: P and D size their pools, hence their offsets, apart.
    offset: int = field(default=-1, compare=False)
    # The pool the blocks are in, and the bytes from one block to the next (0: adjacent,
    # ``block_bytes``); local knowledge like ``offset``.
    memory: Memory = field(default=Memory.DEVICE, compare=False)
    stride: int = field(default=0, compare=False)

    @property
    def block_stride(self) -> int:
        """Bytes from block *b* to block *b + 1* in this engine's allocation."""
        return self.stride or self.block_bytes


@dataclass(frozen=True, slots=True)
class CacheGroup:
    index: int
    kind: CacheKind
    block_size: int  # tokens per block (state kinds: tokens one state covers, informative)
    num_blocks: int  # the pool's size: block ids of this group are in [0, num_blocks)
    regions: tuple[CacheRegion, ...]  # regions[i] holds layers[i]; or one region holds all
    layers: tuple[str, ...] = ()
    window: int = 0  # sliding window in tokens (SLIDING_WINDOW only)
    spec_slots: int = 0  # trailing speculative scratch slots (state kinds only)
    owner: str = ""  # free label: "main_kv", "indexer", "gdn", "ple", ...
    tokens_per_state: int = 1  # tokens one stored state covers (compressed keys: the ratio)
    tp_replicated: bool = False  # every TP rank holds the whole state (PLE), not a shard
    draft: bool = False  # holds the drafter's (MTP / EAGLE) layers: vLLM's is_eagle_group

    @property
    def block_bytes(self) -> int:
        """Bytes one block (or state slot) of this group spans over all its regions."""
        return sum(r.block_bytes for r in self.regions)


@dataclass(frozen=True, slots=True)
class CacheLayout:
    groups: tuple[CacheGroup, ...]
    version: int = SCHEMA_VERSION
    speculative_tokens: int = 0  # the engine's num_speculative_tokens (draft tokens per step)
    # vLLM's ``num_prefill_lookahead_tokens``: prompt tokens past the computed range the
    # drafter reads (multi-module MTP: its whole chain), which P must leave to D
    # (`core.planning.prefill_backoff`).  Local: both sides derive it from the same
    # model config, and a mismatch is D's ``remote_num_tokens`` check; never on the wire.
    prefill_lookahead: int = field(default=0, compare=False)
    # vLLM's index of each group here (its transfer groups) and how many groups vLLM has:
    # local knowledge to cut vLLM's per-group block lists (`select`), never on the wire.
    # Two groups here may come from one of vLLM's (one block table, layers split by kind).
    source_groups: tuple[int, ...] = field(default=(), compare=False)
    num_source_groups: int = field(default=0, compare=False)
    # A host pool's geometry (vLLM's ``hisparse_host_block_stride`` and
    # ``hisparse_shared_host_pool``): this engine's business, never on the wire.
    host_block_stride: int = field(default=0, compare=False)
    shared_host_pool: bool = field(default=False, compare=False)

    def select(self, block_ids: Sequence[Any]) -> tuple[Any, ...]:
        """vLLM's per-group lists cut to this layout's groups, as vLLM's
        ``select_transfer_block_ids`` does: every group's list, or vLLM's transfer groups'
        only, or already one per group here."""
        if not self.source_groups:
            return tuple(block_ids)
        if len(block_ids) == self.num_source_groups:
            return tuple(block_ids[i] for i in self.source_groups)
        transfer = sorted(set(self.source_groups))
        if len(block_ids) == len(transfer):
            return tuple(block_ids[transfer.index(i)] for i in self.source_groups)
        if len(block_ids) == len(self.groups):
            return tuple(block_ids)
        raise GroupMismatch(None, "block id lists (vLLM's KV cache groups)",
                            self.num_source_groups, len(block_ids))

    def regions(self) -> tuple[CacheRegion, ...]:
        """Each physical region once, in first-use order, however many groups share it."""
        return physical_regions(self.groups)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "groups": [_group_to_wire(g) for g in self.groups],
                "speculative_tokens": self.speculative_tokens}

    @classmethod
    def from_wire(cls, obj: Any) -> CacheLayout:
        """Parse `to_wire`'s output; `MalformedGroups` names what was wrong."""
        if not isinstance(obj, dict):
            raise MalformedGroups(None, "", f"must be an object, found {type(obj).__name__}")
        version = obj.get("version")
        if version != SCHEMA_VERSION:
            raise MalformedGroups(None, "version", f"must be {SCHEMA_VERSION}, found {bounded_repr(version)}")
        groups = obj.get("groups")
        if not isinstance(groups, list) or not groups:
            raise MalformedGroups(None, "groups", "must be a non-empty list")
        parsed = tuple(_group_from_wire(i, g) for i, g in enumerate(groups))
        spec = obj.get("speculative_tokens", 0)
        if type(spec) is not int or spec < 0:
            raise MalformedGroups(None, "speculative_tokens", f"must be an int >= 0, found {bounded_repr(spec)}")
        layout = cls(parsed, speculative_tokens=spec)
        physical_regions(layout.groups)  # one block size per shared region
        return layout

    def check_matches(self, peer: CacheLayout) -> None:
        """Refuse ``peer``'s layout unless every group pairs with ours (D checks P's).

        The draft configuration (``speculative_tokens``), the same number of
        groups, and per group the fields of `COMPARED` (kind, block size, which
        is a key ring's capacity, window, speculative slots, tokens per state,
        which is the compress ratio, whether TP ranks replicate the state,
        whether it holds draft layers) and its regions (names and bytes per
        block).  Pool sizes (each engine sizes its own), which pool a region is
        in and its stride (a HiSparse D's host pool and shared rows), layer
        names and owner labels are not compared: block ids are checked per
        request against each side's pool, and names describe, they do not
        decide where bytes go.  A mismatch names the group and the field.
        """
        if self.speculative_tokens != peer.speculative_tokens:
            raise GroupMismatch(None, "speculative_tokens (num_speculative_tokens)",
                                self.speculative_tokens, peer.speculative_tokens)
        if len(self.groups) != len(peer.groups):
            raise GroupMismatch(None, "number of groups", len(self.groups), len(peer.groups))
        for mine, theirs in zip(self.groups, peer.groups, strict=True):
            for name in COMPARED:
                a, b = getattr(mine, name), getattr(theirs, name)
                if a != b:
                    raise GroupMismatch(mine.index, _FIELD_NAMES.get((mine.kind, name), name), a, b)
            ours = [(r.name, r.block_bytes) for r in mine.regions]
            peers = [(r.name, r.block_bytes) for r in theirs.regions]
            if ours != peers:
                raise GroupMismatch(mine.index, "regions", ours, peers)


# The group fields two peers must agree on, in the order a mismatch is reported.
COMPARED = ("kind", "block_size", "window", "spec_slots", "tokens_per_state", "tp_replicated",
            "draft")


def physical_regions(groups: Iterable[CacheGroup]) -> tuple[CacheRegion, ...]:
    """The distinct regions ``groups`` read, once each; a name with two block sizes is refused."""
    seen: dict[str, tuple[int, CacheRegion]] = {}
    for g in groups:
        for r in g.regions:
            first = seen.get(r.name)
            if first is None:
                seen[r.name] = (g.index, r)
            elif first[1].block_bytes != r.block_bytes:
                raise GroupMismatch(g.index, f"regions[{bounded_repr(r.name)}].block_bytes (shared with "
                                    f"group {first[0]})", first[1].block_bytes, r.block_bytes)
    return tuple(r for _, r in seen.values())


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """vLLM 0.32's ``KVCacheTensor``: where a set of same-shaped layers' pages sit.

    Layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride
    + b * block_stride`` bytes into the engine's backing allocation of ``size``
    bytes (as in vLLM, ``size`` is the whole allocation's, the same for every
    tensor, not this tensor's share).  Tensors whose ranges coincide alias the
    same bytes: vLLM lays every group out from byte 0, so groups overlay each
    other, and one block id is owned by one group at a time.
    """

    size: int  # bytes of the whole backing allocation
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


def tensor_regions(tensors: Sequence[TensorPlacement], page_bytes: Mapping[str, int],
                   num_blocks: int) -> dict[str, CacheRegion]:
    """Each layer's region; layers placed on the same bytes share one region.

    Layer-outermost placements (``block_stride`` = the page) give each layer
    its own region; block-outermost ones (``layer_stride`` = the page,
    ``block_stride`` = all layers' pages) give the whole tensor one region
    whose block is every layer's page at once.  Anything else is refused.
    Layers of different groups at the same offset (vLLM's hybrid allocator
    overlaying groups) get the *same* region, named after the first of them:
    registered once, told apart by block ids.  Names depend on the model's
    structure only, so P and D name their regions alike whatever their pool
    sizes; ``offset`` says where each region starts here.
    """
    places: dict[str, tuple[int, int]] = {}  # layer -> (offset, block bytes)
    for i, t in enumerate(tensors):
        pages = {page_bytes[layer] for layer in t.layers}
        if len(pages) != 1:
            raise GroupMismatch(None, f"kv_cache_tensors[{i}] page bytes", "one size",
                                sorted(pages))
        (page,) = pages
        if t.block_stride == page:
            spots = [(t.offset + k * t.layer_stride, page) for k in range(len(t.layers))]
        elif t.layer_stride == page and t.block_stride == page * len(t.layers):
            spots = [(t.offset, t.block_stride)] * len(t.layers)
        else:
            raise GroupMismatch(None, f"kv_cache_tensors[{i}] strides", "layer-outermost "
                                f"(block_stride {page}) or packed blocks (layer_stride {page})",
                                (t.layer_stride, t.block_stride))
        for layer, (offset, block_bytes) in zip(t.layers, spots, strict=True):
            if offset + (num_blocks - 1) * t.block_stride + block_bytes > t.size:
                raise GroupMismatch(None, f"kv_cache_tensors[{i}].size",
                                    f"room for {num_blocks} blocks of {bounded_repr(layer)}", t.size)
            if layer in places:
                raise GroupMismatch(None, f"kv_cache_tensors[{i}].layers",
                                    "each layer in one tensor", layer)
            places[layer] = (offset, block_bytes)
    by_place: dict[int, CacheRegion] = {}
    by_layer: dict[str, CacheRegion] = {}
    for layer, (offset, block_bytes) in places.items():
        region = by_place.setdefault(offset, CacheRegion(layer, block_bytes, offset=offset))
        if region.block_bytes != block_bytes:
            raise GroupMismatch(None, f"layer {bounded_repr(layer)} block bytes (placed on {bounded_repr(region.name)})",
                                region.block_bytes, block_bytes)
        by_layer[layer] = region
    return by_layer


# --- the wire form ----------------------------------------------------------


def _group_to_wire(g: CacheGroup) -> dict[str, Any]:
    return {
        "index": g.index, "kind": g.kind.value, "block_size": g.block_size,
        "num_blocks": g.num_blocks,
        "regions": [[r.name, r.block_bytes, [list(p) for p in r.parts]] for r in g.regions],
        "layers": list(g.layers), "window": g.window, "spec_slots": g.spec_slots,
        "owner": g.owner, "tokens_per_state": g.tokens_per_state,
        "tp_replicated": g.tp_replicated, "draft": g.draft,
    }


def _get(obj: dict, index: int, name: str, kind: type, default: Any = None) -> Any:
    if name not in obj:
        if default is not None:
            return default
        raise MalformedGroups(index, name, "is missing")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedGroups(index, name, f"must be {kind.__name__}, found "
                              f"{type(value).__name__} {bounded_repr(value)}")
    return value


def _group_from_wire(i: int, obj: Any) -> CacheGroup:
    if not isinstance(obj, dict):
        raise MalformedGroups(i, "", f"must be an object, found {type(obj).__name__}")
    index = _get(obj, i, "index", int)
    if index != i:
        raise MalformedGroups(i, "index", f"must be {i} (groups are listed in order), found {index}")
    try:
        kind = CacheKind(_get(obj, i, "kind", str))
    except ValueError:
        raise MalformedGroups(i, "kind", f"must be one of {[k.value for k in CacheKind]}, "
                              f"found {bounded_repr(obj['kind'])}") from None
    block_size = _get(obj, i, "block_size", int)
    window = _get(obj, i, "window", int, 0)
    spec_slots = _get(obj, i, "spec_slots", int, 0)
    num_blocks = _get(obj, i, "num_blocks", int)
    for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
        if value < 1:
            raise MalformedGroups(i, name, f"must be >= 1, found {value}")
    if (kind is CacheKind.SLIDING_WINDOW) != (window > 0) or window < 0:
        raise MalformedGroups(i, "window", f"must be > 0 exactly for sliding_window, found "
                              f"{window} for {kind.value}")
    if spec_slots < 0 or (spec_slots and not kind.reads_state):
        raise MalformedGroups(i, "spec_slots", f"must be 0, or >= 0 for state kinds, found "
                              f"{spec_slots} for {kind.value}")
    raw_regions = _get(obj, i, "regions", list)
    if not raw_regions:
        raise MalformedGroups(i, "regions", "must name at least one region")
    regions = tuple(_region_from_wire(i, j, r) for j, r in enumerate(raw_regions))
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise MalformedGroups(i, "regions", f"must name each region once, found {names}")
    layers = _get(obj, i, "layers", list, [])
    if not all(isinstance(x, str) for x in layers):
        raise MalformedGroups(i, "layers", "must hold strings")
    owner = obj.get("owner", "")
    if not isinstance(owner, str):
        raise MalformedGroups(i, "owner", f"must be str, found {type(owner).__name__}")
    tokens_per_state = _get(obj, i, "tokens_per_state", int, 1)
    if tokens_per_state < 1:
        raise MalformedGroups(i, "tokens_per_state", f"must be >= 1, found {tokens_per_state}")
    flags = {}
    for name in ("tp_replicated", "draft"):
        flags[name] = obj.get(name, False)
        if type(flags[name]) is not bool:
            raise MalformedGroups(i, name, f"must be bool, found {type(flags[name]).__name__} "
                                  f"{bounded_repr(flags[name])}")
    return CacheGroup(i, kind, block_size, num_blocks, regions, tuple(layers), window, spec_slots,
                      owner, tokens_per_state, **flags)


def _region_from_wire(group: int, j: int, raw: Any) -> CacheRegion:
    field = f"regions[{j}]"
    if not (isinstance(raw, list) and len(raw) in (2, 3) and isinstance(raw[0], str) and raw[0]
            and type(raw[1]) is int and raw[1] > 0 and (len(raw) == 2 or isinstance(raw[2], list))):
        raise MalformedGroups(group, field, f"must be [name, block_bytes > 0, parts], found {bounded_repr(raw)}")
    parts: list[tuple[str, int, int]] = []
    for p in raw[2] if len(raw) == 3 else []:
        if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
                and all(type(x) is int and x >= 0 for x in p[1:])
                and p[1] + p[2] <= raw[1]):
            raise MalformedGroups(group, f"{field}.parts", f"must be [label, offset, nbytes] "
                                  f"inside {raw[1]} bytes, found {bounded_repr(p)}")
        parts.append((p[0], p[1], p[2]))
    return CacheRegion(raw[0], raw[1], tuple(parts))

"""A vLLM worker's KV caches as the regions of a `CacheLayout`: each physical range once.

vLLM 0.32 hands ``register_kv_caches`` one tensor per layer, all views of one
backing allocation, and its hybrid allocator overlays groups on the same
bytes (a Gemma-3 sliding layer and a full layer share one tensor).  A
layout's regions (`kvhandoff.core.groups.tensor_regions`) already name each
physical range once and know where it starts; `kv_regions` turns them into
`KVRegion` byte views of that allocation, checking on the way that every
layer vLLM gave us sits where the layout says.  The transport then
registers the allocation once (`transports.nixl.memory.plan_registrations`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhandoff.core.groups import CacheLayout, Memory
from kvhandoff.core.planning import in_host_pool
from kvhandoff.transports.base import KVRegion, MemoryKind, RegionMismatch


def kv_regions(kv_caches: Mapping[str, Any], layout: CacheLayout,
               host_pool: bool = True) -> list[KVRegion]:
    """One `KVRegion` per region of ``layout``, a uint8 view of its backing allocation.

    A layout's regions live in one allocation per pool: the device buffer and, on a
    HiSparse D, the host pool (`Memory.HOST` regions, DRAM whatever the device).  A
    region's blocks are ``block_stride`` apart (a HiSparse D's indexer pages sit in rows
    shared with groups never read).  ``host_pool=False`` leaves the host pool's regions
    out: with a pool shared by the local TP ranks, rank 0 alone registers and reads it.

    Refuses (`RegionMismatch`, naming the layer) a layer of the layout that vLLM did not
    hand over, a pool's layers in more than one allocation, a region without its offset
    or past its allocation's end, and a layer whose tensor does not start inside its
    group's regions where the layout places it.
    """
    import torch

    wanted = [(g, i, layer) for g in layout.groups for i, layer in enumerate(g.layers)
              if host_pool or not in_host_pool(g)]
    storages: dict[Memory, dict[int, Any]] = {}
    starts: dict[str, tuple[Any, int]] = {}
    for g, i, layer in wanted:
        t = kv_caches.get(layer)
        if t is None:
            raise RegionMismatch(f"layer {layer!r} of cache group {g.index} has no KV cache")
        storage = t.untyped_storage()
        # regions[i] holds layers[i]; a single region holds them all (packed blocks)
        r = g.regions[i] if len(g.regions) == len(g.layers) else g.regions[0]
        storages.setdefault(r.memory, {})[storage.data_ptr()] = (storage, t.device)
        starts[layer] = (r, t.data_ptr() - storage.data_ptr())
    for memory, found in storages.items():
        if len(found) != 1:
            raise RegionMismatch(f"expected the {memory.value} KV caches in one backing "
                                 f"allocation, found {len(found)}")
    for g, _, layer in wanted:
        r, at = starts[layer]
        if not r.offset <= at < r.offset + r.block_bytes:
            raise RegionMismatch(f"layer {layer!r} of cache group {g.index} starts at byte "
                                 f"{at} of the allocation, not in its region {r.name!r} "
                                 f"(block 0 at {r.offset}, {r.block_bytes} bytes)")
    blocks = {r.name: g.num_blocks for g in layout.groups for r in g.regions}
    out = []
    for r in layout.regions():
        if r.memory not in storages:
            continue  # the host pool another rank registers
        ((storage, device),) = storages[r.memory].values()
        kind = MemoryKind.VRAM if device.type == "cuda" else MemoryKind.DRAM
        n = (blocks[r.name] - 1) * r.block_stride + r.block_bytes
        if r.offset < 0 or r.offset + n > storage.nbytes():
            raise RegionMismatch(f"region {r.name!r}: {n} bytes at offset {r.offset} are not "
                                 f"inside the {storage.nbytes()}-byte allocation")
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, r.offset, (n,))
        out.append(KVRegion(r.name, view, blocks[r.name], r.block_bytes, kind,
                            device.index or 0 if kind is MemoryKind.VRAM else 0,
                            stride=r.stride))
    return out

"""Where a `KVRegion`'s bytes live, and which few registrations cover them.

NIXL registers memory in ranges; every registration costs a pin (DRAM) or an
IPC handle (VRAM) and a metadata entry that peers load.  A model's KV cache is
many logical regions (per layer, K/V, cache group) that are usually views of
a few large allocations, and hybrid models map several logical groups
(attention KV, indexer KV, SSM/conv state) onto *one* physical tensor.  So
registration works on allocations, not regions: the regions of one
allocation that overlap or touch are merged into one range, and a range
shared by several regions is registered once.  Ranges of different
allocations are never merged, even when adjacent: a VRAM registration must
stay inside one CUDA allocation (its IPC handle covers one).

Everything here is pure except `locate`, which reads a buffer's address.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.transports.base import KVRegion, MemoryKind, RegionMismatch


@dataclass(frozen=True, slots=True)
class Placement:
    """A region's bytes: ``[addr, addr + nbytes)`` inside allocation ``owner``.

    Block ``b`` is ``block_bytes`` at ``addr + b * block_stride``; ``nbytes``
    is the span from block 0's first byte to the last block's last byte (a
    strided region's gaps included: they are registered, never transferred).
    """

    name: str
    kind: MemoryKind
    device: int
    addr: int
    block_bytes: int
    num_blocks: int
    owner: tuple[str, int, int]  # (kind, device, allocation base address)
    stride: int = 0  # bytes from block b to b + 1 (0: block_bytes, adjacent)
    pinned: bool = False  # host memory the CUDA driver pinned (a gather kernel can write it)

    @property
    def block_stride(self) -> int:
        return self.stride or self.block_bytes

    @property
    def nbytes(self) -> int:
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes


@dataclass(frozen=True, slots=True)
class Registration:
    """One NIXL registration: ``nbytes`` at ``addr`` on ``(kind, device)``."""

    kind: MemoryKind
    device: int
    addr: int
    nbytes: int
    regions: tuple[str, ...]  # the logical regions it covers


def locate(region: KVRegion) -> Placement:
    """Read where ``region``'s buffer lives; refuse buffers NIXL cannot READ into."""
    buf = region.buffer
    if region.num_blocks <= 0 or region.block_bytes <= 0:
        raise RegionMismatch(f"region {region.name!r}: expected positive num_blocks and "
                             f"block_bytes, found {region.num_blocks} x {region.block_bytes}")
    stride = region.block_stride
    if stride < region.block_bytes:
        raise RegionMismatch(f"region {region.name!r}: stride {stride} < block_bytes "
                             f"{region.block_bytes} (blocks would overlap)")
    need = (region.num_blocks - 1) * stride + region.block_bytes
    pinned = False
    if isinstance(buf, np.ndarray):
        kind, device, addr, nbytes, owner_addr = _numpy_place(region.name, buf)
    elif _is_torch_tensor(buf):
        kind, device, addr, nbytes, owner_addr = _torch_place(region.name, buf)
        pinned = kind is MemoryKind.DRAM and _is_pinned(buf)
    else:
        raise RegionMismatch(f"region {region.name!r}: expected a numpy array or torch "
                             f"tensor, found {type(buf).__name__}")
    if kind != region.kind or (kind is MemoryKind.VRAM and device != region.device):
        raise RegionMismatch(f"region {region.name!r}: declared {region.kind.value}:"
                             f"{region.device}, buffer is {kind.value}:{device}")
    if nbytes < need:
        shape = (f"{region.num_blocks} x {region.block_bytes}" if stride == region.block_bytes
                 else f"{region.num_blocks} x {region.block_bytes}, stride {stride}")
        raise RegionMismatch(f"region {region.name!r}: expected at least {need} bytes "
                             f"({shape}), found {nbytes}")
    return Placement(region.name, kind, device, addr, region.block_bytes, region.num_blocks,
                     (kind.value, device, owner_addr),
                     0 if stride == region.block_bytes else stride, pinned)


def plan_registrations(placements: Sequence[Placement]) -> list[Registration]:
    """The fewest ranges that cover every placement without crossing an allocation."""
    by_owner: dict[tuple[str, int, int], list[Placement]] = {}
    for p in placements:
        by_owner.setdefault(p.owner, []).append(p)
    out: list[Registration] = []
    for (_, device, _), group in sorted(by_owner.items()):
        group.sort(key=lambda p: (p.addr, p.name))
        start, end, names = group[0].addr, group[0].addr + group[0].nbytes, [group[0].name]
        for p in group[1:]:
            if p.addr <= end:  # overlaps or touches: one range
                end = max(end, p.addr + p.nbytes)
                names.append(p.name)
            else:
                out.append(Registration(group[0].kind, device, start, end - start, tuple(names)))
                start, end, names = p.addr, p.addr + p.nbytes, [p.name]
        out.append(Registration(group[0].kind, device, start, end - start, tuple(names)))
    return out


def descriptor_rows(placements: Sequence[Placement]) -> np.ndarray:
    """NIXL's strided descriptor list: one row per region, one descriptor per block.

    Row ``(addr, block_bytes, device, stride, count)``: index ``base + b``
    addresses block ``b`` of the region (``block_bytes`` at ``addr + b *
    stride``), and NIXL merges consecutive indices of one row into a single
    descriptor when they are adjacent, which is how coalesced block runs of
    an unstrided region reach the wire as one descriptor each (a strided
    region's blocks are not adjacent: one descriptor per block, so the bytes
    between them are never written).
    """
    rows = np.empty((len(placements), 5), dtype=np.int64)
    for i, p in enumerate(placements):
        rows[i] = (p.addr, p.block_bytes, p.device, p.block_stride, p.num_blocks)
    return rows


def span_rows(placements: Sequence[Placement]) -> np.ndarray:
    """One ``(addr, nbytes, device)`` row per region: what a peer must have registered."""
    rows = np.empty((len(placements), 3), dtype=np.int64)
    for i, p in enumerate(placements):
        rows[i] = (p.addr, p.nbytes, p.device)
    return rows


def _numpy_place(name: str, arr: np.ndarray) -> tuple[MemoryKind, int, int, int, int]:
    if not arr.flags.c_contiguous:
        raise RegionMismatch(f"region {name!r}: expected a C-contiguous array, found strides "
                             f"{arr.strides}")
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    owner = root.ctypes.data if root.flags.c_contiguous else arr.ctypes.data
    return MemoryKind.DRAM, 0, arr.ctypes.data, arr.nbytes, owner


def _torch_place(name: str, t: Any) -> tuple[MemoryKind, int, int, int, int]:
    if not t.is_contiguous():
        raise RegionMismatch(f"region {name!r}: expected a contiguous tensor, found strides "
                             f"{tuple(t.stride())}")
    kind = MemoryKind.VRAM if t.is_cuda else MemoryKind.DRAM
    device = (t.device.index or 0) if t.is_cuda else 0
    owner = t.untyped_storage().data_ptr()
    return kind, device, t.data_ptr(), t.numel() * t.element_size(), owner


def _is_pinned(t: Any) -> bool:
    """Whether a host tensor is CUDA-pinned (never initialises CUDA to find out)."""
    try:
        return bool(t.is_pinned())
    except Exception:  # a torch built without CUDA, or no driver
        return False


def _is_torch_tensor(obj: object) -> bool:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to ask
    return torch is not None and isinstance(obj, torch.Tensor)

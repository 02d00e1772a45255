"""Same-node VRAM-to-VRAM READs as one gather kernel per region pair, over CUDA IPC.

Why: UCX's cuda_ipc transport turns every descriptor of a READ into its own
``cuMemcpyDtoDAsync`` plus event bookkeeping, ~8-10 µs of CPU each on an
H200 (measured: docs/nixl.md).  A shuffled 1 GiB READ in 8,192 descriptors
then runs at ~13 GB/s, in 65,536 at ~2 GB/s, against a ~2 TB/s device copy.
The descriptors' bytes are never the problem; their count is.  UCX itself
reaches the source through exactly the same mechanism (CUDA IPC: the
source's allocation mapped into the reader's address space), so when both
agents are on one node this module maps the source's allocations once per
peer and copies a whole READ split with one ``index_select`` kernel per
region pair on a side stream: no per-descriptor CPU work at all.

What stays with NIXL: metadata, notifications (including the completion
notification, sent after the kernel's event fired), host memory, VRAM to
host, and peers on other nodes or whose allocations cannot be exported
(``expandable_segments`` / VMM allocations).  Nothing here is used unless
``NixlOptions.vram_ipc`` is on and both sides agree they share a node.

The CUDA driver API is called through ctypes (``libcuda.so.1``, which every
CUDA process has loaded); torch provides streams, events and the kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

_LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    """A CUDA driver call of the IPC path failed (the caller falls back to NIXL)."""


class _IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array reads back as a C string, cut at the
    # first NUL byte, and IPC handles are full of them.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def handle_to_hex(handle: _IpcHandle) -> str:
    return bytes(handle.reserved).hex()


def handle_from_hex(text: str) -> _IpcHandle:
    raw = bytes.fromhex(text)
    if len(raw) != 64:
        raise CudaIpcError(f"IPC handle: expected 64 bytes, found {len(raw)}")
    return _IpcHandle.from_buffer_copy(raw)


@cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    # The _v2 entry point is what CUDA >= 11 headers bind cuIpcOpenMemHandle to.
    lib.open_ipc = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
    lib.open_ipc.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CudaIpcError(f"{call}: expected CUDA_SUCCESS, found CUresult {status}")


def node_id() -> str:
    """This machine's boot id: two agents share CUDA IPC only if theirs are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@cache
def _torch_on(device: int) -> Any:
    """torch, with ``device``'s primary context created (once; never on the hot path)."""
    import torch

    with torch.cuda.device(device):
        torch.cuda.synchronize(device)
    return torch


def _current(device: int) -> Any:
    """A context manager making ``device``'s primary context current for driver calls."""
    return _torch_on(device).cuda.device(device)


def export(spans: Sequence[tuple[int, int]]) -> list[list]:
    """IPC handles of the allocations under VRAM ``(device, addr)`` spans, once each.

    Returns ``[device, allocation base, allocation size, handle hex]`` rows;
    an allocation that cannot be exported is left out (its READs use NIXL).
    """
    out: dict[tuple[int, int], list] = {}
    for device, addr in spans:
        try:
            lib = _driver()
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            with _current(device):
                _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                   addr), "cuMemGetAddressRange")
                if (device, base.value) in out:
                    continue
                handle = _IpcHandle()
                _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value),
                       "cuIpcGetMemHandle")
        except (OSError, CudaIpcError) as exc:
            log.info("nixl.cuda_ipc_export_skipped", device=device, addr=addr, error=str(exc))
            continue
        out[(device, base.value)] = [device, base.value, size.value, handle_to_hex(handle)]
    return list(out.values())


@dataclass(slots=True)
class _Mapping:
    device: int
    remote_base: int
    size: int
    local_base: int


class PeerMemory:
    """A peer's exported VRAM allocations, mapped into this process."""

    def __init__(self, allocations: Sequence[Sequence]) -> None:
        self._maps: list[_Mapping] = []
        try:
            for device, base, size, handle_hex in allocations:
                handle = handle_from_hex(handle_hex)
                ptr = ctypes.c_uint64()
                with _current(int(device)):
                    _check(_driver().open_ipc(ctypes.byref(ptr), handle,
                                              _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
                self._maps.append(_Mapping(int(device), int(base), int(size), ptr.value))
        except BaseException:
            self.close()
            raise

    def translate(self, addr: int, nbytes: int) -> int | None:
        """This process's address of the peer's ``[addr, addr + nbytes)``, if mapped."""
        for m in self._maps:
            if m.remote_base <= addr and addr + nbytes <= m.remote_base + m.size:
                return m.local_base + (addr - m.remote_base)
        return None

    def close(self) -> None:
        for m in self._maps:
            try:
                with _current(m.device):
                    _check(_driver().cuIpcCloseMemHandle(m.local_base), "cuIpcCloseMemHandle")
            except (OSError, CudaIpcError) as exc:
                log.warning("nixl.cuda_ipc_close_failed", error=str(exc))
        self._maps.clear()


class _Memory:
    """Raw device memory as something ``torch.as_tensor`` accepts."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


@dataclass(frozen=True, slots=True)
class GatherPair:
    """Copy blocks of ``block_bytes`` from ``src`` (mapped peer memory) to ``dst`` (ours)."""

    src: int
    dst: int
    src_blocks: int
    dst_blocks: int
    block_bytes: int


class GatherRead:
    """One READ split in flight on the GPU; `done` polls its event."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())


class Gatherer:
    """Launches gathers on one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def gather(self, device: int, pairs: Sequence[GatherPair], remote_blocks: np.ndarray,
               local_blocks: np.ndarray) -> GatherRead:
        torch = _torch_on(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        dev = torch.device("cuda", device)
        ridx = torch.from_numpy(np.ascontiguousarray(remote_blocks, dtype=np.int64))
        lidx_np = np.ascontiguousarray(local_blocks, dtype=np.int64)
        contiguous = bool(len(lidx_np)) and bool((np.diff(lidx_np) == 1).all())
        with torch.cuda.stream(stream):
            ridx = ridx.to(dev, non_blocking=False)
            lidx = None if contiguous else torch.from_numpy(lidx_np).to(dev)
            for pair in pairs:
                word = _word(pair)
                src = _view(torch, dev, pair.src, pair.src_blocks, pair.block_bytes, word)
                dst = _view(torch, dev, pair.dst, pair.dst_blocks, pair.block_bytes, word)
                if contiguous:  # the common case: local blocks in order, no temporary
                    start = int(lidx_np[0])
                    torch.index_select(src, 0, ridx, out=dst[start:start + len(lidx_np)])
                else:
                    dst.index_copy_(0, lidx, src.index_select(0, ridx))
            event = torch.cuda.Event()
            event.record(stream)
        return GatherRead(event)


def _word(pair: GatherPair) -> Any:
    import torch

    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if pair.block_bytes % size == 0 and pair.src % size == 0 and pair.dst % size == 0:
            return dtype
    return torch.uint8


def _view(torch: Any, dev: Any, ptr: int, blocks: int, block_bytes: int, word: Any) -> Any:
    t = torch.as_tensor(_Memory(ptr, blocks * block_bytes), device=dev)
    return t.view(word).view(blocks, -1)

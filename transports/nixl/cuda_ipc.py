"""Same-node VRAM-to-VRAM READs as gather kernels over CUDA IPC.

Why: UCX's cuda_ipc transport turns every descriptor of a READ into its own
``cuMemcpyDtoDAsync`` plus event bookkeeping, ~8-10 µs of CPU each on an
H200 (measured: docs/nixl.md).  A shuffled 1 GiB READ in 8,192 descriptors
then runs at ~13 GB/s, in 65,536 at ~2 GB/s, against a ~2 TB/s device copy.
The descriptors' bytes are never the problem; their count is.  UCX itself
reaches the source through exactly the same mechanism (CUDA IPC: the
source's allocation mapped into the reader's address space), so when both
agents are on one node this module maps the source's allocations once per
peer and copies a whole READ split with ``index_select`` on a side stream,
usually one kernel for all its region pairs (`plan_jobs`): no per-descriptor
CPU work at all.

VRAM to *pinned host memory* (a HiSparse D's host pool) takes the same
route: UCX stages such READs through TCP (~0.4 GB/s on one H200), while the
gather kernel writes the host memory directly through its device pointer
(`host_device_pointer`) over PCIe; the kernel's completion makes the bytes
visible to the host before its event fires.  Strided regions (block ``b``
at ``addr + b * stride``) are views with that row pitch on either side:
only each block's bytes are read or written.

What stays with NIXL: metadata, notifications (including the completion
notification, sent after the kernel's event fired), unpinned host memory,
host sources, and peers on other nodes or whose allocations cannot be exported
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

from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)

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
    lib.host_ptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or \
        lib.cuMemHostGetDevicePointer
    lib.host_ptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
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


def host_device_pointer(addr: int, device: int) -> int:
    """The address ``device``'s kernels write pinned host memory at ``addr`` through.

    Raises `CudaIpcError` for host memory the CUDA driver has not pinned.
    """
    ptr = ctypes.c_uint64()
    with _current(device):
        _check(_driver().host_ptr(ctypes.byref(ptr), ctypes.c_void_p(addr), 0),
               "cuMemHostGetDevicePointer")
    return ptr.value


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
    """Copy blocks of ``block_bytes`` from ``src`` (mapped peer memory) to ``dst`` (ours).

    Block ``b`` sits at ``src + b * src_stride`` and ``dst + b * dst_stride``
    (0: ``block_bytes``, adjacent); only the blocks' own bytes are copied.
    ``dst`` is a device address: VRAM, or pinned host memory's device pointer.
    """

    src: int
    dst: int
    src_blocks: int
    dst_blocks: int
    block_bytes: int
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def src_pitch(self) -> int:
        return self.src_stride or self.block_bytes

    @property
    def dst_pitch(self) -> int:
        return self.dst_stride or self.block_bytes


class GatherRead:
    """One READ split in flight on the GPU; `done` polls its event."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())


@dataclass(frozen=True, slots=True)
class _Job:
    """One kernel: rows ``remote`` of the source view into rows ``local`` of the destination.

    A view's row ``i`` is ``block_bytes`` at ``ptr + i * pitch``.
    """

    src: int
    src_rows: int
    dst: int
    dst_rows: int
    block_bytes: int
    remote: np.ndarray
    local: np.ndarray
    src_pitch: int = 0
    dst_pitch: int = 0


def plan_jobs(pairs: Sequence[GatherPair], remote_blocks: np.ndarray,
              local_blocks: np.ndarray) -> list[_Job]:
    """As few kernels as the layout allows: usually one for every region pair.

    Region pairs with one block size and one stride per side whose regions
    sit at whole-row offsets from each other (per-layer views of one KV
    allocation, the usual layout) become rows of one view per side, so a READ
    over 56 regions is one ``index_select``, not 56.  Rows between the
    regions, and the bytes between a strided region's blocks, are never
    touched: only indexed rows' ``block_bytes`` are read or written.
    Otherwise: one kernel per pair.
    """
    bb = pairs[0].block_bytes
    sp, dp = pairs[0].src_pitch, pairs[0].dst_pitch
    sbase, dbase = min(p.src for p in pairs), min(p.dst for p in pairs)
    if all(p.block_bytes == bb and p.src_pitch == sp and p.dst_pitch == dp
           and (p.src - sbase) % sp == 0 and (p.dst - dbase) % dp == 0 for p in pairs):
        soff = [(p.src - sbase) // sp for p in pairs]
        doff = [(p.dst - dbase) // dp for p in pairs]
        return [_Job(sbase, max(o + p.src_blocks for o, p in zip(soff, pairs, strict=True)),
                     dbase, max(o + p.dst_blocks for o, p in zip(doff, pairs, strict=True)), bb,
                     np.concatenate([remote_blocks + o for o in soff]),
                     np.concatenate([local_blocks + o for o in doff]), sp, dp)]
    return [_Job(p.src, p.src_blocks, p.dst, p.dst_blocks, p.block_bytes, remote_blocks,
                 local_blocks, p.src_pitch, p.dst_pitch) for p in pairs]


# The most device memory a gather stages at once: a READ whose destination rows are not
# one contiguous run goes through a temporary (``index_select``, then ``index_copy_`` or
# a strided copy), in pieces of at most this many bytes, not the whole READ at once (a
# 2 GiB READ took 2 GiB more of D's GPU, and failed where that much was not free).
GATHER_STAGING_BYTES = 64 << 20


def copy_rows(torch: Any, src: Any, dst: Any, remote: np.ndarray, local: np.ndarray, dev: Any,
              chunk_rows: int) -> None:
    """``dst[local] = src[remote]`` for row views of one job (on any device), staging at
    most ``chunk_rows`` rows at a time; rows in order into a contiguous view go straight
    into place."""
    ridx = torch.from_numpy(np.ascontiguousarray(remote)).to(dev)
    n = len(local)
    if n and local[-1] - local[0] == n - 1 and (np.diff(local) == 1).all():
        # local rows in order (the common case): straight into place
        start = int(local[0])
        rows = dst[start:start + n]
        if rows.is_contiguous():
            torch.index_select(src, 0, ridx, out=rows)
            return
        for i in range(0, n, chunk_rows):  # strided rows: gather, then a strided copy
            rows[i:i + chunk_rows].copy_(src.index_select(0, ridx[i:i + chunk_rows]))
        return
    lidx = torch.from_numpy(np.ascontiguousarray(local)).to(dev)
    for i in range(0, n, chunk_rows):
        dst.index_copy_(0, lidx[i:i + chunk_rows], src.index_select(0, ridx[i:i + chunk_rows]))


class Gatherer:
    """Launches gathers on one side stream per device; caches tensor views of memory."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._views: dict[tuple, Any] = {}

    def gather(self, device: int, pairs: Sequence[GatherPair], remote_blocks: np.ndarray,
               local_blocks: np.ndarray) -> GatherRead:
        torch = _torch_on(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        dev = torch.device("cuda", device)
        with torch.cuda.stream(stream):
            for job in plan_jobs(pairs, np.asarray(remote_blocks, dtype=np.int64),
                                 np.asarray(local_blocks, dtype=np.int64)):
                word = _word(job)
                try:
                    src = self._view(torch, dev, job.src, job.src_rows, job.block_bytes,
                                     job.src_pitch, word)
                    dst = self._view(torch, dev, job.dst, job.dst_rows, job.block_bytes,
                                     job.dst_pitch, word)
                except Exception as exc:
                    # Nothing of this READ may still be copying when the caller hands it
                    # to NIXL instead: wait for the jobs already launched.
                    stream.synchronize()
                    raise CudaIpcError(f"memory at {job.src:#x} -> {job.dst:#x} cannot be "
                                       f"viewed on {dev}: {exc}") from None
                try:
                    copy_rows(torch, src, dst, job.remote, job.local, dev,
                              max(1, GATHER_STAGING_BYTES // job.block_bytes))
                except torch.cuda.OutOfMemoryError as exc:  # no room to stage: NIXL instead
                    stream.synchronize()
                    raise CudaIpcError(f"no device memory on {dev} to stage a gather of "
                                       f"{len(job.remote)} blocks: {exc}") from None
            event = torch.cuda.Event()
            event.record(stream)
        return GatherRead(event)

    def forget(self) -> None:
        """Drop cached views (after memory was unmapped)."""
        self._views.clear()

    def _view(self, torch: Any, dev: Any, ptr: int, rows: int, block_bytes: int, pitch: int,
              word: Any) -> Any:
        key = (dev.index, ptr, rows, block_bytes, pitch, word)
        t = self._views.get(key)
        if t is None:
            if len(self._views) > 1024:  # views own no memory; just keep the dict small
                self._views.clear()
            span = (rows - 1) * pitch + block_bytes
            flat = torch.as_tensor(_Memory(ptr, span), device=dev)
            if flat.data_ptr() != ptr:  # torch copied it (memory of another device?)
                raise CudaIpcError(f"view of {ptr:#x}: expected torch to wrap it in place on "
                                   f"{dev}, found a copy")
            size = word.itemsize
            t = flat.view(word).as_strided((rows, block_bytes // size), (pitch // size, 1))
            self._views[key] = t
        return t


def _word(job: _Job) -> Any:
    import torch

    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(x % size == 0 for x in (job.block_bytes, job.src, job.dst, job.src_pitch,
                                       job.dst_pitch)):
            return dtype
    return torch.uint8

"""`TransportProcess`: a `NixlTransport` in a child process, driven through a pipe.

P and D are different processes in production, and UCX takes a different
path within one process than between two (no ``cma``, no cuda_ipc without
``ENABLE_SAME_PROCESS``).  Tests and benchmarks therefore run the producer
in a child started with ``spawn`` (never ``fork`` a process that has loaded
UCX or CUDA) and talk to it through this proxy, which follows the
`Transport` protocol call for call.

Memory for the child's regions comes from one of two places:

* `shared_array`: host memory in a ``SharedMemory`` segment, visible to both
  processes, so a test can write P's source bytes directly; `register`
  translates such buffers into (segment, offset) for the child.
* `allocate`: memory the child allocates itself (any kind, VRAM included),
  filled with `pattern` so the reader can check every byte it got.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from kvhandoff.transports.base import (
    Completion,
    KVRegion,
    MemoryKind,
    Notification,
    ReadRequest,
    RegionMismatch,
    TransportError,
)

from .agent import NixlOptions


class ChildGone(TransportError):
    """The child process died or stopped answering."""


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """A region the child allocates itself: ``num_blocks`` x ``block_bytes`` of ``kind``.

    With a ``stride`` (bytes from block to block, larger than ``block_bytes``)
    the child allocates ``num_blocks`` whole rows of ``stride`` bytes and
    registers the region strided: the bytes between blocks are not its own.
    """

    name: str
    num_blocks: int
    block_bytes: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0
    seed: int = 0  # filled with `pattern(seed, ...)`
    stride: int = 0


@dataclass(frozen=True, slots=True)
class RegionView:
    """A region carved out of one payload allocation: ``num_blocks`` x ``block_bytes`` at ``offset``
    (block ``b`` at ``offset + b * stride`` with a ``stride``)."""

    name: str
    offset: int
    num_blocks: int
    block_bytes: int
    stride: int = 0

    @property
    def span(self) -> int:
        return (self.num_blocks - 1) * (self.stride or self.block_bytes) + self.block_bytes


def pattern(seed: int, nbytes: int, xp: Any = np, device: Any = None) -> Any:
    """Deterministic, position-dependent bytes: word ``i`` is ``i + 1 + seed << 40``.

    Every 8-byte word differs from every other, and none is zero, so a block
    that landed in the wrong place, or not at all, never passes a comparison.
    Works with numpy (``xp=np``) and torch (``xp=torch``, ``device='cuda:0'``).
    """
    words = nbytes // 8
    if xp is np:
        return (np.arange(1, words + 1, dtype=np.int64) + (seed << 40)).view(np.uint8)
    t = xp.arange(1, words + 1, dtype=xp.int64, device=device) + (seed << 40)
    return t.view(xp.uint8)


# --- the parent's side ----------------------------------------------------------


class TransportProcess:
    """A `Transport` whose agent lives in a spawned child process."""

    def __init__(self, name: str, options: NixlOptions | None = None, *,
                 env: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._proc = ctx.Process(target=_child_main, name=f"kvh-nixl-{name}", daemon=True,
                                 args=(child_conn, name, options or NixlOptions(), env or {}))
        self._proc.start()
        child_conn.close()
        self._call("ping")

    # -- memory ---------------------------------------------------------------

    def shared_array(self, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 array in shared memory that `register` can hand to the child."""
        nbytes = int(np.prod(shape))
        seg = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self._segments[seg.name] = seg
        return np.ndarray(shape, dtype=np.uint8, buffer=seg.buf)

    def allocate(self, specs: Sequence[RegionSpec], register: bool = True) -> None:
        """Have the child allocate (and fill, and by default register) ``specs``."""
        self._call("allocate", list(specs), register)

    def allocate_views(self, kind: MemoryKind, device: int, nbytes: int, seed: int,
                       views: Sequence[RegionView]) -> float:
        """One filled allocation in the child, registered as ``views``; returns register ms."""
        return self._call("allocate_views", kind, device, nbytes, seed, list(views))

    # -- the protocol -----------------------------------------------------------

    def register(self, regions: Sequence[KVRegion]) -> None:
        """Register ``regions`` in the child.

        A region whose buffer is a `RegionSpec` is allocated by the child (any
        memory kind); any other buffer must come from `shared_array`.
        """
        if all(isinstance(r.buffer, RegionSpec) for r in regions):
            self.allocate([r.buffer for r in regions])
            return
        self._call("register_shared", [self._shared_spec(r) for r in regions])

    def metadata(self) -> bytes:
        return self._call("metadata")

    def add_peer(self, metadata: bytes) -> str:
        return self._call("add_peer", metadata)

    def remove_peer(self, peer: str) -> None:
        self._call("remove_peer", peer)

    def post_read(self, peer: str, read: ReadRequest, notif: bytes | None = None) -> int:
        return self._call("post_read", peer, read, notif)

    def poll(self) -> list[Completion]:
        return self._call("poll")

    def send_notif(self, peer: str, message: bytes) -> None:
        self._call("send_notif", peer, message)

    def recv_notifs(self) -> list[Notification]:
        return self._call("recv_notifs")

    def lost_peers(self) -> list[str]:
        return self._call("lost_peers")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._call("close")
                self._call("exit")
            except ChildGone:
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._release_segments()

    # -- extras -------------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Any:
        """Run a child-side helper (see `_Child`) or a transport method by name."""
        return self._call(method, *args)

    def kill(self) -> None:
        """SIGKILL the child: no goodbye, as when a producer crashes."""
        self._proc.kill()
        self._proc.join(10)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _shared_spec(self, region: KVRegion) -> tuple:
        buf = region.buffer
        if not isinstance(buf, np.ndarray):
            raise RegionMismatch(f"region {region.name!r}: a child-process transport needs "
                                 "host buffers from shared_array() (or use allocate())")
        addr = buf.ctypes.data
        for name, seg in self._segments.items():
            base = np.frombuffer(seg.buf, dtype=np.uint8).ctypes.data
            if base <= addr and addr + buf.nbytes <= base + seg.size:
                return (region.name, name, addr - base, region.num_blocks, region.block_bytes,
                        region.stride)
        raise RegionMismatch(f"region {region.name!r}: buffer is not in this process's "
                             "shared_array() segments")

    def _call(self, method: str, *args: Any) -> Any:
        if not self._proc.is_alive():
            raise ChildGone(f"{self.name}: child process is gone "
                            f"(exit code {self._proc.exitcode})")
        try:
            self._conn.send((method, args))
            if not self._conn.poll(self.timeout_s):
                raise ChildGone(f"{self.name}: no answer to {method} in {self.timeout_s} s")
            status, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            raise ChildGone(f"{self.name}: child process is gone during {method}: "
                            f"{exc!r}") from None
        if status == "raise":
            raise value
        if status == "error":
            raise TransportError(f"{self.name}: {method} failed in the child:\n{value}")
        return value

    def _release_segments(self) -> None:
        for seg in self._segments.values():
            try:
                seg.close()
                seg.unlink()
            except (FileNotFoundError, BufferError):
                pass
        self._segments.clear()

    def __enter__(self) -> TransportProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the child's side -----------------------------------------------------------


class _Child:
    """What the child process runs: a `NixlTransport` and the memory behind it."""

    def __init__(self, name: str, options: NixlOptions) -> None:
        from .transport import NixlTransport

        self.transport = NixlTransport(name, options)
        self.buffers: dict[str, Any] = {}
        self.segments: list[shared_memory.SharedMemory] = []

    def ping(self) -> int:
        return os.getpid()

    def register_shared(self, specs: list[tuple]) -> None:
        regions = []
        for name, seg_name, offset, num_blocks, block_bytes, stride in specs:
            seg = shared_memory.SharedMemory(name=seg_name)
            self.segments.append(seg)
            span = (num_blocks - 1) * (stride or block_bytes) + block_bytes
            arr = np.ndarray((span,), dtype=np.uint8, buffer=seg.buf, offset=offset)
            self.buffers[name] = arr
            regions.append(KVRegion(name, arr, num_blocks, block_bytes, stride=stride))
        self.transport.register(regions)

    def allocate(self, specs: list[RegionSpec], register: bool) -> None:
        regions = []
        for s in specs:
            nbytes = s.num_blocks * (s.stride or s.block_bytes)
            if s.kind is MemoryKind.VRAM:
                import torch

                buf = pattern(s.seed, nbytes, torch, f"cuda:{s.device}").clone()
                torch.cuda.synchronize(s.device)
            else:
                buf = pattern(s.seed, nbytes).copy()
            self.buffers[s.name] = buf
            regions.append(KVRegion(s.name, buf, s.num_blocks, s.block_bytes, s.kind, s.device,
                                    s.stride))
        if register:
            self.transport.register(regions)

    def allocate_views(self, kind: MemoryKind, device: int, nbytes: int, seed: int,
                       views: list[RegionView]) -> float:
        if kind is MemoryKind.VRAM:
            import torch

            buf = pattern(seed, nbytes, torch, f"cuda:{device}").clone()
            torch.cuda.synchronize(device)
        else:
            buf = pattern(seed, nbytes).copy()
        # Each allocation stays alive (and registered) until close: keep every one.
        self.buffers["payload" if "payload" not in self.buffers else f"payload{len(self.buffers)}"] = buf
        regions = [KVRegion(v.name, buf[v.offset:v.offset + v.span], v.num_blocks,
                            v.block_bytes, kind, device, v.stride) for v in views]
        t0 = time.perf_counter()
        self.transport.register(regions)
        return (time.perf_counter() - t0) * 1e3

    def registrations(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """(memory kind, bytes, regions covered) of each NIXL registration made here."""
        return [(r.kind.value, r.nbytes, r.regions) for r in self.transport.registrations]

    def write(self, name: str, rows: np.ndarray) -> None:
        """Overwrite region ``name`` (allocated here, any kind) with host ``rows``."""
        buf = self.buffers[name]
        if isinstance(buf, np.ndarray):
            buf.reshape(-1)[:rows.size] = rows.reshape(-1)
        else:
            import torch

            buf.view(-1)[:rows.size].copy_(torch.from_numpy(np.ascontiguousarray(rows)).view(-1))
            torch.cuda.synchronize(buf.device)

    def idle_cpu_percent(self, seconds: float) -> float:
        """CPU this process (all its threads) used while doing nothing, % of one core."""
        t0, w0 = os.times(), time.monotonic()
        time.sleep(seconds)
        t1, w1 = os.times(), time.monotonic()
        return 100.0 * ((t1.user - t0.user) + (t1.system - t0.system)) / (w1 - w0)

    def die_after(self, seconds: float) -> None:
        """SIGKILL this process ``seconds`` from now (a crash in the middle of a READ)."""
        import signal
        import threading

        threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def recv_notifs_until(self, count: int, timeout_s: float) -> list[Notification]:
        """Wait (polling) until ``count`` notifications arrived or time is up."""
        out: list[Notification] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            out.extend(self.transport.recv_notifs())
            time.sleep(0.0002)
        return out

    def close(self) -> None:
        self.transport.close()
        self.buffers.clear()
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:
                pass


def _child_main(conn: Any, name: str, options: NixlOptions, env: dict[str, str]) -> None:
    # NIXL's Python logger writes to stdout; keep the parent's stdout for its own output.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.update(env)
    try:
        child = _Child(name, options)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            conn.send(("ok", None))
            return
        try:
            target = getattr(child, method, None) or getattr(child.transport, method)
            conn.send(("ok", target(*args)))
        except TransportError as exc:
            conn.send(("raise", exc))
        except BaseException:
            conn.send(("error", traceback.format_exc()))

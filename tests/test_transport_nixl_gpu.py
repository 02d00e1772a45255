"""The NIXL transport with GPU memory: two processes, VRAM and mixed VRAM/host destinations.

Runs only where CUDA is visible (the H200 device machine; see docs/nixl.md for
the recorded run).  P runs in a spawned child that allocates its VRAM
regions itself; D runs here.  Every byte is compared with the source.

``KVH_NIXL_GPU_TESTS_ON_CPU=1`` runs the same tests with host memory in place
of VRAM: a dry run of this file's plumbing on a machine without a GPU.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("nixl")
torch = pytest.importorskip("torch")
DRY_RUN = os.environ.get("KVH_NIXL_GPU_TESTS_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not (DRY_RUN or torch.cuda.is_available()),
                                reason="needs a CUDA GPU")

from kvhandoff.core.planning import coalesce  # noqa: E402
from kvhandoff.transports.base import KVRegion, MemoryKind, ReadRequest  # noqa: E402
from kvhandoff.transports.nixl import (  # noqa: E402
    NixlOptions,
    NixlTransport,
    ReadSplit,
    TransportProcess,
    runs_array,
)
from kvhandoff.transports.nixl.process import RegionSpec, pattern  # noqa: E402
from tests.transport_contract import RegionShape, TransportContract, TransportPair  # noqa: E402

DRAM = MemoryKind.DRAM
VRAM = DRAM if DRY_RUN else MemoryKind.VRAM
GPU = "cpu" if DRY_RUN else "cuda:0"


def sync() -> None:
    if not DRY_RUN:
        torch.cuda.synchronize()


def _tag() -> str:
    return str(time.monotonic_ns() % 10**9)


def vram_pair(p_shapes: list[RegionShape], d_shapes: list[RegionShape]) -> TransportPair:
    """P's regions in VRAM (its child allocates them); D's in VRAM unless ``host``."""
    tag = _tag()
    p = TransportProcess(f"P-gpu-{tag}")
    d = NixlTransport(f"D-gpu-{tag}")
    names = [s.name for s in p_shapes]
    p_regions = [KVRegion(s.name, RegionSpec(s.name, s.num_blocks, s.block_bytes, VRAM, 0, seed=i),
                          s.num_blocks, s.block_bytes, VRAM, 0) for i, s in enumerate(p_shapes)]
    d_bufs = [torch.zeros((s.num_blocks, s.block_bytes), dtype=torch.uint8,
                          device="cpu" if s.host else GPU) for s in d_shapes]
    d_regions = [KVRegion(s.name, b, s.num_blocks, s.block_bytes, DRAM if s.host else VRAM, 0)
                 for s, b in zip(d_shapes, d_bufs, strict=True)]

    def write_d(i: int, rows: np.ndarray) -> None:
        d_bufs[i].copy_(torch.from_numpy(rows))
        sync()

    def read_d(i: int) -> np.ndarray:
        sync()
        return d_bufs[i].cpu().numpy()

    def pump() -> None:
        d.progress()
        time.sleep(0.0005)

    def close() -> None:
        try:
            d.close()
        finally:
            p.close()

    return TransportPair(p=p, d=d, p_regions=p_regions, d_regions=d_regions,
                         write_p=lambda i, rows: p.call("write", names[i], rows),
                         write_d=write_d, read_d=read_d, pump=pump, kill_p=p.kill, close=close)


class TestNixlVramContract(TransportContract):
    def make_shaped_pair(self, p_shapes, d_shapes):
        return vram_pair(p_shapes, d_shapes)

    # As on host memory (see test_transport_nixl.py): a READ posted just before the
    # producer dies may have landed already; it must then be complete and correct.
    def test_a_peer_that_dies_mid_read_fails_the_read_and_is_reported_lost(self, pair):
        from tests.test_transport_nixl import TestNixlHostContract

        TestNixlHostContract.test_a_peer_that_dies_mid_read_fails_the_read_and_is_reported_lost(
            self, pair)


def _wait_one(d: NixlTransport, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = d.poll()
        if got:
            return got
    raise AssertionError("no completion")


def test_a_read_into_a_gpu_tail_and_a_host_pool_is_one_completion_with_every_byte():
    """The HiSparse case: history lands in host memory, the recent tail on the GPU."""
    tag = _tag()
    nb, bb, layers = 512, 32 * 1024, 4
    with TransportProcess(f"P-mixed-{tag}") as p:
        p.allocate([RegionSpec(f"layer{i}", nb, bb, VRAM, 0, seed=100 + i) for i in range(layers)])
        d = NixlTransport(f"D-mixed-{tag}", NixlOptions(telemetry=True))
        try:
            tail = [torch.zeros((16, bb), dtype=torch.uint8, device=GPU) for _ in range(layers)]
            pool = [np.zeros((nb, bb), np.uint8) for _ in range(layers)]
            d.register([KVRegion(f"layer{i}@tail", tail[i], 16, bb, VRAM, 0) for i in range(layers)]
                       + [KVRegion(f"layer{i}@pool", pool[i], nb, bb, DRAM, 0)
                          for i in range(layers)])
            peer = d.add_peer(p.metadata())
            d_name = p.add_peer(d.metadata())
            rng = np.random.default_rng(11)
            history = rng.permutation(nb - 16)[:300]
            pool_slots = rng.permutation(nb)[:300]
            recent = np.arange(nb - 16, nb)
            h = d.post_split_read(peer, [
                ReadSplit(runs_array(history, pool_slots),
                          tuple((f"layer{i}", f"layer{i}@pool") for i in range(layers))),
                ReadSplit(runs_array(recent, np.arange(16)),
                          tuple((f"layer{i}", f"layer{i}@tail") for i in range(layers))),
            ], b"release:mixed")
            (c,) = _wait_one(d)
            assert (c.handle, c.ok) == (h, True), c.reason
            sync()
            for i in range(layers):
                src = pattern(100 + i, nb * bb).reshape(nb, bb)
                assert np.array_equal(pool[i][pool_slots], src[history])
                untouched = np.setdiff1d(np.arange(nb), pool_slots)
                assert not pool[i][untouched].any()
                assert np.array_equal(tail[i].cpu().numpy(), src[recent])
            got = p.call("recv_notifs_until", 1, 10.0)
            assert [(n.peer, n.message) for n in got] == [(d_name, b"release:mixed")]
            # The host pool went through NIXL, merged as planned; the GPU tail (VRAM to
            # VRAM on one node) as a CUDA IPC gather.
            assert d.descriptors_on_wire == d.descriptors_posted - d.ipc_descriptors
            assert d.ipc_descriptors == (0 if DRY_RUN else layers)
            assert d.poll() == []
        finally:
            d.close()


@pytest.mark.parametrize("vram_ipc", [True, False], ids=["cuda-ipc", "nixl-only"])
def test_a_large_shuffled_vram_read_lands_every_byte(vram_ipc):
    tag = _tag()
    nb, bb = 8192, 16 * 1024  # 128 MiB
    with TransportProcess(f"P-big-{tag}") as p:
        p.allocate([RegionSpec("kv", nb, bb, VRAM, 0, seed=5)])
        d = NixlTransport(f"D-big-{tag}", NixlOptions(vram_ipc=vram_ipc))
        try:
            dst = torch.zeros((nb, bb), dtype=torch.uint8, device=GPU)
            d.register([KVRegion("kv", dst, nb, bb, VRAM, 0)])
            peer = d.add_peer(p.metadata())
            order = np.random.default_rng(2).permutation(nb)
            d.post_read(peer, ReadRequest(coalesce(order.tolist(), list(range(nb)))))
            (c,) = _wait_one(d)
            assert c.ok, c.reason
            src = pattern(5, nb * bb, torch, GPU).view(nb, bb)
            assert torch.equal(dst, src[torch.as_tensor(order, device=GPU)])
            assert d.ipc_descriptors == (nb if vram_ipc and not DRY_RUN else 0)
        finally:
            d.close()

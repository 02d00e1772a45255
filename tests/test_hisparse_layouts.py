"""HiSparse on D (issue #16): D's vLLM-planned groups as kvhandoff layouts, paired with P's.

Every ``KVCacheConfig`` here is vLLM 0.32's own (`qwen4_layouts.plan_hisparse`: the
engine core's ``resolve_kv_cache_layout`` + ``get_kv_cache_configs``, the worker's
``resolve_hisparse_specs`` with HiSparse on), and the expectations are read off it and off
the tensors vLLM's HiSparse allocator (``v1/hisparse/binding.py:
allocate_hisparse_kv_caches``) builds from it: which groups vLLM transfers, which pool
each is in, where each layer's blocks are.  D runs HiSparse (host source group + device
indexer group, resident / hot groups never transferred); P runs it off (one vLLM group of
sparse and indexer layers).  The handshake pairs the two; D's host pool is D's own.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import qwen4_layouts as q  # noqa: E402

from kvhandoff.adapters.vllm.config import UnsupportedTopology  # noqa: E402
from kvhandoff.adapters.vllm.layout import cache_layout  # noqa: E402
from kvhandoff.adapters.vllm.side_channel import PeerIncompatible, check_compatible  # noqa: E402
from kvhandoff.core.groups import CacheKind, CacheLayout, GroupMismatch, Memory  # noqa: E402

VARIANTS = q.HS_VARIANTS


@pytest.fixture(scope="module")
def planned():
    return {(v, hs): q.plan_hisparse(v, hs) for v in VARIANTS for hs in (False, True)}


def _compat(layout: CacheLayout) -> dict:
    return {"model": "dsa", "tp_size": 1, "cache_layout": layout.to_wire()}


def _vllm_views(kvc) -> tuple[dict, dict, int]:
    """vLLM's own HiSparse allocation of ``kvc`` on CPU (`qwen4_layouts.allocate_hisparse`):
    ``(layer -> view, layer -> base, host pool base)``, base the start of the view's backing
    allocation (device buffer or host pool)."""
    views, _, pool = q.allocate_hisparse(kvc)
    return (views, {k: t.untyped_storage().data_ptr() for k, t in views.items()},
            pool.untyped_storage().data_ptr())


def _row(view) -> int:
    """Bytes from block b to b+1 of a vLLM view (dim 0 is the block in every layout)."""
    return view.stride(0) * view.element_size()


def test_vllm_refuses_hisparse_for_the_qwen4_exp_owners():
    """Qwen4-exp's QSA owners declare no INDEXER-role MLA: vLLM's planner refuses HiSparse
    for them; and a VllmConfig naming HiSparseConnector is refused off CUDA."""
    from vllm.config import HiSparseConfig, KVTransferConfig, VllmConfig
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    v = q.Variant(0, False, 1)
    cfg = q.vllm_config(v)
    kvt = KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"host_pool_gib": q.HOST_POOL_GIB})
    with pytest.raises(ValueError, match="HiSparse currently requires NVIDIA CUDA"):
        VllmConfig(model_config=cfg.model_config, cache_config=cfg.cache_config,
                   kv_transfer_config=kvt)
    cfg.attention_config.hisparse_config = HiSparseConfig()
    cfg.kv_transfer_config = kvt
    specs = q.kv_cache_specs(cfg, v)
    names = [layout.name for layout in get_supported_kv_cache_layouts(q.backends())]
    resolve_kv_cache_layout(cfg, [names], list(specs.values()))
    with pytest.raises(ValueError, match="HiSparse requires sparse-MLA and indexer cache specs"):
        get_kv_cache_configs(cfg, [specs], [1 << 40])


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_d_s_groups_carry_their_pool_and_only_transfer_groups_are_read(planned, v):
    _, configs, sched = planned[v, True]
    for kvc in (*configs, sched):
        assert kvc.kv_cache_layout == "BLHNC"  # HiSparseConnector's requirement
        roles = [g.role.value for g in kvc.transfer_groups]
        assert roles == ["hisparse_source", "hisparse_indexer"]
        skipped = [g for g in kvc.kv_cache_groups if not g.enable_kv_transfer]
        assert {type(g.kv_cache_spec).__name__ for g in skipped} == {"HiSparseResidentSpec",
                                                                     "HiSparseHotSpec"}
        layout = cache_layout(kvc, host_pools=True)
        assert [list(g.layers) for g in layout.groups] == [g.layer_names
                                                           for g in kvc.transfer_groups]
        read = {x for g in layout.groups for x in g.layers}
        assert not read & {x for g in skipped for x in g.layer_names}
        source, indexer = layout.groups
        assert source.kind is CacheKind.FULL_ATTENTION and indexer.kind is CacheKind.INDEXER
        assert {r.memory for r in source.regions} == {Memory.HOST}
        assert {r.memory for r in indexer.regions} == {Memory.DEVICE}
        assert source.num_blocks == kvc.hisparse_host_num_blocks != kvc.num_blocks
        assert indexer.num_blocks == kvc.num_blocks
        assert layout.host_block_stride == kvc.hisparse_host_block_stride
        assert layout.shared_host_pool is kvc.hisparse_shared_host_pool is (v.tp > 1)
        assert layout.source_groups == (0, 1)
        assert all(g.block_size == q.DSA_BLOCK for g in layout.groups)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_d_s_regions_are_where_vllm_s_hisparse_allocator_puts_each_layer(planned, v):
    """Per rank: each region's offset in its allocation, block stride and page, against the
    views vLLM's ``allocate_hisparse_kv_caches`` builds (host pool and device buffer)."""
    _, configs, _ = planned[v, True]
    for kvc in configs:
        views, bases, host = _vllm_views(kvc)
        layout = cache_layout(kvc, host_pools=True)
        pages = {x: s.page_size_bytes for g in kvc.transfer_groups
                 for x, s in g.kv_cache_spec.kv_cache_specs.items()}
        for g in layout.groups:
            for layer, r in zip(g.layers, g.regions, strict=True):
                t = views[layer]
                assert (bases[layer] == host) is (r.memory is Memory.HOST)
                assert t.data_ptr() - bases[layer] == r.offset
                assert _row(t) == r.block_stride
                assert r.block_bytes == pages[layer] <= r.block_stride
                assert t.shape[0] >= g.num_blocks  # the pool's blocks are addressable
        # The device rows are shared with the resident / hot groups (not transferred):
        # the indexer's pages are the row's first bytes, the rest is theirs.
        _, indexer = layout.groups
        row = indexer.regions[0].block_stride
        assert sum(r.block_bytes for r in indexer.regions) <= row
        resident = kvc.kv_cache_groups[2].layer_names[0]  # no layer view: vLLM's tensor
        (t,) = [t for t in kvc.kv_cache_tensors if resident in t.layers]
        assert row == t.block_stride and t.offset == 0  # the same rows, from byte 0


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_p_with_hisparse_off_has_the_same_transfer_groups_on_the_device(planned, v):
    """vLLM plans P's sparse and indexer layers in one group; the layout makes it the two
    groups D's planner makes, both cut from that group's one block list."""
    _, p_configs, p_sched = planned[v, False]
    _, d_configs, d_sched = planned[v, True]
    d_groups = [g.layer_names for g in d_sched.transfer_groups]
    for kvc in (*p_configs, p_sched):
        assert len(kvc.kv_cache_groups) == 1 and kvc.hisparse_host_num_blocks is None
        assert sorted(kvc.kv_cache_groups[0].layer_names) == sorted(sum(d_groups, []))
        p = cache_layout(kvc)
        assert [list(g.layers) for g in p.groups] == d_groups
        assert {r.memory for g in p.groups for r in g.regions} == {Memory.DEVICE}
        assert p.source_groups == (0, 0) and p.num_source_groups == 1
        assert p.select([[5, 6, 7]]) == ([5, 6, 7], [5, 6, 7])
    for p_kvc, d_kvc in zip((*p_configs, p_sched), (*d_configs, d_sched), strict=True):
        d, p = cache_layout(d_kvc, host_pools=True), cache_layout(p_kvc)
        d.check_matches(p)
        check_compatible(_compat(d), _compat(CacheLayout.from_wire(p.to_wire())), "P")
        # Over the wire D's host pool is not said: memory and stride are D's knowledge.
        back = CacheLayout.from_wire(d.to_wire())
        assert {r.memory for g in back.groups for r in g.regions} == {Memory.DEVICE}
        assert back == d  # compared fields only


def test_d_cuts_vllm_s_block_lists_to_its_transfer_groups(planned):
    _, configs, sched = planned[q.HS_VARIANTS[0], True]
    d = cache_layout(sched, host_pools=True)
    lists = [[10 * i, 10 * i + 1] for i in range(len(sched.kv_cache_groups))]
    assert d.select(lists) == tuple(sched.select_transfer_block_ids(lists))
    assert d.select(lists[:2]) == tuple(lists[:2])  # already vLLM's transfer groups


def test_d_s_host_pool_geometry_is_its_own_business(planned, monkeypatch):
    """A D with another host pool (size, hence block count) pairs with the same P."""
    v = q.HS_VARIANTS[0]
    monkeypatch.setattr(q, "HOST_POOL_GIB", 4 * q.HOST_POOL_GIB)
    _, _, bigger = q.plan_hisparse(v, True)
    _, _, d_sched = planned[v, True]
    assert bigger.hisparse_host_num_blocks == 4 * d_sched.hisparse_host_num_blocks
    p = cache_layout(planned[v, False][2])
    cache_layout(bigger, host_pools=True).check_matches(p)


@pytest.mark.parametrize(("edit", "named"), [
    ("index_head", "cache group 1: regions"),
    ("block_size", "cache group 0: block_size"),
    ("one_group", "cache layout: number of groups"),
])
def test_a_p_that_does_not_pair_is_refused_naming_the_field(planned, monkeypatch, edit, named):
    """P's geometry is checked: another indexer page, another block size, or a P that
    does not split the sparse and indexer layers (an older kvhandoff) is refused, typed."""
    v = q.HS_VARIANTS[0]
    d = cache_layout(planned[v, True][2], host_pools=True)
    if edit == "index_head":
        monkeypatch.setattr(q, "DSA_INDEX_HEAD", 2 * q.DSA_INDEX_HEAD)
        p = cache_layout(q.plan_hisparse(v, False)[2])
    else:
        p = cache_layout(planned[v, False][2])
        if edit == "block_size":
            p = dataclasses.replace(p, groups=tuple(dataclasses.replace(g, block_size=32)
                                                    for g in p.groups))
        else:
            merged = dataclasses.replace(p.groups[0], regions=p.groups[0].regions
                                         + p.groups[1].regions)
            p = dataclasses.replace(p, groups=(merged,))
    with pytest.raises(GroupMismatch, match=re.escape(named)):
        d.check_matches(p)
    with pytest.raises(PeerIncompatible, match=re.escape(f"peer P: {named}")):
        check_compatible(_compat(d), _compat(CacheLayout.from_wire(p.to_wire())), "P")


def test_a_layout_without_host_pools_refuses_one_naming_the_group(planned):
    """Without ``host_pools`` (P's start-up: P is read from the device) a HiSparse config
    is refused naming the group and the field."""
    _, configs, sched = planned[q.HS_VARIANTS[0], True]
    for kvc in (*configs, sched):
        with pytest.raises(UnsupportedTopology, match=r"KV cache group 0: host_resident=True "
                           r"is not supported on P"):
            cache_layout(kvc)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_d_registers_each_layer_s_blocks_where_vllm_s_views_are(planned, v):
    """`kv_regions` on vLLM's own HiSparse allocation: the host pool's regions are DRAM
    views of the pool, the device regions views of the device buffer, and block *b* of
    every region is the first ``block_bytes`` of row *b* of vLLM's view of that layer
    (checked by writing through one and reading through the other).  A rank that leaves
    the shared pool to rank 0 registers its device regions only."""
    from kvhandoff.transports.base import MemoryKind
    from kvhandoff.transports.caches import kv_regions

    _, configs, _ = planned[v, True]
    for rank, kvc in enumerate(configs):
        views, _, host = _vllm_views(kvc)
        layout = cache_layout(kvc, host_pools=True)
        regions = {r.name: r for r in kv_regions(views, layout)}
        for g in layout.groups:
            for layer, r in zip(g.layers, g.regions, strict=True):
                kv = regions[r.name]
                assert kv.kind is MemoryKind.DRAM and kv.num_blocks == g.num_blocks
                assert kv.block_stride == _row(views[layer])
                assert (kv.buffer.untyped_storage().data_ptr() == host) is (g.index == 0)
                row = views[layer].view(views[layer].shape[0], -1).view(torch.uint8)
                for b in (0, 1, g.num_blocks - 1):
                    at = b * kv.block_stride
                    kv.buffer[at:at + kv.block_bytes] = torch.arange(
                        kv.block_bytes, dtype=torch.int64).add(b + 7).to(torch.uint8)
                    assert torch.equal(row[b, :kv.block_bytes], kv.buffer[at:at + kv.block_bytes])
        shared = kv_regions(views, layout, host_pool=rank == 0 or not layout.shared_host_pool)
        expect = {r.name for g in layout.groups for r in g.regions
                  if g.index == 1 or rank == 0 or not layout.shared_host_pool}
        assert {r.name for r in shared} == expect


def test_the_worker_pair_s_fixture_is_what_vllm_plans_now(planned):
    """`test_hisparse_worker_pair.py` runs from `tests/hisparse_plans.json` (no vLLM on the
    GPU machine): it must be exactly what vLLM 0.32 plans here, and the layouts it rebuilds
    must equal `cache_layout`'s, the fields never on the wire included (each region's pool,
    offset and stride, the host pool's geometry, vLLM's group indices)."""
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).parent / q.HS_FIXTURE).read_text())
    assert json.loads(json.dumps(q.export_hisparse_plans(), sort_keys=True)) == saved
    assert [tuple(x["variant"]) for x in saved.values()] == [
        (v.mtp, v.prefix_caching, v.tp) for v in q.HS_BYTES_VARIANTS]
    for v in q.HS_BYTES_VARIANTS:
        _, p_configs, _ = planned.get((v, False)) or q.plan_hisparse(v, False)
        _, d_configs, _ = planned.get((v, True)) or q.plan_hisparse(v, True)
        for rank in range(v.tp):
            (p, _), (d, d_alloc) = q.load_hisparse_plan(saved, v, rank)
            for got, want in ((p, cache_layout(p_configs[rank])),
                              (d, cache_layout(d_configs[rank], host_pools=True))):
                assert dataclasses.astuple(got) == dataclasses.astuple(want)  # every field
                assert (got.source_groups, got.num_source_groups, got.host_block_stride,
                        got.shared_host_pool) == (want.source_groups, want.num_source_groups,
                                                  want.host_block_stride, want.shared_host_pool)
            assert {r.memory for r in d.groups[0].regions} == {Memory.HOST}
            # The rebuilt views sit where vLLM's allocator puts them, in the same pool.
            views, device, host = d_alloc("cpu")
            vllm_views, bases, vllm_host = _vllm_views(d_configs[rank])
            assert set(views) == {x for g in d.groups for x in g.layers}
            for layer, t in views.items():
                want = vllm_views[layer]
                pool = host if bases[layer] == vllm_host else device
                assert t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
                assert (t.data_ptr() - pool.data_ptr(), t.shape, t.stride(), t.dtype) == (
                    want.data_ptr() - bases[layer], want.shape, want.stride(), want.dtype)

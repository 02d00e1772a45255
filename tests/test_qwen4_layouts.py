"""The seed's model family (Qwen4-exp) through the connector, on configs vLLM 0.32 plans.

Every config here comes from vLLM's own ``resolve_kv_cache_layout`` and
``get_kv_cache_configs`` over the cache owners' specs (`qwen4_layouts`), with
and without MTP, prefix caching on and off, TP 1 and 2; tensors come from
vLLM's ``allocate_kv_cache``.  The rules checked are vLLM's: the groups, block
sizes, rows and flags vLLM planned, and NixlConnector's clipping
(``clip_ssm_state_blocks``) for which slot a state group hands over.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import qwen4_layouts as q  # noqa: E402
from test_qwen4_worker_pair import _ids  # noqa: E402

from kvhandoff.adapters.vllm.config import UnsupportedTopology  # noqa: E402
from kvhandoff.adapters.vllm.layout import cache_layout  # noqa: E402
from kvhandoff.adapters.vllm.side_channel import PeerIncompatible, check_compatible  # noqa: E402
from kvhandoff.core.groups import CacheKind, CacheLayout  # noqa: E402
from kvhandoff.core.planning import export_ids, plan_group_reads, tokens_loaded  # noqa: E402

DEVICE = os.environ.get("KVH_WORKER_DEVICE", "cpu")


@pytest.fixture(scope="module")
def planned():
    return {v: q.plan(v) for v in q.VARIANTS}


def _kinds(kv_cache_config) -> list[str]:
    """vLLM's representative spec class of each group, as its connectors read it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_representative_spec_type

    return [get_representative_spec_type(g.kv_cache_spec).__name__
            for g in kv_cache_config.kv_cache_groups]


# vLLM groups the compressed keys (MLA, tokens_per_state = ratio) with the main KV: one
# block table ("follows the main KV"), the compressed keys its representative spec.
EXPECTED_KIND = {"FullAttentionSpec": CacheKind.FULL_ATTENTION,
                 "MLAAttentionSpec": CacheKind.COMPRESSED_KEY,
                 "CircularBufferSpec": CacheKind.KEY_RING}


@pytest.mark.parametrize("v", q.VARIANTS, ids=lambda v: v.name)
def test_vllm_s_planned_config_is_accepted_group_by_group(planned, v):
    cfg, configs, sched = planned[v]
    assert configs[0].kv_cache_layout in ("BLNHC", "BLHNC")  # mixed pages: vLLM packs rows
    for kvc in (*configs, sched):
        layout = cache_layout(kvc)
        assert len(layout.groups) == len(kvc.transfer_groups)
        for g, vg, rep in zip(layout.groups, kvc.transfer_groups, _kinds(kvc), strict=True):
            specs = list(getattr(vg.kv_cache_spec, "kv_cache_specs", {"": vg.kv_cache_spec}).values())
            first = specs[0]
            assert g.block_size == vg.kv_cache_spec.block_size
            assert g.draft is vg.is_eagle_group
            if rep == "MambaSpec":
                assert g.kind is (CacheKind.LAYER_EMBEDDING if first.tp_replicated
                                  else CacheKind.LINEAR_STATE)
                assert g.tp_replicated is first.tp_replicated
                assert g.spec_slots == first.num_speculative_blocks == v.mtp
            else:
                assert g.kind is EXPECTED_KIND[rep]
            if rep == "CircularBufferSpec":  # ring capacity: ratio * cdiv(ratio + spec, ratio)
                assert g.block_size == q.COMPRESS_RATIO * -(-(q.COMPRESS_RATIO + v.mtp)
                                                              // q.COMPRESS_RATIO)
            if rep == "MLAAttentionSpec":
                assert g.tokens_per_state == q.COMPRESS_RATIO
            # Block-outermost rows: a group's block is its row of the allocation.
            (row,) = {t.block_stride for t in kvc.kv_cache_tensors}
            assert [r.block_bytes for r in g.regions] == [row]
        assert layout.speculative_tokens == v.mtp
        # The drafter's layers are in a group vLLM flags as the eagle group.
        assert any(g.draft for g in layout.groups) == bool(v.mtp)
    # TP ranks plan alike; a rank's layout pairs with the scheduler's.
    for kvc in configs:
        cache_layout(kvc).check_matches(cache_layout(sched))


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_seed_configuration_starts_on_both_sides(role):
    """MTP on, prefix caching on, TP 2: the connector's start-up (scheduler role) accepts it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.adapters.vllm.connector import KVHandoffConnector

    cfg, configs, sched = q.plan(q.SEED, role=role, engine_id=f"q4-{role}")
    conn = KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, sched)
    assert [g.kind for g in conn.layout.groups].count(CacheKind.LINEAR_STATE) >= 1
    assert conn.scheduler.backoff == 1  # state groups: P leaves the last token to D


def test_mamba2_s_checkpoint_slot_without_align_is_served():
    """vLLM's Mamba2 mixer declares a checkpoint slot in every mode; only 'align' uses it."""
    import torch as t
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec

    s = MambaSpec(shapes=((4, 4),), dtypes=(t.float16,), block_size=16,
                  num_prefill_checkpoint_blocks=1, mamba_cache_mode="none")
    kvc = KVCacheConfig(4, [KVCacheTensor(4 * s.page_size_bytes, ["a"], s.page_size_bytes * 4,
                                          s.page_size_bytes)],
                        [KVCacheGroupSpec(["a"], s)])
    assert [g.kind for g in cache_layout(kvc).groups] == [CacheKind.MAMBA_STATE]


@pytest.mark.parametrize(("spec", "named"), [
    (lambda s: dataclasses.replace(s, extra_retained_tokens=3), "extra_retained_tokens=3"),
    (lambda s: dataclasses.replace(s, num_prefill_checkpoint_blocks=1, mamba_cache_mode="align"),
     "num_prefill_checkpoint_blocks=1"),
])
def test_what_stays_unsupported_is_refused_naming_spec_and_field(spec, named):
    """vLLM specs with a field kvhandoff does not serve: refused at start-up, the field named."""
    import torch as t
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
    )

    base = (SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=t.float16,
                              sliding_window=32) if "retained" in named else
            MambaSpec(shapes=((4, 4),), dtypes=(t.float16,), block_size=16))
    s = spec(base)
    kvc = KVCacheConfig(4, [KVCacheTensor(4 * s.page_size_bytes, ["a"], s.page_size_bytes * 4,
                                          s.page_size_bytes)],
                        [KVCacheGroupSpec(["a"], s)])
    with pytest.raises(UnsupportedTopology, match=f"{type(s).__name__}.{named}"):
        cache_layout(kvc)
    host = KVCacheConfig(4, kvc.kv_cache_tensors, [KVCacheGroupSpec(["a"], FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=t.float16), host_resident=True)])
    with pytest.raises(UnsupportedTopology, match="host_resident=True"):
        cache_layout(host)


@pytest.mark.parametrize(("name", "kind"), [
    ("RSWASpec", CacheKind.FULL_ATTENTION), ("HiddenStateCacheSpec", CacheKind.FULL_ATTENTION),
    ("SlidingWindowMLASpec", CacheKind.SLIDING_WINDOW), ("ChunkedLocalAttentionSpec", None),
    ("SinkFullAttentionSpec", None), ("CrossAttentionSpec", None),
    ("EncoderOnlyAttentionSpec", None),
])
def test_the_other_vllm_spec_kinds_map_or_are_refused_by_name(name, kind):
    import torch as t
    from vllm.v1 import kv_cache_interface as k
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    extra = {"RSWASpec": {"rswa_window": 64}, "SlidingWindowMLASpec": {"sliding_window": 64},
             "ChunkedLocalAttentionSpec": {"attention_chunk_size": 64}}.get(name, {})
    s = getattr(k, name)(block_size=16, num_kv_heads=1, head_size=8, dtype=t.float16, **extra)
    kvc = KVCacheConfig(4, [KVCacheTensor(4 * s.page_size_bytes, ["a"], s.page_size_bytes * 4,
                                          s.page_size_bytes)], [KVCacheGroupSpec(["a"], s)])
    if kind is None:
        with pytest.raises(UnsupportedTopology, match=f"{name} is not supported"):
            cache_layout(kvc)
    else:
        assert cache_layout(kvc).groups[0].kind is kind


def _compat(layout: CacheLayout) -> dict:
    return {"model": "q4", "tp_size": 2, "cache_layout": layout.to_wire()}


@pytest.mark.parametrize(("change", "named"), [
    (dict(speculative_tokens=0), "speculative_tokens (num_speculative_tokens)"),
    ("ring", "block_size (ring capacity)"),
    ("ratio", "tokens_per_state (compress ratio"),
    ("replicated", "tp_replicated"),
    ("draft", "draft"),
    ("slots", "spec_slots"),
])
def test_a_peer_that_disagrees_on_the_draft_or_an_owner_is_refused_naming_group_and_field(
        change, named):
    _, _, sched = q.plan(q.SEED)
    mine = cache_layout(sched)
    kinds = [g.kind for g in mine.groups]
    edits = {
        "ring": (kinds.index(CacheKind.KEY_RING), dict(block_size=12)),
        "ratio": (kinds.index(CacheKind.COMPRESSED_KEY), dict(tokens_per_state=8)),
        "replicated": (kinds.index(CacheKind.LAYER_EMBEDDING), dict(tp_replicated=False)),
        "draft": (kinds.index(CacheKind.COMPRESSED_KEY), dict(draft=False)),
        "slots": (kinds.index(CacheKind.LINEAR_STATE), dict(spec_slots=1)),
    }
    if isinstance(change, dict):
        peer, where = dataclasses.replace(mine, **change), "peer P: cache layout: "
    else:
        i, fields = edits[change]
        groups = list(mine.groups)
        groups[i] = dataclasses.replace(groups[i], **fields)
        peer, where = dataclasses.replace(mine, groups=tuple(groups)), f"peer P: cache group {i}: "
    # Through the wire, as the hello carries it.
    with pytest.raises(PeerIncompatible, match=re.escape(f"{where}{named}")):
        check_compatible(_compat(mine), _compat(CacheLayout.from_wire(peer.to_wire())), "P")
    check_compatible(_compat(mine), _compat(CacheLayout.from_wire(mine.to_wire())), "P")


def test_the_worker_pair_s_fixture_is_what_vllm_plans_now():
    """`test_qwen4_worker_pair.py` runs from `tests/qwen4_plans.json` (no vLLM on the GPU
    machine); it must be exactly what vLLM 0.32 plans here."""
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).parent / q.FIXTURE).read_text())
    assert json.loads(json.dumps(q.export_plans(), sort_keys=True)) == saved


# ---- the differential oracle: NixlConnector 0.32's own descriptors --------------------------


def _nixl_worker(monkeypatch, v: q.Variant, cfg, kvc, views):
    """vLLM 0.32's ``NixlBaseConnectorWorker`` built on CPU tensors and its own
    ``register_kv_caches``; only what needs a live NIXL agent, a TP group or a model is
    stood in: the agent (descriptors are kept, not registered), the TP rank, the
    attention backends (FlashAttention, the QSA main owner's base), the compatibility
    hash, the core pinning; kernel blocks are taken equal to vLLM's blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    class Agent:
        def __init__(self, *a, **k): ...
        def get_agent_metadata(self): return b""
        def get_reg_descs(self, *a, **k): return a
        def register_memory(self, *a, **k): ...
        def get_xfer_descs(self, *a, **k): return a
        def prep_xfer_dlist(self, *a, **k): return 1
        def release_dlist_handle(self, *a, **k): ...

    from vllm.model_executor.layers.mamba import mamba_utils

    # NixlConnector requires the (dim, state_len) conv layout for Mamba / GDN state.
    monkeypatch.setattr(mamba_utils, "get_conv_state_layout", lambda: "DS")
    monkeypatch.setattr(bw, "NixlWrapper", Agent)
    monkeypatch.setattr(bw, "nixl_agent_config", None)
    monkeypatch.setattr(bw, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(bw, "get_tensor_model_parallel_world_size", lambda: v.tp)
    monkeypatch.setattr(bw, "get_current_attn_backends", lambda c: [FlashAttentionBackend])
    monkeypatch.setattr(bw, "compute_nixl_compatibility_hash", lambda *a, **k: "")
    monkeypatch.setattr(bw.os, "sched_setaffinity", lambda *a: None)
    monkeypatch.setattr(bw.NixlBaseConnectorWorker, "_sync_block_size_with_kernel",
                        lambda self: setattr(self, "_logical_num_blocks", self.num_blocks))
    monkeypatch.setattr(bw.NixlBaseConnectorWorker, "__del__", lambda self: None)
    cfg.kv_transfer_config.kv_buffer_device = "cpu"
    w = bw.NixlBaseConnectorWorker(cfg, "D", kvc)
    w.register_kv_caches(views)
    return w


REPORT: list[tuple] = []  # (variant, group, kind, page bytes, NixlConnector's, kvhandoff's)


def _ranges(pairs) -> set[int]:
    return {b for start, n in pairs for b in range(start, start + n)}


@pytest.mark.parametrize("v", [q.Variant(0, False, 1), q.Variant(2, True, 1), q.SEED],
                         ids=lambda v: v.name)
def test_kvhandoff_reads_every_byte_nixlconnector_reads_and_only_the_group_s_own_rows(
        monkeypatch, v):
    """For the same KVCacheConfig, tensors and block ids: per group, the bytes vLLM 0.32's
    NixlConnector worker would write into D (its descriptors for the group's blocks) are
    all among the bytes kvhandoff's planned READ writes, and for the prompt groups (main
    KV with compressed keys) they are the same bytes.  Where they differ, on purpose:
    for a state group (GDN, PLE, key ring) kvhandoff reads the block's whole row (one
    descriptor per run of rows) where NixlConnector reads the group's pages (GDN: conv
    parts + SSM; PLE: the padded page; ring: its regions), so kvhandoff also moves the
    row's bytes no layer of the group uses; a block id belongs to one group at a time,
    so those bytes are the group's own and nothing of another request or group is
    touched.  Every byte of every layer page of the group (vLLM's views) is read by both
    (NixlConnector may skip a state page's padding)."""
    cfg, configs, _ = q.plan(v, role="kv_consumer", engine_id="D")
    kvc = configs[0]
    views, raw = q.allocate(kvc)
    base = raw.data_ptr()
    w = _nixl_worker(monkeypatch, v, cfg, kvc, views)
    layout = cache_layout(kvc)
    n = tokens_loaded(layout, 300)
    p_ids = export_ids(layout, _ids(layout, v, n, 1, set()), n)
    plan = plan_group_reads(layout, layout, p_ids, p_ids, n, null_block=0)
    row = layout.groups[0].regions[0].block_bytes
    src = w.src_blocks_data
    for read, g, vg in zip(plan.reads, layout.groups, kvc.transfer_groups, strict=True):
        only = [list(read.local_ids) if k == g.index else [] for k in range(len(layout.groups))]
        desc = w._compute_desc_ids(only, w.num_blocks, None, 1)
        nixl = _ranges((int(src[d][0]) - base, int(src[d][1])) for d in desc)
        ours = _ranges((b * row, row) for b in read.local_ids)
        pages = _ranges((views[layer][b].data_ptr() - base, views[layer][b].nbytes)
                        for layer in vg.layer_names for b in read.local_ids)
        assert nixl, g
        REPORT.append((v.name, g.index, g.kind.value, len(pages), len(nixl), len(ours)))
        assert nixl <= ours, (g.index, g.kind, len(nixl - ours))
        if not g.kind.reads_state:  # prompt groups: NixlConnector reads every region's page
            assert nixl == ours, (g.index, g.kind)  # of the row, i.e. the whole row, too
        assert pages <= ours, (g.index, g.kind)
        # NixlConnector reads the group's pages too, except what it leaves out on purpose:
        # a state page's padding (vLLM pads Mamba pages up to the attention page).
        missed = pages - nixl
        if missed:
            assert g.kind.reads_state and g.kind is not CacheKind.KEY_RING, (g.index, g.kind)
            specs = list(getattr(vg.kv_cache_spec, "kv_cache_specs",
                                 {"": vg.kv_cache_spec}).values())
            real = specs[0].real_page_size_bytes
            for layer in vg.layer_names:
                for blk in read.local_ids:
                    start = views[layer][blk].data_ptr() - base
                    assert _ranges([(start, real)]) <= nixl, (g.index, layer)

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

from kvhandoff.adapters.vllm.config import UnsupportedTopology  # noqa: E402
from kvhandoff.adapters.vllm.layout import cache_layout  # noqa: E402
from kvhandoff.adapters.vllm.side_channel import PeerIncompatible, check_compatible  # noqa: E402
from kvhandoff.core.groups import CacheKind, CacheLayout  # noqa: E402

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


@pytest.mark.parametrize(("spec", "named"), [
    (lambda s: dataclasses.replace(s, extra_retained_tokens=3), "extra_retained_tokens=3"),
    (lambda s: dataclasses.replace(s, num_prefill_checkpoint_blocks=1),
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

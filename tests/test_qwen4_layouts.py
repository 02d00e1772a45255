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
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import qwen4_layouts as q  # noqa: E402

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


# ---- the data path: P and D workers over NIXL, every byte of D's allocation checked --------

LEASE = 3.0
PROMPT = 300  # tokens; P prefills 299 (state groups: D computes the last one)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(layout: CacheLayout, v: q.Variant, n: int, start: int, skip: set[int]) -> list[list[int]]:
    """Block lists as vLLM's managers lay them out for ``n`` tokens, ids from one pool:
    prompt groups one block per block_size tokens; state groups in 'none' mode the state
    and its scratch slots, in 'align' mode position-indexed with the null block (0)
    before the state; the key ring its one block."""
    pool = iter(b for b in range(start, 10_000) if b not in skip)
    out = []
    for g in layout.groups:
        if g.kind.reads_state:
            lead = (-(-n // g.block_size) - 1) if (v.prefix_caching and g.kind is not
                                                   CacheKind.KEY_RING) else 0
            out.append([0] * lead + [next(pool) for _ in range(1 + g.spec_slots)])
        else:
            out.append([next(pool) for _ in range(-(-n // g.block_size))])
    return out


def _workers(tmp_path, v: q.Variant, configs):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    port = _port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 20.0}
    compat = {"model": "q4", "tp_size": v.tp}
    ranks = []
    for r in range(v.tp):
        layout = cache_layout(configs[r])
        p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-q4", Side.P, r, v.tp, compat)
        d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-q4", Side.D, r, v.tp, compat)
        (pc, praw), (dc, draw) = q.allocate(configs[r], DEVICE, seed=10 + r), q.allocate(configs[r], DEVICE)
        p.register_kv_caches(pc, layout)
        d.register_kv_caches(dc, layout)
        ranks.append((p, d, praw, draw, layout))
    return ranks, port


_PACE = threading.Event()


@pytest.mark.parametrize("v", [q.Variant(0, False, 1), q.Variant(2, True, 1), q.SEED],
                         ids=lambda v: v.name)
def test_every_byte_of_every_group_lands_where_d_planned_it(tmp_path, v):
    from kvhandoff.adapters.vllm.metadata import Admit, Export, Read, StepPlan
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.core.log import read_log

    _, configs, _ = q.plan(v)
    ranks, port = _workers(tmp_path, v, configs)
    try:
        layout = ranks[0][4]
        n = tokens_loaded(layout, PROMPT)
        assert n == PROMPT - 1
        p_lists = _ids(layout, v, n, 1, set())
        p_ids = export_ids(layout, p_lists, n)  # what P's request_finished hands D
        d_lists = _ids(layout, v, n, 1, {b for g in p_lists for b in g} | {0})
        d_ids = [[b for b in g if b] for g in d_lists]  # D's load targets leave nulls out
        plan = plan_group_reads(layout, layout, p_ids, d_ids, n, null_block=0)
        assert len(plan.reads) == len(layout.groups)  # every owner is read
        # Which blocks each owner hands over is vLLM's rule, not ours: NixlConnector's
        # clip_ssm_state_blocks for state, the ring's one block, every prompt block.
        from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

        for read, g, lst in zip(plan.reads, layout.groups, p_lists, strict=True):
            want = (clip_ssm_state_blocks(lst, g.spec_slots) if g.kind.reads_state else lst)
            assert list(read.remote_ids) == want, g
        params = RemotePrefill("P-q4", "q1", "127.0.0.1", port, v.tp, p_ids, n, LEASE,
                               token="tok").to_wire()
        for p, d, *_ in ranks:
            p.start_step(StepPlan(prefill_started=["q1"]))
            p.finish_step()
            p.start_step(StepPlan(exports=[Export("q1", sum(map(len, p_ids)), "tok")]))
            p.finish_step()
            d.start_step(StepPlan(admits=[Admit("Q1", params, "", PROMPT)],
                                  reads=[Read("Q1", d_ids)]))
        sent, recved, failed = [set() for _ in ranks], [set() for _ in ranks], set()
        deadline = time.monotonic() + 60
        # One completion for the request: every rank's (rank, group) splits drained.
        while not all("q1" in s for s in sent) or not all("Q1" in r for r in recved):
            assert time.monotonic() < deadline, (sent, recved, failed)
            for k, (p, d, *_) in enumerate(ranks):
                s, _, _ = p.finish_step()
                _, r, f = d.finish_step()
                assert not (s & sent[k]) and not (r & recved[k]), "reported twice"
                sent[k] |= s
                recved[k] |= r
                failed |= f
            _PACE.wait(0.002)
        assert failed == set()
        row = layout.groups[0].regions[0].block_bytes
        for _p, d, praw, draw, _ in ranks:
            src = praw.view(-1, row).cpu()
            dst = draw.view(-1, row).cpu()
            written = set()
            for read in plan.reads:
                for rb, lb in zip(read.remote_ids, read.local_ids, strict=True):
                    assert torch.equal(dst[lb], src[rb]), (read.group, rb, lb)
                    written.add(lb)
            # Nothing else moved: every other byte of D's allocation is still zero.
            rest = [b for b in range(dst.shape[0]) if b not in written]
            assert not dst[rest].abs().sum().item()
            tail = draw.numel() - dst.numel()
            assert tail == 0 or not draw[-tail:].abs().sum().item()
            events = [e for e in read_log(d.flush()) if e.request_id == "q1"]
            posted = next(e for e in events if e.kind == "reads_posted")
            assert sorted(posted.split_groups) == list(range(len(layout.groups)))
            assert sorted(e.split for e in events if e.kind == "split_completed") == \
                list(range(len(layout.groups)))
        # Each rank read its own P rank's bytes (the ranks' allocations differ).
        if v.tp == 2:
            assert not torch.equal(ranks[0][3], ranks[1][3])
    finally:
        for p, d, *_ in ranks:
            d.close()
            p.close()

"""Qwen4-exp's owners through the connector's worker pair, over NIXL, every byte checked.

P and D workers (`HandoffWorker`) on tensors laid out as vLLM 0.32 plans and
allocates them for a Qwen4-exp-shaped model (`qwen4_layouts`: GDN and PLE
state, the QSA key ring, compressed keys with the main KV; MTP, prefix
caching, TP 1 and 2).  The plans come from `tests/qwen4_plans.json`, which
`test_qwen4_layouts.py` checks against what vLLM plans now, so this runs where
vLLM is not installed: on host memory here, in VRAM with
``KVH_WORKER_DEVICE=cuda`` (docs/nixl.md).  Which block of each owner P hands
over is vLLM's rule (NixlConnector's ``clip_ssm_state_blocks``, re-stated
below for the machine without vLLM, and checked against vLLM's own function
where it is installed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

import handoff_checks as hc  # noqa: E402
import qwen4_layouts as q  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.core.groups import CacheKind, CacheLayout  # noqa: E402
from kvhandoff.core.planning import export_ids, plan_group_reads, tokens_loaded  # noqa: E402

DEVICE = os.environ.get("KVH_WORKER_DEVICE", "cpu")
DATA = json.loads((Path(__file__).parent / q.FIXTURE).read_text())
LEASE = 3.0
PROMPT = 300  # tokens; P prefills 299 (state groups: D computes the last one)


def _clip_ssm_state_blocks(blocks: list[int], num_spec_blocks: int) -> list[int]:
    """vLLM 0.32's ``kv_connector/utils.py:clip_ssm_state_blocks``, verbatim in effect."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
    except ImportError:
        if num_scratch := min(num_spec_blocks, len(blocks) - 1):
            blocks = blocks[:-num_scratch]
        return blocks[-1:]
    return clip_ssm_state_blocks(blocks, num_spec_blocks)


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


def _workers(tmp_path, v: q.Variant):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    port = free_port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 20.0}
    compat = {"model": "q4", "tp_size": v.tp}
    ranks = []
    for r in range(v.tp):
        layout, alloc = q.load_plan(DATA, v, r)
        p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-q4", Side.P, r, v.tp, compat)
        d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-q4", Side.D, r, v.tp, compat)
        (pc, praw), (dc, draw) = alloc(DEVICE, seed=10 + r), alloc(DEVICE)
        p.register_kv_caches(pc, layout)
        d.register_kv_caches(dc, layout)
        ranks.append((p, d, praw, draw, layout))
    return ranks, port




@pytest.mark.parametrize("v", q.BYTES_VARIANTS, ids=lambda v: v.name)
def test_every_byte_of_every_group_lands_where_d_planned_it(tmp_path, v):
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.core.log import read_log

    ranks, port = _workers(tmp_path, v)
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
        for read, g, lst in zip(plan.reads, layout.groups, p_lists, strict=True):
            want = _clip_ssm_state_blocks(lst, g.spec_slots) if g.kind.reads_state else lst
            assert list(read.remote_ids) == want, g
        params = RemotePrefill("P-q4", "q1", "127.0.0.1", port, v.tp, p_ids, n, LEASE,
                               token="tok").to_wire()
        p_ranks, d_workers = [p for p, *_ in ranks], [d for _, d, *_ in ranks]
        hc.start_hand_off(p_ranks, d_workers, params, d_ids, sum(map(len, p_ids)), PROMPT)
        # One completion for the request: every rank's (rank, group) splits drained.
        hc.step_until_handed_off(p_ranks, d_workers)
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

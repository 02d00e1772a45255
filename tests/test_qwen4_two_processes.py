"""Qwen4-exp's owners through the connector with P and D in two processes, every byte checked.

P's `HandoffWorker` ranks run in a process of their own (`two_hosts.Qwen4HostProcess`:
the two-host machinery's `HostProcess`, spawned, its ranks on a Qwen4-exp variant's
allocation as vLLM 0.32 plans it, from tests/qwen4_plans.json); D's ranks run in
the test process.  The seed configuration (MTP 2, prefix caching on: 'align'
checkpoints) at TP 1 and TP 2: each rank has its own allocation (P's filled
from a per-rank seed), D rank r reads P rank r, and the request completes once
on each D rank after every (rank, group) split.  Then every byte of each D
rank's allocation is checked: the blocks the plan names equal P's blocks (the
rows of P's allocation, fetched from P's process), every other byte is still
zero.

UCX is not restricted to tcp here (the host's environment is empty: UCX picks
its same-machine transports, as between two processes of one node); the tcp-only
two-host path is tests/test_two_hosts.py's.  The one-process worker pair, with
the same block-list rules: tests/test_qwen4_worker_pair.py.
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
import two_hosts as th  # noqa: E402
from test_qwen4_worker_pair import _clip_ssm_state_blocks, _ids  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.core.planning import export_ids, plan_group_reads, tokens_loaded  # noqa: E402

pytestmark = pytest.mark.timeout(120)
DATA = json.loads((Path(__file__).parent / q.FIXTURE).read_text())
LEASE = 3.0
PROMPT = 300
SEED_TP = {1: q.Variant(2, True, 1), 2: q.SEED}  # MTP on, prefix caching on


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_p_in_its_own_process_every_byte_of_d_s_allocation(tmp_path, tp):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side
    from kvhandoff.core.log import read_log

    v = SEED_TP[tp]
    assert v.mtp and v.prefix_caching and v.tp == tp
    port = free_port("127.0.0.1", tp)
    common = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
              "log_dir": str(tmp_path), "read_timeout_s": 20.0}
    p_host = th.Qwen4HostProcess(th.HostSpec(
        "P", "P-q4", {**common, "side_channel_port": port}, {}, tp,
        th.qwen4_layout_name(v.mtp, v.prefix_caching, v.tp), seed=10,
        output=str(tmp_path / "P.host.log")))
    d_ranks = []
    try:
        assert p_host.pid != os.getpid()  # P is another process
        p = [p_host.rank(r) for r in range(tp)]
        for r in range(tp):
            layout, alloc = q.load_plan(DATA, v, r)
            d = HandoffWorker(HandoffConfig.from_extra(common, env={}), "D-q4", Side.D, r, tp,
                              {"model": "q4", "tp_size": tp})
            views, raw = alloc("cpu")
            d.register_kv_caches(views, layout)
            d_ranks.append((d, raw, layout))
        layout = d_ranks[0][2]
        n = tokens_loaded(layout, PROMPT)
        assert n == PROMPT - 1  # state groups: D computes the last token
        p_lists = _ids(layout, v, n, 1, set())
        p_ids = export_ids(layout, p_lists, n)
        d_lists = _ids(layout, v, n, 1, {b for g in p_lists for b in g} | {0})
        d_ids = [[b for b in g if b] for g in d_lists]
        plan = plan_group_reads(layout, layout, p_ids, d_ids, n, null_block=0)
        assert len(plan.reads) == len(layout.groups)
        for read, g, lst in zip(plan.reads, layout.groups, p_lists, strict=True):
            want = _clip_ssm_state_blocks(lst, g.spec_slots) if g.kind.reads_state else lst
            assert list(read.remote_ids) == want, g
        params = RemotePrefill("P-q4", "q1", "127.0.0.1", port, tp, p_ids, n, LEASE,
                               token="tok").to_wire()
        d_workers = [d for d, _, _ in d_ranks]
        hc.start_hand_off(p, d_workers, params, d_ids, sum(map(len, p_ids)), PROMPT)
        hc.step_until_handed_off(p, d_workers)
        row = layout.groups[0].regions[0].block_bytes
        srcs = []
        for r, (d, draw, _) in enumerate(d_ranks):
            src = torch.frombuffer(bytearray(p_host.raw(r)), dtype=torch.int8).view(-1, row)
            dst = draw.view(-1, row)
            assert src.shape == dst.shape and src.abs().sum().item()  # P's bytes are random
            srcs.append(src)
            written = set()
            for read in plan.reads:
                for rb, lb in zip(read.remote_ids, read.local_ids, strict=True):
                    assert torch.equal(dst[lb], src[rb]), (r, read.group, rb, lb)
                    written.add(lb)
            rest = [b for b in range(dst.shape[0]) if b not in written]
            assert not dst[rest].abs().sum().item(), "D bytes outside the plan were written"
            # One completion over every (rank, group) split of this rank.
            events = [e for e in read_log(d.flush()) if e.request_id == "q1"]
            posted = next(e for e in events if e.kind == "reads_posted")
            assert sorted(posted.split_groups) == list(range(len(layout.groups)))
            assert sorted(e.split for e in events if e.kind == "split_completed") == \
                list(range(len(layout.groups)))
            assert [e.kind for e in read_log(p[r].flush())
                    if e.request_id == "q1"].count("freed") == 1
        if tp == 2:  # rank-local: each D rank read its own P rank (their bytes differ)
            assert not torch.equal(srcs[0], srcs[1])
            assert not torch.equal(d_ranks[0][1], d_ranks[1][1])
    finally:
        for d, _, _ in d_ranks:
            d.close()
        p_host.close()

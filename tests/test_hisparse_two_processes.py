"""HiSparse on D through the connector, P in its own process, every byte checked (issue #16).

P runs HiSparse off: its `HandoffWorker` ranks, in a spawned process
(`two_hosts.Qwen4HostProcess`, layout `hisparse_p_layout_name`), hold the DSA-shaped
stack as vLLM 0.32 plans and allocates it (`qwen4_layouts.plan_hisparse(v, False)`, one
group of sparse and indexer layers, filled from a per-rank seed).  D runs HiSparse on, in
the test process: vLLM's plan (`plan_hisparse(v, True)`) and vLLM's own HiSparse
allocator (`qwen4_layouts.allocate_hisparse`: the host pool for the sparse history, the
device buffer whose rows the indexer shares with the resident / hot groups; only the
pinning is stood in).  D's workers register both pools (a pool shared by the TP ranks:
rank 0 alone) and read one request.

Checked: the request completes once per D rank, after every split of that rank drained
(the host pool's and the device's); rank 0 read the host pool for every rank and rank 1
posted no host split when the pool is shared; each page D read equals P's page of the
same layer through vLLM's own views on both sides; every other byte of both of D's
allocations is still zero (the rows' resident / hot bytes included); P freed once per
rank.  On this CPU machine both pools are host memory; the H200 run with P's caches in
VRAM and D's pool in pinned DRAM is in docs/nixl.md.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from conftest import poll_pause

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

import qwen4_layouts as q  # noqa: E402
import two_hosts as th  # noqa: E402

from kvhandoff.core.planning import export_ids, in_host_pool, tokens_loaded  # noqa: E402

pytestmark = pytest.mark.timeout(180)
LEASE = 3.0
PROMPT = 300  # 5 blocks of 64 tokens
VARIANT = {1: q.Variant(2, True, 1), 2: q.SEED}  # MTP 2 and prefix caching, as the seed runs


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-shared-pool"])
def test_d_s_host_pool_and_device_groups_every_byte_one_completion(tmp_path, tp):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.layout import cache_layout
    from kvhandoff.adapters.vllm.metadata import Admit, Export, Read, StepPlan
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side
    from kvhandoff.core.log import read_log

    v = VARIANT[tp]
    port = th.free_port_pair("127.0.0.1", tp)
    common = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
              "log_dir": str(tmp_path), "read_timeout_s": 20.0}
    p_host = th.Qwen4HostProcess(th.HostSpec(
        "P", "P-hs", {**common, "side_channel_port": port}, {}, tp,
        th.hisparse_p_layout_name(v.mtp, tp), seed=10, output=str(tmp_path / "P.host.log")),
        timeout_s=120.0)
    d_ranks = []
    try:
        assert p_host.pid != os.getpid()  # P is another process
        p = [p_host.rank(r) for r in range(tp)]
        _, p_configs, _ = q.plan_hisparse(v, False)  # P's plan, to read P's bytes back
        _, d_configs, _ = q.plan_hisparse(v, True)
        for r in range(tp):
            layout = cache_layout(d_configs[r], host_pools=True)
            assert layout.shared_host_pool is (tp > 1)
            d = HandoffWorker(HandoffConfig.from_extra(common, env={}), "D-hs", Side.D, r, tp,
                              {"model": "q4", "tp_size": tp})
            views, device, host = q.allocate_hisparse(d_configs[r])
            d.register_kv_caches(views, layout)
            d_ranks.append((d, layout, views, device, host))
        layout = d_ranks[0][1]
        source, indexer = layout.groups
        assert in_host_pool(source) and not in_host_pool(indexer)
        p_layout = cache_layout(p_configs[0])
        n = tokens_loaded(p_layout, PROMPT)
        assert n == PROMPT  # attention only: D loads the whole prompt
        rng = random.Random(tp)
        blocks = -(-n // source.block_size)
        p_list = rng.sample(range(1, p_configs[0].num_blocks), blocks)
        p_ids = export_ids(p_layout, p_layout.select([p_list]), n)
        assert p_ids == (tuple(p_list), tuple(p_list))  # one vLLM block table, two groups
        d_ids = [rng.sample(range(1, g.num_blocks), blocks) for g in layout.groups]
        params = RemotePrefill("P-hs", "q1", "127.0.0.1", port, tp, p_ids, n, LEASE,
                               token="tok").to_wire()
        for pr in p:
            pr.start_step(StepPlan(prefill_started=["q1"]))
            pr.finish_step()
            pr.start_step(StepPlan(exports=[Export("q1", blocks, "tok")]))
            pr.finish_step()
        for d, *_ in d_ranks:
            d.start_step(StepPlan(admits=[Admit("Q1", params, "", PROMPT)],
                                  reads=[Read("Q1", d_ids)]))
        sent, recved, failed = set(), set(), set()
        deadline = time.monotonic() + 60
        want_sent = {(r, "q1") for r in range(tp)}
        want_recved = {(r, "Q1") for r in range(tp)}
        while not (want_sent <= sent and want_recved <= recved):
            assert time.monotonic() < deadline, (sent, recved, failed)
            for r in range(tp):
                s, _, _ = p[r].finish_step()
                _, got, f = d_ranks[r][0].finish_step()
                now_s, now_r = {(r, x) for x in s}, {(r, x) for x in got}
                assert not (now_s & sent) and not (now_r & recved), "reported twice"
                sent |= now_s
                recved |= now_r
                failed |= {(r, x) for x in f}
            poll_pause(0.002)
        assert failed == set()
        for r, (d, d_layout, views, device, host) in enumerate(d_ranks):
            reads_pool = r == 0 or not d_layout.shared_host_pool
            p_views, p_raw = q.allocate(p_configs[r], "cpu")
            p_raw.copy_(torch.frombuffer(bytearray(p_host.raw(r)), dtype=torch.int8))
            assert p_raw.abs().sum().item()  # P's bytes are random
            for g in d_layout.groups:
                if in_host_pool(g) and not reads_pool:
                    continue
                for layer in g.layers:
                    for rb, lb in zip(p_ids[g.index], d_ids[g.index], strict=True):
                        got, want = _bytes(views[layer][lb]), _bytes(p_views[layer][rb])
                        assert torch.equal(got, want), (r, g.index, layer, rb, lb)
                        views[layer][lb].zero_()  # checked: what is left must be zero
            assert not device.abs().sum().item(), f"rank {r}: device bytes outside the plan"
            assert not host.abs().sum().item(), f"rank {r}: host-pool bytes outside the plan"
            events = [e for e in read_log(d.flush()) if e.request_id == "q1"]
            posted = next(e for e in events if e.kind == "reads_posted")
            groups = [0, 1] if reads_pool else [1]  # a shared pool: rank 0 reads it
            assert sorted(posted.split_groups) == groups
            assert sorted(e.split for e in events if e.kind == "split_completed") == \
                list(range(len(groups)))
            assert [e.kind for e in read_log(p[r].flush())
                    if e.request_id == "q1"].count("freed") == 1
    finally:
        for d, *_ in d_ranks:
            d.close()
        p_host.close()

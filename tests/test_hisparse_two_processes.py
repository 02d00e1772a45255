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

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

import handoff_checks as hc  # noqa: E402
import qwen4_layouts as q  # noqa: E402
import two_hosts as th  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.core.planning import export_ids, in_host_pool, tokens_loaded  # noqa: E402

pytestmark = pytest.mark.timeout(180)
LEASE = 3.0
PROMPT = 300  # 5 blocks of 64 tokens
VARIANT = {1: q.Variant(2, True, 1), 2: q.SEED}  # MTP 2 and prefix caching, as the seed runs


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-shared-pool"])
def test_d_s_host_pool_and_device_groups_every_byte_one_completion(tmp_path, tp):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.layout import cache_layout
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    v = VARIANT[tp]
    port = free_port("127.0.0.1", tp)
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
        hc.start_hand_off(p, [d for d, *_ in d_ranks], params, d_ids, blocks, PROMPT)
        hc.step_until_handed_off(p, [d for d, *_ in d_ranks])
        for r, (d, d_layout, views, device, host) in enumerate(d_ranks):
            p_views, p_raw = q.allocate(p_configs[r], "cpu")
            p_raw.copy_(torch.frombuffer(bytearray(p_host.raw(r)), dtype=torch.int8))
            hc.check_hisparse_rank(r, d_layout, p_ids, d_ids, views, p_views, device, host,
                                   d.flush(), p[r].flush())
    finally:
        for d, *_ in d_ranks:
            d.close()
        p_host.close()

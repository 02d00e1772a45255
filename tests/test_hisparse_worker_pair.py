"""HiSparse on D through the connector's worker pair, over NIXL, every byte checked (issue #16).

P and D `HandoffWorker`s in one process on the allocations vLLM 0.32 plans for the
DSA-shaped stack (`tests/hisparse_plans.json`, checked equal to vLLM's planner and
HiSparse allocator output by `test_hisparse_layouts.py`), so this runs where vLLM is not
installed: on host memory here, with ``KVH_WORKER_DEVICE=cuda`` on the GPU (docs/nixl.md).
P runs HiSparse off: one buffer on the device, the sparse and indexer layers filled from a
per-rank seed.  D runs it on: the sparse history in a host pool (pinned on CUDA), the
indexer in a device buffer whose rows it shares with resident / hot groups that are never
transferred (strided regions); both zeroed.  TP 1 (MTP 2, prefix caching) and the seed's
TP 2, whose host pool is shared by the ranks: rank 0 alone registers and reads it.

Checked: one completion per D rank, after every split of that rank drained; the splits
each rank posted (rank 1 only the indexer's when the pool is shared); every page D read
equals P's page of the same layer; every other byte of D's device buffer and host pool is
still zero (the rows' resident / hot bytes included); P freed once per rank.
``KVH_GPU_REPORT=file`` appends one JSON line per case: the path each D rank's READs took
(the CUDA IPC gather or NIXL/UCX) and the splits' times (from posting to the step that saw
them complete, so a few ms of polling included).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

import handoff_checks as hc  # noqa: E402
import qwen4_layouts as q  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.core.planning import export_ids, in_host_pool, tokens_loaded  # noqa: E402

pytestmark = pytest.mark.timeout(120)
DEVICE = os.environ.get("KVH_WORKER_DEVICE", "cpu")
DATA = json.loads((Path(__file__).parent / q.HS_FIXTURE).read_text())
LEASE = 3.0
# 5 blocks of 64 tokens; KVH_HISPARSE_PROMPT=3008 reads 47 (P's pool holds 48), for a timing
PROMPT = int(os.environ.get("KVH_HISPARSE_PROMPT", "300"))


def _path(d) -> str:
    """Which path the D worker's READs from P took: the CUDA IPC gather or NIXL/UCX."""
    peers = list(getattr(d.transport, "_peers", {}).values())
    if any(getattr(p, "ipc", None) is not None for p in peers):
        return "cuda_ipc_gather"
    if any(getattr(p, "ipc_tried", False) for p in peers):
        return "nixl (cuda ipc refused)"
    return "nixl"


def _report(line: dict) -> None:
    if path := os.environ.get("KVH_GPU_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("v", q.HS_BYTES_VARIANTS, ids=lambda v: v.name)
def test_d_s_host_pool_and_device_groups_every_byte_one_completion(tmp_path, v):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    port = free_port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 20.0}
    compat = {"model": "dsa", "tp_size": v.tp}
    ranks = []
    try:
        for r in range(v.tp):
            (p_layout, p_alloc), (d_layout, d_alloc) = q.load_hisparse_plan(DATA, v, r)
            assert d_layout.shared_host_pool is (v.tp > 1)
            p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-hs", Side.P, r, v.tp,
                              compat)
            d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-hs", Side.D, r, v.tp,
                              compat)
            p_views, p_raw = p_alloc(DEVICE, seed=10 + r)
            d_views, device, host = d_alloc(DEVICE)
            assert device.device.type == torch.device(DEVICE).type and host.device.type == "cpu"
            assert host.is_pinned() is (device.device.type == "cuda")
            p.register_kv_caches(p_views, p_layout)
            d.register_kv_caches(d_views, d_layout)
            ranks.append((p, d, p_layout, d_layout, p_views, d_views, device, host))
        p_layout, d_layout = ranks[0][2], ranks[0][3]
        source, indexer = d_layout.groups
        assert in_host_pool(source) and not in_host_pool(indexer)
        assert indexer.regions[0].stride > indexer.regions[0].block_bytes  # rows shared
        n = tokens_loaded(p_layout, PROMPT)
        assert n == PROMPT  # attention only: D loads the whole prompt
        rng = random.Random(v.tp)
        blocks = -(-n // source.block_size)
        p_list = rng.sample(range(1, p_layout.groups[0].num_blocks), blocks)
        p_ids = export_ids(p_layout, p_layout.select([p_list]), n)
        assert p_ids == (tuple(p_list), tuple(p_list))  # one vLLM block table, two groups
        d_ids = [rng.sample(range(1, g.num_blocks), blocks) for g in d_layout.groups]
        params = RemotePrefill("P-hs", "q1", "127.0.0.1", port, v.tp, p_ids, n, LEASE,
                               token="tok").to_wire()
        p_ranks, d_ranks = [p for p, *_ in ranks], [d for _, d, *_ in ranks]
        hc.start_hand_off(p_ranks, d_ranks, params, d_ids, blocks, PROMPT)
        hc.step_until_handed_off(p_ranks, d_ranks)
        report = {"case": v.name, "device": DEVICE, "prompt": PROMPT, "ranks": []}
        for r, (p, d, _, d_layout, p_views, d_views, device, host) in enumerate(ranks):
            posted, done = hc.check_hisparse_rank(r, d_layout, p_ids, d_ids, d_views, p_views,
                                                  device, host, d.flush(), p.flush())
            report["ranks"].append({
                "rank": r, "path": _path(d), "split_groups": list(posted.split_groups),
                "split_ms": {str(g): round(1e3 * (done[i] - posted.t), 3)
                             for i, g in enumerate(posted.split_groups)},
                "bytes": {str(g): blocks * d_layout.groups[g].block_bytes
                          for g in posted.split_groups}})
        # Each rank read its own P rank's bytes (the ranks' allocations differ).
        if v.tp == 2:
            assert not torch.equal(ranks[0][4][indexer.layers[0]].cpu(),
                                   ranks[1][4][indexer.layers[0]].cpu())
        _report(report)
        print(json.dumps(report))
    finally:
        for p, d, *_ in ranks:
            d.close()
            p.close()

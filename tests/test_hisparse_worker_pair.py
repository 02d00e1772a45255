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
import socket
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

import qwen4_layouts as q  # noqa: E402

from kvhandoff.core.planning import export_ids, in_host_pool, tokens_loaded  # noqa: E402

pytestmark = pytest.mark.timeout(120)
DEVICE = os.environ.get("KVH_WORKER_DEVICE", "cpu")
DATA = json.loads((Path(__file__).parent / q.HS_FIXTURE).read_text())
LEASE = 3.0
# 5 blocks of 64 tokens; KVH_HISPARSE_PROMPT=3008 reads 47 (P's pool holds 48), for a timing
PROMPT = int(os.environ.get("KVH_HISPARSE_PROMPT", "300"))
_PACE = threading.Event()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _page(t) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


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
    from kvhandoff.adapters.vllm.metadata import Admit, Export, Read, StepPlan
    from kvhandoff.adapters.vllm.params import RemotePrefill
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side
    from kvhandoff.core.log import read_log

    port = _port()
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
        for p, d, *_ in ranks:
            p.start_step(StepPlan(prefill_started=["q1"]))
            p.finish_step()
            p.start_step(StepPlan(exports=[Export("q1", blocks, "tok")]))
            p.finish_step()
            d.start_step(StepPlan(admits=[Admit("Q1", params, "", PROMPT)],
                                  reads=[Read("Q1", d_ids)]))
        sent, recved, failed = [set() for _ in ranks], [set() for _ in ranks], set()
        deadline = time.monotonic() + 60
        while not all("q1" in s for s in sent) or not all("Q1" in r for r in recved):
            assert time.monotonic() < deadline, (sent, recved, failed)
            for k, (p, d, *_) in enumerate(ranks):
                s, _, _ = p.finish_step()
                _, got, f = d.finish_step()
                assert not (s & sent[k]) and not (got & recved[k]), "reported twice"
                sent[k] |= s
                recved[k] |= got
                failed |= f
            _PACE.wait(0.002)
        assert failed == set()
        report = {"case": v.name, "device": DEVICE, "prompt": PROMPT, "ranks": []}
        for r, (p, d, _, d_layout, p_views, d_views, device, host) in enumerate(ranks):
            reads_pool = r == 0 or not d_layout.shared_host_pool
            for g in d_layout.groups:
                if in_host_pool(g) and not reads_pool:
                    continue
                for layer in g.layers:
                    for rb, lb in zip(p_ids[g.index], d_ids[g.index], strict=True):
                        got, want = _page(d_views[layer][lb]), _page(p_views[layer][rb])
                        assert want.count_nonzero().item()  # P's bytes are random
                        assert torch.equal(got, want), (r, g.index, layer, rb, lb)
                        d_views[layer][lb].zero_()  # checked: what is left must be zero
            assert not device.count_nonzero().item(), f"rank {r}: device bytes outside the plan"
            assert not host.count_nonzero().item(), f"rank {r}: host-pool bytes outside the plan"
            events = [e for e in read_log(d.flush()) if e.request_id == "q1"]
            posted = next(e for e in events if e.kind == "reads_posted")
            groups = [0, 1] if reads_pool else [1]  # a shared pool: rank 0 reads it
            assert sorted(posted.split_groups) == groups
            done = {e.split: e.t for e in events if e.kind == "split_completed"}
            assert sorted(done) == list(range(len(groups)))
            assert [e.kind for e in read_log(p.flush())
                    if e.request_id == "q1"].count("freed") == 1
            report["ranks"].append({
                "rank": r, "path": _path(d), "split_groups": list(posted.split_groups),
                "split_ms": {str(g): round(1e3 * (done[i] - posted.t), 3)
                             for i, g in enumerate(posted.split_groups)},
                "bytes": {str(g.index): blocks * g.block_bytes for g in d_layout.groups
                          if reads_pool or not in_host_pool(g)}})
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

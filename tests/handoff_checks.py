"""One request through the connector's worker halves, and what must hold after it.

Shared by the worker-pair tests (P and D `HandoffWorker`s in one process, run on the
H200 too: nothing here imports vLLM) and the two-process tests (P's workers in a
spawned process, `two_hosts.RemoteWorker`).  Request ids: ``q1`` on P, ``Q1`` on D.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from conftest import poll_pause

from kvhandoff.core.log import read_log
from kvhandoff.core.planning import in_host_pool


def start_hand_off(p_ranks: Sequence[Any], d_ranks: Sequence[Any], params: dict,
                   d_ids: Sequence[Sequence[int]], blocks: int, prompt: int) -> None:
    """Every P rank prefills and exports ``q1`` (``blocks`` blocks); every D rank admits
    ``Q1`` with P's ``params`` and posts its READs into ``d_ids``."""
    from kvhandoff.adapters.vllm.metadata import Admit, Export, Read, StepPlan

    for p in p_ranks:
        p.start_step(StepPlan(prefill_started=["q1"]))
        p.finish_step()
        p.start_step(StepPlan(exports=[Export("q1", blocks, "tok")]))
        p.finish_step()
    for d in d_ranks:
        d.start_step(StepPlan(admits=[Admit("Q1", params, "", prompt)],
                              reads=[Read("Q1", [list(ids) for ids in d_ids])]))


def step_until_handed_off(p_ranks: Sequence[Any], d_ranks: Sequence[Any],
                          timeout_s: float = 60.0) -> None:
    """Step every rank until each P rank reported ``q1`` sent and each D rank ``Q1``
    received: one completion per rank, each reported exactly once, none failed."""
    sent = [set() for _ in p_ranks]
    recved = [set() for _ in d_ranks]
    failed: set = set()
    deadline = time.monotonic() + timeout_s
    while not all("q1" in s for s in sent) or not all("Q1" in r for r in recved):
        assert time.monotonic() < deadline, (sent, recved, failed)
        for k, (p, d) in enumerate(zip(p_ranks, d_ranks, strict=True)):
            s, _, _ = p.finish_step()
            _, got, f = d.finish_step()
            assert not (s & sent[k]) and not (got & recved[k]), "reported twice"
            sent[k] |= s
            recved[k] |= got
            failed |= f
        poll_pause(0.002)
    assert failed == set()


def check_hisparse_rank(rank: int, d_layout: Any, p_ids: Sequence[Sequence[int]],
                        d_ids: Sequence[Sequence[int]], d_views: dict, p_views: dict,
                        device: Any, host: Any, d_log: str, p_log: str) -> tuple[Any, dict]:
    """What one D rank of a HiSparse hand-off must show; returns its ``reads_posted``
    event and each split's completion time.

    Every page it read equals P's page of the same layer (through each side's own
    views); every other byte of its device buffer and host pool is zero (the pages
    checked are zeroed on the way: call once); it posted the pool's split only if it
    reads the pool (rank 0, or every rank when the pool is not shared), and completed
    every split it posted; P's rank freed once.
    """
    import torch

    def page(t: Any) -> Any:
        return t.contiguous().view(-1).view(torch.uint8).cpu()

    reads_pool = rank == 0 or not d_layout.shared_host_pool
    for g in d_layout.groups:
        if in_host_pool(g) and not reads_pool:
            continue
        for layer in g.layers:
            for rb, lb in zip(p_ids[g.index], d_ids[g.index], strict=True):
                got, want = page(d_views[layer][lb]), page(p_views[layer][rb])
                assert want.count_nonzero().item()  # P's bytes are random
                assert torch.equal(got, want), (rank, g.index, layer, rb, lb)
                d_views[layer][lb].zero_()  # checked: what is left must be zero
    assert not device.count_nonzero().item(), f"rank {rank}: device bytes outside the plan"
    assert not host.count_nonzero().item(), f"rank {rank}: host-pool bytes outside the plan"
    events = [e for e in read_log(d_log) if e.request_id == "q1"]
    posted = next(e for e in events if e.kind == "reads_posted")
    groups = [g.index for g in d_layout.groups if reads_pool or not in_host_pool(g)]
    assert sorted(posted.split_groups) == groups  # a shared pool: rank 0 reads it
    done = {e.split: e.t for e in events if e.kind == "split_completed"}
    assert sorted(done) == list(range(len(groups)))
    assert [e.kind for e in read_log(p_log) if e.request_id == "q1"].count("freed") == 1
    return posted, done

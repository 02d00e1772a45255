"""HiSparse on D in the simulator (issue #16): a request's READ split by where it lands.

A DSA model's request is two groups (`simulations.scenarios._hisparse`): the sparse MLA
layers' KV, which D keeps in a host pool (HiSparse's source group: `Memory.HOST` in D's
layout, on the device in P's), and the indexer's keys, on D's GPU; one split each per D
rank, and D concludes the request once every split of every rank drained.  With the host
pool shared by D's ranks, D rank 0 alone reads it: the other ranks post only their
indexer split.  The tests assert effects on the logs and the fabric: which splits each
rank posted, when P frees against when the splits drained, which bytes were read.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from test_simulations_hybrid import _by_stream, _frees_follow_every_split, _split_ends, events

from kvhandoff.core.fence import FENCE_BYTES
from kvhandoff.core.groups import Memory
from kvhandoff.core.planning import blocks_needed
from kvhandoff.simulations.runner import run_one, sweep
from kvhandoff.simulations.scenarios import HISPARSE_OWNERS, INDEXER, SPARSE, build, names
from kvhandoff.simulations.world import World

HISPARSE = ["hisparse_slow_host_split", "hisparse_host_split_failure",
            "hisparse_cancel_during_host_read", "hisparse_tp2_shared_pool"]
SEEDS = range(int(os.environ.get("KVH_SIM_HISPARSE_SEEDS", "40")))
POLICIES = ("kvhandoff", "vllm-0.32")
LEASE = 30.0


def _host_groups(world: World, d_rank: int) -> list[int]:
    """The groups D rank ``d_rank`` reads: the host pool's only where it is that rank's."""
    shared = world.cfg.shared_host_pool and d_rank != 0
    return [INDEXER] if shared else [SPARSE, INDEXER]


def test_the_catalogue_has_the_hisparse_scenarios_with_the_host_pool_on_d_only():
    """The source group is in D's host pool and on P's device, and the two layouts pair;
    the pool is shared by D's ranks in some seeds (always in the TP-2 scenario)."""
    assert set(HISPARSE) <= set(names())
    shared = set()
    for name in HISPARSE:
        for seed in range(6):
            cfg = build(name, seed)
            assert [g.kind.value for g in cfg.groups] == ["full_attention", "indexer"]
            assert [g.owner for g in cfg.groups] == list(HISPARSE_OWNERS)
            world = World(cfg)
            for layout in world.d.layouts:
                assert [g.regions[0].memory for g in layout.groups] == [Memory.HOST,
                                                                        Memory.DEVICE]
                assert layout.shared_host_pool == cfg.shared_host_pool
                layout.check_matches(world.p.layout)
            assert {r.memory for g in world.p.layout.groups for r in g.regions} == {
                Memory.DEVICE}
            shared.add((name, cfg.shared_host_pool))
    assert {("hisparse_slow_host_split", True), ("hisparse_slow_host_split", False)} <= shared
    for seed in range(6):
        cfg = build("hisparse_tp2_shared_pool", seed)
        assert (cfg.tp, cfg.decode_tp, cfg.shared_host_pool) == (2, 2, True)


@pytest.mark.parametrize("scenario", HISPARSE)
def test_policy_kvhandoff_keeps_every_invariant_with_a_host_pool(scenario):
    summary = sweep([scenario], SEEDS, "kvhandoff", replay_check=True)
    assert summary.violations == [], summary.violations[:3]
    t = summary.totals
    assert t["freed_under_read"] == t["served_corrupt"] == t["served_unproven"] == 0
    assert t["double_frees"] == t["leaks"] == t["stuck"] == t["overwritten_under_read"] == 0
    assert t["lease_expiries"] == 0
    assert t["served"] > 0


def _multi_rank_seeds(scenario: str) -> list[int]:
    """The first seed where D has several ranks sharing the host pool, and the first where
    each has its own (none in the TP-2 shared-pool scenario)."""
    seeds = {}
    for seed in range(100):
        cfg = build(scenario, seed)
        if cfg.decode_tp > 1:
            seeds.setdefault(cfg.shared_host_pool, seed)
    assert True in seeds, scenario
    return sorted(seeds.values())


@pytest.mark.parametrize("scenario", HISPARSE)
@pytest.mark.parametrize("policy", POLICIES)
def test_each_d_rank_posts_a_split_per_group_it_reads_and_a_shared_pool_is_rank_0s(scenario,
                                                                                  policy):
    """D rank d posts one split per group from P rank d // k; where the pool is shared, a
    rank other than 0 posts its indexer split alone.  P frees each rank once, after the
    splits that read it (vllm-0.32 under a cancel: the gap the cancel test shows)."""
    without_pool = 0
    for seed in _multi_rank_seeds(scenario):
        world = World(build(scenario, seed, policy))
        result = world.run(on_step=World.check_safety if policy == "kvhandoff" else None)
        k = world.cfg.heads_per_p_rank
        posted = [e for e in events(result.d_log) if e["type"] == "reads_posted"]
        assert posted
        for e in posted:
            groups = _host_groups(world, e["rank"])
            assert e["split_groups"] == groups
            assert e["split_ranks"] == [e["rank"] // k] * len(groups)
            without_pool += groups == [INDEXER]
        if (scenario, policy) != ("hisparse_cancel_during_host_read", "vllm-0.32"):
            assert _frees_follow_every_split(result)
        assert result.metrics["served_corrupt"] == 0
    assert without_pool, "some seed has D ranks that do not read the shared pool"


def test_a_slow_host_split_keeps_p_holding_both_groups_until_it_drained():
    """The host-pool READ (0.2-2.5 leases) outlasts the indexer's (milliseconds), a whole
    lease at times: heartbeats keep P's lease, P frees after the host split, never before."""
    for policy in POLICIES:
        checked = slower = 0
        for seed in range(6):
            result = run_one("hisparse_slow_host_split", seed, policy)
            assert result.metrics["freed_under_read"] == result.metrics["lease_expiries"] == 0
            checked += _frees_follow_every_split(result)
            for history in _by_stream(events(result.d_log)).values():
                posted = next((e for e in history if e["type"] == "reads_posted"), None)
                if posted is None or SPARSE not in posted["split_groups"]:
                    continue
                ends = _split_ends(history)
                host = ends[posted["split_groups"].index(SPARSE)]["t"]
                indexer = ends[posted["split_groups"].index(INDEXER)]["t"]
                assert host - indexer > 0.1 * LEASE, "the host-pool READ is the slow one"
                slower += host - indexer > LEASE
        assert checked and slower, (policy, checked, slower)


def test_a_failed_host_split_fails_the_request_and_p_frees_once_after_the_indexer_split():
    """Only host-pool splits fail; a request with one fails (never served), is reported
    after every split drained, and the indexer split in flight outlives the failure."""
    for policy in POLICIES:
        overlapped = failed_requests = 0
        for seed in range(10):
            world = World(build("hisparse_host_split_failure", seed, policy))
            result = world.run()
            assert result.metrics["freed_under_read"] == 0
            assert result.metrics["overwritten_under_read"] == 0
            _frees_follow_every_split(result)
            outcome = {r.rid: r.outcome for r in world.requests}
            for (rid, _), history in _by_stream(events(result.d_log)).items():
                failed = [e for e in history if e["type"] == "split_failed"]
                if not failed:
                    continue
                groups = next(e for e in history if e["type"] == "reads_posted")["split_groups"]
                assert {groups[e["split"]] for e in failed} == {SPARSE}
                assert outcome[rid] == "failed", (rid, outcome[rid])
                finish = next(e for e in history if e["type"] == "finished_recving")
                ends = _split_ends(history)
                assert all(e["seq"] < finish["seq"] for e in ends.values())
                overlapped += ends[groups.index(INDEXER)]["t"] > failed[0]["t"]
                failed_requests += 1
        assert failed_requests and overlapped, (policy, failed_requests, overlapped)


def test_cancel_during_the_host_read_vllm_032_frees_under_it_and_kvhandoff_does_not():
    """vllm-0.32 stops heartbeating the cancelled request while the host-pool READ runs:
    P's lease lapses and P frees under it (replay sees the heartbeat gap); kvhandoff
    heartbeats until the READ drained."""
    old = sweep(["hisparse_cancel_during_host_read"], range(10), "vllm-0.32", replay_check=True)
    new = sweep(["hisparse_cancel_during_host_read"], range(10), "kvhandoff", replay_check=True)
    assert old.totals["freed_under_read"] > 0
    assert {"freed_under_read", "replay:heartbeat_gap"} <= {v["invariant"]
                                                            for v in old.violations}
    assert new.totals["freed_under_read"] == 0 and new.violations == []
    assert new.totals["cancelled"] > 0


def test_the_cancel_lands_between_the_indexer_and_the_host_split_and_p_waits_for_the_host():
    """Under kvhandoff a cancel after the indexer landed keeps heartbeats going until the
    host split drained, and P frees after it; under vllm-0.32 P frees before it ends."""
    between = under = 0
    for policy in POLICIES:
        for seed in (1, 2):
            result = run_one("hisparse_cancel_during_host_read", seed, policy)
            freed = {(e["rid"], e["rank"]): e["t"] for e in events(result.p_log)
                     if e["type"] == "freed"}
            for (rid, _), history in _by_stream(events(result.d_log)).items():
                kinds = {e["type"]: e for e in history}
                if ("client_cancelled" not in kinds or "reads_posted" not in kinds
                        or SPARSE not in kinds["reads_posted"]["split_groups"]):
                    continue
                groups = kinds["reads_posted"]["split_groups"]
                ends = _split_ends(history)
                t = kinds["client_cancelled"]["t"]
                host = ends[groups.index(SPARSE)]["t"]
                if not ends[groups.index(INDEXER)]["t"] < t < host:
                    continue
                p_rank = kinds["reads_posted"]["split_ranks"][0]
                if policy == "kvhandoff":
                    between += 1
                    beats = [e["t"] for e in history
                             if e["type"] == "heartbeat_sent" and e["t"] > t]
                    assert beats and max(beats) > host - LEASE, "heartbeats until it drains"
                    assert freed[(rid, p_rank)] >= host
                else:
                    under += freed[(rid, p_rank)] < host
    assert between and under, (between, under)


def _conclusions(world: World) -> dict[str, list[float]]:
    """When D concluded each request (its one outcome, vLLM's aggregated report), recorded
    as D hands it to the world."""
    out: dict[str, list[float]] = {}
    report = world.d.on_done

    def concluded(req, outcome: str) -> None:
        out.setdefault(req.rid, []).append(world.clock.now)
        report(req, outcome)

    world.d.on_done = concluded
    return out


def test_tp2_d_rank_1_never_waits_for_the_shared_pool_and_p_rank_1_frees_after_its_indexer():
    """TP 2 with one host pool: D rank 0 reads the source group (from P rank 0) and the
    indexer, D rank 1 only its indexer.  P rank 1 frees once, after D rank 1's indexer
    split, often before D rank 0's host split ended; D concludes each request once, after
    every split of both ranks.  The fabric moved exactly those splits' bytes, and the fence
    words D read after them."""
    for policy in POLICIES:
        early = 0
        for seed in range(4):
            world = World(build("hisparse_tp2_shared_pool", seed, policy))
            concluded = _conclusions(world)
            result = world.run()
            assert result.metrics["served_corrupt"] == result.metrics["freed_under_read"] == 0
            assert result.metrics["served"] > 0
            _frees_follow_every_split(result)
            freed = {(e["rid"], e["rank"]): e["t"] for e in events(result.p_log)
                     if e["type"] == "freed"}
            d = _by_stream(events(result.d_log))
            tokens = {rid: p.num_tokens for rid, p in world.params.items()}
            groups = world.d.layouts[0].groups
            moved = 0
            for (rid, d_rank), history in d.items():
                posted = next((e for e in history if e["type"] == "reads_posted"), None)
                if posted is None:
                    continue
                assert posted["split_groups"] == ([SPARSE, INDEXER] if d_rank == 0
                                                  else [INDEXER])
                ends = _split_ends(history)
                moved += sum(blocks_needed(groups[g], tokens[rid]) * groups[g].block_bytes
                             for i, g in enumerate(posted["split_groups"])
                             if ends[i]["type"] == "split_completed")
                if d_rank == 1:
                    indexer = ends[0]["t"]
                    assert freed[(rid, 1)] >= indexer
                    host = _split_ends(d[(rid, 0)])[0]["t"]
                    early += freed[(rid, 1)] < host
                    assert len(concluded[rid]) == 1, "D concludes a request once"
                    assert concluded[rid][0] >= max(host, indexer)
            # (and the fence READs kvhandoff's D posts after the splits drained)
            assert world.net.stats.bytes_read == moved + FENCE_BYTES * world.d.fences_landed
        assert early, policy


def test_a_d_rank_with_nothing_of_its_own_to_read_posts_one_empty_split_and_releases():
    """A shared pool where D holds the indexer's blocks already (half the requests): D rank
    1 has no group to read, so it posts one empty split drained at once (as the connector
    does for a plan with no reads) and its P rank is released without waiting for D rank
    0's host-pool READ; nothing is stuck, leaked or refused."""
    for policy in POLICIES:
        empty = 0
        for seed in range(3):
            cfg = build("hisparse_tp2_shared_pool", seed, policy)
            cfg.groups = (cfg.groups[SPARSE], replace(cfg.groups[INDEXER], held_by_d=0.5))
            result = World(cfg).run(on_step=World.check_safety if policy == "kvhandoff"
                                    else None)
            m = result.metrics
            assert m["stuck"] == m["leaks"] == m["refused_events"] == m["lease_expiries"] == 0
            _frees_follow_every_split(result)
            freed = {(e["rid"], e["rank"]): e["t"] for e in events(result.p_log)
                     if e["type"] == "freed"}
            d = _by_stream(events(result.d_log))
            for (rid, d_rank), history in d.items():
                posted = next((e for e in history if e["type"] == "reads_posted"), None)
                if d_rank != 1 or posted is None or posted["split_groups"]:
                    continue
                assert posted["split_ranks"] == [1]
                assert _split_ends(history)[0]["t"] == posted["t"], "drained at once"
                empty += freed[(rid, 1)] < _split_ends(d[(rid, 0)])[0]["t"]
        assert empty, policy

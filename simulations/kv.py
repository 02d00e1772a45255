"""What P computes and D must receive: 64-bit KV tokens, unique per block.

P fills each block of each region with one token naming (request serial,
rank, region, block index), so D can check every byte it received against
what P computed.  Tokens carry a tag in their top bytes, so neither the
poison of a freed block nor zeroed memory can pass for KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_TAG = 0x4B56 << 48  # "KV"


def tokens(serial: int, rank: int, region: int, count: int) -> np.ndarray:
    base = _TAG | (serial << 20) | (rank << 17) | (region << 14)
    return np.arange(base, base + count, dtype=np.uint64)


def words(rows: np.ndarray) -> np.ndarray:
    """A region's ``(num_blocks, block_bytes)`` rows as 64-bit words (shared memory)."""
    return rows.view(np.uint64)


def write(rows64: np.ndarray, ids: Sequence[int], serial: int, rank: int, region: int) -> None:
    rows64[ids] = tokens(serial, rank, region, len(ids))[:, None]


def matches(rows64: np.ndarray, ids: Sequence[int], serial: int, rank: int, region: int) -> bool:
    return bool((rows64[ids] == tokens(serial, rank, region, len(ids))[:, None]).all())

"""Read planning: turn block-id lists into coalesced runs and READ splits.

Pure functions.  A run is a maximal stretch where both the remote and the
local block ids advance by one, so a READ posts one descriptor per run per
region instead of one per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhandoff.core.errors import GeometryMismatch


@dataclass(frozen=True, slots=True)
class BlockRun:
    """``count`` adjacent blocks: remote ``remote_start..`` → local ``local_start..``."""

    remote_start: int
    local_start: int
    count: int


def coalesce(remote_ids: Sequence[int], local_ids: Sequence[int]) -> tuple[BlockRun, ...]:
    """Pair remote and local block ids and merge adjacent pairs into runs."""
    if len(remote_ids) != len(local_ids):
        raise GeometryMismatch("block count", expected=len(remote_ids), found=len(local_ids))
    runs: list[BlockRun] = []
    start_r = start_l = prev_r = prev_l = -2
    count = 0
    for r, loc in zip(remote_ids, local_ids, strict=True):
        if count and r == prev_r + 1 and loc == prev_l + 1:
            count += 1
        else:
            if count:
                runs.append(BlockRun(start_r, start_l, count))
            start_r, start_l, count = r, loc, 1
        prev_r, prev_l = r, loc
    if count:
        runs.append(BlockRun(start_r, start_l, count))
    return tuple(runs)


def validate_block_ids(ids: Sequence[object], num_blocks: int, what: str) -> tuple[int, ...]:
    """Check that ``ids`` are distinct ints in ``[0, num_blocks)``; return them as a tuple."""
    out: list[int] = []
    seen: set[int] = set()
    for i, b in enumerate(ids):
        if type(b) is not int:
            raise GeometryMismatch(f"{what}[{i}] type", expected="int", found=type(b).__name__)
        if not 0 <= b < num_blocks:
            raise GeometryMismatch(f"{what}[{i}]", expected=f"0..{num_blocks - 1}", found=b)
        if b in seen:
            raise GeometryMismatch(f"{what}[{i}] (duplicate block)", expected="distinct ids", found=b)
        seen.add(b)
        out.append(b)
    return tuple(out)

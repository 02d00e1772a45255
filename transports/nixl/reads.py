"""Read planning for the NIXL transport: block runs to descriptor indices, per transfer.

Pure (numpy only).  A READ is a list of ``ReadSplit`` objects; `plan_reads`
turns it into ``ReadGroup`` objects, one per (split, local memory kind, remote memory kind),
each of which becomes one NIXL transfer (or one CUDA IPC gather): a NIXL
descriptor list has a single memory kind, and a split (say, a GPU tail) stays
one transfer.  Indices are built with numpy, never a Python object per block,
because a READ can name 10^5 blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.core.planning import BlockRun
from kvhandoff.transports.base import InvalidRead, MemoryKind, ReadSplit, RegionMismatch

__all__ = ["InvalidRead", "ReadSplit", "runs_array", "plan_reads"]  # the first two live in base


def runs_array(remote_ids: Sequence[int] | np.ndarray,
               local_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """`kvhandoff.core.planning.coalesce` in numpy: ``(n, 3)`` rows of maximal runs.

    Same result as ``coalesce`` (a run is a stretch where both ids advance by
    one), without a Python object per block: what a worker with 10^5 block
    ids per request uses.
    """
    r = np.asarray(remote_ids, dtype=np.int64).ravel()
    loc = np.asarray(local_ids, dtype=np.int64).ravel()
    if r.shape != loc.shape:
        raise InvalidRead(f"expected as many local as remote block ids, found "
                          f"{loc.size} local for {r.size} remote")
    if r.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(r) != 1) | (np.diff(loc) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [r.size])))
    return np.stack((r[starts], loc[starts], counts), axis=1)


@dataclass(frozen=True, slots=True)
class RegionAt:
    """A region as a READ needs it: descriptor-list index base and raw address."""

    kind: MemoryKind
    base: int  # index of its block 0 in its kind's descriptor list
    num_blocks: int
    block_bytes: int
    addr: int
    device: int
    stride: int = 0  # bytes from block b to b + 1 (0: block_bytes)
    pinned: bool = False  # CUDA-pinned host memory (a gather kernel can write it)

    @property
    def block_stride(self) -> int:
        return self.stride or self.block_bytes

    @property
    def nbytes(self) -> int:
        """The span from block 0's first byte to the last block's last byte."""
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes


@dataclass(slots=True)
class ReadGroup:
    """The part of one split that one transfer carries: same (local, remote) kinds."""

    lkind: MemoryKind
    rkind: MemoryKind
    pairs: list[tuple[RegionAt, RegionAt]]  # (remote, local)
    remote_blocks: np.ndarray
    local_blocks: np.ndarray
    descriptors: int  # one per block run and region pair
    bases: tuple[np.ndarray, np.ndarray] | None = None  # (local, remote) ``base`` per pair

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """NIXL descriptor indices (local, remote) for the whole group: pair by pair, each
        pair's blocks in order."""
        if self.bases is None:
            self.bases = _bases(self.pairs)
        local_bases, remote_bases = self.bases
        local = (local_bases[:, None] + self.local_blocks).ravel()
        remote = (remote_bases[:, None] + self.remote_blocks).ravel()
        return local.astype(np.int32), remote.astype(np.int32)


def _bases(pairs: Sequence[tuple[RegionAt, RegionAt]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([lo.base for _, lo in pairs], dtype=np.int64),
            np.array([r.base for r, _ in pairs], dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Pairing:
    """A split's region pairs once `plan_reads` checked them, by (local, remote) kind: what
    a READ naming the same pairs between the same two sides reuses (``pairings``)."""

    kinds: tuple[tuple[MemoryKind, MemoryKind, tuple[tuple[RegionAt, RegionAt], ...],
                       tuple[np.ndarray, np.ndarray]], ...]
    remote_blocks: int  # the fewest blocks of its remote regions
    local_blocks: int  # ... and of its local ones


PAIRINGS_MAX = 256  # pairings one ``pairings`` dict keeps (one per distinct region list)


def plan_reads(splits: Sequence[ReadSplit], remote_regions: Mapping[str, RegionAt],
               local_regions: Mapping[str, RegionAt], peer: str, me: str,
               pairings: dict[Any, Pairing] | None = None) -> list[ReadGroup]:
    """The transfers a READ needs: one per (split, local kind, remote kind).

    Refuses impossible READs (no runs, blocks outside a region, a region
    missing on either side, block sizes that differ) before anything is posted.
    ``pairings`` (the caller's, for these two region maps only) keeps each split's
    checked region pairs: a later split naming the same pairs is only checked for its
    blocks' range (anything else, or a range that fails, takes the full check).
    """
    groups: list[ReadGroup] = []
    for split in splits:
        small = _small_runs(split.runs)
        if small is not None:  # the same checks and blocks, without numpy's per-call cost
            n_runs, r_end, l_end, r_blocks, l_blocks = small
            if not n_runs or not split.regions:
                raise InvalidRead(f"{me}: a READ split needs block runs and regions")
        else:
            runs = _as_array(split.runs)
            if not len(runs) or not split.regions:
                raise InvalidRead(f"{me}: a READ split needs block runs and regions")
            rs, ls, cs = runs[:, 0], runs[:, 1], runs[:, 2]
            if (cs <= 0).any() or (rs < 0).any() or (ls < 0).any():
                raise InvalidRead(f"{me}: runs need count > 0 and starts >= 0")
            n_runs = len(cs)
            r_end, l_end = int((rs + cs).max()), int((ls + cs).max())
            r_blocks, l_blocks = _expand(rs, ls, cs)
        pairing = None
        if pairings is not None:
            try:
                pairing = pairings.get(split.regions)
            except TypeError:  # an unhashable region list: checked in full each time
                pairings = None
        if pairing is not None and r_end <= pairing.remote_blocks and l_end <= pairing.local_blocks:
            groups.extend(ReadGroup(lkind, rkind, list(pairs), r_blocks, l_blocks,
                                    n_runs * len(pairs), bases)
                          for lkind, rkind, pairs, bases in pairing.kinds)
            continue
        by_kind: dict[tuple[MemoryKind, MemoryKind], ReadGroup] = {}
        for remote_name, local_name in split.regions:
            remote = remote_regions.get(remote_name)
            local = local_regions.get(local_name)
            if remote is None:
                raise RegionMismatch(f"peer {peer!r} has no region {remote_name!r}")
            if local is None:
                raise RegionMismatch(f"{me} has no region {local_name!r}")
            if remote.block_bytes != local.block_bytes:
                raise RegionMismatch(f"{remote_name!r} -> {local_name!r}: block_bytes "
                                     f"{remote.block_bytes} on {peer}, "
                                     f"{local.block_bytes} here")
            if r_end > remote.num_blocks or l_end > local.num_blocks:
                raise InvalidRead(f"{remote_name!r} -> {local_name!r}: runs reach block "
                                  f"{max(r_end, l_end) - 1}, regions hold "
                                  f"{remote.num_blocks} remote / {local.num_blocks} local")
            # One transfer per split and kind pair: a NIXL descriptor list has one
            # memory kind, and a split (say, the GPU tail) stays one transfer.
            group = by_kind.get((local.kind, remote.kind))
            if group is None:
                group = by_kind[(local.kind, remote.kind)] = ReadGroup(
                    local.kind, remote.kind, [], r_blocks, l_blocks, 0)
            group.pairs.append((remote, local))
            group.descriptors += n_runs
        groups.extend(by_kind.values())
        if pairings is not None and len(pairings) < PAIRINGS_MAX:
            pairs_all = [pair for g in by_kind.values() for pair in g.pairs]
            for g in by_kind.values():  # (this READ's `indices` uses them too)
                g.bases = _bases(g.pairs)
            pairings[split.regions] = Pairing(
                tuple((g.lkind, g.rkind, tuple(g.pairs), g.bases) for g in by_kind.values()),
                min(r.num_blocks for r, _ in pairs_all), min(lo.num_blocks for _, lo in pairs_all))
    return groups


_SMALL_BLOCKS = 64  # at most this many blocks: Python ints beat numpy's per-call cost


def _small_runs(runs: tuple[BlockRun, ...] | np.ndarray
                ) -> tuple[int, int, int, np.ndarray, np.ndarray] | None:
    """(runs, remote end, local end, remote blocks, local blocks) of a short tuple of
    `BlockRun`, as `plan_reads`'s numpy path finds them; None for anything else (an array,
    more than ``_SMALL_BLOCKS`` blocks, a run that is not valid: the numpy path refuses it)."""
    if isinstance(runs, np.ndarray) or not runs or len(runs) > _SMALL_BLOCKS:
        return None
    r_blocks: list[int] = []
    l_blocks: list[int] = []
    r_end = l_end = 0
    for run in runs:
        r, loc, c = run.remote_start, run.local_start, run.count
        if (type(r) is not int or type(loc) is not int or type(c) is not int
                or c <= 0 or r < 0 or loc < 0 or len(r_blocks) + c > _SMALL_BLOCKS):
            return None
        r_blocks.extend(range(r, r + c))
        l_blocks.extend(range(loc, loc + c))
        r_end, l_end = max(r_end, r + c), max(l_end, loc + c)
    return (len(runs), r_end, l_end, np.array(r_blocks, dtype=np.int64),
            np.array(l_blocks, dtype=np.int64))


def _as_array(runs: tuple[BlockRun, ...] | np.ndarray) -> np.ndarray:
    if isinstance(runs, np.ndarray):
        if runs.ndim != 2 or runs.shape[1] != 3:
            raise InvalidRead(f"runs: expected an (n, 3) array, found shape {runs.shape}")
        return runs.astype(np.int64, copy=False)
    flat = np.fromiter((x for r in runs for x in (r.remote_start, r.local_start, r.count)),
                       dtype=np.int64, count=3 * len(runs))
    return flat.reshape(-1, 3)


def _expand(rs: np.ndarray, ls: np.ndarray, cs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block remote and local ids of runs ``(rs, ls, cs)``, in run order."""
    total = int(cs.sum())
    if total == len(cs):  # every run is one block (a shuffled READ): nothing to expand
        return rs, ls
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(cs) - cs, cs)
    return np.repeat(rs, cs) + within, np.repeat(ls, cs) + within

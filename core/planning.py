"""Read planning: turn block-id lists into coalesced runs and READ splits.

Pure functions.  A run is a maximal stretch where both the remote and the
local block ids advance by one, so a READ posts one descriptor per run per
region instead of one per block.  For hybrid models, `plan_group_reads`
decides per cache group (`core.groups`) which blocks a request reads: every
block of a full-attention group, the window's blocks of a sliding-window
group, the final slot of a state group; one `GroupRead` (a split keyed by
remote rank and group) each, none at all for a notify-only request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.groups import CacheGroup, CacheKind, CacheLayout, GroupMismatch, Memory, Reads
from kvhandoff.core.safelog import bounded_repr


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


# --- per-group reads (hybrid models) -------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadPart:
    """``runs`` over ``(remote region, local region)`` pairs: one `transports` ``ReadSplit``."""

    runs: tuple[BlockRun, ...]
    regions: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class GroupRead:
    """What one cache group of one request reads from one remote rank: one split.

    ``remote_ids`` / ``local_ids`` are the paired block ids (state kinds: the
    one slot), ``parts`` how they are posted (one part, or a host pool and a
    GPU tail, see `route_tail`).  ``prompt_bytes`` is what reading every
    block of the prompt would have cost, so a sliding window's saving shows.
    """

    rank: int
    group: int
    kind: CacheKind
    remote_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    parts: tuple[ReadPart, ...]
    nbytes: int
    prompt_bytes: int

    @property
    def key(self) -> tuple[int, int]:
        """The split's key in the lifecycle and the event log: (remote rank, group)."""
        return (self.rank, self.group)


@dataclass(frozen=True, slots=True)
class GroupReadPlan:
    """Every group's read of one request from one remote rank; empty = notify-only."""

    rank: int
    reads: tuple[GroupRead, ...]
    skipped: tuple[int, ...]  # groups with nothing to read (D holds it already)

    @property
    def notify_only(self) -> bool:
        return not self.reads

    @property
    def keys(self) -> tuple[tuple[int, int], ...]:
        return tuple(r.key for r in self.reads)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


def blocks_needed(group: CacheGroup, num_tokens: int) -> int:
    """How many trailing block positions of ``group`` a request of ``num_tokens`` reads.

    Full attention and indexer: every block holding a prompt token.  Sliding
    window: the blocks holding the ``window - 1`` tokens the next token
    attends to besides itself, i.e. positions ``(num_tokens - window + 1) //
    block_size`` to the last: exactly the blocks vLLM's window manager keeps
    (``SlidingWindowManager.get_num_skipped_tokens``); P nulls the ones
    before, so reading one more would read vLLM's null block.  Slot kinds
    (Mamba / GDN / PLE state, a key ring): the one slot the request ends with.
    """
    if num_tokens <= 0:
        return 0
    reads = group.kind.reads
    if reads is Reads.SLOT:
        return 1
    total = -(-num_tokens // group.block_size)
    if reads is Reads.WINDOW:
        return total - max(0, num_tokens - group.window + 1) // group.block_size
    return total


def prefill_backoff(layout: CacheLayout) -> int:
    """Prompt tokens P leaves to D: 1 when any group does not read the whole prompt, else 0
    (more with a multi-module MTP drafter).

    P's sliding-window and state groups keep what the *next* token needs
    once a prompt's tokens are computed: the blocks of the window it attends
    to, the state after the last token.  D must compute the prompt's last
    token itself (its logits start the decode), and that token needs one
    token more than P kept (the window one token further back; the state
    before that token).  So P prefills all but the last prompt token and D
    loads those and computes the last one, as vLLM's NixlConnector does for
    state models (``_prefill_backoff``).  Full attention keeps every block:
    D loads the whole prompt and recomputes its last token.

    A drafter that reads past the computed range (``prefill_lookahead``, vLLM's
    ``num_prefill_lookahead_tokens``: a multi-module MTP chain) leaves all but one
    of those tokens to D as well, as NixlConnector does: P would otherwise write
    unverified drafts into the MTP layers' cache, which D never rebuilds.
    """
    windowed = 1 if any(g.kind.reads is not Reads.PROMPT for g in layout.groups) else 0
    return max(windowed, layout.prefill_lookahead - 1)


def tokens_prefilled(layout: CacheLayout, num_prompt_tokens: int) -> int:
    """How many of a prompt's tokens P prefills and hands over (``remote_num_tokens``): all
    but `prefill_backoff`'s (all of a prompt no longer than that)."""
    backoff = prefill_backoff(layout)
    return num_prompt_tokens - backoff if num_prompt_tokens > backoff else num_prompt_tokens


def tokens_loaded(layout: CacheLayout, num_prompt_tokens: int) -> int:
    """How many of a prompt's tokens D loads from P: what P prefilled (`tokens_prefilled`).

    But P prefills a prompt no longer than the backoff whole, and D then recomputes its
    last token over what it loaded: attention's pages are written again with the same
    keys, but a state group would take that token twice (the state P hands over already
    holds it), so with one D loads nothing and computes the prompt itself (vLLM's
    NixlConnector loads it: a wrong state once a multi-module MTP drafter makes the
    backoff 2 or more)."""
    if (num_prompt_tokens <= prefill_backoff(layout)
            and any(g.kind.reads_state for g in layout.groups)):
        return 0
    return tokens_prefilled(layout, num_prompt_tokens)


def export_ids(layout: CacheLayout, block_ids: Sequence[Sequence[int]],
               num_tokens: int) -> tuple[tuple[int, ...], ...]:
    """P's block ids, one tuple per group, clipped to what a reader of ``num_tokens`` needs.

    What `plan_group_reads` reads when D holds nothing yet: every block of a
    full-attention group, the window's blocks of a sliding group (never the
    null blocks before it), the running state's slot of a state group.
    Positions past the ``num_tokens``' blocks (allocated for tokens not
    computed yet) are not P's to hand over.  A list too short is a
    `GroupMismatch` naming the group.
    """
    if len(block_ids) != len(layout.groups):
        raise GroupMismatch(None, "block id lists", len(layout.groups), len(block_ids))
    out = []
    for g, ids in zip(layout.groups, block_ids, strict=True):
        if not g.kind.reads_state:
            ids = ids[:-(-num_tokens // g.block_size)]
            if len(ids) < blocks_needed(g, num_tokens):
                raise GroupMismatch(g.index, "block ids", f"at least "
                                    f"{blocks_needed(g, num_tokens)} for {num_tokens} tokens",
                                    len(ids))
        out.append(tuple(_read_positions(g, ids, ids, num_tokens)[0]))
    return tuple(out)


def export_lengths(layout: CacheLayout, num_tokens: int) -> tuple[int, ...]:
    """How many block ids `export_ids` gives each group for a request of ``num_tokens``."""
    return tuple(1 if g.kind.reads_state else blocks_needed(g, num_tokens) for g in layout.groups)


def plan_group_reads(remote: CacheLayout, local: CacheLayout,
                     remote_ids: Sequence[Sequence[int]], local_ids: Sequence[Sequence[int]],
                     num_tokens: int, rank: int = 0,
                     null_block: int | None = None, local_rank: int = 0) -> GroupReadPlan:
    """D's reads of one request from remote rank ``rank``, one per group that needs any.

    ``remote_ids`` / ``local_ids`` hold one list per group, as vLLM's block
    tables do: position *i* of a block group's list covers tokens ``[i *
    block_size, (i + 1) * block_size)`` of the ``num_tokens`` P computed, and
    lists are aligned at their ends (D's list may be shorter: the blocks D
    holds already, from its own prefix cache, are not in it; P's may be
    clipped to what is read).  A state group's list is its slots, the
    running state followed by ``spec_slots`` scratch slots.  Block ids are
    checked against each side's pool; two groups that share a region must
    not write one local block.  ``null_block`` (vLLM's block 0, the
    placeholder its sliding-window and Mamba managers put where a group holds
    nothing) may stand in the positions a group does not read, never in one
    it reads.  A host pool shared by the local TP ranks (``local.shared_host_pool``,
    vLLM's HiSparse on D) is read by local rank 0 alone, for every rank: another
    ``local_rank`` skips the groups in it, as it skips a group it holds already.
    Errors are `GroupMismatch` naming the group.
    """
    groups = local.groups
    if len(remote.groups) != len(groups):  # the handshake's check_matches refuses this first
        raise GroupMismatch(None, "number of groups", len(groups), len(remote.groups))
    for what, ids in (("remote block id lists", remote_ids), ("local block id lists", local_ids)):
        if len(ids) != len(groups):
            raise GroupMismatch(None, what, len(groups), len(ids))
    reads: list[GroupRead] = []
    skipped: list[int] = []
    written: dict[str, dict[int, int]] = {}  # local region -> block -> group writing it
    for g, peer_g in zip(groups, remote.groups, strict=True):
        r_ids, l_ids = _read_positions(g, remote_ids[g.index], local_ids[g.index], num_tokens)
        if not l_ids or (local_rank and local.shared_host_pool and in_host_pool(g)):
            skipped.append(g.index)
            continue
        r_ids = _checked_ids(g.index, "remote block ids", r_ids, peer_g.num_blocks, null_block)
        l_ids = _checked_ids(g.index, "local block ids", l_ids, g.num_blocks, null_block)
        for region in g.regions:
            mine = written.setdefault(region.name, {})
            for b in l_ids:
                other = mine.setdefault(b, g.index)
                if other != g.index:
                    raise GroupMismatch(g.index, f"local block ids (region {bounded_repr(region.name)})",
                                        f"blocks group {other} does not write", b)
        pairs = tuple((r.name, r.name) for r in g.regions)
        full = 1 if g.kind.reads_state else -(-num_tokens // g.block_size)
        reads.append(GroupRead(rank, g.index, g.kind, r_ids, l_ids,
                               (ReadPart(coalesce(r_ids, l_ids), pairs),),
                               len(l_ids) * g.block_bytes, full * g.block_bytes))
    return GroupReadPlan(rank, tuple(reads), tuple(skipped))


def in_host_pool(group: CacheGroup) -> bool:
    """Whether ``group``'s blocks live in a host pool (HiSparse's source group on D)."""
    return all(r.memory is Memory.HOST for r in group.regions)


def _read_positions(g: CacheGroup, remote: Sequence[int], local: Sequence[int],
                    num_tokens: int) -> tuple[Sequence[int], Sequence[int]]:
    if g.kind.reads_state:
        if not local:
            return (), ()
        if not remote:
            raise GroupMismatch(g.index, "remote block ids", "the state slot", "none")
        return _state_slot(remote, g.spec_slots), _state_slot(local, g.spec_slots)
    total = -(-num_tokens // g.block_size)
    for what, ids in (("remote block ids", remote), ("local block ids", local)):
        if len(ids) > total:
            raise GroupMismatch(g.index, what, f"at most {total} (num_tokens {num_tokens}, "
                                f"block_size {g.block_size})", len(ids))
    k = min(blocks_needed(g, num_tokens), len(local))
    if not k:
        return (), ()
    if len(remote) < k:
        raise GroupMismatch(g.index, "remote block ids", f"at least {k} to read", len(remote))
    return remote[len(remote) - k:], local[len(local) - k:]


def _state_slot(slots: Sequence[int], spec_slots: int) -> Sequence[int]:
    """The running state's slot: drop the trailing scratch slots, keep the last one left."""
    scratch = min(spec_slots, len(slots) - 1)
    return slots[len(slots) - scratch - 1:len(slots) - scratch]


def _checked_ids(group: int, what: str, ids: Sequence[object], num_blocks: int,
                 null_block: int | None) -> tuple[int, ...]:
    try:
        out = validate_block_ids(ids, num_blocks, what)
    except GeometryMismatch as exc:
        raise GroupMismatch(group, exc.what, exc.expected, exc.found) from None
    if null_block is not None and null_block in out:
        raise GroupMismatch(group, f"{what}[{out.index(null_block)}] (the null block)",
                            "a block that holds this request's cache", null_block)
    return out


def route_tail(read: GroupRead, tail_ids: Sequence[int], pool: str = "@pool",
               tail: str = "@tail") -> GroupRead:
    """``read`` with its last ``len(tail_ids)`` blocks into ``<region><tail>`` at slots
    ``tail_ids``, the rest into ``<region><pool>`` at ``read.local_ids``: a hierarchical
    sparse cache keeps history in a host pool and the writable tail on the GPU, each
    with its own slots (the same id may name a pool block and a tail slot).  Still one
    split: one handle, one completion.  ``tail_ids`` longer than the read, repeated or
    negative are a `GroupMismatch` naming the group.
    """
    n = len(read.local_ids)
    if len(tail_ids) > n:
        raise GroupMismatch(read.group, "tail ids", f"at most {n} (the blocks read)", len(tail_ids))
    try:
        tail_ids = validate_block_ids(tail_ids, 1 << 62, "tail ids")
    except GeometryMismatch as exc:
        raise GroupMismatch(read.group, exc.what, exc.expected, exc.found) from None
    cut = n - len(tail_ids)
    parts = []
    for remote_ids, local_ids, suffix in ((read.remote_ids[:cut], read.local_ids[:cut], pool),
                                          (read.remote_ids[cut:], tail_ids, tail)):
        if local_ids:
            regions = tuple((remote, local + suffix) for remote, local in read.parts[0].regions)
            parts.append(ReadPart(coalesce(remote_ids, local_ids), regions))
    return replace(read, parts=tuple(parts))

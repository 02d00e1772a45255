"""What one simulated run is made of: `RunConfig`, drawn per seed by a scenario.

Times are seconds of simulated time.  The defaults describe a healthy
deployment shaped like vLLM's NIXL connector (its defaults): a 30 s lease,
heartbeats every lease / 6, engine steps of a few milliseconds, READs of a
few KV blocks over a fast fabric.  A scenario changes only what it is about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.core.groups import CacheKind
from kvhandoff.core.policy import TimingConfig
from kvhandoff.transports.sim import LinkModel, NotifFaults, ReadFaults

POLICIES = ("kvhandoff", "vllm-0.32")

# Where in a request's life a client may cancel it.
PHASES = ("arrival", "exported", "admitted", "reads_posted", "finished")


@dataclass(slots=True)
class CancelPlan:
    """With probability ``rate`` a client cancels ``delay_s`` after reaching a phase.

    Each cancelling client picks one of ``phases`` at random.
    """

    rate: float = 0.0
    phases: tuple[str, ...] = ("arrival",)
    delay_s: tuple[float, float] = (0.0, 0.1)


@dataclass(frozen=True, slots=True)
class SimGroup:
    """One cache group of a hybrid model (`core.groups.CacheGroup`), as a run draws it.

    Every group is overlaid on the same regions and draws its block ids from
    the engine's one block pool, as vLLM's hybrid allocator does; what a
    request of ``n`` tokens holds and reads of it is `core.planning`'s
    business (`blocks_needed`).  ``read_faults`` replaces the run's READ
    faults for this group's splits (a slow state group); ``held_by_d`` is
    the share of requests whose blocks of this group D holds already, so the
    group needs no read (no split for it).  ``tokens_per_state`` (compressed
    keys: the compress ratio) and ``tp_replicated`` (the PLE state: every TP
    rank holds the whole state, `kv.copy_rank`) go to the `CacheGroup` as they
    are; ``owner`` labels the group (``main_kv``, ``ring``, ``gdn``...).
    ``host_pool``: D keeps this group in its host pool (vLLM's HiSparse source group:
    its regions are `Memory.HOST` in D's layout; P's layout keeps it on the device).
    """

    kind: CacheKind
    block_size: int = 16  # tokens per block (a key ring: its capacity)
    window: int = 0  # tokens (SLIDING_WINDOW only)
    read_faults: ReadFaults | None = None
    held_by_d: float = 0.0
    tokens_per_state: int = 1
    tp_replicated: bool = False
    owner: str = ""
    host_pool: bool = False


@dataclass(slots=True)
class RunConfig:
    scenario: str
    seed: int
    policy: str = "kvhandoff"

    # topology and sizes
    tp: int = 1  # P's tensor-parallel size
    d_tp: int | None = None  # D's (None: same as P). D rank d reads P rank d // (d_tp / tp)
    requests: int = 12
    inter_arrival_s: float = 0.004  # mean, exponential
    blocks_per_request: tuple[int, int] = (1, 8)
    p_blocks: int = 96
    d_blocks: int = 96
    block_bytes: int = 64  # a multiple of 8: blocks hold 64-bit KV tokens
    regions: int = 2  # K and V of one layer group
    # Cache groups of a hybrid model; empty: one KV group of ``blocks_per_request``
    # blocks (every scenario before hybrid models, and still the default).  With
    # groups a request is ``tokens_per_request`` tokens and one READ per (rank, group).
    groups: tuple[SimGroup, ...] = ()
    tokens_per_request: tuple[int, int] = (1, 128)
    # D's local ranks share one host pool (vLLM's ``hisparse_shared_host_pool``): D rank 0
    # reads the ``host_pool`` groups for every rank, the other ranks read only the rest.
    shared_host_pool: bool = False

    # lifecycle timing
    # (`core.policy.TimingConfig`, by the same names: see ``timing``)
    lease_s: float = 30.0
    heartbeat_interval_s: float = 5.0  # lease / 6, as vLLM
    lease_margin_s: float = 0.5  # D's safety margin on P's reported time left
    # READs, or P's proof of them, still missing this long after posting: give up (fail).
    # Three leases: the slow-fabric scenarios read for up to 2.5 leases while P answers.
    read_timeout_s: float = 90.0
    # P's fence slots per rank (`core.fence`; the kvhandoff policy).  An export finding
    # every slot live has no fence: D asks P instead.
    fence_slots: int = 512

    # engine loops
    p_step_s: float = 0.004
    p_stall: float = 0.0  # probability that a P step stalls
    p_stall_s: tuple[float, float] = (0.0, 0.0)
    d_step_s: float = 0.002
    step_jitter: float = 0.5  # a step lasts step_s * (1 + jitter * U(0, 1))
    stall: float = 0.0  # probability that a step stalls (GC pause, long forward pass)
    stall_s: tuple[float, float] = (0.0, 0.0)
    prefill_s_per_block: float = 0.001
    proxy_delay_s: tuple[float, float] = (0.0005, 0.003)  # P's params to D, through the proxy
    # P's worker folds an export at P's next engine step, after its scheduler handed out the
    # parameters (vLLM: ``request_finished`` answers in one step, the worker's
    # ``start_load_kv`` sees the export in the next).  False: in the same step.
    export_next_step: bool = False

    # clients and requests
    cancel: CancelPlan = field(default_factory=CancelPlan)
    invalid_geometry: float = 0.0  # share of requests whose transfer params are malformed
    prefix_hit: float = 0.0  # share of requests D already holds entirely (notify-only)

    # the fabric and its faults
    link: LinkModel = field(default_factory=lambda: LinkModel(read_timeout_s=120.0))
    notif_faults: dict[str | None, NotifFaults] = field(default_factory=dict)  # by message kind
    read_faults: ReadFaults = field(default_factory=ReadFaults)
    partitions: list[tuple[float, float]] = field(default_factory=list)  # (start, duration), P<->D
    crash_p_at: float | None = None
    crash_d_at: float | None = None
    wrong_peer_releases: float = 0.0  # share of requests a stray decode engine "releases"
    impersonation: float = 0.0  # share of admitted requests an impostor releases as the consumer
    forged_acks: float = 0.0  # share of requests an impostor "acknowledges" to D as P would
    retries: float = 0.0  # share of finished requests a client retries at a second D engine

    # what the scenario is allowed to show under policy kvhandoff
    exceeds_lease: bool = False  # faults longer than the lease: freed_under_read may be > 0

    @property
    def timing(self) -> TimingConfig:
        return TimingConfig(self.lease_s, self.heartbeat_interval_s, self.lease_margin_s,
                            self.read_timeout_s)

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def decode_tp(self) -> int:
        return self.d_tp or self.tp

    @property
    def heads_per_p_rank(self) -> int:
        """How many D ranks read each P rank (each reads its own head group)."""
        return self.decode_tp // self.tp

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if not 1 <= self.tp <= 4:
            raise ValueError(f"tp {self.tp}: expected 1..4")
        if not 1 <= self.decode_tp <= 4 or self.decode_tp % self.tp:
            raise ValueError(f"d_tp {self.d_tp}: expected a multiple of tp {self.tp}, at most 4")
        if self.block_bytes % 8:
            raise ValueError(f"block_bytes {self.block_bytes}: expected a multiple of 8")
        if self.groups:
            if self.invalid_geometry:
                raise ValueError("invalid_geometry corrupts one flat block list: not with groups")
            if self.tokens_per_request[0] < 1:
                raise ValueError(f"tokens_per_request {self.tokens_per_request}: expected >= 1")
            for g in self.groups:
                if (g.kind is CacheKind.SLIDING_WINDOW) != (g.window > 0):
                    raise ValueError(f"group {g}: a window exactly for sliding_window")
                if g.tp_replicated and not g.kind.reads_state:
                    raise ValueError(f"group {g}: tp_replicated only for a state (slot) kind")
        if self.shared_host_pool and not any(g.host_pool for g in self.groups):
            raise ValueError("shared_host_pool: expected a group in the host pool")
        for phase in self.cancel.phases:
            if phase not in PHASES:
                raise ValueError(f"cancel phase {phase!r}: expected one of {PHASES}")

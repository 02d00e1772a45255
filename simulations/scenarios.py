"""The scenario catalogue: each name reproduces one race of the P/D hand-off.

A scenario turns a seed into a `RunConfig`: it starts from a healthy
deployment and changes only what it is about, drawing its own parameters
(tensor parallelism, sizes, fault rates, timings) from the seed.  `swarm`
draws every fault at once, with rates drawn per seed.

``exceeds_lease`` marks the runs whose faults are longer than any lease can
cover (a partition longer than the lease, a request that reaches D after its
lease ran out): there P may legitimately free blocks under a READ, and the
only promise left is the one that matters, that D never serves those bytes.

The ``hybrid_*`` scenarios run a hybrid model (docs/hybrid.md): every
request is a full-attention group, a sliding-window group and a Mamba state
group, one READ per (rank, group) that needs a read.  The ``qwen4_*``
scenarios run the seed model's five cache owners (`_qwen4`: QSA main KV,
compressed keys, key ring, GDN state, the TP-replicated PLE state).  The
``hisparse_*`` scenarios run a DSA model with HiSparse on D (`_hisparse`: the
sparse MLA KV in D's host pool, the indexer on its GPU; one host-pool split and
one indexer split per D rank, or, with the pool shared by D's ranks, the host
split on D rank 0 alone).

docs/simulation.md describes each scenario; keep the two in step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from kvhandoff.core.groups import CacheKind
from kvhandoff.simulations.config import CancelPlan, RunConfig, SimGroup
from kvhandoff.transports.sim import NotifFaults, ReadFaults, sub_seed

Builder = Callable[[RunConfig, random.Random], None]
SCENARIOS: dict[str, tuple[str, Builder]] = {}


def scenario(name: str, what: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        SCENARIOS[name] = (what, fn)
        return fn
    return register


def build(name: str, seed: int, policy: str = "kvhandoff") -> RunConfig:
    """The run that scenario ``name`` draws from ``seed``."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    rng = random.Random(sub_seed(seed, f"scenario/{name}"))
    cfg = RunConfig(scenario=name, seed=seed, policy=policy)
    cfg.tp = rng.choice((1, 1, 2, 4))
    cfg.requests = rng.randint(8, 16)
    SCENARIOS[name][1](cfg, rng)
    cfg.validate()
    return cfg


def names() -> list[str]:
    return list(SCENARIOS)


def _slow_reads(cfg: RunConfig, share: float, lo: float = 1.2, hi: float = 2.5) -> None:
    """Some READs take longer than the lease (congestion, a straggling NIC)."""
    cfg.read_faults = ReadFaults(fail=cfg.read_faults.fail, slow=share,
                                 slow_s=(lo * cfg.lease_s, hi * cfg.lease_s))


def _silence_before(cfg: RunConfig) -> float:
    """How long P may already have gone without a heartbeat when a partition starts.

    One heartbeat period, plus the periods the drop faults may swallow, plus
    the longest engine stall and notification delay: a partition that, added
    to this, outlasts the lease exceeds what a lease can cover.
    """
    hb = cfg.notif_faults.get("hb")
    lost = (hb.max_consecutive_drops or 0) if hb is not None and hb.drop else 0
    delayed = hb.delay_s if hb is not None and hb.delay else 0.0
    stall = cfg.stall_s[1] if cfg.stall else 0.0
    return cfg.heartbeat_interval_s * (1 + lost) + stall + delayed


# --- the catalogue ----------------------------------------------------------------


@scenario("steady_state", "healthy traffic, a few cancellations anywhere: the baseline")
def _steady(cfg: RunConfig, rng: random.Random) -> None:
    cfg.cancel = CancelPlan(0.1, ("arrival", "exported", "admitted", "reads_posted", "finished"),
                            (0.0, 0.02))


@scenario("cancel_during_read",
          "the client cancels while READs that outlast the lease are in flight "
          "(vLLM 0.32 stops heartbeating: P frees under the READ)")
def _cancel_during_read(cfg: RunConfig, rng: random.Random) -> None:
    _slow_reads(cfg, share=rng.uniform(0.5, 1.0))
    cfg.cancel = CancelPlan(rng.uniform(0.4, 0.9), ("reads_posted",), (0.001, 0.3 * cfg.lease_s))


@scenario("cancel_before_read",
          "the client cancels before any READ was posted: at P, in the proxy, or while D "
          "waits for pages (notify-only release, or the orphaned lease expires)")
def _cancel_before_read(cfg: RunConfig, rng: random.Random) -> None:
    cfg.d_blocks = rng.randint(8, 24)  # pages are scarce: imports wait in VALIDATED
    cfg.cancel = CancelPlan(rng.uniform(0.3, 0.8), ("arrival", "exported", "admitted"),
                            (0.0, 0.02))


@scenario("reject_invalid_geometry",
          "malformed transfer parameters (out-of-range, negative, duplicate, mistyped block "
          "ids, wrong count): D rejects and releases notify-only; P frees at once")
def _reject(cfg: RunConfig, rng: random.Random) -> None:
    cfg.invalid_geometry = rng.uniform(0.3, 0.8)


@scenario("full_prefix_hit_notify_only",
          "D already holds the whole prefix: nothing to read, a notify-only release frees P")
def _prefix_hit(cfg: RunConfig, rng: random.Random) -> None:
    cfg.prefix_hit = rng.uniform(0.3, 1.0)


@scenario("release_overtakes_export",
          "P's worker folds an export an engine step after its scheduler handed out the "
          "parameters, and P's steps run long: D's release (nothing to read, a cancel at "
          "admission) reaches P first; P must free at the release, not a lease later")
def _release_overtakes_export(cfg: RunConfig, rng: random.Random) -> None:
    cfg.export_next_step = True
    cfg.p_step_s = rng.uniform(0.02, 0.05)  # a long prefill step
    cfg.prefix_hit = rng.uniform(0.3, 0.8)
    cfg.cancel = CancelPlan(rng.uniform(0.2, 0.5), ("admitted",), (0.0, 0.002))


@scenario("lease_expiry_boundary",
          "the proxy hands requests to D around the moment their lease ends; some arrive "
          "after it (D must refuse what it reads then)")
def _boundary(cfg: RunConfig, rng: random.Random) -> None:
    cfg.lease_s, cfg.heartbeat_interval_s, cfg.lease_margin_s = 2.0, 2.0 / 6, 0.1
    cfg.read_timeout_s = 1.0
    cfg.proxy_delay_s = (0.8 * cfg.lease_s, 1.2 * cfg.lease_s)
    cfg.exceeds_lease = True


@scenario("heartbeat_loss_tolerated",
          "up to two heartbeats in a row (and acknowledgements) are lost while long READs run: "
          "the lease must survive")
def _hb_loss(cfg: RunConfig, rng: random.Random) -> None:
    drop = rng.uniform(0.2, 0.6)
    cfg.notif_faults = {
        "hb": NotifFaults(drop=drop, max_consecutive_drops=2),
        "ack": NotifFaults(drop=drop, max_consecutive_drops=2),
    }
    _slow_reads(cfg, share=0.5)
    cfg.cancel = CancelPlan(0.3, ("reads_posted",), (0.001, 10.0))


@scenario("acknowledgements_lost",
          "every acknowledgement P sends is lost: D proves its drained READs by reading P's "
          "fence, without P's word (without the fence every request fails unproven)")
def _acks_lost(cfg: RunConfig, rng: random.Random) -> None:
    cfg.notif_faults = {"ack": NotifFaults(drop=1.0)}
    _slow_reads(cfg, share=0.3, lo=0.01, hi=0.2)
    cfg.read_timeout_s = 2 * cfg.lease_s  # an unproven request fails within the run


@scenario("notification_sends_refused",
          "D's and P's send_notif fails now and then, up to twice in a row per link and kind "
          "(NIXL's raises on an endpoint error), while long READs run: a refused heartbeat "
          "goes at D's next poll, a refused release again a quarter period later; leases "
          "hold and P frees on the release, never by expiry")
def _sends_refused(cfg: RunConfig, rng: random.Random) -> None:
    faults = NotifFaults(refuse=rng.uniform(0.2, 0.6), max_consecutive_drops=2)
    cfg.notif_faults = {"hb": faults, "rel": faults, "ack": faults}
    _slow_reads(cfg, share=0.5)
    cfg.cancel = CancelPlan(0.3, ("reads_posted",), (0.001, 10.0))


@scenario("fence_slots_exhausted",
          "P has two fence slots for many live requests: most exports find none free and "
          "have no fence, so D asks P for them; a slot goes to another export once freed")
def _fence_slots_exhausted(cfg: RunConfig, rng: random.Random) -> None:
    cfg.fence_slots = 2
    cfg.requests = rng.randint(16, 32)
    _slow_reads(cfg, share=0.5, lo=0.01, hi=0.2)


@scenario("partition_beyond_lease",
          "P and D are cut off for longer than the lease while READs are in flight: P "
          "expires and reuses the blocks; D must fail those requests, not serve them")
def _partition(cfg: RunConfig, rng: random.Random) -> None:
    _slow_reads(cfg, share=0.3, lo=0.01, hi=0.2)
    start = rng.uniform(0.0, 0.05)
    cfg.partitions = [(start, rng.uniform(1.2, 2.0) * cfg.lease_s)]
    cfg.exceeds_lease = True


@scenario("p_crash_mid_read", "P dies while READs are in flight: D fails them and finishes")
def _p_crash(cfg: RunConfig, rng: random.Random) -> None:
    _slow_reads(cfg, share=0.5, lo=0.01, hi=0.5)
    cfg.crash_p_at = rng.uniform(0.005, 0.06)


@scenario("d_crash_mid_read",
          "D dies while READs are in flight: P frees every lease once it runs out")
def _d_crash(cfg: RunConfig, rng: random.Random) -> None:
    _slow_reads(cfg, share=0.5, lo=0.01, hi=0.5)
    cfg.crash_d_at = rng.uniform(0.005, 0.06)


@scenario("duplicate_release_notification",
          "release notifications arrive twice (and out of order): P frees once, counts the rest")
def _dup_release(cfg: RunConfig, rng: random.Random) -> None:
    cfg.notif_faults = {"rel": NotifFaults(duplicate=rng.uniform(0.5, 1.0), reorder=0.5)}
    cfg.invalid_geometry = 0.1
    cfg.cancel = CancelPlan(0.2, ("admitted", "reads_posted"), (0.0, 0.01))


@scenario("stale_release_after_expiry",
          "a release is delayed past the lease; P expired the lease meanwhile and must "
          "ignore it")
def _stale_release(cfg: RunConfig, rng: random.Random) -> None:
    cfg.notif_faults = {"rel": NotifFaults(delay=rng.uniform(0.3, 1.0), delay_s=2.0 * cfg.lease_s)}


@scenario("release_from_wrong_peer",
          "a decode engine that is not the consumer sends releases for live requests: P "
          "must not free on them")
def _wrong_peer(cfg: RunConfig, rng: random.Random) -> None:
    cfg.wrong_peer_releases = rng.uniform(0.3, 1.0)
    _slow_reads(cfg, share=0.3, lo=0.01, hi=0.1)


@scenario("impersonated_consumer",
          "an impostor that learned the transfer parameters sends releases and heartbeats "
          "naming the consumer engine, its D ranks and its token: P must tell the transport "
          "peer apart and not free under the consumer's READs")
def _impersonation(cfg: RunConfig, rng: random.Random) -> None:
    cfg.impersonation = rng.uniform(0.3, 1.0)
    _slow_reads(cfg, share=0.5, lo=0.01, hi=0.2)


@scenario("forged_acknowledgement",
          "an impostor sends D acknowledgements naming P's engine and the rank each D rank "
          "reads (\"alive for a lease\") while P's own answers are being lost: D must take a "
          "lease answer only from the P rank a request reads, and never serve on a forged one")
def _forged_ack(cfg: RunConfig, rng: random.Random) -> None:
    cfg.fence_slots = 0  # P registered no fence: D's only proof is an answer from P
    cfg.forged_acks = rng.uniform(0.5, 1.0)
    cfg.notif_faults = {"ack": NotifFaults(drop=rng.uniform(0.5, 0.8), max_consecutive_drops=4)}
    _slow_reads(cfg, share=0.3, lo=0.01, hi=0.1)


@scenario("late_acknowledgements",
          "P's answers arrive late (most of a lease) while heartbeats are being lost and READs "
          "run about a lease, with no fence: D must bound P's lease from when it asked, not "
          "from when the answer came, and never serve what P freed meanwhile")
def _late_acks(cfg: RunConfig, rng: random.Random) -> None:
    cfg.fence_slots = 0  # P's answers are D's only proof
    cfg.notif_faults = {"ack": NotifFaults(delay=1.0, delay_s=rng.uniform(0.3, 0.8) * cfg.lease_s),
                        "hb": NotifFaults(drop=rng.uniform(0.85, 0.95))}
    _slow_reads(cfg, share=0.8, lo=0.8, hi=1.5)
    cfg.exceeds_lease = True  # heartbeats lost without bound: P may expire under a READ


@scenario("retry_after_release",
          "the client retries a finished request at a second decode engine with the same "
          "transfer parameters: that reader READs blocks P released (and may reuse) and must "
          "never serve them")
def _retry_after_release(cfg: RunConfig, rng: random.Random) -> None:
    cfg.retries = rng.uniform(0.3, 1.0)
    _slow_reads(cfg, share=0.3, lo=0.001, hi=0.1)
    # P may free (reuse) blocks under the second reader's READs: they are no
    # longer its to read; what matters is that it never serves them.
    cfg.exceeds_lease = True


@scenario("cancel_during_read_realistic",
          "the client cancels while READs of realistic length are in flight (1 ms to 0.75 s: "
          "786 KB to 1 GiB at the NIXL rates in docs/benchmarks.md): how often the vLLM 0.32 "
          "cancel gap bites when reads are not forced to outlast the lease")
def _cancel_realistic(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=1.0, slow_s=(0.001, 0.75))
    cfg.cancel = CancelPlan(rng.uniform(0.4, 0.9), ("reads_posted",), (0.0, 0.5))


@scenario("tp2_split_reads",
          "TP=2: every request is two rank-local READ splits that complete independently")
def _tp2(cfg: RunConfig, rng: random.Random) -> None:
    cfg.tp = 2
    _slow_reads(cfg, share=0.3, lo=0.001, hi=0.05)
    cfg.cancel = CancelPlan(0.2, ("reads_posted",), (0.0, 0.02))


@scenario("tp_ratio_split_reads",
          "D has more TP ranks than P (1→2, 1→4, 2→4): each D rank READs its head group from "
          "the P rank that holds it; P frees only after every D rank reading it released")
def _tp_ratio(cfg: RunConfig, rng: random.Random) -> None:
    cfg.tp, cfg.d_tp = rng.choice(((1, 2), (1, 4), (2, 4)))
    _slow_reads(cfg, share=0.3, lo=0.001, hi=1.5)
    cfg.read_faults.fail = rng.uniform(0.0, 0.1)
    cfg.cancel = CancelPlan(0.3, ("admitted", "reads_posted"), (0.0, 0.3 * cfg.lease_s))


@scenario("split_failure_drains_others",
          "one split fails while the others are still in flight: the request fails, its "
          "pages and P's blocks stay held until every split drained")
def _split_failure(cfg: RunConfig, rng: random.Random) -> None:
    cfg.tp = rng.choice((2, 4))
    cfg.read_faults = ReadFaults(fail=rng.uniform(0.2, 0.5), slow=0.5,
                                 slow_s=(0.01, 0.5 * cfg.lease_s))


@scenario("slow_engine_loop",
          "D's (and P's) engine loop stalls for seconds at a time (GC, long forward passes): "
          "heartbeats go out late but within the lease")
def _slow_loop(cfg: RunConfig, rng: random.Random) -> None:
    cfg.stall, cfg.stall_s = rng.uniform(0.05, 0.3), (0.5, 2.0 * cfg.heartbeat_interval_s)
    cfg.p_stall, cfg.p_stall_s = rng.uniform(0.0, 0.2), (0.5, 2.0 * cfg.heartbeat_interval_s)
    _slow_reads(cfg, share=0.4)
    cfg.cancel = CancelPlan(0.3, ("reads_posted", "admitted"), (0.0, 5.0))


@scenario("swarm", "every fault at once, each rate drawn per seed (swarm testing)")
def _swarm(cfg: RunConfig, rng: random.Random) -> None:
    def maybe(p: float = 0.5) -> bool:
        return rng.random() < p

    lease = cfg.lease_s
    cfg.tp = rng.randint(1, 4)
    cfg.requests = rng.randint(8, 24)
    cfg.fence_slots = rng.choice((0, 2, 512))  # no fence, too few slots, or enough
    if maybe(0.3):
        cfg.d_blocks = rng.randint(16, 48)
    if maybe():
        cfg.cancel = CancelPlan(rng.uniform(0.05, 0.6),
                                tuple(rng.sample(("arrival", "exported", "admitted",
                                                  "reads_posted", "finished"),
                                                 rng.randint(1, 5))),
                                (0.0, rng.choice((0.01, 1.0, 0.3 * lease))))
    cfg.invalid_geometry = rng.uniform(0.0, 0.3) if maybe(0.3) else 0.0
    cfg.prefix_hit = rng.uniform(0.0, 0.3) if maybe(0.3) else 0.0
    faults = {}
    for kind in ("hb", "ack", "rel"):
        if maybe():
            faults[kind] = NotifFaults(
                drop=rng.uniform(0.0, 0.5) if kind != "rel" else 0.0,
                duplicate=rng.uniform(0.0, 0.5), delay=rng.uniform(0.0, 0.3),
                delay_s=rng.uniform(0.0, 0.3) * lease, reorder=rng.uniform(0.0, 0.5),
                max_consecutive_drops=2)
    # Refused sends from a draw of their own: the other faults stay as each seed drew them.
    own = random.Random(sub_seed(cfg.seed, "swarm/refuse"))
    for kind, f in list(faults.items()):
        if own.random() < 0.5:
            faults[kind] = replace(f, refuse=own.uniform(0.0, 0.5))
    cfg.notif_faults = faults
    cfg.read_faults = ReadFaults(fail=rng.uniform(0.0, 0.2) if maybe(0.3) else 0.0,
                                 slow=rng.uniform(0.0, 0.5) if maybe() else 0.0,
                                 slow_s=(0.001, rng.uniform(0.01, 2.5) * lease))
    if maybe(0.3):
        cfg.stall, cfg.stall_s = rng.uniform(0.0, 0.2), (0.1, 2.0 * cfg.heartbeat_interval_s)
    if maybe(0.2):
        duration = rng.uniform(0.1, 2.0) * lease
        cfg.partitions = [(rng.uniform(0.0, 0.1), duration)]
        cfg.exceeds_lease = duration + _silence_before(cfg) > lease
    if maybe(0.1):
        cfg.crash_p_at = rng.uniform(0.0, 0.1)
    elif maybe(0.1):
        cfg.crash_d_at = rng.uniform(0.0, 0.1)
    if maybe(0.2):
        cfg.wrong_peer_releases = rng.uniform(0.0, 0.5)
    if maybe(0.1):
        cfg.impersonation = rng.uniform(0.0, 0.5)
    if maybe(0.2):  # D with more TP ranks than P
        cfg.tp, cfg.d_tp = rng.choice(((1, 2), (1, 4), (2, 4)))
    cfg.export_next_step = maybe(0.3)  # P's worker hears of exports a step late


# --- hybrid models: several cache groups per request (docs/hybrid.md) -----------------

FULL, SLIDING, STATE = 0, 1, 2  # the groups of `_hybrid`'s layout, in order


def _hybrid(cfg: RunConfig, rng: random.Random, **per_group: dict) -> None:
    """A Gemma-3 / Bamba-like layout: full attention, a sliding window, a Mamba state.

    Prompts of 1–128 tokens in blocks of 16 (1–8 full-attention blocks); the
    window (32–64 tokens) keeps the last 2–5 blocks; the state is one slot.
    ``per_group`` maps ``full`` / ``sliding`` / ``state`` to `SimGroup` fields.
    """
    window = rng.choice((32, 48, 64))
    groups = [SimGroup(CacheKind.FULL_ATTENTION, 16, **per_group.get("full", {})),
              SimGroup(CacheKind.SLIDING_WINDOW, 16, window, **per_group.get("sliding", {})),
              SimGroup(CacheKind.MAMBA_STATE, 16, **per_group.get("state", {}))]
    cfg.groups = tuple(groups)
    cfg.tokens_per_request = (1, 128)
    # Up to 14 blocks a request over the groups: pools large enough that the
    # long state READs do not queue every request behind them.
    cfg.p_blocks = cfg.d_blocks = 256


@scenario("hybrid_slow_state_group",
          "a hybrid model whose state group's READ is much slower (0.2–2 leases) than its "
          "KV groups' (milliseconds): P holds every group until the last split drained")
def _hybrid_slow_state(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _hybrid(cfg, rng, state={"read_faults": ReadFaults(
        slow=1.0, slow_s=(0.2 * cfg.lease_s, 2.0 * cfg.lease_s))})


@scenario("hybrid_group_split_failure",
          "a hybrid model where one group's split fails while the other groups' splits are "
          "still in flight: the request fails, P frees once, after every split drained")
def _hybrid_split_failure(cfg: RunConfig, rng: random.Random) -> None:
    failing = rng.choice(("full", "sliding", "state"))
    cfg.read_faults = ReadFaults(slow=0.7, slow_s=(0.01, 0.5 * cfg.lease_s))
    _hybrid(cfg, rng, **{failing: {"read_faults": ReadFaults(fail=rng.uniform(0.3, 0.7))}})


@scenario("hybrid_cancel_during_state_read",
          "a hybrid model: the client cancels after the KV groups' READs landed while the "
          "state group's READ (1.2–2.5 leases) is in flight (vLLM 0.32 stops heartbeating: "
          "P frees under the state READ)")
def _hybrid_cancel_state(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _hybrid(cfg, rng, state={"read_faults": ReadFaults(
        slow=1.0, slow_s=(1.2 * cfg.lease_s, 2.5 * cfg.lease_s))})
    cfg.cancel = CancelPlan(rng.uniform(0.4, 0.9), ("reads_posted",), (0.1, 0.3 * cfg.lease_s))


@scenario("hybrid_sliding_window_no_read",
          "a hybrid model where D holds the sliding-window group's blocks already: that group "
          "posts no split, the others do; where D holds every group, a notify-only release")
def _hybrid_window_no_read(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.3, slow_s=(0.001, 0.5))
    _hybrid(cfg, rng, sliding={"held_by_d": rng.uniform(0.3, 0.8)})
    cfg.prefix_hit = rng.uniform(0.1, 0.3)  # D holds every group: nothing to read
    cfg.cancel = CancelPlan(0.1, ("admitted", "reads_posted"), (0.0, 0.02))


# --- the seed model: Qwen4-exp's cache owners (issue #15, docs/hybrid.md) ----------------

# The groups of `_qwen4`'s layout, in order: QSA main KV, QSA compressed keys, QSA key-state
# ring, GDN state, PLE short-conv state.
MAIN_KV, COMPRESSED, RING, GDN, PLE = range(5)
QWEN4_OWNERS = ("main_kv", "compressed_key", "ring", "gdn", "ple")


def _qwen4(cfg: RunConfig, rng: random.Random, **per_owner: dict) -> None:
    """The seed model's transfer groups (vLLM 0.32's ``models/qwen4_exp``), one `SimGroup`
    per cache owner, in `QWEN4_OWNERS` order:

    * ``main_kv``: the QSA main KV, full attention (``FullAttentionSpec``), blocks of 16;
    * ``compressed_key``: the QSA compressed keys (``MLAAttentionSpec(tokens_per_state=
      compress_ratio)``), block table following the main KV: every prompt block, one
      state per ``compress_ratio`` (4 or 8) tokens;
    * ``ring``: the QSA key-state ring (``CircularBufferSpec``), one block per request of
      capacity ``compress_ratio + num_speculative_tokens`` (0–3 draft tokens);
    * ``gdn``: the GDN linear-attention state (``MambaSpec``): the slot the request ends with;
    * ``ple``: the PLE short-conv state (``MambaSpec(tp_replicated=True)``): one slot, the
      whole state on every TP rank (`kv.copy_rank`).

    Prompts of 1–128 tokens: 1–8 blocks each of main KV and compressed keys plus three
    slots.  ``per_owner`` maps an owner name to `SimGroup` fields.  What the simulator
    leaves out: MTP's scratch slots after the state slot (P exports the clipped lists,
    `core.planning.export_ids`) and the real per-owner page sizes (every group overlays the
    same regions, as vLLM's hybrid allocator does).
    """
    ratio = rng.choice((4, 8))
    capacity = ratio + rng.randint(0, 3)
    kinds = {"main_kv": (CacheKind.FULL_ATTENTION, 16, {}),
             "compressed_key": (CacheKind.COMPRESSED_KEY, 16, {"tokens_per_state": ratio}),
             "ring": (CacheKind.KEY_RING, capacity, {}),
             "gdn": (CacheKind.LINEAR_STATE, 16, {}),
             "ple": (CacheKind.LAYER_EMBEDDING, 16, {"tp_replicated": True})}
    cfg.groups = tuple(SimGroup(kind, size, owner=owner, **fixed, **per_owner.get(owner, {}))
                       for owner, (kind, size, fixed) in kinds.items())
    cfg.tokens_per_request = (1, 128)
    cfg.p_blocks = cfg.d_blocks = 256  # up to 19 blocks a request over the groups


@scenario("qwen4_slow_ring_split",
          "the seed model (QSA main KV, compressed keys, key ring, GDN, PLE): the key ring's "
          "READ takes 0.2-2 leases, the other owners' milliseconds; P holds every owner until "
          "the ring's split drained")
def _qwen4_slow_ring(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _qwen4(cfg, rng, ring={"read_faults": ReadFaults(
        slow=1.0, slow_s=(0.2 * cfg.lease_s, 2.0 * cfg.lease_s))})


@scenario("qwen4_owner_failure",
          "the seed model: one cache owner's splits fail (30-70 %) while the other owners' "
          "READs (up to 0.5 lease) are in flight: the request fails, P frees once, after "
          "every split drained")
def _qwen4_owner_failure(cfg: RunConfig, rng: random.Random) -> None:
    failing = rng.choice(QWEN4_OWNERS)
    cfg.read_faults = ReadFaults(slow=0.7, slow_s=(0.01, 0.5 * cfg.lease_s))
    _qwen4(cfg, rng, **{failing: {"read_faults": ReadFaults(fail=rng.uniform(0.3, 0.7))}})


@scenario("qwen4_cancel_during_gdn_read",
          "the seed model: the client cancels after the attention owners' READs landed while "
          "the GDN state's READ (1.2-2.5 leases) is in flight (vLLM 0.32 stops heartbeating: "
          "P frees under the GDN READ)")
def _qwen4_cancel_gdn(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _qwen4(cfg, rng, gdn={"read_faults": ReadFaults(
        slow=1.0, slow_s=(1.2 * cfg.lease_s, 2.5 * cfg.lease_s))})
    cfg.cancel = CancelPlan(rng.uniform(0.4, 0.9), ("reads_posted",), (0.1, 0.3 * cfg.lease_s))


@scenario("qwen4_tp2_replicated_ple",
          "the seed model at TP 2 on both sides: the PLE state is whole on each P rank "
          "(tp_replicated) and each D rank READs its own P rank's copy; PLE READs are the "
          "slow ones (up to 0.5 lease), some fail, some clients cancel: each P rank frees "
          "once, after its own reader's splits drained")
def _qwen4_tp2_ple(cfg: RunConfig, rng: random.Random) -> None:
    """TP 2 → 2.  How the simulator models ``tp_replicated``: P writes the PLE group's
    blocks alike on both ranks (`kv.copy_rank`: the tokens name rank 0 on every rank, so the
    copies are byte for byte equal, as vLLM's replicated state is), while the hand-off stays
    rank-local as kvhandoff's connector does it: D rank d plans and posts its PLE split from
    P rank d (`plan_group_reads(rank=d)`, one split per (rank, group)), and P rank d frees
    its copy only on D rank d's release (or its lease).  Reading the state once, from one
    rank, would leave the other D rank's copy unfilled and tie P rank 1's free to a split
    that never read it; the simulator does not model that alternative.
    """
    cfg.tp, cfg.d_tp = 2, None
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _qwen4(cfg, rng, ple={"read_faults": ReadFaults(
        fail=rng.uniform(0.0, 0.2), slow=0.7, slow_s=(0.01, 0.5 * cfg.lease_s))})
    cfg.cancel = CancelPlan(rng.uniform(0.1, 0.4), ("admitted", "reads_posted"),
                            (0.0, 0.2 * cfg.lease_s))


# --- HiSparse on D: the sparse-attention KV in a host pool (issue #16, docs/hybrid.md) -----

# The groups of `_hisparse`'s layout, in order: the sparse MLA layers' KV (HiSparse's source
# group, in D's host pool) and the indexer's keys (on D's GPU).
SPARSE, INDEXER = 0, 1
HISPARSE_OWNERS = ("sparse_mla", "indexer")


def _hisparse(cfg: RunConfig, rng: random.Random, shared: bool, **per_owner: dict) -> None:
    """A DSA model's transfer groups with vLLM 0.32's HiSparse on D, one `SimGroup` per
    owner, in `HISPARSE_OWNERS` order:

    * ``sparse_mla``: the sparse MLA layers' KV, every prompt block (``FULL_ATTENTION``),
      in D's host pool (`SimGroup.host_pool`: `Memory.HOST` in D's layout);
    * ``indexer``: the indexer's keys, block-aligned with the KV (``INDEXER``), on D's GPU.

    P runs HiSparse off and describes the same two groups on the device.  Blocks of 64
    tokens, prompts of 1-512 tokens: 1-8 blocks per group.  ``shared``: D's local ranks
    share the host pool (``hisparse_shared_host_pool``), so D rank 0 alone reads it, for
    every rank.  ``per_owner`` maps an owner name to `SimGroup` fields.
    """
    kinds = {"sparse_mla": (CacheKind.FULL_ATTENTION, {"host_pool": True}),
             "indexer": (CacheKind.INDEXER, {})}
    cfg.groups = tuple(SimGroup(kind, 64, owner=owner, **fixed, **per_owner.get(owner, {}))
                       for owner, (kind, fixed) in kinds.items())
    cfg.tokens_per_request = (1, 512)
    cfg.shared_host_pool = shared
    cfg.p_blocks = cfg.d_blocks = 256


@scenario("hisparse_slow_host_split",
          "HiSparse on D (sparse MLA KV in a host pool, indexer on the GPU; the pool shared "
          "by D's ranks in half the seeds): the host-pool split takes 0.2-2.5 leases, the "
          "indexer split milliseconds; P holds both until the host split drained")
def _hisparse_slow_host(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _hisparse(cfg, rng, rng.random() < 0.5, sparse_mla={"read_faults": ReadFaults(
        slow=1.0, slow_s=(0.2 * cfg.lease_s, 2.5 * cfg.lease_s))})


@scenario("hisparse_host_split_failure",
          "HiSparse on D: the host-pool split fails (30-70 %) while the indexer split (up to "
          "0.5 lease) is in flight: the request fails, P frees once, after every split drained")
def _hisparse_host_failure(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.7, slow_s=(0.01, 0.5 * cfg.lease_s))
    _hisparse(cfg, rng, rng.random() < 0.5, sparse_mla={"read_faults": ReadFaults(
        fail=rng.uniform(0.3, 0.7))})


@scenario("hisparse_cancel_during_host_read",
          "HiSparse on D: the client cancels after the indexer READ landed while the "
          "host-pool READ (1.2-2.5 leases) is in flight (vLLM 0.32 stops heartbeating: P "
          "frees under the host-pool READ)")
def _hisparse_cancel_host(cfg: RunConfig, rng: random.Random) -> None:
    cfg.read_faults = ReadFaults(slow=0.5, slow_s=(0.001, 0.05))
    _hisparse(cfg, rng, rng.random() < 0.5, sparse_mla={"read_faults": ReadFaults(
        slow=1.0, slow_s=(1.2 * cfg.lease_s, 2.5 * cfg.lease_s))})
    cfg.cancel = CancelPlan(rng.uniform(0.4, 0.9), ("reads_posted",), (0.1, 0.3 * cfg.lease_s))


@scenario("hisparse_tp2_shared_pool",
          "HiSparse on D at TP 2 on both sides with one host pool for D's ranks: D rank 0 "
          "alone reads it (0.05-1 lease), D rank 1 reads only its indexer split (0-20 % of "
          "indexer READs fail) and P rank 1 frees after it, never waiting for the host-pool READ")
def _hisparse_tp2_shared(cfg: RunConfig, rng: random.Random) -> None:
    """TP 2 → 2, ``hisparse_shared_host_pool``.  What P rank 1 holds of the sparse MLA
    group is never read (D rank 0 reads P rank 0's: MLA's KV is alike on every rank, which
    the simulator does not model, so P rank 1's stays unread), and its blocks go back on
    D rank 1's release, as vLLM's NixlConnector lets rank 1 finish without the DRAM READ
    (``_leaves_dram_xfer_to_rank0``)."""
    cfg.tp, cfg.d_tp = 2, None
    cfg.read_faults = ReadFaults(fail=rng.uniform(0.0, 0.2), slow=0.5, slow_s=(0.001, 0.05))
    _hisparse(cfg, rng, True, sparse_mla={"read_faults": ReadFaults(
        slow=1.0, slow_s=(0.05 * cfg.lease_s, 1.0 * cfg.lease_s))})

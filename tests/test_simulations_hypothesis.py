"""Hypothesis drives the simulator: scenarios, seeds and fault rates are strategies.

Safety (`World.check_safety`: no double free, no corrupt or unproven bytes
served, no block freed under a READ unless the faults exceed the lease,
heartbeats measured as sent while READs are in flight, P's pool matching its
fold, D's pages matching its imports) is checked
after every simulated step; liveness (nothing stuck, nothing leaked) at the
end, after partitions healed and leases ran out.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.simulations.config import PHASES, CancelPlan
from kvhandoff.simulations.scenarios import _silence_before, build, names
from kvhandoff.simulations.world import World
from kvhandoff.transports.sim import NotifFaults, ReadFaults

rates = st.floats(min_value=0.0, max_value=1.0)


def _check_liveness(world: World, result) -> None:
    m = result.metrics
    assert m["stuck"] == 0, f"stuck requests: {world.p.unfinished() + world.d.unfinished()}"
    assert m["leaks"] == 0
    assert m["served"] + m["failed"] + m["rejected"] + m["cancelled"] == m["requests"]


@given(scenario=st.sampled_from(names()),
       seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_any_scenario_any_seed_is_safe_at_every_step_and_live_at_the_end(scenario, seed):
    world = World(build(scenario, seed))
    _check_liveness(world, world.run(on_step=World.check_safety))


@given(seed=st.integers(min_value=0, max_value=2**16),
       tp=st.sampled_from([(1, None), (2, None), (3, None), (4, None), (1, 2), (1, 4), (2, 4)]),
       drop=st.floats(min_value=0.0, max_value=0.7), duplicate=rates, reorder=rates,
       delay=rates, delay_frac=st.floats(min_value=0.0, max_value=0.3),
       read_fail=st.floats(min_value=0.0, max_value=0.5),
       slow=rates, slow_frac=st.floats(min_value=0.0, max_value=2.5),
       cancel=rates, phases=st.lists(st.sampled_from(PHASES), min_size=1, max_size=5, unique=True),
       invalid=st.floats(min_value=0.0, max_value=0.5),
       prefix=st.floats(min_value=0.0, max_value=0.5),
       stall=st.floats(min_value=0.0, max_value=0.3),
       crash=st.sampled_from([None, "P", "D"]), crash_at=st.floats(min_value=0.0, max_value=0.1))
def test_fault_rates_drawn_by_hypothesis_never_break_safety(
        seed, tp, drop, duplicate, reorder, delay, delay_frac, read_fail, slow, slow_frac,
        cancel, phases, invalid, prefix, stall, crash, crash_at):
    cfg = build("steady_state", seed)
    lease = cfg.lease_s
    cfg.tp, cfg.d_tp = tp
    # Heartbeats and their acks may be lost, but never more than two in a row:
    # within that, the lease must hold (three in a row exceed what a lease of
    # six heartbeat periods promises once engine stalls are added).
    hb = NotifFaults(drop=drop, duplicate=duplicate, reorder=reorder, delay=delay,
                     delay_s=delay_frac * cfg.heartbeat_interval_s, max_consecutive_drops=2)
    cfg.notif_faults = {"hb": hb, "ack": hb,
                        "rel": NotifFaults(duplicate=duplicate, reorder=reorder, delay=delay,
                                           delay_s=delay_frac * lease)}
    cfg.read_faults = ReadFaults(fail=read_fail, slow=slow, slow_s=(0.0, slow_frac * lease))
    cfg.cancel = CancelPlan(cancel, tuple(phases), (0.0, 0.3 * lease))
    cfg.invalid_geometry, cfg.prefix_hit = invalid, prefix
    cfg.stall, cfg.stall_s = stall, (0.0, cfg.heartbeat_interval_s)
    if crash == "P":
        cfg.crash_p_at = crash_at
    elif crash == "D":
        cfg.crash_d_at = crash_at
    world = World(cfg)
    _check_liveness(world, world.run(on_step=World.check_safety))


@given(seed=st.integers(min_value=0, max_value=2**16),
       length=st.floats(min_value=0.05, max_value=3.0))
def test_a_partition_of_any_length_never_makes_d_serve_freed_bytes(seed, length):
    cfg = build("partition_beyond_lease", seed)
    cfg.partitions = [(0.01, length * cfg.lease_s)]
    # P may free under a READ only when the silence outlasts what a lease covers;
    # shorter partitions keep the free-under-read check on.
    cfg.exceeds_lease = length * cfg.lease_s + _silence_before(cfg) > cfg.lease_s
    world = World(cfg)
    result = world.run(on_step=World.check_safety)
    assert result.metrics["served_corrupt"] == 0
    _check_liveness(world, result)

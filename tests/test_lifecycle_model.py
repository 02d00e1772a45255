"""Model-based test: random interleavings of both halves against a small reference model.

Hypothesis drives a P stream and a D stream through exports, admissions,
validation, reads (k splits each, completing or failing), client cancels at
any point, heartbeats and their acknowledgements (some lost), release
notifications (some lost, duplicated, stale or forged) and the passage of
time.  After every step the live fold must agree with the reference model,
with the policy, and with a replay of the log written so far.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvhandoff.core import policy
from kvhandoff.core.events import (
    Aborted,
    Admitted,
    ClientCancelled,
    Exported,
    FinishedRecving,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
    LeaseAcknowledged,
    LeaseExpired,
    PrefillStarted,
    ReadsPosted,
    Rejected,
    ReleaseNotified,
    ReleaseSent,
    Side,
    SplitCompleted,
    SplitFailed,
    Stream,
    Validated,
)
from kvhandoff.core.ledger import Ledger
from kvhandoff.core.lifecycle import DState, LifecycleState, PState, fold
from kvhandoff.core.replay import replay, state_hash

LEASE = 10.0
MARGIN = 0.5
# Written out here, not imported: the rule this project exists for.
HEARTBEATING = {"ADMITTED", "VALIDATED", "REJECTED", "CANCELLED", "READING", "CANCELLED_READING"}
P0 = Stream("prefill-0", Side.P, 0)
D0 = Stream("decode-0", Side.D, 0)


class Model:
    """What the lifecycle must look like, written independently of the fold."""

    def __init__(self) -> None:
        self.p: dict[str, str] = {}
        self.d: dict[str, str] = {}
        self.deadline: dict[str, float] = {}
        self.freed_at: dict[str, float] = {}
        self.frees: dict[str, int] = {}
        self.splits: dict[str, list] = {}  # per split: None in flight, completion time, "failed"
        self.cancelled: set[str] = set()


class HandoffMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.n = 0
        self.log: list = []
        self.state = LifecycleState()
        self.P = Ledger(P0, self.state, self.log.append)
        self.D = Ledger(D0, self.state, self.log.append)
        self.m = Model()

    # --- helpers ---------------------------------------------------------------
    def _rid(self) -> str:
        self.n += 1
        return f"req-{self.n}"

    def _p_receives_release(self, rid: str) -> None:
        self.P.record(ReleaseNotified, rid, self.t, from_engine="decode-0", consumer_rank=0)
        if self.m.p.get(rid) == "EXPORTED":
            self.m.p[rid] = "RELEASED"

    # --- P half ----------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.t = 1.0

    @rule()
    def export(self) -> None:
        rid = self._rid()
        self.P.record(PrefillStarted, rid, self.t)
        self.P.record(Exported, rid, self.t, lease_s=LEASE, consumer_ranks=(0,), num_blocks=2)
        self.m.p[rid] = "EXPORTED"
        self.m.deadline[rid] = self.t + LEASE

    @rule()
    def abort_during_prefill(self) -> None:
        rid = self._rid()
        self.P.record(PrefillStarted, rid, self.t)
        self.P.record(Aborted, rid, self.t, reason="client")
        self.m.p[rid] = "ABORTED"

    @rule()
    def reap_and_free(self) -> None:
        for rid in policy.expired_leases(self.state, P0, self.t):
            self.P.record(LeaseExpired, rid, self.t)
            self.m.p[rid] = "EXPIRED"
        for rid in policy.to_free(self.state, P0):
            self.P.record(Freed, rid, self.t)
            self.m.p[rid] = "FREED"
            self.m.frees[rid] = self.m.frees.get(rid, 0) + 1
            self.m.freed_at.setdefault(rid, self.t)

    @rule(data=st.data(), forged=st.booleans())
    def stale_or_forged_release(self, data, forged) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.m.p), "never-exported"]))
        before = self.m.p.get(rid)
        engine = "decode-evil" if forged else "decode-0"
        self.P.record(ReleaseNotified, rid, self.t, from_engine=engine, consumer_rank=0)
        bound = self.state.record(P0, rid)
        if before == "EXPORTED" and not (forged and bound is not None and bound.consumer
                                         and bound.consumer != engine):
            self.m.p[rid] = "RELEASED"

    # --- D half ----------------------------------------------------------------
    @precondition(lambda self: any(s == "EXPORTED" and r not in self.m.d
                                   for r, s in self.m.p.items()))
    @rule(data=st.data())
    def admit(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, s in self.m.p.items()
                                               if s == "EXPORTED" and r not in self.m.d)))
        self.D.record(Admitted, rid, self.t, remote_engine="prefill-0", remote_ranks=(0,),
                      num_blocks=2, lease_s=LEASE, lease_margin_s=MARGIN, local_request_id=rid)
        self.m.d[rid] = "ADMITTED"

    def _in(self, *states):
        return sorted(r for r, s in self.m.d.items() if s in states)

    @precondition(lambda self: self._in("ADMITTED"))
    @rule(data=st.data(), ok=st.booleans())
    def validate_or_reject(self, data, ok) -> None:
        rid = data.draw(st.sampled_from(self._in("ADMITTED")))
        if ok:
            self.D.record(Validated, rid, self.t)
            self.m.d[rid] = "VALIDATED"
        else:
            self.D.record(Rejected, rid, self.t, reason="invalid geometry")
            self.m.d[rid] = "REJECTED"

    @precondition(lambda self: self._in("VALIDATED"))
    @rule(data=st.data(), k=st.integers(1, 3))
    def post_reads(self, data, k) -> None:
        rid = data.draw(st.sampled_from(self._in("VALIDATED")))
        self.D.record(ReadsPosted, rid, self.t, split_ranks=(0,) * k)
        self.m.d[rid] = "READING"
        self.m.splits[rid] = [None] * k

    @precondition(lambda self: any(None in sp for sp in self.m.splits.values()))
    @rule(data=st.data(), ok=st.booleans())
    def finish_a_split(self, data, ok) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, sp in self.m.splits.items()
                                               if None in sp)))
        i = self.m.splits[rid].index(None)
        if ok:
            self.D.record(SplitCompleted, rid, self.t, split=i)
            self.m.splits[rid][i] = self.t
        else:
            self.D.record(SplitFailed, rid, self.t, split=i, reason="remote disconnect")
            self.m.splits[rid][i] = "failed"

    @precondition(lambda self: self.m.d)
    @rule(data=st.data())
    def client_cancels(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.m.d)))
        self.D.record(ClientCancelled, rid, self.t)
        self.m.cancelled.add(rid)
        s = self.m.d[rid]
        self.m.d[rid] = {"ADMITTED": "CANCELLED", "VALIDATED": "CANCELLED",
                         "READING": "CANCELLED_READING"}.get(s, s)

    @rule(lose_heartbeat=st.booleans(), lose_ack=st.booleans())
    def heartbeat(self, lose_heartbeat, lose_ack) -> None:
        due = policy.heartbeat_due(self.state, D0).get("prefill-0", [])
        sent_at = self.t
        for rid in due:
            self.D.record(HeartbeatSent, rid, sent_at)
        if lose_heartbeat:
            return
        self.t += 0.01
        left = {}
        for rid in due:
            self.P.record(HeartbeatReceived, rid, self.t, from_engine="decode-0")
            if self.m.p.get(rid) == "EXPORTED":
                self.m.deadline[rid] = max(self.m.deadline[rid], self.t + LEASE)
            left[rid] = policy.lease_time_left(self.state, P0, rid, self.t)
        if lose_ack:
            return
        self.t += 0.01
        for rid, time_left in left.items():
            self.D.record(LeaseAcknowledged, rid, self.t, p_rank=0, sent_at=sent_at,
                          time_left=time_left)

    @precondition(lambda self: policy.reads_to_report(self.state, D0))
    @rule(lose_release=st.booleans())
    def finished_recving(self, lose_release) -> None:
        for rid in policy.reads_to_report(self.state, D0):
            self.D.record(FinishedRecving, rid, self.t)
            rec = self.state.record(D0, rid)
            self.m.d[rid] = rec.state.value
            self._check_verdict(rid, rec.state)
            notify_only = rec.state is DState.FAILED
            self.D.record(ReleaseSent, rid, self.t, notify_only=notify_only)
            self.m.d[rid] = "DONE"
            if not lose_release:
                self._p_receives_release(rid)

    def _check_verdict(self, rid: str, got: DState) -> None:
        splits = self.m.splits[rid]
        if "failed" in splits:
            assert got is DState.FAILED
        freed = self.m.freed_at.get(rid, math.inf)
        if any(c > freed for c in splits if isinstance(c, float)):
            assert got is DState.FAILED, f"{rid}: read finished after P freed its source"

    @precondition(lambda self: self._in("REJECTED", "CANCELLED", "VALIDATED"))
    @rule(data=st.data(), lose_release=st.booleans())
    def notify_only_release(self, data, lose_release) -> None:
        rid = data.draw(st.sampled_from(self._in("REJECTED", "CANCELLED", "VALIDATED")))
        self.D.record(ReleaseSent, rid, self.t, notify_only=True)
        self.m.d[rid] = "DONE"
        if not lose_release:
            self._p_receives_release(rid)

    @rule(dt=st.sampled_from([0.1, 1.0, 4.0, 12.0]))
    def advance_time(self, dt) -> None:
        self.t += dt

    @rule()
    def partition_beyond_the_lease(self) -> None:
        """D hears nothing for longer than a lease; P's reaper runs meanwhile."""
        self.t += LEASE + 1.0
        self.reap_and_free()

    # --- invariants ------------------------------------------------------------
    @invariant()
    def fold_matches_model(self) -> None:
        for rid, s in self.m.p.items():
            assert self.state.record(P0, rid).state == PState(s), rid
        for rid, s in self.m.d.items():
            assert self.state.record(D0, rid).state == DState(s), rid

    @invariant()
    def heartbeats_are_exactly_the_requests_whose_reads_may_own_the_source(self) -> None:
        expected = sorted(r for r, s in self.m.d.items() if s in HEARTBEATING)
        assert sorted(policy.heartbeat_due(self.state, D0).get("prefill-0", [])) == expected

    @invariant()
    def freed_exactly_once(self) -> None:
        assert all(n == 1 for n in self.m.frees.values())
        assert self.state.streams.get(P0) is None or \
            self.state.streams[P0].freed == len(self.m.frees)

    @invariant()
    def lease_never_ends_before_its_deadline(self) -> None:
        for rid in policy.expired_leases(self.state, P0, self.t):
            assert self.t >= self.m.deadline[rid]

    @invariant()
    def replaying_the_log_gives_the_same_state(self) -> None:
        assert state_hash(fold(self.log)) == state_hash(self.state)

    def teardown(self) -> None:
        result = replay(self.log)
        bad = [v for v in result.violations if v.invariant not in ("heartbeat_gap", "leak")]
        assert not bad, bad


TestHandoffLifecycle = HandoffMachine.TestCase

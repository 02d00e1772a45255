"""Model-based test: the core against an independent reference model, every arrow reached.

Hypothesis drives two P ranks and one D stream (whose READ splits come from
D ranks reading either P rank, one or two D ranks per P rank, one or two
splits per D rank) through exports, aborts, admissions, validation, reads,
client cancels at any point, heartbeats and their acknowledgements, releases,
the reaper and the clock.  Every notification travels through a network that
loses, duplicates and reorders it; an impostor engine sends heartbeats and
releases with stolen, wrong or no tokens; D's own release sometimes goes out
before its reads drained (a stale or early release).

For every event the reference model (`lifecycle_reference`, written from
docs/lifecycle.md) predicts the outcome — applied, ignored with the counted
reason, or refused — and the record after it; P's answers, the heartbeat
set, the leases to reap, the blocks to free and the reads to report are
predicted too, and each prediction is compared with the core.

Effects are checked, not states: D serves (RECEIVED, not cancelled) only
reads its acknowledgements prove, and never bytes read after P freed them
unless P was freed by a release that did not follow D's reads — which
``replay --check`` must then name (``served_freed``).

Every arrow of both graphs is counted as it is taken; a test asserts that
the CI profile took each at least once.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from lifecycle_reference import HEARTBEATING, READING_STATES, ReferenceModel

from kvhandoff.core import policy
from kvhandoff.core.errors import InvalidTransition
from kvhandoff.core.events import (
    CONSUMER_EVENTS,
    EVENT_TYPES,
    PRODUCER_EVENTS,
    Aborted,
    Admitted,
    ClientCancelled,
    Exported,
    FenceHeld,
    FinishedRecving,
    Forgotten,
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
from kvhandoff.core.lifecycle import TABLES, LifecycleState
from kvhandoff.core.replay import replay

LEASE, MARGIN = 10.0, 0.5
P_ENGINE, D_ENGINE, IMPOSTOR = "prefill-0", "decode-0", "decode-9"
P_RANKS = (0, 1)
PS = [Stream(P_ENGINE, Side.P, r) for r in P_RANKS]
D0 = Stream(D_ENGINE, Side.D, 0)

PROBE = st.sampled_from([True, True, False])
FATES = st.sampled_from(["deliver", "deliver", "deliver", "lose", "duplicate"])
# Every arrow taken, (side, from, event, to), over every example this process ran.
ARROWS_TAKEN: Counter[tuple[str, str, str, str]] = Counter()


def all_arrows() -> set[tuple[str, str, str, str]]:
    """The arrows of both graphs, read from the compiled tables (not listed by hand)."""
    return {(side.value, src.value, kind, dest.value)
            for side, table in TABLES.items()
            for (src, kind), handler in table.items()
            for _, dest in handler.choices}


class Request:
    """What the driver knows of one request: its topology and token."""

    def __init__(self, rid: str, k: int, m: int, token: str) -> None:
        self.rid, self.k, self.token = rid, k, token
        # P rank r expects a release from each of its k D ranks.
        self.consumers = {r: tuple(range(r * k, (r + 1) * k)) for r in P_RANKS}
        # D rank d reads P rank d // k, in m splits (cache groups).
        self.split_ranks = tuple(d // k for d in range(len(P_RANKS) * k) for _ in range(m))
        self.tainted = False  # P counted a release that did not follow D's reads


class HandoffMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = 1.0
        self.n = 0
        self.log: list = []
        self.state = LifecycleState()
        self.ledgers = {s: Ledger(s, self.state, self.log.append) for s in (*PS, D0)}
        self.model = ReferenceModel()
        self.requests: dict[str, Request] = {}
        self.net: list[tuple] = []  # notifications in flight, in any order
        self.freed_at: dict[tuple[int, str], float] = {}
        self.served_after_free: set[str] = set()

    # --- applying one event to the core and the model -----------------------------

    def _event(self, stream: Stream, cls, rid: str, **fields) -> str:
        """Fold one event; the model must predict its outcome and the record after it."""
        if stream.side is Side.P:
            predicted, after = self.model.predict_p(stream.rank, cls.kind, rid, fields, self.t)
        else:
            predicted, after = self.model.predict_d(cls.kind, rid, fields, self.t)
        before = self._fold_state(stream, rid)
        ss = self.state.stream(stream)
        ignored_before = Counter(ss.ignored)
        try:
            self.ledgers[stream].record(cls, rid, self.t, **fields)
        except InvalidTransition:
            actual = ("refused", "")
        else:
            new = ss.ignored - ignored_before
            actual = ("ignored", next(iter(new))) if new else ("applied", "")
        assert actual == predicted, f"{stream} {cls.kind} {rid} {fields}: core {actual}, " \
                                    f"model {predicted}"
        if actual[0] != "refused":
            ARROWS_TAKEN[(stream.side.value, before, cls.kind, self._fold_state(stream, rid))] += 1
        if after is not None:
            if stream.side is Side.P:
                self.model.p[(stream.rank, rid)] = after
            else:
                self.model.d[rid] = after
        self._compare(stream, rid)
        return actual[0]

    def _fold_state(self, stream: Stream, rid: str) -> str:
        rec = self.state.record(stream, rid)
        return rec.state.value if rec is not None else "NEW"

    def _compare(self, stream: Stream, rid: str) -> None:
        rec = self.state.record(stream, rid)
        if stream.side is Side.P:
            m = self.model.p_rec(stream.rank, rid)
            if rec is None:
                assert m.state == "NEW"
                return
            assert (rec.state.value, rec.deadline, set(rec.notified), rec.consumer, rec.token) == (
                m.state, m.deadline, set(m.notified), m.consumer, m.token), (stream, rid)
            return
        m = self.model.d_rec(rid)
        if rec is None:
            assert m.state == "NEW"
            return
        assert (rec.state.value, rec.cancelled, list(rec.split_done), rec.safe_until,
                set(rec.gone), rec.last_heartbeat) == (
            m.state, m.cancelled, [("" if d == "failed" else d) for d in m.done], m.bound,
            m.gone, m.last_hb), rid
        if m.state in READING_STATES:
            assert policy.read_verdict(self.state, D0, rid).value == self.model.verdict(m), rid

    # --- P -------------------------------------------------------------------------

    @initialize(k=st.sampled_from([1, 2]), m=st.sampled_from([1, 2]),
                depth=st.sampled_from(["cancelled", "reading", "drained", "finished", "released"]),
                fail=st.booleans(), cancel=st.booleans())
    def a_first_request_is_read(self, k, m, depth, fail, cancel) -> None:
        # Every example starts with one request driven deep into its life (the
        # rules then branch off from there), so that every arrow is reached in
        # the CI profile's few examples.
        rid = self._new_request(k, m, token=True)
        self._export(rid)
        self._admit(rid)
        self._event(D0, Validated, rid)
        if depth == "cancelled":
            self._event(D0, ClientCancelled, rid)
        self._heartbeat_round()
        self._deliver_all()
        if depth == "cancelled":
            return
        self._event(D0, ReadsPosted, rid, split_ranks=self.requests[rid].split_ranks)
        if cancel:
            self._event(D0, ClientCancelled, rid)
        if depth == "reading":
            return
        for i in range(len(self.requests[rid].split_ranks)):
            if fail and i == 0:
                self._event(D0, SplitFailed, rid, split=i, reason="peer lost")
            else:
                self._event(D0, SplitCompleted, rid, split=i)
        if depth == "drained":
            for rank in sorted(set(self.requests[rid].split_ranks)):
                self._read_fence(rid, rank)  # P still holds it: the slot has its value
            return
        self._event(D0, FinishedRecving, rid)
        rec = self.model.d_rec(rid)
        if rec.state == "RECEIVED" and not rec.cancelled:
            self._served(rid)
        self._event(D0, ClientCancelled, rid)  # a late cancel changes nothing
        if depth == "released":
            self._release(rid, notify_only=rec.state != "RECEIVED")
            self._deliver_all()

    @initialize(data=st.data(), paths=st.permutations(
        ["abort", "expire", "reject", "cancel", "prefix", "read", "read_cancel", "read_fail"]))
    def requests_tour_every_path_of_the_graph(self, data, paths) -> None:
        """Each path of the graph, in a drawn order, probed with stray messages on the way.

        What happens at each probe is drawn, so the examples differ; the tour
        makes the short-lived states (EXPIRED, REJECTED, CANCELLED, RECEIVED...)
        common enough for the CI profile to meet every arrow.
        """
        for path in paths:
            self._tour(data, path)

    def _tour(self, data, path: str) -> None:
        self._probe_p(data, "never-seen")
        # (On the way to its expiry, strays must not release it.)
        stolen = path != "expire"
        rid = self._new_request(1, data.draw(st.sampled_from([1, 2])),
                                data.draw(st.booleans()) if stolen else True)
        self._probe_p(data, rid)
        if path == "abort":
            for s in PS:
                self._event(s, Aborted, rid, reason="client")
            self._probe_p(data, rid)
            self.p_reaps_and_frees(True)
            self._probe_p(data, rid)
            return
        self._export(rid)
        self._probe_p(data, rid, stolen)
        if path == "expire":
            self.t += LEASE + 1.0
            self.p_reaps_and_frees(False)
            self._probe_p(data, rid)
            self.p_reaps_and_frees(True)
            self._probe_p(data, rid)
            return
        self._admit(rid)
        self._probe_d(data, rid)
        if path == "reject":
            if data.draw(PROBE):  # a request that fails after validation, before its reads
                self._event(D0, Validated, rid)
            self._event(D0, Rejected, rid, reason="geometry")
        elif path == "cancel":
            self._event(D0, ClientCancelled, rid)
        else:
            self._event(D0, Validated, rid)
        self._probe_d(data, rid)
        if path in ("reject", "cancel", "prefix"):
            self._release(rid, notify_only=True)
        else:
            self._event(D0, ReadsPosted, rid, split_ranks=self.requests[rid].split_ranks)
            if path == "read_cancel":
                self._event(D0, ClientCancelled, rid)
            self._probe_d(data, rid)
            for i in range(len(self.requests[rid].split_ranks)):
                if i == 0 and (path == "read_fail" or path == "read_cancel" and data.draw(PROBE)):
                    self._event(D0, SplitFailed, rid, split=i, reason="peer lost")
                else:
                    self._event(D0, SplitCompleted, rid, split=i)
            self._probe_d(data, rid)
            if rid in self.model.reportable() or self.model.d_rec(rid).cancelled:
                self._event(D0, FinishedRecving, rid)
                if self.model.d_rec(rid).state == "RECEIVED" and path == "read":
                    self._served(rid)
                self._probe_d(data, rid)
                self._release(rid, notify_only=self.model.d_rec(rid).state != "RECEIVED")
        self._probe_d(data, rid)
        self._deliver_all()
        self._probe_p(data, rid)

    def _probe_p(self, data, rid: str, stolen: bool = True) -> None:
        """Maybe an impostor's heartbeat or release reaches P rank 0 now."""
        token = getattr(self.requests.get(rid), "token", "") if stolen else "bogus"
        for kind in ("hb", "rel"):
            if data.draw(PROBE):
                tok = data.draw(st.sampled_from(["", token]))
                self._deliver(("hb", 0, (rid,), IMPOSTOR, (tok,), self.t) if kind == "hb" else
                              ("rel", 0, rid, IMPOSTOR, 0, tok, True))

    def _probe_d(self, data, rid: str) -> None:
        """Maybe a heartbeat round, a plausible acknowledgement, a (harmless) cancel now."""
        if data.draw(PROBE) and self.model.d_rec(rid).state in HEARTBEATING:
            self._heartbeat_round()
            self._deliver_all()
        if data.draw(PROBE):
            self._event(D0, LeaseAcknowledged, rid, p_rank=0,
                        sent_at=self.model.d_rec(rid).last_hb,
                        time_left=data.draw(st.sampled_from([-1.0, 0.0, 5.0])))
        if data.draw(PROBE) and self.model.d_rec(rid).state not in (
                "ADMITTED", "VALIDATED", "READING"):
            self._event(D0, ClientCancelled, rid)

    def _new_request(self, k: int, m: int, token: bool, prefill: bool = True) -> str:
        self.n += 1
        rid = f"req-{self.n}"
        self.requests[rid] = Request(rid, k, m, f"tok-{self.n}" if token else "")
        if prefill:  # (an engine may also log the export alone)
            for s in PS:
                self._event(s, PrefillStarted, rid)
        return rid

    def _export(self, rid: str) -> None:
        req = self.requests[rid]
        for s in PS:
            self._event(s, Exported, rid, lease_s=LEASE, consumer_ranks=req.consumers[s.rank],
                        num_blocks=2, token=req.token)

    @rule(k=st.sampled_from([1, 2]), m=st.sampled_from([1, 2]), token=st.booleans(),
          then=st.sampled_from(["export", "export", "abort", "wait", "direct"]))
    def a_request_is_prefilled(self, k, m, token, then) -> None:
        rid = self._new_request(k, m, token, prefill=then != "direct")
        if then in ("export", "direct"):
            self._export(rid)
        elif then == "abort":
            for s in PS:
                self._event(s, Aborted, rid, reason="client")

    @precondition(lambda self: any(self.model.p_rec(0, r).state in ("PREFILLING", "NEW")
                                   for r in self.requests))
    @rule(data=st.data(), abort=st.booleans())
    def a_prefill_ends(self, data, abort) -> None:
        rid = data.draw(st.sampled_from(sorted(
            r for r in self.requests if self.model.p_rec(0, r).state in ("PREFILLING", "NEW"))))
        if abort:
            for s in PS:
                self._event(s, Aborted, rid, reason="client")
        else:
            self._export(rid)

    @rule(free=st.sampled_from([True, True, False]))
    def p_reaps_and_frees(self, free) -> None:
        for s in PS:
            expired = set(policy.expired_leases(self.state, s, self.t))
            assert expired == self.model.expired(s.rank, self.t)
            for rid in sorted(expired):
                self._event(s, LeaseExpired, rid)
            if not free:  # (the free may come a step later)
                continue
            to_free = set(policy.to_free(self.state, s))
            assert to_free == self.model.to_free(s.rank)
            for rid in sorted(to_free):
                self._event(s, Freed, rid)
                self.freed_at[(s.rank, rid)] = self.t

    # --- D -------------------------------------------------------------------------

    def _d_in(self, *states) -> list[str]:
        return sorted(r for r in self.requests if self.model.d_rec(r).state in states)

    def _admit(self, rid: str, valid: bool = True) -> None:
        self._event(D0, Admitted, rid, remote_engine=P_ENGINE if valid else "",
                    remote_ranks=P_RANKS, num_blocks=2, lease_s=LEASE, lease_margin_s=MARGIN,
                    local_request_id=f"local-{rid}")

    @precondition(lambda self: any(self.model.p_rec(0, r).state != "PREFILLING"
                                   and self.model.d_rec(r).state == "NEW" for r in self.requests))
    @rule(data=st.data(), valid=st.sampled_from([True, True, True, False]))
    def d_admits(self, data, valid) -> None:
        rid = data.draw(st.sampled_from(sorted(
            r for r in self.requests
            if self.model.p_rec(0, r).state != "PREFILLING" and self.model.d_rec(r).state == "NEW")))
        self._admit(rid, valid)

    @precondition(lambda self: self._d_in("ADMITTED", "VALIDATED", "READING", "CANCELLED_READING"))
    @rule(data=st.data(), choice=st.integers(0, 5))
    def d_moves_a_request_on(self, data, choice) -> None:
        """The next step of one request on D: the branch is drawn among the legal ones."""
        rid = data.draw(st.sampled_from(self._d_in("ADMITTED", "VALIDATED", "READING",
                                                   "CANCELLED_READING")))
        rec = self.model.d_rec(rid)
        if rec.state == "ADMITTED":
            [lambda: self._event(D0, Validated, rid),
             lambda: self._event(D0, Rejected, rid, reason="geometry"),
             lambda: self._event(D0, ClientCancelled, rid)][choice % 3]()
        elif rec.state == "VALIDATED":
            if choice < 4:
                self._event(D0, ReadsPosted, rid, split_ranks=self.requests[rid].split_ranks)
            elif choice == 4:
                self._event(D0, ClientCancelled, rid)
            else:  # a full prefix hit: nothing to read
                self._release(rid, notify_only=True)
        elif None in rec.done:
            i = data.draw(st.sampled_from([i for i, d in enumerate(rec.done) if d is None]))
            if choice == 0:
                self._event(D0, SplitFailed, rid, split=i, reason="peer lost")
            elif choice == 1 and rec.state == "READING":
                self._event(D0, ClientCancelled, rid)
            else:
                self._event(D0, SplitCompleted, rid, split=i)
        else:
            self._event(D0, ClientCancelled, rid)

    def _fenceable(self) -> list[tuple[str, int]]:
        """(request, P rank) whose splits from that rank drained (completed or failed: the fold
        takes the fence either way), while P still holds it
        there (after a free the slot no longer holds the request's value: nothing to fold)."""
        return [(rid, rank) for rid in self._d_in(*READING_STATES)
                for rank in sorted(set(self.model.d_rec(rid).split_ranks))
                if (rank, rid) not in self.freed_at and all(d is not None for r, d in zip(
                    self.model.d_rec(rid).split_ranks, self.model.d_rec(rid).done, strict=True)
                    if r == rank)]

    def _unfreed_ranks(self) -> list[tuple[str, int]]:
        return [(rid, rank) for rid in self._d_in(*READING_STATES)
                for rank in sorted(set(self.model.d_rec(rid).split_ranks))
                if (rank, rid) not in self.freed_at]

    @precondition(lambda self: self._unfreed_ranks())
    @rule(data=st.data(), cancel=st.sampled_from([False, False, False, True]))
    def a_rank_drains_and_d_reads_its_fence(self, data, cancel) -> None:
        """A rank's last splits complete and D reads that rank's fence at once (or the
        client cancels first: the cancelled READs still drain into D's pages)."""
        rid, rank = data.draw(st.sampled_from(self._unfreed_ranks()))
        if cancel:
            self._event(D0, ClientCancelled, rid)
        rec = self.model.d_rec(rid)
        for i, (k, done) in enumerate(zip(rec.split_ranks, rec.done, strict=True)):
            if k == rank and done is None:
                self._event(D0, SplitCompleted, rid, split=i)
        self._read_fence(rid, rank)

    @precondition(lambda self: self._fenceable())
    @rule(data=st.data())
    def d_reads_p_s_fence(self, data) -> None:
        """After a rank's splits drained, D reads that rank's fence slot now: it holds the
        request's value while P has not freed the request there (`core.fence`)."""
        self._read_fence(*data.draw(st.sampled_from(self._fenceable())))

    def _read_fence(self, rid: str, rank: int) -> None:
        self._event(D0, FenceHeld, rid, p_rank=rank, posted_at=self.t)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def the_client_cancels_at_any_time(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self._event(D0, ClientCancelled, rid)

    @precondition(lambda self: policy.reads_to_report(self.state, D0) or any(
        self.model.d_rec(r).cancelled for r in self._d_in(*READING_STATES)))
    @rule(data=st.data())
    def d_reports_finished_recving(self, data) -> None:
        # Drained reads are reported once P's word decided them; a cancelled
        # request's drained reads at once (its bytes go nowhere).
        reportable = set(policy.reads_to_report(self.state, D0))
        assert reportable == self.model.reportable()
        drained_cancelled = {r for r in self._d_in(*READING_STATES)
                             if self.model.d_rec(r).cancelled and None not in self.model.d_rec(r).done}
        candidates = sorted(reportable | drained_cancelled)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        self._event(D0, FinishedRecving, rid)
        rec = self.model.d_rec(rid)
        if rec.state == "RECEIVED" and not rec.cancelled:
            self._served(rid)

    def _served(self, rid: str) -> None:
        """D passes the bytes on: they must be proven, and unfreed unless P was misled."""
        assert self.model.proven(rid), f"{rid}: served without proof"
        rec = self.model.d_rec(rid)
        for rank, done in zip(rec.split_ranks, rec.done, strict=True):
            if done > self.freed_at.get((rank, rid), math.inf):
                assert self.requests[rid].tainted, f"{rid}: served bytes P had freed"
                self.served_after_free.add(rid)

    @precondition(lambda self: self._d_in("RECEIVED", "FAILED", "REJECTED", "CANCELLED"))
    @rule(data=st.data())
    def d_releases(self, data) -> None:
        rid = data.draw(st.sampled_from(self._d_in("RECEIVED", "FAILED", "REJECTED", "CANCELLED")))
        self._release(rid, notify_only=self.model.d_rec(rid).state != "RECEIVED")

    def _release(self, rid: str, notify_only: bool) -> None:
        if self._event(D0, ReleaseSent, rid, notify_only=notify_only) == "applied":
            req = self.requests[rid]
            for r in P_RANKS:
                for c in req.consumers[r]:
                    self.net.append(("rel", r, rid, D_ENGINE, c, req.token, False))

    @precondition(lambda self: self._d_in(*READING_STATES))
    @rule(data=st.data())
    def a_release_goes_out_before_the_reads_drained(self, data) -> None:
        """A stale or early release of D's own (what a READ-carried release would be)."""
        rid = data.draw(st.sampled_from(self._d_in(*READING_STATES)))
        req = self.requests[rid]
        r = data.draw(st.sampled_from(P_RANKS))
        for c in req.consumers[r]:
            self.net.append(("rel", r, rid, D_ENGINE, c, req.token, True))

    # --- heartbeats, acknowledgements and the network ----------------------------------

    def _heartbeat_round(self) -> None:
        due = sorted(policy.heartbeat_due(self.state, D0).get(P_ENGINE, []))
        assert set(due) == self.model.heartbeat_due()
        for rid in due:
            self._event(D0, HeartbeatSent, rid)
        tokens = tuple(self.requests[rid].token for rid in due)
        for r in P_RANKS:
            if due:
                self.net.append(("hb", r, tuple(due), D_ENGINE, tokens, self.t))

    @rule()
    def d_heartbeats(self) -> None:
        self._heartbeat_round()

    @rule(data=st.data(), kind=st.sampled_from(["rel", "hb"]),
          token=st.sampled_from(["stolen", "wrong", "none"]), rank=st.integers(0, 3))
    def an_impostor_speaks(self, data, kind, token, rank) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.requests), "never-seen"]))
        tok = {"stolen": getattr(self.requests.get(rid), "token", "x"), "wrong": "bogus",
               "none": ""}[token]
        r = data.draw(st.sampled_from(P_RANKS))
        if kind == "rel":
            self.net.append(("rel", r, rid, IMPOSTOR, rank, tok, True))
        else:
            self.net.append(("hb", r, (rid,), IMPOSTOR, (tok,), self.t))

    @precondition(lambda self: self.net)
    @rule(data=st.data(), fate=FATES)
    def the_network_moves_a_message(self, data, fate) -> None:
        i = data.draw(st.integers(0, len(self.net) - 1))  # any order: reordering
        msg = self.net[i] if fate == "duplicate" else self.net.pop(i)
        if fate != "lose":
            self._deliver(msg)

    @precondition(lambda self: self.net)
    @rule(data=st.data(), newest_first=st.booleans())
    def the_network_drains(self, data, newest_first) -> None:
        """Everything in flight arrives (or is lost, or comes twice), in one of two orders."""
        batch, self.net = self.net[::-1] if newest_first else self.net, []
        for msg in batch:
            fate = data.draw(FATES)
            if fate != "lose":
                self._deliver(msg)
            if fate == "duplicate":
                self._deliver(msg)

    def _deliver_all(self) -> None:
        while self.net:
            self._deliver(self.net.pop(0))

    def _deliver(self, msg: tuple) -> None:
        kind, r = msg[0], msg[1]
        stream = PS[r]
        if kind == "rel":
            _, _, rid, engine, consumer_rank, token, stale = msg
            outcome = self._event(stream, ReleaseNotified, rid, from_engine=engine,
                                  consumer_rank=consumer_rank, token=token)
            if outcome == "applied" and stale:
                self.requests[rid].tainted = True
        elif kind == "hb":
            _, _, rids, engine, tokens, sent_at = msg
            left = {}
            for rid, token in zip(rids, tokens, strict=True):
                self._event(stream, HeartbeatReceived, rid, from_engine=engine, token=token)
                got = policy.lease_time_left(self.state, stream, rid, self.t, engine=engine,
                                             token=token)
                assert got == self.model.time_left(r, rid, self.t, engine, token), rid
                left[rid] = got
            if engine == D_ENGINE:
                self.net.append(("ack", r, sent_at, left))
        else:
            _, _, sent_at, left = msg
            for rid, time_left in sorted(left.items()):
                self._event(D0, LeaseAcknowledged, rid, p_rank=r, sent_at=sent_at,
                            time_left=time_left)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), sent_at=st.sampled_from(["future", "past"]),
          time_left=st.sampled_from([-1.0, 0.0, 3.0, 50.0]))
    def a_forged_or_garbled_acknowledgement(self, data, sent_at, time_left) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        at = self.t + 1.0 if sent_at == "future" else 0.0
        self._event(D0, LeaseAcknowledged, rid, p_rank=data.draw(st.sampled_from(P_RANKS)),
                    sent_at=at, time_left=time_left)

    @rule(dt=st.sampled_from([0.01, 0.3, 2.0, 6.0, 11.0]))
    def time_passes(self, dt) -> None:
        self.t += dt

    @rule()
    def engines_forget_finished_requests(self) -> None:
        """Forgetting (`policy.to_forget`, two leases after the end) on every stream that
        finished a request; the driver then never names it again (re-use is tested apart)."""
        streams = (*PS, D0)
        due = {s: set(policy.to_forget(self.state, s, self.t, LEASE)) for s in streams}
        for rid in sorted(set().union(*due.values())):
            if all(rid in due[s] or self._fold_state(s, rid) == "NEW" for s in streams):
                for s in streams:
                    if rid in due[s]:
                        self._event(s, Forgotten, rid)
                del self.requests[rid]

    # --- anything else is refused and changes nothing ------------------------------------

    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def an_event_out_of_turn(self, data, side) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.requests), "never-seen"]))
        cls = data.draw(st.sampled_from(PRODUCER_EVENTS if side == "P" else CONSUMER_EVENTS))
        fields = {name: data.draw(strategy) for name, strategy in _FIELDS[cls.kind].items()}
        stream = PS[data.draw(st.sampled_from(P_RANKS))] if side == "P" else D0
        if stream.side is Side.P:
            predicted, _ = self.model.predict_p(stream.rank, cls.kind, rid, fields, self.t)
        else:
            predicted, _ = self.model.predict_d(cls.kind, rid, fields, self.t)
        if predicted[0] == "refused":  # (legal draws are the other rules' business)
            self._event(stream, cls, rid, **fields)

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def freed_exactly_once(self) -> None:
        for s in PS:
            ss = self.state.streams.get(s)
            frees = sum(1 for (r, _) in self.freed_at if r == s.rank)
            assert (ss.freed if ss else 0) == frees

    def teardown(self) -> None:
        # replay --check sees what the model saw: no served_unproven ever, and
        # served_freed exactly where a misled P freed bytes D then served.
        result = replay(self.log)
        found = Counter(v.invariant for v in result.violations
                        if v.invariant not in ("heartbeat_gap", "leak"))
        assert set(found) <= {"served_freed"}, result.violations
        flagged = {v.event.rsplit(" ", 1)[1] for v in result.violations
                   if v.invariant == "served_freed"}
        assert flagged == self.served_after_free


_FIELDS = {
    "prefill_started": {}, "freed": {}, "lease_expired": {}, "validated": {},
    "finished_recving": {}, "client_cancelled": {}, "heartbeat_sent": {}, "forgotten": {},
    "exported": {"lease_s": st.sampled_from([0.0, LEASE]),
                 "consumer_ranks": st.sampled_from([(), (0,)]), "num_blocks": st.just(2),
                 "token": st.just("")},
    "aborted": {"reason": st.just("x")},
    "heartbeat_received": {"from_engine": st.just(D_ENGINE), "token": st.just("")},
    "release_notified": {"from_engine": st.just(D_ENGINE), "consumer_rank": st.just(0),
                         "token": st.just("")},
    "admitted": {"remote_engine": st.sampled_from(["", P_ENGINE]), "remote_ranks": st.just((0,)),
                 "num_blocks": st.just(2), "lease_s": st.sampled_from([0.0, LEASE]),
                 "lease_margin_s": st.just(MARGIN), "local_request_id": st.just("x")},
    "rejected": {"reason": st.just("x")},
    "reads_posted": {"split_ranks": st.sampled_from([(), (0,), (0, 1)])},
    "split_completed": {"split": st.integers(0, 4)},
    "split_failed": {"split": st.integers(0, 4), "reason": st.just("x")},
    "lease_acknowledged": {"p_rank": st.just(0), "sent_at": st.just(0.0),
                           "time_left": st.just(1.0)},
    "release_sent": {"notify_only": st.booleans()},
    "fence_held": {"p_rank": st.sampled_from([0, 1, 2]),
                   "posted_at": st.sampled_from([0.0, 1e9])},
}
assert set(_FIELDS) == set(EVENT_TYPES)

STEPS = settings(settings(), stateful_step_count=80)
HandoffMachine.TestCase.settings = STEPS
TestHandoffLifecycle = HandoffMachine.TestCase


def test_every_arrow_of_both_graphs_is_taken():
    """Counted from the events the machine folded, not declared: run it here if it has not run."""
    if not ARROWS_TAKEN:
        run_state_machine_as_test(HandoffMachine, settings=STEPS)
    missing = sorted(all_arrows() - set(ARROWS_TAKEN))
    assert not missing, f"{len(missing)} arrows never taken: {missing}"
    # And nothing outside the graph was taken.
    assert set(ARROWS_TAKEN) <= all_arrows()

"""A reference model of the lifecycle, written from docs/lifecycle.md, not from the code.

It knows nothing of `core.lifecycle`: records are plain dataclasses, states
are strings, and every rule is spelled out here again from the documentation.
For each event it predicts the outcome — ``applied``, ``ignored`` (with the
reason the fold counts) or ``refused`` — and the record after it; for P's
answer to a heartbeat it predicts the time left; for D it predicts the read
verdict, the heartbeat set and which drained reads may be reported.

Order of a release's checks (docs/lifecycle.md): an unexpected consumer rank,
then a wrong token, then a wrong peer, then a duplicate.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

HEARTBEATING = frozenset({"ADMITTED", "VALIDATED", "REJECTED", "CANCELLED", "READING",
                          "CANCELLED_READING"})
READING_STATES = frozenset({"READING", "CANCELLED_READING"})
AFTER_RELEASE = frozenset({"RELEASED", "EXPIRED", "ABORTED", "FREED"})


@dataclass
class PRec:
    state: str = "NEW"
    lease: float = 0.0
    deadline: float = math.inf
    expected: frozenset = frozenset()
    notified: frozenset = frozenset()
    consumer: str = ""
    token: str = ""
    released: bool = False  # ended on its consumers' releases


@dataclass
class DRec:
    state: str = "NEW"
    lease: float = 0.0
    margin: float = 0.0
    split_ranks: tuple = ()
    done: list = field(default_factory=list)  # None in flight, float completed, "failed"
    failed: bool = False
    cancelled: bool = False
    bound: dict = field(default_factory=dict)  # P rank -> proven until (D's clock)
    held: dict = field(default_factory=dict)  # P rank -> latest sent_at answered alive
    gone: set = field(default_factory=set)
    last_hb: float = 0.0
    t0: float = 0.0  # admission


# An outcome is (kind, reason): ("applied", ""), ("ignored", reason) or ("refused", "").
APPLIED, REFUSED = ("applied", ""), ("refused", "")


def ignored(reason: str) -> tuple[str, str]:
    return ("ignored", reason)


class ReferenceModel:
    def __init__(self) -> None:
        self.p: dict[tuple[int, str], PRec] = {}  # (P rank, request)
        self.d: dict[str, DRec] = {}

    # --- producer -------------------------------------------------------------

    def p_rec(self, rank: int, rid: str) -> PRec:
        return self.p.get((rank, rid), PRec())

    def predict_p(self, rank: int, kind: str, rid: str, f: dict, t: float):
        """(outcome, record after) of P rank ``rank`` folding ``kind`` for ``rid``."""
        r = copy.deepcopy(self.p_rec(rank, rid))
        s = r.state
        if kind == "prefill_started":
            return (APPLIED, PRec(state="PREFILLING")) if s == "NEW" else (REFUSED, None)
        if kind == "exported":
            if s not in ("NEW", "PREFILLING") or f["lease_s"] <= 0 or not f["consumer_ranks"]:
                return REFUSED, None
            r.state, r.lease, r.deadline = "EXPORTED", f["lease_s"], t + f["lease_s"]
            r.expected, r.token = frozenset(f["consumer_ranks"]), f["token"]
            return APPLIED, r
        if kind == "aborted":
            return (APPLIED, PRec(state="ABORTED")) if s == "PREFILLING" else (REFUSED, None)
        if kind in ("heartbeat_received", "release_notified"):
            if s in ("NEW", "PREFILLING"):
                return ignored("unknown_request"), None
            if s in AFTER_RELEASE:
                return ignored("after_release"), None
            if kind == "release_notified" and f["consumer_rank"] not in r.expected:
                return ignored("unexpected_rank"), None
            if r.token and f["token"] != r.token:
                return ignored("bad_token"), None
            if r.consumer and f["from_engine"] != r.consumer:
                return ignored("wrong_peer"), None
            r.consumer = f["from_engine"]
            if kind == "heartbeat_received":
                r.deadline = max(r.deadline, t + r.lease)
                return APPLIED, r
            if f["consumer_rank"] in r.notified:
                return ignored("duplicate_release"), None
            r.notified = r.notified | {f["consumer_rank"]}
            if r.notified == r.expected:
                r.state, r.released = "RELEASED", True
            return APPLIED, r
        if kind == "lease_expired":
            if s != "EXPORTED" or t < r.deadline:
                return REFUSED, None
            r.state = "EXPIRED"
            return APPLIED, r
        if kind == "freed":
            if s not in ("RELEASED", "EXPIRED", "ABORTED"):
                return REFUSED, None
            r.state = "FREED"
            return APPLIED, r
        if kind == "forgotten":  # a freed request becomes unknown again
            return (APPLIED, PRec()) if s == "FREED" else (REFUSED, None)
        raise AssertionError(kind)

    def time_left(self, rank: int, rid: str, t: float, engine: str, token: str) -> float:
        """P's answer to ``engine``'s heartbeat (docs: > 0 alive, 0 released, < 0 gone)."""
        r = self.p_rec(rank, rid)
        if r.state in ("NEW", "PREFILLING"):
            return -1.0
        if (r.token and token != r.token) or (r.consumer and engine != r.consumer):
            return -1.0
        if r.state == "EXPORTED":
            return r.deadline - t if t < r.deadline else -1.0
        return 0.0 if r.released else -1.0

    def expired(self, rank: int, t: float) -> set[str]:
        return {rid for (k, rid), r in self.p.items()
                if k == rank and r.state == "EXPORTED" and t >= r.deadline}

    def to_free(self, rank: int) -> set[str]:
        return {rid for (k, rid), r in self.p.items()
                if k == rank and r.state in ("RELEASED", "EXPIRED", "ABORTED")}

    # --- consumer -------------------------------------------------------------

    def d_rec(self, rid: str) -> DRec:
        return self.d.get(rid, DRec())

    def predict_d(self, kind: str, rid: str, f: dict, t: float):
        r = copy.deepcopy(self.d_rec(rid))
        s = r.state
        if kind == "admitted":
            if s != "NEW" or not f["remote_engine"] or not f["remote_ranks"] or f["lease_s"] <= 0:
                return REFUSED, None
            return APPLIED, DRec(state="ADMITTED", lease=f["lease_s"],
                                 margin=f["lease_margin_s"], last_hb=t, t0=t)
        if kind == "lease_acknowledged":
            if s == "NEW":
                return ignored("unknown_request"), None
            if f["sent_at"] > r.last_hb or f["sent_at"] < r.t0:  # not this life's heartbeat
                return ignored("implausible_ack"), None
            self._acknowledge(r, f["p_rank"], f["sent_at"], f["time_left"])
            return APPLIED, r
        if s == "NEW":
            return REFUSED, None
        if kind == "validated":
            return self._move(r, s == "ADMITTED", "VALIDATED")
        if kind == "rejected":
            r.failed = True
            return self._move(r, s in ("ADMITTED", "VALIDATED"), "REJECTED")
        if kind == "client_cancelled":
            r.cancelled = True
            nxt = {"ADMITTED": "CANCELLED", "VALIDATED": "CANCELLED",
                   "READING": "CANCELLED_READING"}.get(s, s)
            return self._move(r, True, nxt)
        if kind == "reads_posted":
            r.split_ranks, r.done = tuple(f["split_ranks"]), [None] * len(f["split_ranks"])
            return self._move(r, s == "VALIDATED" and bool(f["split_ranks"]), "READING")
        if kind in ("split_completed", "split_failed"):
            i = f["split"]
            if s not in READING_STATES or not 0 <= i < len(r.done) or r.done[i] is not None:
                return REFUSED, None
            r.done[i] = t if kind == "split_completed" else "failed"
            r.failed = r.failed or kind == "split_failed"
            return APPLIED, r
        if kind == "fence_held":  # docs/lifecycle.md, "The fence"
            rank, at = f["p_rank"], f["posted_at"]
            if s not in READING_STATES or at > t or rank not in r.split_ranks:
                return REFUSED, None
            r.held[rank] = max(r.held.get(rank, -math.inf), at)
            r.bound[rank] = max(r.bound.get(rank, -math.inf), at)
            return APPLIED, r
        if kind == "heartbeat_sent":
            r.last_hb = t
            return self._move(r, s in HEARTBEATING, s)
        if kind == "finished_recving":
            if s not in READING_STATES or None in r.done:
                return REFUSED, None
            r.state = "RECEIVED" if self.verdict(r) == "CONFIRMED" else "FAILED"
            return APPLIED, r
        if kind == "release_sent":
            ok = (s == "RECEIVED" and not f["notify_only"]) or (
                s in ("VALIDATED", "FAILED", "REJECTED", "CANCELLED") and f["notify_only"])
            return self._move(r, ok, "DONE")
        if kind == "forgotten":  # a finished request becomes unknown again
            return (APPLIED, DRec()) if s == "DONE" else (REFUSED, None)
        raise AssertionError(kind)

    @staticmethod
    def _move(r: DRec, allowed: bool, to: str):
        if not allowed:
            return REFUSED, None
        r.state = to
        return APPLIED, r

    @staticmethod
    def _acknowledge(r: DRec, rank: int, sent_at: float, left: float) -> None:
        # docs/lifecycle.md, "D knows how long the source is safe".
        if left > 0:
            r.held[rank] = max(r.held.get(rank, -math.inf), sent_at)
            until = sent_at if rank in r.gone else sent_at + max(min(left, r.lease) - r.margin, 0)
            r.bound[rank] = max(r.bound.get(rank, -math.inf), until)
        else:
            r.bound[rank] = min(r.bound.get(rank, -math.inf), r.held.get(rank, -math.inf))
            r.gone.add(rank)

    @staticmethod
    def verdict(r: DRec) -> str:
        if r.failed:
            return "FAILED"
        unsafe = pending = False
        for rank, done in zip(r.split_ranks, r.done, strict=True):
            if done is None:
                pending = True
            elif done > r.bound.get(rank, -math.inf):
                unsafe, pending = unsafe or rank in r.gone, pending or rank not in r.gone
        return "UNSAFE" if unsafe else "PENDING" if pending else "CONFIRMED"

    def proven(self, rid: str) -> bool:
        """Every split of ``rid`` completed when its P rank provably held the source."""
        r = self.d_rec(rid)
        return all(isinstance(done, float) and done <= r.bound.get(rank, -math.inf)
                   for rank, done in zip(r.split_ranks, r.done, strict=True))

    def heartbeat_due(self) -> set[str]:
        return {rid for rid, r in self.d.items() if r.state in HEARTBEATING}

    def reportable(self) -> set[str]:
        return {rid for rid, r in self.d.items() if r.state in READING_STATES
                and None not in r.done and self.verdict(r) != "PENDING"}

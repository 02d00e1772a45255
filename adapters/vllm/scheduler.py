"""The scheduler half: tell vLLM what it must know, tell the worker what vLLM did.

It decides nothing about leases, heartbeats or releases (the worker's fold
does); it answers vLLM's questions from the request's own state:

* D, ``get_num_new_matched_tokens``: a remote-prefill request loads its
  prompt asynchronously (malformed params too: the worker then fails it
  through ``failed_recving``, so that request errors and the engine goes on),
  all of it, or all but the last token for a model with sliding-window or
  state groups (`core.planning.prefill_backoff`: D computes that token).
* P, ``on_new_request``: for such a model, a prefill for a remote decode
  leaves the prompt's last token out (``prefill_backoff``), so what P keeps
  of each group is what D needs to compute that token.
* D, ``request_finished``: if reads were handed to the worker and have not
  reported ``finished_recving``, vLLM must keep the destination blocks
  (``delay_free``) until they drain; the worker is told of the cancel.
* P, ``request_finished``: a completed prefill is exported (blocks of every
  group held, ``delay_free``) and its ``kv_transfer_params`` returned for
  the router, with each group's block ids clipped to what D reads
  (`core.planning.export_ids`); a prefill that ended otherwise is reported
  as aborted.

Every hook that takes a request is `contained`: whatever a request carries,
an exception fails that request (the worker is told with a ``Failure``) and
is logged once; nothing raises into vLLM's engine loop.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.vllm import timing
from kvhandoff.adapters.vllm.config import HandoffConfig
from kvhandoff.adapters.vllm.metadata import Admit, Export, Failure, Read, StepPlan
from kvhandoff.adapters.vllm.params import (
    FENCE_SLOT_KEY,
    LAYOUT_VERSION,
    PROTOCOL,
    MalformedTransferParams,
    parse_identity,
    parse_remote_prefill,
    well_formed_id,
)
from kvhandoff.core.fence import FenceSlots
from kvhandoff.core.groups import CacheLayout
from kvhandoff.core.planning import export_ids, prefill_backoff, tokens_loaded
from kvhandoff.core.safelog import bounded_repr, get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class _Track:
    read_sent: bool = False
    awaiting: bool = False


def _is_remote_prefill(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_prefill") not in (None, False)


def _is_remote_decode(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def contained(fallback: Callable[..., Any]) -> Callable:
    """Run a per-request hook; an exception is logged once and answered by ``fallback``."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def hook(self: HandoffScheduler, request: Any, *args: Any) -> Any:
            try:
                return method(self, request, *args)
            except Exception as exc:
                reason = f"{method.__name__}: {type(exc).__name__}: {exc}"
                log.error("vllm.scheduler.request_error",
                          request_id=getattr(request, "request_id", None), error=reason)
                return fallback(self, request, reason, *args)
        return hook
    return wrap


def _fail_at_admission(self: HandoffScheduler, request: Any, reason: str) -> None:
    if not self.producer:  # load "asynchronously" so the worker can fail it through vLLM
        self._d[request.request_id] = _Track()
        self._plan.failures.append(Failure(request.request_id, reason, awaiting=False))


def _fail_after_alloc(self: HandoffScheduler, request: Any, reason: str, blocks: Any,
                      num_external_tokens: int) -> None:
    track = self._d.get(request.request_id)
    if track is not None and not any(r.local_id == request.request_id for r in self._plan.reads):
        track.read_sent, track.awaiting = True, num_external_tokens > 0
        self._plan.failures.append(Failure(request.request_id, reason, track.awaiting))


def _no_match(self: HandoffScheduler, request: Any, reason: str, *_: Any) -> tuple[int, bool]:
    return 0, False


def _free_unless_read(self: HandoffScheduler, request: Any, reason: str,
                      *_: Any) -> tuple[bool, None]:
    """``request_finished`` raised: free only what no READ may own.

    On D a READ may be in flight into the request's pages while its track
    says it awaits one (`request_finished` pops the track last, so it is
    still here): delay the free and ask the worker for the report that
    returns the pages.  Freeing them would let vLLM reuse them under the READ.
    On P nothing was exported (no D can read it): vLLM frees the pages, and
    P's worker ends the record it started for the request.
    """
    rid = getattr(request, "request_id", None)
    if self.producer:
        if self._p.pop(rid, False):
            self._plan.aborted.append(rid)
        return False, None
    track = self._d.pop(rid, None)
    if track is None or not track.awaiting:
        return False, None
    try:
        self._plan.cancels.append(request.request_id)
    except Exception as exc:  # the pages stay held: a leak, never a READ into reused memory
        log.error("vllm.scheduler.cancel_not_planned", request_id=request.request_id,
                  error=f"{type(exc).__name__}: {exc}")
    return True, None


class HandoffScheduler:
    def __init__(self, cfg: HandoffConfig, engine_id: str, producer: bool, layout: CacheLayout,
                 tp_size: int) -> None:
        self.cfg, self.engine_id, self.producer = cfg, engine_id, producer
        self.layout, self.tp_size = layout, tp_size
        self.backoff = prefill_backoff(layout)
        self._plan = StepPlan()
        self._p: dict[str, bool] = {}  # P: request id -> prefill started
        # P: the fence slots (`core.fence`), one per live export, back once every P rank
        # reported the request freed (finished_sending): each rank cleared it by then.
        self.fence = FenceSlots(cfg.fence_slots)
        self._fence_of: dict[str, int] = {}  # P: request id -> its slot
        self._d: dict[str, _Track] = {}  # D: request id -> track

    # ---- common -----------------------------------------------------------

    @contained(_fail_at_admission)
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        rid = request.request_id
        if self.producer:
            if _is_remote_decode(params):
                if not well_formed_id(rid):
                    # D refuses such an id, so P would pin the blocks a whole lease for
                    # nothing: no hand-off (vLLM frees them; the router's D then computes
                    # the prompt itself).  vLLM makes the id from the client's
                    # X-Request-Id or request_id (`cmpl-<it>-<random>`).
                    log.error("vllm.connector.request_id_not_exportable",
                              request_id=rid, length=len(rid),
                              reason="request ids must be 1..256 printable characters")
                    return
                self._p[rid] = False
                self._truncate_for_prefill(request)
            return
        if params is None or not (_is_remote_prefill(params) or not isinstance(params, dict)):
            return
        error = ""
        wire: dict[str, Any] | None = None
        try:
            if params.get("do_remote_prefill") is not True:
                raise MalformedTransferParams(
                    f"kv_transfer_params['do_remote_prefill']: expected true, "
                    f"found {bounded_repr(params.get('do_remote_prefill'))}")
            wire = parse_remote_prefill(params).to_wire()
        except (MalformedTransferParams, AttributeError) as exc:
            error = str(exc) if isinstance(exc, MalformedTransferParams) else (
                f"kv_transfer_params: expected an object, found {type(params).__name__}")
            log.error("vllm.scheduler.malformed_transfer_params", request_id=rid, error=error)
        self._d[rid] = _Track()
        cleanup = bool(getattr(request, "abort_immediately", False))
        ident = parse_identity(params) if (error or cleanup) and isinstance(params, dict) else None
        self._plan.admits.append(Admit(rid, wire, error, len(request.prompt_token_ids or ()), ident,
                                       cleanup))

    def _truncate_for_prefill(self, request: Any) -> None:
        """P: leave the prompt's last ``backoff`` tokens to D (once, even if rescheduled)."""
        n = self.backoff
        params = request.kv_transfer_params
        if not n or params.get("_kvhandoff_truncated") or request.num_prompt_tokens <= n:
            return
        if request.prompt_token_ids is None:
            return  # prompt embeddings: not truncated, D recomputes nothing less
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params["_kvhandoff_truncated"] = True

    @contained(_no_match)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        track = self._d.get(request.request_id)
        if track is None or track.read_sent:
            return 0, False
        count = tokens_loaded(self.layout, len(request.prompt_token_ids or ())) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    @contained(_fail_after_alloc)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if self.producer:
            if self._p.get(rid) is False:
                self._p[rid] = True
                self._plan.prefill_started.append(rid)
            return
        track = self._d.get(rid)
        if track is None or track.read_sent:
            return
        track.read_sent = True
        track.awaiting = num_external_tokens > 0
        ids: list[list[int]] = []
        if track.awaiting:
            ids = self._load_targets(blocks, tokens_loaded(self.layout, len(request.prompt_token_ids)))
            timing.note(rid, "scheduled")
        self._plan.reads.append(Read(rid, ids, track.awaiting))

    def _load_targets(self, blocks: Any, num_tokens: int) -> list[list[int]]:
        """D: per group, the blocks that will hold the loaded tokens, in position order.

        A block group's list stops at the loaded tokens' last block (a block
        allocated for a token D computes itself is not a target) and leaves
        out the blocks of a local prefix-cache hit (hashed: D holds them
        already) and the null blocks (positions a sliding window does not
        keep, or before a state slot): what is left are the last positions,
        which `plan_group_reads` aligns with P's lists at their ends.  (Nulls
        kept as placeholders would misalign a window that a local hit
        reaches into.)  A state group's list is its slot(s).
        """
        out = []
        for g, group in zip(self.layout.groups, self.layout.select(blocks.blocks), strict=True):
            if not g.kind.reads_state:
                group = group[:-(-num_tokens // g.block_size)]
            out.append([b.block_id for b in group if b.block_hash is None and not b.is_null])
        return out

    def build_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_connector_output(self, finished_recving: set[str] | None,
                                finished_sending: set[str] | None = None) -> None:
        for rid in finished_sending or ():  # every P rank freed it (and cleared its slot)
            slot = self._fence_of.pop(rid, None)
            if slot is not None:
                self.fence.give_back(slot)
        for rid in finished_recving or ():
            timing.note(rid, "recved")
            track = self._d.get(rid)
            if track is not None:
                track.awaiting = False

    @contained(_free_unless_read)
    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if self.producer:
            if rid not in self._p:
                return False, None
            # Forget the request last, as on D: if anything here raises, the fallback
            # still sees that P's worker started it, and ends it there.
            started = self._p[rid]
            done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                      RequestStatus.FINISHED_STOPPED)
            n = request.num_computed_tokens
            blocks = (export_ids(self.layout, self.layout.select(block_ids), n)
                      if done and block_ids else ())
            if done and any(blocks):
                # The release token makes the lease a capability: only an
                # engine holding these params can extend or release it.
                token = secrets.token_hex(16)
                # None: every slot is live, this export has no fence.  An id whose earlier
                # life still holds a slot (only without vLLM's id randomization) gets none:
                # P refuses that export, and the slot would never come back.
                slot = None if rid in self._fence_of else self.fence.take()
                if slot is not None:
                    self._fence_of[rid] = slot
                params = {
                    **({} if slot is None else {FENCE_SLOT_KEY: slot}),
                    "do_remote_prefill": True, "do_remote_decode": False, "protocol": PROTOCOL,
                    "remote_engine_id": self.engine_id, "remote_request_id": rid,
                    "remote_host": self.cfg.side_channel_host,
                    "remote_port": self.cfg.side_channel_port, "tp_size": self.tp_size,
                    "pp_size": 1, "dcp_size": 1, "remote_block_ids": [list(g) for g in blocks],
                    "remote_num_tokens": n, "lease_s": self.cfg.lease_s,
                    "release_token": token, "cache_layout_version": LAYOUT_VERSION,
                }
                self._plan.exports.append(Export(rid, sum(map(len, blocks)), token, slot))
                del self._p[rid]
                return True, params
            del self._p[rid]
            if started:
                self._plan.aborted.append(rid)
            return False, None
        track = self._d.get(rid)
        if track is None:
            return False, None
        # Decide, then forget the track last: if anything here raises, the
        # fallback still sees whether a READ may own the pages.
        delay = track.awaiting
        if delay or not track.read_sent:
            # Reads in flight own D's destination blocks: keep them until the
            # worker reports finished_recving (it keeps heartbeating P too).
            # Never read: the worker sends a notify-only release.
            self._plan.cancels.append(rid)
        del self._d[rid]
        return delay, None

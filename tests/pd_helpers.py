"""Helpers of the end-to-end tests that drive a P/D pair of engine processes (`PDPair`).

Shared by the hybrid-model and MultiConnector tests: prompts, the
single-engine reference (P decoding alone), a hand-off, the event logs, and
the abort-during-the-reads check every composition must pass.
"""

from __future__ import annotations

import itertools

from conftest import wait_for

from kvhandoff.adapters.vllm.cluster import PDPair
from kvhandoff.adapters.vllm.demo import prompts_for
from kvhandoff.adapters.vllm.params import DEBUG_DELAY_KEY, DEBUG_HOLD_KEY
from kvhandoff.core.log import read_log

OUT = 8
_counter = itertools.count()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """One seeded prompt of each length."""
    return [prompts_for(1, n, n, seed=seed + i)[0] for i, n in enumerate(lengths)]


def log_of(pd: PDPair, side: str) -> list:
    handle = pd.p if side == "P" else pd.d
    (path,) = [p for p in handle.flush() if f".{side}0." in p]
    return read_log(path)


def events(pd: PDPair, side: str, p_request_id: str) -> list:
    return [e for e in log_of(pd, side) if e.request_id == p_request_id]


def reference(pd: PDPair, prompt_list: list[list[int]]) -> list[list[int]]:
    """P decoding alone: the single-engine reference."""
    refs = [f"ref-{next(_counter)}" for _ in prompt_list]
    for rid, p in zip(refs, prompt_list, strict=True):
        pd.p.add(rid, p, OUT)
    done = pd.p.wait_done(refs)
    return [done[r]["token_ids"] for r in refs]


def hand_off(pd: PDPair, prompt: list[int], extra: dict | None = None,
             d_prompt: list[int] | None = None) -> tuple[str, dict]:
    """P prefills ``prompt``; D decodes ``d_prompt`` (default the same) with P's params."""
    rid = f"h-{next(_counter)}"
    params = pd.prefill([rid], [prompt])[rid]["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    pd.d.add(rid, prompt if d_prompt is None else d_prompt, OUT, {**params, **(extra or {})})
    return rid, params


def abort_during_the_reads(pd: PDPair, prompt: list[int], lease_s: float) -> tuple[dict, list, list]:
    """The client aborts while D's reads (slowed past a whole lease) are in flight.

    Checks what must hold: D reports the request once, after every split it
    posted completed; P's lease never lapses (only D's heartbeats keep it)
    and P frees once, no earlier than that report.  Returns (params, P's
    events, D's events) for the caller's own checks.
    """
    slow = lease_s * 1.5  # from the abort on, however late the engine hears it
    rid, params = hand_off(pd, prompt, {DEBUG_DELAY_KEY: slow, DEBUG_HOLD_KEY: True})
    p_rid = params["remote_request_id"]
    wait_for(lambda: any(e.kind == "reads_posted" for e in events(pd, "D", p_rid)), 60,
             "D to post its reads", interval=0.05)
    pd.d.abort([rid])
    assert pd.d.wait_done([rid])[rid]["finish_reason"] == "aborted"
    p_evs = wait_for(lambda: (evs := events(pd, "P", p_rid))
                     and any(e.kind == "freed" for e in evs) and evs,
                     slow + lease_s + 10, f"P to free {p_rid}", interval=0.2)
    d_evs = events(pd, "D", p_rid)
    t_recv = [e.t for e in d_evs if e.kind == "finished_recving"]
    assert len(t_recv) == 1, [e.kind for e in d_evs]
    posted = next(e for e in d_evs if e.kind == "reads_posted")
    done = [e for e in d_evs if e.kind == "split_completed"]
    assert sorted(e.split for e in done) == list(range(len(posted.split_ranks)))
    assert all(e.t <= t_recv[0] for e in done)
    kinds = [e.kind for e in p_evs]
    assert "lease_expired" not in kinds, "P's lease lapsed under a read"
    assert kinds.count("freed") == 1, kinds
    assert next(e.t for e in p_evs if e.kind == "freed") >= t_recv[0]
    return params, p_evs, d_evs

"""`kvhandoff demo`: a real P → D hand-off inside two vLLM engines on this machine.

Writes a tiny seeded model (a Llama, or with ``model`` a Gemma-3 whose
sliding-window and full-attention layers are two KV cache groups, or a
Mamba2 whose state is one), starts a prefill (P) and a decode (D) engine
with `KVHandoffConnector` over NIXL host memory, and sends a batch through
P → D the way a disaggregating router does.  Some requests are cancelled by
the client while their READs are in flight (the abort comes once D has
posted them, and D holds them on purpose until ``slow_read_s`` after it,
``kvhandoff_debug_hold_read_until_cancelled``), one carries malformed
transfer parameters.  It checks every completed request against a single-engine
greedy reference (P decoding the same prompt by itself), replays both event
logs with the core's invariant check, and summarizes.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.adapters.vllm.cluster import PDConfig, PDPair
from kvhandoff.adapters.vllm.config import HandoffConfig
from kvhandoff.adapters.vllm.params import DEBUG_DELAY_KEY, DEBUG_HOLD_KEY
from kvhandoff.adapters.vllm.tiny_model import write_tiny_model


@dataclass(slots=True)
class DemoOptions:
    model: str = "llama"  # adapters.vllm.tiny_model.TINY_MODEL_KINDS
    requests: int = 12
    cancel: int = 3
    prompt_tokens: tuple[int, int] = (200, 420)
    output_tokens: int = 16
    # the connector's own default: a lease shorter than a stall of the machine frees
    # what D had yet to read (D then fails those requests, as it must)
    lease_s: float = HandoffConfig().lease_s
    slow_read_s: float = 1.5
    seed: int = 0
    workdir: str | None = None


def prompts_for(n: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


# What a demo reports of `analyse_logs` (both demos, the same keys).
REPORTED = ("p_exports", "p_frees", "double_frees", "lease_expiries", "notify_only_releases",
            "replay_violations", "violations", "state_hash")


def reported(analysis: dict[str, Any]) -> dict[str, Any]:
    return {key: analysis[key] for key in REPORTED}


def analyse_logs(paths: list[str]) -> dict[str, Any]:
    """Replay P's and D's logs together (the core's check) and count what happened."""
    from kvhandoff.core.events import Side
    from kvhandoff.core.log import read_logs
    from kvhandoff.core.replay import replay

    events = read_logs(paths)
    result = replay(events)
    summary = result.summary()
    kinds = Counter((e.stream.side, e.kind) for e in events)
    frees = Counter(e.request_id for e in events if e.stream.side is Side.P and e.kind == "freed")
    return {
        "events": summary["events"],
        "replay_violations": len(summary["violations"]),
        "violations": summary["violations"][:10],
        "state_hash": summary["state_hash"],
        "p_exports": kinds[(Side.P, "exported")],
        "p_frees": kinds[(Side.P, "freed")],
        "double_frees": sum(1 for c in frees.values() if c > 1),
        "lease_expiries": kinds[(Side.P, "lease_expired")],
        "releases_received": kinds[(Side.P, "release_notified")],
        "d_rejected": kinds[(Side.D, "rejected")],
        "d_cancelled": kinds[(Side.D, "client_cancelled")],
        "notify_only_releases": sum(1 for e in events if e.kind == "release_sent"
                                    and getattr(e, "notify_only", False)),
        "freed_under_read": summary["freed_under_read"],
    }


def _events(path: Path, rid: str | None = None) -> list:
    from kvhandoff.core.log import read_log

    if not path.exists():
        return []
    evs = read_log(path)  # a live log: a torn last line is dropped with a warning
    return evs if rid is None else [e for e in evs if e.request_id == rid]


def _wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return value


def wait_for_frees(pair: PDPair, timeout_s: float) -> dict[str, Any]:
    """Wait until P has freed every request it exported (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        p = next(iter(pair.p.stats().values()), {})
        if p.get("frees", 0) >= p.get("leases_exported", 0) or time.monotonic() > deadline:
            return p
        time.sleep(0.2)


def run_demo(opts: DemoOptions, progress: Any = None) -> dict[str, Any]:
    """Run the demo; ``progress(stage, detail)`` is told what is happening."""
    say = progress or (lambda stage, detail="": None)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="kvhandoff-demo-"))
    model = write_tiny_model(opts.model, workdir / f"model-{opts.model}")
    say("model", str(model))
    cfg = PDConfig(
        model_dir=str(model), connector="kvhandoff", workdir=str(workdir),
        extra_config={"lease_s": opts.lease_s},
        d_extra_config={"debug_read_delay_param": True}, tag="demo",
        # Mamba state is handed off with mamba_cache_mode 'none' (no prefix cache).
        enable_prefix_caching=opts.model != "mamba2",
    )
    t0 = time.monotonic()
    pair = PDPair(cfg)
    try:
        say("starting", "P and D engines")
        while not (pair.p.poll_ready() and pair.d.poll_ready()):
            say("starting", f"P {'ready' if pair.p.pid else 'loading'}, "
                            f"D {'ready' if pair.d.pid else 'loading'}")
            time.sleep(0.25)
        start_s = time.monotonic() - t0
        say("ready", f"engines up in {start_s:.0f}s")

        n = opts.requests
        prompts = prompts_for(n, *opts.prompt_tokens, seed=opts.seed)
        rids = [f"demo-{i}" for i in range(n)]
        # Single-engine greedy reference: P decodes each prompt by itself.
        say("reference", f"{n} prompts decoded on one engine")
        for rid, p in zip(rids, prompts, strict=True):
            pair.p.add(f"ref-{rid}", p, opts.output_tokens)
        ref = pair.p.wait_done([f"ref-{r}" for r in rids])

        say("prefill", f"{n} prompts on P")
        pre = pair.prefill(rids, prompts)
        cancel = set(rids[1:1 + 3 * opts.cancel:3][:opts.cancel])
        malformed = rids[-1]
        params: dict[str, dict[str, Any]] = {}
        for rid in rids:
            p = dict(pre[rid]["kv_transfer_params"] or {})
            if rid in cancel:
                p[DEBUG_DELAY_KEY] = opts.slow_read_s  # held until that long after the abort
                p[DEBUG_HOLD_KEY] = True
            if rid == malformed:
                p["remote_block_ids"] = [[-1, "not-a-block"]]
            params[rid] = p

        say("decode", f"{n} requests on D ({len(cancel)} cancelled mid-read, 1 malformed)")
        for rid, prompt in zip(rids, prompts, strict=True):
            pair.d.add(rid, prompt, opts.output_tokens, params[rid])
        # Their READs are held from the abort on: abort once D has posted them all.
        held = {params[rid]["remote_request_id"] for rid in cancel}
        try:
            _wait(lambda: held <= {e.request_id for path in pair.d.event_logs
                                   for e in _events(Path(path)) if e.kind == "reads_posted"},
                  60, "D to post the cancelled requests' READs")
        except TimeoutError:
            pass  # aborted anyway: cancelled before their READs, which the summary shows
        pair.d.abort(sorted(cancel))
        done = pair.d.wait_done(rids, timeout_s=120)

        say("draining", "waiting for P to free every exported request")
        wait_for_frees(pair, opts.lease_s + 10)
        logs = pair.p.flush() + pair.d.flush()
        say("replay", " ".join(logs))
        analysis = analyse_logs(logs)
    finally:
        pair.stop()

    completed = [r for r in rids if done[r]["finish_reason"] == "length"]
    mismatched = [r for r in completed if done[r]["token_ids"] != ref[f"ref-{r}"]["token_ids"]]
    distinct_outputs = len({tuple(done[r]["token_ids"]) for r in completed})
    return {
        "model": opts.model,
        "requests": n,
        "completed": len(completed),
        "tokens_match": bool(completed) and not mismatched,
        "mismatched": mismatched,
        "distinct_outputs": distinct_outputs,
        "cancelled": sum(1 for r in rids if done[r]["finish_reason"] == "aborted"),
        "rejected": sum(1 for r in rids if done[r]["finish_reason"] == "error"),
        "malformed_finish_reason": done[malformed]["finish_reason"],
        **reported(analysis),
        "d_ttft_ms_median": _median([done[r]["ttft_ms"] for r in completed]),
        "transfer_ms_median": _median([done[r]["transfer_ms"] for r in completed]),
        "engine_start_s": round(start_s, 1),
        "event_logs": logs,
        "replay_command": "kvhandoff replay --check " + " ".join(logs),
        "workdir": str(workdir),
    }


def p_and_replay_problems(s: dict[str, Any]) -> list[str]:
    """What both demos check of P's frees and of the replay, when it failed."""
    return [why for failed, why in [
        (s["p_frees"] != s["p_exports"],
         f"P exported {s['p_exports']} requests and freed {s['p_frees']}"),
        (s["double_frees"] != 0, f"P freed {s['double_frees']} request(s) twice"),
        (s["replay_violations"] != 0, f"replay --check: {s['replay_violations']} violations"),
    ] if failed]


def demo_problems(s: dict[str, Any]) -> list[str]:
    """The demo's checks that failed, each named with what was found (empty: all held)."""
    return [why for failed, why in [
        (not s["tokens_match"], f"tokens do not equal the reference (mismatched: {s['mismatched']})"),
        (s["completed"] == 0, "no request completed"),
    ] if failed] + p_and_replay_problems(s)

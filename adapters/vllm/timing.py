"""Scheduler-side transfer timings, measured the same way for every connector.

The benchmark compares kvhandoff's connector with vLLM's own NixlConnector,
so both must be timed by the same hooks: D's scheduler notes when it handed a
read to the worker (``update_state_after_alloc`` with external tokens) and
when the worker reported the request in ``finished_recving``.  Both happen in
the engine-core process, which the demo runs in-process with the engine
server, so a module-level table is enough.  Times are ``time.monotonic()``.
"""

from __future__ import annotations

import time
from typing import Any

# internal vLLM request id -> {"scheduled": t, "recved": t}; the newest KEEP requests (a
# served engine notes every request and nobody takes them: the table must not grow).  A
# harness with more than KEEP hand-offs in flight would find the oldest ones' times gone.
_TIMINGS: dict[str, dict[str, float]] = {}
KEEP = 4096


def note(request_id: str, what: str, t: float | None = None) -> None:
    entry = _TIMINGS.get(request_id)
    if entry is None:
        if len(_TIMINGS) >= KEEP:
            del _TIMINGS[next(iter(_TIMINGS))]  # the oldest noted
        entry = _TIMINGS[request_id] = {}
    entry.setdefault(what, time.monotonic() if t is None else t)


def take(request_id: str) -> dict[str, float] | None:
    return _TIMINGS.pop(request_id, None)


def transfer_ms(entry: dict[str, float] | None) -> float | None:
    if not entry or "scheduled" not in entry or "recved" not in entry:
        return None
    return (entry["recved"] - entry["scheduled"]) * 1e3


def _timed_nixl_connector() -> type:
    """vLLM's NixlConnector with the two timing hooks, nothing else changed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    class TimedNixlConnector(NixlConnector):
        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
            if num_external_tokens > 0:
                note(request.request_id, "scheduled")
            return super().update_state_after_alloc(request, blocks, num_external_tokens)

        def update_connector_output(self, connector_output: Any):
            now = time.monotonic()
            for rid in connector_output.finished_recving or ():
                note(rid, "recved", now)
            return super().update_connector_output(connector_output)

    return TimedNixlConnector


def __getattr__(name: str) -> Any:
    # vLLM loads ``kv_connector`` by name from ``kv_connector_module_path``;
    # building the class lazily keeps ``import kvhandoff.adapters.vllm.timing``
    # free of vLLM imports.
    if name == "TimedNixlConnector":
        cls = _timed_nixl_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(name)

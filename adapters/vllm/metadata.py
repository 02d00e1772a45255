"""What the scheduler half tells the worker half each step.

Plain data (vLLM ships it to worker processes with its own serializer).  The
scheduler never decides lifecycle steps itself: it reports what vLLM did
(a request arrived, got blocks, finished, was aborted) and the worker's fold
decides what that means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Admit:
    """D: a request with remote-prefill params arrived (``params`` already parsed, or ``error``)."""

    local_id: str
    params: dict[str, Any] | None
    error: str
    num_prompt_tokens: int
    identity: tuple[str, str, str, int, str] | None = None  # (engine, request, host, port, token)
    # vLLM's API server re-submits a failed or disconnected request's params as
    # a pre-aborted request (``notify_kv_transfer_request_rejected``): nothing
    # is read for it; P is told to release if this D never took the request.
    cleanup: bool = False


@dataclass(slots=True)
class Read:
    """D: vLLM allocated ``local_block_ids`` to fill for the request.

    One list per KV cache group, in position order, ending at the loaded
    tokens' last block; blocks D holds from its own prefix cache and null
    blocks are left out (`HandoffScheduler._load_targets`).  ``awaiting`` is False for a full
    local prefix hit: nothing to read, the scheduler is not waiting for a
    completion.
    """

    local_id: str
    local_block_ids: list[list[int]]
    awaiting: bool = True


@dataclass(slots=True)
class Export:
    """P: prefill finished; ``num_blocks`` blocks stay pinned under a lease."""

    request_id: str
    num_blocks: int
    token: str = ""
    fence_slot: int | None = None  # its slot in every P rank's fence region (`core.fence`)


@dataclass(slots=True)
class Failure:
    """D: the scheduler half could not handle this request; the worker fails it (once)."""

    local_id: str
    reason: str
    awaiting: bool  # vLLM waits for a finished_recving for it


def _new_list() -> list:
    return []


@dataclass(slots=True)
class StepPlan:
    # P
    prefill_started: list[str] = field(default_factory=_new_list)
    exports: list[Export] = field(default_factory=_new_list)
    aborted: list[str] = field(default_factory=_new_list)
    # D
    admits: list[Admit] = field(default_factory=_new_list)
    reads: list[Read] = field(default_factory=_new_list)
    cancels: list[str] = field(default_factory=_new_list)
    failures: list[Failure] = field(default_factory=_new_list)

    def empty(self) -> bool:
        return not (self.prefill_started or self.exports or self.aborted or self.admits
                    or self.reads or self.cancels or self.failures)


def metadata_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    class KVHandoffMetadata(KVConnectorMetadata):
        def __init__(self, plan: StepPlan) -> None:
            self.plan = plan

    return KVHandoffMetadata

"""``kv_transfer_params``: what P hands the router and the router hands D.

P emits them from ``request_finished``; the router passes them to D
unchanged; D parses them here before anything else touches them.  The field
names follow vLLM's NixlConnector so routers written for it need no change.
Anything missing, of the wrong type or out of range raises
`MalformedTransferParams` naming the field: that request fails, the engine
keeps serving.  Range checks that need P's geometry (block ids against P's
pool) happen after the handshake, in the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.core.errors import MalformedMessage
from kvhandoff.core.groups import SCHEMA_VERSION as LAYOUT_VERSION
from kvhandoff.core.policy import MAX_LEASE_S, MIN_LEASE_S
from kvhandoff.core.safelog import bounded_repr

MAX_GROUPS = 64

PROTOCOL = "kvhandoff/1"
DEBUG_DELAY_KEY = "kvhandoff_debug_read_delay_s"
# With it, the delay runs from the client's cancel, not the READ's post (`IncomingHandoff.due`).
DEBUG_HOLD_KEY = "kvhandoff_debug_hold_read_until_cancelled"
UNCANCELLED_HOLD_S = 60.0  # a READ held until its client cancels, when none does
FENCE_SLOT_KEY = "kvhandoff_fence_slot"  # absent: the export has no fence


class MalformedTransferParams(MalformedMessage):
    """kv_transfer_params that do not describe a remote prefill."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A parsed, type-checked remote prefill as D sees it."""

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV cache group, in group order
    num_tokens: int
    lease_s: float
    debug_read_delay_s: float = 0.0  # honoured only where D enables debug_read_delay_param
    token: str = ""  # P's release capability: heartbeats and releases must carry it
    fence_slot: int | None = None  # the export's slot in P's fence region (`core.fence`)
    debug_hold_until_cancelled: bool = False  # with debug_read_delay_s, where D honours it

    def to_wire(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "protocol": PROTOCOL,
            "remote_engine_id": self.engine_id, "remote_request_id": self.request_id,
            "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
            "pp_size": 1, "dcp_size": 1, "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_num_tokens": self.num_tokens, "lease_s": self.lease_s,
            DEBUG_DELAY_KEY: self.debug_read_delay_s, "release_token": self.token,
            **({} if self.fence_slot is None else {FENCE_SLOT_KEY: self.fence_slot}),
            **({DEBUG_HOLD_KEY: True} if self.debug_hold_until_cancelled else {}),
            "cache_layout_version": LAYOUT_VERSION,
        }


def well_formed_id(value: str) -> bool:
    """1..256 printable characters: engine ids, request ids and hosts are logged as text,
    where a control character could forge or rewrite a line."""
    return 0 < len(value) <= 256 and value.isprintable()


def _well_formed_token(token: Any) -> bool:
    return isinstance(token, str) and len(token) <= 128 and token.isprintable()


def _get(params: dict[str, Any], name: str, kind: type) -> Any:
    if name not in params:
        raise MalformedTransferParams(f"kv_transfer_params: missing field {name!r}")
    v = params[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise MalformedTransferParams(
            f"kv_transfer_params[{name!r}]: expected {kind.__name__}, found {type(v).__name__} {bounded_repr(v)}")
    return v


def parse_remote_prefill(params: Any, max_block_id: int = 1 << 31) -> RemotePrefill:
    """Parse D's ``kv_transfer_params``; raise `MalformedTransferParams` naming the field."""
    if not isinstance(params, dict):
        raise MalformedTransferParams(
            f"kv_transfer_params: expected an object, found {type(params).__name__}")
    if params.get("protocol", PROTOCOL) != PROTOCOL:
        raise MalformedTransferParams(
            f"kv_transfer_params['protocol']: expected {PROTOCOL!r}, found {bounded_repr(params.get('protocol'))}"
            " (were these produced by another connector?)")
    engine = _get(params, "remote_engine_id", str)
    rid = _get(params, "remote_request_id", str)
    host = _get(params, "remote_host", str)
    port = _get(params, "remote_port", int)
    tp = _get(params, "tp_size", int)
    num_tokens = _get(params, "remote_num_tokens", int)
    lease = params.get("lease_s", 30.0)
    for name, value in (("remote_engine_id", engine), ("remote_request_id", rid),
                        ("remote_host", host)):
        if not value or len(value) > 256:
            raise MalformedTransferParams(f"kv_transfer_params[{name!r}]: empty or longer than 256")
        if not value.isprintable():  # logged as text: a control character could forge a line
            raise MalformedTransferParams(
                f"kv_transfer_params[{name!r}]: expected printable characters, found {bounded_repr(value)}")
    if not host.isascii():  # D dials these bytes: the trust list must compare exactly them
        raise MalformedTransferParams(
            f"kv_transfer_params['remote_host']: expected an ASCII host name or address (an "
            f"internationalized name in its xn-- form), found {bounded_repr(host)}")
    if not 0 < port < 65536:
        raise MalformedTransferParams(f"kv_transfer_params['remote_port']: expected 1..65535, found {port}")
    if tp < 1:
        raise MalformedTransferParams(f"kv_transfer_params['tp_size']: expected >= 1, found {tp}")
    if num_tokens < 1:
        raise MalformedTransferParams(
            f"kv_transfer_params['remote_num_tokens']: expected >= 1, found {num_tokens}")
    if (isinstance(lease, bool) or not isinstance(lease, int | float)
            or not MIN_LEASE_S <= lease <= MAX_LEASE_S):
        # Bounded: D remembers a request two leases after it ends (single-use), and
        # heartbeats every sixth of the shortest lease it holds from a P rank.
        raise MalformedTransferParams(
            f"kv_transfer_params['lease_s']: expected a number in [{MIN_LEASE_S:g}, "
            f"{MAX_LEASE_S:g}], found {bounded_repr(lease)}")
    # Required: every P of this protocol sends it (``to_wire``, the scheduler's
    # request_finished); params without it were not written by one.
    version = _get(params, "cache_layout_version", int)
    if version != LAYOUT_VERSION:
        raise MalformedTransferParams(
            f"kv_transfer_params['cache_layout_version']: expected {LAYOUT_VERSION}, found "
            f"{bounded_repr(version)} (P and D run different kvhandoff versions)")
    block_ids = _block_ids(_get(params, "remote_block_ids", list), max_block_id)
    delay = params.get(DEBUG_DELAY_KEY, 0.0)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 600:
        raise MalformedTransferParams(f"kv_transfer_params[{DEBUG_DELAY_KEY!r}]: expected 0..600, found {bounded_repr(delay)}")
    hold = params.get(DEBUG_HOLD_KEY, False)
    if type(hold) is not bool:
        raise MalformedTransferParams(f"kv_transfer_params[{DEBUG_HOLD_KEY!r}]: expected true or "
                                      f"false, found {bounded_repr(hold)}")
    token = params.get("release_token", "")
    if not _well_formed_token(token):
        raise MalformedTransferParams("kv_transfer_params['release_token']: expected a string "
                                      f"of at most 128 printable characters, found {bounded_repr(token)}")
    slot = params.get(FENCE_SLOT_KEY)
    if slot is not None and (type(slot) is not int or not 0 <= slot < 1 << 31):
        raise MalformedTransferParams(f"kv_transfer_params[{FENCE_SLOT_KEY!r}]: expected an "
                                      f"integer in [0, 2**31), found {bounded_repr(slot)}")
    return RemotePrefill(engine, rid, host, port, tp, block_ids, num_tokens, float(lease),
                         float(delay), token, slot, hold)


def _block_ids(groups: list, max_block_id: int) -> tuple[tuple[int, ...], ...]:
    """``remote_block_ids``: one list per KV cache group (NixlConnector's shape), each of
    distinct ids.  Two groups may name one block: a group vLLM plans as one (one block
    table) that both sides describe as two (a HiSparse pair's ``SPARSE`` and ``INDEXER``
    layers, `adapters.vllm.layout`) hands the same ids to both; D never writes one local
    block twice (`core.planning.plan_group_reads` checks its own ids)."""
    field = "kv_transfer_params['remote_block_ids']"
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise MalformedTransferParams(f"{field}: expected 1..{MAX_GROUPS} lists (one per KV "
                                      f"cache group), found {len(groups)}")
    out = []
    for g, ids in enumerate(groups):
        if not isinstance(ids, list):
            raise MalformedTransferParams(f"{field}[{g}]: expected a list of block ids, found "
                                          f"{type(ids).__name__}")
        seen: set[int] = set()
        for i, b in enumerate(ids):
            if isinstance(b, bool) or not isinstance(b, int):
                raise MalformedTransferParams(
                    f"{field}[{g}][{i}]: expected int, found {type(b).__name__}")
            if not 0 <= b < max_block_id:
                raise MalformedTransferParams(
                    f"{field}[{g}][{i}]: expected 0..{max_block_id - 1}, found {b}")
            if b in seen:
                raise MalformedTransferParams(f"{field}[{g}][{i}]: duplicate block id {b}")
            seen.add(b)
        out.append(tuple(ids))
    if not any(out):
        raise MalformedTransferParams(f"{field}: empty")
    return tuple(out)


def parse_identity(params: Any) -> tuple[str, str, str, int, str] | None:
    """(engine, request id, host, port, token) when those fields alone are well-formed.

    Lets D tell the right P to free a request whose other fields are bad.
    """
    try:
        engine = _get(params, "remote_engine_id", str)
        rid = _get(params, "remote_request_id", str)
        host = _get(params, "remote_host", str)
        port = _get(params, "remote_port", int)
    except (MalformedTransferParams, TypeError, AttributeError):
        return None
    token = params.get("release_token", "")
    if (not all(map(well_formed_id, (engine, rid, host))) or not host.isascii()
            or not _well_formed_token(token)):
        return None
    return (engine, rid, host, port, token) if 0 < port < 65536 else None

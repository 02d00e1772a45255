"""The side channel: D and P swap agent metadata and check they can talk.

One ZMQ round trip per (D rank, P rank) pair.  D sends a hello and its own
agent metadata; P checks compatibility, adds D as a peer (so it can answer
heartbeats) and replies with its hello and metadata; D checks again.  Frames
are a JSON header (orjson) and the raw NIXL metadata bytes: nothing on this
wire is ever unpickled, and no frame over `MAX_FRAME_BYTES` is taken.

A mismatch in anything that decides the byte layout of a block (model,
dtype, block size, KV heads, head size, layers, TP size, and the cache
groups: kinds, block sizes, windows, regions and their bytes per block,
`core.groups.CacheLayout.check_matches`) is a `PeerIncompatible` naming the
field (and the group) and both values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import orjson

from kvhandoff.adapters.vllm.params import well_formed_id
from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.groups import CacheLayout, GroupMismatch, MalformedGroups
from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)

WIRE = "kvhandoff-side/1"
# The largest frame either side takes: NIXL agent metadata is kilobytes to a few MiB.  ZMQ
# buffers a whole frame before we see it, so without a bound anyone who reaches P's port
# could make P's process hold gigabytes (ZMQ drops the connection of a peer that sends more).
MAX_FRAME_BYTES = 64 << 20
RCVHWM = 16  # hellos queued per connection, not ZMQ's 1,000

COMPAT_FIELDS = ("model", "dtype", "cache_dtype", "block_size", "num_kv_heads", "head_size",
                 "num_layers", "tp_size")


class PeerIncompatible(GeometryMismatch):
    """The peer's KV layout cannot be paired with ours."""


class HandshakeFailed(RuntimeError):
    """The peer did not answer, or answered something that is not a hello."""


def check_compatible(local: dict[str, Any], remote: dict[str, Any], peer: str) -> None:
    for name in COMPAT_FIELDS:
        if local.get(name) != remote.get(name):
            raise PeerIncompatible(f"peer {peer}: {name}", expected=local.get(name),
                                   found=remote.get(name))
    try:
        theirs = CacheLayout.from_wire(remote.get("cache_layout"))
        CacheLayout.from_wire(local.get("cache_layout")).check_matches(theirs)
    except GroupMismatch as exc:
        raise PeerIncompatible(f"peer {peer}: {exc.what}", expected=exc.expected,
                               found=exc.found) from None
    except MalformedGroups as exc:
        raise PeerIncompatible(f"peer {peer}: {exc}", expected="a cache layout",
                               found=remote.get("cache_layout")) from None


def _hello(engine_id: str, rank: int, compat: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"wire": WIRE, "engine_id": engine_id, "rank": rank, "compat": compat,
                         **extra})


def _parse_hello(frame: bytes, who: str) -> dict[str, Any]:
    try:
        hello = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise HandshakeFailed(f"{who}: hello is not JSON: {exc}") from None
    if not isinstance(hello, dict) or hello.get("wire") != WIRE:
        raise HandshakeFailed(f"{who}: not a {WIRE} hello")
    if not isinstance(hello.get("engine_id"), str) or not isinstance(hello.get("compat"), dict):
        raise HandshakeFailed(f"{who}: hello lacks engine_id/compat")
    engine = hello["engine_id"]
    if not well_formed_id(engine):
        raise HandshakeFailed(f"{who}: hello's engine_id must be 1..256 printable characters, "
                              f"found {engine[:300]!r}")
    return hello


class SideChannelServer:
    """P's listener.  ``on_hello(hello, metadata) -> (reply_extra, our_metadata)``."""

    def __init__(self, host: str, port: int, engine_id: str, rank: int, compat: dict[str, Any],
                 on_hello: Callable[[dict[str, Any], bytes], bytes],
                 trusted: Callable[[str | None], bool] | None = None) -> None:
        import zmq

        self.engine_id, self.rank, self.compat = engine_id, rank, compat
        self.on_hello = on_hello
        self.trusted = trusted  # the addresses answered (``trusted_consumers``); None: any
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
        bind_host = "*" if host in ("0.0.0.0", "") else host
        self._sock.bind(f"tcp://{bind_host}:{port}")
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(target=self._serve, name="kvhandoff-side-channel",
                                        daemon=True)
        self._thread.start()
        log.info("vllm.side_channel.listening", address=self.address, engine=engine_id, rank=rank)

    def _serve(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                break
            if self.trusted is not None:
                address = _peer_address(frames[-1])
                if not self.trusted(address):  # nothing of it is read, nothing of ours sent
                    log.warning("vllm.side_channel.untrusted_consumer", address=address)
                    self._reply(frames[0].bytes, _hello(
                        self.engine_id, self.rank, {}, ok=False, error=f"UntrustedConsumer: "
                        f"{address} is not in this P's trusted_consumers"), b"")
                    continue
            if len(frames) != 4:
                log.warning("vllm.side_channel.bad_frames", frames=len(frames))
                continue
            ident, _, header, metadata = (f.bytes for f in frames)
            try:
                hello = _parse_hello(header, "side channel")
                check_compatible(self.compat, hello["compat"], hello["engine_id"])
                ours = self.on_hello(hello, metadata)
                reply = _hello(self.engine_id, self.rank, self.compat, ok=True)
            except Exception as exc:  # every refusal is answered, never raised into the engine
                log.warning("vllm.side_channel.refused", error=str(exc), error_type=type(exc).__name__)
                ours = b""
                reply = _hello(self.engine_id, self.rank, self.compat, ok=False,
                               error=f"{type(exc).__name__}: {exc}")
            self._reply(ident, reply, ours)

    def _reply(self, ident: bytes, reply: bytes, metadata: bytes) -> None:
        import zmq

        try:
            self._sock.send_multipart([ident, b"", reply, metadata])
        except zmq.ZMQError as exc:
            log.warning("vllm.side_channel.reply_failed", error=str(exc))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


def _peer_address(frame: Any) -> str | None:
    """The address a frame came from, as ZMQ saw the connection (None if it cannot say)."""
    try:
        return frame.get("Peer-Address")
    except Exception:  # libzmq without message properties
        return None


def handshake(host: str, port: int, engine_id: str, rank: int, compat: dict[str, Any],
              metadata: bytes, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """D's side: send our hello + metadata, return P's hello and metadata.

    Raises `HandshakeFailed` (no answer / refused) or `PeerIncompatible`.
    """
    import zmq

    # A context of its own, as vLLM's NixlConnector does: under `vllm serve`
    # this runs in a worker process whose shared context never connected.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([b"", _hello(engine_id, rank, compat), metadata])
        if not sock.poll(int(timeout_s * 1e3), zmq.POLLIN):
            raise HandshakeFailed(f"no answer from {host}:{port} within {timeout_s:.1f}s")
        frames = sock.recv_multipart()
    finally:
        sock.close()
        ctx.destroy(linger=0)
    if len(frames) != 3:
        raise HandshakeFailed(f"{host}:{port}: malformed reply ({len(frames)} frames)")
    hello = _parse_hello(frames[1], f"{host}:{port}")
    if not hello.get("ok"):
        raise HandshakeFailed(f"{host}:{port} refused the handshake: {hello.get('error')}")
    check_compatible(compat, hello["compat"], hello["engine_id"])
    return hello, frames[2]

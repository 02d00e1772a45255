"""Which producers D may connect to: ``trusted_producers``.

The address D dials comes from ``kv_transfer_params``, which clients can
write.  D checks it here, before a single packet leaves (no handshake, no
release, nothing), so a client cannot make D connect to an arbitrary host
and port.  An entry is ``HOST``, ``HOST:PORT``, ``CIDR`` or ``CIDR:PORT``
(``[v6]:PORT`` for IPv6 with a port); an entry without a port allows every
port of that host.  Host names match only the same name written in
``remote_host`` (no DNS lookups: D dials what the parameters say, and the
check must be about that string).  The default allows loopback only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvhandoff.adapters.vllm.config import LOOPBACK_PRODUCERS, ConnectorConfigError
from kvhandoff.adapters.vllm.params import MalformedTransferParams

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class UntrustedProducer(MalformedTransferParams):
    """``remote_host``/``remote_port`` name a producer outside ``trusted_producers``."""


@dataclass(frozen=True, slots=True)
class _Entry:
    network: Network | None
    name: str  # a host name (lower case) when network is None
    port: int | None

    def allows(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None, host: str,
               port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            return ip is not None and ip.version == self.network.version and ip in self.network
        return ip is None and host.lower() == self.name


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port or [v6]
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError("text after ']' must be ':PORT'")
        return host, int(rest[1:]) if rest else None
    if entry.count(":") == 1:  # host:port, v4:port, cidr:port
        host, port = entry.split(":")
        return host, int(port)
    return entry, None  # bare host, v4, cidr, or an IPv6 address without a port


def _parse_entry(entry: object) -> _Entry:
    if not isinstance(entry, str) or not entry.strip():
        raise ConnectorConfigError("trusted_producers", "a list of HOST[:PORT] or CIDR[:PORT]",
                                   entry)
    try:
        host, port = _split_port(entry.strip())
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port {port} out of range")
        try:
            return _Entry(ipaddress.ip_network(host, strict=False), "", port)
        except ValueError:
            if not host or any(c in host for c in "/[] "):
                raise
            return _Entry(None, host.lower(), port)
    except ValueError as exc:
        raise ConnectorConfigError("trusted_producers",
                                   f"HOST[:PORT] or CIDR[:PORT] ({exc})", entry) from None


class TrustedProducers:
    """The parsed ``trusted_producers`` list; `check` raises `UntrustedProducer`."""

    def __init__(self, entries: tuple[str, ...] = LOOPBACK_PRODUCERS) -> None:
        self.entries = tuple(entries)
        self._parsed = tuple(_parse_entry(e) for e in self.entries)

    def allows(self, host: str, port: int) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        return any(e.allows(ip, host, port) for e in self._parsed)

    def check(self, host: str, port: int) -> None:
        if not self.allows(host, port):
            raise UntrustedProducer(
                f"kv_transfer_params remote_host/remote_port {host}:{port}: not in "
                f"trusted_producers {list(self.entries)} (D connects only to trusted producers)")

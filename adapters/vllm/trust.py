"""Which producers D may connect to: ``trusted_producers``; which consumers P answers:
``trusted_consumers``.

The address D dials comes from ``kv_transfer_params``, which clients can
write.  D checks it here, before a single packet leaves (no handshake, no
release, nothing), so a client cannot make D connect to an arbitrary host
and port.  The check is on exactly the address D dials: ``remote_host`` as
written and ``remote_port + rank`` (D's rank *r* dials P's rank *r*).

An entry is ``HOST``, ``HOST:PORT``, ``CIDR`` or ``CIDR:PORT`` (IPv4); an
entry without a port trusts every port, i.e. every process on those hosts.
A host name (dot-separated labels of letters, digits, ``-`` and ``_``)
matches only the same name written in ``remote_host`` (no DNS
lookup here: the name is resolved when D dials, so a name entry trusts DNS
at dial time).  An IP address must be written canonically; IPv6 (and scope
ids) are refused: the side channel dials ``tcp://HOST:PORT`` (IPv4 or a
name).  Once P is trusted, so is what it sends: the NIXL metadata of its
handshake is loaded as is.  The default allows loopback only
(``127.0.0.0/8``, ``localhost``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvhandoff.adapters.vllm.config import LOOPBACK_PRODUCERS, ConnectorConfigError
from kvhandoff.adapters.vllm.params import MalformedTransferParams

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# A host name entry: dot-separated labels of letters, digits, '-' and '_' (a
# separator typed by mistake, "a;b" or "a b", is no name).
_HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


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
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            network = None
        if network is not None:
            if network.version != 4:
                raise ValueError("IPv6 producers are not supported (D dials tcp://HOST:PORT)")
            return _Entry(network, "", port)
        if not _HOST_NAME.fullmatch(host):
            raise ValueError("not an IPv4 address, CIDR or host name (IPv6 is not supported)")
        return _Entry(None, host.lower(), port)
    except ValueError as exc:
        raise ConnectorConfigError("trusted_producers",
                                   f"HOST[:PORT] or CIDR[:PORT] ({exc})", entry) from None


_PASSED_MAX = 1024  # addresses `TrustedProducers.check` remembers having passed


def _ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class TrustedProducers:
    """The parsed ``trusted_producers`` list; `check` raises `UntrustedProducer`."""

    def __init__(self, entries: tuple[str, ...] = LOOPBACK_PRODUCERS) -> None:
        self.entries = tuple(entries)
        self._parsed = tuple(_parse_entry(e) for e in self.entries)
        # Addresses `check` passed (it depends on nothing else): each request names its P
        # rank's, so the same few come back.  Bounded: a client picks what is asked.
        self._passed: set[tuple[str, int]] = set()

    def allows(self, host: str, port: int) -> bool:
        """Whether D may dial exactly ``host``:``port`` (`problem` is empty and an entry matches)."""
        return not self.problem(host, port) and any(
            e.allows(_ip_of(host), host, port) for e in self._parsed)

    @staticmethod
    def problem(host: str, port: int) -> str:
        """Why D must never dial ``host``:``port`` whatever the entries say ("" if none)."""
        if type(port) is not int or not 0 < port < 65536:
            return f"port {port!r} out of range 1..65535"
        if not host or any(c in host for c in "%[]/ :@\t\n"):
            return "not an IPv4 address or a host name (IPv6 and scope ids are not supported)"
        ip = _ip_of(host)
        if ip is not None and str(ip) != host:
            return f"IP address not written canonically ({str(ip)!r})"
        return ""

    def check(self, host: str, port: int) -> None:
        """Raise `UntrustedProducer` unless D may dial exactly ``host``:``port``."""
        exact = type(host) is str and type(port) is int  # (True == 1 as a key: never cached)
        if exact and (host, port) in self._passed:
            return
        why = self.problem(host, port)
        if why:
            raise UntrustedProducer(f"kv_transfer_params remote_host/remote_port {host!r}:{port}: "
                                    f"{why} (D connects only to addresses in trusted_producers)")
        if not self.allows(host, port):
            raise UntrustedProducer(
                f"kv_transfer_params remote_host/remote_port {host}:{port}: not in "
                f"trusted_producers {list(self.entries)} (D connects only to trusted producers)")
        if exact and len(self._passed) < _PASSED_MAX:
            self._passed.add((host, port))


class TrustedConsumers:
    """P's ``trusted_consumers``: the IPv4 addresses and CIDRs whose hellos P's side channel
    answers (it sees the address a hello came from: no host names, no ports).  A hello from
    anywhere else gets no metadata, no compatibility fields and no NIXL peer on P."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.entries = tuple(entries)
        self._networks = tuple(_consumer_network(e) for e in self.entries)

    def allows(self, address: str | None) -> bool:
        ip = _ip_of(address) if isinstance(address, str) else None
        return ip is not None and any(ip.version == n.version and ip in n for n in self._networks)


def _consumer_network(entry: object) -> ipaddress.IPv4Network:
    try:
        if not isinstance(entry, str):
            raise ValueError
        network = ipaddress.ip_network(entry.strip(), strict=False)
        if network.version != 4:
            raise ValueError
        return network
    except ValueError:
        raise ConnectorConfigError(
            "trusted_consumers", "a list of IPv4 addresses or CIDRs (P sees the address a hello "
            "comes from: no host names, no ports)", entry) from None

"""Connector settings, read from ``kv_connector_extra_config``.

Every setting has a documented default (docs/operator-guide.md repeats this
table).  Unknown keys and values of the wrong type are refused at start-up
with `ConnectorConfigError`, never discovered mid-request.  Every number of
seconds is in [0, 86400] (NaN and Infinity, which vLLM's ``json.loads`` takes,
are refused).

| key                    | default             | meaning                                              |
|------------------------|---------------------|------------------------------------------------------|
| lease_s                | 30.0                | P keeps exported blocks this long without a heartbeat (>= 1) |
| heartbeat_interval_s   | lease_s / 6         | D heartbeats each P rank at most this far apart (P's lease / 6 when shorter) |
| lease_margin_s         | min(1.0, lease_s/10)| D's safety margin on P's reported time left (>= 0.001) |
| read_timeout_s         | 30.0                | a READ still in flight after this is failed (sooner: one lease without word from P) |
| failure_policy         | vLLM's kv_load_failure_policy | fail | recompute (must agree with vLLM's) |
| log_dir                | $TMPDIR/kvhandoff-events-<uid>-<engine_id> (mode 0700) | where each engine writes its event log (created by its first worker) |
| side_channel_host      | $VLLM_NIXL_SIDE_CHANNEL_HOST or 127.0.0.1 | P's metadata listener (advertised to D) |
| side_channel_port      | $VLLM_NIXL_SIDE_CHANNEL_PORT or 5600 | P's listener port (+ TP rank)      |
| handshake_timeout_s    | 5.0                 | D gives up on an unreachable P after this            |
| notif_poll_s           | 0.0005              | P's notification poll period while leases are live (>= 0.0001) |
| idle_poll_s            | 0.05                | P's notification poll period with no live lease (>= 0.0001) |
| producer_tp_size       | 0 (unchecked)       | D: P's TP size; a mismatch is refused at start-up     |
| fence_slots            | 131072              | P: fence slots per rank (8 bytes each, host memory), one per live export; 0: no fence, D asks P instead |
| debug_read_delay_s     | 0.0                 | tests only: hold each READ's completion this long    |
| debug_read_delay_param | false               | tests/demo only: honour a request's ``kvhandoff_debug_read_delay_s`` (and ``kvhandoff_debug_hold_read_until_cancelled``: counted from the client's cancel) |
| trusted_producers      | $KVHANDOFF_TRUSTED_PRODUCERS or loopback only | D: producers D may connect to (HOST[:PORT] or CIDR[:PORT] entries; the variable: comma-separated) |
| trusted_consumers      | unset: any          | P: the addresses whose hellos its side channel answers (IPv4 addresses or CIDRs) |

``KVHANDOFF_TRUSTED_PRODUCERS`` (e.g. ``10.0.0.11:5600,10.0.1.0/24:5600``) is
read only when the extra config sets no ``trusted_producers``: the extra
config wins.  A bad entry in it (or an empty value) is refused at start-up
with `ConnectorConfigError` naming the variable.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, fields
from typing import Any

from kvhandoff.core.fence import FENCE_SLOTS
from kvhandoff.core.policy import MAX_LEASE_S, MIN_LEASE_S, TimingConfig, TimingError


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value that cannot be used; names key, expected, found."""

    def __init__(self, key: str, expected: str, found: object, *, source: str = "") -> None:
        self.key, self.expected, self.found = key, expected, found
        where = source or f"kv_connector_extra_config[{key!r}]"  # source: an environment variable
        super().__init__(f"{where}: expected {expected}, found {found!r}")


class UnsupportedTopology(RuntimeError):
    """A deployment the connector cannot serve, refused at engine start-up."""


FAILURE_POLICIES = ("fail", "recompute")
LOOPBACK_PRODUCERS = ("127.0.0.0/8", "localhost")
MAX_SECONDS = MAX_LEASE_S  # of any duration setting: a day
MIN_POLL_S = 1e-4  # P's notification poll periods: shorter, its thread spins
TRUSTED_PRODUCERS_ENV = "KVHANDOFF_TRUSTED_PRODUCERS"  # comma-separated; the extra config wins


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    lease_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    lease_margin_s: float = 1.0
    read_timeout_s: float = 30.0
    failure_policy: str = "fail"
    log_dir: str = ""
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    handshake_timeout_s: float = 5.0
    notif_poll_s: float = 0.0005
    idle_poll_s: float = 0.05
    producer_tp_size: int = 0
    fence_slots: int = FENCE_SLOTS
    debug_read_delay_s: float = 0.0
    debug_read_delay_param: bool = False
    trusted_producers: tuple[str, ...] = LOOPBACK_PRODUCERS
    trusted_consumers: tuple[str, ...] = ()  # (): P answers a hello from any address

    @property
    def timing(self) -> TimingConfig:
        """The lifecycle's timing settings, as the engines take them."""
        return TimingConfig(self.lease_s, self.heartbeat_interval_s, self.lease_margin_s,
                            self.read_timeout_s)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, vllm_failure_policy: str = "fail",
                   env: dict[str, str] | None = None, engine_id: str = "") -> HandoffConfig:
        """The settings of engine ``engine_id`` (vLLM's ``kv_transfer_config.engine_id``).

        Every process of one engine (the scheduler's and each worker's
        connector) parses the same extra config, so each default is a function
        of what they share: the default ``log_dir`` is named after the engine,
        not made anew per process, and nothing is created here."""
        env = os.environ if env is None else env
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        # vLLM's own NixlConnector keys may share the dict in mixed fleets; ignore those.
        foreign = {"kv_lease_duration", "kv_recompute_threshold", "backends"}
        for key in extra:
            if key not in known and key not in foreign:
                raise ConnectorConfigError(key, f"one of {sorted(known)}", key)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            v = extra[f.name]
            if f.type in ("float", float):
                # Every float setting is a duration.  JSON as vLLM reads it (`json.loads`)
                # takes NaN and Infinity, which pass a one-sided check (a wait of NaN
                # seconds), and a wait past a day overflows what the threads' waits take.
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_SECONDS:
                    raise ConnectorConfigError(f.name, f"seconds in [0, {MAX_SECONDS:g}]", v)
                v = float(v)
            elif f.type in ("bool", bool):
                if not isinstance(v, bool):
                    raise ConnectorConfigError(f.name, "true or false", v)
            elif f.type in ("int", int):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConnectorConfigError(f.name, "an integer", v)
            elif f.type == "tuple[str, ...]":
                if not isinstance(v, list | tuple) or not v:
                    raise ConnectorConfigError(f.name, "a non-empty list of strings", v)
                v = tuple(v)
            elif not isinstance(v, str):
                raise ConnectorConfigError(f.name, "a string", v)
            values[f.name] = v
        defaults = {f.name: f.default for f in fields(cls)}
        lease = values.get("lease_s", defaults["lease_s"])
        if not lease >= MIN_LEASE_S:  # (D refuses parameters with a shorter lease)
            raise ConnectorConfigError("lease_s", f">= {MIN_LEASE_S:g}", lease)
        values.setdefault("heartbeat_interval_s", lease / 6)
        values.setdefault("lease_margin_s", min(1.0, lease / 10))
        policy = values.setdefault("failure_policy", vllm_failure_policy)
        if policy not in FAILURE_POLICIES:
            raise ConnectorConfigError("failure_policy", " | ".join(FAILURE_POLICIES), policy)
        if policy != vllm_failure_policy:
            # vLLM's scheduler applies the policy to failed loads; two
            # different answers would make the log lie about what happened.
            raise ConnectorConfigError(
                "failure_policy", f"{vllm_failure_policy!r} (kv_transfer_config.kv_load_failure_policy)",
                policy)
        if values["heartbeat_interval_s"] >= lease:
            raise ConnectorConfigError("heartbeat_interval_s", f"> 0 and < lease_s ({lease})",
                                       values["heartbeat_interval_s"])
        try:  # the lifecycle's own rules for its timing settings (`TimingConfig`)
            TimingConfig(lease, values["heartbeat_interval_s"], values["lease_margin_s"],
                         values.get("read_timeout_s", defaults["read_timeout_s"]))
        except TimingError as exc:
            raise ConnectorConfigError(exc.name, exc.expected, exc.found) from None
        if values.get("handshake_timeout_s", defaults["handshake_timeout_s"]) <= 0:
            raise ConnectorConfigError("handshake_timeout_s", "> 0", values["handshake_timeout_s"])
        for key in ("notif_poll_s", "idle_poll_s"):  # shorter: the thread spins
            if values.get(key, defaults[key]) < MIN_POLL_S:
                raise ConnectorConfigError(key, f">= {MIN_POLL_S:g}", values[key])
        if not 0 <= values.get("fence_slots", FENCE_SLOTS) < 2**31:
            raise ConnectorConfigError("fence_slots", ">= 0 and < 2**31", values["fence_slots"])
        if values.get("producer_tp_size", 0) < 0:
            raise ConnectorConfigError("producer_tp_size", ">= 0", values["producer_tp_size"])
        if values.get("debug_read_delay_s", 0.0) < 0:
            raise ConnectorConfigError("debug_read_delay_s", ">= 0", values["debug_read_delay_s"])
        values.setdefault("side_channel_host", env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"))
        if "side_channel_port" not in values:
            try:
                values["side_channel_port"] = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
            except ValueError:
                raise ConnectorConfigError("side_channel_port", "an integer (from the environment)",
                                           env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")) from None
        if "trusted_producers" in values:
            from kvhandoff.adapters.vllm.trust import TrustedProducers

            TrustedProducers(values["trusted_producers"])  # refuse bad entries at start-up
        elif TRUSTED_PRODUCERS_ENV in env:
            values["trusted_producers"] = _trusted_producers_from_env(env[TRUSTED_PRODUCERS_ENV])
        if "trusted_consumers" in values:
            from kvhandoff.adapters.vllm.trust import TrustedConsumers

            TrustedConsumers(values["trusted_consumers"])  # refuse bad entries at start-up
        if not values.get("log_dir"):
            values["log_dir"] = default_log_dir(engine_id)
        return cls(**values)


def default_log_dir(engine_id: str) -> str:
    """``$TMPDIR/kvhandoff-events-<uid>-<engine_id>``: one directory per engine and user, the
    same in each of the engine's processes (the scheduler prints it; the workers write there)."""
    return os.path.join(tempfile.gettempdir(),
                        f"kvhandoff-events-{os.geteuid()}-{engine_id or 'engine'}")


def make_log_dir(path: str, engine_id: str) -> None:
    """Create ``path``, the engine's ``log_dir``, if it is not there.

    The default sits in a shared temporary directory under a name others can
    predict, and the logs hold the release tokens: it is made as ``mkdtemp``
    makes one (mode 0700), and one that is not a directory of this user's that
    only it can use (another user made it first, or a link) is refused with
    `ConnectorConfigError` rather than written into.  A ``log_dir`` the
    operator set is created as given (parents too) and used as it is."""
    if path != default_log_dir(engine_id):
        os.makedirs(path, exist_ok=True)
        return
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConnectorConfigError(
            "log_dir", f"a directory of uid {os.geteuid()} with mode 0700 at the default "
            f"path, or log_dir set to one (the default was made by someone else, or is not "
            f"a private directory: uid {st.st_uid}, mode {stat.filemode(st.st_mode)})", path)


def _trusted_producers_from_env(raw: str) -> tuple[str, ...]:
    """``$KVHANDOFF_TRUSTED_PRODUCERS``: comma-separated entries of the list's syntax,
    checked as the list is (bad entries refused at start-up, naming the variable)."""
    from kvhandoff.adapters.vllm.trust import TrustedProducers

    source = f"environment variable {TRUSTED_PRODUCERS_ENV}"
    entries = tuple(entry.strip() for entry in raw.split(","))
    if not all(entries):
        raise ConnectorConfigError(
            "trusted_producers", "comma-separated HOST[:PORT] or CIDR[:PORT] entries, none "
            "empty (unset it for loopback only)", raw, source=source)
    try:
        TrustedProducers(entries)
    except ConnectorConfigError as exc:
        raise ConnectorConfigError("trusted_producers", f"comma-separated entries, each "
                                   f"{exc.expected}", exc.found, source=source) from None
    return entries

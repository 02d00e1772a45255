"""Start engines as processes and drive P → D hand-offs through them.

``EngineHandle`` owns one engine process (see ``engine_proc``); ``PDPair``
runs requests the way a disaggregated router does: prefill on P with
``do_remote_decode``, pass P's ``kv_transfer_params`` to D unchanged, decode
on D.  Used by the demo, the benchmark and the end-to-end tests.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from kvhandoff.adapters.vllm.engine_proc import EngineSpec, engine_env
from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)


def open_private_log(path: Path):
    """``path`` opened to append bytes, made owner-only (0600, whatever the umask) if new:
    an engine's output holds prompts and, with vLLM's ``--enable-log-requests``, every
    request's transfer parameters, release tokens included."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


class EngineFailed(RuntimeError):
    """An engine process died or did not answer in time; names the log to read."""


def ephemeral_ports() -> range:
    """The ports the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; IANA's 49152–65535 where that cannot be read)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 49152, 65535
    return range(lo, hi + 1)


def free_port(host: str = "127.0.0.1", count: int = 2, tries: int = 200) -> int:
    """A TCP port p such that p .. p + count - 1 are free on ``host`` now, for listeners
    another process opens later.

    Taken outside the ephemeral range: a port the kernel picked for ``bind(0)``
    is one it may give the next outgoing connection (UCX, ZMQ, HTTP) before the
    engine binds it, and the engine's listener then fails with "Address already
    in use" (seen with NixlConnector's side channel).  Outside that range only
    another explicit bind can take it.  ``count`` defaults to two: vLLM's
    NixlConnector listens on side_channel_port + TP rank.
    """
    ephemeral = ephemeral_ports()
    pool = [r for r in (range(10000, ephemeral.start - count), range(ephemeral.stop, 65536 - count))
            if r]
    rng = random.SystemRandom()
    for _ in range(tries if pool else 0):
        port = rng.choice(rng.choice(pool))
        if all(_bindable(host, port + k) for k in range(count)):
            return port
    for _ in range(tries):  # every port outside the range taken: let the kernel pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + count <= 65536 and all(_bindable(host, port + k) for k in range(1, count)):
            return port
    raise RuntimeError(f"no {count} free ports in a row on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class EngineHandle:
    def __init__(self, spec: EngineSpec, workdir: Path) -> None:
        import zmq

        self.workdir = workdir
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{workdir}/{spec.name}.ctl"
        self.sock.bind(endpoint)
        self.spec = replace(spec, control=endpoint)
        self.log_path = workdir / f"{spec.name}.engine.log"
        self.done: dict[str, dict[str, Any]] = {}
        self.replies: list[dict[str, Any]] = []
        self.pid: int | None = None
        self.event_logs: list[str] = []
        logf = open_private_log(self.log_path)  # the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvhandoff.adapters.vllm.engine_proc", self.spec.to_json()],
            env=engine_env(self.spec),
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(workdir),
        )
        logf.close()

    @property
    def name(self) -> str:
        return self.spec.name

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        import zmq

        if self.sock.poll(int(timeout_s * 1e3), zmq.POLLIN):
            msg = orjson.loads(self.sock.recv())
            if msg.get("op") == "done":
                self.done[msg["rid"]] = msg
            return msg
        if self.proc.poll() is not None:
            raise EngineFailed(
                f"engine {self.name} exited with {self.proc.returncode}; see {self.log_path}:\n"
                + self.tail_log()
            )
        return None

    def tail_log(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _await(self, op: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._recv(min(0.2, max(0.0, deadline - time.monotonic())))
            if msg is not None and msg.get("op") == op:
                return msg
        raise EngineFailed(f"engine {self.name}: no {op!r} within {timeout_s:.0f}s; see {self.log_path}")

    def poll_ready(self) -> bool:
        """Non-blocking: True once the engine said it is ready."""
        if self.pid is not None:
            return True
        msg = self._recv(0)
        while msg is not None:
            if msg.get("op") == "ready":
                self.pid = msg["pid"]
                self.event_logs = msg.get("logs", [])
                return True
            msg = self._recv(0)
        return False

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        if self.pid is not None:
            return
        msg = self._await("ready", timeout_s)
        self.pid = msg["pid"]
        self.event_logs = msg.get("logs", [])

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(orjson.dumps(msg))

    def add(self, rid: str, prompt: list[int], max_tokens: int,
            kv_transfer_params: dict[str, Any] | None = None,
            abort_immediately: bool = False) -> None:
        self.send({"op": "add", "rid": rid, "prompt": list(prompt), "max_tokens": max_tokens,
                   "kv_transfer_params": kv_transfer_params,
                   "abort_immediately": abort_immediately})

    def abort(self, rids: Iterable[str]) -> None:
        self.send({"op": "abort", "rids": list(rids)})

    def pump(self, timeout_s: float = 0.0) -> None:
        """Collect whatever the engine has sent."""
        msg = self._recv(timeout_s)
        while msg is not None:
            msg = self._recv(0)

    def wait_done(self, rids: Iterable[str], timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
        want = list(rids)
        deadline = time.monotonic() + timeout_s
        while any(r not in self.done for r in want):
            if time.monotonic() > deadline:
                missing = [r for r in want if r not in self.done]
                raise EngineFailed(f"engine {self.name}: {missing} not finished in {timeout_s:.0f}s")
            self._recv(0.2)
        return {r: self.done.pop(r) for r in want}

    def flush(self, timeout_s: float = 30.0) -> list[str]:
        self.send({"op": "flush"})
        self.event_logs = self._await("flushed", timeout_s).get("logs", [])
        return self.event_logs

    def stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        self.send({"op": "stats"})
        return self._await("stats", timeout_s).get("stats", {})

    def cpu_seconds(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def idle_cpu_percent(self, seconds: float = 3.0) -> float:
        start = self.cpu_seconds()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.pump(0.05)
        return 100.0 * (self.cpu_seconds() - start) / (time.monotonic() - t0)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "shutdown"})
                self._await("bye", timeout_s)
            except EngineFailed:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        self.sock.close()

    def freeze(self) -> None:
        """SIGSTOP the engine (benchmarks: keep an idle pair off the CPU)."""
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Crash the engine (SIGKILL): what a D restart looks like to P."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.sock.close()


@dataclass
class PDConfig:
    model_dir: str
    connector: str = "kvhandoff"  # kvhandoff | nixl
    extra_config: dict[str, Any] = field(default_factory=dict)
    p_extra_config: dict[str, Any] = field(default_factory=dict)
    d_extra_config: dict[str, Any] = field(default_factory=dict)
    workdir: str | None = None
    kv_load_failure_policy: str = "fail"
    tag: str = ""
    enable_prefix_caching: bool = True
    # D's connector when it differs from ``connector``: "multi" runs kvhandoff
    # inside MultiConnector next to DecodeBenchConnector (engine_proc.EngineSpec).
    d_connector: str = ""


class PDPair:
    """A P engine and a D engine with the same connector, started together."""

    def __init__(self, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvh-pd-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        tag = cfg.tag or cfg.connector
        self.p = self._start("prefill", f"P-{tag}", cfg.p_extra_config)
        self.d = self._start("decode", f"D-{tag}", cfg.d_extra_config)

    def _start(self, role: str, name: str, extra: dict[str, Any]) -> EngineHandle:
        merged = {**self.cfg.extra_config, **extra}
        connector = self.cfg.connector
        if role == "decode" and self.cfg.d_connector:
            connector = self.cfg.d_connector
        if connector in ("kvhandoff", "multi"):
            merged.setdefault("log_dir", str(self.workdir / "events"))
        spec = EngineSpec(
            name=name, role=role, model_dir=self.cfg.model_dir, control="",
            connector=connector, engine_id=f"{name}-{os.getpid()}-{int(time.time() * 1e3) % 100000}",
            side_channel_port=free_port(), extra_config=merged,
            kv_load_failure_policy=self.cfg.kv_load_failure_policy,
            enable_prefix_caching=self.cfg.enable_prefix_caching,
        )
        return EngineHandle(spec, self.workdir)

    def restart_d(self, crash: bool = True) -> None:
        (self.d.kill if crash else self.d.stop)()
        name = self.d.spec.name + "r"
        self.d = self._start("decode", name, self.cfg.d_extra_config)
        self.d.wait_ready()

    def restart_p(self, crash: bool = True, same_identity: bool = True) -> None:
        """Restart P; ``same_identity`` keeps its engine id and side-channel port, as a
        deployment restarting the same P would."""
        old = self.p.spec
        (self.p.kill if crash else self.p.stop)()
        if same_identity:
            self.p = EngineHandle(replace(old, name=old.name + "r"), self.workdir)
        else:
            self.p = self._start("prefill", old.name + "r", self.cfg.p_extra_config)
        self.p.wait_ready()

    def wait_ready(self, timeout_s: float = 600.0, on_ready: Callable[[str], None] | None = None) -> None:
        for h in (self.p, self.d):
            h.wait_ready(timeout_s)
            if on_ready:
                on_ready(h.name)

    def prefill(self, rids: list[str], prompts: list[list[int]],
                timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
        for rid, prompt in zip(rids, prompts, strict=True):
            self.p.add(rid, prompt, 1, {"do_remote_decode": True})
        return self.p.wait_done(rids, timeout_s)

    def freeze(self) -> None:
        for h in (self.p, self.d):
            h.freeze()

    def thaw(self) -> None:
        for h in (self.p, self.d):
            h.thaw()

    def stop(self) -> None:
        self.thaw()
        for h in (self.d, self.p):
            try:
                h.stop()
            except Exception as exc:  # best effort on teardown
                log.warning("vllm.cluster.stop_failed", engine=h.name, error=str(exc))

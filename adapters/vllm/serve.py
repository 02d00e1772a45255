"""``vllm serve`` processes for P, D and a plain engine, started as the operator guide says.

`ServeProcess` runs the guide's command (the ``vllm`` script of this
interpreter's environment, ``--kv-transfer-config`` with
``KVHandoffConnector``) in its own process group, waits for ``/health`` and
stops it the ways an operator does: Ctrl-C (SIGINT to the group, vLLM's
default ``--shutdown-timeout 0``), SIGTERM, or ``kill -9`` of every process.
The end-to-end tests of the serve route use it; it is also a small recipe
for running the tiny model by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.adapters.vllm.cluster import EngineFailed, free_port, open_private_log
from kvhandoff.adapters.vllm.engine_proc import EngineSpec, engine_env


@dataclass(slots=True)
class ServeSpec:
    """One ``vllm serve``: ``role`` is ``prefill`` (P), ``decode`` (D) or ``plain`` (no connector)."""

    name: str
    role: str
    model_dir: str
    engine_id: str = ""
    extra_config: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    side_channel_port: int = 0
    kv_load_failure_policy: str = "fail"
    cpus: str = ""  # VLLM_CPU_OMP_THREADS_BIND for this engine's worker (CPU build), e.g. "1"
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags, e.g. --no-enable-prefix-caching
    host: str = "127.0.0.1"  # the HTTP server's address (--host), e.g. another 127/8 "host"
    env: dict[str, str] = field(default_factory=dict)  # more environment, e.g. UCX_TLS

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.role == "plain":
            return None
        extra = dict(self.extra_config)
        if self.role == "prefill":
            extra.setdefault("side_channel_port", self.side_channel_port)
        return {"kv_connector": "KVHandoffConnector",
                "kv_connector_module_path": "kvhandoff.adapters.vllm",
                "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
                "engine_id": self.engine_id or self.name,
                "kv_load_failure_policy": self.kv_load_failure_policy,
                "kv_connector_extra_config": extra}

    def argv(self) -> list[str]:
        vllm = str(Path(sys.executable).with_name("vllm"))
        argv = [vllm, "serve", self.model_dir, "--port", str(self.port), "--host", self.host,
                "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--seed", "0"]
        kvt = self.kv_transfer_config()
        if kvt is not None:
            argv += ["--kv-transfer-config", json.dumps(kvt)]
        return argv + list(self.extra_args)


class ServeProcess:
    def __init__(self, spec: ServeSpec, workdir: Path) -> None:
        spec.port = spec.port or free_port()
        spec.side_channel_port = spec.side_channel_port or free_port()
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.port}"
        self.log_path = workdir / f"{spec.name}.serve.log"
        env = engine_env(EngineSpec(spec.name, spec.role, spec.model_dir, control=""))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # vllm serve as operators run it
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
        if spec.cpus:  # the worker pins itself there: keep P's and D's apart on small hosts
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus
        env.update(spec.env)
        with open_private_log(self.log_path) as logf:
            self.proc = subprocess.Popen(spec.argv(), env=env, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(workdir), start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailed(f"{self.spec.name} exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        raise EngineFailed(f"{self.spec.name}: not healthy within {timeout_s:.0f}s; see "
                           f"{self.log_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of this server (Ctrl-C in a terminal does this)."""
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Stop as an operator would (Ctrl-C by default); ``kill -9`` what is left after the timeout."""
        self.signal_group(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(timeout=30)

    def kill(self) -> None:
        """``kill -9`` of the whole server: API process, engine core and workers."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

"""Starting a NIXL agent the way kvhandoff needs it: UCX defaults and a quiet progress thread.

Two things about a stock ``nixl_agent`` are wrong for a serving engine, and
both must be fixed *before* the agent (and with it UCX's context) starts:

* **UCX refuses cuda_ipc GETs without NVLink.**  A READ is a GET; with
  ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` at its default (``auto``) UCX 1.23 stages
  VRAM READs between two processes on one H200 through TCP, at 0.4–0.5 GB/s
  instead of hundreds of GB/s (docs/nixl.md).  `apply_ucx_defaults` sets
  the variables in `UCX_DEFAULTS` unless the user already set them, and logs
  which it set and which it left alone.  UCX reads its environment when a
  context is created, so setting ``os.environ`` in-process is enough.
* **The progress thread busy-spins.**  ``nixl._api.nixl_agent`` hard-codes a
  progress-thread delay of 0 µs.  NIXL's UCX progress thread sleeps in
  ``poll()`` on the UCX workers' event descriptors with that delay as the
  timeout, so 0 means it never sleeps: ~98 % of a core per idle agent.  The
  thread still wakes at once when UCX signals work, so a timeout of a
  millisecond only bounds how late a *missed* wake-up can be (NIXL keeps the
  timeout as a workaround for one): idle cost ~2 % of a core, transfers
  unchanged (measured; see docs/nixl.md).  The Python API offers no setting
  for it, so `create_agent` passes the delay to the bindings' agent config
  while the stock ``nixl_agent`` constructor runs (`_progress_delay`).  The
  source side of a READ (P) keeps the progress thread: it must answer UCX
  connection set-up, GETs over ``tcp`` and notifications even while its
  engine thread is busy elsewhere.

**Without the progress thread** (``NixlOptions(progress_thread=False)``, or
``KVHANDOFF_NIXL_PROGRESS_THREAD=0`` in the environment, which sets the
default): UCX is progressed only by the transport's caller (NIXL's
``getNotifs`` and transfer checks progress the worker when there is no
thread).  A notification then reaches the caller in one hop instead of two
(no progress thread to wake first), which on a CPU-starved host is where a
heartbeat's round trip went (docs/benchmarks.md, bench vllm co-located), and
an idle agent costs nothing between calls.  The price: nothing answers UCX
between the caller's calls, so a READ that needs the source's CPU (UCX's
``tcp`` between nodes) or a connection set-up waits for the source's next
call, a READ that takes several rounds moves one round per call, and messages
to an agent that makes no calls queue at their senders (`NixlTransport.progress`
collects notifications too, which moves UCX's worker).  The vLLM connector
starts P's agents with the thread and D's without it (`progress_thread_default`,
called with the side's default; the environment variable overrides both): D
initiates every READ and collects every answer from its own engine step, and
between steps a thread of D's connector calls `progress` every half
millisecond while a READ is in flight (docs/nixl.md, "What the connector does").
"""

from __future__ import annotations

import ctypes
import inspect
import os
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)

# name -> (value, why).  Only what a kvhandoff READ needs; everything else is UCX's.
# All of them concern CUDA memory: without a CUDA driver none is set.
UCX_DEFAULTS: dict[str, tuple[str, str]] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": (
        "y",
        "VRAM READs between processes: without it UCX stages GETs through TCP "
        "(0.4-0.5 GB/s on one H200 instead of hundreds of GB/s)",
    ),
    "UCX_CUDA_IPC_ENABLE_SAME_PROCESS": (
        "y",
        "VRAM READs between two agents of one process (tests, single-process demos)",
    ),
}


PROGRESS_THREAD_ENV = "KVHANDOFF_NIXL_PROGRESS_THREAD"  # "0" or "1": overrides every default


def progress_thread_default(otherwise: bool = True) -> bool:
    """Whether to start NIXL's progress thread: `PROGRESS_THREAD_ENV` if set, else ``otherwise``."""
    raw = os.environ.get(PROGRESS_THREAD_ENV, "").strip()
    if not raw:
        return otherwise
    if raw not in ("0", "1"):
        raise ValueError(f"{PROGRESS_THREAD_ENV}: expected 0 or 1, found {raw!r}")
    return raw == "1"


@dataclass(frozen=True, slots=True)
class NixlOptions:
    """How a `NixlTransport` starts its agent.

    ``progress_delay_us``: the progress thread's poll timeout (see module
    docstring); NIXL rounds it up to whole milliseconds; 0 restores NIXL's
    busy-spin.  ``progress_thread``: start NIXL's progress thread (default:
    `progress_thread_default`: yes, unless ``KVHANDOFF_NIXL_PROGRESS_THREAD=0``); without it the caller's
    calls progress UCX (see module docstring).  ``num_threads``: UCX worker threads that post one transfer's
    descriptors in parallel (0: post from the caller's thread).
    ``ucx_defaults``: set `UCX_DEFAULTS` where the user has not.
    ``telemetry``: NIXL per-transfer telemetry (descriptor counts after
    merging; costs a little per transfer).  ``vram_ipc``: READs from a peer's VRAM
    into VRAM or CUDA-pinned host memory, between agents on one node, run as
    CUDA IPC gather kernels instead of one UCX GET per descriptor (see
    `cuda_ipc`); off: everything goes through NIXL.
    """

    backends: tuple[str, ...] = ("UCX",)
    progress_delay_us: int = 1000
    progress_thread: bool = field(default_factory=progress_thread_default)
    num_threads: int = 0
    ucx_defaults: bool = True
    telemetry: bool = False
    vram_ipc: bool = True

    def __post_init__(self) -> None:
        if self.progress_delay_us < 0:
            raise ValueError(f"progress_delay_us: expected >= 0, found {self.progress_delay_us}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads: expected >= 0, found {self.num_threads}")
        if not self.backends:
            raise ValueError("backends: expected at least one NIXL backend, found none")


def cuda_driver_present() -> bool:
    """Whether this process can load the CUDA driver (``libcuda.so.1``)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def apply_ucx_defaults(environ: MutableMapping[str, str] | None = None,
                       cuda: bool | None = None) -> dict[str, str]:
    """Set each of `UCX_DEFAULTS` not already in the environment; return what was set.

    Logs ``nixl.ucx_default`` for every variable, saying whether kvhandoff
    set it (``source=kvhandoff``), found it set by the user or a parent
    process (``source=environment``), or skipped it because there is no CUDA
    driver (``source=skipped``: UCX would only print that it is unused), so
    an operator can see why a READ took the path it took.  ``cuda``: whether
    a CUDA driver is present (None: find out).
    """
    env = os.environ if environ is None else environ
    if cuda is None:
        cuda = cuda_driver_present()
    applied: dict[str, str] = {}
    for name, (value, why) in UCX_DEFAULTS.items():
        if name in env:
            log.info("nixl.ucx_default", variable=name, value=env[name], source="environment",
                     why=why)
            continue
        if not cuda:
            log.info("nixl.ucx_default", variable=name, value=None, source="skipped",
                     why="no CUDA driver here")
            continue
        env[name] = value
        applied[name] = value
        log.info("nixl.ucx_default", variable=name, value=value, source="kvhandoff", why=why)
    return applied


_construct_lock = threading.Lock()


class _BindingsWithDelay:
    """The NIXL bindings module, except that agents start with our progress delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - the bindings' name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


@contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    # ``nixl._api`` writes ``agent_config.pthrDelay = 0`` and then calls
    # ``nixlBind.nixlAgent(name, agent_config)``: swap the module's view of the
    # bindings for the length of one constructor call, under a lock so two
    # threads starting agents never see each other's swap.
    with _construct_lock:
        real = api.nixlBind
        api.nixlBind = _BindingsWithDelay(real, delay_us)
        try:
            yield
        finally:
            api.nixlBind = real


def create_agent(name: str, options: NixlOptions) -> Any:
    """A started ``nixl_agent`` named ``name``, configured by ``options``."""
    if options.ucx_defaults:
        apply_ucx_defaults()
    import nixl._api as api  # imported late: importing nixl loads UCX

    params = inspect.signature(api.nixl_agent_config).parameters
    kwargs: dict[str, Any] = {
        "enable_prog_thread": options.progress_thread,
        "backends": list(options.backends),
        "capture_telemetry": options.telemetry,
        "num_threads": options.num_threads,
    }
    native_delay = "progress_delay_us" in params  # a future nixl may grow the setting
    if native_delay:
        kwargs["progress_delay_us"] = options.progress_delay_us
    config = api.nixl_agent_config(**kwargs)
    if native_delay or not hasattr(api, "nixlBind"):
        agent = api.nixl_agent(name, config)
    else:
        with _progress_delay(api, options.progress_delay_us):
            agent = api.nixl_agent(name, config)
    missing = [b for b in options.backends if b not in agent.backends]
    if missing:
        raise RuntimeError(f"NIXL agent {name!r}: backends {missing} unavailable; "
                           f"plugins found: {agent.get_plugin_list()}")
    log.info("nixl.agent_started", agent=name, backends=list(options.backends),
             progress_thread=options.progress_thread,
             progress_delay_us=options.progress_delay_us, num_threads=options.num_threads)
    return agent

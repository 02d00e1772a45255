"""`ReadProgress`: moves a transport's READs in flight between its owner's calls.

An agent without NIXL's progress thread (``NixlOptions(progress_thread=False)``)
is progressed only by its caller: `NixlTransport.poll`, `progress` and
`recv_notifs`.  A caller that polls once per engine step (vLLM's D) moves a
READ that takes several UCX rounds (a GET over ``tcp``, more descriptors than
the NIC's queue holds) one round per step, and a busy engine's step lasts tens
of milliseconds: a 64 MiB READ over ``tcp`` polled every 30 ms ran at a sixth
of the rate with NIXL's thread (docs/nixl.md, "What the connector does").

This thread calls `NixlTransport.progress` every ``busy_s`` while a READ is in
flight, under the owner's lock (a transport is not thread-safe), and otherwise
every ``idle_s`` or as soon as the owner calls `wake` after posting one.
Completions are only collected here: the owner's `poll` still returns them.
A Python thread: while the owner's thread runs Python (not waiting on a GPU
or a lock) this one gets the GIL once per CPython switch interval (5 ms by
default), so that bounds its period in a Python-busy engine.
"""

from __future__ import annotations

import threading
from typing import Any

from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)


class ReadProgress:
    """Start with `start`; call `wake` after posting READs; `close` stops the thread."""

    def __init__(self, transport: Any, lock: Any, busy_s: float, idle_s: float,
                 name: str = "kvhandoff-read-progress") -> None:
        self.transport, self.lock = transport, lock
        self.busy_s, self.idle_s = busy_s, idle_s
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> ReadProgress:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """The owner posted READs (or may have): advance them now, not after ``idle_s``."""
        if self.transport.reads_in_flight:
            self._wanted.set()

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wanted.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                try:
                    self.transport.progress()
                    busy = self.transport.reads_in_flight > 0
                except Exception as exc:  # never let the thread die silently
                    log.error("nixl.read_progress_error", error=str(exc),
                              error_type=type(exc).__name__)
                    busy = False
            self._wanted.wait(self.busy_s if busy else self.idle_s)
            self._wanted.clear()

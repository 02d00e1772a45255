"""The connector's data path: `kvhandoff.transports.nixl`, the project's one NIXL transport."""

from __future__ import annotations

from typing import Any

from kvhandoff.core.safelog import get_logger

log = get_logger(__name__)


def make_transport(name: str, *, progress_thread_otherwise: bool = True, **options: Any) -> Any:
    """A started `NixlTransport` named ``name`` (``options``: `NixlOptions` fields).

    NIXL's progress thread: ``options["progress_thread"]`` if given, else
    ``KVHANDOFF_NIXL_PROGRESS_THREAD`` if set, else ``progress_thread_otherwise``
    (the worker passes: on P, not on D).
    """
    from kvhandoff.transports.nixl import NixlOptions, NixlTransport
    from kvhandoff.transports.nixl.agent import progress_thread_default

    options.setdefault("progress_thread", progress_thread_default(progress_thread_otherwise))
    opts = NixlOptions(**options)
    log.info("vllm.transport", impl="kvhandoff.transports.nixl", agent=name,
             progress_thread=opts.progress_thread)
    return NixlTransport(name, opts)

"""The connector's data path: `kvhandoff.transports.nixl`, the project's one NIXL transport."""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger(__name__)


def make_transport(name: str, **options: Any) -> Any:
    """A started `NixlTransport` named ``name`` (``options``: `NixlOptions` fields)."""
    from kvhandoff.transports.nixl import NixlOptions, NixlTransport

    opts = NixlOptions(**options) if options else None
    log.info("vllm.transport", impl="kvhandoff.transports.nixl", agent=name)
    return NixlTransport(name, opts)

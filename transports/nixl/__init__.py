"""The NIXL transport: real one-sided READs of KV blocks, host memory and GPU.

`NixlTransport` follows `kvhandoff.transports.base.Transport` and adds
`NixlTransport.post_split_read` for READs whose destinations span memory
kinds (a GPU-resident tail plus a host pool).  `NixlOptions` says how its
agent starts; `apply_ucx_defaults` is what it does to UCX's environment.
`TransportProcess` runs a transport in a child process (tests, benchmarks,
demos).  Importing this package does not import NIXL; starting a transport does.
See docs/nixl.md.
"""

from .agent import UCX_DEFAULTS, NixlOptions, apply_ucx_defaults
from .reads import InvalidRead, ReadSplit, runs_array
from .transport import PROBE, NixlTransport, PeerUnreachable
from .wire import MetadataUnreadable

__all__ = [
    "PROBE", "UCX_DEFAULTS", "InvalidRead", "MetadataUnreadable", "NixlOptions",
    "NixlTransport", "PeerUnreachable", "ReadSplit", "TransportProcess", "apply_ucx_defaults", "runs_array",
]


def __getattr__(name: str):
    if name == "TransportProcess":  # multiprocessing machinery only when asked for
        from .process import TransportProcess

        return TransportProcess
    raise AttributeError(name)

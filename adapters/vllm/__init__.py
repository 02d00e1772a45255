"""kvhandoff as a vLLM KV connector.

Load it on both engines with::

    --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
                           "kv_connector_module_path": "kvhandoff.adapters.vllm",
                           "kv_role": "kv_producer",   # "kv_consumer" on D
                           "kv_connector_extra_config": {...}}'

vLLM resolves ``kv_connector`` as an attribute of this module; the connector
class is imported lazily so that ``import kvhandoff.adapters.vllm`` (and the
tiny-model writer, the engine runner) do not pull vLLM in until needed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVHandoffConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVHandoffConnector":
        from kvhandoff.adapters.vllm.connector import KVHandoffConnector

        return KVHandoffConnector
    raise AttributeError(name)

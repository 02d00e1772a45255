"""Connector metrics, carried by vLLM's ``KVConnectorStats`` from worker to logger.

Counters only (plus the per-read durations needed for GB/s), so aggregation
across workers and intervals is a sum.  ``CumulativeStats`` keeps the same
counters for the life of the worker, for the demo and the benchmark.
"""

from __future__ import annotations

from typing import Any

COUNTERS = (
    "leases_exported", "leases_extended", "leases_expired", "leases_released", "frees",
    "heartbeats_sent", "heartbeats_received", "acks_sent", "acks_received",
    "reads_posted", "reads_completed", "reads_failed", "bytes_read",
    "notify_only_releases", "releases_sent", "rejected", "notifications_ignored",
    "log_write_errors", "refused_events",
)


def empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    data["read_s"] = []
    data["read_bytes"] = []
    return data


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for k, v in other.items():
        if k in ("read_s", "read_bytes"):
            into.setdefault(k, []).extend(v)
        elif isinstance(v, int | float):
            into[k] = into.get(k, 0) + v
    return into


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    out: dict[str, int | float] = {k: data.get(k, 0) for k in COUNTERS}
    reads = sorted(data.get("read_s", []))
    if reads:
        out["read_ms_median"] = reads[len(reads) // 2] * 1e3
        rates = sorted(b / s / 1e9 for b, s in zip(data.get("read_bytes", []), data["read_s"],
                                                   strict=False) if s > 0)
        if rates:
            out["read_GBps_median"] = rates[len(rates) // 2]
    return out


def stats_class() -> type:
    """`KVHandoffStats`, built on vLLM's base class (imported lazily)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    class KVHandoffStats(KVConnectorStats):
        def __post_init__(self) -> None:
            if not self.data:
                self.reset()

        def reset(self) -> None:
            self.data = empty()

        def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
            merge(self.data, other.data)
            return self

        def reduce(self) -> dict[str, int | float]:
            return summarize(self.data)

        def is_empty(self) -> bool:
            return not any(self.data.get(k) for k in COUNTERS)

    return KVHandoffStats


def prom_metrics_class() -> type:
    """`KVHandoffPromMetrics`: the counters above as Prometheus counters, READ time as a histogram."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class KVHandoffPromMetrics(KVConnectorPromMetrics):
        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters = {
                name: create_metric_per_engine(self._counter_cls(
                    name=f"vllm:kvhandoff_{name}", documentation=f"kvhandoff connector: {name}",
                    labelnames=labelnames), per_engine_labelvalues)
                for name in COUNTERS
            }
            self.read_seconds = create_metric_per_engine(self._histogram_cls(
                name="vllm:kvhandoff_read_seconds",
                documentation="kvhandoff connector: READ post to completion, per request",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
                labelnames=labelnames), per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, per_engine in self.counters.items():
                value = transfer_stats_data.get(name, 0)
                if value:
                    per_engine[engine_idx].inc(value)
            for seconds in transfer_stats_data.get("read_s", ()):
                self.read_seconds[engine_idx].observe(seconds)

    return KVHandoffPromMetrics

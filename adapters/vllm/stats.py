"""Connector metrics, carried by vLLM's ``KVConnectorStats`` from worker to logger.

Counters only (plus the per-read durations needed for GB/s), so aggregation
across workers and intervals is a sum.  ``CumulativeStats`` keeps the same
counters for the life of the worker, for the demo and the benchmark.

Failure classes (`FAILURE_CLASSES`) are counters too, one key per class
(``rejected_<reason>``, ``reads_refused_<verdict>``, `failure_key`), exported
as one Prometheus counter per family with the class as a label.  The label
values are these tuples and nothing else: a class outside them is counted as
the family's catch-all, and `KVHandoffPromMetrics.observe` reads only these
keys, whatever else the data holds.  A class comes from an exception's type or
the place that counts it, never from text a client wrote.
"""

from __future__ import annotations

from typing import Any

COUNTERS = (
    "leases_exported", "leases_extended", "leases_expired", "leases_released", "frees",
    "heartbeats_sent", "heartbeats_received", "acks_sent", "acks_received",
    "reads_posted", "reads_completed", "reads_failed", "bytes_read",
    "notify_only_releases", "releases_sent", "rejected", "notifications_ignored",
    "log_write_errors", "refused_events",
    # Events a degraded log dropped: past 64 MiB unwritten (`core.log.LogWriter`).
    "log_events_dropped",
    # P: heartbeats (from the request's own D, with its token) that arrived for a lease
    # already past its deadline.  D: heartbeats sent more than two heartbeat periods
    # after the request's previous one (a stalled engine step or an unreachable P).
    "heartbeats_late", "heartbeats_sent_late",
    # D: fence READs (`core.fence`) that found the request's value (its READs proven without
    # asking P), and those that did not (failed, not written yet, cleared, or another
    # request's value after a slot collision): D asked P instead.
    "fences_held", "fences_missed",
    # P: exports that got no fence slot (every slot was live: `fence_slots` too small for
    # the live leases), and exports the lifecycle refused whose blocks were freed at once
    # (the id's earlier life expired and is still remembered, docs/lifecycle.md).
    "exports_unfenced", "exports_refused_freed",
)

# family -> (Prometheus label, its values); the last value is the catch-all.
REJECT_REASONS = (
    "malformed_params",    # kv_transfer_params that do not parse (`MalformedTransferParams`)
    "reused_params",       # params of a P request this D already took (single-use)
    "untrusted_producer",  # remote_host/remote_port outside trusted_producers
    "handshake_failed",    # the P rank did not answer the side channel, or refused it
    "incompatible_peer",   # P's KV layout (model, dtype, block size, cache groups) differs
    "layout_version",      # P and D run different cache layout versions (kvhandoff versions)
    "geometry",            # the request's blocks / tokens / tp_size do not fit P's or D's caches
    "lifecycle",           # the lifecycle refused the admission (an id it still holds)
    "internal_error",      # an unexpected error failed the request (contained; see D's log)
    "other",
)
READ_VERDICTS = (
    "unsafe",    # a READ completed after P may have freed its blocks
    "unproven",  # no answer from P proved it held the blocks by D's read deadline
    "failed",    # a READ failed or timed out
)
FAILURE_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rejected": ("reason", REJECT_REASONS),
    "reads_refused": ("verdict", READ_VERDICTS),
}
FAILURE_KEYS = tuple(f"{family}_{value}" for family, (_, values) in FAILURE_CLASSES.items()
                     for value in values)


def failure_key(family: str, value: str) -> str:
    """The counter key of a failure class; a value outside the bounded set is the catch-all."""
    values = FAILURE_CLASSES[family][1]
    return f"{family}_{value if value in values else values[-1]}"


def empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS + FAILURE_KEYS, 0)
    data["read_s"] = []
    data["read_bytes"] = []
    return data


# READ samples (seconds, bytes) a bucket keeps for its medians: the newest ones. A worker's
# cumulative totals live as long as the engine, and vLLM may never take the per-step ones.
READ_SAMPLES = 4096


def add_read(data: dict[str, Any], seconds: float, nbytes: int) -> None:
    """One READ's sample; a bucket holds at most 2 x READ_SAMPLES, the newest."""
    times, sizes = data["read_s"], data["read_bytes"]
    times.append(seconds)
    sizes.append(nbytes)
    if len(times) > 2 * READ_SAMPLES:
        del times[:-READ_SAMPLES], sizes[:-READ_SAMPLES]


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for k, v in other.items():
        if k in ("read_s", "read_bytes"):
            into.setdefault(k, []).extend(v)
        elif isinstance(v, int | float):
            into[k] = into.get(k, 0) + v
    return into


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    out: dict[str, int | float] = {k: data.get(k, 0) for k in COUNTERS}
    out.update((k, data[k]) for k in FAILURE_KEYS if data.get(k))
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
            return not any(self.data.get(k) for k in COUNTERS + FAILURE_KEYS)

    return KVHandoffStats


def prom_metrics_class() -> type:
    """`KVHandoffPromMetrics`: the counters above as Prometheus counters (the failure classes
    as one labelled counter per family, every label value created at zero), READ time as a
    histogram."""
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
            # vllm:kvhandoff_rejected_by_reason_total{reason=...},
            # vllm:kvhandoff_reads_refused_total{verdict=...}
            self.failures: dict[str, dict[int, dict[str, Any]]] = {}
            for family, (label, values) in FAILURE_CLASSES.items():
                name = "rejected_by_reason" if family == "rejected" else family
                metric = self._counter_cls(
                    name=f"vllm:kvhandoff_{name}",
                    documentation=f"kvhandoff connector: {family.replace('_', ' ')} by {label}",
                    labelnames=[*labelnames, label])
                self.failures[family] = {
                    idx: {value: metric.labels(*labelvalues, value) for value in values}
                    for idx, labelvalues in per_engine_labelvalues.items()}
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
            for family, per_engine_classes in self.failures.items():
                for value, child in per_engine_classes[engine_idx].items():
                    n = transfer_stats_data.get(f"{family}_{value}", 0)
                    if n:
                        child.inc(n)
            for seconds in transfer_stats_data.get("read_s", ()):
                self.read_seconds[engine_idx].observe(seconds)

    return KVHandoffPromMetrics

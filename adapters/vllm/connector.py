"""`KVHandoffConnector`: the vLLM ``KVConnectorBase_V1`` facade.

vLLM builds one instance in the scheduler (role SCHEDULER) and one per worker
(role WORKER); each forwards to `HandoffScheduler` or `HandoffWorker`.
Topologies the connector cannot serve are refused here, at engine start-up:
pipeline parallelism, decode/prefill context parallelism, ``kv_both``, a
host pool on P, and the cache specs `adapters.vllm.layout` cannot map.
Hybrid models (several KV cache groups) are served: the connector subclasses
``SupportsHMA``.  MLA is served with P's and D's TP equal (the handshake
checks it): every rank holds the whole latent KV and reads its own peer's.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvhandoff.adapters.vllm import stats as kstats
from kvhandoff.adapters.vllm.config import HandoffConfig, UnsupportedTopology
from kvhandoff.adapters.vllm.layout import cache_layout, transfer_groups
from kvhandoff.adapters.vllm.metadata import metadata_class
from kvhandoff.adapters.vllm.scheduler import HandoffScheduler
from kvhandoff.adapters.vllm.worker import HandoffWorker
from kvhandoff.core.events import Side
from kvhandoff.core.safelog import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvhandoff.core.groups import CacheLayout

log = get_logger(__name__)

# Module-level classes: under ``vllm serve`` the executor pickles the step's
# metadata to worker processes and the workers' stats back, by class name.
class KVHandoffMetadata(metadata_class()):
    """The scheduler half's `StepPlan` for one engine step."""


class KVHandoffStats(kstats.stats_class()):
    """The connector counters of `kvhandoff.adapters.vllm.stats`."""


_WORKERS: weakref.WeakSet[HandoffWorker] = weakref.WeakSet()


def flush_all_logs() -> list[str]:
    """Flush every live worker's event log in this process; return their paths.

    Never raises for a failing write (`HandoffWorker.flush` counts it and
    marks the log degraded), so it is safe in a signal handler or at exit.
    """
    return sorted(w.flush() for w in list(_WORKERS))


def _flush_on_exit() -> None:
    """Flush the event logs when this process is told to stop.

    Under ``vllm serve`` the engine core runs in its own process; on Ctrl-C or
    SIGTERM its handler ends the busy loop, and with the default
    ``--shutdown-timeout 0`` the parent force-kills it right after.  Logs are
    already flushed every engine step (`HandoffWorker`); this catches the
    step in progress.  The previous handler (vLLM's) still runs.
    """
    import atexit
    import signal
    import threading

    if not getattr(_flush_on_exit, "at_exit", False):
        atexit.register(flush_all_logs)
        _flush_on_exit.at_exit = True
    if getattr(_flush_on_exit, "installed", False):
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there; a later call may be on it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _chained_flush(signal.getsignal(sig)))
    _flush_on_exit.installed = True


def _chained_flush(previous: Any) -> Any:
    """A handler that flushes the logs, then does what ``previous`` would have done.

    ``previous`` is a callable, ``SIG_IGN``, ``SIG_DFL``, or None (a handler
    not set from Python): None behaves as the default, so the signal is never
    swallowed.
    """
    import signal

    def handler(signum: int, frame: Any) -> None:
        try:
            flush_all_logs()
        except RuntimeError:  # it interrupted a flush (`LogWriter.flush`): that one resumes
            pass
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL or None: the default action (for SIGTERM and SIGINT, exit)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    return handler


def stats_snapshot() -> dict[str, Any]:
    """Cumulative connector counters of the workers in this process."""
    out: dict[str, Any] = {}
    for w in list(_WORKERS):
        w.take_stats()
        out[w.log_path] = kstats.summarize(w.total)
    return out


def _check_topology(vllm_config: VllmConfig, kv_cache_config: Any) -> CacheLayout:
    """The engine's cache layout; `UnsupportedTopology` naming every problem otherwise."""
    par = vllm_config.parallel_config
    kvt = vllm_config.kv_transfer_config
    problems = []
    if par.pipeline_parallel_size != 1:
        problems.append(f"pipeline_parallel_size={par.pipeline_parallel_size} (needs 1)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(par, name, 1)
        if size != 1:
            problems.append(f"{name}={size} (needs 1)")
    if kvt.kv_role not in ("kv_producer", "kv_consumer"):
        problems.append(f"kv_role={kvt.kv_role!r} (kv_producer on P, kv_consumer on D)")
    if not kvt.engine_id:
        problems.append("kv_transfer_config.engine_id is empty")
    elif "/" in kvt.engine_id or "\0" in kvt.engine_id or kvt.engine_id in (".", ".."):
        # It names the event log's file (and the default log_dir): one path component.
        problems.append(f"kv_transfer_config.engine_id={kvt.engine_id!r} (no '/', NUL, '.' or '..')")
    layout = None
    if kv_cache_config is None:
        problems.append("no kv_cache_config (vLLM >= 0.32 passes one to connectors)")
    else:
        try:
            # The draft configuration is compared at the handshake: the engine's own count
            # (a model without state groups has no scratch slots to read it from).
            # D reads into a HiSparse host pool; P's caches are read from the device.
            layout = cache_layout(kv_cache_config,
                                  getattr(vllm_config, "num_speculative_tokens", None),
                                  host_pools=kvt.kv_role == "kv_consumer",
                                  prefill_lookahead=getattr(
                                      vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
        except UnsupportedTopology as exc:
            problems.append(str(exc))
    if problems:
        raise UnsupportedTopology("KVHandoffConnector cannot serve this engine: " + "; ".join(problems))
    return layout


class KVHandoffConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.layout = _check_topology(vllm_config, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        self.cfg = HandoffConfig.from_extra(kvt.kv_connector_extra_config,
                                            kvt.kv_load_failure_policy, engine_id=kvt.engine_id)
        self.engine_id: str = kvt.engine_id
        self.producer = kvt.kv_role == "kv_producer"
        par = vllm_config.parallel_config
        if (not self.producer and self.cfg.producer_tp_size
                and self.cfg.producer_tp_size != par.tensor_parallel_size):
            # D rank r reads P rank r: unequal TP cannot be mapped (yet).
            raise UnsupportedTopology(
                f"KVHandoffConnector: producer_tp_size={self.cfg.producer_tp_size} but this "
                f"decode engine has tensor_parallel_size={par.tensor_parallel_size}; P and D "
                "need the same TP size")
        self.scheduler: HandoffScheduler | None = None
        self.worker: HandoffWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = HandoffScheduler(self.cfg, self.engine_id, self.producer,
                                              self.layout, par.tensor_parallel_size)
            # The issue asks for the log location at start; stderr, not stdout
            # (NIXL owns stdout).
            print(f"kvhandoff: {self.engine_id} ({'P' if self.producer else 'D'}) event logs in "
                  f"{self.cfg.log_dir}", file=sys.stderr, flush=True)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model = vllm_config.model_config
            compat = {
                "model": str(model.model), "dtype": str(model.dtype),
                "block_size": vllm_config.cache_config.block_size,
                "num_kv_heads": model.get_total_num_kv_heads(),
                "head_size": model.get_head_size(),
                "num_layers": model.get_total_num_hidden_layers(),
                "tp_size": par.tensor_parallel_size,
            }
            self.worker = HandoffWorker(self.cfg, self.engine_id,
                                        Side.P if self.producer else Side.D,
                                        get_tensor_model_parallel_rank(),
                                        par.tensor_parallel_size, compat)
            _WORKERS.add(self.worker)
            _flush_on_exit()

    # ---- class-level hooks ------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Block-major per layer (layer, block, head, token, K|V): one block of
        # one layer is one contiguous run of bytes, so a READ of N adjacent
        # blocks is one descriptor per layer.  vLLM's NixlConnector asks for
        # the same; the CPU backend only has this layout.
        model = vllm_config.model_config
        if model is not None and getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No.  vLLM >= 0.33 asks before it enables sleep mode (and refuses the engine when the
        answer is no; the base class says yes).  Sleep releases and later remaps the KV cache's
        memory, and kvhandoff cannot follow that: NIXL's registrations, the agent metadata
        peers hold, P's leases and D's READs in flight all name the memory registered at start.
        """
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KVHandoffStats(data=data) if data is not None else KVHandoffStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return kstats.prom_metrics_class()(vllm_config, metric_types, labelnames,
                                           per_engine_labelvalues)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """The groups a hand-off writes, as NixlConnector answers: the transfer groups.
        vLLM skips zeroing these groups' new blocks; a group D keeps for itself
        (HiSparse's resident and hot groups) is not loaded and must not be skipped."""
        return tuple(i for i, _ in transfer_groups(self._kv_cache_config))

    # ---- scheduler side ---------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVHandoffMetadata(self.scheduler.build_plan())

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output.finished_recving,
                                               connector_output.finished_sending)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches, self.layout)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 calls this before sleep mode releases the KV cache; kvhandoff says it
        does not support sleep mode (`supports_sleep_mode`), so vLLM never should: refuse
        rather than leave registrations that name memory about to be remapped."""
        raise UnsupportedTopology(
            "KVHandoffConnector does not support sleep mode: it cannot follow a remap of the "
            "KV cache's registered memory (unregister_kv_caches was called)")

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33 calls this after sleep mode's wake-up; refused as `unregister_kv_caches`."""
        raise UnsupportedTopology(
            "KVHandoffConnector does not support sleep mode: it cannot follow a remap of the "
            "KV cache's registered memory (restore_kv_caches was called)")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self.worker.start_step(meta.plan if isinstance(meta, KVHandoffMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the whole request is loaded before it is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull model: D reads; P saves nothing

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM (0.32, 0.33) calls each step."""
        sending, recving, failed = self.worker.finish_step()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The older call, which vLLM 0.32 and 0.33 no longer make: it cannot say that a READ
        failed, and a failed READ reported as received would be decoded from garbage.  So
        failed READs are held back (their requests wait, loudly), the rest reported."""
        r = self.get_transfer_results(finished_req_ids)
        if r.failed_recving:
            log.error("vllm.connector.failed_reads_withheld", request_ids=sorted(r.failed_recving),
                      why="get_finished cannot report a failed READ; use a vLLM that calls "
                          "get_transfer_results")
        return r.finished_sending or None, (r.finished_recving - r.failed_recving) or None

    def get_kv_connector_stats(self) -> Any:
        if self.worker is None:
            return None
        data = self.worker.take_stats()
        stats = KVHandoffStats(data=data)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _register_by_name() -> None:
    """Make ``KVHandoffConnector`` known to vLLM's connector registry by name.

    vLLM loads it through ``kv_connector_module_path``, which never registers
    it; but ``MultiConnector.build_kv_connector_stats`` rebuilds each child's
    stats from their serialized dicts with
    ``KVConnectorFactory.get_connector_class_by_name(<class name>)``.  Without
    this, vLLM's ``LoggingStatLogger`` (on at the default INFO log level)
    raises ``ValueError: Connector 'KVHandoffConnector' is not registered`` on
    the first step that carries kvhandoff's stats, and the engine loop dies.
    Importing this module (which resolving the module path does) registers it.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("KVHandoffConnector", __name__, "KVHandoffConnector")
    except ValueError:  # already registered (by an earlier import of this module)
        pass


_register_by_name()

"""D's ``MultiConnector(KVHandoffConnector, HiSparseConnector)`` on vLLM 0.32's real scheduler, CPU.

The engines' configs are vLLM-planned (`qwen4_layouts.plan_hisparse`: P with HiSparse
off and a plain `KVHandoffConnector` producer, D with HiSparse on and the composition);
vLLM's ``Scheduler`` and ``KVCacheManager`` run without a model (fake
``ModelRunnerOutput``s, as in `test_qwen4_scheduler`).

What runs here and where it stops:

* `KVHandoffConnector` maps D's host pool at start-up, inside ``MultiConnector.__init__``
  (``multi_connector.py:189``), and refuses a host pool on P (P runs HiSparse off).
* vLLM's scheduler side of the hand-over runs entirely on CPU:
  ``HiSparseSourceManager`` records the pending host import at allocation, the resident
  groups reserve the tail page only, and the ``finished_recving`` D's connector reports
  reaches ``HiSparseConnector.update_connector_output``, whose ``finish_host_import`` /
  ``complete_host_import`` make the history host-valid and plan the restore of the tail
  page into GPU memory; a failed import (``failed_recving``) leaves the pages invalid.
* CUDA is required by the worker half: D's KV allocation pins the host pool
  (``v1/hisparse/runtime.py:211 allocate_pinned_host_pool`` -> ``pin_tensor``,
  ``v1/simple_kv_offload/cuda_mem_ops.py:31``: ``AssertionError: Torch not compiled with
  CUDA enabled`` on this machine), and before that ``VllmConfig`` itself refuses HiSparse
  off CUDA (``config/vllm.py:1809``), which the planner here sidesteps.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import qwen4_layouts as q  # noqa: E402
from test_qwen4_scheduler import _request, _step  # noqa: E402

from kvhandoff.adapters.vllm.config import UnsupportedTopology  # noqa: E402

V = q.HS_VARIANTS[0]
PROMPT = list(range(1, 301))


def _log_dir(cfg, tmp_path, name: str) -> None:
    kvt = cfg.kv_transfer_config
    extra = {"log_dir": str(tmp_path / name)}
    if kvt.kv_connector != "MultiConnector":
        kvt.kv_connector_extra_config = extra
        return
    for child in kvt.kv_connector_extra_config["connectors"]:
        if child["kv_connector"] == "KVHandoffConnector":
            child["kv_connector_extra_config"] = extra


def _scheduler(tmp_path, hisparse: bool):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    role, name = ("kv_consumer", "D-hs") if hisparse else ("kv_producer", "P-hs")
    cfg, _, sched_cfg = q.plan_hisparse(V, hisparse, role=role, engine_id=name)
    _log_dir(cfg, tmp_path, name)
    cfg.cache_config.num_gpu_blocks = sched_cfg.num_blocks  # as the engine core sets it
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, cfg)
    s = Scheduler(vllm_config=cfg, kv_cache_config=sched_cfg,
                  structured_output_manager=StructuredOutputManager(cfg),
                  block_size=block_size, hash_block_size=hash_block_size)
    return s, hash_block_size


def _export_from_p(tmp_path) -> dict:
    s, hbs = _scheduler(tmp_path, hisparse=False)
    finished = []
    real = s.connector.request_finished_all_groups

    def spy(request, block_ids):
        answer = real(request, block_ids)
        finished.append(answer)
        return answer

    s.connector.request_finished_all_groups = spy
    s.add_request(_request(PROMPT, hbs, {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_host": None, "remote_port": None}))
    for _ in range(10):
        if finished:
            break
        _step(s)
    ((delay_free, params),) = finished
    assert delay_free is True
    return params


def test_the_composition_starts_on_d_and_a_host_pool_on_p_is_refused():
    """D: ``MultiConnector(KVHandoffConnector, HiSparseConnector)`` builds, and kvhandoff's
    layout has the host pool's group.  P: the same host-pool config as a producer is
    refused at start-up, naming the group (P is read from the device)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvhandoff.adapters.vllm.connector import KVHandoffConnector
    from kvhandoff.core.groups import Memory

    cfg, _, sched = q.plan_hisparse(V, True, role="kv_consumer", engine_id="D-hs")
    children = [c["kv_connector"] for c in cfg.kv_transfer_config.kv_connector_extra_config[
        "connectors"]]
    assert children == ["KVHandoffConnector", "HiSparseConnector"]
    kvh, _ = MultiConnector(cfg, KVConnectorRole.SCHEDULER, sched)._connectors
    assert [{r.memory for r in g.regions} for g in kvh.layout.groups] == [{Memory.HOST},
                                                                          {Memory.DEVICE}]
    cfg, _, sched = q.plan_hisparse(V, True, role="kv_producer", engine_id="P-hs")
    cfg.kv_transfer_config.kv_connector = "KVHandoffConnector"
    with pytest.raises(UnsupportedTopology, match=r"KVHandoffConnector cannot serve this "
                       r"engine: KV cache group 0: host_resident=True is not supported on P"):
        KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, sched)


def _d_admits(tmp_path, params):
    from vllm.v1.request import RequestStatus

    s, hbs = _scheduler(tmp_path, hisparse=True)
    kvh, hisparse = s.connector._connectors
    assert type(kvh).__name__ == "KVHandoffConnector"
    assert type(hisparse).__name__ == "HiSparseConnector"
    coordinator = hisparse.connector_scheduler.coordinator  # bound by vLLM's Scheduler
    assert coordinator is not None and coordinator.host_manager is not None
    req = _request(PROMPT, hbs, dict(params), max_tokens=4)
    s.add_request(req)
    out = _step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return s, req, out, coordinator


def test_vllm_s_scheduler_hands_the_import_to_hisparse(tmp_path):
    from vllm.v1.kv_cache_interface import HiSparseResidentSpec

    params = _export_from_p(tmp_path)
    # P's one vLLM group is D's two transfer groups: one list each, the same blocks.
    first, second = params["remote_block_ids"]
    assert first == second
    s, req, out, coordinator = _d_admits(tmp_path, params)
    rid, cfg = req.request_id, s.kv_cache_config
    n = coordinator._pending_imports[rid]  # HiSparseSourceManager: record_pending_host_import
    assert n == params["remote_num_tokens"]
    table = s.kv_cache_manager.get_block_ids(rid)
    tail = (n - 1) // q.DSA_BLOCK
    source, indexer = (table[i] for i in cfg.transfer_group_ids)
    assert len(source) == len(indexer) == tail + 1
    assert max(source) < cfg.hisparse_host_num_blocks  # host pool block ids
    resident = [table[i] for i, g in enumerate(cfg.kv_cache_groups)
                if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
    for row in resident:  # the writable tail page only; history stays on host
        assert row[:tail] == [0] * tail and row[tail] != 0
    (read,) = out.kv_connector_metadata.metadata[0].plan.reads
    assert read.local_block_ids == [source, indexer]  # kvhandoff reads the transfer groups
    # D's connector reports the READ done: HiSparse takes the import over by itself.
    _step(s, finished_recving={rid})
    assert rid not in coordinator._pending_imports
    state = coordinator.request_states[rid]
    assert state.valid_pages == set(range(n // q.DSA_BLOCK))
    out = _step(s)
    (restore,) = out.kv_connector_metadata.metadata[1].command.page_transfers
    assert restore.restore and not restore.after_forward
    assert restore.host_block_id == source[tail]
    assert restore.resident_block_ids == tuple(row[tail] for row in resident)
    assert rid in out.num_scheduled_tokens  # and vLLM schedules the request's own step


def test_a_failed_import_leaves_the_history_invalid(tmp_path):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    params = _export_from_p(tmp_path)
    s, req, _, coordinator = _d_admits(tmp_path, params)
    rid = req.request_id
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(
        req_ids=[], req_id_to_index={},
        kv_connector_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid})))
    assert rid not in coordinator._pending_imports
    state = coordinator.request_states.get(rid)
    assert state is None or not state.valid_pages
    assert not coordinator.spills_to_send


def test_d_admits_the_export_of_a_split_group(tmp_path):
    """P's one vLLM group of sparse and indexer layers is two groups on the wire, both
    naming the same block ids: D admits it (ids are distinct within a group)."""
    params = _export_from_p(tmp_path)
    ids = params["remote_block_ids"]
    assert len(ids) == 2 and ids[0] == ids[1]
    _, _, out, _ = _d_admits(tmp_path, params)
    (admit,) = out.kv_connector_metadata.metadata[0].plan.admits
    assert not admit.error, admit.error


def test_d_tells_vllm_it_loads_the_transfer_groups_not_hisparse_s_own(tmp_path):
    """HiSparse's resident and hot groups are D's own (``enable_kv_transfer=False``): the
    hand-off loads the source and indexer groups only, so those are the groups vLLM must
    not zero during the load (``get_loaded_kv_cache_group_ids`` through vLLM's
    ``MultiConnector``), as vLLM's NixlConnector answers for the same config."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
    )

    params = _export_from_p(tmp_path)
    s, req, _, _ = _d_admits(tmp_path, params)
    cfg = s.kv_cache_config
    assert len(cfg.kv_cache_groups) > len(cfg.transfer_group_ids) == 2
    nixl = NixlBaseConnector.get_loaded_kv_cache_group_ids(
        SimpleNamespace(_kv_cache_config=cfg), req)
    assert s.connector.get_loaded_kv_cache_group_ids(req) == nixl == cfg.transfer_group_ids

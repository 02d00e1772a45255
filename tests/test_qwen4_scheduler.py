"""Qwen4-exp's scheduler side on vLLM 0.32's real ``Scheduler`` and ``KVCacheManager``.

vLLM's ``Scheduler`` runs on CPU without a model (vLLM's own tests build it from a
``VllmConfig`` and a ``KVCacheConfig``, ``tests/v1/core/utils.py: create_scheduler``):
here from the seed configuration's plan (`qwen4_layouts.plan`: MTP 2, prefix
caching on, so ``mamba_cache_mode='align'``), the scheduler's ``KVCacheConfig``
from vLLM's ``generate_scheduler_kv_cache_config`` and block sizes from the
engine core's ``resolve_kv_cache_block_sizes``, with `KVHandoffConnector` as the
engine's KV connector (``kv_producer`` for P, ``kv_consumer`` for D).  The model
run is faked as vLLM's tests fake it: a ``ModelRunnerOutput`` per step, one
sampled token for a request whose prefill completed in that step, none for a
partial prefill chunk; the connector's worker half is not run (its
``finished_recving`` is handed to the scheduler in the output, as the worker
would).

What is checked against vLLM's own computation, not the connector's:

* P: ``request_finished_all_groups`` is called by vLLM with vLLM's block table;
  the connector answers ``delay_free=True`` (vLLM keeps the request's blocks) and
  ``kv_transfer_params`` whose block lists are, per transfer group, what
  vLLM's ``NixlConnector`` scheduler would hand over (``clip_ssm_state_blocks``
  with the group's ``num_speculative_blocks`` for GDN and PLE state: the running
  slot, not the MTP scratch slots nor the earlier 'align' checkpoints; the ring's
  one block; every block of the compressed-key / main-KV group that holds a
  computed token).
* D: vLLM asks ``get_num_new_matched_tokens``, allocates through its real
  ``KVCacheManager`` and calls ``update_state_after_alloc``; the step's plan
  carries a Read whose per-group lists are in vLLM's block table for the request
  and pair with P's lists group by group (`plan_group_reads`), state groups into
  the slot vLLM's ``clip_ssm_state_blocks`` names on D.  After
  ``finished_recving`` vLLM schedules the one token D computes itself.
* Prefix hits with 'align' checkpoints, on both sides: a local request with the
  same prompt prefix leaves cached blocks and vLLM's manager reports a hit at a
  block boundary.  D's Read leaves the hit's blocks out (P's blocks past the hit,
  position for position; the state slot is read over the checkpoint); P's export
  still hands over every computed token's block, the hit's cached ones included.

Nothing here needed CUDA or a model: every piece the brief names was built.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm")

import qwen4_layouts as q  # noqa: E402

from kvhandoff.core.planning import plan_group_reads  # noqa: E402

SEED1 = q.Variant(2, True, 1)  # the seed configuration at TP 1 (the scheduler is per engine)
PROMPT = 300
_ids = itertools.count()


def _scheduler(tmp_path, role: str, engine_id: str, v: q.Variant = SEED1):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    cfg, _, sched_cfg = q.plan(v, role, engine_id)
    cfg.kv_transfer_config.kv_connector_extra_config = {"log_dir": str(tmp_path / engine_id)}
    cfg.cache_config.num_gpu_blocks = sched_cfg.num_blocks  # as the engine core sets it
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, cfg)
    s = Scheduler(vllm_config=cfg, kv_cache_config=sched_cfg,
                  structured_output_manager=StructuredOutputManager(cfg),
                  block_size=block_size, hash_block_size=hash_block_size)
    finished = []  # (request id, block_ids vLLM passed, connector's answer)
    real = s.connector.request_finished_all_groups

    def spy(request, block_ids):
        answer = real(request, block_ids)
        finished.append((request.request_id, tuple(list(b) for b in block_ids), answer))
        return answer

    s.connector.request_finished_all_groups = spy
    return s, finished, hash_block_size


def _request(prompt: list[int], hash_block_size: int, params=None, max_tokens: int = 1):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    req = Request(f"req-{next(_ids)}", list(prompt), SamplingParams(max_tokens=max_tokens),
                  None, None, block_hasher=get_request_block_hasher(hash_block_size, sha256))
    req.kv_transfer_params = params
    return req


def _step(s, finished_recving=(), token: int = 7):
    """One engine step: schedule, then the model's output (one token per request whose
    prefill is complete, none for a partial chunk), as vLLM's scheduler tests fake it."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[] if s.requests[r].num_computed_tokens < s.requests[r].num_tokens else [token]
               for r in ids]
    kvo = KVConnectorOutput(finished_recving=set(finished_recving)) if finished_recving else None
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled, kv_connector_output=kvo)
    s.update_from_output(out, mro)
    return out


def _vllm_clip(sched_cfg, block_ids, num_tokens: int) -> list[list[int]]:
    """Per transfer group, what vLLM 0.32's NixlConnector scheduler hands over
    (``base_scheduler.py``: ``clip_ssm_state_blocks`` with ``num_speculative_blocks``
    for Mamba groups) of a request that computed ``num_tokens``."""
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec

    out = []
    for g, ids in zip(sched_cfg.transfer_groups, block_ids, strict=True):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):
            out.append(clip_ssm_state_blocks(list(ids), spec.num_speculative_blocks))
        elif isinstance(spec, CircularBufferSpec):
            assert len(ids) == 1, ids  # vLLM allocates the ring one block per request
            out.append(list(ids))
        else:
            out.append(list(ids[:-(-num_tokens // spec.block_size)]))
    return out


def _prefill_on_p(tmp_path, prompt):
    s, finished, hbs = _scheduler(tmp_path, "kv_producer", "P-q4")
    req = _request(prompt, hbs, {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None})
    s.add_request(req)
    for _ in range(10):
        if finished:
            break
        _step(s)
    return s, req, finished


def test_p_request_finished_on_vllm_s_scheduler_clips_each_group_as_vllm_does(tmp_path):
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec
    from vllm.v1.request import RequestStatus

    s, req, finished = _prefill_on_p(tmp_path, list(range(1, PROMPT + 1)))
    ((rid, block_ids, (delay_free, params)),) = finished
    assert rid == req.request_id and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    n = PROMPT - 1  # state groups: P leaves the last token to D (prefill_backoff)
    assert req.num_prompt_tokens == n and req.num_computed_tokens == n
    assert delay_free is True
    assert rid in s.requests  # vLLM kept the request and its blocks for the READ
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == n
    assert params["remote_engine_id"] == "P-q4" and params["remote_request_id"] == rid
    cfg = s.kv_cache_config
    want = _vllm_clip(cfg, block_ids, n)
    assert params["remote_block_ids"] == want
    # The rules, group by group, on vLLM's own block table:
    spec_blocks = s.vllm_config.speculative_config.num_speculative_tokens
    for g, ids, got in zip(cfg.transfer_groups, block_ids, params["remote_block_ids"],
                           strict=True):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):  # GDN and PLE: the running slot only
            assert spec.num_speculative_blocks == spec_blocks and len(got) == 1
            live = [b for b in ids if b]
            assert got[0] != 0 and got[0] in live
            assert got[0] not in live[-spec_blocks:]  # not an MTP scratch slot
            assert got == live[-1 - spec_blocks:-spec_blocks]  # nor an earlier checkpoint
        elif isinstance(spec, CircularBufferSpec):
            assert got == ids and len(got) == 1
        else:  # compressed keys with the main KV: one table, every computed token's block
            assert len(got) == -(-n // spec.block_size) and got == ids[:len(got)]
            assert 0 not in got
    # Nothing freed under the lease: vLLM frees when the worker reports finished_sending.
    _step(s, ())
    assert rid in s.requests
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = s.schedule()
    mro = ModelRunnerOutput(req_ids=[], req_id_to_index={},
                            kv_connector_output=KVConnectorOutput(finished_sending={rid}))
    s.update_from_output(out, mro)
    assert rid not in s.requests


def _d_params(params: dict) -> dict:
    """What the router hands D: P's params as they came (the toy proxy passes them on)."""
    return dict(params)


def test_d_allocates_through_vllm_s_manager_and_the_read_fits_each_group(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec
    from vllm.v1.request import RequestStatus

    prompt = list(range(1, PROMPT + 1))
    _, _, finished = _prefill_on_p(tmp_path, prompt)
    p_params = finished[0][2][1]
    n = p_params["remote_num_tokens"]
    s, _, hbs = _scheduler(tmp_path, "kv_consumer", "D-q4")
    asked = []
    real = s.connector.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        answer = real(request, num_computed_tokens)
        asked.append((num_computed_tokens, answer))
        return answer

    s.connector.get_num_new_matched_tokens = spy
    req = _request(prompt, hbs, _d_params(p_params), max_tokens=4)
    s.add_request(req)
    out = _step(s)
    assert asked[0] == (0, (n, True))  # everything P computed, asynchronously
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}  # nothing computed while the READ is pending
    plan = out.kv_connector_metadata.plan
    (admit,) = plan.admits
    assert admit.local_id == req.request_id and admit.error == ""
    (read,) = plan.reads
    assert read.local_id == req.request_id and read.awaiting
    table = s.kv_cache_manager.get_block_ids(req.request_id)  # vLLM's allocation
    cfg = s.kv_cache_config
    layout = s.connector.layout
    spec_blocks = s.vllm_config.speculative_config.num_speculative_tokens
    for g, mine, theirs, got in zip(cfg.transfer_groups, table, p_params["remote_block_ids"],
                                    read.local_block_ids, strict=True):
        spec = g.kv_cache_spec
        assert set(got) <= set(mine) and 0 not in got  # D's own blocks, no null block
        if isinstance(spec, MambaSpec):  # the state slot and its MTP scratch slots
            assert got == [b for b in mine if b][-1 - spec_blocks:]
        elif isinstance(spec, CircularBufferSpec):
            assert got == mine and len(got) == 1
        else:
            assert got == mine[:-(-n // spec.block_size)] and len(got) == len(theirs)
    rplan = plan_group_reads(layout, layout, p_params["remote_block_ids"],
                             read.local_block_ids, n, null_block=0)
    assert len(rplan.reads) == len(cfg.transfer_groups)
    for r, g, mine, theirs in zip(rplan.reads, cfg.transfer_groups, table,
                                  p_params["remote_block_ids"], strict=True):
        assert list(r.remote_ids) == theirs
        if isinstance(g.kv_cache_spec, MambaSpec):
            # into the slot vLLM's own clip names on D: the running state D decodes from
            assert list(r.local_ids) == clip_ssm_state_blocks(
                [b for b in mine if b], g.kv_cache_spec.num_speculative_blocks)
        else:
            assert len(r.local_ids) == len(theirs)
    # The worker reports the READ done: vLLM schedules the one token D computes itself.
    out = _step(s, finished_recving={req.request_id})
    assert out.num_scheduled_tokens == {}  # the report arrives with this step's output
    out = _step(s)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == req.request_id and new.num_computed_tokens == n
    drafts = out.scheduled_spec_decode_tokens.get(req.request_id, [])
    assert len(drafts) == spec_blocks  # vLLM's MTP placeholders, not prompt tokens
    assert out.num_scheduled_tokens[req.request_id] - len(drafts) == PROMPT - n == 1
    assert req.num_output_tokens == 1  # the model's first token, from D's own step


def test_d_prefix_hit_with_align_checkpoints_reads_only_past_the_hit(tmp_path):
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec

    prompt = list(range(1, PROMPT + 1))
    _, _, finished = _prefill_on_p(tmp_path, prompt)
    p_params = finished[0][2][1]
    n = p_params["remote_num_tokens"]
    s, _, hbs = _scheduler(tmp_path, "kv_consumer", "D-q4")
    asked = []
    real = s.connector.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        answer = real(request, num_computed_tokens)
        asked.append((request.request_id, num_computed_tokens, answer))
        return answer

    s.connector.get_num_new_matched_tokens = spy
    local = _request(prompt[:200], hbs)  # a local request sharing the first 200 tokens
    s.add_request(local)
    for _ in range(6):
        _step(s)
    assert local.is_finished() and local.request_id not in s.requests
    req = _request(prompt, hbs, _d_params(p_params), max_tokens=4)
    s.add_request(req)
    out = _step(s)
    ((_, hit, answer),) = [a for a in asked if a[0] == req.request_id]
    bs = s.kv_cache_config.transfer_groups[-1].kv_cache_spec.block_size
    # vLLM's manager found a hit at an 'align' checkpoint: a block boundary, inside the
    # shared 200 tokens; the connector asks for the rest of what P computed.
    assert 0 < hit < 200 and hit % bs == 0, hit
    assert answer == (n - hit, True)
    (read,) = out.kv_connector_metadata.plan.reads
    table = s.kv_cache_manager.get_block_ids(req.request_id)
    pool = s.kv_cache_manager.block_pool.blocks
    spec_blocks = s.vllm_config.speculative_config.num_speculative_tokens
    for g, mine, got in zip(s.kv_cache_config.transfer_groups, table, read.local_block_ids,
                            strict=True):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):  # the hit's checkpoint is D's; the slot is read over it
            assert got == [b for b in mine if b][-1 - spec_blocks:]
        elif isinstance(spec, CircularBufferSpec):
            assert got == mine and len(got) == 1
        else:  # the hit's blocks are D's own (cached by the local request): not read
            assert all(pool[b].block_hash is not None for b in mine[:hit // bs])
            assert got == mine[hit // bs:-(-n // bs)]
    layout = s.connector.layout
    rplan = plan_group_reads(layout, layout, p_params["remote_block_ids"],
                             read.local_block_ids, n, null_block=0)
    for r, g, theirs in zip(rplan.reads, s.kv_cache_config.transfer_groups,
                            p_params["remote_block_ids"], strict=True):
        if not isinstance(g.kv_cache_spec, (MambaSpec, CircularBufferSpec)):
            # P's blocks past the hit, position for position
            assert list(r.remote_ids) == theirs[hit // bs:]
            assert list(r.local_ids) == read.local_block_ids[list(s.kv_cache_config.transfer_groups).index(g)]
        else:
            assert list(r.remote_ids) == theirs


def test_p_prefix_hit_exports_the_shared_blocks_and_the_running_slot(tmp_path):
    """P with prefix caching: a prompt sharing an earlier local request's prefix hits
    vLLM's cache at an 'align' checkpoint; its export is still every computed token's
    block (the hit's cached blocks included) and each state group's running slot."""
    s, finished, hbs = _scheduler(tmp_path, "kv_producer", "P-q4")
    prompt = list(range(1, PROMPT + 1))
    local = _request(prompt[:200], hbs)
    s.add_request(local)
    for _ in range(6):
        _step(s)
    assert local.is_finished() and local.request_id not in s.requests
    # vLLM asks the connector about every request; not a remote decode: nothing kept
    assert [(r, a) for r, _, a in finished] == [(local.request_id, (False, None))]
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    req = _request(prompt, hbs, params)
    s.add_request(req)
    out = _step(s)
    (new,) = out.scheduled_new_reqs
    bs = s.kv_cache_config.transfer_groups[-1].kv_cache_spec.block_size
    hit = new.num_computed_tokens
    assert 0 < hit < 200 and hit % bs == 0, hit  # vLLM's hit, at an 'align' checkpoint
    for _ in range(6):
        if len(finished) == 2:
            break
        _step(s)
    (rid, block_ids, (delay_free, got)) = finished[1]
    n = PROMPT - 1
    assert rid == req.request_id and delay_free and got["remote_num_tokens"] == n
    assert got["remote_block_ids"] == _vllm_clip(s.kv_cache_config, block_ids, n)
    pool = s.kv_cache_manager.block_pool.blocks
    prompt_blocks = got["remote_block_ids"][-1]
    assert len(prompt_blocks) == -(-n // bs)
    # The hit's blocks (cached by the local request) are handed over with the rest.
    assert all(pool[b].block_hash is not None for b in prompt_blocks[:hit // bs])


def test_d_with_prompt_logprobs_computes_the_whole_prompt_and_releases_p(tmp_path):
    """A request with prompt logprobs skips reading the prefix cache: vLLM's scheduler on
    D drops the connector's match (``scheduler.py``: ``skip_reading_prefix_cache``), so D
    computes the whole prompt and reads nothing.  D still admits P's export (P left the
    same last token out as for any request) and its plan releases P's blocks at once."""
    from vllm.sampling_params import SamplingParams

    prompt = list(range(1, PROMPT + 1))
    _, _, finished = _prefill_on_p(tmp_path, prompt)
    p_params = finished[0][2][1]
    s, _, hbs = _scheduler(tmp_path, "kv_consumer", "D-q4")
    req = _request(prompt, hbs, _d_params(p_params), max_tokens=4)
    req.sampling_params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    req.skip_reading_prefix_cache = req.get_skip_reading_prefix_cache()
    assert req.skip_reading_prefix_cache
    s.add_request(req)
    out = _step(s)
    plan = out.kv_connector_metadata.plan
    (admit,) = plan.admits
    assert admit.error == ""  # P's export is what D expected: no rejection
    (read,) = plan.reads
    assert not read.awaiting and not any(read.local_block_ids)  # nothing to read: a release
    (new,) = out.scheduled_new_reqs  # not waiting for remote KVs: D computes from token 0
    assert new.req_id == req.request_id and new.num_computed_tokens == 0
    computed = out.num_scheduled_tokens[req.request_id]
    while computed < PROMPT:  # in chunks of the step's token budget
        computed += _step(s).num_scheduled_tokens[req.request_id]
    assert computed == PROMPT and req.num_output_tokens == 1


def test_d_tells_vllm_it_loads_the_transfer_groups_as_nixl_connector_does(tmp_path):
    """``get_loaded_kv_cache_group_ids``: vLLM skips zeroing the new blocks of these groups
    while the load runs.  The seed's groups all transfer; the answer is vLLM's
    NixlConnector's for the same config (its transfer groups, not every group)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
    )

    s, _, hbs = _scheduler(tmp_path, "kv_consumer", "D-q4")
    req = _request(list(range(1, PROMPT + 1)), hbs)
    cfg = s.kv_cache_config
    nixl = NixlBaseConnector.get_loaded_kv_cache_group_ids(
        SimpleNamespace(_kv_cache_config=cfg), req)
    assert s.connector.get_loaded_kv_cache_group_ids(req) == nixl == cfg.transfer_group_ids


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_the_prefill_backoff_is_nixl_connector_s_for_the_drafter_s_lookahead(tmp_path, lookahead):
    """The prompt tokens P leaves to D: the seed's state groups need one, a drafter that
    reads ``num_prefill_lookahead_tokens`` past the computed range (multi-module MTP) all
    of them but one; vLLM's NixlConnector scheduler computes the same
    (``_prefill_backoff``) from the same config."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

    from kvhandoff.adapters.vllm.layout import cache_layout
    from kvhandoff.core.planning import prefill_backoff

    s, _, _ = _scheduler(tmp_path, "kv_consumer", "D-q4")
    cfg = s.vllm_config
    assert s.connector.layout.prefill_lookahead == cfg.num_prefill_lookahead_tokens == 1
    layout = cache_layout(s.kv_cache_config, cfg.num_speculative_tokens,
                          prefill_lookahead=lookahead)
    nixl = NixlBaseConnectorScheduler._prefill_backoff(SimpleNamespace(
        _has_mamba=True, _bounded_replay=False,
        vllm_config=SimpleNamespace(num_prefill_lookahead_tokens=lookahead)))
    assert prefill_backoff(layout) == nixl == max(1, lookahead - 1)


def test_d_computes_a_prompt_no_longer_than_the_backoff_itself_and_releases_p(tmp_path):
    """P prefills a prompt no longer than the backoff whole (it has nothing to leave to D),
    so the GDN and PLE states it hands over already hold the last token, which D would
    compute again on top of them.  D admits P's export (no rejection), reads nothing and
    computes the prompt itself; its plan releases P's blocks at once."""
    prompt = [5]
    _, _, finished = _prefill_on_p(tmp_path, prompt)
    p_params = finished[0][2][1]
    assert p_params["remote_num_tokens"] == 1  # prefilled whole
    s, _, hbs = _scheduler(tmp_path, "kv_consumer", "D-q4")
    req = _request(prompt, hbs, _d_params(p_params), max_tokens=4)
    s.add_request(req)
    out = _step(s)
    plan = out.kv_connector_metadata.plan
    (admit,) = plan.admits
    assert admit.error == ""
    (read,) = plan.reads
    assert not read.awaiting and not any(read.local_block_ids)  # nothing to read: a release
    (new,) = out.scheduled_new_reqs
    assert new.req_id == req.request_id and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens[req.request_id] == 1 and req.num_output_tokens == 1

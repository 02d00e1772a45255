"""The policies a run can use: this project's, and vLLM 0.32's NIXL connector.

Both drive the same core and write the same kind of event log; they differ
in the decisions the races are about, on both sides:

* ``kvhandoff``: D heartbeats every request in a heartbeat state
  (`core.lifecycle.HEARTBEAT_STATES`, the rule `core.policy.heartbeat_due` states)
  (a client cancel with reads in flight keeps heartbeating until the reads
  drained), proves the source was held by reading P's fence after the reads
  drained (or, where the fence proves nothing, by P's acknowledgement) and
  passes bytes on only when `read_verdict` is CONFIRMED, and releases after
  ``finished_recving``.  P mints a release token, answers heartbeats with the
  time left, takes the sender of a notification from the transport peer (as
  learned at the handshake) and counts one release per consumer rank.
* ``vllm-0.32``: a model of vLLM 0.32's NIXL connector (read from
  ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py`` and
  ``base_worker.py``): ``request_finished`` stops a request's heartbeat as
  soon as the client aborts; every READ carries the ``"<req_id>:<N>"``
  notification; P counts every such notification, from whoever sends it,
  with no per-rank dedupe, until it has N; P sends no acknowledgement, so D
  serves whatever its completed reads brought in; a heartbeat extends the
  lease to ``max(old, now + 2/3 lease)``; no fence.  The log still records the core's
  verdict (a FAILED request in the log that the model served anyway is
  exactly the bug).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodePolicy:
    name: str
    stop_heartbeat_on_cancel: bool
    serve_unconfirmed: bool
    mint_tokens: bool  # P hands out a release token with the transfer parameters
    release_with_reads: bool = False  # each READ carries its rank's release (vLLM's notif_msg)
    acknowledges: bool = True  # P answers heartbeats with the time left; D waits for that proof
    checks_sender: bool = True  # P binds the transport peer and counts one release per rank
    lease_extension: float = 1.0  # a heartbeat moves the deadline to now + this * lease
    fences: bool = True  # P keeps a fence slot per export; D reads it rather than ask P


KVHANDOFF = DecodePolicy("kvhandoff", stop_heartbeat_on_cancel=False, serve_unconfirmed=False,
                         mint_tokens=True)
VLLM_032 = DecodePolicy("vllm-0.32", stop_heartbeat_on_cancel=True, serve_unconfirmed=True,
                        mint_tokens=False, release_with_reads=True, acknowledges=False,
                        checks_sender=False, lease_extension=2 / 3, fences=False)
POLICY_BY_NAME = {p.name: p for p in (KVHANDOFF, VLLM_032)}

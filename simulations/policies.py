"""The decode-side policies a run can use: this project's, and vLLM 0.32's.

Both drive the same core and write the same kind of event log; they differ
only in the two decisions the races are about:

* ``kvhandoff``: heartbeat exactly what `core.policy.heartbeat_due` says (a
  client cancel with reads in flight keeps heartbeating until the reads
  drained), and pass bytes on only when `read_verdict` is CONFIRMED.
* ``vllm-0.32``: a faithful model of vLLM 0.32's NIXL connector
  (FIELD_NOTES.md): ``request_finished`` stops a request's heartbeat as soon
  as the client aborts, whatever its reads are doing, and D serves whatever
  bytes its completed reads brought in.  Its P mints no release token
  (vLLM's release is ``"<req_id>:<N>"``, from whoever sends it).  The log still records the core's
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


KVHANDOFF = DecodePolicy("kvhandoff", stop_heartbeat_on_cancel=False, serve_unconfirmed=False,
                         mint_tokens=True)
VLLM_032 = DecodePolicy("vllm-0.32", stop_heartbeat_on_cancel=True, serve_unconfirmed=True,
                        mint_tokens=False)
POLICY_BY_NAME = {p.name: p for p in (KVHANDOFF, VLLM_032)}

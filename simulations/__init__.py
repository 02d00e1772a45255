"""The deterministic simulated world of the P/D hand-off (docs/simulation.md).

* `config` — what a run is made of (`RunConfig`, `CancelPlan`).
* `scenarios` — the catalogue: a name and a seed give a `RunConfig`.
* `world` — one run: P, D, clients, proxy and the faulty fabric on one clock.
* `prefill`, `decode` — P drives the core's `ProducerEngine` (the code vLLM runs); D still
  models its decisions on the core's policy functions through a ledger.
* `loop` — an engine's step loop on the simulated clock.
* `policies` — `kvhandoff` and the `vllm-0.32` model.
* `kv` — the KV bytes P computes and D checks.
* `runner` — sweeps over seeds and scenarios, with repro commands.

The fabric, the clock and the block pools are `kvhandoff.transports.sim`.
"""

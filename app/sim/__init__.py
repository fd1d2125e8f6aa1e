"""Digital twin: a discrete-event simulation of a PDD cluster from its serve config.

It reads the same `PDDConfig` as the real app and makes every decision with
the same app/policy.py functions as the real conductor; engines (continuous
batching, chunked prefill, prefix caches) and links (latency draws, shared
bandwidth) are modelled. `pdd sim CONFIG` is the command line (app/sim/cli.py).

API for comparisons with real runs (e.g. bench/sim_vs_real.py):

    from app.sim import simulate, fit_from_samples, load_samples, read_trace

    perf = fit_from_samples(load_samples("steps.json"))  # measured engine steps
    run = simulate(config, "trace.jsonl", perf=perf)     # or a list of Request
    for r in run.records():                               # in arrival order
        r.ttft_s, r.tpot_s, r.max_gap_s, r.pipeline       # per request
    run.summary()                                         # percentiles, SLA goodput, BCR

- `simulate(config, workload, perf=None, seed=0, progress=None, *, outages=(), warm_start=False) -> SimRun`:
  `workload` is a list/iterable of `Request` (arrival order), a JSONL trace
  path (format in app/sim/workload.py), or `AgenticWorkload` settings.
  `warm_start`: conversations under way when the run starts (their first
  request repeats a prefix) find it cached where routing puts it; else every
  cache starts empty, as in a fresh deployment (app/sim/twin.py). `perf`
  is one `PerfModel` for every node group, a mapping node-group name ->
  model, or None for each group's roofline from `node_groups.*.spec`. A
  fitted model keeps KV capacity at the role's `engine.kv_cache_gib`.
  `config.model.spec` is required (KV bytes per token).
- `SimRun.records()` -> list of `RequestResult` (ttft_s, tpot_s, max_gap_s,
  pipeline, prompt/output tokens, prefix hits, relay tokens, WAN bytes);
  `SimRun.results.arrays()` gives the same as numpy columns (fast for
  millions); `SimRun.summary(warmup)` the figures `pdd sim` prints.
- `fit_from_samples(samples) -> FittedPerf`: step time = a + b*prefill_tokens
  + c*decode_seqs + d*kv_tokens_read + e*attention_pairs, least squares on
  relative errors, non-negative; samples JSON format in app/sim/perf.py
  (`load_samples`, `save_samples`).
- `goodput_search(config, workload_at, ...)`: the highest RPS meeting the
  config's SLO; `hit_sweep(..., jobs=None)`: benefit against prefix hit rate,
  its runs on every CPU. `app.sim.parallel.run_all` runs any independent runs
  on several processes, with the same figures as one.

Modules: events (the loop), perf (step times), cache (prefix caches), engine
(one replica), network (links), cluster (replicas from the config), twin (the
conductor's pipelines), jobs (its per-request state), workload (generator,
traces), results, report, run, parallel (runs on several processes), cli. The hot ones run compiled where
`pdd native build` built them (app/native.py; their .pxd files declare the
compiled classes' fields), with the same results as plain Python.
"""

from app.sim.outages import Outage
from app.sim.perf import FittedPerf, PerfModel, Roofline, StepSample, fit_from_samples, load_samples, save_samples
from app.sim.report import Summary, summarize
from app.sim.results import RequestResult, Results
from app.sim.run import SimRun, goodput_search, hit_sweep, simulate
from app.sim.workload import AgenticWorkload, Request, read_trace, write_trace

__all__ = [
    "AgenticWorkload",
    "FittedPerf",
    "Outage",
    "PerfModel",
    "Request",
    "RequestResult",
    "Results",
    "Roofline",
    "SimRun",
    "StepSample",
    "Summary",
    "fit_from_samples",
    "goodput_search",
    "hit_sweep",
    "load_samples",
    "read_trace",
    "save_samples",
    "simulate",
    "summarize",
    "write_trace",
]

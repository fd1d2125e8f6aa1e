"""What-if for the agents (agents/whatif.py) and chat-ops: a replica plan and live knobs at a load.

    what_if(config, {"prefill": 4, "relay_decode": 1, "main_decode": 3}, knobs, 6.0)
      -> WhatIfAnswer(ttft_ms=..., tpot_ms=..., gap_ms=..., goodput_rps=..., cost_per_hour=..., ...)

The config's roles get the plan's replica counts (roles the plan leaves out keep
theirs) and the knobs' routing and handoff; an agentic workload sized to the
model's context window is served at `load_rps`, starting from the caches a
cluster serving it would hold (the twin's warm start). Latencies are at the SLO's
percentile (`config.slo.percentile`); `goodput_rps` is the rate of requests that
met every SLO target at that load, and `cost_per_hour` the plan's hardware.
Raises ValueError (SimConfigError) when the config lacks the twin's figures or a
role the mode needs has no replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.config import LiveKnobs, PDDConfig, RoleName
from app.sim.cluster import SimConfigError, cost_per_hour, derive
from app.sim.run import simulate
from app.sim.workload import AgenticWorkload, fitted_to_window

#: Requests per what-if: enough turns for the queues to settle, fast enough for an agent tick.
REQUESTS = 3000
WARMUP = 0.2


@dataclass(frozen=True)
class WhatIfAnswer:
    ttft_ms: float
    tpot_ms: float
    gap_ms: float
    """Worst inter-token gap."""
    goodput_rps: float
    cost_per_hour: float
    slo_attainment: float
    percentile: float
    load_rps: float
    requests: int

    def __getitem__(self, name: str) -> float:
        return getattr(self, name)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_for(config: PDDConfig, load_rps: float, requests: int = REQUESTS, seed: int = 0) -> AgenticWorkload:
    """The default agentic mix, its contexts fitted into the served model's window."""
    return fitted_to_window(AgenticWorkload(requests=requests, rps=load_rps, seed=seed), config.model.max_model_len)


def what_if(config: PDDConfig, replicas: dict[str, int], knobs: LiveKnobs, load_rps: float, requests: int = REQUESTS, seed: int = 0) -> WhatIfAnswer:
    if load_rps <= 0:
        raise ValueError("load_rps must be positive")
    roles = config.roles.model_copy()
    for name, count in replicas.items():
        try:
            role = RoleName(name)
        except ValueError:
            raise SimConfigError(f"unknown role '{name}'; roles: {', '.join(r.value for r in RoleName)}") from None
        rc = config.roles.get(role)
        if rc is None:
            raise SimConfigError(f"roles.{name}: not in this config")
        setattr(roles, role.value, rc.model_copy(update={"replicas": int(count)}))
    plan = derive(config, roles=roles, routing=knobs.routing, handoff=knobs.handoff)
    run = simulate(plan, workload_for(plan, load_rps, requests, seed), seed=seed, warm_start=True)
    import numpy as np

    a = run.results.arrays()
    keep = a["arrival"] >= a["arrival"][0] + WARMUP * (a["arrival"][-1] - a["arrival"][0])
    q = config.slo.percentile

    def at(column: str) -> float:
        v = a[column][keep]
        v = v[~np.isnan(v)]
        return float(np.percentile(v, q)) * 1000 if len(v) else float("nan")

    s = run.summary(WARMUP)
    return WhatIfAnswer(
        ttft_ms=at("ttft"),
        tpot_ms=at("tpot"),
        gap_ms=at("gap"),
        goodput_rps=float(s.sla_goodput_rps),
        cost_per_hour=cost_per_hour(plan),
        slo_attainment=float(s.slo_attainment),
        percentile=q,
        load_rps=load_rps,
        requests=s.requests,
    )

"""The swarm against the digital twin: the same graph, one tick per call, no I/O.

The twin supplies a Snapshot (its own figures, shaped like Prometheus'
answers: `snapshot_from_run`) and applies the returned knobs and replica
counts itself. Memory (cooldowns, hysteresis, units awaiting verification)
stays in the TwinAgent, so successive calls behave like successive ticks of
the live swarm, including rollbacks when the twin's next snapshot shows a
regression. `TwinWhatIf` answers the capacity specialist's what-ifs
(agents/whatif.py) by simulating the candidate plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from agents.actuate import DryRunActuator
from agents.entries import NoEntries
from agents.figures import deployment
from agents.graph import Deps, build_graph, new_tick_id
from agents.knobs import Change
from agents.memory import InMemoryBackend, Memory
from agents.proposal import Decision
from agents.router import Router, RuleRouter
from agents.situations import Situation
from agents.verify import Verdict
from agents.whatif import WhatIf
from app.config import MODE_ROLES, AgentMode, LiveKnobs, Mode, PDDConfig, RoleName
from app.engine.kv.link import direction_name
from app.policy import Pipeline
from app.sim import Request, SimRun, simulate
from app.telemetry.metrics import RATIO_BUCKETS
from app.telemetry.snapshot import Snapshot, StaticSource


@dataclass
class TwinTick:
    knobs: LiveKnobs
    """Knobs after the tick (apply them to the twin)."""
    replicas: dict[str, int]
    """Role -> replica count after the tick."""
    changes: list[Change]
    """What this tick changed, rollbacks included, in order."""
    rollbacks: list[Change]
    situations: list[Situation]
    decisions: list[Decision]
    verdicts: list[Verdict]
    memory: Memory


class TwinAgent:
    def __init__(self, config: PDDConfig, *, what_if: WhatIf | None = None, router: Router | None = None, memory: Memory | None = None):
        self.config = config
        self.source = StaticSource()
        self.actuator = DryRunActuator(config.live_knobs(), {r.value: rc.replicas for r, rc in config.roles.present().items()})
        self.memory = InMemoryBackend(memory)
        self.now = 0.0
        deps = Deps(
            config=config,
            agents=config.agents.model_copy(update={"mode": AgentMode.act}),
            source=self.source,
            actuator=self.actuator,
            memory=self.memory,
            entries=NoEntries(),
            router=router or RuleRouter(),
            what_if=what_if,
            clock=lambda: self.now,
        )
        self.graph = build_graph(deps).compile()

    def tick(self, snapshot: Snapshot, *, knobs: LiveKnobs | None = None, replicas: dict[str, int] | None = None) -> TwinTick:
        """One tick at `snapshot.at`; `knobs` / `replicas` override what the agent last set."""
        if knobs is not None:
            self.actuator.knobs = knobs
        if replicas is not None:
            self.actuator.replicas = dict(replicas)
        self.source.current = snapshot
        self.now = snapshot.at
        state = self.graph.invoke({"tick": new_tick_id(snapshot.at), "mode": AgentMode.act.value, "now": snapshot.at})
        verdicts = [Verdict.model_validate(v) for v in state.get("verdicts", [])]
        rollbacks = [c for v in verdicts for c in v.rollback]
        applied = [Change.model_validate(c) for c in state.get("applied", [])]
        return TwinTick(
            knobs=self.actuator.knobs,
            replicas=dict(self.actuator.replicas),
            changes=applied + rollbacks,
            rollbacks=rollbacks,
            situations=[Situation.model_validate(s) for s in state.get("situations", [])],
            decisions=[Decision.model_validate(d) for d in state.get("decisions", [])],
            verdicts=verdicts,
            memory=self.memory.load(),
        )


def run_tick(
    config: PDDConfig, snapshot: Snapshot, *, knobs: LiveKnobs, replicas: dict[str, int], memory: Memory | None = None, what_if: WhatIf | None = None
) -> TwinTick:
    """One tick as a function: pass the returned `memory` into the next call."""
    return TwinAgent(config, what_if=what_if, memory=memory).tick(snapshot, knobs=knobs, replicas=replicas)


def fleet_config(config: PDDConfig, replicas: dict[str, int], knobs: LiveKnobs) -> PDDConfig:
    """`config` running `replicas` (role name -> count; roles not named keep theirs) with live `knobs`."""
    roles = config.roles.model_copy(
        update={role.value: rc.model_copy(update={"replicas": replicas.get(role.value, rc.replicas)}) for role, rc in config.roles.present().items()}
    )
    data = {name: getattr(config, name) for name in PDDConfig.model_fields}
    return PDDConfig.model_validate({**data, "roles": roles, "routing": knobs.routing, "handoff": knobs.handoff})


# ---- the twin's run as the agents' Snapshot ---------------------------------------------

#: The role that decodes a request to its end, by pipeline: its prefix hit is the decode-side
#: hit the real app records. P-RLD is missing: the twin records no hit for RLD there.
_FINISHER = {
    Pipeline.p_md: RoleName.main_decode,
    Pipeline.p_rld_md: RoleName.main_decode,
    Pipeline.p_p_md: RoleName.main_decode,
    Pipeline.p_d_naive: RoleName.main_decode,
    Pipeline.p_d_cross: RoleName.main_decode,
    Pipeline.colocated: RoleName.main_decode,
    Pipeline.p_d: RoleName.relay_decode,
}
_RELAYED = (Pipeline.p_rld_md.value, Pipeline.p_rld.value)
#: WAN utilisation at which the queueing estimate of a pull's time stops growing: past it the
#: backlog outgrows any window, and a finite figure still tells the agents "very slow".
_MAX_WAN_UTILISATION = 0.95


def _pct(values: np.ndarray, q: float) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else None


def _by_pipeline(pipes: np.ndarray, values: np.ndarray, q: float) -> dict[str, float]:
    out = {}
    for p in np.unique(pipes):
        v = _pct(values[pipes == p], q)
        if v is not None:
            out[str(p)] = v
    return out


def _le(bound: float) -> str:
    """A histogram bucket's `le` label as Prometheus writes it."""
    return repr(float(bound))


def snapshot_from_run(run: SimRun, config: PDDConfig, now: float, *, window_s: float | None = None, end_s: float | None = None) -> Snapshot:
    """What Prometheus would answer at `now` about `window_s` seconds of the twin's run.

    `run` is a finished `app.sim.simulate(...)` of `run.config`; the window
    holds the requests sent in the `window_s` seconds (default
    `config.slo.window_s`) before `end_s` of simulated time (default: the
    last request's), so a run simulated with a warm-up first reports warm
    caches. Give `end_s` as the end of the offered traffic when the cluster
    may be overloaded: turns held back behind their conversation's previous
    one are sent late, and past that end they are a backlog, not traffic of
    the window. Figures follow app/telemetry/queries.py: percentiles at
    `config.slo.percentile` (exact, where Prometheus interpolates buckets),
    rates per second of the window, gaps and SLO violations counted as
    app/telemetry/metrics.py's `record_journey` counts them.

    Where the twin's per-request records are silent, the figure is derived:
    - requests in progress per deployment (Serve's own gauge), by Little's
      law over the window: P holds a request from arrival to first token,
      RLD for its relay tokens at the request's TPOT, the finishing decoder
      from first to last token;
    - seconds per WAN pull, from the link model and the window's WAN
      utilisation rho (processor sharing: RTT + mean jitter and stall +
      bytes / (bandwidth x (1 - rho))): records carry each request's WAN
      bytes, not its pull's duration;
    - intra-datacenter pulls, RLD's prefix hit and KV leases are not in the
      records: those figures stay unset, as for a query without data.
    """
    slo = config.slo
    window = float(window_s if window_s is not None else slo.window_s)
    w = _Window.of(run, window, end_s)
    fleet, q, span, pipes = run.config, slo.percentile, w.span, w.pipes
    gap, steady_tpot = w.gap, w.steady_tpot
    present = fleet.roles.present()  # holds every role of the mode (PDDConfig validates it)
    replicas = {deployment(role): float(present[role].replicas) for role in MODE_ROLES[fleet.mode]}
    kv = _wan_pulls(w, fleet)
    return Snapshot(
        at=now,
        window_s=window,
        ttft_p_by_pipeline=_by_pipeline(pipes, w.ttft, q),
        ttft_p99_by_pipeline=_by_pipeline(pipes, w.ttft, 99),
        ttft_p=_pct(w.ttft, q),
        tpot_p_by_pipeline=_by_pipeline(pipes, w.tpot, q),
        tpot_p=_pct(w.tpot, q),
        gap_p99_by_pipeline=_by_pipeline(pipes, gap, 99),
        gap_p=_pct(gap, q),
        gap_p99=_pct(gap, 99),
        request_rate_by_pipeline={str(p): float(n) / span for p, n in zip(*np.unique(pipes, return_counts=True))},
        prefix_hit_by_role=_prefix_hits(w),
        md_hit_buckets=_md_hit_buckets(w),
        kv_seconds_mean_by_link=kv["mean"],
        kv_seconds_p90_by_link=kv["p90"],
        kv_slowdown_mean_by_link=kv["slowdown"],
        kv_bytes_per_transfer_by_link=kv["bytes"],
        kv_transfer_rate_by_link=kv["rate"],
        kv_failure_rate_by_link={label: 0.0 for label in kv["rate"]},
        relay_tokens_p90=_pct(w.relay[w.relayed], 90),
        singular_rate=float((pipes == Pipeline.p_rld.value).sum()) / span if fleet.mode is Mode.pdd else None,
        slo_violation_rate_by_slo={
            "ttft": float((w.ttft * 1000 > slo.ttft_ms).sum()) / span,
            "tpot": float((steady_tpot * 1000 > slo.tpot_ms).sum()) / span,
            "gap": float((np.nan_to_num(gap) * 1000 > slo.max_gap_ms).sum()) / span,
        },
        replicas_healthy_by_deployment=replicas,
        replicas_target_by_deployment=dict(replicas),
        ongoing_by_deployment=_ongoing(w, fleet),
        health_check_failures_by_deployment={name: 0.0 for name in replicas},
    )


@dataclass
class _Window:
    """The twin's records of the requests one window holds, as columns."""

    span: float
    """Seconds the window's requests were sent over (at most the window)."""
    pipes: np.ndarray
    finisher: np.ndarray
    """The role that produced each request's last token ("" for none)."""
    ttft: np.ndarray
    tpot: np.ndarray
    gap: np.ndarray
    """Worst gap; NaN for one-token answers, which have none (record_journey skips them)."""
    prompt: np.ndarray
    output: np.ndarray
    p_hit: np.ndarray
    d_hit: np.ndarray
    relay: np.ndarray
    wan: np.ndarray

    @classmethod
    def of(cls, run: SimRun, window: float, end_s: float | None) -> _Window:
        records = run.records()
        end = end_s if end_s is not None else max((r.arrival_s for r in records), default=0.0)
        records = [r for r in records if end - window <= r.arrival_s <= end]

        def col(name: str) -> np.ndarray:
            return np.array([getattr(r, name) for r in records], dtype=float)

        output = col("output_tokens")
        return cls(
            span=max(min(window, end - min((r.arrival_s for r in records), default=end)), 1e-9),
            pipes=np.array([r.pipeline.value for r in records], dtype=object),
            finisher=np.array([_FINISHER[r.pipeline].value if r.pipeline in _FINISHER else "" for r in records], dtype=object),
            ttft=col("ttft_s"),
            tpot=col("tpot_s"),
            gap=np.where(output > 1, col("max_gap_s"), np.nan),
            prompt=col("prompt_tokens"),
            output=output,
            p_hit=col("prefill_hit_tokens"),
            d_hit=col("decode_hit_tokens"),
            relay=col("relay_tokens"),
            wan=col("wan_bytes"),
        )

    @cached_property
    def with_p(self) -> np.ndarray:
        return self.pipes != Pipeline.colocated.value

    @cached_property
    def relayed(self) -> np.ndarray:
        return np.isin(self.pipes, _RELAYED)

    @cached_property
    def steady_tpot(self) -> np.ndarray:
        """TPOT with one-token answers' NaN as 0."""
        return np.nan_to_num(self.tpot)


def _prefix_hits(w: _Window) -> dict[str, float]:
    """Cached prompt tokens / prompt tokens: P's over requests it prefilled, a decoder's over those it finished."""
    hits: dict[str, float] = {}
    if w.prompt[w.with_p].sum() > 0:
        hits[RoleName.prefill.value] = float(np.minimum(w.p_hit, w.prompt)[w.with_p].sum() / w.prompt[w.with_p].sum())
    for role in (RoleName.main_decode, RoleName.relay_decode):
        mine = w.finisher == role.value
        if w.prompt[mine].sum() > 0:
            hits[role.value] = float(np.minimum(w.d_hit, w.prompt)[mine].sum() / w.prompt[mine].sum())
    return hits


def _md_hit_buckets(w: _Window) -> dict[str, float]:
    """MD's prefix-hit ratios as the histogram's cumulative bucket rates."""
    md = w.finisher == RoleName.main_decode.value
    if not md.any():
        return {}
    ratio = np.minimum(w.d_hit[md], w.prompt[md]) / np.maximum(w.prompt[md], 1)
    return {**{_le(le): float((ratio <= le).sum()) / w.span for le in RATIO_BUCKETS}, "+Inf": float(md.sum()) / w.span}


def _ongoing(w: _Window, fleet: PDDConfig) -> dict[str, float]:
    """Requests in progress per deployment, by Little's law: P holds a request from arrival to
    first token, RLD for its relay tokens, the finishing decoder from first to last token."""
    steady_tpot = w.steady_tpot
    ongoing: dict[str, float] = {}
    for role in MODE_ROLES[fleet.mode]:
        if role is RoleName.prefill:
            busy = w.ttft[w.with_p].sum()
        elif role is RoleName.relay_decode and fleet.mode is Mode.pdd:
            busy = (steady_tpot * w.relay)[w.relayed].sum()
        else:
            busy = (steady_tpot * np.maximum(w.output - 1, 0))[w.finisher == role.value].sum()
        ongoing[deployment(role)] = float(busy) / w.span
    return ongoing


def _wan_pulls(w: _Window, fleet: PDDConfig) -> dict[str, dict[str, float]]:
    """Seconds, bytes and rate of the WAN's pulls by the link model at the window's utilisation."""
    kv: dict[str, dict[str, float]] = {"mean": {}, "p90": {}, "bytes": {}, "rate": {}, "slowdown": {}}
    roles = MODE_ROLES[fleet.mode]
    if RoleName.prefill not in roles or RoleName.main_decode not in roles:
        return kv
    src, dst = fleet.datacenter_of(RoleName.prefill), fleet.datacenter_of(RoleName.main_decode)
    pulled = w.wan[w.wan > 0]
    if src == dst or not len(pulled):
        return kv
    link = fleet.link(src, dst)
    rho = min(float(pulled.sum()) / w.span / link.bytes_per_s, _MAX_WAN_UTILISATION)
    seconds = link.mean_latency_s + pulled / (link.bytes_per_s * (1 - rho))
    label = direction_name(src, dst)
    kv["mean"][label] = float(seconds.mean())
    kv["p90"][label] = float(np.percentile(seconds, 90))
    kv["bytes"][label] = float(pulled.mean())
    kv["rate"][label] = len(pulled) / w.span
    kv["slowdown"][label] = 1.0  # the twin's link is as configured, shared as modelled
    return kv


class TwinWhatIf:
    """The capacity specialist's what-if (agents/whatif.py), answered by simulating the plan.

    `workload_at(rps)` gives the traffic to replay at a load; answers are the
    SLO-percentile figures `snapshot_from_run` reports over the window
    (`window_s` seconds up to `end_s`). Runs are deterministic, so each
    question is simulated once. `warm_start` as in `app.sim.simulate`.
    """

    def __init__(
        self, workload_at: Callable[[float], Iterable[Request]], *, window_s: float, end_s: float | None = None, seed: int = 0, warm_start: bool = False
    ):
        self.workload_at = workload_at
        self.window_s = window_s
        self.end_s = end_s
        self.seed = seed
        self.warm_start = warm_start
        self.answers: dict[str, dict[str, float]] = {}

    def __call__(self, config: PDDConfig, replicas: dict[str, int], knobs: LiveKnobs, load_rps: float) -> dict[str, float]:
        key = json.dumps([sorted(replicas.items()), knobs.model_dump(mode="json"), round(load_rps, 3)], sort_keys=True)
        if key not in self.answers:
            run = simulate(fleet_config(config, replicas, knobs), self.workload_at(load_rps), seed=self.seed, warm_start=self.warm_start)
            snap = snapshot_from_run(run, config, 0.0, window_s=self.window_s, end_s=self.end_s)
            self.answers[key] = {
                "ttft_ms": (snap.ttft_p or 0.0) * 1000,
                "tpot_ms": (snap.tpot_p or 0.0) * 1000,
                "gap_ms": (snap.gap_p or 0.0) * 1000,
            }
        return self.answers[key]

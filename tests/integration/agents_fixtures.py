"""Fixtures for the agent tests: a PDD config, and a scripted exporter per named situation.

The exporter serves exactly the metric names and labels app/telemetry/metrics.py
defines (and Ray Serve's replica metrics, app/telemetry/queries.py), named through
`prom_name`, with values that follow a scenario's levels: counters grow at
the scenario's rates, histograms put each observation at the scenario's
value, gauges hold theirs. A real Prometheus scrapes it.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from agents.actuate import DryRunActuator
from agents.router import RuleRouter
from agents.runner import Swarm
from app.config import PDDConfig
from app.telemetry import metrics as m
from app.telemetry.metrics import MetricSpec, prom_name
from app.telemetry.prometheus import PrometheusServer
from app.telemetry.queries import SERVE_HEALTH_CHECK_FAILURES, SERVE_PROCESSING, SERVE_REPLICA_HEALTHY, SERVE_TARGET_REPLICAS
from app.telemetry.snapshot import StaticSource

APP = "pdd"
WAN = "dc-a->dc-b"
LAN = "dc-a->dc-a"


def pdd_args(**agents: Any) -> dict[str, Any]:
    """A PDD-mode config with all three roles across two datacenters."""
    return {
        "mode": "pdd",
        "node_groups": {
            "gpu-a": {"datacenter": "dc-a", "cost_per_hour": 2.0},
            "gpu-b": {"datacenter": "dc-b", "cost_per_hour": 2.5},
        },
        "roles": {
            "prefill": {"node_group": "gpu-a", "replicas": 1, "max_replicas": 4},
            "relay_decode": {"node_group": "gpu-a", "replicas": 1, "max_replicas": 3},
            "main_decode": {"node_group": "gpu-b", "replicas": 2, "max_replicas": 4},
        },
        "links": [
            {"between": ["dc-a", "dc-a"], "bandwidth_mbps": 10000, "rtt_ms": 0.2},
            {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 40, "rtt_ms": 40},
        ],
        "slo": {"ttft_ms": 2000, "tpot_ms": 200, "max_gap_ms": 1000, "window_s": 6},
        "agents": {"mode": "act", "cooldown_s": 60, "verify_after_s": 30, "confirm_ticks": 1, **agents},
    }


def pdd_config(**agents: Any) -> PDDConfig:
    return PDDConfig.model_validate(pdd_args(**agents))


def pending(config: PDDConfig) -> list[dict]:
    """The proposals awaiting approval in the config's audit database (`pdd agents pending`)."""
    with Swarm.open(config, source=StaticSource(), actuator=DryRunActuator(config.live_knobs(), {}), router=RuleRouter()) as s:
        return s.pending()


@dataclass
class Levels:
    """What the cluster looks like in one scenario (per second rates, seconds, ratios)."""

    rps: dict[str, float] = field(default_factory=lambda: {"P-MD": 4.0, "P-RLD-MD": 1.0})
    ttft_s: dict[str, float] = field(default_factory=lambda: {"P-MD": 0.5, "P-RLD-MD": 0.5})
    tpot_s: dict[str, float] = field(default_factory=lambda: {"P-MD": 0.02, "P-RLD-MD": 0.02})
    gap_s: dict[str, float] = field(default_factory=lambda: {"P-MD": 0.2, "P-RLD-MD": 0.2})
    hit: dict[str, float] = field(default_factory=lambda: {"prefill": 0.9, "main_decode": 0.88})
    md_hit: list[tuple[float, float]] = field(default_factory=lambda: [(0.95, 1.0)])
    """(hit ratio, weight) of MD's per-request prefix hits."""
    kv: dict[str, tuple[float, float, float, float]] = field(default_factory=lambda: {WAN: (5.0, 0.06, 100_000.0, 0.0), LAN: (1.0, 0.01, 2_000_000.0, 0.0)})
    """link -> (pulls/s, seconds per pull, bytes per pull, failed share)."""
    gap_error: dict[str, float] = field(default_factory=lambda: {WAN: 0.02})
    """link -> each P-MD turn's gap less the gap routing predicted for it, seconds (one per P-MD request)."""
    leases_gone: dict[str, float] = field(default_factory=dict)
    """link -> share of pulls that found their lease expired (failures with reason LeaseGone)."""
    relay_tokens: float = 40.0
    singular_rps: float = 0.0
    violations: dict[str, float] = field(default_factory=dict)
    leases: tuple[float, float] = (5.0, 0.0)
    """(live leases at the start, change per second)."""
    replicas: dict[str, tuple[int, int]] = field(default_factory=lambda: {"Prefill": (1, 1), "RelayDecode": (1, 1), "MainDecode": (2, 2), "Conductor": (1, 1)})
    """deployment -> (target, healthy)."""
    ongoing: dict[str, float] = field(default_factory=lambda: {"Prefill": 30.0, "RelayDecode": 20.0, "MainDecode": 80.0, "Conductor": 5.0})
    health_failures_rps: dict[str, float] = field(default_factory=dict)


HEALTHY = Levels()
SCENARIOS: dict[str, Levels] = {
    # 0.875 busy: past rld_overload's 0.85, short of routing.max_relay_load (0.9), where with P-MD gaps to spare it is relay_saturated
    "rld_overload": replace(HEALTHY, ongoing={**HEALTHY.ongoing, "RelayDecode": 56.0}, relay_tokens=400.0),
    "md_hit_behind": replace(HEALTHY, hit={"prefill": 0.9, "main_decode": 0.6}, singular_rps=0.2),
    "wan_degradation": replace(HEALTHY, kv={**HEALTHY.kv, WAN: (5.0, 0.6, 100_000.0, 0.0)}, gap_s={"P-MD": 2.0, "P-RLD-MD": 0.2}),
    "bathtub_valley": replace(HEALTHY, md_hit=[(0.5, 0.5), (0.95, 0.5)], gap_s={"P-MD": 1.5, "P-RLD-MD": 0.2}),
    "ttft_slo_breach": replace(HEALTHY, ttft_s={"P-MD": 4.0, "P-RLD-MD": 4.0}, violations={"ttft": 4.5}),
    "tpot_slo_breach": replace(HEALTHY, tpot_s={"P-MD": 0.4, "P-RLD-MD": 0.02}, violations={"tpot": 3.5}),
    "kv_lease_leak": replace(HEALTHY, leases=(500.0, 2.0)),
    "wan_saturated": replace(HEALTHY, leases_gone={WAN: 0.1}),
    "replica_crash": replace(HEALTHY, replicas={**HEALTHY.replicas, "MainDecode": (2, 1)}, health_failures_rps={"MainDecode": 0.2}),
    "over_provisioned": replace(HEALTHY, ongoing={**HEALTHY.ongoing, "MainDecode": 10.0}),
    # a link as configured, P-MD's gaps 1.5 s against the 1 s target, the prediction 0.4 s short: the threshold is too high
    "gap_slo_breach": replace(HEALTHY, gap_s={"P-MD": 1.5, "P-RLD-MD": 0.2}, violations={"gap": 4.0}, gap_error={WAN: 0.4}),
    # RLD at routing.max_relay_load (60 of 64) while P-MD's gaps are a quarter of the target: the threshold is too low
    "relay_saturated": replace(HEALTHY, ongoing={**HEALTHY.ongoing, "RelayDecode": 60.0}),
    "prefill_relaying": replace(
        HEALTHY,
        rps={"P-MD": 4.0, "P-P-MD": 1.0},
        ttft_s={"P-MD": 0.5, "P-P-MD": 0.5},
        tpot_s={"P-MD": 0.02, "P-P-MD": 0.02},
        gap_s={"P-MD": 0.2, "P-P-MD": 0.2},
    ),
}
RELAY_OUTAGE_TTFT = replace(
    SCENARIOS["prefill_relaying"],
    ttft_s={"P-MD": 4.0, "P-P-MD": 4.0},
    violations={"ttft": 4.5},
    replicas={**HEALTHY.replicas, "RelayDecode": (1, 0)},
)
"""The relay decoder dead, prefill relaying, and TTFT over its target."""


def _hist_name(spec: MetricSpec) -> str:
    return prom_name(spec)


def _counter_name(spec: MetricSpec) -> str:
    # prometheus_client adds `_total` back on exposition
    return prom_name(spec).removesuffix("_total")


class ScriptedExporter:
    """Serves one scenario's metrics over HTTP (prometheus_client), advancing with time."""

    def __init__(self, levels: Levels, application: str = APP):
        self.levels = copy.deepcopy(levels)
        self.application = application
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()
        self._counts: dict[tuple, float] = {}
        self._sums: dict[tuple, float] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self.server.server_address[1]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_levels(self, levels: Levels) -> None:
        with self._lock:
            self._advance()
            self.levels = copy.deepcopy(levels)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _add(self, key: tuple, n: float, total: float = 0.0) -> None:
        self._counts[key] = self._counts.get(key, 0.0) + n
        self._sums[key] = self._sums.get(key, 0.0) + total

    def _advance(self) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        lv = self.levels
        for pipeline, rps in lv.rps.items():
            n = rps * dt
            self._add(("requests", pipeline), n)
            for name, values in (("ttft", lv.ttft_s), ("tpot", lv.tpot_s), ("gap", lv.gap_s)):
                self._add((name, pipeline, values[pipeline]), n, n * values[pipeline])
        total = sum(lv.rps.values()) * dt
        for role, ratio in lv.hit.items():
            self._add(("prompt", role), total * 1000)
            self._add(("cached", role), total * 1000 * ratio)
        for value, weight in lv.md_hit:
            self._add(("md_hit", value), total * weight, total * weight * value)
        for link, (pulls, seconds, nbytes, failed) in lv.kv.items():
            n = pulls * dt
            self._add(("kv", link, seconds), n, n * seconds)
            self._add(("kv_bytes", link), n * nbytes)
            self._add(("kv_fail", link), n * failed)
            self._add(("kv_gone", link), n * lv.leases_gone.get(link, 0.0))
        turns = lv.rps.get("P-MD", 0.0) * dt
        for link, err in lv.gap_error.items():  # exported as |error| by direction, as the conductor does
            self._add(("gap_error", link, "under" if err > 0 else "over", abs(err)), turns, turns * abs(err))
        relayed = lv.rps.get("P-RLD-MD", 0.0) * dt
        self._add(("relay", lv.relay_tokens), relayed, relayed * lv.relay_tokens)
        self._add(("singular",), lv.singular_rps * dt)
        for slo, rps in lv.violations.items():
            self._add(("violation", slo), rps * dt)
        for dep, rps in lv.health_failures_rps.items():
            self._add(("health_fail", dep), rps * dt)

    def _hist(self, spec: MetricSpec, kind: str, labels: dict[str, str], match: tuple) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(_hist_name(spec), spec.description, labels=list(labels))
        points = [(k[-1], c, self._sums[k]) for k, c in self._counts.items() if k[0] == kind and k[1:-1] == match]
        bounds = list(spec.buckets or ())
        buckets = [(str(b), sum(c for v, c, _ in points if v <= b)) for b in bounds]
        count = sum(c for _, c, _ in points)
        fam.add_metric(list(labels.values()), buckets + [("+Inf", count)], sum(s for _, _, s in points))
        return fam

    def collect(self):
        """Every series labelled with its Serve application, as Ray exports them."""
        for fam in self._families():
            fam.samples = [s._replace(labels={m.APPLICATION_LABEL: self.application, **s.labels}) for s in fam.samples]
            yield fam

    def _families(self):
        with self._lock:
            self._advance()
            lv = self.levels
            c = self._counts
            req = CounterMetricFamily(_counter_name(m.REQUESTS), m.REQUESTS.description, labels=list(m.REQUESTS.labels))
            for pipeline in lv.rps:
                req.add_metric(["pdd", pipeline, "ok"], c.get(("requests", pipeline), 0.0))
            yield req
            for spec, kind in ((m.TTFT, "ttft"), (m.TPOT, "tpot"), (m.MAX_GAP, "gap")):
                for pipeline in lv.rps:
                    yield self._hist(spec, kind, {"pipeline": pipeline}, (pipeline,))
            for spec, kind in ((m.PROMPT_TOKENS, "prompt"), (m.CACHED_TOKENS, "cached")):
                fam = CounterMetricFamily(_counter_name(spec), spec.description, labels=list(spec.labels))
                for role in lv.hit:
                    fam.add_metric([role], c.get((kind, role), 0.0))
                yield fam
            yield self._hist(m.PREFIX_HIT, "md_hit", {"role": "main_decode"}, ())
            for link in lv.kv:
                yield self._hist(m.KV_SECONDS, "kv", {"link": link}, (link,))
            fam = CounterMetricFamily(_counter_name(m.KV_BYTES), m.KV_BYTES.description, labels=list(m.KV_BYTES.labels))
            for link in lv.kv:
                fam.add_metric([link], c.get(("kv_bytes", link), 0.0))
            yield fam
            fam = CounterMetricFamily(_counter_name(m.KV_FAILURES), m.KV_FAILURES.description, labels=list(m.KV_FAILURES.labels))
            for link in lv.kv:
                fam.add_metric([link, "TimeoutError"], c.get(("kv_fail", link), 0.0))
                fam.add_metric([link, m.KV_LEASE_GONE], c.get(("kv_gone", link), 0.0))
            yield fam
            for link, err in lv.gap_error.items():
                direction = "under" if err > 0 else "over"
                yield self._hist(m.GAP_ERROR, "gap_error", {"link": link, "direction": direction}, (link, direction))
            yield self._hist(m.RELAY_TOKENS, "relay", {}, ())
            fam = CounterMetricFamily(_counter_name(m.SINGULAR), m.SINGULAR.description)
            fam.add_metric([], c.get(("singular",), 0.0))
            yield fam
            fam = CounterMetricFamily(_counter_name(m.SLO_VIOLATIONS), m.SLO_VIOLATIONS.description, labels=list(m.SLO_VIOLATIONS.labels))
            for slo in ("ttft", "tpot", "gap"):
                fam.add_metric(["P-MD", slo], c.get(("violation", slo), 0.0))
            yield fam
            base, slope = lv.leases
            fam = GaugeMetricFamily(prom_name(m.LEASES_LIVE), m.LEASES_LIVE.description, labels=list(m.LEASES_LIVE.labels))
            fam.add_metric(["prefill-0"], base + slope * (time.monotonic() - self._t0))
            yield fam
            healthy = GaugeMetricFamily(prom_name(SERVE_REPLICA_HEALTHY), SERVE_REPLICA_HEALTHY.description, labels=list(SERVE_REPLICA_HEALTHY.labels))
            target = GaugeMetricFamily(prom_name(SERVE_TARGET_REPLICAS), SERVE_TARGET_REPLICAS.description, labels=list(SERVE_TARGET_REPLICAS.labels))
            ongoing = GaugeMetricFamily(prom_name(SERVE_PROCESSING), SERVE_PROCESSING.description, labels=list(SERVE_PROCESSING.labels))
            fails = CounterMetricFamily(
                _counter_name(SERVE_HEALTH_CHECK_FAILURES), SERVE_HEALTH_CHECK_FAILURES.description, labels=list(SERVE_HEALTH_CHECK_FAILURES.labels)
            )
            for dep, (want, up) in lv.replicas.items():
                target.add_metric([self.application, dep], want)
                for i in range(want):
                    replica = f"{dep.lower()}-{i}"
                    healthy.add_metric([self.application, dep, replica], 1.0 if i < up else 0.0)
                    ongoing.add_metric([self.application, dep, replica], lv.ongoing.get(dep, 0.0) / want)
                    fails.add_metric([self.application, dep, replica], c.get(("health_fail", dep), 0.0) / want)
            yield from (healthy, target, ongoing, fails)


class LabelledPrometheus(PrometheusServer):
    """Static targets, each with its own `scenario` label (one Prometheus for every scenario)."""

    def __init__(self, targets: dict[str, str], **kw):
        super().__init__(static_targets=list(targets.values()), **kw)
        self.labelled = targets

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["scrape_configs"] = [
            {
                "job_name": "scenarios",
                "static_configs": [{"targets": [t], "labels": {"scenario": name}} for name, t in self.labelled.items()],
            }
        ]
        return cfg


def healthy_snapshot(at: float = 10_000.0, **fields: Any):
    """What the queries return for HEALTHY, as a typed Snapshot (unit tests, twin-style).
    An objective whose percentile `fields` put over pdd_config's target has requests over it
    (a fifth of the traffic), unless `fields` give slo_violation_rate_by_slo."""
    from app.telemetry.snapshot import Snapshot

    both = lambda v: {"P-MD": v, "P-RLD-MD": v}  # noqa: E731
    base: dict[str, Any] = dict(
        at=at,
        window_s=6,
        ttft_p_by_pipeline=both(0.475),
        ttft_p99_by_pipeline=both(0.4975),
        ttft_p=0.475,
        tpot_p_by_pipeline=both(0.0235),
        tpot_p=0.0235,
        gap_p99_by_pipeline=both(0.2485),
        gap_p=0.235,
        gap_p99=0.2485,
        request_rate_by_pipeline={"P-MD": 4.0, "P-RLD-MD": 1.0},
        prefix_hit_by_role={"prefill": 0.9, "main_decode": 0.88},
        md_hit_buckets={"0.2": 0.0, "0.8": 0.0, "0.9": 0.0, "0.95": 5.0, "1.0": 5.0, "+Inf": 5.0},
        kv_seconds_mean_by_link={WAN: 0.06, LAN: 0.01},
        kv_seconds_p90_by_link={WAN: 0.095, LAN: 0.0095},
        kv_bytes_per_transfer_by_link={WAN: 100_000.0, LAN: 2_000_000.0},
        kv_transfer_rate_by_link={WAN: 5.0, LAN: 1.0},
        kv_failure_rate_by_link={WAN: 0.0, LAN: 0.0},
        kv_lease_gone_rate_by_link={WAN: 0.0, LAN: 0.0},
        relay_tokens_p90=60.8,
        singular_rate=0.0,
        leases_live=5.0,
        leases_slope=0.0,
        slo_violation_rate_by_slo={"ttft": 0.0, "tpot": 0.0, "gap": 0.0},
        replicas_healthy_by_deployment={"Prefill": 1.0, "RelayDecode": 1.0, "MainDecode": 2.0, "Conductor": 1.0},
        replicas_target_by_deployment={"Prefill": 1.0, "RelayDecode": 1.0, "MainDecode": 2.0, "Conductor": 1.0},
        ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 20.0, "MainDecode": 80.0, "Conductor": 5.0},
        health_check_failures_by_deployment={"Prefill": 0.0, "RelayDecode": 0.0, "MainDecode": 0.0, "Conductor": 0.0},
    )
    base.update(fields)
    if "slo_violation_rate_by_slo" not in fields:
        slo = pdd_config().slo
        over = sum(base["request_rate_by_pipeline"].values()) / 5
        targets = {"ttft": (base["ttft_p"], slo.ttft_ms), "tpot": (base["tpot_p"], slo.tpot_ms), "gap": (base["gap_p"], slo.max_gap_ms)}
        base["slo_violation_rate_by_slo"] = {name: over if figure is not None and figure * 1000 > target else 0.0 for name, (figure, target) in targets.items()}
    return Snapshot(**base)


# ---- a tiny real Serve application for actuation tests (stand-ins for the engines) ----


def build_standin(args: dict[str, Any]):
    """Serve app: a `Conductor` that records every user_config it is given, and a `MainDecode` to scale."""
    from ray import serve

    from app.config import LiveKnobs, RoleName
    from app.engine.deployments import DEPLOYMENT_NAMES

    @serve.deployment(name=DEPLOYMENT_NAMES[RoleName.main_decode], ray_actor_options={"num_cpus": 0.01})
    class StandInEngine:
        async def __call__(self, request) -> str:
            return "ok"

    @serve.deployment(name="Conductor", ray_actor_options={"num_cpus": 0.01})
    class StandInConductor:
        def __init__(self, engine):
            self.engine = engine
            self.received: list[dict] = []

        def reconfigure(self, user_config: dict) -> None:
            LiveKnobs.model_validate(user_config)  # what the real ingress does with it
            self.received.append(user_config)

        def seen(self) -> list[dict]:
            return self.received

        async def __call__(self, request) -> list[dict]:
            return self.received

    return StandInConductor.options(user_config=LiveKnobs().model_dump(mode="json")).bind(StandInEngine.bind())

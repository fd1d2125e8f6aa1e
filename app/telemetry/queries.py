"""The named PromQL queries the agents read, built from app/telemetry/metrics.py's specs.

Every metric name comes from `prom_name()`: ours from app/telemetry/metrics.py, Ray
Serve's own from the specs below (their names as Serve 2.60 registers them in
ray/serve/_private/deployment_state.py and replica.py; Ray adds the `ray_`
prefix on export like it does for ours). Each query's name is the Snapshot
field it fills (app/telemetry/snapshot.py); `by` names the label a per-label query
groups on.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config import PDDConfig
from app.telemetry import metrics as m
from app.telemetry.metrics import MetricSpec, prom_name

# Ray Serve's own metrics, labelled application, deployment (and replica).
SERVE_REPLICA_HEALTHY = MetricSpec(
    "serve_deployment_replica_healthy", "gauge", "1 per healthy replica (per-replica series) or the healthy count.", ("application", "deployment", "replica")
)
SERVE_TARGET_REPLICAS = MetricSpec("serve_autoscaling_target_replicas", "gauge", "Replica count a deployment is scaled to.", ("application", "deployment"))
SERVE_PROCESSING = MetricSpec("serve_replica_processing_queries", "gauge", "Requests a replica is processing now.", ("application", "deployment", "replica"))
SERVE_HEALTH_CHECK_FAILURES = MetricSpec("serve_health_check_failures", "counter", "Failed replica health checks.", ("application", "deployment", "replica"))
SERVE_SPECS = (SERVE_REPLICA_HEALTHY, SERVE_TARGET_REPLICAS, SERVE_PROCESSING, SERVE_HEALTH_CHECK_FAILURES)


@dataclass(frozen=True)
class Query:
    name: str
    promql: str
    by: str | None = None
    """Label the result is keyed by; None for a single number."""


class QuerySet:
    """The queries for one cluster: evaluation window, SLO percentile, Serve app, extra matchers."""

    def __init__(self, *, window_s: float, percentile: float, app_name: str, matchers: dict[str, str] | None = None, lease_window_s: float = 60.0):
        self.window_s = max(1, round(window_s))
        self.window = f"{self.window_s}s"
        self.lease_window = f"{max(1, round(lease_window_s))}s"
        """kv.lease_timeout_s: the requests of the last lease lifetime explain the live leases."""
        self.q = percentile / 100
        self.app_name = app_name
        self.matchers = dict(matchers or {})

    @classmethod
    def for_config(cls, config: PDDConfig, app_name: str, window_s: float | None = None) -> QuerySet:
        """The queries for a cluster of `config` serving `app_name` (window: the SLO's, unless given)."""
        return cls(
            window_s=config.slo.window_s if window_s is None else window_s,
            percentile=config.slo.percentile,
            app_name=app_name,
            matchers=config.agents.prometheus_matchers,
            lease_window_s=config.kv.lease_timeout_s,
        )

    def select(self, spec: MetricSpec, suffix: str = "", **labels: str) -> str:
        """Ours and Serve's series both carry `application`: select this app's."""
        pairs = {**self.matchers, m.APPLICATION_LABEL: self.app_name, **labels}
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))
        return f"{prom_name(spec, suffix)}{{{inner}}}"

    def _rate(self, spec: MetricSpec, suffix: str = "", **labels: str) -> str:
        return f"rate({self.select(spec, suffix, **labels)}[{self.window}])"

    def _quantile(self, q: float, spec: MetricSpec, by: str | None = None) -> str:
        group = f"le,{by}" if by else "le"
        return f"histogram_quantile({q:g}, sum by ({group}) ({self._rate(spec, '_bucket')}))"

    def _mean(self, spec: MetricSpec, by: str) -> str:
        return f"sum by ({by}) ({self._rate(spec, '_sum')}) / sum by ({by}) ({self._rate(spec, '_count')})"

    def _signed_mean(self, spec: MetricSpec, by: str) -> str:
        """Mean of a histogram of |error| by `direction` (under: +, over: -); a direction with no
        series counts 0."""
        count = f"sum by ({by}) ({self._rate(spec, '_count')})"
        under, over = (f"(sum by ({by}) ({self._rate(spec, '_sum', direction=d)}) or {count} * 0)" for d in ("under", "over"))
        return f"({under} - {over}) / {count}"

    def all(self) -> list[Query]:
        q, r = self.q, self._rate
        return [
            Query("ttft_p_by_pipeline", self._quantile(q, m.TTFT, "pipeline"), "pipeline"),
            Query("ttft_p99_by_pipeline", self._quantile(0.99, m.TTFT, "pipeline"), "pipeline"),
            Query("ttft_p", self._quantile(q, m.TTFT)),
            Query("tpot_p_by_pipeline", self._quantile(q, m.TPOT, "pipeline"), "pipeline"),
            Query("tpot_p", self._quantile(q, m.TPOT)),
            Query("gap_p99_by_pipeline", self._quantile(0.99, m.MAX_GAP, "pipeline"), "pipeline"),
            Query("gap_p", self._quantile(q, m.MAX_GAP)),
            Query("gap_p99", self._quantile(0.99, m.MAX_GAP)),
            Query("request_rate_by_pipeline", f"sum by (pipeline) ({r(m.REQUESTS)})", "pipeline"),
            Query(
                "prefix_hit_by_role",
                f"sum by (role) ({r(m.CACHED_TOKENS)}) / sum by (role) ({r(m.PROMPT_TOKENS)})",
                "role",
            ),
            Query("md_hit_buckets", f"sum by (le) ({r(m.PREFIX_HIT, '_bucket', role='main_decode')})", "le"),
            Query("kv_seconds_mean_by_link", self._mean(m.KV_SECONDS, "link"), "link"),
            Query("kv_seconds_p90_by_link", self._quantile(0.9, m.KV_SECONDS, "link"), "link"),
            Query("kv_slowdown_mean_by_link", self._mean(m.KV_SLOWDOWN, "link"), "link"),
            Query("gap_error_mean_by_link", self._signed_mean(m.GAP_ERROR, "link"), "link"),
            Query(
                "kv_bytes_per_transfer_by_link",
                f"sum by (link) ({r(m.KV_BYTES)}) / sum by (link) ({r(m.KV_SECONDS, '_count')})",
                "link",
            ),
            Query("kv_transfer_rate_by_link", f"sum by (link) ({r(m.KV_SECONDS, '_count')})", "link"),
            Query("kv_failure_rate_by_link", f"sum by (link) ({r(m.KV_FAILURES)})", "link"),
            Query("kv_lease_gone_rate_by_link", f"sum by (link) ({r(m.KV_FAILURES, reason=m.KV_LEASE_GONE)})", "link"),
            Query("relay_tokens_p90", self._quantile(0.9, m.RELAY_TOKENS)),
            Query("singular_rate", f"sum({r(m.SINGULAR)})"),
            Query("leases_live", f"sum({self.select(m.LEASES_LIVE)})"),
            # increase(), not rate x time: a rate over the window under-reads a series younger than the window
            Query("requests_in_lease_window", f"sum(increase({self.select(m.REQUESTS)}[{self.lease_window}]))"),
            Query("requests_in_flight", f"sum({self.select(m.IN_FLIGHT)})"),
            Query("leases_slope", f"sum(deriv({self.select(m.LEASES_LIVE)}[{self.window}]))"),
            Query("slo_violation_rate_by_slo", f"sum by (slo) ({r(m.SLO_VIOLATIONS)})", "slo"),
            Query("replicas_healthy_by_deployment", f"sum by (deployment) ({self.select(SERVE_REPLICA_HEALTHY)})", "deployment"),
            Query("replicas_target_by_deployment", f"max by (deployment) ({self.select(SERVE_TARGET_REPLICAS)})", "deployment"),
            Query("ongoing_by_deployment", f"sum by (deployment) ({self.select(SERVE_PROCESSING)})", "deployment"),
            Query(
                "health_check_failures_by_deployment",
                f"sum by (deployment) (increase({self.select(SERVE_HEALTH_CHECK_FAILURES)}[{self.window}]))",
                "deployment",
            ),
        ]

"""Observe: run the named queries against a real Prometheus into a typed Snapshot.

A Snapshot is plain data (numbers and label -> number maps), so the digital
twin can build one directly and the checkpointer stores it as JSON. Every
field named like a query in app/telemetry/queries.py is filled by that query; a query
with no data (no traffic yet, NaN from an empty histogram) leaves it unset.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from pydantic import BaseModel

from app.telemetry.queries import QuerySet


class Snapshot(BaseModel):
    """What the cluster looks like at one instant, over the evaluation window."""

    at: float
    """Unix time the figures refer to."""
    window_s: float
    promql: dict[str, str] = {}
    """Query name -> the PromQL that produced it (the evidence trail)."""

    ttft_p_by_pipeline: dict[str, float] = {}
    """TTFT at the SLO percentile, seconds."""
    ttft_p99_by_pipeline: dict[str, float] = {}
    ttft_p: float | None = None
    tpot_p_by_pipeline: dict[str, float] = {}
    """TPOT at the SLO percentile, seconds."""
    tpot_p: float | None = None
    gap_p99_by_pipeline: dict[str, float] = {}
    """Worst inter-token gap per request, p99, seconds."""
    gap_p: float | None = None
    gap_p99: float | None = None
    request_rate_by_pipeline: dict[str, float] = {}
    """Finished requests per second."""
    prefix_hit_by_role: dict[str, float] = {}
    """Cached prompt tokens / prompt tokens, per role (prefill vs main_decode)."""
    md_hit_buckets: dict[str, float] = {}
    """MD per-request prefix hit histogram: `le` -> observations per second (cumulative)."""
    kv_seconds_mean_by_link: dict[str, float] = {}
    kv_seconds_p90_by_link: dict[str, float] = {}
    kv_slowdown_mean_by_link: dict[str, float] = {}
    """Mean of each WAN pull's time / what the configured link needs for it beside the pulls sharing it."""
    gap_error_mean_by_link: dict[str, float] = {}
    """Mean of each P-MD turn's gap (P's first token to MD's) less the gap routing predicted for it,
    seconds (from the histogram's two directions): above 0 the prediction misses part of the stall."""
    kv_bytes_per_transfer_by_link: dict[str, float] = {}
    kv_transfer_rate_by_link: dict[str, float] = {}
    kv_failure_rate_by_link: dict[str, float] = {}
    """Failed pulls per second, whatever the reason (lease gone included)."""
    kv_lease_gone_rate_by_link: dict[str, float] = {}
    """Pulls per second that found their lease gone (transport.LeaseGone)."""
    relay_tokens_p90: float | None = None
    singular_rate: float | None = None
    leases_live: float | None = None
    leases_slope: float | None = None
    """Change of live leases per second (deriv over the window)."""
    requests_in_lease_window: float | None = None
    """Requests finished within the last kv.lease_timeout_s."""
    requests_in_flight: float | None = None
    slo_violation_rate_by_slo: dict[str, float] = {}
    replicas_healthy_by_deployment: dict[str, float] = {}
    replicas_target_by_deployment: dict[str, float] = {}
    ongoing_by_deployment: dict[str, float] = {}
    """Requests each deployment's replicas are processing now (Serve's own gauge)."""
    health_check_failures_by_deployment: dict[str, float] = {}

    @property
    def request_rate(self) -> float:
        return sum(self.request_rate_by_pipeline.values())

    def query(self, name: str) -> str:
        return self.promql.get(name, name)


class ObserveError(RuntimeError):
    """Prometheus could not be queried; the tick records it and changes nothing."""


class Source(Protocol):
    def snapshot(self, now: float) -> Snapshot: ...


class StaticSource:
    """A snapshot someone else made (the digital twin, tests)."""

    def __init__(self, snapshot: Snapshot | None = None):
        self.current = snapshot

    def snapshot(self, now: float) -> Snapshot:
        if self.current is None:
            raise ObserveError("no snapshot given")
        return self.current


def _number(sample: dict) -> float | None:
    value = float(sample["value"][1])
    return value if math.isfinite(value) else None


class PromSource:
    """The real Prometheus, through prometheus-api-client."""

    def __init__(self, url: str, queries: QuerySet, timeout_s: float = 10.0):
        self.url = url
        self.queries = queries
        self.timeout_s = timeout_s
        self.client = PrometheusConnect(url=url, disable_ssl=True)

    def snapshot(self, now: float) -> Snapshot:
        values: dict[str, Any] = {}
        promql: dict[str, str] = {}
        for q in self.queries.all():
            promql[q.name] = q.promql
            try:
                result = self.client.custom_query(q.promql, params={"time": now}, timeout=self.timeout_s)
            except (PrometheusApiClientException, OSError) as err:
                raise ObserveError(f"Prometheus at {self.url} ({q.name}): {str(err)[:200]}") from err
            if q.by is None:
                numbers = [v for v in map(_number, result) if v is not None]
                if numbers:
                    values[q.name] = numbers[0]
            else:
                keyed = {}
                for sample in result:
                    key = sample["metric"].get(q.by)
                    value = _number(sample)
                    if key is not None and value is not None:
                        keyed[key] = value
                values[q.name] = keyed
        return Snapshot(at=now, window_s=self.queries.window_s, promql=promql, **values)

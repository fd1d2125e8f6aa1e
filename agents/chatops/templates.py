"""Named PromQL queries for the questions operators ask most.

Most are the swarm's own queries (app/telemetry/queries.py), so chat-ops and the
agents quote the same figures for the same question; a few more cover what
only people ask about (violations by pipeline, failures by reason, handoffs).
Every metric name comes from app/telemetry/metrics.py through `prom_name()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.telemetry import metrics as m
from app.telemetry.queries import QuerySet


@dataclass(frozen=True)
class Template:
    name: str
    description: str
    promql: str


#: The swarm's queries chat-ops offers, with what each answers (units included).
FROM_SWARM: dict[str, str] = {
    "ttft_p99_by_pipeline": "p99 time to first token, seconds, by pipeline (P-MD, P-RLD-MD, ...)",
    "ttft_p_by_pipeline": "time to first token at the SLO percentile, seconds, by pipeline",
    "tpot_p_by_pipeline": "time per output token at the SLO percentile, seconds, by pipeline",
    "gap_p99_by_pipeline": "p99 of each request's worst inter-token gap, seconds, by pipeline",
    "request_rate_by_pipeline": "finished requests per second, by pipeline",
    "prefix_hit_by_role": "prefix-cache hit ratio (cached / prompt tokens), P (prefill) vs MD (main_decode)",
    "kv_seconds_mean_by_link": "mean seconds per KV pull, by link (`dc-a->dc-b` is the WAN)",
    "kv_seconds_p90_by_link": "p90 seconds per KV pull, by link",
    "kv_slowdown_mean_by_link": "WAN pulls' seconds over what the configured link needs for them beside the pulls sharing it, by link (1: healthy, however busy)",
    "gap_error_mean_by_link": "mean of each P-MD turn's gap less the gap routing predicted for it, seconds, by link (above 0: routing under-predicts the stall)",
    "kv_bytes_per_transfer_by_link": "mean bytes per KV pull, by link",
    "kv_transfer_rate_by_link": "KV pulls per second, by link",
    "kv_failure_rate_by_link": "failed KV pulls per second, by link",
    "relay_tokens_p90": "p90 tokens the relay decoder (RLD) produced per relayed request",
    "singular_rate": "requests per second the singular-traffic filter finished on RLD",
    "leases_live": "prompt KV leases prefill holds for decoders to pull",
    "slo_violation_rate_by_slo": "SLO violations per second, by objective (ttft, tpot, gap)",
    "replicas_healthy_by_deployment": "healthy replicas, by Serve deployment (Prefill, RelayDecode, MainDecode, Conductor)",
    "replicas_target_by_deployment": "replica count each Serve deployment is scaled to",
    "ongoing_by_deployment": "requests each deployment is processing now",
    "health_check_failures_by_deployment": "failed replica health checks over the window, by deployment",
}


def templates(queries: QuerySet) -> dict[str, Template]:
    """Every named query for one cluster (its window, percentile, app and matchers)."""
    swarm = {q.name: q.promql for q in queries.all()}
    out = {name: Template(name, description, swarm[name]) for name, description in FROM_SWARM.items()}
    w, sel = queries.window, queries.select
    extra = [
        Template(
            "slo_violations_by_pipeline",
            f"requests over an SLO target in the last {w}, by pipeline and objective",
            f"sum by (pipeline, slo) (increase({sel(m.SLO_VIOLATIONS)}[{w}]))",
        ),
        Template(
            "kv_failures_by_link_reason",
            f"failed KV pulls in the last {w}, by link and reason",
            f"sum by (link, reason) (increase({sel(m.KV_FAILURES)}[{w}]))",
        ),
        Template(
            "kv_seconds_p99_by_link",
            "p99 seconds per KV pull, by link (WAN transfer time tail)",
            f"histogram_quantile(0.99, sum by (le, link) (rate({sel(m.KV_SECONDS, '_bucket')}[{w}])))",
        ),
        Template(
            "handoff_p99_by_mode",
            "p99 RLD -> MD handoff latency, seconds, by handoff mode",
            f"histogram_quantile(0.99, sum by (le, mode) (rate({sel(m.HANDOFF, '_bucket')}[{w}])))",
        ),
        Template(
            "requests_by_outcome",
            f"requests finished in the last {w}, by pipeline and outcome (ok, error, cancelled)",
            f"sum by (pipeline, outcome) (increase({sel(m.REQUESTS)}[{w}]))",
        ),
    ]
    out.update({t.name: t for t in extra})
    return out


def catalogue(named: dict[str, Template]) -> str:
    """One line per template, for the model's instructions and the tool's description."""
    return "\n".join(f"- {t.name}: {t.description}" for t in named.values())

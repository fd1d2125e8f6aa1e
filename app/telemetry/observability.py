"""Prometheus rules and the Grafana dashboard, derived from the config's SLOs.

Every expression comes from app/telemetry/queries.py's QuerySet, the queries the
agents themselves read, so a dashboard, an alert and an agent never disagree on
what "TTFT p90" means. Recording rules are named `pdd:<query name>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from app.config import PDDConfig
from app.telemetry.queries import QuerySet

APP_NAME = "pdd"


def query_set(config: PDDConfig, app_name: str = APP_NAME) -> QuerySet:
    return QuerySet.for_config(config, app_name, window_s=min(config.slo.window_s, 300))


def rules(config: PDDConfig, app_name: str = APP_NAME) -> dict[str, Any]:
    qs = query_set(config, app_name)
    pct = f"p{config.slo.percentile:g}"
    slo = config.slo
    hold = "5m"
    leak_after = f"{max(120, int(2 * config.kv.lease_timeout_s))}s"
    alerts = [
        _alert("PDDTTFTSLOBreach", f"pdd:ttft_p > {slo.ttft_ms / 1000:g}", hold, "warning", f"TTFT {pct} above {slo.ttft_ms:g} ms", "ttft_slo_breach"),
        _alert("PDDTPOTSLOBreach", f"pdd:tpot_p > {slo.tpot_ms / 1000:g}", hold, "warning", f"TPOT {pct} above {slo.tpot_ms:g} ms", "tpot_slo_breach"),
        _alert(
            "PDDGapSLOBreach",
            f"pdd:gap_p > {slo.max_gap_ms / 1000:g}",
            hold,
            "warning",
            f"worst inter-token gap {pct} above {slo.max_gap_ms:g} ms",
            "gap_slo_breach",
        ),
        _alert(
            "PDDKVTransferFailures",
            "sum(pdd:kv_failure_rate_by_link) - (sum(pdd:kv_lease_gone_rate_by_link) or vector(0)) > 0",
            hold,
            "warning",
            "KV pulls failing on the link (decoders recompute)",
            "wan_degradation",
        ),
        _alert(
            "PDDKVLeasesExpiredInQueue",
            "sum(pdd:kv_lease_gone_rate_by_link) > 0",
            hold,
            "warning",
            "KV pulls waited past their lease (a full link; decoders recompute)",
            "wan_saturated",
        ),
        _alert(
            "PDDKVLeaseLeak",
            "pdd:leases_live > 0 and on() (sum(pdd:request_rate_by_pipeline) or vector(0)) == 0",
            leak_after,
            "critical",
            "prefill holds KV leases with no traffic",
            "kv_lease_leak",
        ),
        _alert(
            "PDDMDHitBehindP",
            'pdd:prefix_hit_by_role{role="main_decode"} < ignoring(role) 0.9 * pdd:prefix_hit_by_role{role="prefill"}',
            "10m",
            "warning",
            "main decoders' prefix hit falls behind prefill's",
            "md_hit_behind",
        ),
        _alert(
            "PDDReplicaUnhealthy",
            "pdd:replicas_healthy_by_deployment < pdd:replicas_target_by_deployment",
            "2m",
            "critical",
            "a deployment has fewer healthy replicas than its target",
            "replica_crash",
        ),
    ]
    return {
        "groups": [
            {"name": "pdd-recording", "interval": "15s", "rules": [{"record": f"pdd:{q.name}", "expr": q.promql} for q in qs.all()]},
            {"name": "pdd-slo-alerts", "rules": alerts},
        ]
    }


def _alert(name: str, expr: str, hold: str, severity: str, summary: str, runbook: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": hold,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "runbook": f"runbooks/{runbook}.md"},
    }


def write_rules(config: PDDConfig, path: Path, app_name: str = APP_NAME) -> Path:
    path.write_text(yaml.safe_dump(rules(config, app_name), sort_keys=False))
    return path


#: Dashboard rows: (title, [(panel title, query name, unit)]).
DASHBOARD_ROWS: list[tuple[str, list[tuple[str, str, str]]]] = [
    (
        "Pipelines",
        [
            ("Requests/s by pipeline", "request_rate_by_pipeline", "reqps"),
            ("TTFT (SLO percentile) by pipeline", "ttft_p_by_pipeline", "s"),
            ("TTFT p99 by pipeline", "ttft_p99_by_pipeline", "s"),
            ("TPOT by pipeline", "tpot_p_by_pipeline", "s"),
        ],
    ),
    (
        "Handoffs and relay",
        [
            ("Worst inter-token gap p99 by pipeline", "gap_p99_by_pipeline", "s"),
            ("RLD tokens per relayed request p90", "relay_tokens_p90", "none"),
            ("Singular requests/s", "singular_rate", "reqps"),
        ],
    ),
    (
        "WAN and KV",
        [
            ("KV transfer seconds p90 by link", "kv_seconds_p90_by_link", "s"),
            ("WAN slowdown vs the configured link, shared (1: healthy)", "kv_slowdown_mean_by_link", "none"),
            ("KV bytes per transfer by link", "kv_bytes_per_transfer_by_link", "bytes"),
            ("KV pulls/s by link", "kv_transfer_rate_by_link", "ops"),
            ("KV pull failures/s by link", "kv_failure_rate_by_link", "ops"),
            ("KV leases held by prefill", "leases_live", "none"),
        ],
    ),
    (
        "Caches",
        [
            ("Prefix hit by role (MD vs P)", "prefix_hit_by_role", "percentunit"),
        ],
    ),
    (
        "SLOs and replicas",
        [
            ("SLO violations/s by objective", "slo_violation_rate_by_slo", "reqps"),
            ("Healthy replicas by deployment", "replicas_healthy_by_deployment", "none"),
            ("Requests being processed by deployment", "ongoing_by_deployment", "none"),
        ],
    ),
]


def dashboard_queries(config: PDDConfig, app_name: str = APP_NAME) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard panel."""
    return [(p["title"], t["expr"]) for p in dashboard(config, app_name)["panels"] for t in p.get("targets", [])]


def dashboard(config: PDDConfig, app_name: str = APP_NAME) -> dict[str, Any]:
    """An importable Grafana dashboard (datasource picked at import: ${DS_PROMETHEUS})."""
    by_name = {q.name: q for q in query_set(config, app_name).all()}
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row_title, row in DASHBOARD_ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "collapsed": False})
        pid += 1
        y += 1
        for i, (title, name, unit) in enumerate(row):
            q = by_name[name]
            legend = f"{{{{{q.by}}}}}" if q.by else title
            panels.append(
                {
                    "type": "timeseries",
                    "title": title,
                    "id": pid,
                    "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                    "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 8, "w": 8, "h": 8},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    # `or vector(0)`: 0 rather than "no data" for events that have not happened yet
                    "targets": [{"refId": "A", "expr": f"({q.promql}) or vector(0)", "legendFormat": legend}],
                }
            )
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "pdd-serve",
        "uid": "pdd-serve",
        "tags": ["pdd", "vllm", "ray-serve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "panels": panels,
    }


def write_dashboard(config: PDDConfig, path: Path, app_name: str = APP_NAME) -> Path:
    path.write_text(json.dumps(dashboard(config, app_name), indent=2) + "\n")
    return path

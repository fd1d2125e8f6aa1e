"""A journey's engine timings (what each engine replica, and vLLM's engine core inside it, spent on the
first token), and the recent SLO figures the conductor keeps from journeys."""

from __future__ import annotations

import time

import pytest
from rich.console import Console
from vllm.v1.metrics.stats import RequestStateStats

from app.conductor.journal import Journal, Journey, slo_summary
from app.config import LiveKnobs, SLOConfig
from app.engine.replica import _engine_core_times
from app.engine.token_channel import EngineDelta
from app.ops.status import render


def _first(engine: float, core: float | None = None, queued: float | None = None) -> EngineDelta:
    return EngineDelta("r", [7], engine_ttft_ms=engine, engine_core_ttft_ms=core, engine_queued_ms=queued)


def test_engine_core_times_come_from_vllms_request_metrics():
    stats = RequestStateStats(queued_ts=100.0, scheduled_ts=100.004, first_token_ts=100.030)
    core, queued = _engine_core_times(stats)
    assert core == pytest.approx(30.0) and queued == pytest.approx(4.0)
    for missing in (None, RequestStateStats(), RequestStateStats(queued_ts=100.0, scheduled_ts=100.004)):
        assert _engine_core_times(missing) == (None, None)


def test_the_first_engine_of_a_role_keeps_its_times_unless_it_was_retried():
    journey = Journey("r", "pdd", 10, 5)
    journey.note_first_token("relay_decode", _first(40.0, 31.0, 2.0), replace=False)
    journey.note_first_token("relay_decode", _first(90.0, 80.0, 5.0), replace=False)  # a failover target's later token
    assert (journey.engine_ttft_ms, journey.engine_core_ttft_ms, journey.engine_queued_ms) == (
        {"relay_decode": 40.0},
        {"relay_decode": 31.0},
        {"relay_decode": 2.0},
    )
    journey.note_first_token("prefill", _first(20.0, 12.0, 1.0), replace=True)
    journey.note_first_token("prefill", _first(25.0), replace=True)  # P retried; its engine kept no metrics
    assert journey.engine_ttft_ms["prefill"] == 25.0
    assert "prefill" not in journey.engine_core_ttft_ms and "prefill" not in journey.engine_queued_ms
    assert journey.to_dict()["engine_core_ttft_ms"] == {"relay_decode": 31.0}


def test_one_keys_recent_journeys_are_its_newest_n_not_its_share_of_everyones():
    journal = Journal(capacity=10)
    for i in range(6):
        journal.add(Journey(f"r{i}", "pdd", 3, 4, key_fingerprint="mine" if i in (0, 2, 3) else "theirs"))
    assert [j.request_id for j in journal.recent(2, "mine")] == ["r2", "r3"]
    assert [j.request_id for j in journal.recent(2)] == ["r4", "r5"]
    assert journal.recent(5, "nobody") == []


def test_recent_slo_figures_are_kept_at_the_slos_own_percentile_and_pdd_status_judges_those():
    journeys = []
    for i in range(100):
        j = Journey(f"r{i}", "pdd", 10, 5, started_at=0.0)
        j.pipeline, j.ttft_ms, j.decode_ms, j.max_gap_ms, j.completion_tokens, j.finished_at = "P-MD", float(i + 1), 40.0, 50.0, 5, 10.0
        journeys.append(j)
    slo = SLOConfig(percentile=95, ttft_ms=95.5)
    fig = slo_summary(journeys, slo, window_s=60, now=20.0)["by_pipeline"]["P-MD"]
    assert (fig["ttft_ms"]["p95"], fig["ttft_ms"]["p90"], fig["tpot_ms"]["p95"]) == (96.0, 91.0, 10.0)
    state = {
        "model": "m",
        "mode": "pdd",
        "in_flight": 0,
        "roles": {},
        "links": {},
        "knobs": LiveKnobs().model_dump(mode="json"),
        "slo": {"targets": slo.model_dump(mode="json"), "recent": {"by_pipeline": {"P-MD": fig}}},
    }
    console = Console(width=200, record=True)
    console.print(render(state, None))
    row = next(line for line in console.export_text().splitlines() if "P-MD" in line)
    assert row.split("│")[3].strip() == "96"  # the p95 column shows p95 (over the 95.5 ms target), not p90's 91


def test_pdd_status_shows_the_conductors_figures_while_prometheus_has_no_rate_yet():
    from app.ops.status import figures_to_show
    from app.telemetry.snapshot import Snapshot

    recent = {"window_s": 300, "by_pipeline": {"P-MD": {"requests": 3}}}
    state = {"slo": {"recent": recent}}
    first_scrape = Snapshot(at=0.0, window_s=300, request_rate_by_pipeline={"P-MD": 0.0})
    snapshot, note = figures_to_show(state, first_scrape)
    assert snapshot is None and "conductor's last 300 s" in note
    running = Snapshot(at=0.0, window_s=300, request_rate_by_pipeline={"P-MD": 0.02})
    assert figures_to_show(state, running) == (running, "")
    idle = {"slo": {"recent": {"window_s": 300, "by_pipeline": {}}}}
    assert figures_to_show(idle, first_scrape) == (first_scrape, "")


def test_pdd_status_tells_md_warm_ups_from_requests_and_what_routing_knows():
    role = {
        "datacenter": "dc-b",
        "accelerator": "cpu",
        "configured_replicas": 2,
        "replicas": [
            {"in_flight": 3, "warming": 2, "known_blocks": 1200, "kv_blocks": 4000},
            {"in_flight": 1, "warming": 0, "known_blocks": 34, "kv_blocks": 4000},
        ],
    }
    idle = {**role, "datacenter": "dc-a", "configured_replicas": 1, "replicas": [{"in_flight": 0, "warming": 0, "known_blocks": 0, "kv_blocks": 900}]}
    state = {
        "model": "m",
        "mode": "pdd",
        "in_flight": 2,
        "roles": {"main_decode": role, "prefill": idle},
        "links": {},
        "knobs": LiveKnobs().model_dump(mode="json"),
        "slo": {"targets": SLOConfig().model_dump(mode="json"), "recent": {"by_pipeline": {}}},
        "prefix_index_saved_at": time.time() - 3,
    }
    console = Console(width=200, record=True)
    console.print(render(state, None))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[5:7]] for line in text.splitlines() if line.count("│") > 6}
    assert rows["main_decode"] == ["4 (2 warm-ups)", "1,234 of 8,000"] and rows["prefill"] == ["0", "0 of 900"]
    assert "prefix index saved 3 s ago" in text


def test_pdd_status_reads_at_80_columns():
    """No table cell wraps to more than two rows: a row's continuation lines have an empty first cell."""
    fig = {
        "requests": 12,
        "ttft_ms": {"p50": 120.0, "p90": 2500.0, "p99": 4000.0},
        "tpot_ms": {"p50": 10.0, "p90": 12.0, "p99": 30.0},
        "max_gap_ms": {"p50": 100.0, "p90": 200.0, "p99": 13000.0},
    }
    replica = {"in_flight": 12, "warming": 10, "known_blocks": 123456, "kv_blocks": 400000, "model_runner": "v1 (GPUModelRunner)"}
    role = {"datacenter": "dc-b-frankfurt", "accelerator": "H200", "configured_replicas": 16, "replicas": [replica] * 16}
    state = {
        "model": "deepseek-v4-pro",
        "mode": "pdd",
        "in_flight": 200,
        "roles": {"prefill": {**role, "datacenter": "dc-a-virginia", "accelerator": "H100"}, "relay_decode": role, "main_decode": role},
        "links": {"dc-a-virginia->dc-b-frankfurt": {"bandwidth_mbps": 40000, "rtt_ms": 80, "bytes_down": 123456789012, "is_cut": False}},
        "knobs": LiveKnobs().model_dump(mode="json"),
        "slo": {"targets": SLOConfig().model_dump(mode="json"), "recent": {"by_pipeline": {"P-RLD-MD": fig, "P-MD": fig, "P-P-MD": fig}}},
    }
    console = Console(width=80, record=True)
    console.print(render(state, None, "Prometheus shows no request rate yet (it counts from a series' second scrape)"))
    lines = console.export_text().splitlines()
    body = [line for line in lines if line.startswith("│")]
    continued = [line.split("│")[1].strip() == "" for line in body]
    assert not any(a and b for a, b in zip(continued, continued[1:])), "\n".join(lines)
    assert "…" not in "\n".join(body), "a cell was cut"
    assert sum(continued) < len(body)  # the check sees real rows

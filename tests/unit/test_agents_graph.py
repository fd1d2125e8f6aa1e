"""The tick graph end to end without a cluster: twin ticks, modes, approval, audit, LLM routing (fakes)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage
from typer.testing import CliRunner

from agents.actuate import DryRunActuator
from agents.cli import agents_cli
from agents.entries import FileEntries, read_entry
from agents.knobs import Change
from agents.memory import Memory
from agents.proposal import Proposal
from agents.router import LLMRouter, RuleRouter, tool_name
from agents.runner import Swarm
from agents.situations import Evidence
from agents.twin import TwinAgent, run_tick
from app.config import AgentMode
from app.telemetry.snapshot import StaticSource
from tests.integration.agents_fixtures import WAN, healthy_snapshot, pdd_args, pdd_config

T0 = 10_000.0
REPLICAS = {"prefill": 1, "relay_decode": 1, "main_decode": 2}
TTFT_BREACH = dict(ttft_p=4.75, ttft_p_by_pipeline={"P-MD": 4.75, "P-RLD-MD": 4.75})
RLD_OVERLOAD = dict(ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 56.0, "MainDecode": 80.0})


class FakeToolChatModel(FakeMessagesListChatModel):
    """A fake chat model that 'binds' tools by ignoring them and replays scripted replies."""

    def bind_tools(self, tools, **kwargs):
        return self


class FailingChatModel(FakeToolChatModel):
    def _generate(self, *args, **kwargs):
        raise ConnectionError("endpoint down")


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def swarm(tmp_path: Path, mode: str, source: StaticSource, actuator: DryRunActuator, clock: Clock, router=None, **agents):
    config = pdd_config(mode=mode, audit_db=str(tmp_path / "audit.sqlite"), actions_dir=str(tmp_path / "actions"), **agents)
    return Swarm.open(config, source=source, actuator=actuator, router=router or RuleRouter(), clock=clock)


def entries(tmp_path: Path) -> list[tuple[dict, str]]:
    return [read_entry(p) for p in sorted((tmp_path / "actions").glob("*.md"))]


def test_twin_tick_acts_verifies_and_rolls_back_a_regression():
    agent = TwinAgent(pdd_config())
    first = agent.tick(healthy_snapshot(T0, **TTFT_BREACH))
    assert [c.describe() for c in first.changes] == ["replicas.prefill: 1 -> 2"]
    assert first.replicas["prefill"] == 2
    waiting = agent.tick(healthy_snapshot(T0 + 10, **TTFT_BREACH))
    assert waiting.changes == [] and any("awaiting verification" in d.reason for d in waiting.decisions)
    worse = agent.tick(healthy_snapshot(T0 + 31, ttft_p=9.0, ttft_p_by_pipeline={"P-MD": 9.0, "P-RLD-MD": 9.0}))
    assert [c.describe() for c in worse.rollbacks] == ["replicas.prefill: 2 -> 1"]
    assert worse.replicas["prefill"] == 1
    assert worse.memory.blocked["replicas.prefill"].direction == 1
    again = agent.tick(healthy_snapshot(T0 + 200, **TTFT_BREACH))
    assert again.changes == [] and any(d.status == "rejected" and "rolled back" in d.reason for d in again.decisions)


def test_twin_tick_keeps_an_improvement():
    first = run_tick(pdd_config(), healthy_snapshot(T0, **TTFT_BREACH), knobs=pdd_config().live_knobs(), replicas=REPLICAS)
    better = run_tick(pdd_config(), healthy_snapshot(T0 + 31), knobs=first.knobs, replicas=first.replicas, memory=first.memory)
    assert [v.outcome for v in better.verdicts] == ["kept"]
    assert better.replicas["prefill"] == 2 and not better.memory.units


def test_main_decoders_are_not_added_without_end_for_a_hit_gap_they_do_not_close():
    agent = TwinAgent(pdd_config())

    def gap(at: float, md_hit: float):
        return agent.tick(healthy_snapshot(at, prefix_hit_by_role={"prefill": 0.9, "main_decode": md_hit}))

    assert [c.describe() for c in gap(T0, 0.6).changes] == ["replicas.main_decode: 2 -> 3"]
    assert [v.outcome for v in gap(T0 + 31, 0.6).verdicts] == ["kept"]
    for at in (T0 + 100, T0 + 400, T0 + 1000):  # past the cooldown, the gap as wide as before
        held = gap(at, 0.6)
        assert held.changes == [] and held.replicas["main_decode"] == 3
        assert any(d.status == "held" and "has not eased it" in d.reason for d in held.decisions)
    narrower = gap(T0 + 1100, 0.72)  # the third replica helped: a fourth may too
    assert [c.describe() for c in narrower.changes] == ["replicas.main_decode: 3 -> 4"]
    kept = gap(T0 + 1131, 0.72)
    assert [v.outcome for v in kept.verdicts] == ["kept"] and "md_hit_behind|replicas.main_decode" in kept.memory.growth
    assert gap(T0 + 1200, 0.89).memory.growth == {}  # closed: the next gap starts afresh


def test_observe_mode_files_once_and_changes_nothing(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    source = StaticSource(healthy_snapshot(T0, **TTFT_BREACH))
    with swarm(tmp_path, "observe", source, actuator, clock) as s:
        state = s.tick()
        clock.t = source.current.at = T0 + 10
        state2 = s.tick()
        history = s.history()
    assert actuator.calls == []
    assert [d["status"] for d in state["decisions"]] == ["accepted"]
    assert [d["status"] for d in state2["decisions"]] == ["held"]
    [(front, body)] = entries(tmp_path)
    assert front["outcome"].startswith("proposed (observe mode")
    assert front["situation"] == "ttft_slo_breach" and front["action"] == {"target": "replicas.prefill", "from": 1, "to": 2}
    assert front["rollback"] == {"target": "replicas.prefill", "to": 1}
    assert any(e["query"] == "ttft_p" and e["value"] == 4.75 for e in front["evidence"])
    assert "../ttft_slo_breach.md" in body
    assert [h["status"] for h in history] == ["done", "done"]


def test_observe_mode_keeps_one_entry_while_its_situation_lasts(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    source = StaticSource(healthy_snapshot(T0, **TTFT_BREACH))

    def tick_at(at: float, **fields) -> dict:
        clock.t = at
        source.current = healthy_snapshot(at, **fields)
        return s.tick()

    with swarm(tmp_path, "observe", source, actuator, clock) as s:
        s.tick()
        for at in (T0 + 70, T0 + 140):  # past each cooldown, the breach still there
            assert [d["status"] for d in tick_at(at, **TTFT_BREACH)["decisions"]] == ["accepted"]
        [(front, _)] = entries(tmp_path)
        assert [o["outcome"].split(":")[0] for o in front["outcomes"]] == [
            "proposed (observe mode",
            "proposed again (observe mode",
            "proposed again (observe mode",
        ]
        assert front["outcome"].startswith("proposed again") and front["time"] == front["outcomes"][0]["time"]

        first = set((tmp_path / "actions").glob("*.md"))
        tick_at(T0 + 150)  # the breach is over: a later one is a new situation with its own entry
        tick_at(T0 + 220, **TTFT_BREACH)
        [second] = set((tmp_path / "actions").glob("*.md")) - first
        second.unlink()
        tick_at(T0 + 290, **TTFT_BREACH)  # a person removed its entry: the next filing is not lost
        assert len(entries(tmp_path)) == 2 and not second.exists()
    assert actuator.calls == []


def test_a_lasting_notice_is_one_entry_and_a_different_proposal_another(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    leak = dict(leases_live=600.0, leases_slope=2.0)
    source = StaticSource(healthy_snapshot(T0, **leak))
    with swarm(tmp_path, "act", source, actuator, clock) as s:
        s.tick()
        clock.t = source.current.at = T0 + 70
        s.tick()
        [(front, _)] = entries(tmp_path)
        assert front["action"]["kind"] == "notice" and [o["outcome"].split(":")[0] for o in front["outcomes"]] == ["notified", "still so"]
    # observe mode, one breach: the proposal for a second prefill replica, then (the fleet grown by hand) for a third
    observe = tmp_path / "observe"
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    source = StaticSource(healthy_snapshot(T0, **TTFT_BREACH))
    clock = Clock(T0)
    with swarm(observe, "observe", source, actuator, clock) as s:
        s.tick()
        actuator.replicas["prefill"] = 2
        clock.t = source.current.at = T0 + 70
        s.tick()
    assert sorted((f["action"]["from"], f["action"]["to"]) for f, _ in entries(observe)) == [(1, 2), (2, 3)]


def test_a_lasting_situation_whose_proposed_value_moves_keeps_one_entry(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    slow_wan = lambda at, mean: healthy_snapshot(at, kv_seconds_mean_by_link={WAN: mean}, kv_seconds_p90_by_link={WAN: mean * 1.5}, gap_p99=1.9)  # noqa: E731
    source = StaticSource(slow_wan(T0, 0.6))
    with swarm(tmp_path, "observe", source, actuator, clock) as s:
        s.tick()
        clock.t = T0 + 70
        source.current = slow_wan(T0 + 70, 0.15)  # the controller's threshold follows the pulls: 100 ms, then 120 ms
        s.tick()
    [(front, _)] = entries(tmp_path)
    assert front["action"] == {"target": "routing.max_wan_transfer_ms", "from": 300.0, "to": 100.0}
    assert "routing.max_wan_transfer_ms: 300 -> 120" in front["outcome"]


def test_advise_mode_waits_then_applies_on_approval(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    source = StaticSource(healthy_snapshot(T0, **RLD_OVERLOAD))
    with swarm(tmp_path, "advise", source, actuator, clock) as s:
        state = s.tick()
        assert state["__interrupt__"]
        [waiting] = s.pending()
        assert waiting["tick"] == state["tick"]
        assert {p["change"]["target"] for p in waiting["proposals"]} == {"handoff.relay_cap_tokens", "replicas.relay_decode"}
        assert actuator.calls == []
        # the next tick does not propose the same targets again while they await approval
        clock.t = source.current.at = T0 + 5
        nxt = s.tick()
        assert {d["status"] for d in nxt["decisions"]} == {"held"}
        clock.t = T0 + 20
        done = s.decide(state["tick"], approved=True, by="alice", note="looks right")
        assert s.pending() == []
    assert [c[0] for c in actuator.calls] == ["set_knobs", "scale"]
    assert actuator.knobs.handoff.relay_cap_tokens == 256 and actuator.replicas["relay_decode"] == 2
    assert {c["target"] for c in done["applied"]} == {"handoff.relay_cap_tokens", "replicas.relay_decode"}
    outcomes = sorted(front["outcome"] for front, _ in entries(tmp_path))
    assert all("approved by alice" in o for o in outcomes) and len(outcomes) == 2


def test_advise_rejection_is_recorded_and_throttled(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    source = StaticSource(healthy_snapshot(T0, **TTFT_BREACH))
    with swarm(tmp_path, "advise", source, actuator, clock) as s:
        tick = s.tick()["tick"]
        s.decide(tick, approved=False, by="bob", note="peak hour")
        clock.t = source.current.at = T0 + 10
        again = s.tick()
    assert actuator.calls == []
    [(front, _)] = entries(tmp_path)
    assert front["outcome"] == "rejected by bob: peak hour"
    assert [d["status"] for d in again["decisions"]] == ["held"]


def test_approval_of_a_stale_proposal_changes_nothing(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    with swarm(tmp_path, "advise", StaticSource(healthy_snapshot(T0, **TTFT_BREACH)), actuator, clock) as s:
        tick = s.tick()["tick"]
        actuator.replicas["prefill"] = 3  # someone scaled by hand meanwhile
        s.decide(tick, approved=True, by="carol")
    assert actuator.calls == []
    [(front, _)] = entries(tmp_path)
    assert "not applied: stale" in front["outcome"]


def test_act_mode_entry_follows_the_change_to_its_verdict(tmp_path):
    config = pdd_config()
    actuator = DryRunActuator(config.live_knobs(), REPLICAS)
    clock = Clock(T0)
    source = StaticSource(healthy_snapshot(T0, **TTFT_BREACH))
    with swarm(tmp_path, "act", source, actuator, clock) as s:
        s.tick()
        clock.t = T0 + 31
        source.current = healthy_snapshot(T0 + 31, ttft_p=9.0)
        state = s.tick()
    assert [v["outcome"] for v in state["verdicts"]] == ["rolled_back"]
    assert actuator.replicas["prefill"] == 1
    fronts = [front for front, _ in entries(tmp_path)]
    original = next(f for f in fronts if "rollback_of" not in f)
    rollback = next(f for f in fronts if "rollback_of" in f)
    assert original["outcome"].startswith("rolled back: SLO score")
    assert [o["outcome"].split(";")[0] for o in original["outcomes"]][:2] == ["applying", "applied"]
    assert rollback["action"] == {"target": "replicas.prefill", "from": 2, "to": 1}


def test_observe_failure_is_recorded_not_raised(tmp_path):
    config = pdd_config()
    with swarm(tmp_path, "act", StaticSource(None), DryRunActuator(config.live_knobs(), REPLICAS), Clock(T0)) as s:
        state = s.tick()
        [row] = s.history()
    assert "observe failed" in state["error"] and row["status"] == "error"


def test_llm_routes_and_explains_but_numbers_stay_the_same(tmp_path):
    llm = FakeToolChatModel(
        responses=[
            AIMessage(content="", tool_calls=[{"name": tool_name("capacity"), "args": {"reason": "relay capacity first"}, "id": "c1"}]),
            AIMessage(content="RLD is saturated; the relay cap was lowered and a relay replica added."),
        ]
    )
    config = pdd_config()
    snap = healthy_snapshot(T0, **RLD_OVERLOAD)
    llm_actuator, rule_actuator = DryRunActuator(config.live_knobs(), REPLICAS), DryRunActuator(config.live_knobs(), REPLICAS)
    with swarm(tmp_path / "llm", "act", StaticSource(snap), llm_actuator, Clock(T0), router=LLMRouter(llm)) as s:
        state = s.tick()
    with swarm(tmp_path / "rules", "act", StaticSource(snap), rule_actuator, Clock(T0)) as s:
        rule_state = s.tick()
    assert [r["to"] for r in state["route"]][:2] == ["capacity", "handoff"]
    assert state["route"][0]["reason"] == "llm: relay capacity first"
    assert [r["to"] for r in rule_state["route"]][:2] == ["handoff", "capacity"]
    assert llm_actuator.calls == rule_actuator.calls
    assert state["explanation"].startswith("RLD is saturated")
    assert all("RLD is saturated" in body for _, body in entries(tmp_path / "llm"))


def test_unusable_llm_answers_fall_back_to_rules(tmp_path):
    config = pdd_config()
    snap = healthy_snapshot(T0, **RLD_OVERLOAD)
    for model in (FakeToolChatModel(responses=[AIMessage(content="no idea")]), FailingChatModel(responses=[AIMessage(content="")])):
        actuator = DryRunActuator(config.live_knobs(), REPLICAS)
        with swarm(tmp_path / type(model).__name__, "act", StaticSource(snap), actuator, Clock(T0), router=LLMRouter(model)) as s:
            state = s.tick()
        assert state["route"][0]["to"] == "handoff" and state["route"][0]["reason"].startswith("rule:")
        assert [c[0] for c in actuator.calls] == ["set_knobs", "scale"]


def cli_config(tmp_path: Path, mode: str, **agents) -> tuple:
    """The parsed config and its serve config file, for tests driving `pdd agents` commands."""
    args = pdd_args(audit_db=str(tmp_path / "audit.sqlite"), actions_dir=str(tmp_path / "actions"), mode=mode, **agents)
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump({"applications": [{"name": "pdd", "import_path": "app.builder:build_app", "args": args}]}))
    return pdd_config(**args["agents"]), cfg_file


def test_cli_pending_history_and_unknown_tick(tmp_path):
    config, cfg_file = cli_config(tmp_path, "advise")
    with Swarm.open(
        config,
        source=StaticSource(healthy_snapshot(T0, **TTFT_BREACH)),
        actuator=DryRunActuator(config.live_knobs(), REPLICAS),
        router=RuleRouter(),
        clock=Clock(T0),
    ) as s:
        tick = s.tick()["tick"]
    runner = CliRunner()
    out = runner.invoke(agents_cli, ["pending", "--config", str(cfg_file)])
    assert out.exit_code == 0 and tick in out.output and "replicas.prefill" in out.output
    out = runner.invoke(agents_cli, ["history", "--config", str(cfg_file)])
    assert out.exit_code == 0 and "awaiting" in out.output
    # every live knob no specialist moves is named, never silently left out
    unwatched = out.output.split("not watched by the agents", 1)[1].split("\n\n", 1)[0]
    assert "routing.max_relay_load" in unwatched and "handoff.catch_up_threshold_tokens" in unwatched
    assert "routing.max_wan_transfer_ms" not in unwatched and "handoff.relay_cap_tokens" not in unwatched
    out = runner.invoke(agents_cli, ["approve", "tick-nope", "--config", str(cfg_file)])
    assert out.exit_code == 1 and "no proposal awaits approval" in out.output


def test_a_new_cluster_starts_with_an_empty_memory_and_the_old_history(tmp_path):
    # nothing listens at that Prometheus: the tick records that it could not observe
    config, cfg_file = cli_config(tmp_path, "advise", prometheus_url="http://127.0.0.1:9")
    with Swarm.open(
        config,
        source=StaticSource(healthy_snapshot(T0, **TTFT_BREACH)),
        actuator=DryRunActuator(config.live_knobs(), REPLICAS),
        router=RuleRouter(),
        clock=Clock(T0),
    ) as s:
        tick = s.tick()["tick"]
        assert s.pending() and s.deps.memory.load().streaks
    runner = CliRunner()
    out = runner.invoke(agents_cli, ["run", "--once", "--new-cluster", "--config", str(cfg_file)])
    assert out.exit_code == 0, out.output
    with Swarm.open(
        config, source=StaticSource(healthy_snapshot(T0)), actuator=DryRunActuator(config.live_knobs(), REPLICAS), router=RuleRouter(), clock=Clock(T0)
    ) as s:
        assert s.pending() == [] and s.deps.memory.load() == Memory()
        assert tick in {h["tick"] for h in s.history()}


def test_history_marks_where_each_run_began(tmp_path):
    """The audit database outlives runs: history shows whose ticks are whose."""
    config, cfg_file = cli_config(tmp_path, "observe", prometheus_url="http://127.0.0.1:9")  # each tick records it could not observe
    with Swarm.open(
        config, source=StaticSource(healthy_snapshot(T0)), actuator=DryRunActuator(config.live_knobs(), REPLICAS), router=RuleRouter(), clock=Clock(T0)
    ) as s:
        unmarked = s.tick()["tick"]  # a tick of no recorded run (as before runs were recorded)
    runner = CliRunner()
    for flags in (["--new-cluster"], []):
        out = runner.invoke(agents_cli, ["run", "--once", *flags, "--config", str(cfg_file)])
        assert out.exit_code == 0, out.output
    out = runner.invoke(agents_cli, ["history", "--config", str(cfg_file)])
    assert out.exit_code == 0, out.output
    lines = [line for line in out.output.splitlines() if "run of" in line or "tick-" in line]
    assert [("run of" in line) for line in lines] == [True, False, True, False, False]  # newest first, each run over its tick
    assert all("observe" in line and "app 'pdd'" in line for line in (lines[0], lines[2]))
    assert unmarked in lines[-1]
    with Swarm.open(config, source=StaticSource(healthy_snapshot(T0)), actuator=DryRunActuator(config.live_knobs(), REPLICAS), router=RuleRouter()) as s:
        assert [run["new_cluster"] for run in s.runs()] == [True, False]


def test_entries_can_be_filed_by_hand(tmp_path):
    sink = FileEntries(tmp_path)
    p = Proposal(
        specialist="routing",
        situation="wan_degradation",
        subject="dc-a->dc-b",
        change=Change(target="routing.max_wan_transfer_ms", old=300.0, new=100.0),
        reason="slow link",
        expected_effect="gaps fall",
        evidence=[Evidence(query="rate(x[1m])", value=2.5)],
    )
    path = sink.file(p, tick="t1", mode=AgentMode.act.value, at=T0, outcome="applying", explanation="")
    sink.update(path, at=T0 + 1, outcome="applied")
    front, body = read_entry(path)
    assert front["evidence"] == [{"query": "rate(x[1m])", "value": 2.5}]
    assert front["outcome"] == "applied" and len(front["outcomes"]) == 2
    assert "../wan_degradation.md" in body


def test_history_and_pending_read_at_80_columns_and_as_json(tmp_path):
    """A run line and ticks whose verification notes run long: no line takes more than two rows."""
    config, cfg_file = cli_config(tmp_path, "act")
    with Swarm.open(
        config,
        source=StaticSource(healthy_snapshot(T0, **TTFT_BREACH)),
        actuator=DryRunActuator(config.live_knobs(), REPLICAS),
        router=RuleRouter(),
        clock=Clock(T0),
    ) as s:
        s.begin_run("pdd", new_cluster=True)
        ticks = [s.tick()["tick"] for _ in range(3)]
    runner = CliRunner()
    out = runner.invoke(agents_cli, ["history", "--config", str(cfg_file)], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("run of", "tick-", "  "))]
    assert all(len(line) <= 80 for line in lines)
    assert all(b - a <= 2 for a, b in zip(starts, [*starts[1:], len(lines)])), out.output  # each record line wraps once at most
    assert all(any(line.startswith(t) for line in lines) for t in ticks)
    assert "  accepted: replicas.prefill: 1 -> 2" in lines and "  applied replicas.prefill: 1 -> 2" in lines
    wide = runner.invoke(agents_cli, ["history", "--wide", "--config", str(cfg_file)], env={"COLUMNS": "200"})
    assert wide.exit_code == 0 and "decisions / applied / verified" in wide.output
    data = json.loads(runner.invoke(agents_cli, ["history", "--json", "--config", str(cfg_file)], env={"COLUMNS": "40"}).output)
    assert {t["tick"] for t in data["ticks"]} == set(ticks) and data["runs"][0]["new_cluster"] is True
    assert json.loads(runner.invoke(agents_cli, ["pending", "--json", "--config", str(cfg_file)]).output) == []

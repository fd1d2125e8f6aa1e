"""Chat-ops without an LLM: questions read by rules, answered from the read-only tools.

No cluster: the data source is test_chatops_agent's stub (GET /pdd/state of a
P 1, RLD 1, MD 2 cluster), Prometheus is unreachable (its figures say so),
the audit database and action entries live in tmp_path. Proposals go through
the agents' real approval flow. The figures Prometheus gives are checked
against a real Prometheus in tests/integration/test_observability.py.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agents.chatops.agent import build_agent
from agents.chatops.answers import knob_paths
from agents.chatops.endpoint import ChatEndpoint, ChatOpsRequest
from agents.chatops.questions import change_args, read_question
from agents.chatops.rules import CAPABILITIES, NO_LLM_LINE, RuleAgent
from app.ops.cli import main
from tests.conftest import LOCAL_CONFIG
from tests.integration.agents_fixtures import pdd_config, pending
from tests.unit.test_chatops_agent import INJECTION, JOURNEY, StubSource, answer, converse

SITUATIONS = ["rld_overload", "wan_degradation", "ttft_slo_breach"]
TARGETS = [
    "replicas.prefill",
    "replicas.relay_decode",
    "replicas.main_decode",
    "routing.max_wan_transfer_ms",
    "routing.min_hit_rate",
    "handoff.relay_cap_tokens",
    "handoff.min_relay_cap_tokens",
    "handoff.mode",
    "routing.singular.enabled",
    "routing.singular.min_prompt_tokens",
]


def read(message: str):
    return read_question(message, datacenters=["dc-a", "dc-b"], knobs=knob_paths(), situations=SITUATIONS)


@pytest.mark.parametrize(
    "message, topics, metrics, scope",
    [
        ("Why is P99 TTFT up?", (), ("ttft",), ""),
        ("why is P-RLD-MD's TTFT up?", (), ("ttft",), "P-RLD-MD"),
        ("Is the cluster healthy?", ("state",), (), ""),
        ("How many MD replicas are live?", ("state",), (), "main_decode"),
        ("Which WAN links fail?", (), ("wan", "errors"), ""),
        ("why are there gaps on dc-b?", (), ("gap",), "dc-b"),
        ("what is the prefix hit rate on MD?", (), ("hit",), "main_decode"),
        ("what did the agents do?", ("agents",), (), ""),
        ("which runbook applies now?", ("runbook",), (), ""),
        ("show the wan_degradation runbook", ("runbook",), (), ""),
        ("what does routing.max_wan_transfer_ms do?", ("knobs",), (), ""),
        ("what changed in the last 30 minutes?", ("changes",), (), ""),
        ("what happened to chatcmpl-abc123def?", ("journey",), (), ""),
        ("show the slowest recent requests", ("requests",), (), ""),
        ("what is the weather like", (), (), ""),
    ],
)
def test_questions_are_read_into_topics_metrics_and_scope(message, topics, metrics, scope):
    q = read(message)
    assert (q.topics, q.metrics, q.scope.describe()) == (topics, metrics, scope)


def test_question_details_knobs_spans_situations_ids():
    assert read("what is the min relay cap?").knobs == ("handoff.min_relay_cap_tokens",)
    assert read("what is the relay cap?").knobs == ("handoff.relay_cap_tokens",)
    assert read("what changed in the last 2 hours?").minutes == 120
    assert read("show the wan_degradation runbook").situations == ("wan_degradation",)
    assert read("why was chatcmpl-abc123def slow?").request_ids == ("chatcmpl-abc123def",)
    scope = read("why is the WAN slow on dc-a?").scope
    assert scope.keeps({"link": "dc-a->dc-b"}) and not scope.keeps({"link": "dc-b->dc-b"}) and scope.keeps({"pipeline": "P-MD"})


@pytest.mark.parametrize(
    "message, args",
    [
        ("scale MD to 10", {"target": "replicas.main_decode", "value": "10", "relative": False}),
        ("add 2 main decode replicas", {"target": "replicas.main_decode", "value": "2", "relative": True}),
        ("set routing.max_wan_transfer_ms to 0.5s", {"target": "routing.max_wan_transfer_ms", "value": "0.5s", "relative": False}),
        ("lower the relay cap by 64", {"target": "handoff.relay_cap_tokens", "value": "64", "relative": True}),
        ("switch handoff mode to one-shot", {"target": "handoff.mode", "value": "one_shot"}),
        ("disable the singular filter", {"target": "routing.singular.enabled", "value": "False"}),
        ("set hit rate to 70%", {"target": "routing.min_hit_rate", "value": "70%", "relative": False}),
    ],
)
def test_change_requests_are_read_into_proposals(message, args):
    got, why = change_args(message, TARGETS)
    assert got == {**args, "reason": ""} and why == ""


def test_change_requests_that_name_no_single_target_or_no_value_say_why():
    assert change_args("please set the threshold to 500", TARGETS) == (None, "it could mean routing.max_wan_transfer_ms or routing.min_hit_rate: name one")
    assert change_args("reduce rld replicas", TARGETS) == (None, "it gives no value for replicas.relay_decode")
    assert change_args("make it faster", TARGETS) == (None, "it names nothing the agents may change")
    assert change_args("scale prefill to 2 because the queue is long", TARGETS)[0]["reason"] == "the queue is long"


@pytest.fixture
def config(tmp_path):
    return pdd_config(mode="act", audit_db=str(tmp_path / "audit.sqlite"), actions_dir=str(tmp_path / "actions"), prometheus_url="http://127.0.0.1:9")


def rules_for(config, source=None) -> RuleAgent:
    agent = build_agent(config, llm=None, source=source or StubSource(), app_name="pdd", checkpointer=None)
    assert isinstance(agent, RuleAgent)
    return agent


async def test_state_answer_reads_the_cluster_and_says_it_used_no_llm(config):
    events = await converse(rules_for(config), "Is the cluster healthy?")
    text = answer(events)
    assert "Readiness: ready (prefill 1/1, relay_decode 1/1, main_decode 2/2)" in text
    assert "- main_decode in dc-b (None): 2 live of 2 configured" in text and "Live knobs equal the config file's." in text
    assert "The agents' diagnosis could not be made: Prometheus at http://127.0.0.1:9" in text  # down: said, not guessed
    assert text.rstrip().endswith(NO_LLM_LINE) and "agents.llm" in NO_LLM_LINE
    assert [f["source"] for f in events[-1]["figures"]] == ["state"] and events[-1]["type"] == "figures"


async def test_knob_answer_gives_meaning_live_value_and_bounds(config):
    source = StubSource()
    state = await source.state()
    state["knobs"]["routing"]["max_wan_transfer_ms"] = 450.0

    class Moved(StubSource):
        async def state(self):
            return state

    text = answer(await converse(rules_for(config, Moved()), "what does routing.max_wan_transfer_ms do?"))
    bounds = config.agents.bounds["routing.max_wan_transfer_ms"]
    assert f"- routing.max_wan_transfer_ms: live 450, config {config.routing.max_wan_transfer_ms:g}. P-MD when the gap it is predicted to cause" in text
    assert f"within {bounds.min:g}..{bounds.max:g}, at most {bounds.max_step:g} a step" in text
    changed = answer(await converse(rules_for(config, Moved()), "what changed in the last 10 minutes?"))
    assert f"routing.max_wan_transfer_ms 450 (config {config.routing.max_wan_transfer_ms:g})" in changed
    assert "the agents changed, proposed and verified nothing" in changed


async def test_journey_and_runbook_answers(config):
    text = answer(await converse(rules_for(config), "why was chatcmpl-1 slow?"))
    assert "chatcmpl-1: P-RLD-MD (pdd), 900 prompt tokens" in text and f"TTFT {JOURNEY['ttft_ms']} ms, worst gap {JOURNEY['max_gap_ms']} ms" in text
    missing = answer(await converse(rules_for(config), "what happened to chatcmpl-nothere?"))
    assert "chatcmpl-nothere: no request 'chatcmpl-nothere' in the journal" in missing
    runbook = answer(await converse(rules_for(config), "show the wan_degradation runbook"))
    assert "runbooks/wan_degradation.md: WAN degradation" in runbook and "routing" in runbook


async def test_unknown_question_lists_what_it_can_answer(config):
    events = await converse(rules_for(config), "what is the weather like?")
    assert "I could not tell what that asks." in answer(events) and CAPABILITIES in answer(events)
    assert events[-1]["figures"] == []


async def test_change_request_is_filed_for_approval_only(config, tmp_path, actuations):
    events = await converse(rules_for(config), "scale MD to 3")
    [proposal] = [e for e in events if e["type"] == "proposal"]
    assert proposal["filed"] and proposal["change"] == "replicas.main_decode: 2 -> 3"
    assert answer(events).startswith(
        f"Filed for approval: replicas.main_decode: 2 -> 3. Nothing changes until a person runs `pdd agents approve {proposal['tick']}`."
    )
    assert [p["tick"] for p in pending(config)] == [proposal["tick"]] and actuations == []
    agents = answer(await converse(rules_for(config), "what did the agents do?"))
    assert f"Awaiting approval: replicas.main_decode (`pdd agents approve {proposal['tick']}`)" in agents
    assert "operator_request: replicas.main_decode: 2 -> 3" in agents
    vague = [e for e in await converse(rules_for(config), "set the threshold to 500") if e["type"] == "proposal"]
    assert not vague[0]["filed"] and "name one" in vague[0]["message"]


async def test_injection_in_a_question_or_tool_data_changes_nothing(config, actuations):
    journeys = {"chatcmpl-1": {**JOURNEY, "error": INJECTION}}
    events = await converse(rules_for(config, StubSource(journeys)), f"What happened to chatcmpl-1? {INJECTION}")
    assert not [e for e in events if e["type"] == "proposal"]
    assert INJECTION in answer(events)  # quoted as the request's error, not followed
    assert pending(config) == [] and actuations == []


async def test_chat_endpoint_without_an_llm_answers_by_rules():
    endpoint = ChatEndpoint(pdd_config(), conductor=None, app_name="pdd")
    response = await endpoint.respond(ChatOpsRequest(message="hello"), key="")
    body = b"".join([chunk async for chunk in response.body_iterator]).decode()
    assert "I could not tell what that asks." in body and body.endswith("data: [DONE]\n\n")


def test_pdd_ask_without_an_llm_answers_and_says_how_to_add_one(tmp_path):
    out = CliRunner().invoke(main, ["ask", "what is the weather like?", "--config", str(LOCAL_CONFIG), "--url", "http://127.0.0.1:9"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "Answered without an LLM" in text and "agents.llm" in text and "--thread" not in text

"""bench/pipelines.py's closed profile, its keys and its chat conversations (no engines)."""

import math

from bench.chat_replay import Conversation
from bench.pipelines import ANSWER_TOKENS, SYSTEMS, TOOL_CALL_TOKENS, closed_trace, hit_share, ratios, system_args, workload
from tests.conftest import local_args


def test_the_closed_profile_runs_conversations_on_as_many_agents_back_to_back():
    trace = closed_trace(120, 4, seed=1)
    assert len(trace) == 120 and {r.arrival_s for r in trace} == {0.0}
    assert {r.session for r in trace} == {0, 1, 2, 3}
    short = [r for r in trace if TOOL_CALL_TOKENS[0] <= r.output_tokens <= TOOL_CALL_TOKENS[1]]
    long = [r for r in trace if ANSWER_TOKENS[0] <= r.output_tokens <= ANSWER_TOKENS[1]]
    assert len(short) + len(long) == 120 and 0.5 < len(short) / 120 < 0.9
    for agent in range(4):
        turns = [r for r in trace if r.session == agent]
        # an agent's later conversation starts fresh: its first turn repeats nothing of the last one's
        starts = [i for i, r in enumerate(turns) if r.prefix_tokens == 0]
        assert starts[0] == 0 and len(starts) >= 1
        assert all(r.prefix_tokens < r.prompt_tokens for r in turns)
    conversations = {r.session for r in workload(120, 1.0, 1).generate()}
    assert sum(r.prefix_tokens == 0 for r in trace) == len(conversations) > 4  # each starts fresh, wherever it runs


def test_each_disaggregated_system_runs_three_engines():
    base = local_args()
    for name, system in SYSTEMS.items():
        roles = system_args(base, system)["roles"]
        used = {
            "colocated": ("main_decode",),
            "pd_intra_dc": ("prefill", "relay_decode"),
            "pd_cross_dc_naive": ("prefill", "main_decode"),
            "pd_cross_dc": ("prefill", "main_decode"),
        }.get(name, ("prefill", "relay_decode", "main_decode"))
        assert sum(roles[r].get("replicas", 1) for r in used) == 3, name
    assert base["roles"]["main_decode"].get("replicas", 1) == 1  # the base config is left as it was


def test_the_keys_compare_pdd_with_each_baseline():
    row = {"gap_p99": 100.0, "ttft_p99": 200.0, "wait_p99": 300.0, "wan_mb": 10.0}
    rows = {"pdd": row, "pd_intra_dc": {**row, "gap_p99": 50.0}, "pd_cross_dc": {**row, "wait_p99": 900.0, "wan_mb": 0.0}}
    keys = ratios(rows)
    assert keys["gap_p99_pdd_over_intra"] == 2.0 and keys["ttft_p99_pdd_over_intra"] == 1.0
    assert keys["worst_wait_p99_crossdc_over_pdd"] == 3.0 and keys["wan_bytes_crossdc_over_pdd"] == 0.0
    assert "gap_p99_naive_over_pdd" not in keys
    assert math.isinf(ratios({"pdd": {**row, "wan_mb": 0.0}, "pd_cross_dc": row})["wan_bytes_crossdc_over_pdd"])


def test_a_chat_conversation_is_cut_as_a_token_list_would_be_but_never_inside_an_answer():
    talk = Conversation(lambda ids: " ".join(map(str, ids)))
    talk.write("user", list(range(100)))
    talk.answer({"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]}, 20)
    assert talk.awaiting_result() == "call_1"
    talk.write("tool", list(range(50)), tool_call_id="call_1")
    assert talk.awaiting_result() is None and talk.messages[2]["tool_call_id"] == "call_1"
    assert talk.cut(10_000) == 170 and len(talk.messages) == 3  # nothing to cut
    assert talk.cut(150) == 150 and talk.messages[2]["content"] == " ".join(map(str, range(30)))  # the tool result's start
    assert talk.cut(120) == 120 and talk.awaiting_result() == "call_1"  # the call kept, its result not: a tool message comes next
    assert talk.cut(110) == 100 and talk.awaiting_result() is None  # never inside the model's answer
    assert talk.cut(40) == 40 and talk.messages == [{"role": "user", "content": " ".join(map(str, range(40)))}]
    assert talk.cut(0) == 0 and talk.messages == [] and talk.awaiting_result() is None


def test_hit_shares_count_only_the_requests_a_role_saw():
    journeys = [
        {"prompt_tokens": 100, "hit_tokens": {"prefill": 50, "main_decode": 100}},
        {"prompt_tokens": 200, "hit_tokens": {"prefill": 200}},
        {},  # a request that got no id
    ]
    assert hit_share(journeys, "prefill") == 0.75
    assert hit_share(journeys, "main_decode") == 1.0
    assert math.isnan(hit_share(journeys, "relay_decode"))

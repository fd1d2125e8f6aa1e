"""PDD on real engines: every pipeline and handoff mode gives the colocated tokens.

One app: 1 P + 1 RLD in dc-a, 2 MD in dc-b, a 40 Mbit/s WAN: a 2400-token
prompt's KV takes ~2 s to cross, while RLD decodes ~85 tokens/s (~180 tokens
during that pull), so a 1600-token answer's relay really relays and hands over.
Tests that must see RLD's tokens between P's and MD's either slow the WAN to a
quarter (`slow_wan`: an ~8 s pull) or hold it until RLD's tokens reach the
client (`relayed_while_wan_held`). Holding is the robust one both ways: MD took
over before RLD's first token on loaded CI machines, 2 s and 8 s pulls alike,
and a fast one relayed all 1600 tokens inside an 8 s pull.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import jsonschema
import pytest
from transformers import AutoTokenizer

from app.config import PDDConfig, RoleName
from app.engine.deployments import DEPLOYMENT_NAMES
from app.engine.devmodel import ensure_devmodel
from app.ops.faults import Faults
from app.sim.calibrate import take_app_steps
from app.sim.fitting import serving_overhead_ms
from app.sim.perf import chunk_attention_pairs
from tests.conftest import local_args, set_wan
from tests.integration.conftest import completion, deploy_app, list_schema
from tests.integration.relaying import WAN, api, assert_crossed_every_engine, fresh, relayed_while_wan_held, wait_wan_idle

LONG = 2400
OUT = 1600
WAN_MBPS = 40


@pytest.fixture(scope="module")
def app(serve_instance):
    args = local_args()
    args["roles"]["main_decode"]["replicas"] = 2
    for role in args["roles"].values():
        role["engine"]["record_steps"] = True
    set_wan(args, WAN_MBPS, 20)
    deployed = deploy_app(serve_instance, "pdd", args)
    yield deployed
    deployed.delete()


RELAY_64_ONE_SHOT = {"relay_cap_tokens": 64, "min_relay_cap_tokens": 64, "mode": "one_shot"}
"""Handoff knobs: the relay decodes 64 tokens, then MD takes over in one step."""


@pytest.fixture
def slow_wan(app):
    """The WAN at a quarter of its configured speed for one test, routing still planning for the configured one.

    For tests that must see RLD's tokens between P's and MD's: MD takes over when its pull ends,
    and a loaded machine can take longer than the 2 s pull to start RLD decoding (the conductor
    then rightly hands over before RLD's first token). An ~8 s pull leaves margin."""
    faults = Faults(app.name)
    faults.degrade_link(WAN, bandwidth_mbps=WAN_MBPS / 4)
    yield
    faults.restore_link(WAN)


def wait_for_md_report(app, request_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        journey = app.journey(request_id)
        if "main_decode" in journey["hit_tokens"]:
            return journey
        time.sleep(0.2)
    raise TimeoutError(f"no MD report for {request_id}")


def stream_text(app, prompt, max_tokens) -> str:
    client = api(app)
    chunks = client.completions.create(model="pdd-dev", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def assert_relayed_then_handed_over(journey, max_tokens):
    assert_crossed_every_engine(journey)
    counts = dict((role, n) for role, n in journey["token_sources"])
    assert counts["prefill"] == 1
    handoff = journey["handoff"]
    assert handoff["point"] == 1 + counts["relay_decode"]  # RLD's last token is the handoff point
    assert sum(counts.values()) == max_tokens == journey["completion_tokens"]
    links = {t["link"]: t for t in journey["transfers"]}
    assert links["dc-a->dc-a"]["ok"] and links[WAN]["ok"]
    return handoff


@pytest.mark.parametrize("mode", ["one_shot", "catch_up", "auto"])
def test_relay_and_handoff_give_the_colocated_tokens(app, knobs, mode):
    # MD's pull starts after RLD's first token and takes ~2 s: the relay is still going when MD holds the KV
    knobs(handoff={"mode": mode, "catch_up_threshold_tokens": 32, "relay_cap_tokens": 2048})
    prompt_a, prompt_b = fresh(LONG), fresh(LONG)
    text_a, journey = relayed_while_wan_held(app, prompt_a, OUT)
    handoff = assert_relayed_then_handed_over(journey, OUT)
    streamed_b = stream_text(app, prompt_b, OUT)
    assert text_a == completion(app, prompt_a, OUT, mode="colocated")[0]
    assert streamed_b == completion(app, prompt_b, OUT, mode="colocated")[0]
    expected_mode = "catch_up" if mode == "auto" else mode  # auto: catch-up while RLD is idle
    assert handoff["mode"] == expected_mode
    if expected_mode == "one_shot":
        assert handoff["steps"] == 1 and handoff["final_step_tokens"] == handoff["point"] - 1
    elif handoff["relay_tokens"] > 2 * 32:
        assert handoff["steps"] >= 2 and handoff["final_step_tokens"] < handoff["relay_tokens"]
    assert handoff["latency_ms"] is not None


def test_a_batchs_choices_relay_side_by_side_and_give_the_colocated_tokens(app):
    prompts = [fresh(1200), fresh(1200)]
    client = api(app)
    texts = {i: "" for i in range(4)}
    for chunk in client.completions.create(model="pdd-dev", prompt=prompts, n=2, max_tokens=300, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    colocated = [completion(app, p, 300, mode="colocated")[0] for p in prompts]
    assert list(texts.values()) == [colocated[0], colocated[0], colocated[1], colocated[1]]
    pipelines = [app.journey(f"{chunk.id}-{i}")["pipeline"] for i in range(4)]
    assert "P-RLD-MD" in pipelines, pipelines


def test_a_seeded_sample_is_the_colocated_one_whichever_pipeline_serves_it(app, knobs):
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt, seeded = fresh(LONG), {"temperature": 1.0, "top_p": 0.9, "seed": 11}
    relayed, journey = completion(app, prompt, 400, **seeded)
    assert journey["pipeline"] == "P-RLD-MD", journey["decision"]
    sources = [role for role, _ in journey["token_sources"]]
    assert sources[0] == "prefill" and sources[-1] == "main_decode", journey["token_sources"]
    wait_wan_idle(app)
    again, journey = completion(app, prompt, 400, **seeded)  # MD now holds the prompt
    assert journey["pipeline"] != "P-RLD-MD", journey["decision"]
    assert relayed == again == completion(app, prompt, 400, mode="colocated", **seeded)[0]
    assert relayed != completion(app, prompt, 400, mode="colocated", **{**seeded, "seed": 12})[0]


def test_penalties_count_the_output_of_every_engine_the_request_crossed(app, knobs, slow_wan):
    """After each handoff the earlier output is in the next engine's prompt: it still counts as output."""
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt, penalties = fresh(LONG), {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    relayed, journey = completion(app, prompt, 300, **penalties)
    assert_crossed_every_engine(journey)
    assert relayed == completion(app, prompt, 300, mode="colocated", **penalties)[0]
    assert relayed != completion(app, prompt, 300, mode="colocated")[0]


def test_vllms_sampling_extensions_hold_on_every_engine_the_request_crossed(app, knobs, slow_wan):
    """top_k and min_p act per step, repetition_penalty reads prompt and output alike (the earlier
    output is in the next engine's prompt), min_tokens is what is left on each engine."""
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt = fresh(LONG)
    params = {"temperature": 1.0, "seed": 5, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.3, "min_tokens": 150}
    relayed, journey = completion(app, prompt, 300, **params)
    assert_crossed_every_engine(journey)
    assert relayed == completion(app, prompt, 300, mode="colocated", **params)[0]
    assert relayed != completion(app, prompt, 300, mode="colocated", **{**params, "repetition_penalty": 1.0})[0]


LIST = list_schema(10)


@pytest.mark.parametrize("mode", ["one_shot", "catch_up"])
def test_a_structured_answer_handed_over_mid_object_satisfies_its_schema_and_is_the_colocated_one(app, knobs, mode):
    """P writes the answer's first token, RLD the next 64, MD the rest: each engine's grammar
    starts where the engines before it stopped, so no engine opens the object again."""
    knobs(handoff={"relay_cap_tokens": 64, "min_relay_cap_tokens": 64, "mode": mode, "catch_up_threshold_tokens": 16})
    prompt, constrained = fresh(LONG), {"response_format": {"type": "json_schema", "json_schema": {"name": "items", "schema": LIST}}}
    relayed, journey = completion(app, prompt, 700, **constrained)
    assert_crossed_every_engine(journey)
    assert journey["handoff"]["point"] < journey["completion_tokens"] - 100  # MD took over inside the list
    jsonschema.validate(json.loads(relayed), LIST)
    assert relayed == completion(app, prompt, 700, mode="colocated", **constrained)[0]
    seeded = {"temperature": 1.0, "seed": 3, "structured_outputs": {"regex": "([a-z]{3}-[0-9]{2} ){40}"}}
    prompt = fresh(LONG)
    sampled, journey = completion(app, prompt, 400, **seeded)
    assert re.fullmatch("([a-z]{3}-[0-9]{2} ){40}", sampled), sampled
    assert "main_decode" in dict(journey["token_sources"])
    assert sampled == completion(app, prompt, 400, mode="colocated", **seeded)[0]


@pytest.mark.xfail(
    reason="open bug (#57): run after this module's other tests, one of the three answers differs mid-arguments from the others; passes alone", strict=False
)
def test_a_tool_call_handed_over_mid_arguments_is_a_valid_call_and_the_colocated_one(app, knobs):
    """tool_choice required: the engines write the call list under its schema, P then RLD then MD."""
    knobs(handoff=RELAY_64_ONE_SHOT)
    tools = [{"type": "function", "function": {"name": "file_items", "parameters": LIST}}]
    content = AutoTokenizer.from_pretrained(str(ensure_devmodel())).decode(fresh(LONG))  # a prompt no engine has seen

    def ask(**extra):
        return api(app).chat.completions.create(
            model="pdd-dev",
            messages=[{"role": "user", "content": content}],
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=700,
            temperature=0,
            **extra,
        )

    relayed = ask()
    assert_crossed_every_engine(app.journey(relayed.id))
    (call,) = relayed.choices[0].message.tool_calls
    assert call.function.name == "file_items" and relayed.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), LIST)
    wait_wan_idle(app)  # MD's background pull done: the next answers run in batches of their own, as the first did
    (colocated,) = ask(extra_body={"pdd_mode": "colocated"}).choices[0].message.tool_calls
    streamed = "".join(d.function.arguments or "" for c in ask(stream=True) if c.choices for d in c.choices[0].delta.tool_calls or [])
    assert call.function.arguments == colocated.function.arguments == streamed


def test_a_logit_bias_applies_on_every_engine_the_request_crossed(app, knobs):
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt = fresh(LONG)
    client = api(app)
    plain = client.completions.create(
        model="pdd-dev", prompt=prompt, max_tokens=200, temperature=0, extra_body={"return_token_ids": True, "pdd_mode": "colocated"}
    )
    common = [t for t, _ in Counter(plain.choices[0].token_ids).most_common(5)]
    bias = {str(t): -100 for t in common}
    app.handle("Conductor").reset_prefix_caches.remote().result()  # colocated ran on an MD: cold caches, as for a new prompt
    relayed, journey = relayed_while_wan_held(app, prompt, 200, logit_bias=bias)
    assert_crossed_every_engine(journey)
    assert relayed == completion(app, prompt, 200, mode="colocated", logit_bias=bias)[0]
    assert relayed != plain.choices[0].text


def test_logprobs_are_the_single_engines_whichever_engines_sampled_the_tokens(app, knobs, slow_wan):
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt = fresh(LONG)
    client = api(app)

    def logprobs(**extra):
        out = client.completions.create(
            model="pdd-dev", prompt=prompt, max_tokens=200, temperature=0, logprobs=3, stream=True, extra_body={"ignore_eos": True, **extra}
        )
        chunks = [c for c in out if c.choices and c.choices[0].logprobs]
        lps = [c.choices[0].logprobs for c in chunks]
        return chunks[0].id, [t for c in lps for t in c.tokens], [v for c in lps for v in c.token_logprobs], [top for c in lps for top in c.top_logprobs]

    request_id, tokens, relayed, top = logprobs()
    journey = app.journey(request_id)
    assert_crossed_every_engine(journey)
    _, single_tokens, single, single_top = logprobs(pdd_mode="colocated")
    assert tokens == single_tokens and len(relayed) == 200
    assert relayed == pytest.approx(single, abs=1e-3)
    assert [sorted(t) for t in top] == [sorted(t) for t in single_top]


def test_an_echoed_prompt_is_scored_by_prefill_as_by_a_single_engine(app, knobs, slow_wan):
    """P computes the prompt, so P scores it; the answer goes on across RLD and MD."""
    knobs(handoff=RELAY_64_ONE_SHOT)
    prompt = fresh(LONG)
    client = api(app)

    def scored(**extra):
        out = client.completions.create(
            model="pdd-dev", prompt=prompt, max_tokens=200, temperature=0, logprobs=2, echo=True, extra_body={"ignore_eos": True, **extra}
        )
        return out.id, out.choices[0]

    request_id, relayed = scored()
    journey = app.journey(request_id)
    assert_crossed_every_engine(journey)
    _, single = scored(pdd_mode="colocated")
    assert relayed.text == single.text and relayed.logprobs.tokens == single.logprobs.tokens
    assert len(relayed.logprobs.tokens) == len(prompt) + 200 and relayed.logprobs.token_logprobs[0] is None
    assert relayed.logprobs.token_logprobs[1:] == pytest.approx(single.logprobs.token_logprobs[1:], abs=1e-3)


def test_high_hit_turn_goes_straight_to_md(app):
    """The next turn repeats the conversation, answer included: MD holds all of it
    (it decoded the answer, or caught up on the relay's answer by recompute)."""
    turn1 = fresh(LONG)
    client = api(app)
    first = client.completions.create(model="pdd-dev", prompt=turn1, max_tokens=64, temperature=0, extra_body={"return_token_ids": True})
    answer = first.choices[0].token_ids
    if app.journey(first.id)["handoff"]["mode"] == "none":  # the relay finished turn 1; MD still pulls it (~2 s)
        wait_wan_idle(app)
    turn2 = turn1 + answer + fresh(60)
    text, journey = completion(app, turn2, 64)
    assert journey["pipeline"] == "P-MD"
    assert [role for role, _ in journey["token_sources"]] == ["prefill", "main_decode"]
    block = app.args["model"]["block_size"]
    # the answer's last token was sampled, never fed back: no KV of its own
    assert journey["hit_tokens"]["main_decode"] >= (len(turn1) + len(answer) - 1) // block * block
    wan = [t for t in journey["transfers"] if t["link"] == WAN]
    assert len(wan) == 1 and wan[0]["blocks"] <= 3  # only what the new turn added
    assert text == completion(app, turn2, 64, mode="colocated")[0]


def test_a_turn_stopped_during_the_relay_still_reaches_md(app):
    """A stop string ends the client's stream while RLD relays: MD still catches up on the
    turn, so the next one goes straight to MD and only what it added crosses the WAN."""
    client = api(app)
    relays = []
    for _ in range(3):  # on a loaded host MD's pull can win the race to the stop string: another turn then
        turn1 = fresh(LONG)
        reference, _ = completion(app, turn1, 200, mode="colocated", ignore_eos=True)
        app.handle("Conductor").reset_prefix_caches.remote().result()  # colocated ran on an MD: cold caches again
        at = next(k for k in range(40, len(reference) - 4) if reference.find(reference[k : k + 4]) == k)
        first = client.completions.create(
            model="pdd-dev",
            prompt=turn1,
            max_tokens=200,
            temperature=0,
            stop=[reference[at : at + 4]],
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert first.choices[0].text == reference[:at] and first.choices[0].finish_reason == "stop"
        journey = app.journey(first.id)
        assert journey["pipeline"] == "P-RLD-MD"
        relays.append({k: journey[k] for k in ("token_sources", "hit_tokens", "transfers", "handoff")})
        if [role for role, _ in journey["token_sources"]] == ["prefill", "relay_decode"]:
            break
        wait_wan_idle(app)
    assert [role for role, _ in journey["token_sources"]] == ["prefill", "relay_decode"], relays
    assert journey["handoff"]["reason"] == "the stream ended during the relay"
    wait_wan_idle(app)
    turn2 = turn1 + first.choices[0].token_ids + fresh(60)
    text, journey = completion(app, turn2, 16)
    assert journey["pipeline"] == "P-MD", journey["decision"]
    block = app.args["model"]["block_size"]
    assert journey["hit_tokens"]["main_decode"] >= len(turn1) // block * block
    wan = [t for t in journey["transfers"] if t["link"] == WAN]
    assert len(wan) == 1 and wan[0]["blocks"] <= 3
    assert text == completion(app, turn2, 16, mode="colocated")[0]


def test_a_turn_stopped_on_md_counts_in_the_next_turns_estimate(app):
    """A stop string ends the client's stream while MD decodes: the conductor's index still
    learns what MD computed, so the next turn's estimate counts it and only what that turn
    added is expected to cross the WAN."""
    client = api(app)
    turn1 = fresh(LONG)
    answer1 = client.completions.create(model="pdd-dev", prompt=turn1, max_tokens=64, temperature=0, extra_body={"return_token_ids": True}).choices[0].token_ids
    turn2 = turn1 + answer1 + fresh(60)
    reference, _ = completion(app, turn2, 200, mode="colocated", ignore_eos=True)
    # colocated ran on an MD and taught the index: cold caches, then turn 1 again, as PDD served it
    app.handle("Conductor").reset_prefix_caches.remote().result()
    completion(app, turn1, 64)
    wait_wan_idle(app)
    at = next(k for k in range(120, len(reference) - 4) if reference.find(reference[k : k + 4]) == k)
    second = client.completions.create(
        model="pdd-dev", prompt=turn2, max_tokens=200, temperature=0, stop=[reference[at : at + 4]], extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert second.choices[0].text == reference[:at]
    journey = app.journey(second.id)
    assert journey["pipeline"] == "P-MD" and journey["finish_reason"] == "stop", journey["decision"]
    turn3 = turn2 + second.choices[0].token_ids + fresh(60)
    _, journey = completion(app, turn3, 8)
    assert journey["pipeline"] == "P-MD" and journey["decision"]["blocks_to_send"] <= 3, journey["decision"]
    # the gap routing predicted and the one seen: at least MD's pull, and the worst of the turn here
    decision, (pull,) = journey["decision"], [t for t in journey["transfers"] if t["link"] == WAN]
    token_back_ms = PDDConfig.model_validate(app.args).link("dc-a", "dc-b").rtt_ms / 2
    assert decision["predicted_gap_ms"] == pytest.approx(
        decision["expected_wan_ms"] + decision["md_wait_ms"] + token_back_ms + decision["gap_correction_ms"], abs=0.2
    )
    assert pull["seconds"] * 1000 < journey["md_gap_ms"] <= journey["max_gap_ms"] + 1


def test_a_relayed_turn_stopped_after_the_handoff_counts_in_the_next_turns_estimate(app, knobs):
    """As above, on P-RLD-MD: a stop string ends the stream after MD took over from RLD."""
    knobs(handoff={"relay_cap_tokens": 24, "min_relay_cap_tokens": 24, "mode": "one_shot"})
    client = api(app)
    turn1 = fresh(LONG)
    reference, _ = completion(app, turn1, 200, mode="colocated", ignore_eos=True)
    app.handle("Conductor").reset_prefix_caches.remote().result()
    at = next(k for k in range(len(reference) * 2 // 3, len(reference) - 4) if reference.find(reference[k : k + 4]) == k)
    first = client.completions.create(
        model="pdd-dev", prompt=turn1, max_tokens=200, temperature=0, stop=[reference[at : at + 4]], extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert first.choices[0].text == reference[:at]
    journey = app.journey(first.id)
    assert journey["pipeline"] == "P-RLD-MD" and journey["finish_reason"] == "stop", journey["decision"]
    # RLD's share may be none: on a loaded host MD can hold the KV (~2 s) before RLD's first token
    assert [role for role, _ in journey["token_sources"]] in (["prefill", "relay_decode", "main_decode"], ["prefill", "main_decode"])
    assert len(first.choices[0].token_ids) >= 100  # without what MD computed, the next turn's estimate would be off by >= 3 blocks
    wait_wan_idle(app)
    turn2 = turn1 + first.choices[0].token_ids + fresh(60)
    _, journey = completion(app, turn2, 8)
    assert journey["pipeline"] == "P-MD" and journey["decision"]["blocks_to_send"] <= 3, journey["decision"]
    # the gap routing predicted and the one seen: at least MD's pull, and the worst of the turn here
    decision, (pull,) = journey["decision"], [t for t in journey["transfers"] if t["link"] == WAN]
    token_back_ms = PDDConfig.model_validate(app.args).link("dc-a", "dc-b").rtt_ms / 2
    assert decision["predicted_gap_ms"] == pytest.approx(
        decision["expected_wan_ms"] + decision["md_wait_ms"] + token_back_ms + decision["gap_correction_ms"], abs=0.2
    )
    assert pull["seconds"] * 1000 < journey["md_gap_ms"] <= journey["max_gap_ms"] + 1


def test_singular_request_finishes_on_the_relay(app, knobs):
    knobs(routing={"singular": {"enabled": True, "min_prompt_tokens": 2000, "max_hit_rate": 0.2, "max_output_tokens": 8}})
    prompt = fresh(LONG)
    text, journey = completion(app, prompt, 6)
    assert journey["pipeline"] == "P-RLD"
    assert journey["token_sources"] == [["prefill", 1], ["relay_decode", 5]]
    assert all(t["to_role"] != "main_decode" for t in journey["transfers"])
    assert text == completion(app, prompt, 6, mode="colocated")[0]


def test_relay_cap_stops_the_relay_and_md_resumes(app, knobs):
    knobs(handoff={"relay_cap_tokens": 24, "min_relay_cap_tokens": 24, "mode": "one_shot"})
    prompt = fresh(LONG)
    text, journey = completion(app, prompt, 200)
    assert journey["decision"].get("relay_capped_at") == 24
    assert journey["token_sources"][:2] == [["prefill", 1], ["relay_decode", 24]]
    # RLD's request ended at its cap, well before MD's ~2 s pull landed: it decoded next to nothing past it
    assert journey["handoff"]["relay_tokens_discarded"] <= 2
    assert text == completion(app, prompt, 200, mode="colocated")[0]


def test_knob_changes_are_live_without_engine_restarts(app, knobs):
    before = {d: app.handle(d).describe.remote().result().replica_id for d in ("Prefill", "RelayDecode")}
    knobs(routing={"max_wan_transfer_ms": 100_000})
    _, journey = completion(app, fresh(LONG), 8)
    assert journey["pipeline"] == "P-MD"  # everything is "cheap enough" now
    after = {d: app.handle(d).describe.remote().result().replica_id for d in ("Prefill", "RelayDecode")}
    assert after == before


def test_conversations_stick_to_one_md_and_md_keeps_up_with_p(app):
    """Affinity across 2 MD replicas, and MD's hit rate tracks P's turn after turn."""
    conversations = {c: fresh(800 + 300 * c) for c in range(4)}
    md_of: dict[int, set[str]] = {c: set() for c in conversations}
    p_hit = md_hit = prompt_total = 0
    for turn in range(4):
        for c in conversations:
            prompt = conversations[c]
            _, journey = completion(app, prompt, 24)
            assert journey["pipeline"] in ("P-MD", "P-RLD-MD")
            if "main_decode" not in journey["hit_tokens"]:  # the relay finished; MD's warm-up reports later
                journey = wait_for_md_report(app, journey["request_id"])
            if turn > 0:
                md_of[c].add(journey["replicas"]["main_decode"])
                p_hit += journey["hit_tokens"]["prefill"]
                md_hit += journey["hit_tokens"]["main_decode"]
                prompt_total += len(prompt)
            conversations[c] = prompt + fresh(150)
    assert all(len(replicas) == 1 for replicas in md_of.values()), md_of
    assert len(set().union(*md_of.values())) == 2, "both MD replicas serve conversations"
    p_rate, md_rate = p_hit / prompt_total, md_hit / prompt_total
    assert p_rate > 0.5
    assert md_rate >= 0.95 * p_rate, (md_rate, p_rate)


def _steps_until(app, done, timeout_s: float = 10.0) -> dict:
    """Engines' timed steps (taken from every replica) until `done(steps)`: a step's
    report travels with the engine's stats, a moment after its outputs."""
    steps = {role: [] for role in RoleName}
    deadline = time.monotonic() + timeout_s
    while True:
        for role, samples in take_app_steps(app.name).items():
            steps[role] += samples
        if done(steps) or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def test_journeys_split_ttft_into_the_engines_own_time_and_the_serving_stacks(app):
    """Each engine replica's time to the first token lands in the journey; the rest of TTFT is the serving stack's."""
    _, colocated = completion(app, fresh(600), 3, mode="colocated")
    assert set(colocated["engine_ttft_ms"]) == set(colocated["engine_core_ttft_ms"]) == {"main_decode"}
    core = colocated["engine_core_ttft_ms"]["main_decode"]
    assert 0 <= colocated["engine_queued_ms"]["main_decode"] < core < colocated["engine_ttft_ms"]["main_decode"] < colocated["ttft_ms"]
    # outside the engine is outside its core: the replica's input and output processing included
    assert serving_overhead_ms(colocated) == pytest.approx(colocated["ttft_ms"] - core)
    _, pdd = completion(app, fresh(600), 8, mode="pdd")
    engine, core = pdd["engine_ttft_ms"], pdd["engine_core_ttft_ms"]
    assert {role for role, _ in pdd["token_sources"]} <= set(engine) == set(core), (pdd["token_sources"], engine, core)
    assert all(0 < core[role] < engine[role] for role in engine), (engine, core)
    assert engine["prefill"] < pdd["ttft_ms"]
    assert serving_overhead_ms(pdd) == pytest.approx(pdd["ttft_ms"] - core["prefill"])


def test_engines_time_their_steps_in_the_twins_terms(app):
    """`engine.record_steps`: the steps vLLM really ran, counted as the twin counts them."""
    _steps_until(app, lambda steps: False, timeout_s=1.0)  # earlier tests' steps
    sent = time.monotonic()
    completion(app, fresh(700), 6, mode="colocated")
    done = time.monotonic()
    # one prefill step, then one decode step per token but the first
    want = Counter([(700, 0, 700, chunk_attention_pairs(700, 0))] + [(0, 1, 700 + k, 700 + k) for k in range(1, 6)])

    def shapes(steps):
        return Counter((s.prefill_tokens, s.decode_seqs, s.kv_tokens_read, s.attention_pairs) for s in steps[RoleName.main_decode])

    steps = _steps_until(app, lambda steps: want <= shapes(steps))
    assert want <= shapes(steps), shapes(steps)
    assert all(0 < s.step_ms < 10_000 for s in steps[RoleName.main_decode])
    assert not steps[RoleName.prefill] and not steps[RoleName.relay_decode]
    # start times are on this host's monotonic clock, which every process shares (an idle engine may report
    # an earlier test's last step only now: the request's own prefill step places the clock), and name their replica
    timed = sorted(steps[RoleName.main_decode], key=lambda s: s.start_s)
    prefill = next(s for s in timed if s.prefill_tokens == 700)
    assert sent < prefill.start_s < done, (sent, prefill.start_s, done)
    assert all(s.engine for s in timed) and {s.engine for s in timed} <= set(Faults(app.name).replicas(DEPLOYMENT_NAMES[RoleName.main_decode]))
    ours = [s for s in timed if s.engine == prefill.engine and s.start_s >= prefill.start_s]
    assert len(ours) >= 6  # the request's steps, one engine's: they follow each other
    assert all(a.start_s + a.step_ms / 1000 <= b.start_s + 1e-6 for a, b in zip(ours, ours[1:]))

    completion(app, fresh(900), 4, mode="pdd")
    steps = _steps_until(app, lambda steps: any(s.prefill_tokens == 900 for s in steps[RoleName.prefill]))
    # P's one step ends its request: it is timed at once, not when P next works
    assert [(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read) for s in steps[RoleName.prefill]] == [(900, 0, 900)]

"""The OpenAI-compatible API in colocated mode, through the official openai client."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from app.engine.devmodel import ensure_devmodel
from tests.conftest import local_args
from tests.integration.conftest import deploy_app, list_schema

KEY = "sk-test-key"
OPERATOR = "sk-test-operator"
MODEL = "pdd-dev"


@pytest.fixture(scope="module")
def app(serve_instance, tmp_path_factory):
    args = local_args()
    args["mode"] = "colocated"
    del args["roles"]["prefill"], args["roles"]["relay_decode"]
    args["server"] = {"api_keys": [KEY], "operator_api_keys": [OPERATOR], "max_output_tokens": 512, "max_concurrent_per_key": 64}
    args["model"]["max_model_len"] = 2048
    # chat-ops answers by rules here (no LLM): whatever the fuzzer files stays in this test's folder
    state = tmp_path_factory.mktemp("api-agents")
    args["agents"] = {
        "prometheus_url": "http://127.0.0.1:9",
        "audit_db": str(state / "audit.sqlite"),
        "actions_dir": str(state / "actions"),
        "chat_db": str(state / "chat.sqlite"),
    }
    deployed = deploy_app(serve_instance, "api", args)
    yield deployed
    deployed.delete()


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.v1, api_key=KEY, max_retries=0)


def chat(client, content="Summarize the log file.", **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_and_retrieves_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/other-model")  # sent as org%2Fother-model: a name may hold a slash
    assert info.value.body["code"] == "model_not_found" and "org/other-model" in info.value.body["message"]


def test_chat_non_streaming(client):
    r = chat(client)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.id.startswith("chatcmpl-")


def test_chat_streaming_matches_non_streaming_and_reports_usage(client):
    whole = chat(client, "list every error with its time").choices[0].message.content
    chunks = list(chat(client, "list every error with its time", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_usage_sends_none(client):
    chunks = list(chat(client, stream=True))
    assert all(c.usage is None for c in chunks)


def test_completions_streaming_and_not(client):
    r = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=16, temperature=0)
    s = list(client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=16, temperature=0, stream=True))
    assert r.choices[0].text and "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    assert r.usage.completion_tokens == 16


def test_completions_accept_token_ids(client):
    by_text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[465, 480], max_tokens=8, temperature=0)
    assert ids.usage.prompt_tokens == 2 and ids.choices[0].text
    assert by_text.choices[0].text


def test_greedy_is_deterministic_across_calls(client):
    outs = {chat(client, "one two three", max_tokens=40).choices[0].message.content for _ in range(3)}
    assert len(outs) == 1


def test_seed_makes_sampling_reproducible(client):
    a = chat(client, "seeded", temperature=1.0, seed=7, max_tokens=30).choices[0].message.content
    b = chat(client, "seeded", temperature=1.0, seed=7, max_tokens=30).choices[0].message.content
    c = chat(client, "seeded", temperature=1.0, seed=8, max_tokens=30).choices[0].message.content
    assert a == b
    assert a != c


def test_top_p_tiny_is_greedy(client):
    greedy = chat(client, "top p", max_tokens=20).choices[0].message.content
    nucleus = chat(client, "top p", temperature=1.0, top_p=1e-6, max_tokens=20, seed=3).choices[0].message.content
    assert nucleus == greedy


def test_stop_string_truncates(client):
    full = chat(client, "stop here", max_tokens=40).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]
    r = chat(client, "stop here", max_tokens=40, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.usage.completion_tokens < 40
    s = list(chat(client, "stop here", max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content


def test_journey_of_a_request(app, client):
    r = chat(client, max_tokens=5)
    j = httpx.get(f"{app.base_url}/pdd/requests/{r.id}", headers={"authorization": f"Bearer {KEY}"}).json()
    assert httpx.get(f"{app.base_url}/pdd/requests/{r.id}").status_code == 401
    assert j["pipeline"] == "colocated" and j["completion_tokens"] == 5
    assert j["replicas"]["main_decode"] and j["ttft_ms"] > 0
    missing = httpx.get(f"{app.base_url}/pdd/requests/nope", headers={"authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"


def test_an_inference_key_reads_its_own_journeys_and_nothing_operational(app, client):
    mine = chat(client, max_tokens=3)
    theirs = chat(openai.OpenAI(base_url=app.v1, api_key=OPERATOR, max_retries=0), max_tokens=3)
    as_key, as_operator = ({"authorization": f"Bearer {k}"} for k in (KEY, OPERATOR))
    assert httpx.get(f"{app.base_url}/pdd/requests/{mine.id}", headers=as_key).status_code == 200
    _assert_error(httpx.get(f"{app.base_url}/pdd/requests/{theirs.id}", headers=as_key), 404, param="request_id")
    listed = {j["request_id"] for j in httpx.get(f"{app.base_url}/pdd/requests", params={"limit": 100}, headers=as_key).json()["requests"]}
    assert mine.id in listed and theirs.id not in listed
    _assert_error(httpx.get(f"{app.base_url}/pdd/state", headers=as_key), 403, code="insufficient_scope")
    assert all(httpx.get(f"{app.base_url}/pdd/requests/{r.id}", headers=as_operator).status_code == 200 for r in (mine, theirs))
    assert httpx.get(f"{app.base_url}/pdd/state", headers=as_operator).status_code == 200


ABANDONED_MAX_TOKENS = 500  # no other test asks for this many: it marks the abandoned requests' journeys


def test_a_client_that_leaves_stops_its_request(app, client):
    """Through Serve's HAProxy, as users reach it. With kernel splicing on, about a third of
    abandoned short non-streamed requests decoded to their end for nobody (app/ops/haproxy.py)."""
    body = {"model": MODEL, "prompt": "Count the sheep.", "max_tokens": ABANDONED_MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    for _ in range(8):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{app.v1}/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=0.5)
    stream = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        journeys = httpx.get(f"{app.base_url}/pdd/requests", params={"limit": 50}, headers={"authorization": f"Bearer {KEY}"}).json()["requests"]
        # (a request left before it reached the conductor has no journey, and no engine work either)
        abandoned = [j for j in journeys if j["max_tokens"] == ABANDONED_MAX_TOKENS]
        if abandoned and all(j["outcome"] for j in abandoned) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert abandoned
    assert [(j["outcome"], j["completion_tokens"] < ABANDONED_MAX_TOKENS) for j in abandoned] == [("cancelled", True)] * len(abandoned)


# ---- errors ------------------------------------------------------------------


def _post(app, path, body, key=KEY, raw=None):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["content-type"] = "application/json"
        return httpx.post(f"{app.base_url}{path}", content=raw, headers=headers, timeout=60)
    return httpx.post(f"{app.base_url}{path}", json=body, headers=headers, timeout=60)


def _assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_missing_and_wrong_key_are_401(app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    _assert_error(_post(app, "/v1/chat/completions", body, key=None), 401, code="invalid_api_key")
    _assert_error(_post(app, "/v1/chat/completions", body, key="sk-wrong"), 401, code="invalid_api_key")
    assert httpx.get(f"{app.base_url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=app.v1, api_key="sk-wrong", max_retries=0).models.list()


def test_readiness_needs_no_key_and_names_each_roles_live_engines(app):
    """What a load balancer probes: /health only says the ingress answers."""
    ready = httpx.get(f"{app.base_url}/ready", timeout=30)
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "missing": [], "roles": {"main_decode": {"live": 1, "configured": 1}}}
    assert httpx.get(f"{app.base_url}/health", timeout=30).json() == {"status": "ok"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),  # more choices than the key may have in flight
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"frobnicate": True}, "frobnicate"),
        ({"metadata": {"team": 7}}, "metadata.team"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"pdd_mode": "teleport"}, "pdd_mode"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"seven": 5}}, "logit_bias.seven"),
        ({"logit_bias": {"7": 101}}, "logit_bias.7"),
        ({"logit_bias": {"-7": 1}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {str(t): -1 for t in range(301)}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ],
)
def test_bad_parameters_are_400(app, body, param):
    full = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    _assert_error(_post(app, "/v1/chat/completions", full), 400, param=param)


def test_penalties_push_the_answer_off_repeated_tokens(client):
    plain = chat(client, "repeat", max_tokens=60).choices[0].message.content
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = chat(client, "repeat", max_tokens=60, **penalty).choices[0].message.content
        assert penalised != plain
        assert len(set(penalised.split())) > len(set(plain.split()))


def test_logit_bias_bans_and_forces_tokens(client):
    kw = {"model": MODEL, "prompt": "list the errors", "max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}}
    plain = client.completions.create(**kw).choices[0].token_ids
    banned = plain[0]
    without = client.completions.create(**kw, logit_bias={str(banned): -100}).choices[0].token_ids
    assert without[0] != banned and banned not in without
    forced = 400 if banned != 400 else 401  # the dev model's vocabulary has 500 tokens
    assert client.completions.create(**kw, logit_bias={str(forced): 100}).choices[0].token_ids == [forced] * 12


def test_logprobs_come_with_each_token_streamed_or_not(client):
    kw = {"model": MODEL, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}  # EOS would show as "</s>"
    messages = [{"role": "user", "content": "Summarize the log file."}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **kw).choices[0]
    content = whole.logprobs.content
    special = set(AutoTokenizer.from_pretrained(str(ensure_devmodel())).all_special_tokens)

    def text_of(tokens):  # the answer's text skips special tokens
        return "".join(t for t in tokens if t not in special)

    assert len(content) == 16 and text_of(c.token for c in content) == whole.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)  # greedy: the best
    chunks = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, stream=True, **kw)
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert client.chat.completions.create(messages=messages, **kw).choices[0].logprobs is None

    plain = client.completions.create(prompt="list the errors", logprobs=2, **kw).choices[0]
    assert len(plain.logprobs.tokens) == len(plain.logprobs.token_logprobs) == len(plain.logprobs.top_logprobs) == 16
    assert plain.logprobs.text_offset == [len("".join(plain.logprobs.tokens[:i])) for i in range(16)]
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(plain.logprobs.top_logprobs, plain.logprobs.token_logprobs))
    stopped = client.completions.create(prompt="list the errors", logprobs=0, stop=[plain.text[6:9]], **kw).choices[0]
    assert text_of(stopped.logprobs.tokens).startswith(stopped.text) and len(stopped.logprobs.tokens) < 16


def test_an_echoed_prompt_comes_before_the_completion_streamed_or_not(client):
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(prompt="list the errors", **kw).choices[0]
    echoed = client.completions.create(prompt="list the errors", echo=True, **kw)
    assert echoed.choices[0].text == "list the errors" + plain.text
    assert echoed.usage.completion_tokens == 12
    chunks = [c for c in client.completions.create(prompt="list the errors", echo=True, stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].text == "list the errors"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    prompt_only = client.completions.create(prompt=["list the errors", "count them"], echo=True, **{**kw, "max_tokens": 0})
    assert [c.text for c in prompt_only.choices] == ["list the errors", "count them"]
    assert {c.finish_reason for c in prompt_only.choices} == {"length"} and prompt_only.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt="list the errors", **{**kw, "max_tokens": 0})
    assert info.value.body["param"] == "max_tokens"


def test_an_echoed_prompt_is_scored_as_the_same_tokens_are_when_generated(client):
    """lm-eval-harness's loglikelihood request (token ids, echo, logprobs, max_tokens 0 or 1):
    a greedy answer, scored as part of a prompt, gets the log probabilities it was generated with."""
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_devmodel()))
    prompt = tokenizer("Summarize the log file and list the errors.")["input_ids"]
    kw = {"model": MODEL, "temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    generated = client.completions.create(prompt=prompt, max_tokens=10, logprobs=1, **kw).choices[0]
    context = prompt + generated.token_ids
    for max_tokens in (0, 1):
        scored = client.completions.create(prompt=[context, prompt], max_tokens=max_tokens, logprobs=1, echo=True, **kw)
        whole, head = scored.choices[0].logprobs, scored.choices[1].logprobs
        assert len(whole.tokens) == len(context) + max_tokens and whole.token_logprobs[0] is None and whole.top_logprobs[0] is None
        assert whole.token_logprobs[len(prompt) : len(context)] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-3)
        # greedy tokens are their places' best (lm-eval's is_greedy)
        assert all(lp == max(top.values()) for lp, top in zip(whole.token_logprobs[len(prompt) : len(context)], whole.top_logprobs[len(prompt) :]))
        assert head.token_logprobs[: len(prompt)] == pytest.approx(whole.token_logprobs[: len(prompt)], abs=1e-3)
        assert scored.choices[0].text.startswith(tokenizer.decode(context, skip_special_tokens=True))
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(prompt=context, max_tokens=0, logprobs=1, echo=True, stream=True, **kw)
        if c.choices and c.choices[0].logprobs
    ]
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(whole.token_logprobs[: len(context)], abs=1e-3)


def test_known_openai_fields_asking_for_nothing_are_accepted_and_others_refused_by_name(app):
    # what SDKs send by default (langchain's completion LLM sends logprobs: null)
    chat_neutral = {
        "logprobs": False,
        "top_logprobs": None,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "logit_bias": {},
        "functions": None,
        # what tagging and cache-hinting clients add
        "store": False,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "modalities": ["text"],
        "prompt_cache_key": "session-1",
        "safety_identifier": "user-1",
        "reasoning_effort": None,
    }
    ok = _post(app, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **chat_neutral})
    assert ok.status_code == 200, ok.text
    ok = _post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": None, "best_of": 1, "echo": False, "suffix": None})
    assert ok.status_code == 200, ok.text
    for path, field, value, reason in (
        ("/v1/chat/completions", "functions", [{"name": "f"}], "not supported (deprecated by OpenAI; send tools and tool_choice)"),
        ("/v1/chat/completions", "store", True, "not supported (completions are not stored); leave it out or send null or false"),
        ("/v1/chat/completions", "reasoning_effort", "high", "not supported (not a reasoning model); leave it out or send null"),
        ("/v1/chat/completions", "service_tier", "priority", 'not supported (one service tier); leave it out or send null or "auto" or "default"'),
        ("/v1/completions", "suffix", "}", "not supported (no insertion)"),
        ("/v1/completions", "best_of", True, "not supported (choices are not ranked); leave it out or send null or 1"),
    ):
        body = {"model": MODEL, field: value, **({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
        err = _assert_error(_post(app, path, body), 400, param=field, code="unsupported_parameter")
        assert err["message"].startswith(f"{field}: {reason}"), err["message"]


LIST = list_schema(3)


def test_structured_outputs_satisfy_their_constraint_streamed_and_not(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "items", "schema": LIST, "strict": True}}
    whole = chat(client, response_format=fmt, max_tokens=300)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), LIST)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, response_format=fmt, max_tokens=300, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content
    assert isinstance(json.loads(chat(client, response_format={"type": "json_object"}, max_tokens=300).choices[0].message.content), dict)
    regex = client.completions.create(
        model=MODEL, prompt="id:", max_tokens=40, temperature=0, extra_body={"structured_outputs": {"regex": "([a-z]{2}-[0-9] ){3}"}}
    )
    assert re.fullmatch("([a-z]{2}-[0-9] ){3}", regex.choices[0].text), regex.choices[0].text
    picked = chat(client, extra_body={"structured_outputs": {"choice": ["route to md", "relay"]}})
    assert picked.choices[0].message.content in ("route to md", "relay")
    free = chat(client, max_tokens=60).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):  # the same prompt unconstrained: the constraint did the work
        json.loads(free)


def test_a_constraint_the_engines_cannot_build_is_a_400_naming_its_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={"structured_outputs": {"regex": "a(b"}})
    assert info.value.body["param"] == "structured_outputs.regex" and "parenthesis" in info.value.body["message"]
    assert chat(client).choices[0].message.content  # and the engines serve on


LOGS = {
    "type": "object",
    "properties": {"lines": {"type": "integer", "minimum": 1, "maximum": 500}, "level": {"enum": ["error", "warning"]}},
    "required": ["lines", "level"],
}
TOOLS = [
    {"type": "function", "function": {"name": "read_logs", "description": "Read the last lines of the log", "parameters": LOGS}},
    {"type": "function", "function": {"name": "restart", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


def test_tool_calls_are_valid_calls_streamed_and_not_and_the_conversation_goes_on(client):
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    whole = chat(client, tools=TOOLS, tool_choice="required", max_tokens=200)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.tool_calls
    for call in whole.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    streamed: dict[int, dict] = {}
    for chunk in chat(client, tools=TOOLS, tool_choice="required", max_tokens=200, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            got = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            got["name"] += delta.function.name or ""
            got["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls
    ]
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "read_logs"}}, max_tokens=200)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "read_logs" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), LOGS)
    history = [
        {"role": "user", "content": "Summarize the log file."},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:01 error disk full"},
    ]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None
    without_call = client.chat.completions.create(model=MODEL, messages=[history[0], history[2]], tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert after.usage.prompt_tokens > without_call.usage.prompt_tokens  # the call is in the prompt
    auto = chat(client, tools=TOOLS, max_tokens=40)  # OpenAI's default with tools: free text, vLLM's hermes parser reads it
    said = auto.choices[0].message
    assert said.content or said.tool_calls
    if said.tool_calls is None:  # the random model wrote no call: the text is the answer, as the parser found it
        assert (
            auto.choices[0].finish_reason == "length"
            and said.content == chat(client, max_tokens=40, tools=TOOLS, tool_choice="none").choices[0].message.content
        )


@pytest.mark.parametrize(("backend", "endpoint"), [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllms_benchmark_client_runs_against_the_app_with_no_failed_request(app, monkeypatch, backend, endpoint):
    """vllm.benchmarks.serve, as people run it against any vLLM-style server: its own request
    fields (repetition_penalty, ignore_eos, ...) on a random dataset."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = f"--backend {backend} --base-url {app.base_url} --endpoint {endpoint} --model {MODEL} --tokenizer {ensure_devmodel()} "
    args += "--dataset-name random --random-input-len 64 --random-output-len 16 --num-prompts 12 --max-concurrency 6 --num-warmups 0 --disable-tqdm"
    result = main(parser.parse_args(args.split()))
    assert (result["completed"], result["failed"]) == (12, 0), result["errors"]
    assert result["total_output_tokens"] == 12 * 16  # ignore_eos and max_tokens, as the client asked


def test_langchain_openai_clients_are_served(app):
    from langchain_openai import ChatOpenAI, OpenAI

    kw = {"base_url": app.v1, "api_key": KEY, "model": MODEL, "max_tokens": 6, "temperature": 0, "max_retries": 0}
    reply = ChatOpenAI(**kw).invoke("Summarize the log file.")
    assert reply.usage_metadata["output_tokens"] == 6 and reply.content
    streamed = list(ChatOpenAI(**kw, stream_usage=True).stream("Summarize the log file."))
    assert "".join(c.content for c in streamed) == reply.content
    assert OpenAI(**kw).invoke("Summarize the log file.")


def test_n_choices_answer_as_single_requests_with_seed_plus_choice(client):
    single = chat(client, "list every error with its time")
    greedy = chat(client, "list every error with its time", n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [single.choices[0].message.content] * 3
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert greedy.usage.completion_tokens == 3 * 24
    sampled = chat(client, "seeded", temperature=1.0, seed=7, n=2, max_tokens=30)
    alone = [chat(client, "seeded", temperature=1.0, seed=7 + j, max_tokens=30).choices[0].message.content for j in range(2)]
    assert [c.message.content for c in sampled.choices] == alone and alone[0] != alone[1]


def test_streamed_choices_interleave_each_with_its_index(client):
    whole = chat(client, "list every error with its time").choices[0].message.content
    chunks = list(chat(client, "list every error with its time", n=2, stream=True, stream_options={"include_usage": True}))
    texts, finals, roles = {0: "", 1: ""}, {}, set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles |= {choice.index} if choice.delta.role == "assistant" else set()
            if choice.finish_reason:
                finals[choice.index] = choice.finish_reason
    assert texts == {0: whole, 1: whole} and finals == {0: "length", 1: "length"} and roles == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48


def test_a_batch_of_prompts_gets_n_choices_per_prompt_each_with_its_journey(app, client):
    prompts = ["the quick brown fox", "list the errors"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    journeys = [httpx.get(f"{app.base_url}/pdd/requests/{batch.id}-{i}", headers={"authorization": f"Bearer {KEY}"}, timeout=60) for i in range(4)]
    assert [j.status_code for j in journeys] == [200] * 4
    streamed = client.completions.create(model=MODEL, prompt=[[465, 480], [11, 12, 13]], max_tokens=4, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text for p in ([465, 480], [11, 12, 13])]
    assert texts == {0: singles[0], 1: singles[1]}


def test_a_batch_names_the_prompt_that_does_not_fit(app):
    err = _assert_error(_post(app, "/v1/completions", {"model": MODEL, "prompt": [[11], [10**7]]}), 400, param="prompt.1")
    assert "outside the vocabulary" in err["message"]
    err = _assert_error(
        _post(app, "/v1/completions", {"model": MODEL, "prompt": ["hi", "x " * 3000], "max_tokens": 2}), 400, param="prompt.1", code="context_length_exceeded"
    )
    assert "prompt.1 has" in err["message"]
    err = _assert_error(_post(app, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 33, "n": 2}), 400, param="n")
    assert err["message"] == "n: 33 prompt(s) x n=2 asks for 66 choices; at most 64 (server.max_concurrent_per_key)"


def test_malformed_json_is_400(app):
    _assert_error(_post(app, "/v1/chat/completions", None, raw=b'{"model": "pdd-dev", "messages": ['), 400)
    _assert_error(_post(app, "/v1/chat/completions", None, raw=b"\xff\xfe not utf-8"), 400)
    _assert_error(_post(app, "/v1/completions", None, raw=b"[]"), 400)


def test_json_sent_without_its_content_type_is_400_naming_the_header(app):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    resp = httpx.post(
        f"{app.base_url}/v1/chat/completions",
        content=body,
        timeout=60,
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/x-www-form-urlencoded"},
    )
    err = _assert_error(resp, 400)
    assert "Content-Type: application/json" in err["message"] and "x-www-form-urlencoded" in err["message"], err


def test_query_parameters_are_named_as_sent(app):
    resp = httpx.get(f"{app.base_url}/pdd/requests", params={"limit": "many"}, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    _assert_error(resp, 400, param="limit")


def test_prompt_too_long_is_400_context_length(app):
    body = {"model": MODEL, "prompt": list(range(10, 300)) * 8, "max_tokens": 4}
    _assert_error(_post(app, "/v1/completions", body), 400, param="prompt", code="context_length_exceeded")


def test_prompt_plus_max_tokens_over_context_is_400(app):
    body = {"model": MODEL, "prompt": list(range(10, 300)) * 6, "max_tokens": 400}
    _assert_error(_post(app, "/v1/completions", body), 400, param="max_tokens", code="context_length_exceeded")


def test_token_id_outside_vocabulary_is_400(app):
    _assert_error(_post(app, "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}), 400, param="prompt")


def test_unknown_route_is_404_json(app):
    resp = httpx.get(f"{app.base_url}/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()


def test_return_token_ids_extension(client):
    kw = {"max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}}
    whole = client.completions.create(model=MODEL, prompt="list the errors", **kw)
    ids = whole.choices[0].token_ids
    assert len(ids) == whole.usage.completion_tokens == 12
    streamed = [
        t for c in client.completions.create(model=MODEL, prompt="list the errors", stream=True, **kw) if c.choices for t in (c.choices[0].token_ids or [])
    ]
    assert streamed == ids
    # the ids continue the prompt exactly: feeding them back reproduces the rest
    prompt_ids = client.completions.create(model=MODEL, prompt="list the errors", max_tokens=1, temperature=0, extra_body={"return_token_ids": True})
    assert prompt_ids.choices[0].token_ids == ids[:1]
    assert client.completions.create(model=MODEL, prompt="list the errors", max_tokens=12, temperature=0).choices[0].token_ids is None


# ---- the documented schema holds for generated input (schemathesis) ---------------


def test_generated_requests_never_get_a_server_error(app):
    """Every operation, generated inputs: responses match the OpenAPI schema, never 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{app.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/pdd/state", "/pdd/requests/{request_id}"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("n"), int):
                    case.body["n"] = min(case.body["n"], 2)  # few engine requests; bad values stay bad
                for field in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(field), int):
                        case.body[field] = min(case.body[field], 4)  # short generations; bad values stay bad
            if operation.path == "/pdd/chat":  # noqa: B023 - check() runs within its own iteration
                # an SSE stream, which the schema cannot describe: answered by rules (no LLM here), or refused
                response = case.call(headers={"authorization": f"Bearer {OPERATOR}"}, timeout=120)
                assert response.status_code in (200, 400, 401), response.text
                if response.status_code == 200:
                    assert "text/event-stream" in str(response.headers["content-type"])
                    assert response.text.endswith("data: [DONE]\n\n") and '"type": "figures"' in response.text
                return
            case.call_and_validate(headers={"authorization": f"Bearer {OPERATOR}"}, timeout=120)

        check()

"""app/api/openai_requests.py and openai_responses.py: how log probabilities are asked for and rendered (OpenAI's shapes)."""

import json

import pytest

from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.api.openai_responses import ChatRenderer, Choice, CompletionRenderer, Echo, Usage
from app.engine.token_channel import TokenLogprob

TEXT = {7: "He", 8: "llo", 9: " wor", 10: "ld", 11: "é"}
LOGPROBS = [TokenLogprob(-0.1, [(7, -0.1), (9, -2.5)]), TokenLogprob(-1.5, [(9, -0.7), (8, -1.5)])]
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


def chat_body(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_what_each_endpoint_asks_the_engines_for():
    assert chat_body().requested_logprobs() is None
    assert chat_body(logprobs=False, top_logprobs=0).requested_logprobs() is None
    assert chat_body(logprobs=True).requested_logprobs() == 0
    assert chat_body(logprobs=True, top_logprobs=5).requested_logprobs() == 5
    with pytest.raises(APIError) as info:
        chat_body(top_logprobs=3).requested_logprobs()
    assert info.value.param == "top_logprobs"
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi", "logprobs": 2}).requested_logprobs() == 2
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1, "logprobs": True}):
        with pytest.raises(ValueError, match="top_logprobs"):
            chat_body(**bad)
    with pytest.raises(ValueError, match="logprobs"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "logprobs": 6})


def completion_body(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def test_an_echoed_prompt_is_scored_only_when_logprobs_are_asked_and_max_tokens_0_needs_echo():
    assert completion_body(echo=True).requested_prompt_logprobs() is None
    assert completion_body(logprobs=0).requested_prompt_logprobs() is None
    assert completion_body(echo=True, logprobs=3).requested_prompt_logprobs() == 3
    assert completion_body(echo=True, max_tokens=0).requested_max_tokens() == 0
    with pytest.raises(APIError) as info:
        completion_body(max_tokens=0).requested_max_tokens()
    assert info.value.param == "max_tokens" and "echo" in info.value.message
    with pytest.raises(ValueError, match="max_tokens"):
        completion_body(echo=True, max_tokens=-1)


# "Hello" echoed as [7, 8]: 8's log probability given 7; 7 comes first and has none
PROMPT_LOGPROBS = [TokenLogprob(-2.0, [(9, -0.5)])]
ECHO = Echo("Hello", [7, 8], generates=True)
WORLD = [TokenLogprob(-0.1, [(9, -0.1)]), TokenLogprob(-0.4, [(10, -0.4)])]


def test_an_echoed_prompt_comes_before_the_completion_with_a_null_first_logprob():
    render = CompletionRenderer("cmpl-1", "m", TEXT.__getitem__)
    choice = render.whole([Choice(" world", "length", [9, 10], WORLD, ECHO, PROMPT_LOGPROBS)], USAGE, want_ids=True).choices[0]
    assert choice.text == "Hello world"
    assert choice.token_ids == [9, 10]  # the generated ones, as without echo
    lp = choice.logprobs
    assert lp.tokens == ["He", "llo", " wor", "ld"]
    assert lp.token_logprobs == [None, -2.0, -0.1, -0.4]
    assert lp.top_logprobs == [None, {"llo": -2.0, " wor": -0.5}, {" wor": -0.1}, {"ld": -0.4}]
    assert lp.text_offset == [0, 2, 5, 9]  # the completion's tokens where they start in the text
    plain = render.whole([Choice(" world", "length", [9, 10], None, ECHO)], USAGE, want_ids=False).choices[0]
    assert (plain.text, plain.logprobs) == ("Hello world", None)


def test_a_streamed_echo_is_its_own_chunk_and_the_completions_offsets_follow_it():
    render = CompletionRenderer("cmpl-1", "m", TEXT.__getitem__)
    echo = json.loads(render.echo(0, ECHO, PROMPT_LOGPROBS))["choices"][0]
    assert (echo["text"], echo["finish_reason"]) == ("Hello", None)
    assert echo["logprobs"]["token_logprobs"] == [None, -2.0] and echo["logprobs"]["top_logprobs"][0] is None
    after = json.loads(render.delta(0, " wor", None, [9], WORLD[:1], want_ids=False))["choices"][0]["logprobs"]
    assert after["text_offset"] == [5]
    assert json.loads(render.echo(1, Echo("Hello", [7, 8], generates=False), None))["choices"][0]["logprobs"] is None


def test_chat_logprobs_name_each_token_and_its_alternatives():
    render = ChatRenderer("chatcmpl-1", "m", TEXT.__getitem__)
    body = render.whole([Choice("Hello", "length", [7, 8], LOGPROBS)], USAGE, want_ids=False)
    content = body.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("He", -0.1, [72, 101]), ("llo", -1.5, [108, 108, 111])]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [(" wor", -0.7), ("llo", -1.5)]
    assert body.choices[0].token_ids is None
    assert render.whole([Choice("Hello", "length", [7, 8])], USAGE, want_ids=True).choices[0].logprobs is None
    chunk = json.loads(render.delta(0, "é", None, [11], [TokenLogprob(-0.2, [])], want_ids=False))
    assert chunk["choices"][0]["logprobs"]["content"] == [{"token": "é", "logprob": -0.2, "bytes": [195, 169], "top_logprobs": []}]


def test_completion_logprobs_offsets_run_on_across_a_streams_chunks():
    render = CompletionRenderer("cmpl-1", "m", TEXT.__getitem__)
    whole = render.whole([Choice("Hello", "length", [7, 8], LOGPROBS)], USAGE, want_ids=False).choices[0].logprobs
    assert (whole.tokens, whole.token_logprobs, whole.text_offset) == (["He", "llo"], [-0.1, -1.5], [0, 2])
    assert whole.top_logprobs == [{"He": -0.1, " wor": -2.5}, {"llo": -1.5, " wor": -0.7}]  # the token itself, then the best
    chunks = [
        json.loads(render.delta(0, text, None, ids, lps, want_ids=False))["choices"][0]["logprobs"]
        for text, ids, lps in (("Hello", [7, 8], LOGPROBS), (" world", [9, 10], LOGPROBS))
    ]
    assert [c["text_offset"] for c in chunks] == [[0, 2], [5, 9]]
    other_choice = json.loads(render.delta(1, "He", None, [7], LOGPROBS[:1], want_ids=False))["choices"][0]["logprobs"]
    assert other_choice["text_offset"] == [0]

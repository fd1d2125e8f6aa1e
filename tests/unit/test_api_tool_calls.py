"""Tool calls at the API (app/api/tool_calls.py, the chat renderer): tool_choice read into the
engines' constraint, the answer read back into OpenAI's tool calls, whole and streamed."""

import json

import jsonschema
import pytest

from app.api.openai_requests import APIError, ChatCompletionRequest
from app.api.openai_responses import ChatRenderer, Choice, Usage
from app.api.tool_calls import ToolCalling

LOGS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "get_logs", "parameters": LOGS}}, {"type": "function", "function": {"name": "restart"}}]


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_required_asks_the_engines_for_a_list_of_calls_to_the_given_tools():
    tools, (constraint, field) = ToolCalling.of(chat(tools=TOOLS, tool_choice="required"))
    schema = json.loads(constraint.json)
    jsonschema.validate([{"name": "get_logs", "parameters": {"n": 3}}, {"name": "restart", "parameters": {}}], schema)
    for wrong in ([], [{"name": "delete_all", "parameters": {}}], [{"name": "get_logs", "parameters": {"n": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    one = json.loads(ToolCalling.of(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))[1][0].json)
    assert one["maxItems"] == 1
    content, calls = tools.calls('[{"name": "get_logs", "parameters": {"n": 3}}]')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_logs", {"n": 3})]
    assert content is None and tools.calls('[{"name": "get_logs", "param') == ('[{"name": "get_logs", "param', None)  # cut short: no calls made up
    assert tools.finish_reason("stop", True) == "tool_calls" and tools.finish_reason("length", False) == "length"


def test_a_named_function_asks_for_its_arguments_and_none_for_text():
    tools, (constraint, field) = ToolCalling.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_logs"}}))
    assert json.loads(constraint.json) == LOGS and field == "tools.0.function.parameters"
    assert tools.calls('{"n": 3}')[1][0].function.name == "get_logs" and tools.finish_reason("stop", True) == "stop"
    assert json.loads(ToolCalling.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "restart"}}))[1][0].json)["type"] == "object"
    assert ToolCalling.of(chat(tools=TOOLS, tool_choice="none")) == (None, None)
    assert ToolCalling.of(chat()) == (None, None)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": TOOLS}, "auto needs a tool-call parser"),  # auto: the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "auto needs a tool-call parser"),
        ({"tool_choice": "required"}, "no tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope' is not in tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "leave out response_format"),
    ],
)
def test_tool_choices_that_cannot_be_served_are_400s_naming_tool_choice(fields, words):
    with pytest.raises(APIError) as err:
        ToolCalling.of(chat(**fields))
    assert err.value.status == 400 and err.value.param == "tool_choice" and words in err.value.message


def _render(tools, pieces):
    render = ChatRenderer("chatcmpl-1", "m", str, tools)
    chunks = [json.loads(render.opening(0))]
    for i, text in enumerate(pieces):
        chunks.append(json.loads(render.delta(0, text, "stop" if i == len(pieces) - 1 else None, [], None, False)))
    return [c["choices"][0] for c in chunks]


def test_a_named_call_streams_its_arguments_as_they_come():
    tools, _ = ToolCalling.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_logs"}}))
    choices = _render(tools, ['{"n"', ": 3", "}"])
    calls = [c["delta"]["tool_calls"][0] for c in choices[1:]]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_logs"
    assert all(c["id"] is None and c["function"]["name"] is None for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"n": 3}'
    assert choices[-1]["finish_reason"] == "stop"


def test_a_required_answer_streams_as_its_calls_once_whole_or_as_text_when_cut_short():
    tools, _ = ToolCalling.of(chat(tools=TOOLS, tool_choice="required"))
    choices = _render(tools, ['[{"name": "restart", ', '"parameters": {}}]'])
    assert choices[1]["delta"]["tool_calls"] is None and choices[1]["finish_reason"] is None
    (call,) = choices[2]["delta"]["tool_calls"]
    assert (call["index"], call["function"]["name"], call["function"]["arguments"]) == (0, "restart", "{}")
    assert choices[2]["finish_reason"] == "tool_calls"
    render = ChatRenderer("chatcmpl-1", "m", str, tools)
    cut = render.whole([Choice('[{"name": "rest', "length", [])], Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2), False).choices[0]
    assert (cut.message.content, cut.message.tool_calls, cut.finish_reason) == ('[{"name": "rest', None, "length")


@pytest.fixture(scope="module")
def hermes():
    from transformers import AutoTokenizer

    from app.api.tool_calls import parser_factory
    from app.engine.devmodel import ensure_devmodel

    return parser_factory("hermes", AutoTokenizer.from_pretrained(str(ensure_devmodel())))


SAID = 'Reading them. <tool_call>{"name": "get_logs", "arguments": {"n": 3}}</tool_call>'


def test_auto_answers_in_text_and_vllms_parser_finds_the_calls_whole_and_streamed(hermes):
    tools, constraint = ToolCalling.of(chat(tools=TOOLS), hermes)  # auto: the default with tools
    assert constraint is None  # free text: the parser, not a grammar, finds the calls
    content, calls = tools.calls(SAID)
    assert content == "Reading them. " and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_logs", {"n": 3})]
    assert tools.calls("no call here") == ("no call here", None)
    pieces = ["Reading them. ", "<tool_call>", '{"name": "get_logs", ', '"arguments": {"n": 3}}', "</tool_call>"]
    choices = _render(tools, pieces)
    assert "".join(c["delta"]["content"] or "" for c in choices[1:]) == "Reading them. "
    deltas = [d for c in choices[1:] for d in c["delta"]["tool_calls"] or []]
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "get_logs"
    assert json.loads("".join(d["function"]["arguments"] or "" for d in deltas)) == {"n": 3}
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_a_parser_vllm_does_not_have_is_refused_naming_the_field():
    from app.api.tool_calls import parser_factory

    with pytest.raises(ValueError, match="model.tool_call_parser: 'nope' is not one of vLLM's .*hermes"):
        parser_factory("nope", None)

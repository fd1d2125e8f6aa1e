"""Structured outputs at the API (app/api/structured.py): response_format and vLLM's
structured_outputs read into one engine constraint, carried to a continuation, and the 400s
that name the field (the grammar backend's own message for a schema, regex or grammar it
cannot build)."""

import asyncio
import json

import pytest
from pydantic import ValidationError

from app.api import structured
from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.api.sampling import sampling_options
from app.engine.token_channel import Constraint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def constraint_of(body):
    return asyncio.run(structured.check(structured.constraint(body.response_format, body.structured_outputs, body.ignore_eos)))


def test_response_format_and_structured_outputs_become_the_engines_constraint():
    assert constraint_of(chat()) is None
    assert constraint_of(chat(response_format={"type": "text"})) is None
    assert constraint_of(chat(response_format={"type": "json_object"})) == Constraint(json_object=True)
    schema = constraint_of(chat(response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}))
    assert json.loads(schema.json) == SCHEMA
    assert json.loads(constraint_of(chat(structured_outputs={"json": json.dumps(SCHEMA)})).json) == SCHEMA  # a schema's text reads as the schema
    assert constraint_of(chat(structured_outputs={"regex": "[a-z]{3}"})) == Constraint(regex="[a-z]{3}")
    assert constraint_of(chat(structured_outputs={"choice": ["yes", "no"]})) == Constraint(choice=["yes", "no"])
    assert constraint_of(chat(structured_outputs={"grammar": 'root ::= "a" | "b"'})) == Constraint(grammar='root ::= "a" | "b"')
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a"]}})
    assert constraint_of(completion) == Constraint(choice=["a"])


def test_the_constraint_goes_to_every_engine_the_request_crosses():
    c = Constraint(regex="[0-9]+")
    s = sampling_options(chat(), max_tokens=20, vocab=512, prompt_logprobs=None, constraint=c)
    later = s.continued(5)
    assert later.constraint == c and later.sampled_before == 5  # the next engine's grammar starts past those 5


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "missing"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json", "nonsense"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
            "nonsense",
        ),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ends"),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "only then"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": {}}}}, "response_format.json_schema", "only then"),
    ],
)
def test_a_constraint_the_engines_could_not_run_is_a_400_naming_its_field(fields, param, words):
    with pytest.raises(APIError) as err:
        constraint_of(chat(**fields))
    assert err.value.status == 400 and err.value.param == param and words in err.value.message
    assert "/project/cpp" not in err.value.message  # the backend's message, without its source location


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"json_object": False}},
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        {"structured_outputs": {"structural_tag": "{}"}},
        {"structured_outputs": {"regex": "a", "backend": "guidance"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_a_malformed_constraint_is_refused_by_the_request_model(fields):
    with pytest.raises(ValidationError):
        chat(**fields)

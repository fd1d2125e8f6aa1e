"""OpenAI-compatible requests and error bodies.

Requests are validated here, so a bad field becomes a 400 naming it, in
OpenAI's error shape, before anything reaches an engine. Unknown fields are
rejected, as OpenAI does ("Unrecognized request argument supplied"). Known
OpenAI fields this server does not serve (tools, best_of, ...) are accepted at
the value that asks for nothing, which SDKs send by default, and refused with
OpenAI's `unsupported_parameter` / `unsupported_value` codes otherwise.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, field_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from app.config import Mode


class APIError(Exception):
    """An error the client caused (or a known server condition), with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class Unsupported:
    """A known OpenAI field this server does not serve: accepted at a value that asks
    for nothing (null, or what SDKs send by default), refused with the reason otherwise.
    Annotated metadata: `tools: Annotated[Any, Unsupported("why", [])] = None`."""

    def __init__(self, why: str, *neutral: Any):
        self.why = why
        self.accepted = (None, *neutral)

    def check(self, given: Any) -> Any:
        # by type too: 0 == False and 1 == True would let a different request through
        if not any(type(given) is type(v) and given == v for v in self.accepted):
            shown = " or ".join("null" if v is None else json.dumps(v) for v in self.accepted)
            raise PydanticCustomError("unsupported_parameter", "not supported ({why}); leave it out or send {shown}", {"why": self.why, "shown": shown})
        return given

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), "description": f"Not supported ({self.why})", "enum": list(self.accepted)}


_LEGACY_FUNCTIONS = "deprecated by OpenAI; send tools and tool_choice"
_TEXT_ONLY = "a text-only model"


_PER_ENGINE = "an engine-wide option of vLLM's xgrammar backend: roles.<role>.engine.extra.structured_outputs_config"


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the answer satisfies")
    strict: bool | None = Field(default=None, description="Accepted; the answer always satisfies the schema")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="With type json_schema, and only then")


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one constraint (app/api/structured.py checks, where a
    bad request's 400 comes after the model's 404, as for every rule a schema cannot state)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema (an object, or its text)")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1, description="An EBNF grammar (xgrammar's dialect)")] | None = None
    json_object: Literal[True] | None = None
    disable_any_whitespace: Annotated[Any, Unsupported(_PER_ENGINE, False)] = None
    whitespace_pattern: Annotated[Any, Unsupported(_PER_ENGINE)] = None
    disable_additional_properties: Annotated[Any, Unsupported("an option of vLLM's guidance backend; engines run xgrammar", False)] = None
    structural_tag: Annotated[Any, Unsupported("structural tags are not served")] = None

    def constraint_fields(self) -> dict[str, Any]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar, "json_object": self.json_object}


ResponseFormatField = Annotated[ResponseFormat | None, Field(description="text, json_object, or json_schema: the answer satisfies the schema on every engine")]
StructuredOutputsField = Annotated[StructuredOutputs | None, Field(description="Extension (vLLM's): a JSON schema, regex, choice or EBNF grammar")]


_PENALTY = Annotated[float, Field(ge=-2, le=2, description="Counts every output token, whichever engine sampled it")]

LogitBias = Annotated[
    # keys as JSON has them (strings), so the published schema says which are valid
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
    Field(
        max_length=300,
        json_schema_extra={"additionalProperties": False},
        description="Token id -> a bias (-100..100) added to its logit on every engine the request crosses; up to 300 tokens, as OpenAI",
    ),
]

StopField = Annotated[str | Annotated[list[str], Field(max_length=4)] | None, Field(description="Up to 4 stop strings")]


class _SamplingFields(_Request):
    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, description="Choices per prompt; each is one engine request (seeds: seed + choice)")] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    seed: Annotated[int, Field(ge=-(2**53), le=2**53, description="Within +-2^53: integers JSON carries exactly")] | None = None
    user: str | None = None
    presence_penalty: _PENALTY | None = None
    frequency_penalty: _PENALTY | None = None
    ignore_eos: bool | None = Field(default=None, description="Extension: keep generating past EOS (benchmarks)")
    return_token_ids: bool | None = Field(default=None, description="Extension (as vLLM's): output token ids in each choice")
    pdd_mode: Mode | None = Field(default=None, description="Extension: serve this request in another mode (benchmarks, tests)")
    logit_bias: LogitBias | None = None
    response_format: ResponseFormatField = None
    structured_outputs: StructuredOutputsField = None
    # vLLM's sampling extensions: each means what it means in vLLM's OpenAI server, on every engine a request crosses
    top_k: Annotated[int, Field(ge=-1, description="Extension (vLLM's): sample among the k most likely tokens (0 or -1: all)")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, description="Extension (vLLM's): drop tokens below this share of the likeliest one's probability")] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, description="Extension (vLLM's): > 1 discourages tokens already in the prompt or output")] | None = None
    min_tokens: Annotated[int, Field(ge=0, description="Extension (vLLM's): no EOS, stop token or stop string before this many output tokens")] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256, description="Extension (vLLM's): token ids that end the output")] | None
    ) = None
    include_stop_str_in_output: bool | None = Field(default=None, description="Extension (vLLM's): keep the stop string or stop token's text in the output")
    add_special_tokens: bool | None = Field(
        default=None, description="Extension (vLLM's): add the tokenizer's special tokens (BOS) to the prompt; default true for completions, false for chat"
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, description="Extension (vLLM's): keep the last k prompt tokens (-1: the context length)")] | None = None
    skip_special_tokens: Annotated[Any, Unsupported("text is rendered without special tokens", True)] = None
    spaces_between_special_tokens: Annotated[Any, Unsupported("text is rendered without special tokens", True)] = None
    priority: Annotated[Any, Unsupported("engines schedule first come, first served", 0)] = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="The arguments' JSON schema (none: an empty object)")
    strict: bool | None = Field(default=None, description="Accepted; arguments always satisfy the schema")


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a name carries no meaning here

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="An assistant turn's calls, rendered into the prompt by the chat template")
    tool_call_id: str | None = Field(default=None, description="A tool turn: the call it answers")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # else the union reports its first branch: "Input should be a valid string"
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise PydanticCustomError("unsupported_value", "only text parts are supported (a text-only model), got a {kind} part", {"kind": repr(kind)})
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = Field(default=None, description="Each output token's log probability (the model's, before sampling's penalties and biases)")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(default=None, description="With logprobs: the most likely tokens at each place")
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="none, required or a named function (auto, the default with tools, needs a tool-call parser: not served yet)"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="With tool_choice required: false allows one call")
    functions: Annotated[Any, Unsupported(_LEGACY_FUNCTIONS, [])] = None
    function_call: Annotated[Any, Unsupported(_LEGACY_FUNCTIONS, "none")] = None
    modalities: Annotated[Any, Unsupported(_TEXT_ONLY, ["text"])] = None
    audio: Annotated[Any, Unsupported(_TEXT_ONLY)] = None
    web_search_options: Annotated[Any, Unsupported("no web search")] = None
    prediction: Annotated[Any, Unsupported("no predicted outputs")] = None
    moderation: Annotated[Any, Unsupported("no moderation")] = None
    reasoning_effort: Annotated[Any, Unsupported("not a reasoning model")] = None
    verbosity: Annotated[Any, Unsupported("not a reasoning model")] = None
    store: Annotated[Any, Unsupported("completions are not stored", False)] = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = Field(default=None, description="Accepted for clients that tag requests; not stored")
    service_tier: Annotated[Any, Unsupported("one service tier", "auto", "default")] = None
    prompt_cache_key: str | None = Field(default=None, description="Accepted; routing finds cached prefixes from the prompt itself")
    prompt_cache_retention: Annotated[Any, Unsupported("cached prefixes live while engines keep them", "in_memory")] = None
    prompt_cache_options: Annotated[Any, Unsupported("cached prefixes live while engines keep them")] = None
    safety_identifier: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per output token, or None for no log probabilities."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="One prompt (text or token ids) or a batch of them; choice i*n+j is prompt i's choice j")
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=16, description="Tokens to generate; 0 only with echo: the prompt is repeated (and scored, with logprobs), nothing generated"
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = Field(
        default=None,
        description="Each output token's log probability (the model's, before sampling's penalties and biases) and this many most likely tokens at its place",
    )
    echo: bool | None = Field(
        default=None,
        description="Repeat the prompt before the completion; with logprobs, its tokens' log probabilities too "
        "(the first token's are null: nothing comes before it)",
    )
    best_of: Annotated[Any, Unsupported("choices are not ranked", 1)] = None
    suffix: Annotated[Any, Unsupported("no insertion", "")] = None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; it is for scoring a prompt with echo: true", param="max_tokens")
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per output token, or None for no log probabilities."""
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token (echo with logprobs), or None."""
        return self.logprobs if self.echo else None

    def prompt_texts(self) -> list[str] | None:
        """The batch when given as text (a single prompt as a batch of one), else None."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [t for t in p if isinstance(t, str)] or None

    def prompt_ids(self) -> list[list[int]] | None:
        """The batch when given as token ids (a single prompt as a batch of one), else None."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], str):
            return None
        if isinstance(p[0], int):
            return [[t for t in p if isinstance(t, int)]]
        return [ids for ids in p if isinstance(ids, list)]

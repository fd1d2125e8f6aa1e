"""Tool calls, as vLLM's server makes them: `tool_choice` required or a named function
becomes a structured-output constraint (the JSON schema vLLM builds for them), so the
answer is valid calls on every engine it crosses; auto is free text read by vLLM's parser.
The renderer returns them in OpenAI's shape (app/api/openai_responses.py).

- named: the answer is the function's arguments; finish_reason as the engine says ("stop").
- required: the answer is a JSON list of {"name", "parameters"}, one entry per call (at most
  one with parallel_tool_calls false); finish_reason "tool_calls".
- none: the tools are rendered into the prompt, the answer is text.
- auto (OpenAI's default once tools are given): the answer is free text in which vLLM's
  tool-call parser for the model (`model.tool_call_parser`) finds the calls, whole or as
  they stream; refused when the config names no parser.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from app.api.openai_requests import APIError, CalledFunction, ChatCompletionRequest, ChatTool, ToolCall
from app.engine.token_channel import Constraint

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _NO_ARGUMENTS


class ParsedCalls:
    """vLLM's tool-call parser over one choice's free text (`tool_choice: auto`)."""

    def __init__(self, parser_class: Any, tokenizer: Any, tools: list[dict[str, Any]]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        self._request = VllmRequest(model="-", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice="auto")
        self._parser = parser_class(tokenizer, self._request.tools)
        self._text, self._ids = "", list[int]()

    def whole(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        found = self._parser.extract_tool_calls(text, self._request)
        if not found.tools_called:
            return text, None
        return found.content, [new_call(c.function.name, c.function.arguments) for c in found.tool_calls]

    def step(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, list[Any]]:
        """What this delta adds: text, and vLLM's tool-call deltas (index, id, type, function)."""
        before, before_ids = self._text, self._ids
        self._text, self._ids = before + text, before_ids + list(token_ids)
        delta = self._parser.extract_tool_calls_streaming(before, self._text, text, before_ids, self._ids, list(token_ids), self._request)
        return (None, []) if delta is None else (delta.content, list(delta.tool_calls or []))


#: Makes a choice's parser from the request's tools (None: no parser configured).
ParserFactory = Callable[[list[dict[str, Any]]], ParsedCalls]


def parser_factory(name: str | None, tokenizer: Any) -> ParserFactory | None:
    """vLLM's parser called `name` for this tokenizer, or a ValueError naming the choices."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_class = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"model.tool_call_parser: {name!r} is not one of vLLM's ({', '.join(sorted(ToolParserManager.list_registered()))})") from None
    return lambda tools: ParsedCalls(parser_class, tokenizer, tools)


class ToolCalling:
    """How one request's answer becomes tool calls: `named` (the function called), required,
    or found in free text by `parse` (auto)."""

    def __init__(self, named: str | None, parse: Callable[[], ParsedCalls] | None = None):
        self.named = named
        self.parse = parse

    @staticmethod
    def of(body: ChatCompletionRequest, parsers: ParserFactory | None = None) -> tuple[ToolCalling | None, tuple[Constraint, str] | None]:
        """The request's tool calling and its constraint (with the field that asked), or (None, None)."""
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if choice == "none":
            return None, None
        tools = body.tools or []
        if not tools:
            raise APIError(400, "tool_choice: there are no tools to call", param="tool_choice")
        if choice == "auto":
            if parsers is None:
                raise APIError(
                    400,
                    "tool_choice: auto needs a tool-call parser, and model.tool_call_parser names none; send required, none, or a named function",
                    param="tool_choice",
                    code="unsupported_value",
                )
            dumped = [t.model_dump(exclude_none=True) for t in tools]
            return ToolCalling(None, lambda: parsers(dumped)), None
        if body.response_format is not None and body.response_format.type != "text" or body.structured_outputs is not None:
            raise APIError(
                400, "tool_choice: a tool call's arguments have their own schema; leave out response_format and structured_outputs", param="tool_choice"
            )
        if choice == "required":
            entries = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
            calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": entries}}
            if body.parallel_tool_calls is False:
                calls["maxItems"] = 1
            return ToolCalling(None), (Constraint(json=json.dumps(calls)), "tools")
        assert not isinstance(choice, str)
        named = next((t for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise APIError(400, f"tool_choice: function {choice.function.name!r} is not in tools", param="tool_choice")
        return ToolCalling(named.function.name), (Constraint(json=json.dumps(_parameters(named))), f"tools.{tools.index(named)}.function.parameters")

    def calls(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """The answer's text and calls: (None, calls), or (text, None) when a required or named
        answer is not whole calls (cut short by max_tokens or a stop); auto: what the parser finds."""
        if self.parse is not None:
            return self.parse().whole(text)
        calls = self._constrained_calls(text)
        return (text, None) if calls is None else (None, calls)

    def _constrained_calls(self, text: str) -> list[ToolCall] | None:
        if self.named is not None:
            return [new_call(self.named, text)] if _parses(text) else None
        try:
            entries = json.loads(text)
            return [new_call(e["name"], json.dumps(e["parameters"])) for e in entries]
        except (ValueError, TypeError, KeyError):
            return None

    def finish_reason(self, finish: str | None, called: bool) -> str | None:
        return "tool_calls" if called and self.named is None and finish == "stop" else finish


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=CalledFunction(name=name, arguments=arguments))

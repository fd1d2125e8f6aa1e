"""Tool calls, as vLLM's server makes them without a parser: `tool_choice` required or a
named function becomes a structured-output constraint (the JSON schema vLLM builds for
them), so the answer is valid calls on every engine it crosses, and the renderer returns
them in OpenAI's shape (app/api/openai_responses.py).

- named: the answer is the function's arguments; finish_reason as the engine says ("stop").
- required: the answer is a JSON list of {"name", "parameters"}, one entry per call (at most
  one with parallel_tool_calls false); finish_reason "tool_calls".
- none: the tools are rendered into the prompt, the answer is text.
- auto (OpenAI's default once tools are given) needs a tool-call parser that finds calls in
  free text; not served yet, so it is refused with the choices that are.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.api.openai_requests import APIError, CalledFunction, ChatCompletionRequest, ChatTool, ToolCall
from app.engine.token_channel import Constraint

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _NO_ARGUMENTS


class ToolCalling:
    """How one request's answer becomes tool calls: `named` (the function called) or required."""

    def __init__(self, named: str | None):
        self.named = named

    @staticmethod
    def of(body: ChatCompletionRequest) -> tuple[ToolCalling | None, tuple[Constraint, str] | None]:
        """The request's tool calling and its constraint (with the field that asked), or (None, None)."""
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if choice == "none":
            return None, None
        tools = body.tools or []
        if not tools:
            raise APIError(400, "tool_choice: there are no tools to call", param="tool_choice")
        if choice == "auto":
            raise APIError(
                400,
                "tool_choice: auto needs a tool-call parser, which this server does not run yet; send required, none, or a named function",
                param="tool_choice",
                code="unsupported_value",
            )
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

    def calls(self, text: str) -> list[ToolCall] | None:
        """The answer's calls, or None when it is not whole calls (cut short by max_tokens or a stop)."""
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

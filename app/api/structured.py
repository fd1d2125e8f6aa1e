"""Structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs`, read into
one engine `Constraint` and checked here by the engines' grammar backend (xgrammar), so a bad
schema, regex or grammar is a 400 naming its field rather than a request every engine fails.

Engines run xgrammar unless `roles.<role>.engine.extra.structured_outputs_config` says
otherwise (app/engine/engine_args.py); a constraint crosses engines with the answer, and each
engine's grammar starts past the output the engines before it produced
(app/engine/carried_sampling.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Callable

from app.api.openai_requests import APIError, ResponseFormat, StructuredOutputs
from app.engine.token_channel import Constraint


def constraint(response_format: ResponseFormat | None, structured: StructuredOutputs | None, ignore_eos: bool | None) -> tuple[Constraint, str] | None:
    """The request's constraint and the field that gave it, or None for free text."""
    asked = response_format is not None and response_format.type != "text"
    if asked and structured is not None:
        raise APIError(400, "structured_outputs: give it or response_format, not both", param="structured_outputs")
    if ignore_eos and (asked or structured is not None):
        raise APIError(400, "ignore_eos: a constrained answer ends where its constraint does", param="ignore_eos")
    if response_format is not None and (response_format.type == "json_schema") != (response_format.json_schema is not None):
        raise APIError(400, "response_format.json_schema: given with type json_schema, and only then", param="response_format.json_schema")
    if structured is not None:
        fields = {k: v for k, v in structured.constraint_fields().items() if v is not None}
        if len(fields) != 1:
            raise APIError(
                400,
                f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object (got {', '.join(fields) or 'none'})",
                param="structured_outputs",
            )
        ((name, value),) = fields.items()
        if name == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"structured_outputs.json: not JSON ({exc})", param="structured_outputs.json") from None
        if name == "json":
            value = json.dumps(value)
        return Constraint(**{name: value}), f"structured_outputs.{name}"
    if response_format is None or response_format.type == "text":
        return None
    if response_format.json_schema is None:
        return Constraint(json_object=True), "response_format"
    return Constraint(json=json.dumps(response_format.json_schema.schema_)), "response_format.json_schema.schema"


_BACKEND_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


@functools.lru_cache(maxsize=256)
def _compile_error(kind: str, spec: str) -> str | None:
    import xgrammar

    builds: dict[str, Callable[[str], object]] = {
        "json": xgrammar.Grammar.from_json_schema,
        "regex": xgrammar.Grammar.from_regex,
        "grammar": xgrammar.Grammar.from_ebnf,
    }
    try:
        builds[kind](spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        return _BACKEND_PREFIX.sub("", str(exc)).strip()
    return None


async def check(given: tuple[Constraint, str] | None) -> Constraint | None:
    """The constraint, once the grammar backend can build it (in a thread: xgrammar's first
    import and a large schema take a while); a 400 naming the field otherwise."""
    if given is None:
        return None
    c, field = given
    spec = next(((kind, text) for kind, text in (("json", c.json), ("regex", c.regex), ("grammar", c.grammar)) if text is not None), None)
    if spec is not None:
        error = await asyncio.to_thread(_compile_error, *spec)
        if error:
            raise APIError(400, f"{field}: {error}", param=field)
    return c

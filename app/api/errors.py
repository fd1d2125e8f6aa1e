"""Errors as OpenAI's JSON: the status each exception maps to, and which request field was wrong."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.openai_requests import APIError, ErrorResponse
from app.conductor.engine_client import NoReplicaError
from app.conductor.generation import EngineError, RequestTimeout
from app.engine.token_channel import ChannelClosed

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or invalid API key"},
    403: {"model": ErrorResponse, "description": "The API key's scope does not cover this endpoint (an operator key is needed)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Too many concurrent requests"},
    500: {"model": ErrorResponse, "description": "Internal error (a bug)"},
    502: {"model": ErrorResponse, "description": "An engine failed and no replica could take over"},
    503: {"model": ErrorResponse, "description": "No engine replica available"},
    504: {"model": ErrorResponse, "description": "The request ran past server.request_timeout_s"},
}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _api_error(_: Request, err: APIError) -> JSONResponse:
    return _error_response(err)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or "-" in part)


def param_path(loc) -> str | None:
    """`body.messages.0.content.list[TextContentPart].0.text` -> `messages.0.content.0.text`:
    the field path without pydantic's union-branch tags."""
    parts = [str(p) for p in loc if not _is_union_tag(p)]
    return ".".join(parts[1:] if parts[:1] in (["body"], ["query"], ["path"]) else parts) or None


def most_telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first error, or where a union's branches all failed on it, the branch that matched the
    input's type and got furthest: `content: [{"type": "text"}]` fails as a string and as a list
    of parts without `text`; the second says what is wrong."""
    if not errors:
        return {}
    first = errors[0]
    stem = list(itertools.takewhile(lambda p: not _is_union_tag(p), first.get("loc", ())))
    siblings = [e for e in errors if list(e.get("loc", ()))[: len(stem)] == stem]
    return max(siblings, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    first = most_telling(err.errors())
    param = param_path(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    content_type = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type:
        # curl -d sends a form's content type: FastAPI then does not parse the JSON at all
        msg = f"Send the body as JSON with Content-Type: application/json (got {content_type or 'no Content-Type'})"
    elif first.get("type") == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif first.get("type") == "json_invalid":
        msg = "Request body is not valid JSON"
        param = None
    elif param:
        msg = f"{param}: {msg.removeprefix('Value error, ')}"
    code = first.get("type") if first.get("type") in ("unsupported_parameter", "unsupported_value") else None
    return _error_response(APIError(400, msg, param=param, code=code))


async def _no_replica(_: Request, err: NoReplicaError) -> JSONResponse:
    return _error_response(APIError(503, f"no engine available: {err}; retry shortly", type="service_unavailable", code="no_replica"))


async def _engine_failed(_: Request, err: Exception) -> JSONResponse:
    return _error_response(APIError(502, f"an engine failed and no replica could take the request over: {err}", type="server_error", code="engine_failed"))


async def _timeout_error(_: Request, err: RequestTimeout) -> JSONResponse:
    return _error_response(APIError(504, f"request {err}", type="timeout_error", code="request_timeout"))


async def _unexpected_error(_: Request, err: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return _error_response(APIError(500, f"internal error: {type(err).__name__}", type="server_error"))


async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(err.status_code, str(err.detail), type=kind))


def install_error_handlers(api: FastAPI) -> None:
    """Every error the API can meet answered in OpenAI's JSON shape, with its status."""
    # FastAPI's decorator form: Starlette's add_exception_handler types every handler as taking any Exception
    api.exception_handler(APIError)(_api_error)
    api.exception_handler(RequestValidationError)(_validation_error)
    api.exception_handler(NoReplicaError)(_no_replica)
    api.exception_handler(EngineError)(_engine_failed)
    api.exception_handler(ChannelClosed)(_engine_failed)
    api.exception_handler(RequestTimeout)(_timeout_error)
    api.exception_handler(Exception)(_unexpected_error)
    api.exception_handler(StarletteHTTPException)(_http_error)

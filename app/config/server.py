"""The public API: keys, limits, timeouts."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.config.base import StrictModel


class ServerConfig(StrictModel):
    api_keys: list[str] = []
    """Inference keys (plus PDD_API_KEYS, comma-separated): /v1/*, and the journeys of their own
    requests. With no key of either scope, the API is open while Serve binds loopback only;
    bound beyond it, the cluster generates an operator key (app/api/auth.py, README: Security)."""
    operator_api_keys: list[str] = []
    """Operator keys (plus PDD_OPERATOR_API_KEYS): everything inference keys call, and every
    user's journeys (GET /pdd/requests), /pdd/state, /pdd/chat."""
    allow_anonymous: bool = False
    """With no key configured and Serve binding beyond loopback: serve everyone without a key
    (a warning at start) instead of generating one."""
    max_prompt_tokens: Annotated[int, Field(gt=0)] | None = None
    """Longest prompt accepted (default: max_model_len - 1)."""
    max_output_tokens: Annotated[int, Field(gt=0)] = 4096
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    """max_tokens when a request gives none."""
    max_concurrent_per_key: Annotated[int, Field(gt=0)] = 256
    """Choices in flight for one API key beyond which new requests get 429."""
    max_queued_requests: Annotated[int, Field(gt=0)] = 1024
    """Choices in flight in one conductor replica beyond which new requests get 429."""
    max_choices_per_request: Annotated[int, Field(gt=0)] = 128
    """Most choices one request may ask for (`n` times its prompts); each is one engine request.
    A request asking for more is refused with 400, naming `n` or `prompt`."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    allow_mode_override: bool = True
    """Accept a per-request `pdd_mode` (benchmarks, tests)."""
    http_port: Annotated[int, Field(gt=0, lt=65536)] = 8000

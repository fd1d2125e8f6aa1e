"""Extension points that the layers above app/ fill: `pdd` subcommands and the chat-ops endpoint.

app/ imports nothing from agents/. The agents say what they add as entry points
in pyproject.toml (the groups below), and app/ loads them by group, so the
dependency points one way: agents/ on app/.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.openai_requests import APIError
from app.config import PDDConfig

COMMANDS = "pdd_serve.commands"
"""`pdd NAME`: a typer app (a group of commands) or a function (one command)."""
CHAT_OPS = "pdd_serve.chat_ops"
"""A factory (config, conductor, app name) -> ChatOps, for POST /pdd/chat."""


class ChatOpsRequest(BaseModel):
    """Body of POST /pdd/chat."""

    model_config = ConfigDict(extra="forbid")

    message: str = Field(min_length=1, max_length=8000, description="A question about the cluster, or a change to propose")
    thread_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="Continue this conversation; none starts one")


class ChatOps(Protocol):
    async def respond(self, body: ChatOpsRequest, key: str) -> StreamingResponse:
        """The answer as server-sent events; `key` scopes the caller's conversations."""


def commands() -> list[tuple[str, Any]]:
    """(name, typer app or function) of every installed `pdd` extension command, by name."""
    return [(ep.name, ep.load()) for ep in sorted(entry_points(group=COMMANDS), key=lambda ep: ep.name)]


def chat_ops(config: PDDConfig, conductor: Any, app_name: str) -> ChatOps:
    """The chat-ops endpoint of one ingress replica (`conductor`: its app.conductor.conductor.Conductor)."""
    found = list(entry_points(group=CHAT_OPS))
    if not found:
        raise APIError(501, f"chat-ops is not installed: no '{CHAT_OPS}' entry point (pip install -e . installs the agents')", type="server_error")
    factory: Callable[[PDDConfig, Any, str], ChatOps] = found[0].load()
    return factory(config, conductor, app_name)

"""POST /pdd/chat on the ingress: one chat agent per ingress replica.

The ingress route (app/api/ingress.py) checks the API key and hands over here,
through the `pdd_serve.chat_ops` entry point (app/api/extensions.py). The agent
reads state and journeys from the replica's own conductor (InProcessSource), is
built on the first chat request, and keeps its conversation checkpointer open
for the replica's life. Thread ids are scoped to the caller's API key, so one
key's conversations are not readable with another.

Light imports only at module level: the agent's own are made when it is built.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from app.api.extensions import ChatOpsRequest
from app.api.openai_requests import APIError
from app.config import PDDConfig

if TYPE_CHECKING:
    from agents.chatops.agent import ChatAgent
    from agents.chatops.rules import RuleAgent

logger = logging.getLogger(__name__)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class ChatEndpoint:
    """app.api.extensions.ChatOps for one ingress replica; the `pdd_serve.chat_ops` entry point builds it."""

    def __init__(self, config: PDDConfig, conductor: Any, app_name: str):
        self.config = config
        self.conductor = conductor
        self.app_name = app_name
        self._agent: ChatAgent | RuleAgent | None = None
        self._lock = asyncio.Lock()

    async def agent(self) -> ChatAgent | RuleAgent:
        async with self._lock:
            if self._agent is None:
                from agents.chatops.agent import build_agent, llm_for, sqlite_checkpointer
                from agents.chatops.sources import InProcessSource
                from agents.whatif import load_what_if

                llm = llm_for(self.config.agents)
                saver = await sqlite_checkpointer(self.config.agents.chat_db) if llm is not None else None
                self._agent = build_agent(
                    self.config,
                    llm=llm,
                    source=InProcessSource(self.conductor),
                    app_name=self.app_name,
                    checkpointer=saver,
                    what_if=load_what_if(),
                )
            return self._agent

    async def respond(self, body: ChatOpsRequest, key: str) -> StreamingResponse:
        from agents.chatops.agent import new_thread_id

        agent = await self.agent()
        thread = body.thread_id or new_thread_id()
        scoped = f"{hashlib.sha256(key.encode()).hexdigest()[:16]}/{thread}" if key else thread

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in agent.ask(body.message, scoped):
                    yield _sse({**event, "thread_id": thread} if event["type"] == "figures" else event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
                logger.exception("chat-ops failed on thread %s", thread)
                yield _sse(APIError(500, f"chat-ops failed: {type(exc).__name__}: {exc}", type="server_error").body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-thread-id": thread})

"""One chat agent: the graph compiled over a conversation checkpointer, streamed as events.

Events, in order: `text` (pieces of the answer as the model writes them),
`proposal` (when the turn filed, or refused to file, a change), and last
`figures` (every figure the turn fetched, and the thread id to continue).
`pdd ask` prints them; POST /pdd/chat sends each as one SSE event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import aiosqlite
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from agents.chatops import records
from agents.chatops.graph import MAX_ROUNDS, ChatDeps, build_chat_graph, text_of
from agents.chatops.propose import ProposalDesk
from agents.chatops.rules import RuleAgent
from agents.chatops.sources import DataSource
from agents.chatops.templates import templates
from agents.chatops.tools import Toolbox
from agents.router import chat_model
from agents.whatif import WhatIf
from app.config import AgentsConfig, PDDConfig
from app.telemetry.queries import QuerySet
from app.telemetry.snapshot import PromSource


def llm_for(agents: AgentsConfig) -> BaseChatModel | None:
    """The configured OpenAI-compatible chat model (langchain-openai), as the swarm builds it;
    None when `agents.llm` is unset (chat-ops then answers by rules, agents/chatops/rules.py)."""
    return None if agents.llm is None else chat_model(agents.llm)


async def sqlite_checkpointer(path: str | Path) -> AsyncSqliteSaver:
    """A conversation checkpointer on a SQLite file (created with its folder); close `.conn` when done."""
    db = Path(path).expanduser()
    db.parent.mkdir(parents=True, exist_ok=True)
    saver = AsyncSqliteSaver(await aiosqlite.connect(db, timeout=30))
    await saver.setup()
    return saver


def new_thread_id() -> str:
    return uuid.uuid4().hex[:12]


class ChatAgent:
    def __init__(self, deps: ChatDeps, checkpointer: BaseCheckpointSaver):
        self.deps = deps
        self.graph = build_chat_graph(deps).compile(checkpointer=checkpointer)

    async def ask(self, message: str, thread_id: str) -> AsyncIterator[dict[str, Any]]:
        """Answer one message on a thread (its earlier turns are remembered)."""
        config: RunnableConfig = {"configurable": {"thread_id": thread_id}, "recursion_limit": 2 * MAX_ROUNDS + 8}
        # with a list of stream modes each part is a (mode, chunk) pair, which the stub's return type does not say
        parts = cast("AsyncIterator[tuple[str, Any]]", self.graph.astream({"messages": [HumanMessage(message)]}, config, stream_mode=["messages", "updates"]))
        async for mode, item in parts:
            if mode == "messages":
                chunk, meta = item
                if meta.get("langgraph_node") == "agent" and isinstance(chunk, (AIMessage, AIMessageChunk)):
                    text = text_of(chunk.content)
                    if text:
                        yield {"type": "text", "text": text}
            else:
                filing = (item.get("propose") or {}).get("filing")
                if filing:
                    yield {"type": "proposal", **filing}
        final = await self.graph.aget_state(config)
        yield {"type": "figures", "thread_id": thread_id, "figures": final.values.get("figures", [])}


def build_agent(
    config: PDDConfig,
    *,
    llm: BaseChatModel | None,
    source: DataSource,
    app_name: str,
    checkpointer: BaseCheckpointSaver | None,
    runbooks_dir: Path = records.RUNBOOKS,
    what_if: WhatIf | None = None,
    clock: Callable[[], float] = time.time,
) -> ChatAgent | RuleAgent:
    """A chat agent for one cluster: its Prometheus, its audit trail, its approval flow.

    With no `llm`, the rule answerer over the same tools (it needs no checkpointer).
    `what_if`: the digital twin's (agents.whatif.load_what_if()); None leaves that tool out.
    """
    agents = config.agents
    queries = QuerySet.for_config(config, app_name)
    toolbox = Toolbox(
        config=config,
        source=source,
        prometheus_url=agents.prometheus_url,
        named=templates(queries),
        audit_db=agents.audit_db,
        actions_dir=records.resolve_dir(agents.actions_dir),
        runbooks_dir=runbooks_dir,
        what_if=what_if,
        observe=PromSource(agents.prometheus_url, queries).snapshot,
    )
    desk = ProposalDesk(config, clock=clock)
    if llm is None:
        return RuleAgent(config, toolbox, desk, source)
    if checkpointer is None:
        raise ValueError("a chat agent with an LLM needs a conversation checkpointer")
    return ChatAgent(ChatDeps(llm=llm, toolbox=toolbox, desk=desk, source=source), checkpointer)

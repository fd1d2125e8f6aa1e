"""The chat graph: intake -> [propose] -> agent <-> tools, one run per operator message.

- intake reads the operator's message alone (agents/chatops/intent.py) and
  decides whether this turn may file a proposal. Nothing a tool returns can
  reach that decision: it is made before any tool runs.
- propose runs only on such a turn. Its model sees the proposal instructions
  and the operator's message, nothing else: not the conversation, not any
  tool output. The proposal tool exists only here, and what it files must name
  a target and a value found in the operator's message (propose.read_request).
- agent answers with the read-only tools bound; tools runs the calls it makes
  through the Toolbox, which knows only read-only tools: a call to anything
  else (a proposal tool included) is refused as data.
Figures from every tool call of the turn accumulate in `figures`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from agents.chatops import intent, prompts
from agents.chatops.propose import TOOL_NAME, Filing, ProposalDesk, proposal_tool
from agents.chatops.sources import DataSource, SourceError, live_values
from agents.chatops.tools import Toolbox

#: Tool rounds per turn before the model must answer with what it has.
MAX_ROUNDS = 6
#: Past turns the model sees (the checkpointer keeps them all).
MAX_TURNS = 8


class ChatState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    figures: list[dict]
    """This turn's figures (agents/chatops/evidence.Figure dumps)."""
    rounds: int
    change_requested: bool
    filing: dict | None
    """This turn's proposal outcome (propose.Filing.data())."""


@dataclass
class ChatDeps:
    llm: BaseChatModel
    toolbox: Toolbox
    desk: ProposalDesk
    source: DataSource


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content if isinstance(p, (str, dict)))
    return ""


def asked(state: ChatState) -> str:
    """The operator's message of this turn."""
    for m in reversed(state.get("messages", [])):
        if isinstance(m, HumanMessage):
            return text_of(m.content)
    return ""


def recent_turns(messages: list[AnyMessage], turns: int = MAX_TURNS) -> list[AnyMessage]:
    starts = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    return messages[starts[-turns] :] if len(starts) > turns else messages


def _thread(config: RunnableConfig) -> str:
    return str((config.get("configurable") or {}).get("thread_id", ""))


def build_chat_graph(deps: ChatDeps) -> StateGraph:
    async def intake(state: ChatState) -> dict:
        return {"figures": [], "rounds": 0, "filing": None, "change_requested": intent.asks_for_change(asked(state))}

    async def propose(state: ChatState, config: RunnableConfig) -> dict:
        message = asked(state)
        llm = deps.llm.bind_tools([proposal_tool()])
        reply = await llm.ainvoke([SystemMessage(prompts.propose(deps.desk.targets())), HumanMessage(message)])
        calls = [c for c in getattr(reply, "tool_calls", None) or [] if c.get("name") == TOOL_NAME]
        if not calls:
            return {}
        call = calls[0]
        try:
            knobs, replicas = live_values(await deps.source.state())
        except SourceError as err:
            filing = Filing(False, f"not filed: the live values could not be read ({err})")
        else:
            filing = await asyncio.to_thread(deps.desk.file, call.get("args") or {}, asked=message, thread=_thread(config), knobs=knobs, replicas=replicas)
        record = [
            AIMessage(content="", tool_calls=[call]),
            ToolMessage(content=json.dumps(filing.data()), tool_call_id=call["id"], name=TOOL_NAME),
        ]
        return {"messages": record, "filing": filing.data()}

    async def agent(state: ChatState) -> dict:
        system = prompts.ANSWER
        if state.get("change_requested") and not state.get("filing"):
            system += "\n\n" + prompts.NO_PROPOSAL
        last_round = state.get("rounds", 0) >= MAX_ROUNDS
        llm = deps.llm if last_round else deps.llm.bind_tools(deps.toolbox.tools)
        reply = await llm.ainvoke([SystemMessage(system), *recent_turns(state["messages"])])
        if last_round and reply.tool_calls:
            # a call left unanswered would make the thread's history invalid for the next turn
            reply = AIMessage(content=text_of(reply.content) or "Stopped: too many tool calls for one question.", id=reply.id)
        return {"messages": [reply]}

    async def tools(state: ChatState) -> dict:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)  # the agent's edge leads here only from its reply with tool calls
        calls = last.tool_calls
        results = await asyncio.gather(*(deps.toolbox.run(c["name"], c.get("args") or {}) for c in calls))
        figures = list(state.get("figures", []))
        messages = []
        for call, (content, found) in zip(calls, results):
            messages.append(ToolMessage(content=content, tool_call_id=call["id"], name=call["name"]))
            figures += [f.model_dump() for f in found if f.model_dump() not in figures]
        return {"messages": messages, "figures": figures, "rounds": state.get("rounds", 0) + 1}

    g = StateGraph(ChatState)
    g.add_node("intake", intake)
    g.add_node("propose", propose)
    g.add_node("agent", agent)
    g.add_node("tools", tools)
    g.add_edge(START, "intake")
    g.add_conditional_edges("intake", lambda s: "propose" if s.get("change_requested") else "agent", ["propose", "agent"])
    g.add_edge("propose", "agent")
    g.add_conditional_edges("agent", lambda s: "tools" if getattr(s["messages"][-1], "tool_calls", None) else END, ["tools", END])
    g.add_edge("tools", "agent")
    return g

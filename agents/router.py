"""Who speaks next, swarm-style: handoff tools that return LangGraph Commands.

Each specialist, when done, hands the tick to the next one by calling a
handoff tool (`transfer_to_<specialist>`), whose result is a `Command(goto=...)`
the graph follows, as in langgraph-swarm. Which tool gets called is decided
by a router:
- `RuleRouter`: the first specialist, in a fixed order, that still has open
  situations; then the clerk.
- `LLMRouter`: any OpenAI-compatible chat model (langchain-openai) bound to the
  same tools picks among the specialists that still have open situations and
  says why; the clerk is always last. A reply that is not one of the offered
  tools falls back to the rule. Since routing, handoff and capacity do not
  depend on each other's order, an LLM changes the route and the
  explanations, never the numbers.
Both routers also write the tick's explanation for people (the rule router
from a template).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import BaseTool, tool
from langgraph.types import Command

from agents.specialists import CLERK, PROPOSERS
from app.config import LLMEndpoint

logger = logging.getLogger(__name__)

ORDER = (*PROPOSERS, CLERK)
DESCRIPTIONS = {
    "routing": "WAN-transfer / hit-rate threshold and the singular filter (WAN degradation, MD hit behind P, bathtub valley, "
    "P-MD gap breach, relay saturated, threshold back to intent)",
    "handoff": "handoff mode, catch-up threshold and relay cap (RLD overload, WAN degradation, P-RLD-MD gap breach, relay cap back to intent)",
    "capacity": "P:RLD:MD replica counts, cost-aware (SLO breaches, RLD overload, spare capacity)",
    "clerk": "runbook notices for what needs a person; always last",
}


def tool_name(agent: str) -> str:
    return f"transfer_to_{agent}"


def handoff_tool(agent: str) -> BaseTool:
    @tool(tool_name(agent), description=f"Hand the tick to the {agent} specialist: {DESCRIPTIONS[agent]}.")
    def handoff(reason: str) -> Command:
        return Command(goto=agent, update={"active_agent": agent, "route": [{"to": agent, "reason": reason}]})

    return handoff


TOOLS: dict[str, BaseTool] = {agent: handoff_tool(agent) for agent in ORDER}


def tool_call(agent: str, reason: str) -> dict[str, Any]:
    return {"name": tool_name(agent), "args": {"reason": reason}, "id": f"route-{agent}", "type": "tool_call"}


def hand_to(agent: str, reason: str) -> Command:
    """Run the handoff tool for `agent`: the Command the graph follows."""
    return TOOLS[agent].invoke(tool_call(agent, reason))


class Router(Protocol):
    name: str

    def choose(self, brief: str, candidates: list[str]) -> tuple[str, str]:
        """(next specialist, why) among `candidates` (non-empty)."""

    def explain(self, facts: str) -> str:
        """A short account of the tick for people."""


class RuleRouter:
    name = "rules"

    def choose(self, brief: str, candidates: list[str]) -> tuple[str, str]:
        agent = min(candidates, key=ORDER.index)
        return agent, f"rule: {agent} has open situations (order {', '.join(ORDER)})"

    def explain(self, facts: str) -> str:
        return facts


SYSTEM = (
    "You route one tick of the PDD serving cluster's ops swarm between specialists. "
    "Specialists compute every number themselves; you only choose who goes next and say why in one sentence. "
    "Call exactly one of the offered transfer tools."
)
EXPLAIN = (
    "Explain this tick of the PDD ops agents to an on-call engineer in at most four sentences: "
    "what was seen, what was changed or proposed and why, and what to watch. Use only the facts given."
)


class LLMRouter:
    """An OpenAI-compatible chat model routes; the rules step in when its answer is unusable."""

    name = "llm"

    def __init__(self, llm: BaseChatModel):
        self.llm = llm
        self.rules = RuleRouter()

    def choose(self, brief: str, candidates: list[str]) -> tuple[str, str]:
        if len(candidates) == 1:
            return self.rules.choose(brief, candidates)
        tools = [TOOLS[a] for a in candidates]
        try:
            reply = self.llm.bind_tools(tools).invoke([SystemMessage(SYSTEM), HumanMessage(brief)])
        except Exception as err:  # any endpoint failure: the rule-routed swarm still runs
            logger.warning("LLM routing failed, using rules: %s", err)
            agent, why = self.rules.choose(brief, candidates)
            return agent, f"{why} (LLM unavailable: {type(err).__name__})"
        by_name = {tool_name(a): a for a in candidates}
        for call in getattr(reply, "tool_calls", None) or []:
            chosen = by_name.get(call.get("name"))
            if chosen is not None:
                reason = str((call.get("args") or {}).get("reason") or reply.content or "").strip()
                return chosen, f"llm: {reason}" if reason else "llm"
        agent, why = self.rules.choose(brief, candidates)
        return agent, f"{why} (LLM answer not an offered handoff)"

    def explain(self, facts: str) -> str:
        try:
            reply = self.llm.invoke([SystemMessage(EXPLAIN), HumanMessage(facts)])
        except Exception as err:  # the record is kept with the template text
            logger.warning("LLM explanation failed: %s", err)
            return facts
        text = reply.content if isinstance(reply.content, str) else str(reply.content)
        return text.strip() or facts


def chat_model(endpoint: LLMEndpoint) -> BaseChatModel:
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    return ChatOpenAI(
        base_url=endpoint.base_url,
        model=endpoint.model,
        api_key=SecretStr(os.environ.get(endpoint.api_key_env) or "none"),
        temperature=0,
        timeout=30,
        max_retries=1,
    )


def make_router(endpoint: LLMEndpoint | None) -> Router:
    return LLMRouter(chat_model(endpoint)) if endpoint is not None else RuleRouter()

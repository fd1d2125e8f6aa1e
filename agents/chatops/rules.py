"""Chat-ops without an LLM: rules read the question, the read-only tools answer it.

Most clusters first run with no model configured for the agents. The rule
answerer takes the questions operators ask most (agents/chatops/questions.py
says which words lead where), calls the same tools the chat agent would, and
writes the figures it read into the answer (agents/chatops/answers.py). A
change request is read into a proposal by rules and filed through the same
desk as the chat agent's, checked against the message and guarded the same
way. A question it cannot read gets the list of what it can answer. Each
message stands alone: without a model there is no conversation to carry on.

It streams the events ChatAgent does (text, proposal, figures), so `pdd ask`
and POST /pdd/chat serve either.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agents.chatops import answers, intent, records
from agents.chatops.answers import Reader
from agents.chatops.propose import Filing, ProposalDesk
from agents.chatops.questions import Question, change_args, read_question
from agents.chatops.sources import DataSource, SourceError, live_values
from agents.chatops.tools import Toolbox
from app.config import PDDConfig

NO_LLM_LINE = (
    "(Answered without an LLM, by rules over the read-only tools. For free-form questions and follow-ups, "
    "set `agents.llm` in the serve config: any OpenAI-compatible endpoint.)"
)

CAPABILITIES = """Without an LLM, chat-ops answers these (examples in quotes):
- state and health: "is the cluster healthy?", "how many main_decode replicas are live?"
- why a figure is up or down, per pipeline, role, datacenter or link: TTFT, TPOT, worst gap, \
WAN/KV transfers, prefix-cache hit, request rate, errors, SLO violations ("why is P-RLD-MD's TTFT up?")
- what the agents did and why, and what awaits approval: "what did the agents do?"
- which runbook applies: "which runbook applies now?", "show the wan_degradation runbook"
- what a knob does and its value: "what does routing.max_wan_transfer_ms do?", "list the knobs"
- what changed: "what changed in the last 30 minutes?"
- one request, or the recent ones: "what happened to chatcmpl-…?", "show the slowest recent requests"
- a change, filed for approval only: "scale main_decode to 3", "set routing.max_wan_transfer_ms to 500\""""

Part = Callable[[Question, Reader, PDDConfig], Awaitable[list[str]]]
#: Topic -> the answer part it asks for, in the order parts are written.
PARTS: dict[str, Part] = {
    "journey": answers.journey_lines,
    "state": answers.state_lines,
    "knobs": answers.knob_lines,
    "changes": answers.change_lines,
    "agents": answers.agents_lines,
    "runbook": answers.runbook_lines,
    "requests": answers.requests_lines,
}


def _text(lines: list[str]) -> dict[str, Any]:
    return {"type": "text", "text": "\n".join(lines) + "\n\n"}


class RuleAgent:
    """Answers one message from the tools; the events `ChatAgent.ask` yields."""

    def __init__(self, config: PDDConfig, toolbox: Toolbox, desk: ProposalDesk, source: DataSource):
        self.config = config
        self.toolbox = toolbox
        self.desk = desk
        self.source = source

    def read(self, message: str) -> Question:
        datacenters = sorted({g.datacenter for g in self.config.node_groups.values()})
        return read_question(message, datacenters=datacenters, knobs=answers.knob_paths(), situations=records.runbook_names(self.toolbox.runbooks_dir))

    async def ask(self, message: str, thread_id: str) -> AsyncIterator[dict[str, Any]]:
        reader = Reader(self.toolbox)
        if intent.asks_for_change(message):
            filing = await self.propose(message, thread_id)
            yield _text([filing.message[:1].upper() + filing.message[1:]])
            yield {"type": "proposal", **filing.data()}
        else:
            question = self.read(message)
            async for event in self.answer(question, reader):
                yield event
        yield {"type": "text", "text": NO_LLM_LINE}
        yield {"type": "figures", "thread_id": thread_id, "figures": [f.model_dump() for f in reader.figures]}

    async def answer(self, q: Question, reader: Reader) -> AsyncIterator[dict[str, Any]]:
        if not q.topics and not q.metrics:
            yield _text(["I could not tell what that asks.", CAPABILITIES])
            return
        topics = [t for t in PARTS if t in q.topics]
        if "journey" in topics:  # the request asked about, before figures of the whole cluster
            topics.remove("journey")
            yield _text(await answers.journey_lines(q, reader, self.config))
        if q.metrics:
            yield _text(await answers.metric_lines(q, reader, self.config))
        for topic in topics:
            yield _text(await PARTS[topic](q, reader, self.config))
        # why a figure moved, or how the cluster is: what the agents' own checks say
        if (q.metrics and q.why) or "state" in q.topics:
            yield _text(await answers.diagnosis_lines(reader))

    async def propose(self, message: str, thread_id: str) -> Filing:
        """A change request read by rules and filed for approval, or why it was not."""
        args, why = change_args(message, list(self.desk.targets()))
        if args is None:
            return Filing(False, f'not filed: {why}. Ask like "scale main_decode to 3" or "set routing.max_wan_transfer_ms to 500".')
        try:
            knobs, replicas = live_values(await self.source.state())
        except SourceError as err:
            return Filing(False, f"not filed: the live values could not be read ({err})")
        return await asyncio.to_thread(self.desk.file, args, asked=message, thread=thread_id, knobs=knobs, replicas=replicas)

"""The agentic trace replayed as chat conversations, plain or with tool calls.

Each session is one conversation of messages, as an agent framework keeps it:
- plain (`--api chat`): every turn a user message, every answer an assistant
  message with its text;
- tools (`--api tools`): the tools listed on every request (they render first,
  so the prompt's start never changes); a turn whose trace output is short (at
  most `CALL_TOKENS`) is a tool call (`tool_choice: required`, one call), the
  next turn's new tokens then come back as the `tool` message answering it;
  the other turns answer in text (`tool_choice: none`).
A turn's new text is as many random dev-model tokens as the trace adds; a
text answer is as long as the trace says, a call as long as its JSON around a
`command` of at most `CALL_TOKENS` characters. Where the trace keeps less than the
whole conversation (compaction, a low-hit turn), the conversation is cut as
the completions replay cuts its token list: the messages that fit, and the
start of the next one where that is one of ours (a user or tool message; an
answer is the model's own, and goes whole or not at all).

Timing is per stream chunk (each carries the engines' next tokens): a required
call's arguments reach the client whole at its end, but its chunks still show
when each token left the server.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from app.engine.devmodel import ensure_devmodel
from app.ops import progress
from app.sim.workload import Request
from bench.common import LoadResult, Replayed, replay_sessions

CALL_TOKENS = 32
"""Turns whose trace output is at most this many tokens are tool calls (`--api tools`)."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command on the agent's workstation and return its output",
            "parameters": {"type": "object", "properties": {"command": {"type": "string", "maxLength": CALL_TOKENS}}, "required": ["command"]},
        },
    }
]
CALL_JSON_TOKENS = 40
"""Room for a call's JSON around its command: `[{"name": "run", "parameters": {"command": ...}}]`."""


class Conversation:
    """One session's messages, each with its size in tokens and, for the ones we wrote, the
    token ids its text was made of (what a cut keeps of it)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.messages: list[dict[str, Any]] = []
        self.sizes: list[int] = []
        self.ids: list[list[int] | None] = []

    def cut(self, keep: int) -> int:
        """The first `keep` tokens: the messages that fit, then the start of the next if we wrote it; the tokens kept."""
        total = n = 0
        while n < len(self.sizes) and total + self.sizes[n] <= keep:
            total += self.sizes[n]
            n += 1
        if n < len(self.sizes) and (ids := self.ids[n]) is not None and keep > total:
            part = ids[: keep - total]
            self.messages[n] = {**self.messages[n], "content": self.decode(part)}
            self.sizes[n], self.ids[n] = len(part), part
            total, n = keep, n + 1
        del self.messages[n:], self.sizes[n:], self.ids[n:]
        return total

    def write(self, role: str, ids: list[int], **fields: Any) -> None:
        """A message of ours (user or tool), its text made of `ids`."""
        self.messages.append({"role": role, "content": self.decode(ids), **fields})
        self.sizes.append(len(ids))
        self.ids.append(ids)

    def answer(self, message: dict[str, Any], tokens: int) -> None:
        """The model's answer, `tokens` long."""
        self.messages.append(message)
        self.sizes.append(tokens)
        self.ids.append(None)

    def awaiting_result(self) -> str | None:
        """The id of the call the last message made, which the next message must answer."""
        calls = self.messages[-1].get("tool_calls") if self.messages else None
        return calls[0]["id"] if calls else None


async def chat_replay(
    base_url: str, trace: list[Request], mode: str, seed: int, step: progress.Step, tools: bool
) -> tuple[LoadResult, list[str], list[Request]]:
    """Sessions run as agents (turns in order), through chat completions; returns results,
    request ids and the trace as sent. `step(name)` as each request ends."""
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_devmodel()))
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)

    async def one(replayed: Replayed, i: int, conversation: Conversation | None, rng: random.Random) -> Conversation:
        r, conversation = trace[i], conversation or Conversation(tokenizer.decode)
        keep = conversation.cut(min(r.prefix_tokens, r.prompt_tokens - 1))
        new = [rng.randrange(10, 500) for _ in range(r.prompt_tokens - keep)]
        call_id = conversation.awaiting_result()
        if call_id:
            conversation.write("tool", new, tool_call_id=call_id)
        else:
            conversation.write("user", new)
        calls = tools and r.output_tokens <= CALL_TOKENS
        timed = await replayed.begin(i, keep)
        tokens, answer, called = 0, [], []
        extra: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False} if calls else {}
        if tools and not calls:
            extra = {"tools": TOOLS, "tool_choice": "none"}
        try:
            stream = await client.chat.completions.create(
                model="pdd-dev",
                messages=conversation.messages,  # type: ignore[arg-type]
                max_tokens=r.output_tokens + CALL_JSON_TOKENS if calls else r.output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"pdd_mode": mode, **({} if calls else {"ignore_eos": True})},
                **extra,
            )
            async for chunk in stream:
                replayed.ids[i] = chunk.id
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices or chunk.choices[0].delta.role:
                    continue  # the opening chunk carries no token
                delta = chunk.choices[0].delta
                answer.append(delta.content or "")
                called += delta.tool_calls or []
                timed.token()
            replayed.records[i] = timed.done(tokens)
        except Exception as exc:  # noqa: BLE001 - a failure is a data point
            replayed.records[i] = timed.failed(exc)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(answer)}
        if called:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in called],
            }
        conversation.answer(message, tokens)
        return conversation

    try:
        return await replay_sessions(trace, mode, seed, step, one)
    finally:
        await client.close()

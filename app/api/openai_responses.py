"""OpenAI-compatible responses: the bodies and stream chunks, and the renderers that build
them from the conductor's output (choices, usage, log probabilities, echoed prompts)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Literal, NamedTuple

from pydantic import BaseModel

from app.api.openai_requests import ToolCall
from app.api.tool_calls import ParsedCalls, ToolCalling, new_call
from app.engine.token_channel import TokenLogprob


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdd-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    """The token's text as UTF-8 (a token may hold part of a character)."""


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """null only for an echoed prompt's first token (nothing comes before it)."""
    top_logprobs: list[dict[str, float] | None]
    """Per token: itself and the requested number of most likely tokens, by their text."""
    text_offset: list[int]
    """Where each token's text starts in the choice's text (an echoed prompt's: the running
    length of its tokens' texts, which may differ from the prompt as sent)."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Echo(NamedTuple):
    """A completion's prompt, repeated before its text."""

    text: str
    """As sent; a prompt of token ids, decoded."""
    token_ids: list[int]
    generates: bool
    """False for max_tokens 0: the prompt alone (the engine's one token is dropped)."""


class Choice(NamedTuple):
    """One choice's whole answer."""

    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    echo: Echo | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    """With `echo` and logprobs: the prompt's tokens' after the first."""


TokenText = Callable[[int], str]
"""A token id's text, as it reads after another word (ConductorIngress._token_text)."""


class ChatRenderer:
    """Chat completion bodies and stream chunks for one request."""

    def __init__(self, request_id: str, model: str, token_text: TokenText, tools: ToolCalling | None = None):
        self.id, self.model, self.created = request_id, model, now()
        self.token_text = token_text
        self.tools = tools
        self._call_ids: dict[int, str] = {}  # a named call's id, once its first delta left (by choice)
        self._held: dict[int, list[str]] = {}  # the text of a required call's answer so far (by choice)
        self._parsed: dict[int, ParsedCalls] = {}  # auto: each choice's parser
        self._called: set[int] = set()  # choices that streamed a call

    def opening(self, index: int) -> str:
        return self._chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=None if self.tools else "")))

    def delta(self, index: int, text: str, finish: str | None, token_ids: list[int], logprobs: list[TokenLogprob] | None, want_ids: bool) -> str:
        message = DeltaMessage(content=text or None)
        if self.tools is not None:
            message = self._call_delta(self.tools, index, text, finish, token_ids)
            if message.tool_calls:
                self._called.add(index)
            finish = self.tools.finish_reason(finish, index in self._called)
        return self._chunk(
            ChatChunkChoice(
                index=index,
                delta=message,
                finish_reason=finish,
                logprobs=self._logprobs(token_ids, logprobs),
                token_ids=token_ids if want_ids else None,
            )
        )

    def usage(self, usage: Usage) -> str:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage).model_dump_json()

    def whole(self, choices: list[Choice], usage: Usage, want_ids: bool) -> ChatCompletion:
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            usage=usage,
            choices=[
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=finish,
                    logprobs=self._logprobs(c.token_ids, c.logprobs),
                    token_ids=c.token_ids if want_ids else None,
                )
                for i, c in enumerate(choices)
                for message, finish in [self._message(c)]
            ],
        )

    def _message(self, choice: Choice) -> tuple[AssistantMessage, str | None]:
        if self.tools is None:
            return AssistantMessage(content=choice.text), choice.finish_reason
        content, calls = self.tools.calls(choice.text)  # calls cut short: the text as it came
        return AssistantMessage(content=content, tool_calls=calls), self.tools.finish_reason(choice.finish_reason, calls is not None)

    def _call_delta(self, tools: ToolCalling, index: int, text: str, finish: str | None, token_ids: list[int]) -> DeltaMessage:
        """A named call streams its arguments as they come; a required answer is held until it
        ends, then sent as its calls (or as text, when cut short); auto streams what the parser finds."""
        if tools.parse is not None:
            if index not in self._parsed:
                self._parsed[index] = tools.parse()
            parsed = self._parsed[index]
            said, found = parsed.step(text, token_ids)
            return DeltaMessage(
                content=said or None,
                tool_calls=[
                    DeltaToolCall(index=c.index, id=c.id, type=c.type, function=DeltaFunction(name=c.function.name, arguments=c.function.arguments))
                    for c in found
                ]
                or None,
            )
        if tools.named is not None:
            first = index not in self._call_ids
            if first:
                self._call_ids[index] = new_call(tools.named, "").id
            elif not text:
                return DeltaMessage()
            function = DeltaFunction(name=tools.named if first else None, arguments=text)
            call = DeltaToolCall(index=0, id=self._call_ids[index], type="function", function=function) if first else DeltaToolCall(index=0, function=function)
            return DeltaMessage(tool_calls=[call])
        self._held.setdefault(index, []).append(text)
        if finish is None:
            return DeltaMessage()
        content, calls = tools.calls("".join(self._held.pop(index)))
        if calls is None:
            return DeltaMessage(content=content or None)
        return DeltaMessage(
            tool_calls=[
                DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunction(name=c.function.name, arguments=c.function.arguments))
                for i, c in enumerate(calls)
            ]
        )

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(**self._entry(tid, lp.logprob), top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in lp.top])
                for tid, lp in zip(token_ids, logprobs)
            ]
        )

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump_json()


class CompletionRenderer:
    """Text completion bodies and stream chunks for one request."""

    def __init__(self, request_id: str, model: str, token_text: TokenText):
        self.id, self.model, self.created = request_id, model, now()
        self.token_text = token_text
        self._offsets: dict[int, int] = {}
        """Choice index -> where its next token's text starts (streams)."""

    def opening(self, index: int) -> None:
        return None

    def echo(self, index: int, echo: Echo, prompt_logprobs: list[TokenLogprob] | None) -> str:
        """A stream's first chunk of an echoing choice: the prompt (and its log probabilities)."""
        self._offsets[index] = len(echo.text)
        return self._body(
            [CompletionChoice(index=index, text=echo.text, finish_reason=None, logprobs=self._prompt_logprobs(echo, prompt_logprobs))]
        ).model_dump_json()

    def delta(self, index: int, text: str, finish: str | None, token_ids: list[int], logprobs: list[TokenLogprob] | None, want_ids: bool) -> str:
        rendered = self._logprobs(token_ids, logprobs, self._offsets.get(index, 0))
        if rendered is not None and rendered.tokens:
            self._offsets[index] = rendered.text_offset[-1] + len(rendered.tokens[-1])
        return self._body(
            [CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=rendered, token_ids=token_ids if want_ids else None)]
        ).model_dump_json()

    def usage(self, usage: Usage) -> str:
        return self._body([], usage).model_dump_json()

    def whole(self, choices: list[Choice], usage: Usage, want_ids: bool) -> Completion:
        return self._body(
            [
                CompletionChoice(
                    index=i,
                    text=(c.echo.text if c.echo else "") + c.text,
                    finish_reason=c.finish_reason,
                    logprobs=self._whole_logprobs(c),
                    token_ids=c.token_ids if want_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage,
        )

    def _whole_logprobs(self, choice: Choice) -> CompletionLogprobs | None:
        output = self._logprobs(choice.token_ids, choice.logprobs, len(choice.echo.text) if choice.echo else 0)
        if choice.echo is None or output is None:
            return output
        prompt = self._prompt_logprobs(choice.echo, choice.prompt_logprobs)
        return CompletionLogprobs(**{name: getattr(prompt, name) + getattr(output, name) for name in CompletionLogprobs.model_fields})

    def _prompt_logprobs(self, echo: Echo, logprobs: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        """An echoed prompt's tokens: the first with null log probabilities (nothing before it)."""
        if logprobs is None:
            return None
        rest = self._scored(echo.token_ids[1:], logprobs, len(self.token_text(echo.token_ids[0])))
        return CompletionLogprobs(
            tokens=[self.token_text(echo.token_ids[0]), *rest.tokens],
            token_logprobs=[None, *rest.token_logprobs],
            top_logprobs=[None, *rest.top_logprobs],
            text_offset=[0, *rest.text_offset],
        )

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
        return None if logprobs is None else self._scored(token_ids, logprobs, offset)

    def _scored(self, token_ids: list[int], logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        tokens = [self.token_text(t) for t in token_ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[: len(tokens)]
        top: list[dict[str, float] | None] = [{token: lp.logprob, **{self.token_text(t): v for t, v in lp.top}} for token, lp in zip(tokens, logprobs)]
        return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], top_logprobs=top, text_offset=offsets)

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

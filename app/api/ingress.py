"""OpenAI-compatible HTTP API (FastAPI) and the Conductor deployment that serves it.

The ingress and the conductor share one deployment, named `Conductor`, so a
streamed token crosses one Serve hop (engine replica -> here) rather than two.
Its `user_config` carries the live knobs (routing, handoff).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.api import structured
from app.api.admission import Admission, SeatedStream, Seats
from app.api.auth import Caller, api_keys
from app.api.errors import ERROR_RESPONSES, install_error_handlers
from app.api.extensions import ChatOps, ChatOpsRequest, chat_ops
from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.api.openai_responses import (
    ChatCompletion,
    ChatRenderer,
    Choice,
    Completion,
    CompletionRenderer,
    Echo,
    ModelCard,
    ModelList,
    Usage,
    new_request_id,
    now,
)
from app.api.sampling import sampling_options, truncated
from app.api.streams import all_of, merge_streams, prompt_only, sse
from app.api.tool_calls import ToolCalling, parser_factory
from app.conductor.conductor import Conductor
from app.conductor.engine_client import EngineClient
from app.conductor.generation import GenerationRequest, Output
from app.conductor.index_store import IndexStore
from app.conductor.journal import JOURNAL_CAPACITY
from app.conductor.link_directory import LinkDirectory
from app.config import LiveKnobs, Mode, PDDConfig, RoleName
from app.engine.devmodel import resolve_model_source
from app.engine.token_channel import Constraint, TokenLogprob
from app.ray_private import serve_http_host
from app.telemetry.replica_logging import log_to_stderr

logger = logging.getLogger(__name__)


api = FastAPI(title="pdd-serve", version="0.1.0", description="OpenAI-compatible API of a PDD cluster")
install_error_handlers(api)


@serve.deployment(name="Conductor", max_ongoing_requests=1024)
@serve.ingress(api)
class ConductorIngress:
    def __init__(self, config: dict[str, Any], engines: dict[str, DeploymentHandle], links: dict[str, DeploymentHandle]):
        from transformers import AutoTokenizer

        log_to_stderr()

        self.config = PDDConfig.model_validate(config)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(self.config.model.source))
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("model.source: pdd-serve needs a model with a fast (tokenizers) tokenizer")
        self._tool_parsers = parser_factory(self.config.model.tool_call_parser, self.tokenizer)
        self._anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1]
        self._anchor_text = self.tokenizer.decode([self._anchor])
        self._token_texts: dict[int, str] = {}
        handles = {RoleName(role): h for role, h in engines.items()}
        context = serve.get_replica_context()
        self.conductor = Conductor(
            self.config,
            EngineClient(handles),
            LinkDirectory(links),
            self.tokenizer.backend_tokenizer,
            context.replica_id.unique_id,
            IndexStore(context.app_name),
        )
        self.keys = api_keys(self.config.server, serve_http_host())
        self.chat_ops: ChatOps | None = None
        self.admission = Admission(self.config.server.max_concurrent_per_key, self.config.server.max_queued_requests)
        self.created = now()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        self.conductor.reconfigure(LiveKnobs.model_validate(user_config))

    async def reset_prefix_caches(self) -> None:
        """Serve-handle control call (not HTTP): empty every engine's prefix cache."""
        await self.conductor.reset_prefix_caches()

    async def forget_saved_index(self) -> None:
        """Serve-handle control call (not HTTP): the next conductor starts from an empty prefix index."""
        await self.conductor.forget_saved_index()

    # ---- request preparation -------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.config.model.served_name:
            raise APIError(404, f"The model '{model}' does not exist", type="not_found_error", param="model", code="model_not_found")

    def _mode(self, requested: Mode | None) -> Mode:
        if requested is None or requested is self.config.mode:
            return self.config.mode
        if not self.config.server.allow_mode_override:
            raise APIError(400, "pdd_mode: per-request modes are disabled (server.allow_mode_override)", param="pdd_mode")
        return requested

    def _generation_requests(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prefix: str,
        prompt_logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> tuple[str, list[GenerationRequest]]:
        """The response's id and one engine request per choice: prompt i's choice j is choice i*n+j,
        with the request's seed + j (as vLLM seeds its parallel samples). max_tokens 0 (a
        prompt echoed, not continued) asks the engines for one token, which is dropped: they
        generate at least one."""
        n = body.n or 1
        server = self.config.server
        limit, bound = min(
            (server.max_choices_per_request, "server.max_choices_per_request"),
            (server.max_concurrent_per_key, "server.max_concurrent_per_key"),
            (server.max_queued_requests, "server.max_queued_requests"),
        )
        if n * len(prompts) > limit:
            param = "n" if n > 1 else "prompt"
            raise APIError(400, f"{param}: {len(prompts)} prompt(s) x n={n} asks for {n * len(prompts)} choices; at most {limit} ({bound})", param=param)
        request_id = new_request_id(prefix)
        many = n * len(prompts) > 1
        stop, mode, vocab = body.stop_list(), self._mode(body.pdd_mode), len(self.tokenizer)
        gens = []
        for i, ids in enumerate(prompts):
            room = max(1, self._max_new_tokens(body, ids, max_tokens, f"prompt.{i}" if len(prompts) > 1 else None))
            sampling = sampling_options(body, room, vocab, prompt_logprobs, constraint)
            for j in range(n):
                gens.append(
                    GenerationRequest(
                        request_id=f"{request_id}-{i * n + j}" if many else request_id,
                        prompt_token_ids=ids,
                        sampling=sampling if body.seed is None else msgspec.structs.replace(sampling, seed=body.seed + j),
                        stop=stop,
                        mode=mode,
                        include_stop=bool(body.include_stop_str_in_output),
                    )
                )
        return request_id, gens

    def _token_text(self, token_id: int) -> str:
        """A token's text as it reads after another word: decoded alone, a SentencePiece
        tokenizer drops a word's leading space."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([self._anchor, token_id]))[len(self._anchor_text) :]
        return text

    def _max_new_tokens(self, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], max_tokens: int | None, which: str | None) -> int:
        """max_tokens for one prompt, or the 400 that says why it does not fit (`which` names a batch's prompt)."""
        limit = self.config.max_prompt_tokens
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        prompt = f"{which} has" if which else "the prompt has"
        if len(prompt_ids) > limit:
            raise APIError(
                400, f"This model's maximum prompt length is {limit} tokens; {prompt} {len(prompt_ids)}", param=which or field, code="context_length_exceeded"
            )
        room = self.config.model.max_model_len - len(prompt_ids)
        server = self.config.server
        if max_tokens is None:
            return min(server.default_max_tokens, room, server.max_output_tokens)
        if max_tokens > server.max_output_tokens:
            raise APIError(400, f"max_tokens: at most {server.max_output_tokens}", param="max_tokens")
        if max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.config.model.max_model_len} tokens; "
                f"{prompt} {len(prompt_ids)} and max_tokens asks for {max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, "This model has no chat template; use /v1/completions", param="messages")
        messages = [m.model_dump(include={"role", "tool_calls", "tool_call_id"}, exclude_none=True) | {"content": m.text()} for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            if body.add_special_tokens:  # the template's text, tokenized with BOS and the like added, as vLLM does
                text: Any = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
                ids: Any = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            else:  # a list of ids, or a BatchEncoding (by transformers' version)
                ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - templates raise anything on odd input
            raise APIError(400, f"messages: cannot apply the chat template: {exc}", param="messages") from None
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return truncated(ids, body.truncate_prompt_tokens, self.config.model.max_model_len)

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        texts = body.prompt_texts()
        keep, context = body.truncate_prompt_tokens, self.config.model.max_model_len
        if texts is not None:
            special = body.add_special_tokens is not False
            return [truncated(list(ids), keep, context) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]
        prompts = body.prompt_ids() or []
        vocab = len(self.tokenizer)
        for i, ids in enumerate(prompts):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                where = f"prompt.{i}" if isinstance(body.prompt[0], list) else "prompt"
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=where)
        return [truncated(list(ids), keep, context) for ids in prompts]

    # ---- running -------------------------------------------------------------

    @staticmethod
    def _usage(body: ChatCompletionRequest | CompletionRequest, gens: list[GenerationRequest], completion_tokens: int) -> Usage:
        # a prompt counts once however many choices it has (as OpenAI and vLLM count it)
        prompt_tokens = sum(len(g.prompt_token_ids) for g in gens[:: body.n or 1])
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)

    async def _respond(
        self,
        caller: Caller,
        body: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        gens: list[GenerationRequest],
        render: ChatRenderer | CompletionRenderer,
        echoes: Sequence[Echo | None] | None = None,
    ):
        """`echoes`: per choice, the prompt a completion repeats before its text."""
        seats = self.admission.seats(caller.key, len(gens))
        for gen in gens:  # its journey names the caller's key (by a hash)
            gen.key_fingerprint = caller.fingerprint
        want_ids = bool(body.return_token_ids)
        echoes = echoes or [None] * len(gens)
        if body.stream:
            want_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(body, request_id, gens, echoes, seats, render, want_usage, want_ids)
            return SeatedStream(stream, seats, media_type="text/event-stream", headers={"x-request-id": request_id})
        try:
            choices = await all_of([self._whole(gen, echo) for gen, echo in zip(gens, echoes)])
        finally:
            seats.release()
        usage = self._usage(body, gens, sum(tokens for _, tokens in choices))
        return render.whole([choice for choice, _ in choices], usage, want_ids)

    def _outputs(self, gen: GenerationRequest, echo: Echo | None) -> AsyncGenerator[Output, None]:
        outputs = self.conductor.generate(gen)
        return outputs if echo is None or echo.generates else prompt_only(outputs)

    async def _whole(self, gen: GenerationRequest, echo: Echo | None) -> tuple[Choice, int]:
        """One choice's answer and its completion tokens."""
        parts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] | None = None if gen.sampling.logprobs is None else []
        prompt_logprobs = None
        async for out in self._outputs(gen, echo):
            parts.append(out.text)
            ids += out.token_ids
            if logprobs is not None:
                logprobs += out.logprobs or []
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs
            last = out
        return Choice("".join(parts), last.finish_reason, ids, logprobs, echo, prompt_logprobs), last.completion_tokens

    async def _stream(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        gens: list[GenerationRequest],
        echoes: Sequence[Echo | None],
        seats: Seats,
        render,
        want_usage: bool,
        want_ids: bool,
    ) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come, each with its index; usage once all have finished."""
        completion_tokens = 0
        echoing = {index for index, echo in enumerate(echoes) if echo is not None}
        try:
            for index in range(len(gens)):
                opening = render.opening(index)
                if opening is not None:
                    yield sse(opening)
            async with aclosing(merge_streams([self._outputs(gen, echo) for gen, echo in zip(gens, echoes)])) as outputs:
                async for index, out in outputs:
                    if index in echoing:  # the prompt before the choice's first text
                        echoing.discard(index)
                        yield sse(render.echo(index, echoes[index], out.prompt_logprobs))
                    if out.text or out.finish_reason or (out.token_ids and (want_ids or out.logprobs)):
                        yield sse(render.delta(index, out.text, out.finish_reason, out.token_ids, out.logprobs, want_ids))
                    if out.finish_reason:
                        completion_tokens += out.completion_tokens
            if want_usage:
                yield sse(render.usage(self._usage(body, gens, completion_tokens)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            logger.exception("request %s failed mid-stream", request_id)
            yield sse(json.dumps(APIError(500, f"generation failed: {exc}", type="server_error").body()))
        finally:
            seats.release()
        yield b"data: [DONE]\n\n"

    @api.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models(self, request: Request) -> ModelList:
        self.keys.caller(request)
        return ModelList(data=[self._model_card()])

    @api.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def model(self, model: str, request: Request) -> ModelCard:
        self.keys.caller(request)
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.config.model.served_name, created=self.created, max_model_len=self.config.model.max_model_len)

    @api.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        caller = self.keys.caller(request)
        self._check_model(body.model)
        tools, tool_constraint = ToolCalling.of(body, self._tool_parsers)
        constraint = await structured.check(tool_constraint or structured.constraint(body.response_format, body.structured_outputs, body.ignore_eos))
        request_id, gens = self._generation_requests(body, [self._chat_prompt(body)], body.requested_max_tokens(), "chatcmpl", constraint=constraint)
        return await self._respond(caller, body, request_id, gens, ChatRenderer(request_id, body.model, self._token_text, tools))

    @api.post("/v1/completions", response_model=Completion, responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def completions(self, body: CompletionRequest, request: Request):
        caller = self.keys.caller(request)
        self._check_model(body.model)
        prompts = self._completion_prompts(body)
        constraint = await structured.check(structured.constraint(body.response_format, body.structured_outputs, body.ignore_eos))
        request_id, gens = self._generation_requests(body, prompts, body.requested_max_tokens(), "cmpl", body.requested_prompt_logprobs(), constraint)
        echoes = None
        if body.echo:
            texts = body.prompt_texts() or self.tokenizer.batch_decode(prompts, skip_special_tokens=True)
            echoes = [Echo(text, ids, body.max_tokens != 0) for text, ids in zip(texts, prompts) for _ in range(body.n or 1)]
        return await self._respond(caller, body, request_id, gens, CompletionRenderer(request_id, body.model, self._token_text), echoes)

    @api.get("/pdd/requests", responses=ERROR_RESPONSES)
    async def recent_journeys(self, request: Request, limit: Annotated[int, Query(ge=1, le=JOURNAL_CAPACITY)] = 100) -> dict[str, Any]:
        """The newest journeys: every user's for an operator key, its own requests' for an inference key."""
        owner = self.keys.caller(request).listed_owner
        return {"requests": [j.to_dict() for j in self.conductor.journal.recent(limit, owner)]}

    @api.get("/pdd/requests/{request_id}", responses=ERROR_RESPONSES)
    async def journey(self, request_id: str, request: Request) -> dict[str, Any]:
        caller = self.keys.caller(request)
        j = self.conductor.journal.get(request_id)
        if j is None or not caller.may_read(j.key_fingerprint):  # another key's: as if absent
            raise APIError(
                404,
                f"No request '{request_id}' in the journal (it keeps the last {self.conductor.journal.capacity})",
                type="not_found_error",
                param="request_id",
            )
        return j.to_dict()

    @api.get("/pdd/state", responses=ERROR_RESPONSES)
    async def state(self, request: Request) -> dict[str, Any]:
        """Roles and replicas per node group, live knobs, links, recent SLO figures (operator keys)."""
        self.keys.operator(request)
        return await self.conductor.state()

    @api.post("/pdd/chat", responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat(self, body: ChatOpsRequest, request: Request) -> StreamingResponse:
        """Chat-ops (agents/chatops): an answer about the cluster as SSE, then the figures it used; read-only."""
        key = self.keys.operator(request).key
        if self.chat_ops is None:  # built on first use: most replicas never chat
            self.chat_ops = chat_ops(self.config, self.conductor, serve.get_replica_context().app_name)
        return await self.chat_ops.respond(body, key)

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        """Liveness: the ingress answers (engines may still be starting: see /ready)."""
        return {"status": "ok"}

    @api.get("/ready", responses={503: {"description": "No request can be served: no engine of a role every request needs is live"}})
    async def ready(self) -> JSONResponse:
        """Readiness: which roles have a live engine; 503 only while no request could be served."""
        body = await self.conductor.readiness()
        return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)

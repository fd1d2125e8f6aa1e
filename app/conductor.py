"""Runs one request through its pipeline and turns engine tokens into client text."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenizers import Tokenizer

from app.config import LiveKnobs, Mode, PDDConfig, RoleName
from app.engine_client import EngineClient
from app.journal import Journal, Journey
from app.textstream import TextAssembler
from app.token_channel import EngineRequest, SamplingOptions

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine reported a failure for this request."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stop: list[str]
    mode: Mode


@dataclass
class Output:
    """What the ingress sends on: new text, and on the last one the finish reason."""

    text: str
    completion_tokens: int
    """Tokens produced so far (usage)."""
    finish_reason: str | None = None


@dataclass
class _Tokens:
    """Tokens from one engine, in client order."""

    token_ids: list[int]
    role: RoleName
    finish_reason: str | None = None


class Conductor:
    def __init__(self, config: PDDConfig, engines: EngineClient, tokenizer: Tokenizer):
        self.config = config
        self.engines = engines
        self.tokenizer = tokenizer
        self.knobs = config.live_knobs()
        self.journal = Journal()

    def reconfigure(self, knobs: LiveKnobs) -> None:
        self.knobs = knobs

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Output]:
        journey = self.journal.add(
            Journey(
                request_id=req.request_id,
                mode=req.mode.value,
                prompt_tokens=len(req.prompt_token_ids),
                max_tokens=req.sampling.max_tokens,
            )
        )
        assembler = TextAssembler(self.tokenizer, req.prompt_token_ids, req.stop)
        last_token_at: float | None = None
        max_gap = 0.0
        finish_reason: str | None = None
        pipeline = self._pipeline(req, journey)
        try:
            async for batch in pipeline:
                now = time.monotonic()
                if batch.token_ids:
                    if last_token_at is None:
                        journey.ttft_ms = (time.time() - journey.started_at) * 1000
                    else:
                        max_gap = max(max_gap, now - last_token_at)
                    last_token_at = now
                    journey.note_tokens(batch.role.value, len(batch.token_ids))
                delta = assembler.feed(batch.token_ids)
                journey.completion_tokens = assembler.num_tokens
                if delta.stopped:
                    finish_reason = "stop"
                    if delta.text:
                        yield Output(delta.text, assembler.num_tokens)
                    break
                if batch.finish_reason is not None:
                    finish_reason = batch.finish_reason
                    tail = assembler.finish()
                    yield Output(delta.text + tail, assembler.num_tokens)
                    break
                if delta.text:
                    yield Output(delta.text, assembler.num_tokens)
        except BaseException as exc:
            journey.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await pipeline.aclose()
            journey.max_gap_ms = max_gap * 1000
            journey.finish_reason = finish_reason
            journey.finished_at = time.time()
        yield Output("", assembler.num_tokens, finish_reason=_openai_finish_reason(finish_reason))

    async def _pipeline(self, req: GenerationRequest, journey: Journey) -> AsyncIterator[_Tokens]:
        if req.mode is Mode.colocated:
            async for t in self._colocated(req, journey):
                yield t
        else:
            raise NotImplementedError(f"mode {req.mode.value} is not built yet")

    async def _colocated(self, req: GenerationRequest, journey: Journey) -> AsyncIterator[_Tokens]:
        journey.pipeline = "colocated"
        role = RoleName.main_decode
        replica = await self.engines.pick(role)
        journey.replicas[role.value] = replica.replica_id
        request = EngineRequest(req.request_id, req.prompt_token_ids, req.sampling)
        async for delta in self.engines.stream(replica, request):
            if delta.error:
                raise EngineError(f"{role.value} engine failed: {delta.error}")
            if delta.num_cached_tokens is not None:
                journey.hit_tokens[role.value] = delta.num_cached_tokens
            yield _Tokens(delta.token_ids, role, delta.finish_reason if delta.finished else None)


def _openai_finish_reason(reason: str | None) -> str:
    # vLLM says "length" / "stop" / "abort"; OpenAI knows "length" and "stop".
    return "length" if reason == "length" else "stop"

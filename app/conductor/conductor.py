"""Runs one request through its pipeline and turns engine tokens into client text.

Pipelines yield token batches in client order, each tagged with the role that
produced it; `Conductor.generate` assembles text (stop strings included), times
every token, records the journey and the metrics. The pipelines live beside it:
baselines.py (colocated, PD) and relay.py (PDD), each given an EngineOps
(engine_ops.py), never the conductor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from app.conductor.baselines import colocated, disaggregated
from app.conductor.engine_client import EngineClient
from app.conductor.engine_ops import EngineOps
from app.conductor.gaps import GapModel
from app.conductor.generation import EngineError, GenerationRequest, Output, PrefillUnavailable, RequestTimeout, Tokens
from app.conductor.index_store import IndexStore
from app.conductor.journal import Journal, Journey, slo_summary
from app.conductor.link_accounts import LinkAccounts
from app.conductor.placement import Placement
from app.conductor.readiness import readiness
from app.conductor.relay import pdd_pipeline
from app.conductor.textstream import TextAssembler
from app.config import LiveKnobs, Mode, PDDConfig, RoleName
from app.engine.token_channel import TokenLogprob
from app.telemetry import metrics

if TYPE_CHECKING:
    from app.conductor.link_directory import LinkDirectory


def numeric_knobs(knobs: LiveKnobs) -> dict[str, float]:
    """Live knobs as dotted paths with numeric values (e.g. routing.max_wan_transfer_ms)."""
    flat: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix] = float(value)

    walk("", knobs.model_dump(mode="json"))
    return flat


@dataclass
class TokenClock:
    """When a request's tokens reached the conductor: its TTFT, decode time and worst gap."""

    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    last_at: float | None = None
    max_gap: float = 0.0

    def tick(self) -> bool:
        """Tokens arrived now; True for the first ones."""
        now = time.monotonic()
        last, self.last_at = self.last_at, now
        if last is None:
            self.first_at = now
            return True
        self.max_gap = max(self.max_gap, now - last)
        return False

    def close(self, journey: Journey) -> None:
        first, last = self.first_at, self.last_at
        journey.ttft_ms = None if first is None else (first - self.started) * 1000
        journey.decode_ms = None if first is None or last is None else (last - first) * 1000
        journey.max_gap_ms = self.max_gap * 1000


class Conductor:
    def __init__(
        self, config: PDDConfig, engines: EngineClient, links: LinkDirectory, tokenizer: Tokenizer, replica_id: str = "", index_store: IndexStore | None = None
    ):
        self.config = config
        self.replica_id = replica_id
        self.engines = engines
        self.links = links
        self.tokenizer = tokenizer
        self.journal = Journal()
        self.in_flight = 0
        self.placement = Placement(config, engines, index_store)
        self.accounts = LinkAccounts(config.link, config.kv)
        self.ops = EngineOps(config, engines, links, self.placement, self.accounts)

    @property
    def knobs(self) -> LiveKnobs:
        return self.ops.knobs

    def reconfigure(self, knobs: LiveKnobs) -> None:
        self.ops.knobs = knobs
        for name, value in numeric_knobs(knobs).items():
            metrics.registry().set(metrics.KNOB, value, knob=name)

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Output, None]:
        self.placement.keeper.keep_saved(lambda: self.placement.index)
        journey = self.journal.add(
            Journey(
                request_id=req.request_id,
                mode=req.mode.value,
                prompt_tokens=len(req.prompt_token_ids),
                max_tokens=req.sampling.max_tokens,
                key_fingerprint=req.key_fingerprint,
            )
        )
        assembler = TextAssembler(
            self.tokenizer,
            req.prompt_token_ids,
            req.stop,
            min_tokens=req.sampling.min_tokens,
            stop_token_ids=req.sampling.stop_token_ids,
            include_stop=req.include_stop,
        )
        clock = TokenClock()
        finish_reason: str | None = None
        text = ""
        pending_ids: list[int] = []
        pending_logprobs: list[TokenLogprob] | None = None if req.sampling.logprobs is None else []
        prompt_logprobs: list[TokenLogprob] | None = None
        outcome = "cancelled"
        pipeline = self._pipeline(req, journey)
        self._count_in_flight(+1)
        try:
            deadline = asyncio.get_running_loop().time() + self.config.server.request_timeout_s
            while True:
                try:
                    # a bound on every wait: a stuck engine or link cannot hang the request
                    async with asyncio.timeout_at(deadline):
                        batch = await anext(pipeline)
                except StopAsyncIteration:
                    break
                if batch.token_ids:
                    if clock.tick():
                        prompt_logprobs = self._prompt_logprobs(req, batch)
                    journey.note_tokens(batch.role.value, len(batch.token_ids))
                delta = assembler.feed(batch.token_ids)
                pending_ids += batch.token_ids[: delta.num_tokens]
                if pending_logprobs is not None:
                    pending_logprobs += (batch.logprobs or [])[: delta.num_tokens]
                journey.completion_tokens = assembler.num_tokens
                if delta.stopped or batch.finish_reason is not None:
                    finish_reason = "stop" if delta.stopped else batch.finish_reason
                    text = delta.text if delta.stopped else delta.text + assembler.finish()
                    break
                if delta.text:
                    yield Output(delta.text, assembler.num_tokens, token_ids=pending_ids, logprobs=pending_logprobs, prompt_logprobs=prompt_logprobs)
                    pending_ids, prompt_logprobs = [], None
                    pending_logprobs = None if pending_logprobs is None else []
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            outcome = "error"
            journey.error = f"timed out after {self.config.server.request_timeout_s:g} s"
            raise RequestTimeout(journey.error) from None
        except Exception as exc:
            outcome = "error"
            journey.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._count_in_flight(-1)
            await pipeline.aclose()
            clock.close(journey)
            journey.finish_reason, journey.outcome, journey.finished_at = finish_reason, outcome, time.time()
            metrics.record_journey(journey, self.config.slo, outcome)
        if text or pending_ids or prompt_logprobs:
            yield Output(text, assembler.num_tokens, token_ids=pending_ids, logprobs=pending_logprobs, prompt_logprobs=prompt_logprobs)
        yield Output("", assembler.num_tokens, finish_reason="length" if finish_reason == "length" else "stop")

    @staticmethod
    def _prompt_logprobs(req: GenerationRequest, first: Tokens) -> list[TokenLogprob] | None:
        """The prompt's log probabilities, which come with the first token, or an EngineError
        if the engine that computed the prompt did not send them asked."""
        if req.sampling.prompt_logprobs is not None and first.prompt_logprobs is None:
            raise EngineError(f"the {first.role.value} engine sent no prompt log probabilities")
        return first.prompt_logprobs

    async def _pipeline(self, req: GenerationRequest, journey: Journey) -> AsyncGenerator[Tokens, None]:
        if req.mode is Mode.colocated:
            stream = colocated(self.ops, req, journey, RoleName.main_decode)
        elif req.mode is Mode.pd_intra_dc:
            stream = disaggregated(self.ops, req, journey, RoleName.relay_decode, first_token_from_prefill=True)
        elif req.mode in (Mode.pd_cross_dc_naive, Mode.pd_cross_dc):
            stream = disaggregated(self.ops, req, journey, RoleName.main_decode, first_token_from_prefill=False, decoder_cache=req.mode is Mode.pd_cross_dc)
        else:
            stream = pdd_pipeline(self.ops, req, journey)
        try:
            async with aclosing(stream):
                async for batch in stream:
                    yield batch
        except PrefillUnavailable as exc:  # nothing was sent yet: a decoder computes it all
            decoder = RoleName.main_decode if RoleName.main_decode in self.engines.roles() else RoleName.relay_decode
            journey.failovers.append({"from_role": "prefill", "to_role": decoder.value, "at_token": 0, "error": str(exc)})
            metrics.registry().inc(metrics.FAILOVERS, from_role="prefill", to_role=decoder.value)
            async with aclosing(colocated(self.ops, req, journey, decoder)) as fallback:
                async for batch in fallback:
                    yield batch

    async def save_index(self) -> None:
        await self.placement.keeper.save(self.placement.index)

    async def reset_prefix_caches(self) -> None:
        """Cold caches everywhere, and routing's gap model as new (benchmarks compare modes from the same start)."""
        await self.engines.reset_prefix_caches()
        await self.placement.forget_all()
        self.ops.gaps = GapModel()

    async def forget_saved_index(self) -> None:
        """The next conductor starts from an empty prefix index (IndexKeeper.forget)."""
        await self.placement.keeper.forget()

    def _count_in_flight(self, delta: int) -> None:
        self.in_flight += delta
        metrics.registry().set(metrics.IN_FLIGHT, self.in_flight, replica=self.replica_id)

    async def readiness(self) -> dict[str, Any]:
        """What GET /ready answers (app/conductor/readiness.py): never waits for a replica to describe itself."""
        configured = {role: rc.replicas for role, rc in self.config.roles.present().items() if role in self.engines.roles()}
        live = {role: len(await self.engines.replicas(role, wait=False)) for role in configured}
        return readiness(self.config.mode, configured, live)

    async def state(self) -> dict[str, Any]:
        """What GET /pdd/state returns (people, `pdd status`, chat-ops)."""
        cfg = self.config
        roles = {}
        for role, rc in cfg.roles.present().items():
            replicas = await self.engines.replicas(role) if role in self.engines.roles() else []
            group = cfg.node_groups[rc.node_group]
            roles[role.value] = {
                "node_group": rc.node_group,
                "datacenter": group.datacenter,
                "accelerator": group.accelerator,
                "configured_replicas": rc.replicas,
                "max_replicas": rc.max_replicas,
                "replicas": [
                    {
                        "replica_id": i.replica_id,
                        "node_ip": i.node_ip,
                        "node_id": i.node_id,
                        "in_flight": self.engines.load(i.replica_id),
                        "warming": self.placement.warming(i.replica_id),
                        "kv_blocks": i.num_kv_blocks,
                        "known_blocks": self.placement.index.held_blocks(i.replica_id),
                        "model_runner": i.model_runner,
                    }
                    for i in replicas
                ],
            }
        return {
            "mode": cfg.mode.value,
            "model": cfg.model.served_name,
            "roles": roles,
            "node_groups": {name: g.model_dump(mode="json", include={"datacenter", "accelerator", "cost_per_hour"}) for name, g in cfg.node_groups.items()},
            "knobs": self.knobs.model_dump(mode="json"),
            "links": {name: {**counters, "backlog_bytes": self.accounts.backlog(name)} for name, counters in (await self.links.counters()).items()},
            "in_flight": self.in_flight,
            "prefix_index_saved_at": self.placement.keeper.saved_at,
            "slo": {"targets": cfg.slo.model_dump(mode="json"), "recent": slo_summary(self.journal.recent(self.journal.capacity), cfg.slo, cfg.slo.window_s)},
        }

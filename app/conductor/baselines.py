"""The baselines PDD is measured against: one engine alone, and classic prefill/decode disaggregation."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from app.conductor.engine_ops import EngineOps, lease_of
from app.conductor.generation import GenerationRequest, Tokens
from app.conductor.journal import Journey
from app.config import RoleName
from app.engine.token_channel import EngineRequest
from app.policy import Pipeline


async def colocated(ops: EngineOps, req: GenerationRequest, journey: Journey, role: RoleName) -> AsyncGenerator[Tokens, None]:
    """One engine computes the prompt and every token."""
    journey.pipeline = journey.pipeline or Pipeline.colocated.value
    keys = ops.placement.keys(req.prompt_token_ids)
    replica, _ = await ops.placement.route(role, keys, journey)
    request = EngineRequest(req.request_id, req.prompt_token_ids, req.sampling)
    async with aclosing(ops.served(role, replica, request, req, journey, [], keys=keys)) as stream:
        async for served_by, delta in stream:
            yield Tokens(delta.token_ids, served_by, delta.finish_reason if delta.finished else None, delta.logprobs, delta.prompt_logprobs)


async def disaggregated(
    ops: EngineOps, req: GenerationRequest, journey: Journey, decode_role: RoleName, *, first_token_from_prefill: bool, decoder_cache: bool = True
) -> AsyncGenerator[Tokens, None]:
    """Classic disaggregation: P prefills, one decoder pulls the KV and decodes the rest.

    Across datacenters (pd_cross_dc, pd_cross_dc_naive) the client sees the first token
    only once the decoder produced its own, as vLLM's disaggregated-prefill proxy does.
    Without `decoder_cache` (pd_cross_dc_naive) the whole prompt KV crosses the WAN: no
    decoder-side prefix cache shrinks it. With it, the decoder pulls only what its cache
    lacks, and routing keeps a conversation on the decoder that holds it.
    """
    if first_token_from_prefill:
        journey.pipeline = Pipeline.p_d.value
    else:
        journey.pipeline = (Pipeline.p_d_cross if decoder_cache else Pipeline.p_d_naive).value
    keys = ops.placement.keys(req.prompt_token_ids)
    first, _ = await ops.prefill(req, journey, consumers=1, keys=keys)
    last = await ops.ended_on_prefill(req, first, consumers=1)
    if last is not None:
        yield last
        return
    if first_token_from_prefill:
        yield Tokens(first.token_ids, RoleName.prefill, logprobs=first.logprobs, prompt_logprobs=first.prompt_logprobs)
    replica, _ = await ops.placement.route(decode_role, keys, journey)
    if not decoder_cache:  # salted: the decoder's cache will not hold this prompt
        ops.placement.unroute(replica, keys)
    salt = None if decoder_cache else req.request_id
    decode = ops.continue_on(decode_role, replica, req, journey, first, lease_of(first), keys, cache_salt=salt, hold_first=not first_token_from_prefill)
    async with aclosing(decode):
        async for batch in decode:
            yield batch

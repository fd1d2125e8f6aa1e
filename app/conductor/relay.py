"""PDD: route by expected WAN transfer; relay on RLD while MD pulls; hand over by extend-decode.

P-RLD-MD, step by step (docs/design.md, Request flow):
1. P prefills and its first token goes to the client at once.
2. RLD pulls the prompt KV over the intra-datacenter link and keeps decoding;
   its tokens go to the client as they come ("eager" tokens).
3. Meanwhile MD warms: a one-token request pulls only the blocks MD lacks over
   the WAN, which fills MD's prefix cache.
4. Handoff: MD gets prompt + the eager token IDs (never their KV) and
   recomputes them in one extend step (catch-up: a first slice while RLD
   continues, then the rest). RLD is aborted at the handoff point; the client
   stream continues from MD with no gap, duplicate or missing token.

P-P-MD, while no relay decoder is alive: the same, with the prefill replica that
computed the prompt as the relay (its prefix cache holds the prompt's KV, leased
for MD's pull, so step 2 pulls nothing).

All decisions (pipeline, handoff mode and steps, relay cap) come from
app/policy.py, the functions the digital twin runs too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from app.conductor.engine_client import NoReplicaError
from app.conductor.engine_ops import EngineOps, lease_of
from app.conductor.gaps import note_decision
from app.conductor.generation import ENGINE_FAILURES, GenerationRequest, Tokens, note_failover
from app.conductor.journal import Journey
from app.config import RoleName
from app.engine.kv.link import direction_name
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import EngineDelta, EngineRequest
from app.policy import (
    ClusterFacts,
    HandoffStep,
    LinkFacts,
    Pipeline,
    RelayMachine,
    RelayPhase,
    RequestFacts,
    choose_pipeline,
)
from app.telemetry import metrics

logger = logging.getLogger(__name__)


def occupancy(ops: EngineOps, role: RoleName, replica: ReplicaInfo) -> float:
    """Requests the conductor has in flight on `replica` over its batch limit."""
    return ops.engines.load(replica.replica_id) / ops.config.roles.of(role).engine.max_num_seqs


async def rld_load(ops: EngineOps) -> tuple[ReplicaInfo | None, float]:
    """The least loaded RLD replica and its occupancy (relays in flight / batch limit).
    A request can do without a relay: it does not wait for a new RLD replica's description."""
    infos = await ops.engines.replicas(RoleName.relay_decode, wait=False)
    if not infos or ops.config.roles.relay_decode is None:
        return None, 1.0
    best = min(infos, key=lambda i: ops.engines.load(i.replica_id))
    return best, occupancy(ops, RoleName.relay_decode, best)


async def pdd_pipeline(ops: EngineOps, req: GenerationRequest, journey: Journey) -> AsyncGenerator[Tokens, None]:
    keys = ops.placement.keys(req.prompt_token_ids)
    try:
        md, md_cached = await ops.placement.route(RoleName.main_decode, keys, journey)
    except NoReplicaError:  # datacenter B is down: datacenter A serves alone
        md, md_cached = None, 0
    # a previous turn's warm-up still pulling into this MD: count its blocks, wait for it
    pending, covered = ops.placement.pending_warm(md, keys) if md is not None else (None, 0)
    md_cached = max(md_cached, covered * ops.config.model.block_size)
    rld, load = await rld_load(ops)
    shape = md or rld
    if shape is None:
        raise NoReplicaError("neither a main decoder nor a relay decoder is alive")
    p_dc = ops.config.datacenter_of(RoleName.prefill)
    md_dc = ops.config.datacenter_of(RoleName.main_decode)
    link = ops.config.link(p_dc, md_dc)
    wan = direction_name(p_dc, md_dc)
    wan_down = await ops.links.down_reason(p_dc, md_dc)
    md_batch = ops.config.roles.of(RoleName.main_decode).engine.max_num_seqs
    md_wait, correction = ops.gaps.md_side(wan, md.replica_id, ops.engines.load(md.replica_id), md_batch) if md is not None else (0.0, 0.0)
    decision = choose_pipeline(
        RequestFacts(len(req.prompt_token_ids), req.sampling.max_tokens, md_cached),
        ClusterFacts(
            kv_bytes_per_block=shape.kv_bytes_per_block,
            block_size=shape.block_size,
            wan=LinkFacts(link.bytes_per_s, link.rtt_ms / 1000),
            rld_load=load,
            rld_available=rld is not None,
            wan_up=wan_down is None,
            md_available=md is not None,
            wan_backlog_bytes=ops.accounts.backlog(wan),
            md_wait_ms=md_wait,
            gap_correction_ms=correction,
        ),
        ops.knobs.routing,
    )
    note_decision(journey, decision, md_wait, correction, wan, load)
    if wan_down is not None:
        journey.decision["wan_down"] = wan_down
    consumers = 2 if decision.pipeline is Pipeline.p_rld_md else 1
    first, p = await ops.prefill(req, journey, consumers, keys)
    last = await ops.ended_on_prefill(req, first, consumers)
    if last is not None:
        yield last
        return
    lease = lease_of(first)
    yield Tokens(first.token_ids, RoleName.prefill, logprobs=first.logprobs, prompt_logprobs=first.prompt_logprobs)
    first_sent = time.monotonic()

    wan_bytes = decision.blocks_to_send * shape.kv_bytes_per_block
    # choose_pipeline names only pipelines whose decoders are alive; a relay hands MD P's lease
    if decision.pipeline is Pipeline.p_md:
        assert md is not None
        await ops.placement.await_warm(pending)
        stream = ops.continue_on(RoleName.main_decode, md, req, journey, first, lease, keys, expected_bytes=wan_bytes)
        stream = ops.gaps.timed(stream, journey, first_sent, wan, md.replica_id, decision.uncorrected_gap_ms)
    elif decision.pipeline is Pipeline.p_rld:
        if md is not None:  # singular, or WAN down: MD never sees this request
            ops.placement.unroute(md, keys)
        assert rld is not None
        journey.replicas[RoleName.relay_decode.value] = rld.replica_id
        stream = ops.continue_on(RoleName.relay_decode, rld, req, journey, first, lease, keys)
    elif decision.pipeline is Pipeline.p_p_md:  # no relay decoder alive: P relays what it prefilled
        assert md is not None and lease is not None
        stream = Relay(ops, req, journey, md, RoleName.prefill, p, p, first, lease, keys, occupancy(ops, RoleName.prefill, p), wan_bytes, pending).run()
    else:
        assert md is not None and rld is not None and lease is not None
        journey.replicas[RoleName.relay_decode.value] = rld.replica_id
        stream = Relay(ops, req, journey, md, RoleName.relay_decode, rld, p, first, lease, keys, load, wan_bytes, pending).run()
    async with aclosing(stream):
        async for batch in stream:
            yield batch


_END = object()


class Relay:
    """One P-RLD-MD request from the first token on (P-P-MD: the relay is the prefill
    replica, which holds the prompt's KV already and pulls nothing)."""

    def __init__(
        self,
        ops: EngineOps,
        req: GenerationRequest,
        journey: Journey,
        md: ReplicaInfo,
        relay_role: RoleName,
        relay: ReplicaInfo,
        prefill: ReplicaInfo,
        first: EngineDelta,
        lease: dict[str, Any],
        keys: list[int],
        load: float,
        wan_bytes: int,
        previous_warm: asyncio.Task | None,
    ):
        self.ops, self.req, self.journey = ops, req, journey
        self.md, self.relay_role, self.relay, self.first, self.lease, self.keys = md, relay_role, relay, first, lease, keys
        self.prefill = prefill
        """The replica that prefilled the prompt (and still holds it): the relay's fallback."""
        self.machine = RelayMachine.start(ops.knobs.handoff, load)
        self.wan_bytes = wan_bytes
        self.previous_warm = previous_warm
        self.out: list[int] = list(first.token_ids)
        """Tokens the client has: P's first, then the relay's (the eager tokens MD must catch up on)."""
        self.handed = 0
        """Tokens of `out` whose KV MD's last finished step computed."""
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pump: asyncio.Task | None = None
        self.next_item: asyncio.Task | None = None
        self.md_task: asyncio.Task | None = None

    def _md_request(self, suffix: str, tokens: list[int], max_tokens: int, kv: dict[str, Any] | None = None) -> EngineRequest:
        return EngineRequest(
            f"{self.req.request_id}-{suffix}",
            self.req.prompt_token_ids + tokens,
            self.req.sampling.continued(len(tokens), max_tokens),
            kv_transfer_params=kv,
        )

    async def _md_step(self, request: EngineRequest) -> None:
        """A one-token MD request: pull (warm) or extend (catch-up); its token is discarded."""
        async for _ in self.ops.decode_stream(RoleName.main_decode, self.md, request, self.journey):
            pass

    async def _warm(self, request: EngineRequest) -> None:
        await self.ops.placement.await_warm(self.previous_warm)  # then MD holds what it pulled: only the rest crosses
        await self._md_step(request)

    async def _pump(self, request: EngineRequest, queue: asyncio.Queue) -> None:
        try:
            async for delta in self.ops.decode_stream(self.relay_role, self.relay, request, self.journey):
                queue.put_nowait(delta)
                if delta.finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the relay failed: P relays on, or MD takes over early
            if isinstance(exc, ENGINE_FAILURES):  # the next requests do not try it while Serve replaces it
                self.ops.engines.suspect(self.relay.replica_id)
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    async def run(self) -> AsyncGenerator[Tokens, None]:
        """RLD relays while MD warms and catches up (RelayMachine decides each step), then MD
        continues the stream; or RLD finishes the request, and MD catches up in the background."""
        warm = self._md_request("warm", list(self.out), 1, await self.ops.pull_params(self.lease, self.md.datacenter, self.wan_bytes))
        self._start_pump(await self._relay_request())
        self.md_task = asyncio.create_task(self._warm(warm))
        self.ops.placement.track_warm(self.md, self.keys, self.md_task)
        machine = self.machine
        try:
            while machine.phase in (RelayPhase.relaying, RelayPhase.waiting):
                relaying = machine.phase is RelayPhase.relaying
                waiting = {t for t in (self.md_task, self.next_item if relaying else None) if t is not None}
                if not waiting:  # the relay stopped and MD failed: the final step fails over
                    break
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if relaying and self.next_item in done:
                    batch = self._on_relay_item(self.next_item.result())
                    if batch is not None:
                        yield batch
                    if machine.phase is RelayPhase.relay_finished:
                        return
                if self.md_task is not None and self.md_task in done:
                    self._on_md_step(self.md_task)
        except GeneratorExit:
            # the client's stream ended during the relay (the conductor stops reading at a stop
            # string): the turn is over, as if RLD had finished it, and MD's cache must not fall
            # behind P's, so MD still catches up on it for the conversation's next turn
            if machine.phase is RelayPhase.relaying and self.md_task is not None:
                self._relay_ended("the stream ended during the relay")
            raise
        finally:
            for task in (self.next_item, self.pump):
                if task is not None:
                    task.cancel()
            if self.md_task is not None and not self.md_task.done():
                self.md_task.cancel()
        async with aclosing(self._final_step()) as final:
            async for batch in final:
                yield batch

    async def _relay_request(self) -> EngineRequest:
        if self.relay_role is not RoleName.relay_decode:
            return self._prefill_relay_request()
        req = self.req
        return EngineRequest(
            f"{req.request_id}-rld",
            req.prompt_token_ids + self.out,
            req.sampling.continued(len(self.out)),
            kv_transfer_params=await self.ops.pull_params(self.lease, self.relay.datacenter),
        )

    def _start_pump(self, request: EngineRequest) -> None:
        self.queue = asyncio.Queue()
        self.pump = asyncio.create_task(self._pump(request, self.queue))
        self.next_item = asyncio.create_task(self.queue.get())

    def _on_relay_item(self, item: EngineDelta | Exception | object) -> Tokens | None:
        """The relay's next delta, failure or end: the tokens the client takes from it, if any."""
        machine = self.machine
        if isinstance(item, Exception) and self.relay_role is RoleName.relay_decode:
            self.journey.decision["rld_failure"] = f"{type(item).__name__}: {item}"
            if self._relay_on_prefill(item):
                self._start_pump(self._prefill_relay_request())
            else:
                machine.relay_stopped()
            return None
        if not isinstance(item, EngineDelta):  # a failed prefill relay, or the stream's end
            machine.relay_stopped()
            return None
        tokens = item.token_ids[: machine.take(len(item.token_ids), item.finished)]
        logprobs = None if item.logprobs is None else item.logprobs[: len(tokens)]
        self.out += tokens
        if machine.phase is RelayPhase.relay_finished:
            self._relay_ended("relay finished the request")
            return Tokens(tokens, self.relay_role, item.finish_reason, logprobs)
        if machine.phase is RelayPhase.waiting:
            self.journey.decision["relay_capped_at"] = machine.cap
            # RLD's request ends at its cap: its batch slot is what the cap protects, and past
            # it its tokens would only be discarded (an MD that fails now is replaced by the
            # final step's failover, not by RLD)
            if self.pump is not None:
                self.pump.cancel()
        else:
            self.next_item = asyncio.create_task(self.queue.get())
        return Tokens(tokens, self.relay_role, logprobs=logprobs) if tokens else None

    def _on_md_step(self, task: asyncio.Task) -> None:
        """MD's step ended: a catch-up round starts, or the final step is next."""
        self.md_task = None
        if task.exception() is not None:
            # MD cannot take over: the relay finishes the request if it can; otherwise
            # the final step fails over to another decoder
            self.ops.engines.suspect(self.md.replica_id)
            self.journey.decision["md_failure"] = f"{type(task.exception()).__name__}: {task.exception()}"
            self.machine.md_failed(self.req.sampling.max_tokens)
            return
        self.handed = len(self.first.token_ids) + self.machine.sent
        if self.machine.md_step_done() is HandoffStep.catch_up:
            request = self._md_request(f"cu{self.machine.rounds}", list(self.out), 1)
            self.md_task = asyncio.create_task(self._md_step(request))

    def _relay_ended(self, reason: str) -> None:
        """The turn ended on the relay: MD catches up on it in the background."""
        self._finish_md_in_background(self.md_task)
        self.md_task = None
        self.journey.handoff = {"mode": "none", "point": len(self.out), "reason": reason}

    async def _final_step(self) -> AsyncGenerator[Tokens, None]:
        """RLD is stopped (its request aborted), and MD continues from every token the client has."""
        req, machine = self.req, self.machine
        discarded = sum(len(d.token_ids) for d in _drain(self.queue))
        t_handoff = time.monotonic()
        final = self._md_request("md", list(self.out), req.sampling.max_tokens - len(self.out))
        self.journey.handoff = {
            "mode": machine.mode.value,
            "point": len(self.out),
            "steps": machine.rounds + 1,
            "tokens": len(self.out),
            "final_step_tokens": len(self.out) - self.handed,
            "relay_tokens": len(self.out) - 1,
            "relay_tokens_discarded": discarded,
            "latency_ms": None,
        }
        stream = self.ops.served(RoleName.main_decode, self.md, final, req, self.journey, list(self.out), keys=None)
        async with aclosing(stream):
            async for served_by, delta in stream:
                if delta.token_ids and self.journey.handoff["latency_ms"] is None:
                    self.journey.handoff["latency_ms"] = (time.monotonic() - t_handoff) * 1000
                if delta.token_ids or delta.finished:
                    yield Tokens(delta.token_ids, served_by, delta.finish_reason if delta.finished else None, delta.logprobs)

    def _relay_on_prefill(self, failure: Exception) -> bool:
        """RLD failed mid-relay: the prefill replica takes the relay over from the tokens sent
        (as P-P-MD's relay), so the stream does not wait for MD's pull. True if it does."""
        if not self.ops.knobs.routing.prefill_relays:
            return False
        note_failover(self.journey, (self.relay_role, self.relay), (RoleName.prefill, self.prefill), len(self.out), failure)
        self.relay_role, self.relay = RoleName.prefill, self.prefill
        return True

    def _prefill_relay_request(self) -> EngineRequest:
        """The prefill replica relays from the tokens sent; its own prefix cache holds the prompt."""
        return EngineRequest(
            f"{self.req.request_id}-prelay",
            self.req.prompt_token_ids + self.out,
            self.req.sampling.continued(len(self.out)),
        )

    def _finish_md_in_background(self, md_task: asyncio.Task | None) -> None:
        """The relay finished the request. MD's warm-up still runs to completion, then
        MD extends over the relay's tokens, recomputed from their ids as at a handoff:
        MD's cache then holds the whole turn, and the conversation's next turn pulls
        only what is new (not the answer's KV over the WAN, turn after turn)."""
        if md_task is None:
            return
        ops, md, journey, prompt = self.ops, self.md, self.journey, self.req.prompt_token_ids
        sync = self._md_request("sync", list(self.out), 1)
        turn = sync.prompt_token_ids

        async def bring_md_along() -> None:
            await md_task
            ops.placement.remember(md, prompt + self.first.token_ids)
            metrics.record_kv(journey)  # the warm's pull and MD's hit, after the request ended
            await self._md_step(sync)
            ops.placement.remember(md, turn)

        task = asyncio.create_task(bring_md_along())
        ops.placement.track_warm(md, ops.placement.keys(turn), task)  # the next turn waits for it, then pulls only the rest
        ops.background.add(task)

        def done(task: asyncio.Task) -> None:
            ops.background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.info("MD %s did not catch up on %s: %s", md.replica_id, journey.request_id, task.exception())

        task.add_done_callback(done)


def _drain(queue: asyncio.Queue) -> list[EngineDelta]:
    items = []
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, EngineDelta):
            items.append(item)
    return items

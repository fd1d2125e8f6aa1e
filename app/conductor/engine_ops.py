"""The engine operations every pipeline is built from, and the narrow port each pipeline gets.

P's prefill with a KV lease for its consumers; a decoder's stream whose pull is accounted
on its link; `follow`, which carries a stream to another replica when its engine dies;
and `served`, the one stream helper: a decoder's tokens, after which (or when the
client leaves first) the prefix index learns what that replica's cache now holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from app.conductor.engine_client import EngineClient, NoReplicaError
from app.conductor.gaps import GapModel
from app.conductor.generation import ENGINE_FAILURES, GenerationRequest, PrefillUnavailable, Tokens, check, note_failover
from app.conductor.journal import Journey, Transfer
from app.conductor.link_accounts import LinkAccounts
from app.conductor.placement import Placement
from app.config import LiveKnobs, PDDConfig, RoleName
from app.engine.cluster_tls import cluster_tls
from app.engine.kv.params import LEASE, PRODUCE, PULL
from app.engine.kv.transport import release_lease
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import EngineDelta, EngineRequest

if TYPE_CHECKING:
    from app.conductor.link_directory import LinkDirectory


#: Where a request goes when its engine dies mid-stream: the same role first.
FAILOVER_ORDER = {
    RoleName.main_decode: (RoleName.main_decode, RoleName.relay_decode, RoleName.prefill),
    RoleName.relay_decode: (RoleName.relay_decode, RoleName.main_decode, RoleName.prefill),
    RoleName.prefill: (RoleName.prefill, RoleName.main_decode, RoleName.relay_decode),
}


class EngineOps:
    """What a pipeline may do: reach engines, place requests, account for links. The
    conductor owns one; pipelines (baselines.py, relay.py) get it instead of the conductor."""

    def __init__(self, config: PDDConfig, engines: EngineClient, links: LinkDirectory, placement: Placement, accounts: LinkAccounts):
        self.config = config
        self.knobs: LiveKnobs = config.live_knobs()
        """The live knobs (the conductor's reconfigure replaces them)."""
        self.engines = engines
        self.links = links
        self.placement = placement
        self.accounts = accounts
        self.background: set[asyncio.Task] = set()
        """Engine work that outlives its request (an MD warm-up after the relay finished)."""
        self.gaps = GapModel()
        """Decoders' step times, read off their streams, and the gap prediction's corrections."""

    async def prefill(self, req: GenerationRequest, journey: Journey, consumers: int, keys: list[int]) -> tuple[EngineDelta, ReplicaInfo]:
        """P computes the prompt's KV and the first token; the KV stays leased for
        `consumers` pulls. A failed P replica is left for another one."""
        for attempt in range(len(await self.engines.replicas(RoleName.prefill)) or 1):
            try:
                replica, _ = await self.placement.route(RoleName.prefill, keys, journey)
            except NoReplicaError as exc:
                raise PrefillUnavailable(str(exc)) from exc
            request = EngineRequest(
                f"{req.request_id}-p{attempt or ''}",
                req.prompt_token_ids,
                replace(req.sampling, max_tokens=1),
                kv_transfer_params={PRODUCE: {"consumers": consumers}},
            )
            last = None
            try:
                async for delta in self.engines.stream(replica, request):
                    last = check(delta, RoleName.prefill)
                    journey.note_first_token(RoleName.prefill.value, delta, replace=True)
            except ENGINE_FAILURES as exc:
                self.engines.suspect(replica.replica_id)
                self.placement.unroute(replica, keys)
                journey.failovers.append({"from_role": "prefill", "from_replica": replica.replica_id, "at_token": 0, "error": str(exc)})
                continue
            assert last is not None and last.finished
            journey.hit_tokens[RoleName.prefill.value] = last.num_cached_tokens or 0
            self.placement.remember(replica, req.prompt_token_ids, last.num_cached_tokens or 0, keys)
            return last, replica
        raise PrefillUnavailable("every prefill replica failed")

    async def decode_stream(self, role: RoleName, replica: ReplicaInfo, request: EngineRequest, journey: Journey) -> AsyncGenerator[EngineDelta, None]:
        """An engine stream whose transfer report lands in the journey; its pull joins the
        link's backlog until the pull's report, or its first token without one (a decoder
        whose cache held the whole prompt pulls nothing and reports nothing), says what it moved."""
        pull = (request.kv_transfer_params or {}).get(PULL, {})
        expected = int(pull.get("expected_bytes") or 0)
        place = self.accounts.start(pull["link"], request.request_id, expected, replica.replica_id) if expected else None
        last_tokens_at: float | None = None
        async with aclosing(self.engines.stream(replica, request)) as stream:
            async for delta in stream:
                check(delta, role)
                if delta.token_ids:  # after the first, each delta's interval is a step of this replica's batch
                    now = time.monotonic()
                    if last_tokens_at is not None:
                        self.gaps.steps.note(replica.replica_id, now - last_tokens_at, len(delta.token_ids))
                    last_tokens_at = now
                moved = 0
                if delta.transfer is not None:
                    moved = int(delta.transfer.get("bytes", 0))
                    model_s = self.accounts.model_seconds(pull["link"], request.request_id, expected, moved) if expected else None
                    note_transfer(journey, role, delta.transfer, pull.get("host", ""), replica.node_ip, model_s)
                if place is not None and (delta.transfer is not None or delta.token_ids or delta.finished):
                    self.accounts.settle(pull["link"], request.request_id, place, expected, moved)
                    place = None
                journey.note_first_token(role.value, delta, replace=False)
                if delta.finished:  # no pull (all cached): the engine's own count is the hit
                    journey.hit_tokens.setdefault(role.value, delta.num_cached_tokens or 0)
                yield delta

    async def follow(
        self, role: RoleName, replica: ReplicaInfo, request: EngineRequest, req: GenerationRequest, journey: Journey, before: list[int]
    ) -> AsyncGenerator[tuple[RoleName, EngineDelta], None]:
        """Stream `request`, whose prompt is the user's prompt + `before` (tokens the
        client already has). If its engine fails mid-stream, the request goes on
        elsewhere from prompt + every token sent so far (extend-decode), so the
        client sees no gap, duplicate or lost token."""
        produced: list[int] = []
        attempt = 0
        while True:
            try:
                async with aclosing(self.decode_stream(role, replica, request, journey)) as stream:
                    async for delta in stream:
                        produced += delta.token_ids
                        yield role, delta
                return
            except ENGINE_FAILURES as exc:
                self.engines.suspect(replica.replica_id)
                target = await self._failover_target(role)
                if target is None:
                    raise
                so_far = before + produced
                attempt += 1
                note_failover(journey, (role, replica), target, len(so_far), exc)
                role, replica = target
                journey.replicas[role.value] = replica.replica_id
                # nothing sent yet: the same request again, prompt log probabilities and all
                sampling = req.sampling.continued(len(so_far)) if so_far else req.sampling
                request = EngineRequest(f"{req.request_id}-f{attempt}", req.prompt_token_ids + so_far, sampling)

    async def _failover_target(self, failed: RoleName) -> tuple[RoleName, ReplicaInfo] | None:
        for role in FAILOVER_ORDER[failed]:
            if role in self.engines.roles():
                infos = await self.engines.replicas(role)
                if infos:
                    return role, min(infos, key=lambda i: self.engines.load(i.replica_id))
        return None

    async def served(
        self,
        role: RoleName,
        replica: ReplicaInfo,
        request: EngineRequest,
        req: GenerationRequest,
        journey: Journey,
        before: list[int],
        *,
        keys: list[int] | None,
        learn: bool = True,
    ) -> AsyncGenerator[tuple[RoleName, EngineDelta], None]:
        """`follow`, after which the index learns what `replica` holds: the prompt and
        `before` and every token it produced, also when the client's stream ends first (a
        stop string). With `keys` (the prompt's), the engine's real hit corrects the
        estimate first. Not when another replica took over, nor with `learn` False
        (salted blocks serve no later request)."""
        output = list(before)
        served_by: RoleName | None = None
        finished = False

        def learn_cache() -> None:
            if learn and served_by is role:
                hit = journey.hit_tokens.get(role.value) if keys is not None else None
                self.placement.remember(replica, req.prompt_token_ids + output, hit, keys)

        try:
            async with aclosing(self.follow(role, replica, request, req, journey, list(before))) as stream:
                async for served_by, delta in stream:
                    output += delta.token_ids
                    finished = delta.finished
                    if finished:
                        learn_cache()
                    yield served_by, delta
        except GeneratorExit:
            if not finished:
                learn_cache()
            raise

    async def continue_on(
        self,
        role: RoleName,
        replica: ReplicaInfo,
        req: GenerationRequest,
        journey: Journey,
        first: EngineDelta,
        lease: dict[str, Any] | None,
        keys: list[int],
        *,
        cache_salt: str | None = None,
        hold_first: bool = False,
        expected_bytes: int = 0,
    ) -> AsyncGenerator[Tokens, None]:
        """A decoder pulls the prompt KV from the lease and decodes after the first token.

        `cache_salt`: a unique one keeps the decoder's prefix cache out of it, so
        the whole prompt KV crosses the link (naive PD). `hold_first`: the first
        token (already computed by P) reaches the client only with the decoder's
        first one.
        """
        request = EngineRequest(
            f"{req.request_id}-{role.value}",
            req.prompt_token_ids + first.token_ids,
            req.sampling.continued(len(first.token_ids)),
            kv_transfer_params=await self.pull_params(lease, replica.datacenter, expected_bytes) if lease else None,
            cache_salt=cache_salt,
        )
        held = list(first.token_ids) if hold_first else []
        held_logprobs = list(first.logprobs or []) if hold_first else []
        held_prompt_logprobs = first.prompt_logprobs if hold_first else None
        stream = self.served(role, replica, request, req, journey, list(first.token_ids), keys=keys, learn=cache_salt is None)
        async with aclosing(stream):
            async for served_by, delta in stream:
                tokens = held + delta.token_ids
                logprobs = held_logprobs + delta.logprobs if delta.logprobs is not None else None
                if tokens or delta.finished:
                    yield Tokens(tokens, served_by, delta.finish_reason if delta.finished else None, logprobs, held_prompt_logprobs)
                held, held_logprobs, held_prompt_logprobs = [], [], None

    async def pull_params(self, lease: dict[str, Any], dst_dc: str, expected_bytes: int = 0) -> dict[str, Any]:
        """What a decoder needs to pull `lease` through the link emulator; `expected_bytes`
        (what routing expects to move) joins the link's backlog when the pull starts."""
        name, relay = await self.links.relay(lease["datacenter"], dst_dc)
        return {PULL: {**lease, "relay": relay, "link": name, "expected_bytes": expected_bytes}}

    async def release(self, lease: dict[str, Any] | None) -> None:
        if lease:
            await asyncio.to_thread(release_lease, (lease["host"], int(lease["port"])), lease["lease_id"], cluster_tls().client)

    async def ended_on_prefill(self, req: GenerationRequest, first: EngineDelta, consumers: int) -> Tokens | None:
        """P's token ended the request (a stop token, or one token asked): the lease's
        consumers will never pull, so it is released, and this is the request's last batch."""
        if first.finish_reason == "length" and req.sampling.max_tokens > 1:
            return None
        for _ in range(consumers):
            await self.release(lease_of(first))
        return Tokens(first.token_ids, RoleName.prefill, first.finish_reason, first.logprobs, first.prompt_logprobs)


def lease_of(first: EngineDelta) -> dict[str, Any] | None:
    """The KV lease P's first token came with (None: P kept nothing for a decoder)."""
    return (first.kv_transfer_params or {}).get(LEASE)


def note_transfer(journey: Journey, role: RoleName, report: dict[str, Any], source: str, destination: str, model_s: float | None = None) -> None:
    journey.hit_tokens[role.value] = int(report.get("local_hit_tokens", 0))
    journey.transfers.append(
        Transfer(
            link=report.get("link", ""),
            to_role=role.value,
            source=source,
            destination=destination,
            blocks=int(report.get("blocks", 0)),
            bytes=int(report.get("bytes", 0)),
            seconds=float(report.get("seconds", 0.0)),
            queued_seconds=float(report.get("queued_seconds", 0.0)),
            ok=bool(report.get("ok", True)),
            error=report.get("error"),
            model_seconds=model_s,
        )
    )

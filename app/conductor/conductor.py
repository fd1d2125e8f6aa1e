"""Runs one request through its pipeline and turns engine tokens into client text.

Pipelines yield token batches in client order, each tagged with the role that
produced it; `Conductor.generate` assembles text (stop strings included),
times every token, records the journey and the metrics. The PD baselines live
here; the PDD relay/handoff machinery is in app/conductor/relay.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace
from tokenizers import Tokenizer

from app.conductor.engine_client import EngineClient, NoReplicaError
from app.conductor.generation import ENGINE_FAILURES, EngineError, GenerationRequest, Output, PrefillUnavailable, RequestTimeout, Tokens, check, note_failover
from app.conductor.index_store import IndexKeeper, IndexStore
from app.conductor.journal import Journal, Journey, Transfer, slo_summary
from app.conductor.prefix_index import PrefixIndex
from app.conductor.readiness import readiness
from app.conductor.relay import pdd_pipeline
from app.conductor.textstream import TextAssembler
from app.config import LinkConfig, LiveKnobs, Mode, PDDConfig, RoleName
from app.engine.kv.link import LinkShare
from app.engine.kv.params import LEASE, PRODUCE, PULL
from app.engine.kv.transport import release_lease
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import EngineDelta, EngineRequest, TokenLogprob
from app.policy import LinkBacklog, Pipeline, affinity_room
from app.telemetry import metrics

if TYPE_CHECKING:
    from app.conductor.link_directory import LinkDirectory


#: Where a request goes when its engine dies mid-stream: the same role first.
FAILOVER_ORDER = {
    RoleName.main_decode: (RoleName.main_decode, RoleName.relay_decode, RoleName.prefill),
    RoleName.relay_decode: (RoleName.relay_decode, RoleName.main_decode, RoleName.prefill),
    RoleName.prefill: (RoleName.prefill, RoleName.main_decode, RoleName.relay_decode),
}


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


class Conductor:
    def __init__(
        self, config: PDDConfig, engines: EngineClient, links: LinkDirectory, tokenizer: Tokenizer, replica_id: str = "", index_store: IndexStore | None = None
    ):
        self.config = config
        self.replica_id = replica_id
        self.engines = engines
        self.links = links
        self.tokenizer = tokenizer
        self.knobs = config.live_knobs()
        self.journal = Journal()
        self.index = PrefixIndex(config.model.block_size)
        self.in_flight = 0
        self.backlogs: dict[str, LinkBacklog] = {}
        """KV bytes routed onto each link and not yet moved (policy input)."""
        self.shares: dict[str, LinkShare] = {}
        """The same pulls sharing each link's bandwidth: what each needs on a healthy link (the agents' yardstick)."""
        self._warms: dict[str, dict[int, asyncio.Task]] = {}
        """MD warm-ups in flight: replica id -> last prompt block key -> task."""
        self.background: set[asyncio.Task] = set()
        """Engine work that outlives its request (an MD warm-up after the relay finished)."""
        self.index_keeper = IndexKeeper(index_store, engines.live_replica_ids)
        """Saves the index for the next conductor (without a store: nothing is saved)."""
        self.index_keeper.restore(self.index)

    async def save_index(self) -> None:
        await self.index_keeper.save(self.index)

    def reconfigure(self, knobs: LiveKnobs) -> None:
        self.knobs = knobs
        for name, value in numeric_knobs(knobs).items():
            metrics.registry().set(metrics.KNOB, value, knob=name)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Output]:
        self.index_keeper.keep_saved(lambda: self.index)
        journey = self.journal.add(
            Journey(
                request_id=req.request_id,
                mode=req.mode.value,
                prompt_tokens=len(req.prompt_token_ids),
                max_tokens=req.sampling.max_tokens,
            )
        )
        assembler = TextAssembler(self.tokenizer, req.prompt_token_ids, req.stop)
        t0 = time.monotonic()
        first_at = last_at = None
        max_gap = 0.0
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
                    now = time.monotonic()
                    if first_at is None:
                        prompt_logprobs = self._prompt_logprobs(req, batch)
                        first_at = now
                    else:
                        max_gap = max(max_gap, now - last_at)
                    last_at = now
                    journey.note_tokens(batch.role.value, len(batch.token_ids))
                delta = assembler.feed(batch.token_ids)
                pending_ids += batch.token_ids[: delta.num_tokens]
                if pending_logprobs is not None:
                    pending_logprobs += (batch.logprobs or [])[: delta.num_tokens]
                journey.completion_tokens = assembler.num_tokens
                if delta.stopped:
                    finish_reason = "stop"
                    text = delta.text
                    break
                if batch.finish_reason is not None:
                    finish_reason = batch.finish_reason
                    text = delta.text + assembler.finish()
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
            journey.ttft_ms = None if first_at is None else (first_at - t0) * 1000
            journey.decode_ms = None if first_at is None else (last_at - first_at) * 1000
            journey.max_gap_ms = max_gap * 1000
            journey.finish_reason = finish_reason
            journey.outcome = outcome
            journey.finished_at = time.time()
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

    async def reset_prefix_caches(self) -> None:
        """Cold caches everywhere (benchmarks compare modes from the same start)."""
        await self.engines.reset_prefix_caches()

        def empty_index() -> None:
            self.index = PrefixIndex(self.config.model.block_size)

        await self.index_keeper.replace(empty_index)

    async def forget_saved_index(self) -> None:
        """The next conductor starts from an empty prefix index (IndexKeeper.forget)."""
        await self.index_keeper.forget()

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
                        "warming": len(self._warms.get(i.replica_id, {})),
                        "kv_blocks": i.num_kv_blocks,
                        "known_blocks": self.index.held_blocks(i.replica_id),
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
            "links": {name: {**counters, "backlog_bytes": self.backlog(name)} for name, counters in (await self.links.counters()).items()},
            "in_flight": self.in_flight,
            "prefix_index_saved_at": self.index_keeper.saved_at,
            "slo": {"targets": cfg.slo.model_dump(mode="json"), "recent": slo_summary(self.journal.recent(self.journal.capacity), cfg.slo, cfg.slo.window_s)},
        }

    async def _pipeline(self, req: GenerationRequest, journey: Journey) -> AsyncIterator[Tokens]:
        if req.mode is Mode.colocated:
            stream = self._colocated(req, journey, RoleName.main_decode)
        elif req.mode is Mode.pd_intra_dc:
            stream = self._pd(req, journey, RoleName.relay_decode, first_token_from_prefill=True)
        elif req.mode is Mode.pd_cross_dc_naive:
            stream = self._pd(req, journey, RoleName.main_decode, first_token_from_prefill=False)
        else:
            stream = pdd_pipeline(self, req, journey)
        try:
            async with aclosing(stream):
                async for batch in stream:
                    yield batch
        except PrefillUnavailable as exc:  # nothing was sent yet: a decoder computes it all
            decoder = RoleName.main_decode if RoleName.main_decode in self.engines.roles() else RoleName.relay_decode
            journey.failovers.append({"from_role": "prefill", "to_role": decoder.value, "at_token": 0, "error": str(exc)})
            metrics.registry().inc(metrics.FAILOVERS, from_role="prefill", to_role=decoder.value)
            async with aclosing(self._colocated(req, journey, decoder)) as fallback:
                async for batch in fallback:
                    yield batch

    # ---- building blocks (also used by app/conductor/relay.py) -----------------------------

    async def route(self, role: RoleName, keys: list[int], journey: Journey) -> tuple[ReplicaInfo, int]:
        """The replica of `role` expected to hold the longest prefix (unless its batch is full)."""
        infos = {i.replica_id: i for i in await self.engines.replicas(role)}
        if not infos:
            raise NoReplicaError(f"no live {role.value} replica")
        room = affinity_room(self.config.roles.get(role).engine)
        choice = self.index.choose({rid: i.num_kv_blocks for rid, i in infos.items()}, keys, self.engines.load, room)
        journey.replicas[role.value] = choice.replica_id
        replica = infos[choice.replica_id]
        # the next turn may arrive before this one ends: it should come here too
        self.index.route(replica.replica_id, keys, replica.num_kv_blocks)
        return replica, choice.cached_tokens

    def track_warm(self, replica: ReplicaInfo, keys: list[int], task: asyncio.Task) -> None:
        """An MD warm-up is pulling these blocks: a next turn of the conversation waits
        for it rather than pulling the same blocks again."""
        if not keys:
            return
        warms = self._warms.setdefault(replica.replica_id, {})
        warms[keys[-1]] = task
        task.add_done_callback(lambda _t: warms.pop(keys[-1], None) if warms.get(keys[-1]) is _t else None)

    def pending_warm(self, replica: ReplicaInfo, keys: list[int]) -> tuple[asyncio.Task | None, int]:
        """The warm-up in flight on `replica` covering the longest prefix of `keys`,
        and how many of their blocks it covers."""
        warms = self._warms.get(replica.replica_id)
        if warms:
            for i in range(len(keys) - 1, -1, -1):
                task = warms.get(keys[i])
                if task is not None and not task.done():
                    return task, i + 1
        return None, 0

    async def await_warm(self, task: asyncio.Task | None) -> None:
        """Wait (bounded) for another request's warm-up; its failure is its own."""
        if task is not None:
            await asyncio.wait({task}, timeout=self.config.kv.transfer_timeout_s)

    def unroute(self, replica: ReplicaInfo, keys: list[int]) -> None:
        """The request will not leave its prompt on this replica after all."""
        self.index.unroute(replica.replica_id, keys)

    def remember(self, replica: ReplicaInfo, tokens: list[int], actual_hit: int | None = None, prompt_keys: list[int] | None = None) -> None:
        """After a request: correct the estimate with the engine's real hit, then
        record what the replica now holds."""
        keys = self.index.keys(tokens)
        if actual_hit is not None:
            self.index.observe(replica.replica_id, prompt_keys if prompt_keys is not None else keys, actual_hit)
        self.index.record(replica.replica_id, keys, replica.num_kv_blocks)

    def _link_config(self, link: str) -> LinkConfig:
        """The configured link of a direction name ("dc-a->dc-b")."""
        return self.config.link(*link.split("->"))

    def _link_backlog(self, link: str) -> LinkBacklog:
        backlog = self.backlogs.get(link)
        if backlog is None:
            backlog = self.backlogs[link] = LinkBacklog(self._link_config(link).bytes_per_s)
        return backlog

    def _link_share(self, link: str) -> LinkShare:
        share = self.shares.get(link)
        if share is None:
            kv = self.config.kv
            share = self.shares[link] = LinkShare(self._link_config(link).bytes_per_s, kv.concurrent_pulls, kv.pull_order)
        return share

    def _model_seconds(self, pull: dict[str, Any], request: EngineRequest, moved_bytes: int) -> float | None:
        """What the configured link needs for this pull beside the others routed onto it.

        The model moved the bytes routing expected; the pull moved `moved_bytes` (more when
        the decoder's cache held less than estimated): the model's share of the bandwidth
        applies to those."""
        share = self.shares.get(pull.get("link", ""))
        shared_s = share.finish(request.request_id, time.monotonic()) if share is not None else None
        if shared_s is None:
            return None
        return self._link_config(pull["link"]).mean_latency_s + shared_s * moved_bytes / int(pull["expected_bytes"])

    def backlog(self, link: str) -> int:
        """KV bytes still queued on a link ("dc-a->dc-b"), by its configured model."""
        backlog = self.backlogs.get(link)
        return backlog.queued(time.monotonic()) if backlog is not None else 0

    async def decode_stream(self, role: RoleName, replica: ReplicaInfo, request: EngineRequest, journey: Journey) -> AsyncIterator[EngineDelta]:
        """An engine stream whose transfer report lands in the journey; its pull joins the
        link's backlog until the pull's report, or its first token without one (a decoder
        whose cache held the whole prompt pulls nothing and reports nothing), says what it moved."""
        pull = (request.kv_transfer_params or {}).get(PULL, {})
        expected = int(pull.get("expected_bytes") or 0)
        place = None
        if expected:
            now = time.monotonic()
            place = self._link_backlog(pull["link"]).add(expected, now)
            self._link_share(pull["link"]).start(request.request_id, expected, now, destination=replica.replica_id)
        async with aclosing(self.engines.stream(replica, request)) as stream:
            async for delta in stream:
                check(delta, role)
                moved = 0
                if delta.transfer is not None:
                    moved = int(delta.transfer.get("bytes", 0))
                    self.note_transfer(journey, role, delta.transfer, pull.get("host", ""), replica.node_ip, self._model_seconds(pull, request, moved))
                if place is not None and (delta.transfer is not None or delta.token_ids or delta.finished):
                    self._settle_pull(pull["link"], request.request_id, place, expected, moved)
                    place = None
                journey.note_first_token(role.value, delta, replace=False)
                if delta.finished:  # no pull (all cached): the engine's own count is the hit
                    journey.hit_tokens.setdefault(role.value, delta.num_cached_tokens or 0)
                yield delta

    def _settle_pull(self, link: str, pull_id: str, place: float, expected: int, moved: int) -> None:
        """What a pull did not move of routing's estimate leaves the link's models."""
        now = time.monotonic()
        self._link_backlog(link).settle(place, expected, moved, now)
        self._link_share(link).settle(pull_id, moved, now)

    async def prefill(self, req: GenerationRequest, journey: Journey, consumers: int, keys: list[int]) -> tuple[EngineDelta, ReplicaInfo]:
        """P computes the prompt's KV and the first token; the KV stays leased for
        `consumers` pulls. A failed P replica is left for another one."""
        for attempt in range(len(await self.engines.replicas(RoleName.prefill)) or 1):
            try:
                replica, _ = await self.route(RoleName.prefill, keys, journey)
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
                self.unroute(replica, keys)
                journey.failovers.append({"from_role": "prefill", "from_replica": replica.replica_id, "at_token": 0, "error": str(exc)})
                continue
            assert last is not None and last.finished
            journey.hit_tokens[RoleName.prefill.value] = last.num_cached_tokens or 0
            self.remember(replica, req.prompt_token_ids, last.num_cached_tokens or 0, keys)
            return last, replica
        raise PrefillUnavailable("every prefill replica failed")

    async def follow(
        self, role: RoleName, replica: ReplicaInfo, request: EngineRequest, req: GenerationRequest, journey: Journey, before: list[int]
    ) -> AsyncIterator[tuple[RoleName, EngineDelta]]:
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

    async def pull_params(self, lease: dict[str, Any], dst_dc: str, expected_bytes: int = 0) -> dict[str, Any]:
        """What a decoder needs to pull `lease` through the link emulator; `expected_bytes`
        (what routing expects to move) joins the link's backlog when the pull starts."""
        name, relay = await self.links.relay(lease["datacenter"], dst_dc)
        return {PULL: {**lease, "relay": relay, "link": name, "expected_bytes": expected_bytes}}

    def note_transfer(self, journey: Journey, role: RoleName, report: dict[str, Any], source: str, destination: str, model_s: float | None = None) -> None:
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

    async def release(self, lease: dict[str, Any] | None) -> None:
        if lease:
            await asyncio.to_thread(release_lease, (lease["host"], int(lease["port"])), lease["lease_id"])

    # ---- pipelines ----------------------------------------------------------------

    async def _colocated(self, req: GenerationRequest, journey: Journey, role: RoleName) -> AsyncIterator[Tokens]:
        """One engine computes the prompt and every token."""
        journey.pipeline = journey.pipeline or Pipeline.colocated.value
        keys = self.index.keys(req.prompt_token_ids)
        replica, _ = await self.route(role, keys, journey)
        request = EngineRequest(req.request_id, req.prompt_token_ids, req.sampling)
        output: list[int] = []
        async with aclosing(self.follow(role, replica, request, req, journey, [])) as stream:
            async for served_by, delta in stream:
                output += delta.token_ids
                if delta.finished and served_by is role:
                    journey.hit_tokens[role.value] = delta.num_cached_tokens or 0
                    self.remember(replica, req.prompt_token_ids + output, delta.num_cached_tokens or 0, keys)
                yield Tokens(delta.token_ids, served_by, delta.finish_reason if delta.finished else None, delta.logprobs, delta.prompt_logprobs)

    async def _pd(self, req: GenerationRequest, journey: Journey, decode_role: RoleName, *, first_token_from_prefill: bool) -> AsyncIterator[Tokens]:
        """Classic disaggregation: P prefills, one decoder pulls the KV and decodes the rest.

        pd_cross_dc_naive ships the whole prompt KV across the WAN (no
        decoder-side prefix cache shrinks it) and shows the first token only once the decoder
        produced its own, as vLLM's disaggregated-prefill proxy does.
        """
        journey.pipeline = (Pipeline.p_d if first_token_from_prefill else Pipeline.p_d_naive).value
        keys = self.index.keys(req.prompt_token_ids)
        first, _ = await self.prefill(req, journey, consumers=1, keys=keys)
        lease = (first.kv_transfer_params or {}).get(LEASE)
        if first.finish_reason != "length" or req.sampling.max_tokens == 1:
            await self.release(lease)
            yield Tokens(first.token_ids, RoleName.prefill, first.finish_reason, first.logprobs, first.prompt_logprobs)
            return
        if first_token_from_prefill:
            yield Tokens(first.token_ids, RoleName.prefill, logprobs=first.logprobs, prompt_logprobs=first.prompt_logprobs)
        replica, _ = await self.route(decode_role, keys, journey)
        naive = not first_token_from_prefill
        if naive:  # salted: the decoder's cache will not hold this prompt
            self.unroute(replica, keys)
        decode = self.continue_on(decode_role, replica, req, journey, first, lease, keys, cache_salt=req.request_id if naive else None, hold_first=naive)
        async with aclosing(decode):
            async for batch in decode:
                yield batch

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
    ) -> AsyncIterator[Tokens]:
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
        output = list(first.token_ids)
        served_by: RoleName | None = None
        finished = False
        try:
            async with aclosing(self.follow(role, replica, request, req, journey, list(first.token_ids))) as stream:
                async for served_by, delta in stream:
                    output += delta.token_ids
                    finished = delta.finished
                    if finished and cache_salt is None and served_by is role:  # salted blocks serve no later request
                        self.remember(replica, req.prompt_token_ids + output, journey.hit_tokens.get(role.value), keys)
                    tokens = held + delta.token_ids
                    logprobs = held_logprobs + delta.logprobs if delta.logprobs is not None else None
                    if tokens or delta.finished:
                        yield Tokens(tokens, served_by, delta.finish_reason if delta.finished else None, logprobs, held_prompt_logprobs)
                    held, held_logprobs, held_prompt_logprobs = [], [], None
        except GeneratorExit:
            # the client's stream ended first (a stop string): the decoder's cache keeps what it computed
            if not finished and cache_salt is None and served_by is role:
                self.remember(replica, req.prompt_token_ids + output, journey.hit_tokens.get(role.value), keys)
            raise

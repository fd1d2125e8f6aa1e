"""One vLLM AsyncLLM per replica, and the small protocol the conductor speaks to it.

Engines see token IDs only: tokenization, chat templates, detokenization and
stop strings live in the conductor, so text is identical whichever engines a
request crossed (a stop string spanning a handoff is still found).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from app.config import PDDConfig, RoleName
from app.engine import carried_sampling
from app.engine.cluster_tls import cluster_tls
from app.engine.engine_args import engine_args, kv_transfer_config
from app.engine.env import set_engine_env
from app.engine.kv import block_servers
from app.engine.kv.limits import ConnectionLimits
from app.engine.kv.params import PULL
from app.engine.token_channel import EngineDelta, EngineRequest, TokenLogprob, TokenStreamServer

logger = logging.getLogger(__name__)


@dataclass
class ReplicaInfo:
    replica_id: str
    role: str
    node_ip: str
    node_id: str
    datacenter: str
    num_kv_blocks: int
    block_size: int
    token_port: int
    """Where app.engine.token_channel serves this replica's token streams (on node_ip)."""
    kv_bytes_per_block: int
    """Bytes one KV block holds across all layers (what one block costs on a link)."""
    model_runner: str = ""
    """The vLLM model runner the engine built, e.g. `v1 (CPUModelRunner)` (checked at start)."""


def node_ip() -> str:
    """This node's address as Ray knows it (never "localhost": roles span machines)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - fall back to the routing table's answer
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ConnectorState:
    """What this engine's connector last reported: live leases, pull reports by
    request id until generate() takes them, and timed steps until taken."""

    def __init__(self, capacity: int = 10_000, step_capacity: int = 200_000):
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._capacity = capacity
        self.leases_live = 0
        self.steps: deque[dict[str, Any]] = deque(maxlen=step_capacity)

    def put(self, report: dict[str, Any]) -> None:
        # the engine core knows vLLM's internal id: ours plus "-" and 8 random characters
        self._items[report["request_id"].rsplit("-", 1)[0]] = report
        while len(self._items) > self._capacity:  # requests that ended before their report
            self._items.popitem(last=False)

    def take(self, request_id: str) -> dict[str, Any] | None:
        return self._items.pop(request_id, None)


def _connector_stats_logger(replica_id: str, state: ConnectorState):
    """A vLLM stat logger: the connector's lease gauge as a Ray metric, its reports to `state`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    from app.telemetry import metrics

    class ConnectorStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self._last: float | None = None

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            data = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            for report in data.get("transfers", ()):
                state.put(report)
            state.steps.extend(data.get("steps", ()))
            live = data.get("leases_live")
            if live is not None:
                state.leases_live = int(live)
            if live is not None and live != self._last:
                metrics.registry().set(metrics.LEASES_LIVE, float(live), replica=replica_id)
                self._last = live

        def log_engine_initialized(self):
            pass

    return ConnectorStatsLogger


class EngineServer:
    """Hosts one AsyncLLM; the role deployments are thin subclasses."""

    role: RoleName

    def __init__(self, config: PDDConfig, role: RoleName, replica_id: str):
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.role = role
        self.replica_id = replica_id
        set_engine_env(config, role)
        self._node_ip = node_ip()
        self._node_id = _ray_node_id()
        self.block_port = free_port()
        kv = kv_transfer_config(config, role, self._node_ip, self.block_port, os.getpid())
        self._connector = ConnectorState()
        self.engine = AsyncLLM.from_engine_args(engine_args(config, role, kv), stat_loggers=[_connector_stats_logger(replica_id, self._connector)])
        vllm_config = self.engine.vllm_config
        self.num_kv_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_bytes_per_block = _kv_bytes_per_block(vllm_config)
        block_servers.register(self.replica_id, (self._node_ip, self.block_port))  # relays may forward to it now
        self.datacenter = config.datacenter_of(role)
        security = config.security
        self._token_server = TokenStreamServer(
            self.generate,
            security.bind_host or self._node_ip,
            cluster_tls().server,
            ConnectionLimits("token channel", security.max_connections_per_peer, security.max_connections),
        )
        self.model_runner = ""

    async def check_runner(self) -> None:
        """Refuse to serve unless every worker's model runner runs carried sampling (the
        runner vLLM built, whatever was asked for), then log the engine's start line."""
        try:
            labels = set(await self.engine.collective_rpc("pdd_check_sampling"))
        except Exception as exc:
            self.shutdown()
            del self.engine  # shut down once, not again when the replica is collected
            raise RuntimeError(f"{self.role.value} engine {self.replica_id} refused to start: {exc}") from exc
        self.model_runner = ", ".join(sorted(labels))
        logger.info(
            "%s engine %s started in %s: model runner %s, %d KV blocks of %d tokens",
            self.role.value,
            self.replica_id,
            self.datacenter,
            self.model_runner,
            self.num_kv_blocks,
            self.block_size,
        )

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        s = request.sampling
        extra_args = carried_sampling.extra_args(s)
        if request.kv_transfer_params:
            extra_args["kv_transfer_params"] = request.kv_transfer_params
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logit_bias=s.logit_bias,
            logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs,
            stop_token_ids=s.stop_token_ids or None,
            ignore_eos=s.ignore_eos,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            min_tokens=min(s.min_tokens, s.max_tokens),  # a part of the request (P's one token, a catch-up step) stops at none before its end
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args or None,
            structured_outputs=None if s.constraint is None else StructuredOutputsParams(**msgspec.structs.asdict(s.constraint)),
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        pulling = request.kv_transfer_params is not None and PULL in request.kv_transfer_params
        started, first = time.monotonic(), True
        async for out in self.engine.generate(prompt, params, request.request_id):
            completion = out.outputs[0]
            transfer = self._connector.take(request.request_id) if pulling else None
            pulling = pulling and transfer is None
            engine_ttft_ms = core_ttft_ms = queued_ms = None
            if first and completion.token_ids:
                first = False
                engine_ttft_ms = (time.monotonic() - started) * 1000
                core_ttft_ms, queued_ms = _engine_core_times(out.metrics)
            yield EngineDelta(
                request_id=request.request_id,
                token_ids=list(completion.token_ids),
                finished=out.finished,
                finish_reason=completion.finish_reason if out.finished else None,
                num_prompt_tokens=len(out.prompt_token_ids or ()),
                num_cached_tokens=out.num_cached_tokens,
                kv_transfer_params=out.kv_transfer_params if out.finished else None,
                transfer=transfer,
                logprobs=None if s.logprobs is None else token_logprobs(completion.token_ids, completion.logprobs, s.logprobs),
                prompt_logprobs=prompt_token_logprobs(request.prompt_token_ids, out.prompt_logprobs, s.prompt_logprobs),
                engine_ttft_ms=engine_ttft_ms,
                engine_core_ttft_ms=core_ttft_ms,
                engine_queued_ms=queued_ms,
            )

    # `target_replica` is read by the affinity router, not here.
    async def abort(self, request_id: str, target_replica: str | None = None) -> None:
        await self.engine.abort(request_id)

    async def reset_prefix_cache(self, target_replica: str | None = None) -> bool:
        # The router falls back to any replica when it does not (yet) list the target:
        # answering for another replica's cache would report it emptied when it is not.
        if target_replica is not None and target_replica != self.replica_id:
            return False
        return bool(await self.engine.reset_prefix_cache())

    async def describe(self, target_replica: str | None = None) -> ReplicaInfo:
        # Started here, on the replica's serving loop, where the engine's output handler runs too.
        token_port = await self._token_server.start()
        return ReplicaInfo(
            replica_id=self.replica_id,
            role=self.role.value,
            node_ip=self._node_ip,
            node_id=self._node_id,
            datacenter=self.datacenter,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            token_port=token_port,
            kv_bytes_per_block=self.kv_bytes_per_block,
            model_runner=self.model_runner,
        )

    async def kv_state(self, target_replica: str | None = None) -> dict[str, Any]:
        """The connector's view: leases this engine holds for decoders to pull."""
        return {"replica_id": self.replica_id, "leases_live": self._connector.leases_live}

    async def data_plane_state(self, target_replica: str | None = None) -> dict[str, Any]:
        """Open and refused connections of the token channel and each worker's block server
        (with its leases and its process's threads): what a hostile client would exhaust."""
        channel = self._token_server.limits
        return {
            "replica_id": self.replica_id,
            "token_channel": {"open_connections": channel.open, "refused_connections": channel.refused},
            "block_servers": await self.engine.collective_rpc("pdd_block_server_state"),
        }

    async def expire_leases(self, target_replica: str | None = None) -> int:
        """Release this engine's KV leases now (fault injection; a stuck lease)."""
        return sum(await self.engine.collective_rpc("pdd_expire_leases"))

    async def take_steps(self, clear: bool = True, target_replica: str | None = None) -> list[dict[str, Any]]:
        """The engine's timed steps (`engine.record_steps`; else none) since the last clearing take."""
        steps = list(self._connector.steps)
        if clear:
            self._connector.steps.clear()
        return steps

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        block_servers.unregister(self.replica_id)
        self.engine.shutdown()


def token_logprobs(token_ids: Sequence[int], positions, top: int) -> list[TokenLogprob]:
    """vLLM's logprobs of new tokens (per position: token id -> Logprob with its rank) as
    each token's own log probability and the `top` most likely tokens, best first."""
    out = []
    for token, position in zip(token_ids, positions or ()):
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top)
        out.append(TokenLogprob(position[token].logprob, [(tid, logprob) for _, tid, logprob in ranked]))
    return out


def prompt_token_logprobs(prompt_token_ids: list[int], positions, top: int | None) -> list[TokenLogprob] | None:
    """vLLM's prompt logprobs (its first position None: nothing before it) as
    `token_logprobs` of the prompt's tokens after the first; None until vLLM gives them."""
    if top is None or not positions:
        return None
    return token_logprobs(prompt_token_ids[1:], list(positions)[1:], top)


def _engine_core_times(stats: Any) -> tuple[float | None, float | None]:
    """(first token, queue wait) in ms inside the engine core, from vLLM's request
    metrics (`RequestOutput.metrics`, engine-core timestamps); (None, None) where a
    timestamp is missing (metrics off, or the token came before its events)."""
    queued = getattr(stats, "queued_ts", 0.0)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    first = getattr(stats, "first_token_ts", 0.0)
    if not (queued and scheduled and first):
        return None, None
    return (first - queued) * 1000, (scheduled - queued) * 1000


def _kv_bytes_per_block(vllm_config) -> int:
    import torch

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    elem = torch.tensor([], dtype=model.dtype).element_size() if dtype == "auto" else 1
    per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * elem
    return per_token * vllm_config.cache_config.block_size


def _ray_node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""

"""PDDConnector: a pull-based vLLM KV connector that moves only the blocks a decoder lacks.

Loaded by vLLM with `kv_connector_module_path="app.engine.kv.connector"`, in both the
scheduler (EngineCore process) and the worker. Per request it plays one part,
chosen by the conductor through `kv_transfer_params`:

- producer (`{"pdd_produce": {"consumers": n}}`, on prefill): when the request
  finishes, its blocks stay allocated under a lease (freed after n pulls or the
  lease timeout) and the output carries `{"pdd_lease": {...}}`: where to pull.
- consumer (`{"pdd_pull": <pdd_lease> + relay/link}`, on decoders): vLLM's own
  prefix cache answers first; the connector pulls only the blocks past that hit,
  through the link relay, asynchronously. A failed pull marks the unwritten
  blocks invalid and vLLM recomputes them (`kv_load_failure_policy="recompute"`);
  the request still succeeds. The output carries `{"pdd_transfer": {...}}`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from app.config import PullOrder, SecurityConfig
from app.engine import carried_sampling
from app.engine.cluster_tls import ClusterTLS, Credentials
from app.engine.kv.leases import LeaseIds, LeaseTable
from app.engine.kv.limits import ConnectionLimits
from app.engine.kv.params import LEASE, PRODUCE, PULL
from app.engine.kv.pull_threads import PullThreads
from app.engine.kv.steps import StepClock
from app.engine.kv.transport import BlockServer, KVLayout, PullResult, PullSpec, pull_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The scheduler side loads in vLLM's engine core, where grammars are made: continued ones start past the carried output.
carried_sampling.install()


@dataclass(frozen=True)
class ConnectorSettings:
    datacenter: str
    host: str
    """Address decoders reach this engine's block server at (the node's IP)."""
    bind_host: str
    """Address the block server listens on (`security.bind_host`, else `host`)."""
    block_port: int
    lease_timeout_s: float
    connect_timeout_s: float
    transfer_timeout_s: float
    owner_pid: int | None
    """The Serve replica owning this engine: the engine exits when it is gone."""
    record_steps: bool = False
    """Time every engine step (app/engine/kv/steps.py) and report it with the connector's stats."""
    concurrent_pulls: int = 8
    """Pull threads: pulls this engine runs at once (KVTransferSettings.concurrent_pulls)."""
    pull_order: PullOrder = PullOrder.smallest_first
    """Which waiting pull a freed pull thread takes (KVTransferSettings.pull_order)."""
    tls_credentials: str = ""
    """The file of the cluster's TLS credentials (app/engine/cluster_tls.py credentials_file)."""
    intra_dc_encryption: bool = True
    """`security.intra_dc_encryption`: off, pulls from this datacenter's block servers send blocks outside TLS."""
    max_connections_per_peer: int = SecurityConfig().max_connections_per_peer
    max_connections: int = SecurityConfig().max_connections

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        return cls(
            datacenter=str(extra.get("datacenter", "")),
            host=str(extra.get("host", "127.0.0.1")),
            bind_host=str(extra.get("bind_host") or extra.get("host", "127.0.0.1")),
            block_port=int(extra.get("block_port", 0)),
            lease_timeout_s=float(extra.get("lease_timeout_s", 60.0)),
            connect_timeout_s=float(extra.get("connect_timeout_s", 5.0)),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 120.0)),
            owner_pid=int(extra["owner_pid"]) if extra.get("owner_pid") else None,
            record_steps=bool(extra.get("record_steps", False)),
            concurrent_pulls=int(extra.get("concurrent_pulls", 8)),
            pull_order=PullOrder(extra.get("pull_order", PullOrder.smallest_first.value)),
            tls_credentials=str(extra.get("tls_credentials", "")),
            intra_dc_encryption=bool(extra.get("intra_dc_encryption", True)),
            max_connections_per_peer=int(extra.get("max_connections_per_peer", cls.max_connections_per_peer)),
            max_connections=int(extra.get("max_connections", cls.max_connections)),
        )


def _watch_owner(owner_pid: int, interval_s: float = 1.0) -> None:
    """End this engine process when its replica dies: a killed Ray actor never
    runs vLLM's shutdown, and orphaned engines would hold memory and CPU forever."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(owner_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="pdd-owner-watchdog", daemon=True).start()


@dataclass
class LeaseSpec:
    request_id: str
    lease_id: str
    block_ids: list[int]
    consumers: int
    ttl_s: float


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    leases: list[LeaseSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)


@dataclass
class PDDWorkerMetadata(KVConnectorWorkerMetadata):
    results: list[PullResult] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PDDWorkerMetadata)
        return PDDWorkerMetadata(self.results + other.results)


@dataclass
class PDDConnectorStats(KVConnectorStats):
    """`leases_live` (gauge: latest wins); `transfers` (pull reports) and `steps` (timed steps): concatenated."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = {**self.data, **other.data}
        for key in ("transfers", "steps"):
            merged[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
        return PDDConnectorStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def _first_group(block_ids: Any) -> list[int]:
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids or [])


class PDDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        if self._settings.owner_pid:
            _watch_owner(self._settings.owner_pid)
        # scheduler side
        self._new_leases: list[LeaseSpec] = []
        self._new_pulls: list[PullSpec] = []
        self._local_hit: dict[str, int] = {}
        self._pull_planned: set[str] = set()
        self._reports: list[dict[str, Any]] = []
        self._leases_live: set[str] = set()
        self._lease_ids: LeaseIds | None = None
        self._step_clock = StepClock() if self._settings.record_steps else None
        # worker side
        self._layout: KVLayout | None = None
        self._leases = LeaseTable()
        self._server: BlockServer | None = None
        self._pulls: PullThreads | None = None
        self._tls: ClusterTLS | None = None
        self._inflight: dict[str, Future] = {}
        self._done_results: list[PullResult] = []
        self._invalid_blocks: set[int] = set()

    # ---- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        pull = (request.kv_transfer_params or {}).get(PULL)
        if not pull or request.request_id in self._pull_planned:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        # the decoder computes at least its last prompt token itself
        loadable = min(int(pull["num_tokens"]), request.num_prompt_tokens - 1)
        count = loadable - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pull = (request.kv_transfer_params or {}).get(PULL)
        rid = request.request_id
        if not pull or rid in self._pull_planned:
            return
        self._pull_planned.add(rid)
        indices: list[int] = []
        local: list[int] = []
        if num_external_tokens > 0:
            hit = self._local_hit.get(rid, 0)
            first = hit // self._block_size
            last = math.ceil((hit + num_external_tokens) / self._block_size)
            block_ids = _first_group(blocks.get_block_ids())
            indices = list(range(first, last))
            local = list(block_ids[first:last])
        # an empty pull still tells the producer this consumer is done with the lease
        self._new_pulls.append(self._pull_spec(rid, pull, indices, local))

    def _pull_spec(self, rid: str, pull: dict[str, Any], indices: list[int], local: list[int]) -> PullSpec:
        relay = pull.get("relay")
        return PullSpec(
            request_id=rid,
            lease_id=pull["lease_id"],
            source=(pull["host"], int(pull["port"])),
            relay=(relay[0], int(relay[1])) if relay else None,
            link=pull.get("link", ""),
            remote_indices=indices,
            local_block_ids=local,
            plaintext=not self._settings.intra_dc_encryption and pull.get("datacenter") == self._settings.datacenter,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._step_clock is not None:
            self._step_clock.scheduled(scheduler_output)
        meta = PDDConnectorMetadata(self._new_leases, self._new_pulls)
        self._new_leases, self._new_pulls = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PDDWorkerMetadata):
            for r in meta.results:
                if r.requested_blocks:
                    report = asdict(r)
                    report.pop("failed_block_ids")
                    report["local_hit_tokens"] = self._local_hit.get(r.request_id, 0)
                    self._reports.append(report)
        for rid in connector_output.finished_sending or ():
            self._leases_live.discard(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        rid = request.request_id
        if self._step_clock is not None:
            self._step_clock.finished(rid)
        if PULL in params:
            if rid not in self._pull_planned:  # aborted before scheduling: release the lease
                self._new_pulls.append(self._pull_spec(rid, params[PULL], [], []))
            # An abort while the pull runs is safe: vLLM keeps a request waiting for
            # remote KV allocated until the worker reports its pull finished.
            self._pull_planned.discard(rid)
            self._local_hit.pop(rid, None)
            return False, None
        produce = params.get(PRODUCE)
        blocks = _first_group(block_ids)
        finished_ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not produce or not blocks or not finished_ok:
            return False, None
        consumers = int(produce.get("consumers", 1))
        lease_id = self._ids().issue()  # a capability, never shown to clients
        self._new_leases.append(LeaseSpec(rid, lease_id, blocks, consumers, self._settings.lease_timeout_s))
        self._leases_live.add(rid)
        lease = {
            "lease_id": lease_id,
            "host": self._settings.host,
            "port": self._settings.block_port,
            "num_tokens": request.num_prompt_tokens,
            "num_blocks": len(blocks),
            "datacenter": self._settings.datacenter,
        }
        return True, {LEASE: lease}

    def _ids(self) -> LeaseIds:
        if self._lease_ids is None:
            key = Credentials.load(self._settings.tls_credentials).key
            self._lease_ids = LeaseIds.for_block_server(key, (self._settings.host, self._settings.block_port))
        return self._lease_ids

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role is not KVConnectorRole.SCHEDULER:
            return None
        reports, self._reports = self._reports, []
        data: dict[str, Any] = {"leases_live": len(self._leases_live), "transfers": reports}
        if self._step_clock is not None:  # vLLM asks at the end of each step's output processing
            self._step_clock.processed()
            data["steps"] = self._step_clock.take()
        return PDDConnectorStats(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PDDConnectorStats(dict(data or {}))

    # ---- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._layout = KVLayout.from_caches(kv_caches, self._kv_cache_config.num_blocks)
        s = self._settings
        self._tls = ClusterTLS(Credentials.load(s.tls_credentials))
        self._server = BlockServer(
            lambda: self._layout,
            self._leases,
            self._ids(),
            (s.bind_host, s.block_port),
            self._tls.server,
            ConnectionLimits("KV block server", s.max_connections_per_peer, s.max_connections),
            allow_plaintext=not s.intra_dc_encryption,
        )
        self._pulls = PullThreads(self._settings.concurrent_pulls, self._settings.pull_order)
        logger.info("PDDConnector: block server on port %d, %d bytes per block", self._server.port, self._layout.block_nbytes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDDConnectorMetadata)
        for lease in meta.leases:
            self._leases.add(lease.lease_id, lease.block_ids, lease.consumers, lease.ttl_s, request_id=lease.request_id)
        for spec in meta.pulls:
            assert self._pulls is not None and self._layout is not None and self._tls is not None
            s = self._settings
            self._inflight[spec.request_id] = self._pulls.submit(
                len(spec.remote_indices), pull_blocks, spec, self._layout, self._tls.client, s.connect_timeout_s, s.transfer_timeout_s, time.monotonic()
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._leases.expire()
        recving = set()
        for rid, fut in list(self._inflight.items()):
            if not fut.done():
                continue
            del self._inflight[rid]
            result: PullResult = fut.result()
            if not result.ok:
                logger.warning("KV pull for %s over %s failed (%s); recomputing %d blocks", rid, result.link, result.error, len(result.failed_block_ids))
                self._invalid_blocks.update(result.failed_block_ids)
            self._done_results.append(result)
            if result.requested_blocks:
                recving.add(rid)
        return KVConnectorTransferResults(finished_sending=self._leases.take_done(), finished_recving=recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._done_results:
            return None
        out, self._done_results = self._done_results, []
        return PDDWorkerMetadata(out)

    def expire_all_leases(self) -> int:
        return len(self._leases.expire(now=float("inf")))

    def block_server_state(self) -> dict[str, int]:
        assert self._server is not None
        limits = self._server.limits
        return {"open_connections": limits.open, "refused_connections": limits.refused, "leases": len(self._leases), "threads": threading.active_count()}

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._pulls is not None:
            self._pulls.shutdown()

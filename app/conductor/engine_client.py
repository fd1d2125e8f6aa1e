"""How the conductor reaches engine replicas.

Discovery and control go through Serve handles (the affinity router publishes
the live replica set); token streams go over app/engine/token_channel.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from ray.serve.handle import DeploymentHandle

from app.conductor.replica_router import live_replicas
from app.config import RoleName
from app.engine.cluster_tls import cluster_tls
from app.engine.deployments import DEPLOYMENT_NAMES
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import EngineDelta, EngineRequest, TokenStreamClient

logger = logging.getLogger(__name__)


class NoReplicaError(RuntimeError):
    """A role has no live replica to take the request."""


#: A replica whose stream broke is left out of routing this long (Serve needs a
#: few seconds to notice a dead replica; new requests must not queue behind it).
SUSPECT_S = 30.0

#: A replica that does not describe itself this fast is not routable now. Serve
#: holds a call while a deployment has no replica to take it (a datacenter that
#: died): unbounded, routing would wait for the datacenter to come back.
DESCRIBE_TIMEOUT_S = 10.0

#: How long a role the request can do without (`wait=False`: the relay) waits for a fresh
#: conductor's first look at it: a live replica answers in milliseconds, while a role whose
#: replicas are dead would hold the request for DESCRIBE_TIMEOUT_S.
FIRST_LOOK_WAIT_S = 1.0

#: How long reset_prefix_caches waits for busy replicas to free their blocks, and how often it asks.
RESET_TIMEOUT_S = 120.0
RESET_RETRY_S = 0.2


class EngineClient:
    def __init__(self, handles: dict[RoleName, DeploymentHandle]):
        self._handles = handles
        self._replicas: dict[str, ReplicaInfo] = {}
        self._channels: dict[str, TokenStreamClient] = {}
        self._suspect: dict[str, float] = {}
        self._describing: dict[str, asyncio.Task] = {}
        """Replica id -> its description in flight, which every caller shares."""
        self._first_look: dict[RoleName, asyncio.Task] = {}
        """Role -> the call that builds its Serve router, which every caller shares."""

    def roles(self) -> list[RoleName]:
        return list(self._handles)

    async def replicas(self, role: RoleName, *, wait: bool = True) -> list[ReplicaInfo]:
        """Live replicas of a role, each described once (node, datacenter, cache size, port).

        A replica Serve lists that is not described yet (new, or a replacement) is described
        in the background. The call waits for that only while the role has no other
        replica to offer, and only if `wait`: a role the request can do without (the
        relay) is then "none now" rather than a wait of up to DESCRIBE_TIMEOUT_S, which a
        replica that died before it was described would cost every request meanwhile.
        One that does not answer is left out of routing for SUSPECT_S. A fresh conductor's
        first look at a role (the call that builds its Serve router) is shared by every
        request, and without `wait` lasts at most FIRST_LOOK_WAIT_S."""
        name = DEPLOYMENT_NAMES[role]
        live = live_replicas(name)
        if live is None:  # the router is built on first use; one call builds it
            look = self._first_look.get(role)
            if look is None:
                look = self._first_look[role] = asyncio.create_task(self._look(role))
            done, _ = await asyncio.wait({look}, timeout=None if wait else FIRST_LOOK_WAIT_S)
            if not done:
                return []
            info = look.result()
            live = live_replicas(name) or (frozenset({info.replica_id}) if info is not None else frozenset())
        for rid in [r for r in self._channels if r not in live and r in self._replicas and self._replicas[r].role == role.value]:
            await self._channels.pop(rid).close()
        now = time.monotonic()
        pending = [self._description(role, rid) for rid in live if rid not in self._replicas and self._suspect.get(rid, 0) <= now]
        healthy = self._healthy(live)
        if pending and wait and not healthy:
            await asyncio.wait(pending)
            healthy = self._healthy(live)
        return healthy

    def live_replica_ids(self) -> set[str] | None:
        """Every role's replicas Serve routes to now; None until each role's router has its first set."""
        ids: set[str] = set()
        for role in self._handles:
            live = live_replicas(DEPLOYMENT_NAMES[role])
            if live is None:
                return None
            ids |= live
        return ids

    def _healthy(self, live: frozenset[str]) -> list[ReplicaInfo]:
        now = time.monotonic()
        return [self._replicas[rid] for rid in sorted(live) if rid in self._replicas and self._suspect.get(rid, 0) <= now]

    async def _look(self, role: RoleName) -> ReplicaInfo | None:
        try:
            info = await self._describe(role)
            if info is not None:
                self._replicas[info.replica_id] = info
            return info
        finally:
            self._first_look.pop(role, None)

    def _description(self, role: RoleName, replica_id: str) -> asyncio.Task:
        task = self._describing.get(replica_id)
        if task is None:
            task = self._describing[replica_id] = asyncio.create_task(self._learn(role, replica_id))
        return task

    async def _learn(self, role: RoleName, replica_id: str) -> None:
        try:
            info = await self._describe(role, replica_id)
            if info is None:
                self.suspect(replica_id)
            else:
                self._replicas[replica_id] = info
        finally:
            self._describing.pop(replica_id, None)

    async def _describe(self, role: RoleName, replica_id: str | None = None) -> ReplicaInfo | None:
        """A replica's description (`replica_id`'s, or any one's); None when none answers in time."""
        handle = self._handles[role]
        call = handle.describe.remote(target_replica=replica_id) if replica_id else handle.describe.remote()
        try:
            return await asyncio.wait_for(call, DESCRIBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - dead, dying or absent: not routable now
            logger.info("no %s replica%s described itself: %r", role.value, f" {replica_id}" if replica_id else "", exc)
            return None

    def suspect(self, replica_id: str) -> None:
        """A stream to this replica broke: route around it for a while."""
        self._suspect[replica_id] = time.monotonic() + SUSPECT_S

    def load(self, replica_id: str) -> int:
        """Requests this conductor has in flight on a replica."""
        channel = self._channels.get(replica_id)
        return channel.active_streams if channel is not None else 0

    def _channel(self, info: ReplicaInfo) -> TokenStreamClient:
        channel = self._channels.get(info.replica_id)
        if channel is None or channel.closed:
            channel = self._channels[info.replica_id] = TokenStreamClient(info.node_ip, info.token_port, cluster_tls().client)
        return channel

    async def stream(self, replica: ReplicaInfo, request: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Stream one request on one replica; leaving early aborts it there."""
        async with aclosing(self._channel(replica).stream(request)) as stream:
            async for delta in stream:
                yield delta

    async def reset_prefix_caches(self, timeout_s: float = RESET_TIMEOUT_S) -> None:
        """Empty every live replica's prefix cache (benchmarks comparing modes on equal terms).

        Every replica Serve routes to, described or not and suspect or not: a fresh
        conductor has described only the replica that answered its first look, and a
        cache left warm would serve the next prompt. vLLM refuses while any block is in
        use (a request running, a lease not yet pulled); a replica is asked again until it
        empties, or TimeoutError names those that never did."""
        deadline = time.monotonic() + timeout_s
        emptied: set[str] = set()
        while True:
            pending = [(self._handles[role], rid) for role in self._handles for rid in await self._live_ids(role) if rid not in emptied]
            done = await asyncio.gather(*(handle.reset_prefix_cache.remote(target_replica=rid) for handle, rid in pending), return_exceptions=True)
            emptied.update(rid for (_, rid), ok in zip(pending, done) if ok is True)
            left = sorted(rid for _, rid in pending if rid not in emptied)
            if not left:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prefix caches of replicas {left} still had blocks in use after {timeout_s:.0f} s")
            await asyncio.sleep(RESET_RETRY_S)

    async def _live_ids(self, role: RoleName) -> frozenset[str]:
        """Every replica id Serve routes to for a role (the described ones until its router published a set)."""
        described = await self.replicas(role)  # builds the role's router on first use
        live = live_replicas(DEPLOYMENT_NAMES[role])
        return live if live is not None else frozenset(info.replica_id for info in described)

"""Serve request router that sends a request to the replica the conductor chose.

Control calls (describe, reset_prefix_cache) name a replica with a
`target_replica` keyword; this router honours it when that replica is alive
and falls back to power-of-two-choices otherwise. Token streams do not pass
through Serve handles (app/engine/token_channel.py explains why).

The router runs inside the caller's process (the conductor), so it also
publishes each deployment's live replica set for the conductor to read.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from app.ray_private import router_deployment_name

# Written by the router's event loop, read by the conductor's: one dict
# assignment is atomic, and holding a lock here would make the class unpicklable.
_live: dict[str, frozenset[str]] = {}


def live_replicas(deployment_name: str) -> frozenset[str] | None:
    """Replica ids Serve currently routes to for a deployment; None before the
    router's first update (empty: it has none)."""
    return _live.get(deployment_name)


def _target_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    target = pending_request.kwargs.get("target_replica")
    return target if isinstance(target, str) else None


class AffinityRequestRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """The named replica when it is alive; otherwise two random ones (nearest first), of
    which Serve takes the one with the shorter queue (the power of two choices)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = _target_of(pending_request)
        if target:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        nearest = [rid for rid in self.apply_locality_routing(pending_request) if rid in by_id]
        if not nearest:
            return []
        return [[by_id[rid] for rid in random.sample(nearest, min(2, len(nearest)))]]

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        # Serve may ship this class by value (cloudpickle), giving it a private copy
        # of this module's globals; import the real module to publish where readers look.
        from app.conductor import replica_router

        replica_router._live[router_deployment_name(self)] = frozenset(r.replica_id.unique_id for r in replicas)

"""Fault injection for a running app: kill replicas, cut or stall links, expire
leases, restart the conductor. Used by tests, bench/soak.py and people.

Everything goes through Ray and Serve themselves (actor kills, deployment
handles), so a fault here is the fault production would see.
"""

from __future__ import annotations

import random

from app.config import RoleName
from app.roles import DEPLOYMENT_NAMES

DEPLOYMENTS = (*DEPLOYMENT_NAMES.values(), "Conductor", "Links")


class Faults:
    def __init__(self, app_name: str = "pdd", seed: int | None = None):
        self.app_name = app_name
        self._rng = random.Random(seed)

    def _handle(self, deployment: str):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=self.app_name)

    def replicas(self, deployment: str) -> list[str]:
        """Actor names of the live replicas of a deployment (from the GCS: no dashboard needed)."""
        import ray

        if deployment not in DEPLOYMENTS:
            raise ValueError(f"unknown deployment {deployment!r} (known: {', '.join(DEPLOYMENTS)})")
        prefix = f"SERVE_REPLICA::{self.app_name}#{deployment}#"
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))

    def kill_replica(self, deployment: str) -> str:
        """Kill one replica of a deployment (chosen at random) as a crash would; Serve replaces it."""
        import ray

        names = self.replicas(deployment)
        if not names:
            raise RuntimeError(f"no live replica of {deployment}")
        name = self._rng.choice(names)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def kill_role(self, role: RoleName) -> str:
        return self.kill_replica(DEPLOYMENT_NAMES[role])

    def restart_conductor(self) -> str:
        return self.kill_replica("Conductor")

    def cut_link(self, direction: str, seconds: float | None = None) -> None:
        """Sever e.g. "dc-a->dc-b" for `seconds` (None: until restore_link)."""
        self._handle("Links").cut.remote(direction, seconds).result()

    def restore_link(self, direction: str) -> None:
        self._handle("Links").restore.remote(direction).result()

    def stall_link(self, direction: str, seconds: float) -> None:
        self._handle("Links").stall.remote(direction, seconds).result()

    def expire_leases(self) -> int:
        """Release every prefill replica's KV leases now; returns how many went."""
        handle = self._handle(DEPLOYMENT_NAMES[RoleName.prefill])
        return sum(handle.expire_leases.remote(target_replica=name.rsplit("#", 1)[-1]).result() for name in self.replicas(DEPLOYMENT_NAMES[RoleName.prefill]))

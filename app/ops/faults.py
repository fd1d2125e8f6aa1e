"""Fault injection for a running app: kill replicas, cut, stall or slow links, expire
leases, restart the conductor. Used by tests, bench/soak.py and people.

Everything goes through Ray and Serve themselves (actor kills, deployment
handles), so a fault here is the fault production would see.
"""

from __future__ import annotations

import random

from app.config import RoleName
from app.engine.deployments import DEPLOYMENT_NAMES
from app.engine.link_emulators import deployment_name


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

        prefix = f"SERVE_REPLICA::{self.app_name}#{deployment}#"
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))

    def kill_replica(self, deployment: str) -> str:
        """Kill one replica of a deployment (chosen at random) as a crash would; Serve replaces it."""
        import ray

        names = self.replicas(deployment)
        if not names:
            raise RuntimeError(f"no live replica of {deployment} in app {self.app_name}")
        name = self._rng.choice(names)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def kill_role(self, role: RoleName) -> str:
        return self.kill_replica(DEPLOYMENT_NAMES[role])

    def restart_conductor(self, forget_index: bool = False) -> str:
        """Kill the conductor; Serve starts another, from the prefix index the last one saved,
        or with `forget_index` from an empty one (as after a GCS restart without fault tolerance)."""
        if forget_index:
            self._handle("Conductor").forget_saved_index.remote().result()
        return self.kill_replica("Conductor")

    def _links(self, direction: str):
        """The emulator of a direction such as "dc-a->dc-b" (it lives in the receiving datacenter)."""
        source, arrow, destination = direction.partition("->")
        if not (source and arrow and destination):
            raise ValueError(f"a link direction reads like dc-a->dc-b, not {direction!r}")
        deployment = deployment_name(destination)
        if not self.replicas(deployment):  # a handle to no deployment would wait for one forever
            raise ValueError(f"no link emulator receives in {destination!r} in app {self.app_name} (is it running? a datacenter of its config?)")
        return self._handle(deployment)

    def cut_link(self, direction: str, seconds: float | None = None) -> None:
        """Sever e.g. "dc-a->dc-b" for `seconds` (None: until restore_link)."""
        self._links(direction).cut.remote(direction, seconds).result()

    def restore_link(self, direction: str) -> None:
        self._links(direction).restore.remote(direction).result()

    def stall_link(self, direction: str, seconds: float) -> None:
        self._links(direction).stall.remote(direction, seconds).result()

    def degrade_link(self, direction: str, *, bandwidth_mbps: float | None = None, rtt_ms: float | None = None) -> None:
        """Slow e.g. "dc-a->dc-b" down to these figures until restore_link; the app's
        config (and so routing's transfer estimates) keeps the configured ones."""
        figures = {k: v for k, v in (("bandwidth_mbps", bandwidth_mbps), ("rtt_ms", rtt_ms)) if v is not None}
        if not figures:
            raise ValueError("degrade_link needs bandwidth_mbps and/or rtt_ms")
        self._links(direction).degrade.remote(direction, figures).result()

    def link_counters(self, direction: str) -> dict:
        return self._links(direction).counters.remote().result()[direction]

    def expire_leases(self) -> int:
        """Release every prefill replica's KV leases now; returns how many went."""
        handle = self._handle(DEPLOYMENT_NAMES[RoleName.prefill])
        return sum(handle.expire_leases.remote(target_replica=name.rsplit("#", 1)[-1]).result() for name in self.replicas(DEPLOYMENT_NAMES[RoleName.prefill]))

"""The link emulators: the emulated network between datacenters, live-configurable.

One deployment per receiving datacenter (`Links-<dc>`, placed on that
datacenter's nodes) hosts a relay for every configured direction into it
(app/engine/kv/link.py): KV crosses to the receiver's side, and a datacenter that
dies takes only the relays into it along. Its `user_config` is the list of
links, so a redeploy with new bandwidth/RTT/jitter changes the network without
a restart; `cut`, `stall`, `degrade` and `restore` inject faults.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from app.config import LinkConfig, SecurityConfig
from app.engine.kv.block_servers import BlockServerDirectory
from app.engine.kv.link import LinkSet
from app.engine.replica import node_ip
from app.telemetry.replica_logging import log_to_stderr


def deployment_name(datacenter: str) -> str:
    return f"Links-{datacenter}"


@serve.deployment(num_replicas=1, max_ongoing_requests=1000)
class LinkEmulators:
    def __init__(self, destination: str, security: dict[str, Any] | None = None) -> None:
        log_to_stderr()
        self._destination = destination
        self._security = SecurityConfig.model_validate(security or {})
        self._links = LinkSet()
        self._advertised = node_ip()
        self._host = self._security.bind_host or self._advertised
        self._block_servers = BlockServerDirectory()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        configs = [LinkConfig.model_validate(c) for c in user_config.get("links", [])]
        self._links.update(configs, self._host, self._block_servers.allowed, destination=self._destination, security=self._security)
        await self._links.start()

    async def describe(self) -> dict[str, tuple[str, int]]:
        """Relay address of each direction, e.g. {"dc-a->dc-b": ("10.0.0.5", 41234)}."""
        ports = await self._links.start()
        return {name: (self._advertised, port) for name, port in ports.items()}

    async def cut(self, direction: str, seconds: float | None = None) -> None:
        """Sever one direction (e.g. "dc-a->dc-b") for `seconds`, or until restore."""
        self._relay(direction).cut(seconds)

    async def restore(self, direction: str) -> None:
        self._relay(direction).restore()

    async def degrade(self, direction: str, figures: dict[str, float]) -> None:
        """Run one direction at other figures than configured (e.g. {"bandwidth_mbps": 4}) until restore."""
        self._relay(direction).degrade(**figures)

    async def stall(self, direction: str, seconds: float) -> None:
        """Hold one direction's data for `seconds` without closing connections."""
        self._relay(direction).stall(seconds)

    async def counters(self) -> dict[str, dict[str, Any]]:
        return {
            name: {**vars(relay.counters), "is_cut": relay.is_cut, "bandwidth_mbps": relay.model.config.bandwidth_mbps, "rtt_ms": relay.model.config.rtt_ms}
            for name, relay in self._links.relays.items()
        }

    def _relay(self, direction: str):
        try:
            return self._links.relays[direction]
        except KeyError:
            raise ValueError(f"no link direction '{direction}' (known: {', '.join(sorted(self._links.relays))})") from None

"""Where the cluster's KV block servers listen, so that a link relay forwards only
to them and is never an open TCP proxy.

Each engine replica registers its block server in Ray's GCS (beside the TLS
credentials, app/engine/cluster_tls.py) before it serves, and removes it when it
shuts down. A relay reads the set when asked for an address it does not know,
at most once per `refresh_s`.
"""

from __future__ import annotations

import asyncio
import time

from app.ray_private import kv_delete, kv_get, kv_keys, kv_put

NAMESPACE, PREFIX = "pdd", "block_server/"

Address = tuple[str, int]


def register(replica_id: str, address: Address) -> None:
    kv_put(PREFIX + replica_id, f"{address[0]}:{address[1]}".encode(), NAMESPACE)


def unregister(replica_id: str) -> None:
    kv_delete(PREFIX + replica_id, NAMESPACE)


def address_of(replica_id: str) -> Address | None:
    value = kv_get(PREFIX + replica_id, NAMESPACE)
    return None if value is None else _address(value)


def _address(value: bytes) -> Address:
    host, _, port = value.decode().rpartition(":")
    return host, int(port)


def registered() -> set[Address]:
    out = set()
    for key in kv_keys(PREFIX, NAMESPACE):
        value = kv_get(key, NAMESPACE)
        if value is not None:
            out.add(_address(value))
    return out


class BlockServerDirectory:
    """A relay's view of the registered block servers (`allowed` is its check)."""

    def __init__(self, refresh_s: float = 1.0):
        self._known: set[Address] = set()
        self._read_at = -float("inf")
        self._refresh_s = refresh_s
        self._lock = asyncio.Lock()

    async def allowed(self, address: Address) -> bool:
        if address in self._known:
            return True
        async with self._lock:  # one GCS read for a burst of unknown addresses
            if address not in self._known and time.monotonic() - self._read_at >= self._refresh_s:
                self._known = await asyncio.to_thread(registered)
                self._read_at = time.monotonic()
        return address in self._known

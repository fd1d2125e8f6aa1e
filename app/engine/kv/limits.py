"""Bounds on a data-plane listener's open connections: per peer address and in all."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

logger = logging.getLogger(__name__)

#: Refusals are logged at most this often per listener (a flood must not flood the log too).
WARN_EVERY_S = 10.0


class ConnectionLimits:
    def __init__(self, name: str, per_peer: int, total: int):
        self.name = name
        self.per_peer = per_peer
        self.total = total
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._warned_at = -WARN_EVERY_S
        self.refused = 0

    def admit(self, peer: str) -> bool:
        """Count a new connection from `peer`; False (logged) when over a bound."""
        with self._lock:
            if self._open[peer] >= self.per_peer:
                why = f"{peer} already holds {self.per_peer} connections (security.max_connections_per_peer)"
            elif sum(self._open.values()) >= self.total:
                why = f"{self.total} connections open (security.max_connections)"
            else:
                self._open[peer] += 1
                return True
            self.refused += 1
            if time.monotonic() - self._warned_at >= WARN_EVERY_S:
                self._warned_at = time.monotonic()
                logger.warning("%s refused a connection: %s (%d refused so far)", self.name, why, self.refused)
            return False

    def release(self, peer: str) -> None:
        with self._lock:
            self._open[peer] -= 1
            if self._open[peer] <= 0:
                del self._open[peer]

    @property
    def open(self) -> int:
        with self._lock:
            return sum(self._open.values())

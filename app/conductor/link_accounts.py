"""Routing's account of each link: what it expects pulls to move, before they report.

Two models per direction ("dc-a->dc-b"), both from the configured link: the backlog
(KV bytes routed onto the link and not yet moved, which `choose_pipeline` adds to a
request's own transfer) and the share (each pull's part of the bandwidth beside the
others, what a pull needs on a healthy link: the agents' yardstick for a slow one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from app.config import LinkConfig
from app.config.kv import KVTransferSettings
from app.engine.kv.link import LinkShare
from app.policy import LinkBacklog


class LinkAccounts:
    def __init__(self, link_config: Callable[[str, str], LinkConfig], kv: KVTransferSettings):
        self._link_config = link_config
        self._kv = kv
        self.backlogs: dict[str, LinkBacklog] = {}
        self.shares: dict[str, LinkShare] = {}

    def _config(self, link: str) -> LinkConfig:
        return self._link_config(*link.split("->"))

    def _backlog(self, link: str) -> LinkBacklog:
        backlog = self.backlogs.get(link)
        if backlog is None:
            backlog = self.backlogs[link] = LinkBacklog(self._config(link).bytes_per_s)
        return backlog

    def share(self, link: str) -> LinkShare:
        share = self.shares.get(link)
        if share is None:
            share = self.shares[link] = LinkShare(self._config(link).bytes_per_s, self._kv.concurrent_pulls, self._kv.pull_order)
        return share

    def backlog(self, link: str) -> int:
        """KV bytes still queued on a link, by its configured model."""
        backlog = self.backlogs.get(link)
        return backlog.queued(time.monotonic()) if backlog is not None else 0

    def start(self, link: str, pull_id: str, expected: int, destination: str) -> float:
        """A pull expected to move `expected` bytes starts; returns its place in the backlog."""
        now = time.monotonic()
        place = self._backlog(link).add(expected, now)
        self.share(link).start(pull_id, expected, now, destination=destination)
        return place

    def settle(self, link: str, pull_id: str, place: float, expected: int, moved: int) -> None:
        """What a pull did not move of routing's estimate leaves the link's models."""
        now = time.monotonic()
        self._backlog(link).settle(place, expected, moved, now)
        self.share(link).settle(pull_id, moved, now)

    def model_seconds(self, link: str, pull_id: str, expected: int, moved: int) -> float | None:
        """What the configured link needs for this pull beside the others routed onto it.

        The model moved the bytes routing expected; the pull moved `moved` (more when the
        decoder's cache held less than estimated): the model's share of the bandwidth
        applies to those."""
        share = self.shares.get(link)
        shared_s = share.finish(pull_id, time.monotonic()) if share is not None else None
        if shared_s is None:
            return None
        return self._config(link).mean_latency_s + shared_s * moved / expected

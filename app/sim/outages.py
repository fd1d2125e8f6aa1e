"""Outage windows a twin run is given: what is unavailable, and when."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Outage(NamedTuple):
    """`what` is unavailable in [start_s, end_s): "wan" (the P <-> MD link is cut),
    "main_decode" (no main decoder alive) or "relay_decode" (no relay decoder alive)."""

    start_s: float
    end_s: float
    what: str


OUTAGE_KINDS = ("wan", "main_decode", "relay_decode")


class Outages:
    def __init__(self, outages: Iterable[Outage]):
        outages = list(outages)
        unknown = {o.what for o in outages} - set(OUTAGE_KINDS)
        if unknown:
            raise ValueError(f"unknown outage kind(s) {sorted(unknown)}; known: {', '.join(OUTAGE_KINDS)}")
        self.windows = {kind: [(o.start_s, o.end_s) for o in outages if o.what == kind] for kind in OUTAGE_KINDS}
        """Kind -> [start_s, end_s) windows."""
        for md in self.windows["main_decode"]:
            for rld in self.windows["relay_decode"]:
                if max(md[0], rld[0]) < min(md[1], rld[1]):
                    raise ValueError(
                        f"main_decode outage {md} overlaps relay_decode outage {rld}: with neither decoder alive "
                        "the conductor refuses requests, which the twin does not model"
                    )

    def down(self, kind: str, now: float) -> bool:
        return any(s <= now < e for s, e in self.windows[kind])

"""How KV blocks move between engines."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import Field

from app.config.base import StrictModel


class PullOrder(str, Enum):
    """Which waiting pull a decoding engine's next free pull thread takes."""

    smallest_first = "smallest_first"
    """Fewest blocks first, ties in arrival order: a high-hit turn's few missing
    blocks (a P-MD client waiting on them, or a relay held past its turn) never
    queue behind cold prompts' pulls. A large pull waits while smaller ones keep
    arriving, so it moves when the link has slack."""
    arrival = "arrival"
    """First come, first served."""


class KVTransferSettings(StrictModel):
    """How KV blocks move between engines."""

    lease_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """Prefill keeps a finished prompt's blocks this long for decoders to pull."""
    connect_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    transfer_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """A pull not done by then is abandoned; the decoder recomputes."""
    concurrent_pulls: Annotated[int, Field(ge=1)] = 8
    """Pulls one decoding engine runs at once (its connector's pull threads); the
    others wait their turn (`pull_order`), and that wait is not part of a
    transfer's `seconds` (it is its `queued_seconds`). Fewer at once: each pull on
    a slow link finishes sooner, but the waiting ones wait longer."""
    pull_order: PullOrder = PullOrder.smallest_first
    """Which waiting pull goes next when a pull thread frees."""

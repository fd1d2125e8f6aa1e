"""Service-level objectives."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.config.base import StrictModel


class SLOConfig(StrictModel):
    ttft_ms: Annotated[float, Field(gt=0)] = 2000.0
    """Time to first token target."""
    tpot_ms: Annotated[float, Field(gt=0)] = 200.0
    """Mean time per output token (after the first) target."""
    max_gap_ms: Annotated[float, Field(gt=0)] = 1000.0
    """Worst inter-token gap target (handoffs and transfers show up here)."""
    percentile: Annotated[float, Field(gt=0, lt=100)] = 90.0
    """The percentile the targets apply to."""
    window_s: Annotated[float, Field(gt=0)] = 300.0
    """Evaluation window for recording rules and agents."""

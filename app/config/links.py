"""Network links between datacenters, as emulated."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.config.base import StrictModel


class JitterConfig(StrictModel):
    """Per-transfer extra latency, drawn from a seeded distribution."""

    distribution: Literal["none", "normal", "lognormal", "exponential", "pareto"] = "none"
    mean_ms: Annotated[float, Field(ge=0)] = 0.0
    """Mean of the extra latency."""
    std_ms: Annotated[float, Field(ge=0)] = 0.0
    """Spread (normal, lognormal); ignored by exponential; pareto uses `pareto_shape`."""
    pareto_shape: Annotated[float, Field(gt=1)] = 2.5
    max_ms: Annotated[float, Field(ge=0)] = 30_000.0
    """Cap, so one draw cannot stall a transfer forever."""


class StallConfig(StrictModel):
    """Random stalls: a transfer pauses mid-stream (TCP retransmit storms, congestion)."""

    probability: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Chance that one transfer stalls once."""
    duration_ms: Annotated[float, Field(ge=0)] = 0.0


class LinkConfig(StrictModel):
    """A network path between two datacenters (or within one), emulated in user space."""

    between: tuple[str, str]
    """The two datacenters (equal for the intra-datacenter link). Symmetric."""
    bandwidth_mbps: Annotated[float, Field(gt=0)]
    """Throughput available to KV transfers, megabits per second."""
    rtt_ms: Annotated[float, Field(ge=0)] = 0.0
    """Base round-trip time; one RTT is paid per pull before bytes flow."""
    jitter: JitterConfig = JitterConfig()
    stall: StallConfig = StallConfig()
    seed: int = 0
    """Seed of the jitter and stall draws (reproducible runs)."""

    @property
    def key(self) -> tuple[str, str]:
        return link_key(*self.between)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def mean_latency_s(self) -> float:
        """What a pull waits on this link besides its bytes, on average: RTT, mean jitter, mean stall.

        The configured jitter and stalls are part of the model: a link that behaves
        exactly as configured must not read as degraded."""
        jitter_ms = self.jitter.mean_ms if self.jitter.distribution != "none" else 0.0
        return (self.rtt_ms + jitter_ms + self.stall.probability * self.stall.duration_ms) / 1000


def link_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)

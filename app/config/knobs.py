"""The live knobs: routing and handoff, changed without a restart."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import Field, model_validator

from app.config.base import StrictModel


class SingularFilterConfig(StrictModel):
    """Ultra-long, low-hit input with ultra-short output finishes on RLD (P-RLD).

    The only exception to "every request ends at MD"; must stay rare.
    """

    enabled: bool = True
    min_prompt_tokens: Annotated[int, Field(ge=1)] = 4096
    """Only prompts at least this long."""
    max_hit_rate: Annotated[float, Field(ge=0, le=1)] = 0.2
    """Only when MD's expected prefix hit is at most this."""
    max_output_tokens: Annotated[int, Field(ge=1)] = 16
    """Only when the request asks for at most this many tokens."""


class RoutingConfig(StrictModel):
    """Live knob: which pipeline a request takes (conductor user_config)."""

    max_wan_transfer_ms: Annotated[float, Field(ge=0)] = 300.0
    """P-MD when the gap it is predicted to cause is at most this; above it
    P-RLD-MD masks the gap with a relay. The gap: the WAN transfer of the blocks
    MD lacks (x bytes / bandwidth + RTT, behind the link's backlog), then MD's
    wait for a step and its extend step, corrected by what finished P-MD turns
    showed (app/policy.py `GapCorrection`)."""
    min_hit_rate: Annotated[float, Field(ge=0, le=1)] | None = None
    """Alternative form of the threshold: when set, P-MD also requires MD's
    expected prefix hit to be at least this."""
    max_relay_load: Annotated[float, Field(gt=0, le=1)] = 0.9
    """RLD occupancy (active relays / max_num_seqs) above which new requests
    skip the relay (P-MD) rather than overload RLD."""
    prefill_relays: bool = True
    """While no relay decoder is alive (its replica died and Serve is replacing
    it, or none is deployed), the prefill replica that computed a request's
    prompt relays it (P-P-MD) where P-RLD-MD would have been taken: the client
    sees P's tokens while MD pulls, not the WAN pull as a gap. P then decodes
    besides prefilling (at most the relay cap, scaled by P's own occupancy);
    false sends those requests P-MD."""
    singular: SingularFilterConfig = SingularFilterConfig()


class HandoffMode(str, Enum):
    one_shot = "one_shot"
    catch_up = "catch_up"
    auto = "auto"


class HandoffConfig(StrictModel):
    """Live knob: how RLD hands a request over to MD (conductor user_config)."""

    mode: HandoffMode = HandoffMode.auto
    """one_shot: all eager tokens at once; catch_up: a first slice warms MD while
    RLD continues, then the rest; auto: catch_up only past the threshold."""
    catch_up_threshold_tokens: Annotated[int, Field(ge=1)] = 64
    """In auto mode, eager tokens beyond which the handoff goes in two steps."""
    relay_cap_tokens: Annotated[int, Field(ge=1)] = 512
    """Most tokens RLD produces for one request. The cap shrinks with RLD load
    (dynamic cap); at the cap RLD stops and MD resumes once it holds the KV."""
    min_relay_cap_tokens: Annotated[int, Field(ge=1)] = 32
    """The dynamic cap never drops below this."""

    @model_validator(mode="after")
    def _caps_ordered(self) -> HandoffConfig:
        if self.min_relay_cap_tokens > self.relay_cap_tokens:
            raise ValueError("min_relay_cap_tokens must not exceed relay_cap_tokens")
        return self


class LiveKnobs(StrictModel):
    """What the Conductor deployment's user_config carries (changed without restart)."""

    routing: RoutingConfig = RoutingConfig()
    handoff: HandoffConfig = HandoffConfig()

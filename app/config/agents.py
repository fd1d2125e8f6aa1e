"""The agents: mode, bounds, LLM endpoint, where they keep their records."""

from __future__ import annotations

import typing
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from app.config.base import StrictModel
from app.config.knobs import LiveKnobs


class AgentMode(str, Enum):
    observe = "observe"
    advise = "advise"
    act = "act"


class KnobBounds(StrictModel):
    min: float
    max: float
    max_step: Annotated[float, Field(gt=0)]
    """Largest change per action."""

    @model_validator(mode="after")
    def _ordered(self) -> KnobBounds:
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        return self


class LLMEndpoint(StrictModel):
    base_url: str
    """Any OpenAI-compatible endpoint (may be this cluster)."""
    model: str
    api_key_env: str = "PDD_AGENT_LLM_API_KEY"
    """Name of the environment variable holding the key (never the key itself)."""


class AgentsConfig(StrictModel):
    mode: AgentMode = AgentMode.observe
    tick_s: Annotated[float, Field(gt=0)] = 30.0
    cooldown_s: Annotated[float, Field(ge=0)] = 120.0
    """Minimum time between two changes of the same knob."""
    verify_after_s: Annotated[float, Field(ge=0)] = 60.0
    """How long after acting the SLO is checked again (roll back if worse)."""
    replica_start_s: Annotated[float, Field(ge=0)] = 300.0
    """How long a replica the agents add may take to come up (engine start, weights)
    before the shortfall counts as a crash; for this long plus `cooldown_s` the role
    is not judged idle either (its new replica has not drawn its share of the load)."""
    prometheus_url: str = "http://127.0.0.1:9090"
    bounds: dict[str, KnobBounds] = {
        "routing.max_wan_transfer_ms": KnobBounds(min=0, max=5000, max_step=200),
        "handoff.catch_up_threshold_tokens": KnobBounds(min=8, max=512, max_step=64),
        "handoff.relay_cap_tokens": KnobBounds(min=32, max=4096, max_step=256),
        "routing.min_hit_rate": KnobBounds(min=0, max=0.95, max_step=0.1),
        "routing.singular.min_prompt_tokens": KnobBounds(min=1024, max=65536, max_step=4096),
    }
    """Per-knob bounds; replica bounds come from each role's max_replicas.
    A numeric knob without bounds here is never changed by the agents."""
    llm: LLMEndpoint | None = None
    """None: the swarm runs rule-routed and chat-ops says how to configure one."""
    audit_db: str = "~/.cache/pdd-serve/agents.sqlite"
    chat_db: str = "~/.cache/pdd-serve/chatops.sqlite"
    """Chat-ops conversations (`pdd ask`, POST /pdd/chat): a LangGraph checkpointer, one thread per conversation."""
    actions_dir: str = "runbooks/actions"
    dashboard_url: str = "http://127.0.0.1:8265"
    """Ray dashboard the agents actuate through (Serve REST API: redeploy, scale)."""
    prometheus_matchers: dict[str, str] = {}
    """Label matchers added to every agent query, e.g. `{job: ray-prod}` when one
    Prometheus scrapes several clusters."""
    confirm_ticks: Annotated[int, Field(ge=1)] = 2
    """Consecutive ticks a situation must persist before a change is proposed
    (hysteresis: one noisy scrape never moves a knob)."""
    regression_tolerance: Annotated[float, Field(gt=0, le=1)] = 0.1
    """Relative worsening of the SLO score (worst figure / target) after a change
    that makes the agents roll it back."""
    max_cost_per_hour: Annotated[float, Field(gt=0)] | None = None
    """Ceiling on the fleet's hardware cost (replicas x their node group's
    cost_per_hour, summed over roles). The agents never scale past it; a role
    that must grow at the ceiling gets a replica moved from another role.
    None: no ceiling (each role is still bounded by its max_replicas)."""

    @field_validator("bounds")
    @classmethod
    def _bounds_name_numeric_knobs(cls, v: dict[str, KnobBounds]) -> dict[str, KnobBounds]:
        for path in v:
            model: type[BaseModel] = LiveKnobs
            *parents, leaf = path.split(".")
            for part in parents:
                field = model.model_fields.get(part)
                if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                    raise ValueError(f"'{path}' is not a live knob (routing.* or handoff.*)")
                model = field.annotation
            field = model.model_fields.get(leaf)
            if field is None or not _is_numeric(field.annotation):
                raise ValueError(f"'{path}' is not a numeric live knob (routing.* or handoff.*)")
        return v


def _is_numeric(annotation: Any) -> bool:
    """int/float, also inside Annotated[...] and Optional[...] (as `min_hit_rate` is)."""
    if annotation in (int, float):
        return True
    return any(_is_numeric(a) for a in typing.get_args(annotation) if not isinstance(a, FieldInfo))

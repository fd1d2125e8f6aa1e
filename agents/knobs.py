"""What the agents may change, and the shape of a change.

Two kinds of target:
- live knobs, addressed by their path in `LiveKnobs` (`routing.max_wan_transfer_ms`,
  `handoff.mode`): the Conductor deployment's user_config;
- replica counts, addressed as `replicas.<role>` (`replicas.relay_decode`):
  the Serve scale endpoint.

A notice (`notice.<situation>`) changes nothing: it files a runbook action entry
for a person. Everything here is pure.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from app.config import AgentsConfig, HandoffMode, KnobBounds, LiveKnobs, PDDConfig, RoleName

REPLICAS = "replicas."
NOTICE = "notice."

#: Knobs with a fixed set of values (no bounds or step size; cooldowns still apply).
CHOICE_KNOBS: dict[str, tuple[Any, ...]] = {
    "handoff.mode": tuple(m.value for m in HandoffMode),
    "routing.singular.enabled": (True, False),
}
#: Numeric knobs that hold whole numbers.
INTEGER_KNOBS = frozenset(
    {
        "handoff.catch_up_threshold_tokens",
        "handoff.relay_cap_tokens",
        "handoff.min_relay_cap_tokens",
        "routing.singular.min_prompt_tokens",
        "routing.singular.max_output_tokens",
    }
)


class Change(BaseModel):
    """One target moved from one value to another (a rollback is the reverse change)."""

    model_config = ConfigDict(frozen=True)

    target: str
    old: Any
    new: Any

    def reverse(self) -> Change:
        return Change(target=self.target, old=self.new, new=self.old)

    def describe(self) -> str:
        if is_notice(self.target):
            return f"notice: {self.new}"
        return f"{self.target}: {fmt(self.old)} -> {fmt(self.new)}"


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "unset" if value is None else str(value)


def replica_target(role: RoleName) -> str:
    return REPLICAS + role.value


def notice_target(situation_key: str) -> str:
    return NOTICE + situation_key


def is_replicas(target: str) -> bool:
    return target.startswith(REPLICAS)


def is_notice(target: str) -> bool:
    return target.startswith(NOTICE)


def role_of(target: str) -> RoleName:
    return RoleName(target.removeprefix(REPLICAS))


def knob_paths(model: type[BaseModel] = LiveKnobs, prefix: str = "") -> list[str]:
    """Every live knob's dotted path (routing.singular.enabled, handoff.mode, ...)."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths += knob_paths(field.annotation, f"{path}.")
        else:
            paths.append(path)
    return paths


def get_knob(knobs: LiveKnobs, path: str) -> Any:
    obj: Any = knobs
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj.value if isinstance(obj, HandoffMode) else obj


def with_knobs(knobs: LiveKnobs, changes: dict[str, Any]) -> LiveKnobs:
    """A new LiveKnobs with the given paths set; raises ValueError when the result is invalid."""
    data = knobs.model_dump(mode="json")
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        if leaf not in node:
            raise ValueError(f"unknown knob '{path}'")
        node[leaf] = value
    return LiveKnobs.model_validate(data)


def knob_bounds(agents: AgentsConfig, config: PDDConfig, target: str) -> KnobBounds | None:
    """Bounds of a numeric target; None when the agents may not move it."""
    if is_replicas(target):
        rc = config.roles.get(role_of(target))
        if rc is None:
            return None
        return KnobBounds(min=1, max=rc.max_replicas, max_step=1)
    return agents.bounds.get(target)


def is_integer(target: str) -> bool:
    return is_replicas(target) or target in INTEGER_KNOBS


Kind = Literal["knob", "choice", "replicas", "notice"]


def kind_of(target: str) -> Kind:
    if is_replicas(target):
        return "replicas"
    if is_notice(target):
        return "notice"
    if target in CHOICE_KNOBS:
        return "choice"
    return "knob"


def clamp(value: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, value))


def limit(target: str, old: float | None, new: float, bounds: KnobBounds) -> float:
    """`new` brought within the bounds and one step of `old` (an unset knob starts at the minimum)."""
    start = bounds.min if old is None else float(old)
    value = clamp(new, start - bounds.max_step, start + bounds.max_step)
    value = clamp(value, bounds.min, bounds.max)
    if is_integer(target):
        # round towards `start` so rounding never exceeds the step
        value = math.floor(value) if value > start else math.ceil(value)
        value = int(clamp(value, math.ceil(bounds.min), math.floor(bounds.max)))
    return value

"""The digital twin's what-if, when app/sim provides one.

Interface (for app/sim to implement as `app.sim.whatif.what_if`):

    what_if(config: PDDConfig, replicas: dict[str, int], knobs: LiveKnobs,
            load_rps: float) -> Mapping[str, float] | object

`replicas` maps role names (`prefill`, `relay_decode`, `main_decode`) to
counts; the answer carries `ttft_ms`, `tpot_ms` and `gap_ms` (the worst
inter-token gap) at `config.slo.percentile`, as keys or attributes. The
capacity specialist asks it about candidate replica plans; without it, it
uses a deterministic rule.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config import LiveKnobs, PDDConfig

WhatIf = Callable[[PDDConfig, dict[str, int], LiveKnobs, float], Any]


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    gap_ms: float

    def score(self, config: PDDConfig) -> float:
        """Worst predicted figure / target, as agents/figures.slo_score."""
        slo = config.slo
        return max(self.ttft_ms / slo.ttft_ms, self.tpot_ms / slo.tpot_ms, self.gap_ms / slo.max_gap_ms)


def predict(what_if: WhatIf, config: PDDConfig, replicas: dict[str, int], knobs: LiveKnobs, load_rps: float) -> Prediction:
    answer = what_if(config, dict(replicas), knobs, load_rps)

    def get(name: str) -> float:
        value = answer[name] if isinstance(answer, Mapping) else getattr(answer, name)
        return float(value)

    return Prediction(ttft_ms=get("ttft_ms"), tpot_ms=get("tpot_ms"), gap_ms=get("gap_ms"))


def load_what_if() -> WhatIf | None:
    """`app.sim.whatif.what_if` when the twin ships it; None otherwise."""
    try:
        module = importlib.import_module("app.sim.whatif")
    except ImportError:
        return None
    fn = getattr(module, "what_if", None)
    return fn if callable(fn) else None

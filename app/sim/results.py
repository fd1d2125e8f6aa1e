"""Per-request outcomes of a run, stored column-wise (a million requests stay cheap)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from app.policy import Pipeline

PIPELINES: tuple[Pipeline, ...] = tuple(Pipeline)
PIPELINE_CODE = {p: i for i, p in enumerate(PIPELINES)}


@dataclass(frozen=True)
class RequestResult:
    """One request's journey as the client saw it (times in seconds)."""

    rid: int
    arrival_s: float
    ttft_s: float
    tpot_s: float
    """Mean time per output token after the first (nan for one-token outputs)."""
    max_gap_s: float
    """Worst inter-token gap."""
    pipeline: Pipeline
    prompt_tokens: int
    output_tokens: int
    prefill_hit_tokens: int
    decode_hit_tokens: int
    """Prefix hit at the replica that finished the request (MD in PDD)."""
    relay_tokens: int
    """Tokens the relay decoder produced."""
    wan_bytes: int


_COLUMNS = ("rid", "arrival", "ttft", "last", "gap", "pipe", "prompt", "output", "p_hit", "d_hit", "relay", "wan")
_TYPES = ("q", "d", "d", "d", "d", "b", "q", "q", "q", "q", "q", "q")


@dataclass
class Results:
    cols: dict[str, array] = field(default_factory=lambda: {c: array(t) for c, t in zip(_COLUMNS, _TYPES)})

    def add(self, rid: int, arrival: float, t_first: float, t_last: float, gap: float, pipeline: Pipeline,
            prompt: int, output: int, p_hit: int, d_hit: int, relay: int, wan: int) -> None:
        c = self.cols
        c["rid"].append(rid)
        c["arrival"].append(arrival)
        c["ttft"].append(t_first - arrival)
        c["last"].append(t_last)
        c["gap"].append(gap)
        c["pipe"].append(PIPELINE_CODE[pipeline])
        c["prompt"].append(prompt)
        c["output"].append(output)
        c["p_hit"].append(p_hit)
        c["d_hit"].append(d_hit)
        c["relay"].append(relay)
        c["wan"].append(wan)

    def __len__(self) -> int:
        return len(self.cols["rid"])

    def arrays(self) -> dict[str, Any]:
        """numpy columns in request (arrival) order, with `tpot` derived."""
        import numpy as np

        a = {k: np.frombuffer(v, dtype=v.typecode) if len(v) else np.zeros(0, dtype=v.typecode) for k, v in self.cols.items()}
        order = np.argsort(a["rid"], kind="stable")
        a = {k: v[order] for k, v in a.items()}
        first = a["arrival"] + a["ttft"]
        with np.errstate(invalid="ignore", divide="ignore"):
            a["tpot"] = np.where(a["output"] > 1, (a["last"] - first) / (a["output"] - 1), np.nan)
        return a

    def records(self) -> list[RequestResult]:
        a = self.arrays()
        return [
            RequestResult(int(a["rid"][i]), float(a["arrival"][i]), float(a["ttft"][i]), float(a["tpot"][i]),
                          float(a["gap"][i]), PIPELINES[int(a["pipe"][i])], int(a["prompt"][i]), int(a["output"][i]),
                          int(a["p_hit"][i]), int(a["d_hit"][i]), int(a["relay"][i]), int(a["wan"][i]))
            for i in range(len(a["rid"]))
        ]

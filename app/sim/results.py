"""Per-request outcomes of a run, stored column-wise (a million requests stay cheap)."""

from __future__ import annotations

import math
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
    """Prefix hit at the decoding replica: MD in PDD, also when the relay finished the request."""
    relay_tokens: int
    """Tokens the relay decoder produced."""
    wan_bytes: int


_COLUMNS = ("rid", "arrival", "ttft", "last", "gap", "pipe", "prompt", "output", "p_hit", "d_hit", "relay", "wan")
_WAN = _COLUMNS.index("wan")
_ARRIVAL = _COLUMNS.index("arrival")
_D_HIT = _COLUMNS.index("d_hit")
_INTS = {"rid", "pipe", "prompt", "output", "p_hit", "d_hit", "relay", "wan"}


@dataclass
class Results:
    rows: array = field(default_factory=lambda: array("d"))
    """Row-major, one float per column of _COLUMNS (integers are exact below 2**53)."""
    arrivals_end_s: float = math.nan
    """The workload's last scheduled arrival. A turn its session held back (the
    previous turn still ran) is stored at its later start, which may fall past it."""

    def measured(self, warmup: float) -> tuple[float, float]:
        """(start, end) of the measured window: requests starting from `start` count (the first
        `warmup` share of the arrivals fills the caches), until the last scheduled arrival."""
        import numpy as np

        a = np.frombuffer(self.rows, dtype=np.float64)[_ARRIVAL :: len(_COLUMNS)]
        first = float(a.min())
        end = self.arrivals_end_s if not math.isnan(self.arrivals_end_s) else float(a.max())
        return first + warmup * (end - first), end

    def add(
        self,
        rid: int,
        arrival: float,
        t_first: float,
        t_last: float,
        gap: float,
        pipeline: Pipeline,
        prompt: int,
        output: int,
        p_hit: int,
        d_hit: int,
        relay: int,
        wan: int,
    ) -> int:
        """Store a finished request; returns its row (for `add_wan`)."""
        self.rows.extend((rid, arrival, t_first - arrival, t_last, gap, PIPELINE_CODE[pipeline], prompt, output, p_hit, d_hit, relay, wan))
        return len(self.rows) // len(_COLUMNS) - 1

    def add_wan(self, row: int, nbytes: int) -> None:
        """WAN bytes a finished request still moved (MD catching up after the relay ended it)."""
        self.rows[row * len(_COLUMNS) + _WAN] += nbytes

    def set_decode_hit(self, row: int, tokens: int) -> None:
        """MD's hit on a request the relay finished before MD's pull started."""
        self.rows[row * len(_COLUMNS) + _D_HIT] = tokens

    def __len__(self) -> int:
        return len(self.rows) // len(_COLUMNS)

    def arrays(self) -> dict[str, Any]:
        """numpy columns in request (arrival) order, with `tpot` derived."""
        import numpy as np

        table = np.frombuffer(self.rows, dtype=np.float64).reshape(-1, len(_COLUMNS))
        table = table[np.argsort(table[:, 0], kind="stable")]
        a = {c: (table[:, i].astype(np.int64) if c in _INTS else table[:, i].copy()) for i, c in enumerate(_COLUMNS)}
        first = a["arrival"] + a["ttft"]
        with np.errstate(invalid="ignore", divide="ignore"):
            a["tpot"] = np.where(a["output"] > 1, (a["last"] - first) / (a["output"] - 1), np.nan)
        return a

    def records(self) -> list[RequestResult]:
        a = self.arrays()
        return [
            RequestResult(
                int(a["rid"][i]),
                float(a["arrival"][i]),
                float(a["ttft"][i]),
                float(a["tpot"][i]),
                float(a["gap"][i]),
                PIPELINES[int(a["pipe"][i])],
                int(a["prompt"][i]),
                int(a["output"][i]),
                int(a["p_hit"][i]),
                int(a["d_hit"][i]),
                int(a["relay"][i]),
                int(a["wan"][i]),
            )
            for i in range(len(a["rid"]))
        ]

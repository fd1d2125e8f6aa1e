"""What the twin serves: an agentic multi-turn generator, or a replayed JSONL trace.

A request says how long its prompt is, how much of it repeats the
conversation so far, and how many tokens it asks for. Token ids are never
needed: caches are tracked per conversation (app/sim/cache.py).

Trace format (one JSON object per line, in arrival order):

    {"arrival_s": 12.5, "session": "c17", "prompt_tokens": 60412,
     "prefix_tokens": 59800, "output_tokens": 380}

- `arrival_s`: seconds since the start of the trace.
- `session`: conversation id (string or integer); turns of one conversation
  reuse its prefix and are routed to the same replicas.
- `prompt_tokens`: prompt length.
- `prefix_tokens`: leading prompt tokens identical to the conversation's
  previous request's prompt followed by its output (0 for a first turn).
  Equal to that whole length when the turn only appends to the context;
  smaller when the context was rewritten (compaction, edits), which
  invalidates cached blocks past that point.
- `output_tokens`: tokens generated (the request's max_tokens; ignore_eos).

Other keys are ignored. A request longer than the served model's window
(prompt plus output over `model.max_model_len`) is refused, as the real API
refuses it.

The generator's hit rate of a turn is prefix_tokens / prompt_tokens: what a
cache that kept the whole conversation would hit.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.config.file import validation_problems


class Request(NamedTuple):
    arrival_s: float
    session: int | str
    prompt_tokens: int
    prefix_tokens: int
    output_tokens: int


class HitBand(BaseModel):
    """A share of turns whose hit rate is drawn uniformly in [low, high]."""

    model_config = ConfigDict(extra="forbid")
    weight: Annotated[float, Field(gt=0)]
    low: Annotated[float, Field(ge=0, le=1)]
    high: Annotated[float, Field(ge=0, le=1)]


class AgenticWorkload(BaseModel):
    """Agentic sessions: long contexts that grow turn by turn, mostly cached.

    Sessions start as a Poisson process at `rps / mean turns`; a session's next
    turn arrives `think_time` after the previous one arrived (the agent's tool
    time plus the model's answer). The superposition of many such sessions is
    close to Poisson at `rps` (Palm-Khintchine), steady from time 0 (sessions
    already under way then contribute their later turns). A turn due before its
    predecessor finished is held back until it has (`SimRun.delayed_turns`); one
    held back past the last scheduled arrival misses the SLO (app/sim/report.py).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    requests: Annotated[int, Field(gt=0)] = 2000
    rps: Annotated[float, Field(gt=0)] = 1.0
    seed: int = 0
    turns_min: Annotated[int, Field(ge=1)] = 20
    turns_max: Annotated[int, Field(ge=1)] = 60
    """Turns per session, uniform in [turns_min, turns_max] ("dozens of tool-call turns")."""
    first_prompt_median: Annotated[int, Field(gt=0)] = 24_000
    first_prompt_sigma: Annotated[float, Field(ge=0)] = 0.5
    """First turn's prompt: lognormal (system prompt, tools, task)."""
    max_context_tokens: Annotated[int, Field(gt=0)] = 65_536
    compact_to: Annotated[float, Field(gt=0, le=1)] = 0.5
    """A turn that would outgrow max_context is compacted to this fraction of it;
    only the turn's drawn hit share of the compacted prompt is reused."""
    hit_bands: list[HitBand] = [
        HitBand(weight=0.75, low=0.95, high=1.0),
        HitBand(weight=0.23, low=0.6, high=0.95),
        HitBand(weight=0.02, low=0.0, high=0.5),
    ]
    """Hit-rate mix of follow-up turns. With the cold first turns and the
    compactions, the default gives what the PDD paper reports: ~90% on
    average, ~73% of turns above 95%, a low-hit tail (< 50%) of ~4%."""
    output_median: Annotated[int, Field(gt=0)] = 400
    output_sigma: Annotated[float, Field(ge=0)] = 0.8
    output_max: Annotated[int, Field(gt=0)] = 4096
    think_time_min_s: Annotated[float, Field(ge=0)] = 20.0
    think_time_mean_s: Annotated[float, Field(ge=0)] = 20.0
    """Gap between a session's turns: think_time_min_s plus an exponential draw of this mean."""
    answer_s_per_output_token: Annotated[float, Field(ge=0)] = 0.0
    """Seconds the gap grows per output token of the previous turn: the agent reads the
    whole answer before its tools run. 0 folds the answer into the think time, which
    holds for outputs that stream within think_time_min_s; with longer outputs, turns
    would come due before their predecessor finished even on an idle cluster."""

    def with_rps(self, rps: float) -> AgenticWorkload:
        return self.model_copy(update={"rps": rps})

    def generate(self) -> Iterator[Request]:
        return agentic_requests(self)


class _Draws:
    """The generator's settings unpacked once (the per-turn loop is hot on million-request runs)."""

    def __init__(self, w: AgenticWorkload):
        self.turns = (w.turns_min, max(w.turns_min, w.turns_max))
        self.bands = [(b.low, b.high) for b in w.hit_bands]
        self.cum = list(itertools.accumulate(b.weight for b in w.hit_bands))
        self.first_mu = math.log(w.first_prompt_median)
        self.first_sigma = w.first_prompt_sigma
        self.max_context = w.max_context_tokens
        self.compacted = max(1, int(w.compact_to * w.max_context_tokens))
        self.out_mu = math.log(w.output_median)
        self.out_sigma = w.output_sigma
        self.out_max = w.output_max
        self.think_min = w.think_time_min_s
        self.think_rate = 1 / w.think_time_mean_s if w.think_time_mean_s > 0 else 0.0
        self.answer_s = w.answer_s_per_output_token


def _session_turns(d: _Draws, rng: random.Random, start: float) -> list[tuple[float, int, int, int]]:
    turns = rng.randint(*d.turns)
    out = []
    t = start
    stream = output = 0
    lognorm = rng.lognormvariate
    total = d.cum[-1]
    for i in range(turns):
        if i == 0:
            prompt = min(d.max_context, max(1, int(lognorm(d.first_mu, d.first_sigma))))
            prefix = 0
        else:
            low, high = d.bands[bisect.bisect(d.cum, rng.random() * total)]
            hit = low + (high - low) * rng.random()
            grown = math.ceil(stream / hit) if hit > 0 else d.max_context + 1
            if grown <= d.max_context:
                prompt = max(stream + 1, grown)
                prefix = stream
            else:
                prompt = d.compacted
                prefix = min(stream, int(hit * prompt))
            t += d.think_min + (rng.expovariate(d.think_rate) if d.think_rate else 0.0) + output * d.answer_s
        output = min(d.out_max, max(1, int(lognorm(d.out_mu, d.out_sigma))))
        out.append((t, prompt, prefix, output))
        stream = prompt + output
    return out


def agentic_requests(w: AgenticWorkload) -> Iterator[Request]:
    """`w.requests` requests in arrival order, generated lazily (memory: open sessions only)."""
    rng = random.Random(w.seed)
    draws = _Draws(w)
    session_rate = w.rps / ((w.turns_min + max(w.turns_min, w.turns_max)) / 2)
    pending: list[tuple[float, int, int, Request]] = []
    # sessions start a lifetime before 0 and only arrivals from 0 on are served: the offered
    # rate is steady from the first request (caches still start cold: see the warm-up share)
    mean_output = min(w.output_max, w.output_median * math.exp(w.output_sigma**2 / 2))
    mean_gap = w.think_time_min_s + w.think_time_mean_s + mean_output * w.answer_s_per_output_token
    next_start = -max(w.turns_min, w.turns_max) * mean_gap + rng.expovariate(session_rate)
    sid = 0
    emitted = 0
    while emitted < w.requests:
        if not pending or next_start <= pending[0][0]:
            for k, (t, prompt, prefix, output) in enumerate(_session_turns(draws, rng, next_start)):
                if t >= 0:
                    heapq.heappush(pending, (t, sid, k, Request(t, sid, prompt, prefix, output)))
            sid += 1
            next_start += rng.expovariate(session_rate)
            continue
        yield heapq.heappop(pending)[3]
        emitted += 1


def fitted_to_window(w: AgenticWorkload, max_model_len: int) -> AgenticWorkload:
    """`w` with its contexts and outputs shrunk into a model window of `max_model_len`
    tokens (prompt plus output): contexts to 7/8 of it, outputs to the rest."""
    window = min(w.max_context_tokens, max_model_len * 7 // 8)
    return w.model_copy(
        update={
            "max_context_tokens": window,
            "first_prompt_median": max(1, min(w.first_prompt_median, window // 2)),
            "output_max": max(1, min(w.output_max, max_model_len - window)),
            "output_median": max(1, min(w.output_median, (max_model_len - window) // 4)),
        }
    )


def check_window(w: AgenticWorkload, max_model_len: int) -> None:
    """Raise ValueError when `w` can draw a request longer than the model's window."""
    if w.max_context_tokens + w.output_max > max_model_len:
        raise ValueError(
            f"workload: max_context_tokens + output_max ({w.max_context_tokens} + {w.output_max}) exceed the model's "
            f"window (model.max_model_len {max_model_len}): lower them"
        )


def fixed_hit(w: AgenticWorkload, hit: float) -> AgenticWorkload:
    """The same sessions with every follow-up turn at one hit rate (the bathtub sweep)."""
    return w.model_copy(update={"hit_bands": [HitBand(weight=1.0, low=hit, high=hit)]})


class TraceRecord(BaseModel):
    """One line of a trace file (fields as in the module's docstring; other keys are ignored)."""

    model_config = ConfigDict(allow_inf_nan=False)
    arrival_s: Annotated[float, Field(ge=0)]
    session: int | str
    prompt_tokens: Annotated[int, Field(ge=1)]
    prefix_tokens: Annotated[int, Field(ge=0)]
    output_tokens: Annotated[int, Field(ge=1)]

    @model_validator(mode="after")
    def _prefix_within_prompt(self) -> TraceRecord:
        if self.prefix_tokens > self.prompt_tokens:
            raise ValueError(f"prefix_tokens: {self.prefix_tokens} is more than prompt_tokens ({self.prompt_tokens})")
        return self


def read_trace(path: str | Path) -> Iterator[Request]:
    """The trace's requests; a bad line raises ValueError naming the line and the field."""
    last = -math.inf
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = TraceRecord.model_validate_json(line)
            except ValidationError as err:
                raise ValueError(f"{path}:{n}: " + "; ".join(validation_problems(err))) from None
            if d.arrival_s < last:
                raise ValueError(f"{path}:{n}: arrival_s {d.arrival_s:g} is before the previous line's ({last:g}): arrivals must not go back in time")
            last = d.arrival_s
            yield Request(d.arrival_s, d.session, d.prompt_tokens, d.prefix_tokens, d.output_tokens)


def write_trace(path: str | Path, requests: Iterable[Request]) -> int:
    n = 0
    with Path(path).open("w") as f:
        for r in requests:
            f.write(json.dumps(r._asdict()) + "\n")
            n += 1
    return n


def hit_rate(r: Request) -> float:
    return r.prefix_tokens / r.prompt_tokens

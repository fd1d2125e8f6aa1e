"""Each engine step's shape and duration, measured inside a serving engine.

The digital twin's step-time model (app/sim/perf.py) is fitted to engine steps.
Steps measured on an idle engine run faster than the same steps while the app
serves: on a small host, the other engines, the conductor and the clients take
CPU from the model. `StepClock` measures the steps of an engine at work, so the
twin can be calibrated from a real run (app/sim/calibrate.py `take_app_steps`).

It runs in the KV connector's scheduler side (`EngineConfig.record_steps`):
`build_connector_meta` sees every step's `SchedulerOutput` at the end of its
schedule, and `get_kv_connector_stats` runs at the end of the step's output
processing. When the next step continues one of its requests, the engine had
work all along, and a step lasts until the next schedule: forward pass, output
processing, handing outputs over and scheduling again, the whole cycle a
decoding request waits per token. Otherwise (a prefill that ended its request,
then nothing or other work) the step lasts until its outputs are processed: the
time until the next schedule may hold an idle wait. An engine whose requests
all wait for remote KV schedules empty steps: no step is timed across those.

Each step also keeps when it started (`start_s`, `time.monotonic`: on Linux
CLOCK_MONOTONIC, one clock for every process of a host), so the steps of
engines sharing a host can be laid side by side (app/sim/fitting.py
`fit_to_app_steps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def step_shape(scheduler_output: SchedulerOutput) -> dict[str, Any]:
    """The twin's figures of one step (app/sim/perf.py `StepSample`, without `step_ms`).

    A request is decoding when it has output tokens and runs one token; any
    other scheduled request runs a prefill chunk (a resumed preempted request
    recomputes, as a prefill does).
    """
    tokens = scheduler_output.num_scheduled_tokens
    prefill = decode = read = prefix_chunks = 0
    pairs = 0.0

    def add(n: int, computed: int, decoding: bool) -> None:
        nonlocal prefill, decode, read, pairs, prefix_chunks
        read += computed + n
        if decoding and n == 1:
            decode += 1
            pairs += computed + 1
        else:
            prefill += n
            pairs += n * computed + n * (n + 1) / 2  # perf.chunk_attention_pairs
            prefix_chunks += computed > 0

    for new in scheduler_output.scheduled_new_reqs:
        add(tokens[new.req_id], new.num_computed_tokens, False)
    cached = scheduler_output.scheduled_cached_reqs
    for rid, computed, outputs in zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens):
        add(tokens[rid], computed, outputs > 0)
    return {"prefill_tokens": prefill, "decode_seqs": decode, "kv_tokens_read": read, "attention_pairs": pairs, "prefix_chunks": prefix_chunks}


class StepClock:
    """Turns the stream of engine steps into timed step samples (dicts of `StepSample`'s fields)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: _Step | None = None
        self._samples: list[dict[str, Any]] = []

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """A step was just scheduled; times the step before it when that one is still open."""
        now = self._clock()
        ids = frozenset(scheduler_output.num_scheduled_tokens)
        last, self._last = self._last, None
        if last is not None:
            if ids and not ids.isdisjoint(last.request_ids):
                self._keep(last, now)
            elif last.end is not None:
                self._keep(last, last.end)
        if ids:
            self._last = _Step(now, step_shape(scheduler_output), ids, set(ids))

    def finished(self, request_id: str) -> None:
        """A request ended (finished or aborted): no later step continues it."""
        if self._last is not None:
            self._last.open.discard(request_id)

    def processed(self) -> None:
        """The step last scheduled has had its outputs processed; a step whose
        requests all ended is timed now (nothing will continue it)."""
        last = self._last
        if last is None or last.end is not None:
            return
        last.end = self._clock()
        if not last.open:
            self._keep(last, last.end)
            self._last = None

    def take(self) -> list[dict[str, Any]]:
        """The steps timed since the last take."""
        samples, self._samples = self._samples, []
        return samples

    def _keep(self, step: _Step, end: float) -> None:
        self._samples.append({**step.shape, "step_ms": (end - step.start) * 1000, "start_s": step.start})


@dataclass
class _Step:
    start: float
    shape: dict[str, Any]
    request_ids: frozenset[str]
    open: set[str]
    """Its requests that have not ended."""
    end: float | None = None

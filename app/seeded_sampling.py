"""Seeded sampling that carries on across engines, and survives a discarded step on CPU.

vLLM gives a seeded request a generator of its own, seeded when the request
arrives, and draws from it once for every token it samples. A request that moves
to another engine (P to the relay, the relay to MD, a failover) arrives there
with its earlier output in the prompt, and a fresh generator would draw those
tokens' numbers again: the answer would depend on the pipeline that served it.
An engine request says how many output tokens were sampled before it
(`SamplingOptions.sampled_before`); the worker skips that many draws of the new
generator before the request's first step, by running its own sampler on
placeholder logits, so whichever draw the platform's sampler makes (one integer
per token on CPU, a row of noise on GPU) is the one skipped.

When vLLM discards a step's sample (a partial prefill, as a relay decoder's
first step after its KV pull can be), it takes the draw back by moving the
generator's offset back; CPU generators have no offset, and the engine died of
it. A CPU generator here remembers its state at each step's start and takes a
draw back by returning to it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: The `SamplingParams.extra_args` key the engine sets from `sampled_before`.
SAMPLED_BEFORE = "pdd_sampled_before"


def extra_args(seed: int | None, sampled_before: int) -> dict[str, Any]:
    """What an engine request adds to vLLM's `extra_args` (nothing unless a seeded one continues)."""
    return {SAMPLED_BEFORE: sampled_before} if seed is not None and sampled_before > 0 else {}


class RewindableGenerator(torch.Generator):
    """A CPU generator that can take back the current step's draw, as vLLM does with
    `set_offset(get_offset() - 4)` on CUDA's counter-based generators."""

    def __new__(cls, like: torch.Generator):
        return super().__new__(cls, device="cpu")

    def __init__(self, like: torch.Generator):
        super().__init__()
        self.set_state(like.get_state())
        self._step_start = like.get_state()

    def step_starts(self) -> None:
        self._step_start = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> RewindableGenerator:
        # only ever asked to go back by this step's draw: the step's starting state
        self.set_state(self._step_start)
        return self


def skip_draws(runner: Any, generator: torch.Generator, count: int) -> None:
    """Advance `generator` as `count` sampling steps of `runner` would."""
    logits = torch.zeros(1, runner.model_config.get_vocab_size(), dtype=torch.float32, device=runner.device)
    for _ in range(count):
        runner.sampler.topk_topp_sampler(logits.clone(), {0: generator}, None, None)


def _adopt(runner: Any, req_id: str) -> None:
    """Give a newly added seeded request its rewindable generator (CPU) and skip its earlier draws."""
    state = runner.requests.get(req_id)
    if state is None or state.generator is None:
        return
    if state.generator.device.type == "cpu" and not isinstance(state.generator, RewindableGenerator):
        state.generator = RewindableGenerator(state.generator)
        runner.input_batch.generators[runner.input_batch.req_id_to_index[req_id]] = state.generator
    count = ((state.sampling_params.extra_args or {}).get(SAMPLED_BEFORE, 0)) if state.sampling_params else 0
    if count:
        skip_draws(runner, state.generator, count)


def install() -> None:
    """Patch vLLM's model runner, once per process (engine workers import app.kv.control)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states
    if getattr(original, "_pdd_seeded", False):
        return

    @functools.wraps(original)
    def update_states(self, scheduler_output):
        result = original(self, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            _adopt(self, new.req_id)
        for generator in self.input_batch.generators.values():
            if isinstance(generator, RewindableGenerator):
                generator.step_starts()
        return result

    update_states._pdd_seeded = True
    GPUModelRunner._update_states = update_states

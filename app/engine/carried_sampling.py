"""Sampling that carries on across engines: seeded draws and output-token penalties.

A request that moves to another engine (P to the relay, the relay to MD, a
failover) arrives there with its earlier output in the prompt. An engine request
says how many output tokens other engines sampled before it
(`SamplingOptions.sampled_before`), and the worker treats them as what they are:

- **Seeds.** vLLM gives a seeded request a generator of its own, seeded when the
  request arrives, and draws from it once per sampled token; a fresh generator
  would draw the earlier tokens' numbers again, and the answer would depend on
  the pipeline that served it. The worker skips that many draws of the new
  generator before the request's first step, by running its own sampler on
  placeholder logits, so whichever draw the platform's sampler makes (one integer
  per token on CPU, a row of noise on GPU) is the one skipped.
- **Presence and frequency penalties** count a request's output tokens, which
  vLLM takes from the request's own output: after a handoff the earlier ones are
  in the prompt and would not count. The worker adds them, the prompt's last
  `sampled_before` tokens, to the output tokens its sampler penalises.
- **Structured outputs.** vLLM's grammar starts at the request's first output
  token; a continuation's would start the JSON object (or regex, or choice) again
  in the middle of one. The engine core's structured-output manager has the new
  grammar accept the prompt's last `sampled_before` tokens before the request's
  first step; a continuation whose earlier output the grammar refuses fails
  rather than produce output no single engine would.

When vLLM discards a step's sample (a partial prefill, as a relay decoder's
first step after its KV pull can be), it takes the draw back by moving the
generator's offset back; CPU generators have no offset, and the engine died of
it. A CPU generator here remembers its state at each step's start and takes a
draw back by returning to it.

Why patches, not vLLM's public hooks. Both parts need V1's model runner
(`engine.model_runner: v1`), and every engine checks at start that the runner
and sampler vLLM built are the patched classes (`check`), since vLLM picks
Model Runner V2 on CUDA by default and some features force it:
- The seed part has no public hook: a logits processor sees logits, never a
  request's generator, so skipping draws needs the runner's request set-up
  (`GPUModelRunner._update_states`).
- The penalty part could be a custom logits processor reading `extra_args`,
  but vLLM's V1 runner then keeps every request's output ids in the sampling
  metadata and, with async scheduling, waits each step for the last step's
  tokens (`logitsprocs_need_output_token_ids`), a cost on every request, not
  only continuations; and it would penalise in a second pass whose rounding
  differs from one engine's single pass. Feeding the earlier output into vLLM's
  own penalty pass (`GPUModelRunner._sample`, `Sampler.apply_penalties`) costs
  nothing when no request continues and gives one engine's arithmetic exactly.
- V2 has its own sampler and logits-processor interface
  (vllm/v1/worker/gpu/sample/); carried sampling is not written for it yet.

Not covered: speculative decoding (its rejection sampler penalises on its own).
"""

from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from app.engine.token_channel import SamplingOptions

#: The `SamplingParams.extra_args` key the engine sets from `sampled_before`.
SAMPLED_BEFORE = "pdd_sampled_before"

#: Marks this module's replacements of vLLM's methods.
_PATCHED = "_pdd_carried"


class CarriedSamplingUnavailable(RuntimeError):
    """The model runner vLLM built does not run this module's patches."""


#: Per row of the batch being sampled: the output tokens sampled before it (None: none).
_carried_rows: contextvars.ContextVar[list[list[int] | None] | None] = contextvars.ContextVar("carried_rows", default=None)


def extra_args(sampling: SamplingOptions) -> dict[str, Any]:
    """What an engine request adds to vLLM's `extra_args`: nothing unless it continues a
    request whose sampling depends on the output before it (a seed, a penalty, a constraint)."""
    depends = sampling.seed is not None or penalised(sampling) or sampling.constraint is not None
    return {SAMPLED_BEFORE: sampling.sampled_before} if depends and sampling.sampled_before > 0 else {}


def penalised(params: Any) -> bool:
    """Whether sampling `params` (ours or vLLM's) penalise output tokens."""
    return bool(params.presence_penalty or params.frequency_penalty)


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


def _adopt(runner: Any, req_id: str, carried: dict[str, list[int]]) -> None:
    """A newly added request: a seeded one gets its rewindable generator (CPU) and skips its
    earlier draws; a penalised continuation's earlier output goes into `carried`."""
    state = runner.requests.get(req_id)
    if state is None or state.sampling_params is None:
        return
    count = (state.sampling_params.extra_args or {}).get(SAMPLED_BEFORE, 0)
    if state.generator is not None:
        if state.generator.device.type == "cpu" and not isinstance(state.generator, RewindableGenerator):
            state.generator = RewindableGenerator(state.generator)
            runner.input_batch.generators[runner.input_batch.req_id_to_index[req_id]] = state.generator
        if count:
            skip_draws(runner, state.generator, count)
    if count and penalised(state.sampling_params):
        carried[req_id] = list(state.prompt_token_ids[-count:])


def with_carried(output_token_ids: list[list[int]], rows: list[list[int] | None] | None) -> list[list[int]]:
    """Each row's output tokens, after those other engines sampled before it."""
    if rows is None or len(rows) != len(output_token_ids):  # not this batch's rows: never break the step
        return output_token_ids
    return [out if before is None else before + list(out) for before, out in zip(rows, output_token_ids)]


def grammar_past_carried(create: Any) -> Any:
    """Wrap `StructuredOutputManager._create_grammar`: the grammar it returns has accepted
    the output other engines produced, which ends the request's prompt."""

    @functools.wraps(create)
    def create_grammar(self, request):
        grammar = create(self, request)
        count = (request.sampling_params.extra_args or {}).get(SAMPLED_BEFORE, 0)
        carried = list(request.prompt_token_ids[-count:]) if count else []
        if carried and not grammar.accept_tokens(request.request_id, carried):
            raise ValueError(f"request {request.request_id}: the {count} output tokens other engines produced do not satisfy its structured-output constraint")
        return grammar

    setattr(create_grammar, _PATCHED, True)
    return create_grammar


def install() -> None:
    """Patch vLLM's model runner, sampler and structured-output manager, once per process
    (workers import app.engine.kv.control; the engine core, where grammars are made,
    app.engine.kv.connector)."""
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(StructuredOutputManager._create_grammar, _PATCHED, False):
        StructuredOutputManager._create_grammar = grammar_past_carried(StructuredOutputManager._create_grammar)

    original_update, original_sample, original_penalties = GPUModelRunner._update_states, GPUModelRunner._sample, Sampler.apply_penalties
    if getattr(original_update, _PATCHED, False):
        return

    @functools.wraps(original_update)
    def update_states(self, scheduler_output):
        carried = self.__dict__.setdefault("_pdd_carried", {})
        for req_id in scheduler_output.finished_req_ids:
            carried.pop(req_id, None)
        result = original_update(self, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            _adopt(self, new.req_id, carried)
        for generator in self.input_batch.generators.values():
            if isinstance(generator, RewindableGenerator):
                generator.step_starts()
        return result

    @functools.wraps(original_sample)
    def sample(self, *args, **kwargs):
        carried = self.__dict__.get("_pdd_carried")
        if not carried:
            return original_sample(self, *args, **kwargs)
        token = _carried_rows.set([carried.get(req_id) for req_id in self.input_batch.req_ids])
        try:
            return original_sample(self, *args, **kwargs)
        finally:
            _carried_rows.reset(token)

    @functools.wraps(original_penalties)
    def apply_penalties(logits, sampling_metadata, output_token_ids):
        return original_penalties(logits, sampling_metadata, with_carried(output_token_ids, _carried_rows.get()))

    for patched in (update_states, sample, apply_penalties):
        setattr(patched, _PATCHED, True)
    GPUModelRunner._update_states = update_states
    GPUModelRunner._sample = sample
    Sampler.apply_penalties = staticmethod(apply_penalties)


def _is_patched(owner: Any, name: str) -> bool:
    # the method the instance's own class resolves, not merely a patched base somewhere
    return getattr(getattr(type(owner), name, None), _PATCHED, False)


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def runner_label(runner: Any) -> str:
    """`v1 (CPUModelRunner)`, `v2 (GPUModelRunner)`, or the class's full name for another runner."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    name = type(runner).__qualname__
    if isinstance(runner, GPUModelRunner):
        return f"v1 ({name})"
    if type(runner).__module__.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")):  # V2's packages
        return f"v2 ({name})"
    return _qualname(runner)


def check(runner: Any) -> str:
    """Confirm that `runner`, the model runner vLLM built, and its sampler run this
    module's patches; return the runner's label. Raises CarriedSamplingUnavailable
    naming the runner and what would not carry across engines otherwise."""
    from vllm.v1.structured_output import StructuredOutputManager

    sampler = getattr(runner, "sampler", None)
    missing = [
        feature
        for owner, method, feature in (
            (runner, "_update_states", "seeded sampling (its generator would draw the earlier tokens' numbers again)"),
            (runner, "_sample", "presence and frequency penalties (the earlier output would not count)"),
            (sampler, "apply_penalties", "presence and frequency penalties (the earlier output would not count)"),
        )
        if not _is_patched(owner, method)
    ]
    if not getattr(StructuredOutputManager._create_grammar, _PATCHED, False):
        missing.append("structured outputs (the grammar would start again mid-answer)")
    if missing:
        raise CarriedSamplingUnavailable(
            f"vLLM built model runner {runner_label(runner)} ({_qualname(runner)}) with sampler {_qualname(sampler)}, "
            f"which do not run app/engine/carried_sampling.py's hooks: {'; '.join(dict.fromkeys(missing))} would differ from one engine's "
            "answer once a request moves between engines. Use vLLM's V1 runner (engine.model_runner: v1) and no "
            "engine.extra option that forces Model Runner V2"
        )
    return runner_label(runner)

"""What an engine request tells the worker about the output sampled before it, and the start check that
the runner vLLM built runs it (app/engine/carried_sampling.py)."""

from types import SimpleNamespace

import pytest

from app.engine.carried_sampling import SAMPLED_BEFORE, CarriedSamplingUnavailable, _adopt, check, extra_args, grammar_past_carried, install, with_carried
from app.engine.token_channel import Constraint, SamplingOptions


def test_a_continuation_counts_every_engine_before_it():
    first = SamplingOptions(max_tokens=100, temperature=1.0, seed=7)
    relay = first.continued(1)  # after P's first token
    main = relay.continued(24)  # after the relay's 24
    assert (relay.max_tokens, relay.sampled_before) == (99, 1)
    assert (main.max_tokens, main.sampled_before) == (75, 25)
    step = relay.continued(10, max_tokens=1)  # a one-token catch-up step
    assert (step.max_tokens, step.sampled_before) == (1, 11)
    assert first.sampled_before == 0 and main.seed == 7


def test_only_a_continuation_whose_sampling_depends_on_earlier_output_tells_the_engine():
    def args(**kw):
        return extra_args(SamplingOptions(max_tokens=10, **kw))

    assert args(seed=7, sampled_before=25) == {SAMPLED_BEFORE: 25}
    assert args(frequency_penalty=0.5, sampled_before=25) == {SAMPLED_BEFORE: 25}
    assert args(presence_penalty=-1.0, sampled_before=3) == {SAMPLED_BEFORE: 3}
    assert args(sampled_before=25) == {}  # unseeded, unpenalised: nothing to line up
    assert args(seed=7, frequency_penalty=1.0) == {}  # the request's first engine


def test_a_constrained_continuation_tells_the_engine_and_its_grammar_starts_past_the_earlier_output():
    assert extra_args(SamplingOptions(max_tokens=9, constraint=Constraint(regex="[a-z]+")).continued(3)) == {SAMPLED_BEFORE: 3}

    class Grammar:
        def __init__(self):
            self.accepted = []

        def accept_tokens(self, request_id, tokens):
            self.accepted += tokens
            return 99 not in tokens

    create = grammar_past_carried(lambda manager, request: Grammar())

    def request(prompt, extra):
        return SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=SimpleNamespace(extra_args=extra))

    assert create(None, request([1, 2, 3, 4], {SAMPLED_BEFORE: 2})).accepted == [3, 4]
    assert create(None, request([1, 2, 3, 4], None)).accepted == []  # the request's own answer starts at its first token
    with pytest.raises(ValueError, match="do not satisfy"):  # no engine writes on from output its grammar refuses
        create(None, request([1, 99], {SAMPLED_BEFORE: 1}))


def test_a_penalised_continuation_counts_the_prompts_tail_as_output():
    """The prompt ends with the output other engines sampled; a seed alone carries nothing to penalise."""

    def state(prompt, count, **penalties):
        params = SimpleNamespace(presence_penalty=0.0, frequency_penalty=0.0, extra_args={SAMPLED_BEFORE: count} if count else None)
        params.__dict__.update(penalties)
        return SimpleNamespace(sampling_params=params, generator=None, prompt_token_ids=prompt)

    runner = SimpleNamespace(
        requests={"a": state([1, 2, 3, 40, 41], 2, frequency_penalty=1.0), "b": state([1, 2, 3, 40, 41], 2), "c": state([1, 2, 3], 0, presence_penalty=1.0)}
    )
    carried = {}
    for req_id in runner.requests:
        _adopt(runner, req_id, carried)
    assert carried == {"a": [40, 41]}
    rows = [None, carried["a"]]
    assert with_carried([[7], [42, 43]], rows) == [[7], [40, 41, 42, 43]]
    assert with_carried([[7]], None) == [[7]]


def _draw(generator) -> int:
    import torch

    return int(torch.randint(0, 2**31, (1,), generator=generator).item())


def test_a_cpu_generator_takes_back_its_steps_draw_as_vllm_asks():
    import torch

    from app.engine.carried_sampling import RewindableGenerator

    plain = torch.Generator()
    plain.manual_seed(5)
    expected = [_draw(plain) for _ in range(2)]
    seeded = torch.Generator()
    seeded.manual_seed(5)
    rewindable = RewindableGenerator(seeded)
    discarded = _draw(rewindable)  # a partial prefill's sample, discarded
    rewindable.set_offset(rewindable.get_offset() - 4)  # vLLM's take-back (a plain CPU generator raises)
    kept = _draw(rewindable)
    rewindable.step_starts()
    assert [discarded, kept, _draw(rewindable)] == [expected[0], expected[0], expected[1]]


def _built(runner_cls, sampler_cls):
    """A runner as vLLM would have built it, without building a model: only its class and its sampler's matter."""
    runner = object.__new__(runner_cls)
    runner.sampler = object.__new__(sampler_cls)
    return runner


def test_an_engine_on_v1s_runner_passes_the_start_check():
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install()
    assert check(_built(CPUModelRunner, Sampler)) == "v1 (CPUModelRunner)"
    assert check(_built(GPUModelRunner, Sampler)) == "v1 (GPUModelRunner)"


def test_the_start_check_refuses_model_runner_v2_naming_it_and_what_would_not_carry():
    """What vLLM builds on CUDA unless told otherwise (or forced by HiSparse, watermarking):
    patching V1's classes did nothing to these."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu.sample.sampler import Sampler as SamplerV2

    install()
    with pytest.raises(CarriedSamplingUnavailable) as info:
        check(_built(GPUModelRunnerV2, SamplerV2))
    message = str(info.value)
    assert "v2 (GPUModelRunner)" in message and "vllm.v1.worker.gpu.sample.sampler.Sampler" in message
    assert "seeded sampling" in message and "penalties" in message and "engine.model_runner: v1" in message


def test_the_start_check_looks_at_the_class_vllm_built_not_at_the_patched_base():
    """A V1 runner subclass that overrides a patched method no longer runs the patch."""
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install()

    class PlatformRunner(GPUModelRunner):
        def _update_states(self, scheduler_output):
            return None

    class PlatformSampler(Sampler):
        @staticmethod
        def apply_penalties(logits, sampling_metadata, output_token_ids):
            return logits

    with pytest.raises(CarriedSamplingUnavailable, match="seeded sampling") as info:
        check(_built(PlatformRunner, Sampler))
    assert "penalties" not in str(info.value)
    with pytest.raises(CarriedSamplingUnavailable, match="penalties"):
        check(_built(GPUModelRunner, PlatformSampler))

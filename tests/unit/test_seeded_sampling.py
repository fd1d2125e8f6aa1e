"""What an engine request tells a seeded generator about the output sampled before it."""

from app.seeded_sampling import SAMPLED_BEFORE, extra_args
from app.token_channel import SamplingOptions


def test_a_continuation_counts_every_engine_before_it():
    first = SamplingOptions(max_tokens=100, temperature=1.0, seed=7)
    relay = first.continued(1)  # after P's first token
    main = relay.continued(24)  # after the relay's 24
    assert (relay.max_tokens, relay.sampled_before) == (99, 1)
    assert (main.max_tokens, main.sampled_before) == (75, 25)
    step = relay.continued(10, max_tokens=1)  # a one-token catch-up step
    assert (step.max_tokens, step.sampled_before) == (1, 11)
    assert first.sampled_before == 0 and main.seed == 7


def test_only_a_seeded_continuation_asks_the_engine_to_skip():
    assert extra_args(7, 25) == {SAMPLED_BEFORE: 25}
    assert extra_args(None, 25) == {}  # unseeded: the engine's shared generator, nothing to line up
    assert extra_args(7, 0) == {}


def _draw(generator) -> int:
    import torch

    return int(torch.randint(0, 2**31, (1,), generator=generator).item())


def test_a_cpu_generator_takes_back_its_steps_draw_as_vllm_asks():
    import torch

    from app.seeded_sampling import RewindableGenerator

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

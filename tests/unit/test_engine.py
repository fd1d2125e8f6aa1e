"""app/engine/replica.py's conversion of vLLM's per-position logprobs."""

from vllm.logprobs import Logprob

from app.engine.replica import prompt_token_logprobs, token_logprobs
from app.engine.token_channel import TokenLogprob


def test_each_token_gets_its_own_logprob_and_the_top_alternatives_best_first():
    positions = [
        {5: Logprob(-0.2, rank=1), 6: Logprob(-1.9, rank=2), 9: Logprob(-3.0, rank=3)},
        {4: Logprob(-4.0, rank=7), 6: Logprob(-0.1, rank=1), 5: Logprob(-2.4, rank=2)},  # sampled outside the top 2
    ]
    assert token_logprobs([5, 4], positions, top=2) == [
        TokenLogprob(-0.2, [(5, -0.2), (6, -1.9)]),
        TokenLogprob(-4.0, [(6, -0.1), (5, -2.4)]),
    ]
    assert token_logprobs([5], positions[:1], top=0) == [TokenLogprob(-0.2, [])]


def test_a_prompts_logprobs_score_each_token_after_the_first_on_what_came_before():
    positions = [None, {8: Logprob(-2.0, rank=3), 9: Logprob(-0.5, rank=1)}, {10: Logprob(-0.3, rank=1)}]
    assert prompt_token_logprobs([7, 8, 10], positions, top=1) == [TokenLogprob(-2.0, [(9, -0.5)]), TokenLogprob(-0.3, [(10, -0.3)])]
    assert prompt_token_logprobs([7, 8, 10], positions, top=None) is None
    assert prompt_token_logprobs([7, 8, 10], [], top=1) is None  # a delta after the prefill's

"""vLLM's sampling extensions at the API (app/api/sampling.py): what each asks of the engines,
carried to a continuation, and the 400s that name the field."""

import pytest

from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.api.sampling import sampling_options, truncated

VOCAB = 512


def body(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def test_vllms_benchmark_client_fields_are_served_with_their_vllm_meaning():
    """vllm.benchmarks.serve sends repetition_penalty 1.0 on every request; the rest as vLLM's server reads them."""
    s = sampling_options(
        body(repetition_penalty=1.0, top_k=40, min_p=0.05, min_tokens=3, stop_token_ids=[7, 9], temperature=0.8),
        max_tokens=16,
        vocab=VOCAB,
        prompt_logprobs=None,
    )
    assert (s.repetition_penalty, s.top_k, s.min_p, s.min_tokens, s.stop_token_ids) == (1.0, 40, 0.05, 3, [7, 9])
    default = sampling_options(body(), max_tokens=16, vocab=VOCAB, prompt_logprobs=None)
    assert (default.repetition_penalty, default.top_k, default.min_p, default.min_tokens, default.stop_token_ids) == (1.0, 0, 0.0, 0, [])
    assert sampling_options(body(top_k=-1), max_tokens=16, vocab=VOCAB, prompt_logprobs=None).top_k == 0  # -1 and 0 both mean every token


def test_a_continuation_gets_what_is_left_of_min_tokens():
    s = sampling_options(body(min_tokens=10), max_tokens=50, vocab=VOCAB, prompt_logprobs=None)
    assert s.continued(4).min_tokens == 6 and s.continued(4).continued(8).min_tokens == 0
    assert s.continued(4).repetition_penalty == s.repetition_penalty  # stateless across engines: the prompt holds the earlier output


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_tokens": 17}, "min_tokens"),
        ({"stop_token_ids": [3, VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {str(VOCAB + 1): 5}}, "logit_bias"),
    ],
)
def test_a_bad_extension_is_a_400_naming_its_field(fields, param):
    with pytest.raises(APIError) as info:
        sampling_options(body(**fields), max_tokens=16, vocab=VOCAB, prompt_logprobs=None)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"priority": 1}, "priority"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name_and_the_neutral_value_accepted(fields, field):
    with pytest.raises(ValueError, match=field):
        body(**fields)
    ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 0, "skip_special_tokens": True})


def test_truncation_keeps_the_prompts_last_tokens_as_vllm_does():
    prompt = list(range(10))
    assert truncated(prompt, None, 8) == prompt
    assert truncated(prompt, 3, 8) == [7, 8, 9]
    assert truncated(prompt, -1, 8) == prompt[-8:]
    with pytest.raises(APIError, match="truncate_prompt_tokens"):
        truncated(prompt, 0, 8)

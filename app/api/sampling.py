"""An API request's sampling as every engine it crosses runs it (SamplingOptions), checked
against the tokenizer: token ids inside the vocabulary, min_tokens within max_tokens."""

from __future__ import annotations

from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.engine.token_channel import Constraint, SamplingOptions

Body = ChatCompletionRequest | CompletionRequest


def _in_vocabulary(field: str, token_ids: list[int], vocab: int) -> None:
    bad = next((t for t in token_ids if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=field)


def logit_bias(body: Body, vocab: int) -> dict[int, float] | None:
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    _in_vocabulary("logit_bias", list(bias), vocab)
    return bias or None


def sampling_options(body: Body, max_tokens: int, vocab: int, prompt_logprobs: int | None, constraint: Constraint | None = None) -> SamplingOptions:
    """One prompt's engine sampling; `max_tokens` is what that prompt may generate, `constraint`
    the structured output it satisfies (app/api/structured.py)."""
    if body.min_tokens and body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
    stop_ids = list(body.stop_token_ids or [])
    _in_vocabulary("stop_token_ids", stop_ids, vocab)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.ignore_eos),
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens or 0,
        logit_bias=logit_bias(body, vocab),
        logprobs=body.requested_logprobs(),
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
    )


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the context length), as vLLM keeps them."""
    if keep is None:
        return prompt
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens: 0 keeps no token; give at least 1, or -1 for the context length", param="truncate_prompt_tokens")
    return prompt[-(max_model_len if keep == -1 else keep) :]

"""A request as pipelines run it, what they yield, and how they fail.

Shared by the conductor (app/conductor/conductor.py), the PDD relay (app/conductor/relay.py) and
the ingress, which is why it is not in any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.conductor.journal import Journey
from app.config import Mode, RoleName
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import ChannelClosed, EngineDelta, SamplingOptions, TokenLogprob
from app.telemetry import metrics


def note_failover(journey: Journey, failed: tuple[RoleName, ReplicaInfo], target: tuple[RoleName, ReplicaInfo], at_token: int, error: Exception) -> None:
    """A request moved mid-stream off a failed engine: in its journey and the metrics."""
    journey.failovers.append(
        {
            "from_role": failed[0].value,
            "from_replica": failed[1].replica_id,
            "to_role": target[0].value,
            "to_replica": target[1].replica_id,
            "at_token": at_token,
            "error": str(error),
        }
    )
    metrics.registry().inc(metrics.FAILOVERS, from_role=failed[0].value, to_role=target[0].value)


class EngineError(RuntimeError):
    """An engine reported a failure for this request."""


class RequestTimeout(RuntimeError):
    """The request ran past server.request_timeout_s."""


class PrefillUnavailable(RuntimeError):
    """No prefill replica could compute the prompt."""


ENGINE_FAILURES = (ChannelClosed, EngineError)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stop: list[str]
    mode: Mode
    key_fingerprint: str = ""
    """Of the API key that made the request (its journey records it)."""
    include_stop: bool = False
    """Keep a stop string or stop token's text in the output (`include_stop_str_in_output`)."""


@dataclass
class Output:
    """What the ingress sends on: new text, and on the last one the finish reason."""

    text: str
    completion_tokens: int
    """Tokens produced so far (usage)."""
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    """The tokens since the previous Output (text may lag them: stop strings)."""
    logprobs: list[TokenLogprob] | None = None
    """Those tokens' log probabilities, when the request asked for them."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On the first Output, when the request asked for them: the prompt's tokens' after the first."""


@dataclass
class Tokens:
    """Tokens from one engine, in client order."""

    token_ids: list[int]
    role: RoleName
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per token, when the request asked for them (from the engine that sampled it)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """From the engine that computed the prompt, with the first token, when the request asked for them."""


def check(delta: EngineDelta, role: RoleName) -> EngineDelta:
    """The delta, unless its engine reported a failure."""
    if delta.error:
        raise EngineError(f"{role.value} engine failed: {delta.error}")
    return delta

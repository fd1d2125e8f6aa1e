"""The conductor's stream handling, on scripted engine streams (no vLLM)."""

import asyncio
from contextlib import aclosing

import pytest
from transformers import AutoTokenizer

from app.conductor.conductor import Conductor
from app.conductor.generation import EngineError, GenerationRequest
from app.conductor.journal import Journey
from app.config import Mode, PDDConfig, RoleName
from app.engine.devmodel import ensure_devmodel
from app.engine.kv.params import PULL
from app.engine.replica import ReplicaInfo
from app.engine.token_channel import ChannelClosed, EngineDelta, EngineRequest, SamplingOptions, TokenLogprob
from tests.conftest import local_args

SENTENCE = "the cluster relays the first tokens then the main decoder takes over and the end is near and far away"


class ScriptedEngines:
    """Stands in for app.conductor.engine_client.EngineClient: one main decoder whose streams
    emit SENTENCE's tokens, one per loop turn (the first with `transfer`, a pull's
    report, if set; `step_s` apart after the first); it records which streams are open, and
    calls `on_open` as one opens.
    A request asking for prompt log probabilities gets them on its first delta, as vLLM
    sends them, unless `scores_prompt` is off; `failures` streams fail before any token."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.transfer: dict | None = None
        self.on_open = lambda: None
        self.open: set[str] = set()
        self.scores_prompt = True
        self.failures = 0
        self.step_s = 0.0
        self.requests: list[EngineRequest] = []
        self.replica = ReplicaInfo("md-0", "main_decode", "127.0.0.1", "node", "dc-b", 1000, 16, 0, 1024)

    async def replicas(self, role: RoleName) -> list[ReplicaInfo]:
        return [self.replica] if role is RoleName.main_decode else []

    def roles(self) -> list[RoleName]:
        return [RoleName.main_decode]

    def load(self, replica_id: str) -> float:
        return 0.0

    def suspect(self, replica_id: str) -> None:
        pass

    def live_replica_ids(self) -> set[str]:
        return {self.replica.replica_id}

    async def reset_prefix_caches(self) -> None:
        pass

    async def stream(self, replica: ReplicaInfo, request):
        self.requests.append(request)
        self.open.add(request.request_id)
        self.on_open()
        try:
            if self.failures:
                self.failures -= 1
                raise ChannelClosed("scripted failure")
            scored = request.sampling.prompt_logprobs is not None and self.scores_prompt
            for i, token in enumerate(self.token_ids):
                await asyncio.sleep(self.step_s if i else 0)
                last = i == len(self.token_ids) - 1
                transfer = self.transfer if i == 0 else None
                prompt_logprobs = [TokenLogprob(-1.0 * t) for t in request.prompt_token_ids[1:]] if scored and i == 0 else None
                yield EngineDelta(
                    request.request_id, [token], finished=last, finish_reason="length" if last else None, transfer=transfer, prompt_logprobs=prompt_logprobs
                )
        finally:
            self.open.discard(request.request_id)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_devmodel())).backend_tokenizer


@pytest.fixture
def conductor(tokenizer):
    args = local_args()
    args["mode"] = "colocated"
    engines = ScriptedEngines(tokenizer.encode(SENTENCE, add_special_tokens=False).ids)
    return Conductor(PDDConfig.model_validate(args), engines, links=None, tokenizer=tokenizer)


def _request(stop: list[str]) -> GenerationRequest:
    return GenerationRequest("req-1", [11, 12, 13], SamplingOptions(max_tokens=200), stop, Mode.colocated)


async def test_a_stop_string_ends_the_engine_stream_before_the_response_does(conductor):
    text = "".join([out.text async for out in conductor.generate(_request(["end"]))])
    assert text.endswith("and the ") and "end" not in text
    assert (conductor.journal.get("req-1").finish_reason, conductor.journal.get("req-1").outcome) == ("stop", "ok")
    # no loop turn since the last output: the engine request was aborted on the way, not later by the finalizer
    assert conductor.engines.open == set()


async def test_a_client_leaving_ends_the_engine_stream_before_close_returns(conductor):
    outputs = conductor.generate(_request([]))
    assert (await anext(outputs)).text
    assert conductor.engines.open == {"req-1"}
    await outputs.aclose()
    assert conductor.engines.open == set()
    journey = conductor.journal.get("req-1")
    assert (journey.finish_reason, journey.outcome) == (None, "cancelled")


def test_a_pull_is_judged_on_the_bytes_it_moved_at_the_share_the_model_gave_it(conductor):
    """Routing expected 1 MB; the decoder's cache held less and it moved 2 MB: a healthy
    link needs twice the modelled transfer, plus its latency, for that."""
    link = "dc-a->dc-b"
    config = conductor.config.link("dc-a", "dc-b")
    bytes_per_s = config.bandwidth_mbps * 1e6 / 8
    request = _request([])
    accounts = conductor.accounts
    accounts.share(link).start(request.request_id, 1_000_000, now=0.0, destination="md-0")
    assert accounts.model_seconds(link, request.request_id, 1_000_000, 2_000_000) == pytest.approx(config.mean_latency_s + 2 * 1_000_000 / bytes_per_s)
    assert accounts.model_seconds("dc-b->dc-a", request.request_id, 10, 10) is None  # no pull routed there


async def _pull_stream(conductor, expected_bytes: int) -> tuple[int, int]:
    """A main decoder's stream whose pull routing expected to move `expected_bytes` over the
    WAN: the link's modelled backlog before its first token, and after it."""
    link = "dc-a->dc-b"
    request = EngineRequest(
        "req-1-md",
        [11, 12, 13],
        SamplingOptions(max_tokens=200),
        kv_transfer_params={PULL: {"link": link, "expected_bytes": expected_bytes, "host": "10.0.0.1"}},
    )
    stream = conductor.ops.decode_stream(RoleName.main_decode, conductor.engines.replica, request, Journey("req-1", "pdd", 3, 200))
    before = []
    conductor.engines.on_open = lambda: before.append(conductor.accounts.backlog(link))
    await anext(stream)
    after = conductor.accounts.backlog(link)
    await stream.aclose()
    return before[0], after


async def test_what_a_pull_did_not_move_leaves_the_wan_backlog_at_its_report(conductor):
    """Routing expected 50 MB; MD's cache held more and it moved 10 MB: 40 MB never cross,
    and the next request's estimate no longer waits behind them."""
    conductor.engines.transfer = {"link": "dc-a->dc-b", "blocks": 10, "bytes": 10_000_000, "seconds": 1.0}
    before, after = await _pull_stream(conductor, 50_000_000)
    drain = conductor.config.link("dc-a", "dc-b").bytes_per_s * 0.5  # at most half a second passes
    assert before > 50_000_000 - drain
    assert 10_000_000 - drain < after <= 10_000_000


async def test_a_first_token_without_a_report_means_the_pull_moved_nothing(conductor):
    """A decoder whose cache held the whole prompt pulls nothing and reports nothing."""
    before, after = await _pull_stream(conductor, 50_000_000)
    assert before > 40_000_000 and after == 0
    assert conductor.accounts.share("dc-a->dc-b").finish("req-1-md", now=1e9) is None  # gone from the share model too


async def test_a_decoders_step_time_is_read_off_its_streams(conductor):
    """Routing's MD wait (policy.decoder_wait_ms) counts this replica's recent step time."""
    conductor.engines.step_s = 0.02
    request = EngineRequest("req-1-md", [11, 12, 13], SamplingOptions(max_tokens=200))
    journey = Journey("req-1", "pdd", 3, 200)
    assert conductor.ops.gaps.steps.step_ms("md-0") == 0.0
    async with aclosing(conductor.ops.decode_stream(RoleName.main_decode, conductor.engines.replica, request, journey)) as stream:
        count = len([delta async for delta in stream])
    assert count > 5
    assert 18 < conductor.ops.gaps.steps.step_ms("md-0") < 60
    assert conductor.ops.gaps.md_wait_ms("md-0", running=0, batch_limit=4) == pytest.approx(2 * conductor.ops.gaps.steps.step_ms("md-0"))


def _scored_request(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest("req-1", prompt, SamplingOptions(max_tokens=200, prompt_logprobs=0), [], Mode.colocated)


async def test_a_prompts_logprobs_reach_the_client_with_its_first_output(conductor):
    prompt = [11, 12, 13]
    outputs = [out async for out in conductor.generate(_scored_request(prompt))]
    assert outputs[0].text and outputs[0].prompt_logprobs == [TokenLogprob(-12.0), TokenLogprob(-13.0)]
    assert all(out.prompt_logprobs is None for out in outputs[1:])


async def test_a_request_restarted_before_its_first_token_asks_again_for_its_prompts_logprobs(conductor):
    conductor.engines.failures = 1
    outputs = [out async for out in conductor.generate(_scored_request([11, 12, 13]))]
    assert [r.sampling.prompt_logprobs for r in conductor.engines.requests] == [0, 0]
    assert outputs[0].prompt_logprobs == [TokenLogprob(-12.0), TokenLogprob(-13.0)]


async def test_prompt_logprobs_asked_and_not_sent_fail_the_request(conductor):
    conductor.engines.scores_prompt = False
    with pytest.raises(EngineError, match="no prompt log probabilities"):
        [out async for out in conductor.generate(_scored_request([11, 12, 13]))]


def test_a_continuation_never_asks_for_prompt_logprobs():
    sampling = SamplingOptions(max_tokens=10, prompt_logprobs=2)
    assert sampling.continued(1).prompt_logprobs is None

"""Engine steps timed inside the engine (app/engine/kv/steps.py), on vLLM's own scheduler output types."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from app.engine.kv.steps import StepClock, step_shape
from app.sim.perf import chunk_attention_pairs


def scheduled(new: dict[str, tuple[int, int]] | None = None, running: dict[str, tuple[int, int, int]] | None = None) -> SchedulerOutput:
    """new: id -> (cached prefix, tokens this step); running: id -> (computed, output tokens, tokens this step)."""
    new, running = new or {}, running or {}
    new_reqs = [
        NewRequestData(
            req_id=rid,
            prompt_token_ids=None,
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=([],),
            num_computed_tokens=computed,
            lora_request=None,
        )
        for rid, (computed, _) in new.items()
    ]
    cached = CachedRequestData(
        req_ids=list(running),
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None] * len(running),
        num_computed_tokens=[c for c, _, _ in running.values()],
        num_output_tokens=[o for _, o, _ in running.values()],
    )
    tokens = {rid: n for rid, (_, n) in new.items()} | {rid: n for rid, (_, _, n) in running.items()}
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def test_a_step_counts_prefill_chunks_decodes_context_and_pairs_as_the_twin_does():
    shape = step_shape(
        scheduled(
            new={"fresh": (0, 300), "after-prefix": (2048, 64)},
            running={"second-chunk": (512, 0, 256), "decoding": (1000, 5, 1), "decoding-2": (40, 1, 1)},
        )
    )
    assert shape["prefill_tokens"] == 300 + 64 + 256
    assert shape["decode_seqs"] == 2
    assert shape["kv_tokens_read"] == 300 + (2048 + 64) + (512 + 256) + 1001 + 41
    assert shape["attention_pairs"] == pytest.approx(
        chunk_attention_pairs(300, 0) + chunk_attention_pairs(64, 2048) + chunk_attention_pairs(256, 512) + 1001 + 41
    )
    assert shape["prefix_chunks"] == 2  # after the cached prefix, and the second chunk after the first: not the fresh one


def test_a_preempted_request_resuming_recomputes_as_a_prefill():
    shape = step_shape(scheduled(running={"resumed": (0, 12, 700)}))
    assert (shape["prefill_tokens"], shape["decode_seqs"], shape["prefix_chunks"]) == (700, 0, 0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_continued_by_the_next_lasts_until_the_next_schedule():
    """The whole cycle a decoding request waits per token, output handling included."""
    clock = Clock()
    steps = StepClock(clock)
    steps.scheduled(scheduled(new={"a": (0, 100)}))
    clock.now = 0.020
    steps.processed()
    assert steps.take() == []  # "a" goes on: its step ends at the next schedule
    clock.now = 0.025
    steps.scheduled(scheduled(running={"a": (100, 1, 1)}))
    clock.now = 0.030
    steps.processed()
    clock.now = 0.031
    steps.scheduled(scheduled(new={"b": (0, 10)}, running={"a": (101, 2, 1)}))
    first, second = steps.take()
    assert first == {
        "prefill_tokens": 100,
        "decode_seqs": 0,
        "kv_tokens_read": 100,
        "attention_pairs": chunk_attention_pairs(100, 0),
        "prefix_chunks": 0,
        "step_ms": pytest.approx(25.0),
        "start_s": 0.0,
    }
    assert (second["decode_seqs"], second["step_ms"], second["start_s"]) == (1, pytest.approx(6.0), 0.025)
    assert steps.take() == []


def test_a_step_whose_requests_all_ended_is_timed_when_its_outputs_are_processed():
    """A prefill that ended its request: the engine may idle after it."""
    clock = Clock()
    steps = StepClock(clock)
    steps.scheduled(scheduled(new={"a": (0, 100)}))
    steps.finished("a")
    clock.now = 0.03
    steps.processed()
    (sample,) = steps.take()
    assert (sample["prefill_tokens"], sample["step_ms"]) == (100, pytest.approx(30.0))
    clock.now = 5.0
    steps.processed()  # steps without work of their own change nothing
    steps.scheduled(scheduled(new={"b": (0, 100)}))
    assert steps.take() == []


def test_a_step_not_continued_by_the_next_lasts_until_its_outputs_were_processed():
    """Its request was aborted after the step: the next step runs other work, maybe after a wait."""
    clock = Clock()
    steps = StepClock(clock)
    steps.scheduled(scheduled(running={"a": (500, 3, 1)}))
    clock.now = 0.004
    steps.processed()
    clock.now = 2.0
    steps.scheduled(scheduled(new={"b": (0, 100)}))
    (sample,) = steps.take()
    assert (sample["decode_seqs"], sample["step_ms"]) == (1, pytest.approx(4.0))


def test_an_empty_schedule_times_no_step_across_it():
    """Every request waited (for remote KV): the engine did no step's work in that time."""
    clock = Clock()
    steps = StepClock(clock)
    steps.scheduled(scheduled(running={"a": (100, 1, 1)}))
    clock.now = 0.004
    steps.processed()
    clock.now = 0.5
    steps.scheduled(scheduled())
    steps.processed()
    clock.now = 0.51
    steps.scheduled(scheduled(running={"a": (101, 2, 1)}))
    clock.now = 0.52
    steps.scheduled(scheduled(running={"a": (102, 3, 1)}))
    assert [s["step_ms"] for s in steps.take()] == [pytest.approx(4.0), pytest.approx(10.0)]

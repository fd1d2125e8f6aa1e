"""app.sim.whatif.what_if: the twin's answer to the agents' and chat-ops' what-if questions."""

from __future__ import annotations

import math

import pytest

from agents.whatif import load_what_if, predict
from app.config import LiveKnobs
from app.sim.cluster import cost_per_hour
from app.sim.whatif import WhatIfAnswer, what_if
from tests.unit.test_sim_twin import tiny_args, tiny_config


def test_agents_find_the_twin_what_if():
    assert load_what_if() is what_if


def test_answer_carries_the_slo_percentile_figures_goodput_and_cost():
    config = tiny_config("pdd", model={**tiny_args()["model"], "max_model_len": 16384})
    answer = what_if(config, {"main_decode": 2}, config.live_knobs(), 2.0, requests=400)
    assert isinstance(answer, WhatIfAnswer) and answer.percentile == config.slo.percentile
    for name in ("ttft_ms", "tpot_ms", "gap_ms", "goodput_rps", "cost_per_hour"):
        assert math.isfinite(answer[name]) and answer[name] >= 0
    assert answer.cost_per_hour == 2.0 + 2.0 + 2 * 3.0
    assert answer.goodput_rps <= answer.load_rps * 1.2
    p = predict(what_if, config, {"prefill": 1, "relay_decode": 1, "main_decode": 2}, config.live_knobs(), 2.0)
    assert p.ttft_ms > 0 and p.tpot_ms > 0


def test_more_prefill_lowers_ttft_under_load():
    config = tiny_config("pdd", model={**tiny_args()["model"], "max_model_len": 16384}, roles__prefill__engine={"max_num_batched_tokens": 2048})
    knobs = LiveKnobs()
    one = what_if(config, {"prefill": 1}, knobs, 6.0, requests=600)
    three = what_if(config, {"prefill": 3}, knobs, 6.0, requests=600)
    assert three.ttft_ms < one.ttft_ms
    assert three.cost_per_hour == cost_per_hour(config) + 2 * 2.0


def test_knobs_are_applied():
    config = tiny_config("pdd", model={**tiny_args()["model"], "max_model_len": 16384})
    relay_all = LiveKnobs.model_validate({"routing": {"max_wan_transfer_ms": 0}})
    a = what_if(config, {}, config.live_knobs(), 2.0, requests=300)
    b = what_if(config, {}, relay_all, 2.0, requests=300)
    assert a != b


def test_bad_plans_are_value_errors():
    config = tiny_config("pdd")
    with pytest.raises(ValueError, match="unknown role"):
        what_if(config, {"decoder": 2}, config.live_knobs(), 1.0)
    with pytest.raises(ValueError, match="positive"):
        what_if(config, {}, config.live_knobs(), 0.0)

"""app/engine/replica.py's conversion of vLLM's per-position logprobs, and its control calls."""

import asyncio
from types import SimpleNamespace

from vllm.logprobs import Logprob

from app.engine.replica import EngineServer, prompt_token_logprobs, token_logprobs
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


def test_a_replica_asked_to_empty_another_replicas_prefix_cache_says_it_did_not():
    """Serve's router falls back to any replica when it does not list the target yet: the answer
    must not report the target's cache emptied."""

    class Engine:
        resets = 0

        async def reset_prefix_cache(self) -> bool:
            Engine.resets += 1
            return True

    replica = SimpleNamespace(replica_id="md-1", engine=Engine())
    assert asyncio.run(EngineServer.reset_prefix_cache(replica, target_replica="md-2")) is False  # type: ignore[arg-type]
    assert Engine.resets == 0
    assert asyncio.run(EngineServer.reset_prefix_cache(replica, target_replica="md-1")) is True  # type: ignore[arg-type]
    assert Engine.resets == 1


def test_engines_build_constraints_with_the_backend_the_ingress_checks_them_with():
    from app.config import PDDConfig, RoleName
    from app.engine.engine_args import engine_args
    from tests.conftest import local_args

    args = local_args()
    so = engine_args(PDDConfig.model_validate(args), RoleName.main_decode).structured_outputs_config
    assert (so.backend, so.disable_any_whitespace) == ("xgrammar", True)  # the dev model: no optional whitespace
    args["roles"]["main_decode"]["engine"]["extra"] = {"structured_outputs_config": {"disable_any_whitespace": False}}
    so = engine_args(PDDConfig.model_validate(args), RoleName.main_decode).structured_outputs_config
    assert (so.backend, so.disable_any_whitespace) == ("xgrammar", False)  # the operator's choice wins, field by field

"""On a CUDA GPU: every pipeline returns one engine's tokens, greedy and seeded with penalties.

vLLM's GPU path differs from the CPU one these machines run: another model
runner by default (V2, refused by each engine's start check unless
`engine.model_runner` is v1), CUDA generators that take back a discarded draw by
their offset, and other attention kernels. This module runs where a GPU is, from
bench/gpu_check.py; elsewhere it is skipped. One app puts all three roles on the
one GPU, with the float32 dev model (its wide logit gaps keep greedy choices
stable across batch shapes, which a bfloat16 model's near-ties would not).
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import local_args, on_one_gpu, set_wan
from tests.integration.conftest import completion, deploy_app
from tests.integration.relaying import assert_crossed_every_engine, fresh, relayed_while_wan_held, wait_wan_idle


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if os.environ.get("PDD_REQUIRE_GPU") and not _cuda():  # bench/gpu_check.py: a skip would pass for a check
    raise RuntimeError("PDD_REQUIRE_GPU is set, but torch sees no CUDA GPU (is the CUDA vllm installed: EXTRAS=gpu?)")
pytestmark = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU and the vllm package (EXTRAS=gpu): bench/gpu_check.py runs it")

LONG = 1500
OUT = 300
SAMPLING = {
    "greedy": {"temperature": 0},
    "seeded_with_penalties": {"temperature": 1.0, "top_p": 0.9, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": 1.0},
}


@pytest.fixture(scope="module")
def app(serve_instance):
    # a 1 Gbit/s WAN: once released, MD's pull (~6 MB) ends long before a GPU relay could finish the answer
    args = set_wan(on_one_gpu(local_args(), model="devmodel", memory_fraction=0.2), 1000, 20)
    deployed = deploy_app(serve_instance, "gpu", args)
    yield deployed
    deployed.delete()


def test_every_engine_runs_v1_where_carried_sampling_runs(app):
    runners = {r["model_runner"] for role in app.state()["roles"].values() for r in role["replicas"]}
    assert runners == {"v1 (GPUModelRunner)"}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("mode", ["pd_intra_dc", "pd_cross_dc_naive"])
def test_each_disaggregated_mode_gives_the_colocated_tokens(app, mode, sampling):
    prompt = fresh(LONG)
    text, journey = completion(app, prompt, OUT, mode=mode, **SAMPLING[sampling])
    assert journey["completion_tokens"] == OUT
    assert text == completion(app, prompt, OUT, mode="colocated", **SAMPLING[sampling])[0]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("handoff", ["one_shot", "catch_up"])
def test_relay_handoff_and_the_next_turn_on_md_give_the_colocated_tokens(app, knobs, handoff, sampling):
    """P-RLD-MD with the WAN held until RLD has sent 40 tokens (past catch-up's threshold), then
    the same prompt again, which MD now holds: P-MD."""
    knobs(handoff={"mode": handoff, "catch_up_threshold_tokens": 16, "relay_cap_tokens": 2048})
    params = SAMPLING[sampling]
    prompt = fresh(LONG)
    relayed, journey = relayed_while_wan_held(app, prompt, OUT, relayed_pieces=40, **params)
    assert_crossed_every_engine(journey)
    assert journey["handoff"]["mode"] == handoff
    colocated = completion(app, prompt, OUT, mode="colocated", **params)[0]
    assert relayed == colocated
    wait_wan_idle(app)
    again, journey = completion(app, prompt, OUT, **params)
    assert journey["pipeline"] == "P-MD", journey["decision"]
    assert again == colocated

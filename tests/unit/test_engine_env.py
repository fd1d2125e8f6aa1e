"""The environment a role's engine starts with on CPU: engines share the host."""

from __future__ import annotations

import os

import psutil
import pytest

from app.config import PDDConfig, RoleName
from app.engine.env import engine_env, loopback_interface, set_engine_env
from tests.conftest import local_args

ENGINE_ENV = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "OMP_NUM_THREADS",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_V2_MODEL_RUNNER",
    "GLOO_SOCKET_IFNAME",
)


@pytest.fixture
def config() -> PDDConfig:
    args = local_args()
    args["node_groups"]["gpu-a"]["num_cpus"] = 2.5
    return PDDConfig.model_validate(args)


@pytest.fixture
def clean_env(monkeypatch) -> pytest.MonkeyPatch:
    """None of the engine's variables set; whatever set_engine_env sets is undone after."""
    for name in ENGINE_ENV:
        monkeypatch.setenv(name, "")  # recorded, so that the test's own value is undone too
        monkeypatch.delenv(name)
    return monkeypatch


def test_engines_are_not_pinned_to_one_core(config, clean_env):
    set_engine_env(config, RoleName.prefill)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "2"  # as Ray gives a worker with 2.5 CPUs
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_model_runs_in_the_engine_core_process(config, clean_env):
    # vLLM's CPU platform keeps its single-process executor only with this off
    set_engine_env(config, RoleName.prefill)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_a_fraction_of_a_cpu_still_gets_a_thread(config, clean_env):
    set_engine_env(config, RoleName.main_decode)  # gpu-b: 0.25 CPUs
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_what_the_operator_set_wins(config, clean_env):
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    clean_env.setenv("OMP_NUM_THREADS", "4")
    clean_env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    set_engine_env(config, RoleName.main_decode)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert os.environ["OMP_NUM_THREADS"] == "4"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_the_config_chooses_the_model_runner_whatever_the_environment_says(config, clean_env):
    set_engine_env(config, RoleName.prefill)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # V1: on CUDA vLLM would otherwise pick V2
    clean_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    set_engine_env(config, RoleName.main_decode)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_a_one_process_engine_listens_on_loopback_only(config, clean_env):
    # its gloo groups would otherwise listen on whatever the host name resolves to (the LAN address)
    set_engine_env(config, RoleName.prefill)
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert "127.0.0.1" in {a.address for a in psutil.net_if_addrs()[os.environ["GLOO_SOCKET_IFNAME"]]}


def test_engines_of_several_processes_keep_torch_s_choice(config, clean_env):
    # their workers may sit on other nodes: loopback would cut them off
    config.roles.of(RoleName.prefill).engine.tensor_parallel_size = 2
    assert "GLOO_SOCKET_IFNAME" not in engine_env(config, RoleName.prefill, {})
    config.roles.of(RoleName.prefill).engine.tensor_parallel_size = 1
    config.roles.of(RoleName.prefill).engine.extra = {"pipeline_parallel_size": 2}
    assert "GLOO_SOCKET_IFNAME" not in engine_env(config, RoleName.prefill, {})
    assert engine_env(config, RoleName.main_decode, {"GLOO_SOCKET_IFNAME": "eth1"})["GLOO_SOCKET_IFNAME"] == "eth1"

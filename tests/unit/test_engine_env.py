"""The environment a role's engine starts with on CPU: engines share the host."""

from __future__ import annotations

import os

import pytest

from app.config import PDDConfig, RoleName
from app.engine import set_engine_env
from tests.conftest import local_args


@pytest.fixture
def config() -> PDDConfig:
    args = local_args()
    args["node_groups"]["gpu-a"]["num_cpus"] = 2.5
    return PDDConfig.model_validate(args)


def test_engines_are_not_pinned_to_one_core(config, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    set_engine_env(config, RoleName.prefill)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "2"  # as Ray gives a worker with 2.5 CPUs
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_a_fraction_of_a_cpu_still_gets_a_thread(config, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    set_engine_env(config, RoleName.main_decode)  # gpu-b: 0.25 CPUs
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_what_the_operator_set_wins(config, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    set_engine_env(config, RoleName.main_decode)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert os.environ["OMP_NUM_THREADS"] == "4"

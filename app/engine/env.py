"""The process environment an engine starts with: the model runner the config chose,
on CPU how engines that share a host share its cores, and where a one-process engine's
torch.distributed groups listen (loopback)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping

from app.config import PDDConfig, RoleName

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


#: VLLM_USE_V2_MODEL_RUNNER for each `engine.model_runner` (None: unset, vLLM decides).
RUNNER_ENV = {"v1": "0", "v2": "1", "auto": None}


def engine_env(config: PDDConfig, role: RoleName, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The variables a role's engine reads at start, given the environment it would
    inherit (None: unset). The operator's settings win, except the model runner's."""
    rc = config.roles.of(role)
    # The runner is the config's choice: on CUDA vLLM would pick V2, where carried sampling does not run.
    runner = RUNNER_ENV[rc.engine.model_runner]
    inherited = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if inherited is not None and inherited != runner:
        logger.warning("VLLM_USE_V2_MODEL_RUNNER=%s ignored: roles.%s.engine.model_runner is %s", inherited, role.value, rc.engine.model_runner)
    env: dict[str, str | None] = {"VLLM_USE_V2_MODEL_RUNNER": runner}
    if on_cpu():
        # Read by the engine's worker process at start; whole GiB only.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(rc.engine.kv_cache_gib)))
        # vLLM's CPU binding assumes an engine owns its host: it pins every engine's
        # worker to the same core, so the app's engines took turns on it while the
        # others idled. Here engines share hosts: the OS spreads them, each
        # with as many threads as its node group's CPUs (Ray's rule for its workers,
        # applied here for engines started outside Ray: calibration).
        env["VLLM_CPU_OMP_THREADS_BIND"] = environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env["OMP_NUM_THREADS"] = environ.get("OMP_NUM_THREADS", str(max(1, math.floor(config.node_groups[rc.node_group].num_cpus))))
        # On CPU, vLLM runs the model in a second process fed through shared
        # memory, and both processes busy-poll for a second after each message.
        # With several engines on a few cores the polling took the models' CPU.
        # Off, the model runs in the engine core process, as on GPUs.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if single_process(rc.engine.tensor_parallel_size, rc.engine.extra):
        # vLLM's engine core makes ~13 torch.distributed gloo groups, each listening on the address
        # this host's name resolves to (the LAN address on most hosts, the pod's on Kubernetes),
        # without authentication. An engine of one process only talks to itself: loopback.
        env["GLOO_SOCKET_IFNAME"] = environ.get("GLOO_SOCKET_IFNAME") or loopback_interface()
    return env


def single_process(tensor_parallel_size: int, extra: Mapping[str, object]) -> bool:
    """Whether vLLM runs the engine as one worker (no peers to reach over the network)."""
    sizes = [tensor_parallel_size, *(extra.get(k, 1) for k in ("pipeline_parallel_size", "data_parallel_size"))]
    return all(int(str(size)) == 1 for size in sizes)


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def set_engine_env(config: PDDConfig, role: RoleName) -> None:
    """Set this process's environment for a role's engine (call before creating it)."""
    for name, value in engine_env(config, role, os.environ).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

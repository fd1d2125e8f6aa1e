"""The three roles, their replicas and engine arguments."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from app.config.base import StrictModel
from app.config.modes import RoleName


class EngineConfig(StrictModel):
    """Per-role vLLM engine arguments."""

    kv_cache_gib: Annotated[float, Field(gt=0)] = 1.0
    """KV cache size. On CPU this sets VLLM_CPU_KVCACHE_SPACE for the engine."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """GPU machines only."""
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    """Decode batch limit."""
    max_num_batched_tokens: Annotated[int, Field(gt=0)] | None = None
    """Chunked-prefill token budget per step (vLLM's default when unset)."""
    enforce_eager: bool = True
    """No graph capture: engine start ~30 s instead of ~70 s on CPU."""
    tensor_parallel_size: Annotated[int, Field(gt=0)] = 1
    model_runner: Literal["v1", "v2", "auto"] = "v1"
    """vLLM's model runner, set through VLLM_USE_V2_MODEL_RUNNER before the engine starts
    (whatever the environment says). `auto` is vLLM's own choice: V2 wherever Triton
    runs, i.e. on every CUDA machine. Only `v1` is accepted while carried sampling
    (app/engine/carried_sampling.py) hooks V1's runner; each engine checks the runner it got."""
    record_steps: bool = False
    """Time each engine step and keep its shape (app/engine/kv/steps.py), to fit the twin's
    step model to steps taken while the app serves (app/sim/fitting.py)."""
    extra: dict[str, Any] = {}
    """Any other `vllm.AsyncEngineArgs` field, passed through as is."""

    @field_validator("model_runner")
    @classmethod
    def _runner_carries_sampling(cls, v: str) -> str:
        if v != "v1":
            raise ValueError(
                f"'{v}' is not supported yet: seeded sampling and presence/frequency penalties that carry "
                "across engines (app/engine/carried_sampling.py) hook vLLM's V1 model runner, and under V2 a request "
                "moved between engines (handoff, relay, failover) would sample other tokens than one engine does; use 'v1'"
            )
        return v

    @field_validator("extra")
    @classmethod
    def _extra_are_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        import dataclasses

        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
        except ImportError:  # validating a config on a machine without vLLM
            return v
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"not vLLM engine arguments: {', '.join(unknown)}")
        reserved = sorted(set(v) & {"model", "kv_transfer_config", "block_size", "dtype", "worker_extension_cls"})
        if reserved:
            raise ValueError(f"set by pdd-serve, not here: {', '.join(reserved)}")
        return v


class RoleConfig(StrictModel):
    node_group: str
    """Name of a node group in `node_groups`."""
    replicas: Annotated[int, Field(ge=0)] = 1
    """Initial replica count (later changed through Serve's scale endpoint)."""
    max_replicas: Annotated[int, Field(ge=1)] = 8
    """Upper bound for scaling (agents respect it)."""
    engine: EngineConfig = EngineConfig()


class Roles(StrictModel):
    prefill: RoleConfig | None = None
    relay_decode: RoleConfig | None = None
    main_decode: RoleConfig | None = None

    def get(self, role: RoleName) -> RoleConfig | None:
        return getattr(self, role.value)

    def of(self, role: RoleName) -> RoleConfig:
        """A role the caller knows is configured (its mode needs it)."""
        rc = self.get(role)
        if rc is None:
            raise KeyError(f"roles.{role.value} is not configured")
        return rc

    def present(self) -> dict[RoleName, RoleConfig]:
        return {r: c for r in RoleName if (c := self.get(r)) is not None}

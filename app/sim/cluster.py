"""The simulated cluster a config describes: replicas per role, links, cost.

Perf model per role: a fitted model when one is given (for every role, or by
role name, or by node-group name, in that order), else the roofline from the
role's node group's `spec` and `model.spec`. Models by role come from steps
timed in the serving app (app/sim/fitting.py `fit_to_app_steps`): engines
sharing a host slow each other down. When any model has a `neighbor_slowdown`
(it was fitted on such a host), every replica is placed on one `Host`, as the
CPU dev cluster places them. KV capacity per replica: with a
spec, the replica's memory (`memory_gib` x accelerators x
`gpu_memory_utilization`) less the weights;
without one, the role's `engine.kv_cache_gib` (the CPU engines' setting).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.config import MODE_ROLES, Mode, ModelSpec, PDDConfig, RoleConfig, RoleName, link_key
from app.sim.engine import Instance
from app.sim.events import Loop
from app.sim.network import Link
from app.sim.perf import PerfModel, Roofline
from app.sim.work import Host

GIB = 1 << 30
#: vLLM's chunked-prefill token budget for online serving when the engine sets none.
DEFAULT_MAX_BATCHED_TOKENS = 8192

PerfArg = PerfModel | Mapping[str, PerfModel] | None


class SimConfigError(ValueError):
    """The config lacks a figure the twin needs; the message names the field."""


def derive(config: PDDConfig, **update: Any) -> PDDConfig:
    """`config` with top-level fields replaced (e.g. `mode`, `roles`), checked again as a whole.

    Unchanged sections pass as the validated objects they are.
    """
    data = {name: getattr(config, name) for name in PDDConfig.model_fields}
    data.update(update)
    return PDDConfig.model_validate(data)


def role_config(config: PDDConfig, role: RoleName) -> RoleConfig:
    """The role's section of the config; a role the mode uses is always there (PDDConfig checks)."""
    rc = config.roles.get(role)
    if rc is None:
        raise SimConfigError(f"roles.{role.value}: not in the config")
    return rc


def model_spec(config: PDDConfig) -> ModelSpec:
    if config.model.spec is None:
        raise SimConfigError("model.spec: the twin needs the model's size figures (active_params_b, kv_bytes_per_token)")
    return config.model.spec


def gpus_per_replica(config: PDDConfig, role: RoleName) -> int:
    rc = role_config(config, role)
    group = config.node_groups[rc.node_group]
    return max(1, round(group.num_gpus)) if group.num_gpus > 0 else rc.engine.tensor_parallel_size


def entry_role(mode: Mode) -> RoleName:
    """The role whose engine a request of `mode` reaches first."""
    return RoleName.main_decode if mode is Mode.colocated else RoleName.prefill


def role_perf(config: PDDConfig, role: RoleName, perf: PerfArg) -> PerfModel:
    rc = role_config(config, role)
    if perf is not None and not isinstance(perf, Mapping):
        return perf
    if isinstance(perf, Mapping):
        for key in (role.value, rc.node_group):
            if key in perf:
                return perf[key]
    spec = config.node_groups[rc.node_group].spec
    if spec is None:
        raise SimConfigError(f"node_groups.{rc.node_group}.spec: needed for the roofline (or pass a fitted perf model)")
    return Roofline(spec, model_spec(config), gpus_per_replica(config, role))


def kv_capacity_tokens(config: PDDConfig, role: RoleName, fitted: bool) -> int:
    rc = role_config(config, role)
    spec = config.node_groups[rc.node_group].spec
    ms = model_spec(config)
    if spec is None or fitted:
        return int(rc.engine.kv_cache_gib * GIB / ms.kv_bytes_per_token)
    weights = (ms.total_params_b or ms.active_params_b) * 1e9 * ms.weight_bytes_per_param
    free = spec.memory_gib * GIB * gpus_per_replica(config, role) * rc.engine.gpu_memory_utilization - weights
    if free <= 0:
        raise SimConfigError(
            f"roles.{role.value}: the weights ({weights / GIB:.0f} GiB) do not fit in a replica of "
            f"{gpus_per_replica(config, role)} x {spec.memory_gib} GiB at gpu_memory_utilization "
            f"{rc.engine.gpu_memory_utilization}"
        )
    return int(free / ms.kv_bytes_per_token)


def cost_per_hour(config: PDDConfig, mode: Mode | None = None) -> float:
    """Hardware cost of the roles the mode uses: cost_per_hour x replicas."""
    total = 0.0
    for role in MODE_ROLES[mode or config.mode]:
        rc = role_config(config, role)
        total += config.node_groups[rc.node_group].cost_per_hour * rc.replicas
    return total


@dataclass
class SimCluster:
    pools: dict[RoleName, list[Instance]]
    links: dict[tuple[str, str], Link]
    datacenter: dict[RoleName, str]

    def link(self, a: str, b: str) -> Link:
        return self.links[link_key(a, b)]

    @property
    def wan_bytes(self) -> int:
        return sum(lk.bytes for lk in self.links.values() if lk.wan)


def build_cluster(config: PDDConfig, loop: Loop, mode: Mode, perf: PerfArg = None, seed: int = 0) -> SimCluster:
    pools: dict[RoleName, list[Instance]] = {}
    for role in MODE_ROLES[mode]:
        rc = config.roles.get(role)
        if rc is None or rc.replicas < 1:
            raise SimConfigError(f"roles.{role.value}: mode '{mode.value}' needs at least one replica")
        model = role_perf(config, role, perf)
        capacity = kv_capacity_tokens(config, role, fitted=not isinstance(model, Roofline))
        pools[role] = [
            Instance(
                loop,
                f"{role.value}-{i}",
                model,
                max_seqs=rc.engine.max_num_seqs,
                max_batched=rc.engine.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS,
                capacity=capacity,
                block_size=config.model.block_size,
            )
            for i in range(rc.replicas)
        ]
    if any(getattr(pool[0].perf, "neighbor_slowdown", 0.0) > 0 for pool in pools.values()):
        host = Host()
        for pool in pools.values():
            for inst in pool:
                host.join(inst)
    links = {lc.key: Link(loop, lc, seed) for lc in config.links}
    return SimCluster(pools, links, {role: config.datacenter_of(role) for role in pools})

"""build_app(args) -> the Serve application (import_path: app.builder:build_app).

`args` is a PDDConfig (see app/config/), usually written inline in a
serve_configs/*.yaml file. Placement comes from the config alone: each role's
replicas ask for their node group's Ray resources and labels.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.api.ingress import ConductorIngress
from app.config import NodeGroup, PDDConfig
from app.config.file import ConfigError, parse_config
from app.engine.deployments import ROLE_DEPLOYMENTS
from app.engine.link_emulators import LinkEmulators, deployment_name

logger = logging.getLogger(__name__)

#: Engines queue internally; Serve must not hold requests back in front of them.
ENGINE_MAX_ONGOING_REQUESTS = 1024


def _cluster_resources() -> dict[str, float]:
    import ray

    if not ray.is_initialized():
        return {}
    return dict(ray.cluster_resources())


def actor_options(config: PDDConfig, group_name: str, *, with_accelerators: bool = True) -> dict[str, Any]:
    """Ray actor options placing one replica on a node group's machines."""
    group: NodeGroup = config.node_groups[group_name]
    available = _cluster_resources()
    resources = dict(group.resources)
    missing = sorted(r for r in resources if r not in available)
    if missing and available:
        if not config.cluster.emulated:
            raise ConfigError(
                f"node_groups.{group_name}.resources: no node in the Ray cluster offers {', '.join(missing)} "
                f"(start nodes with e.g. `ray start --resources='{{\"{missing[0]}\": 8}}'`)"
            )
        logger.warning(
            "node group %s: cluster offers no %s; placing its replicas anywhere (cluster.emulated)",
            group_name,
            ", ".join(missing),
        )
        resources = {k: v for k, v in resources.items() if k not in missing}
    options: dict[str, Any] = {"num_cpus": group.num_cpus}
    if with_accelerators and group.num_gpus:
        options["num_gpus"] = group.num_gpus
    if resources:
        options["resources"] = resources
    if group.labels:
        options["label_selector"] = dict(group.labels)
    return options


def engine_placement(config: PDDConfig, group_name: str) -> dict[str, Any]:
    """Serve options placing one engine replica.

    A replica of several GPUs (tensor parallel) reserves them as a placement
    group, its actor in the first bundle and one GPU per following bundle, which
    vLLM's Ray executor then fills with its workers (possibly across nodes, as
    a 16-GPU replica on 8-GPU nodes needs).
    """
    options = actor_options(config, group_name)
    gpus = options.pop("num_gpus", 0)
    if gpus <= 1:  # one GPU, or a share of it: Ray then gives several engines the same card
        if gpus:
            options["num_gpus"] = gpus
        return {"ray_actor_options": options}
    placed = options.get("resources", {})  # every bundle in the node group's datacenter
    first = {"CPU": options["num_cpus"], **placed}
    return {
        "ray_actor_options": options,
        "placement_group_bundles": [first] + [{"GPU": 1, **placed}] * int(gpus),
        "placement_group_strategy": "PACK",
    }


def light_options(config: PDDConfig, group_name: str) -> dict[str, Any]:
    """Replicas that move bytes, not tensors: a node group's placement, no accelerator."""
    options = actor_options(config, group_name, with_accelerators=False)
    options["num_cpus"] = min(options["num_cpus"], 0.25)
    return options


def build_app(args: dict[str, Any]) -> serve.Application:
    config = parse_config(args)
    config_dict = config.model_dump(mode="json")
    # Ray annotates RequestRouterConfig's **kwargs as dicts; mypy does not apply class decorators,
    # so it misses that @serve.deployment made the classes below Deployments (hence .options)
    router = RequestRouterConfig(request_router_class="app.conductor.replica_router:AffinityRequestRouter")  # type: ignore[arg-type]
    engines = {}
    for role, rc in config.roles.present().items():
        if rc.replicas < 1:
            continue
        engines[role.value] = (
            ROLE_DEPLOYMENTS[role]
            .options(  # type: ignore[attr-defined]
                num_replicas=rc.replicas,
                request_router_config=router,
                max_ongoing_requests=ENGINE_MAX_ONGOING_REQUESTS,
                health_check_period_s=10,
                health_check_timeout_s=60,
                **engine_placement(config, rc.node_group),
            )
            .bind(config_dict)
        )
    home = config.roles.prefill or config.roles.main_decode
    assert home is not None  # every mode needs one of them (validated)
    links = {}
    for dc in sorted({b for lc in config.links for b in lc.between}):
        group = next((rc.node_group for rc in config.roles.present().values() if config.node_groups[rc.node_group].datacenter == dc), None)
        if group is None:  # no role there: nothing receives KV in this datacenter
            continue
        links[dc] = LinkEmulators.options(  # type: ignore[attr-defined]
            name=deployment_name(dc), ray_actor_options=light_options(config, group), user_config={"links": [lc.model_dump(mode="json") for lc in config.links]}
        ).bind(dc, config.security.model_dump(mode="json"))
    return ConductorIngress.options(  # type: ignore[attr-defined]
        ray_actor_options=light_options(config, home.node_group),
        user_config=config.live_knobs().model_dump(mode="json"),
    ).bind(config_dict, engines, links)

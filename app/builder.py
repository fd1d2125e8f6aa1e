"""build_app(args) -> the Serve application (import_path: app.builder:build_app).

`args` is a PDDConfig (see app/config.py), usually written inline in a
serve_configs/*.yaml file. Placement comes from the config alone: each role's
replicas ask for their node group's Ray resources and labels.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.config import ConfigError, NodeGroup, PDDConfig, parse_config
from app.ingress import ConductorIngress
from app.links import LinkEmulators
from app.roles import ROLE_DEPLOYMENTS

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


def build_app(args: dict[str, Any]) -> serve.Application:
    config = parse_config(args)
    config_dict = config.model_dump(mode="json")
    router = RequestRouterConfig(request_router_class="app.replica_router:AffinityRequestRouter")
    engines = {}
    for role, rc in config.roles.present().items():
        if rc.replicas < 1:
            continue
        engines[role.value] = (
            ROLE_DEPLOYMENTS[role]
            .options(
                num_replicas=rc.replicas,
                ray_actor_options=actor_options(config, rc.node_group),
                request_router_config=router,
                max_ongoing_requests=ENGINE_MAX_ONGOING_REQUESTS,
                health_check_period_s=10,
                health_check_timeout_s=60,
            )
            .bind(config_dict)
        )
    home = config.roles.prefill or config.roles.main_decode
    assert home is not None  # every mode needs one of them (validated)
    light = actor_options(config, home.node_group, with_accelerators=False)
    light["num_cpus"] = min(light["num_cpus"], 0.25)
    # the relays sit on the receiving side of the WAN: KV crosses to main_decode's nodes
    receiver = config.roles.main_decode or home
    link_options = actor_options(config, receiver.node_group, with_accelerators=False)
    link_options["num_cpus"] = min(link_options["num_cpus"], 0.25)
    links = LinkEmulators.options(
        ray_actor_options=link_options,
        user_config={"links": [lc.model_dump(mode="json") for lc in config.links]},
    ).bind()
    return ConductorIngress.options(
        ray_actor_options=light,
        user_config=config.live_knobs().model_dump(mode="json"),
    ).bind(config_dict, engines, links)


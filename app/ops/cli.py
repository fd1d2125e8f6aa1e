"""The `pdd` command."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import NoReturn

import httpx
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from app import native
from app.api import extensions
from app.conductor.readiness import await_ready
from app.config.file import ConfigError, load_config
from app.ops import cluster
from app.ops.fault_cli import fault_cli
from app.sim.cli import calibrate as calibrate_command
from app.sim.cli import sim as sim_command

console = Console()
main = typer.Typer(help="pdd-serve: PDD (Prefill / Relay-Decode / Main-Decode) serving on Ray Serve + vLLM.", no_args_is_help=True)
cluster_cli = typer.Typer(help="A local Ray cluster with one node per datacenter.", no_args_is_help=True)
native_cli = typer.Typer(help="Compiled (Cython) builds of the digital twin's hot modules (app/native.py).", no_args_is_help=True)
main.add_typer(cluster_cli, name="cluster")
main.add_typer(native_cli, name="native")
main.add_typer(fault_cli, name="fault")
main.command("sim")(sim_command)
main.command("calibrate")(calibrate_command)
# `pdd agents` and `pdd ask` come from agents/ (pyproject.toml's entry points)
for name, command in extensions.commands():
    if isinstance(command, typer.Typer):
        main.add_typer(command, name=name)
    else:
        main.command(name)(command)

DEFAULT_CONFIG = Path("serve_configs/local.yaml")


def _load(config_path: Path):
    try:
        return load_config(config_path)
    except (ConfigError, OSError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None


@main.command()
def devmodel() -> None:
    """Build the tiny local dev model when missing and print its folder."""
    from app.engine.devmodel import ensure_devmodel

    console.print(str(ensure_devmodel()))


@main.command()
def validate(config_path: Path = typer.Argument(DEFAULT_CONFIG, help="Serve config YAML")) -> None:
    """Check a config; errors name the bad field."""
    from app.ops.exposure import exposure, render

    config = _load(config_path)
    roles = ", ".join(f"{r.value}x{c.replicas}" for r, c in config.roles.present().items())
    console.print(f"[green]ok[/green] mode={config.mode.value} roles: {roles}")
    console.print(render(exposure(config, _serve_doc(config_path))))


def _serve_doc(config_path: Path) -> dict:
    """The config file as a document (its `http_options`: where Serve binds); {} for a bare PDD config."""
    doc = yaml.safe_load(config_path.read_text())
    return doc if isinstance(doc, dict) and "applications" in doc else {}


@main.command()
def status(
    config_path: Path = typer.Option(DEFAULT_CONFIG, "--config", help="Serve config (SLO targets, agent settings)"),
    url: str = typer.Option("http://127.0.0.1:8000", help="The app's HTTP address (PDD_API_KEY for auth)"),
    prometheus: str = typer.Option(None, help="Prometheus URL (default: agents.prometheus_url)"),
    app_name: str = typer.Option("pdd", help="Serve application name"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object (state, Prometheus' figures, note) for scripts"),
) -> None:
    """The cluster at a glance: roles, links, knobs, SLO figures."""
    from app.ops.exposure import exposure
    from app.ops.status import show

    config = _load(config_path)
    try:
        show(url, prometheus or config.agents.prometheus_url, config, console, app_name, as_json, exposure(config, _serve_doc(config_path)))
    except (httpx.HTTPError, RuntimeError) as err:
        console.print(f"[red]cannot read {url}/pdd/state: {err}[/red] (is the app running? `make run`)")
        raise typer.Exit(1) from None


@main.command()
def rules(config_path: Path = typer.Argument(DEFAULT_CONFIG), output: Path = typer.Option(Path("pdd-rules.yaml"), "-o", help="Where to write")) -> None:
    """Write Prometheus recording + alerting rules for the config's SLOs."""
    from app.telemetry.observability import write_rules

    console.print(str(write_rules(_load(config_path), output)))


@main.command()
def dashboard(config_path: Path = typer.Argument(DEFAULT_CONFIG), output: Path = typer.Option(Path("pdd-dashboard.json"), "-o", help="Where to write")) -> None:
    """Write the importable Grafana dashboard."""
    from app.telemetry.observability import write_dashboard

    console.print(str(write_dashboard(_load(config_path), output)))


@main.command()
def kuberay(
    config_path: Path = typer.Argument(Path("serve_configs/gpu_h100_h200.yaml"), help="Serve config of the GPU deployment"),
    image: str = typer.Option("ghcr.io/pdd-serve/pdd-serve:0.1.0-cuda", help="Container image with pdd-serve and vllm installed"),
    name: str = typer.Option("pdd-serve", help="RayService name"),
    prometheus_url: str = typer.Option("http://prometheus:9090", help="Prometheus service the agents query"),
    output: Path = typer.Option(Path("serve_configs/kuberay/pdd-rayservice.yaml"), "-o", help="Where to write"),
    secrets_out: Path | None = typer.Option(
        None, "--secrets-out", help="Where to write the Secrets its pods read (API keys, cluster TLS); default ~/.config/pdd-serve/kuberay/NAME-secrets.yaml"
    ),
) -> None:
    """Write a KubeRay RayService (+ agents Deployment) for a serve config, and the Secrets it reads (mode 0600; kept when there)."""
    from app.ops.kuberay import render, write_secrets

    _load(config_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render(config_path, image, name, prometheus_url))
    secrets_out = secrets_out or Path.home() / ".config" / "pdd-serve" / "kuberay" / f"{name}-secrets.yaml"
    wrote = write_secrets(config_path, secrets_out, name)
    console.print(str(output))
    console.print(f"{secrets_out} ({'new API keys and cluster CA' if wrote else 'kept: delete it to make new keys and a new CA'})")
    console.print(f"  kubectl apply -f {secrets_out} && kubectl apply -f {output}")


@cluster_cli.command("up")
def cluster_up(config_path: Path = typer.Argument(DEFAULT_CONFIG), cpus_per_node: int = typer.Option(8, help="Logical CPUs each Ray node offers")) -> None:
    """Start one Ray node per datacenter of the config (on this host)."""
    config = _load(config_path)
    if cluster.is_running(f"{cluster.plan_nodes(config)[0].ip}:{cluster.HEAD_PORT}"):
        console.print("the cluster is already running (`pdd cluster down` stops it)")
        raise typer.Exit(1)
    started = cluster.up(config, cpus_per_node, echo=console.print)
    console.print(f"cluster at {started.address}, dashboard {started.dashboard_url}")
    console.print(f"deploy with: RAY_AUTH_MODE=token serve deploy {config_path}   (raw ray/serve commands need RAY_AUTH_MODE=token)")


@cluster_cli.command("down")
def cluster_down() -> None:
    """Stop the local Ray cluster (and any vLLM process it left behind)."""
    cluster.down(echo=console.print)


@native_cli.command("build")
def native_build() -> None:
    """Compile the twin's hot modules (`make install` does); edited modules run as Python until the next build."""
    native.build()


@native_cli.command("status")
def native_status() -> None:
    """Which modules load compiled, and which run as Python."""
    builds = native.fresh_builds()
    for module in native.MODULES:
        if not native.enabled():
            state = f"python ({native.ENV_SWITCH}=0)"
        elif module in builds:
            state = "[green]compiled[/green]"
        else:
            state = "[yellow]python[/yellow] (not built, or edited since: `pdd native build`)"
        console.print(f"{module:20} {state}")


def _deploy(config_path: Path) -> dict:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    doc = yaml.safe_load(config_path.read_text())
    ServeSubmissionClient(cluster.DASHBOARD_URL).deploy_applications(doc)
    return doc


def _app_status() -> tuple[str, str]:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    details = ServeSubmissionClient(cluster.DASHBOARD_URL).get_serve_details()
    apps = details.get("applications") or {}
    if not apps:
        return "DEPLOYING", ""
    statuses = {a["status"] for a in apps.values()}
    message = "; ".join(a.get("message") or "" for a in apps.values() if a.get("message"))
    for s in ("DEPLOY_FAILED", "UNHEALTHY", "DEPLOYING"):
        if s in statuses:
            return s, message
    return "RUNNING", message


@main.command()
def run(
    config_path: Path = typer.Argument(DEFAULT_CONFIG, help="Serve config YAML"),
    timeout_s: float = typer.Option(600, help="Give up when the app is not running after this long"),
    ready_timeout_s: float = typer.Option(300, help="After deploying, how long to wait for every role's engine before saying which are not live"),
) -> None:
    """Start a local cluster, deploy CONFIG, and serve until Ctrl-C (or SIGTERM)."""
    import os

    stop_on_sigterm()
    config = _load(config_path)
    os.environ.update(cluster.serve_env())
    if config.model.source == "devmodel":
        from app.engine.devmodel import ensure_devmodel

        console.print(f"dev model: {ensure_devmodel()}")
    started = None
    address = f"{cluster.plan_nodes(config)[0].ip}:{cluster.HEAD_PORT}"
    if not cluster.is_running(address):
        started = cluster.up(config, echo=console.print)
    try:
        try:
            doc = _deploy(config_path)
        except Exception as exc:  # the dashboard refused it: Serve's own error text says why
            _deploy_failed("refused", str(exc))
        http = doc.get("http_options") or {}
        url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
        t0 = time.monotonic()
        with console.status("deploying (engines take ~30 s each to start)") as status:
            while True:
                state, message = _app_status()
                status.update(f"{state} {time.monotonic() - t0:.0f}s {message[:120]}")
                if state == "RUNNING":
                    break
                if state == "DEPLOY_FAILED" or time.monotonic() - t0 > timeout_s:
                    _deploy_failed(state, message)
                time.sleep(2)
        console.print(f"deployed {config.model.served_name} ({config.mode.value}) at {url}/v1; waiting for its engines (Ctrl-C to stop)")
        with console.status("waiting for a live engine of every role and a first completion"):
            await_ready(url, config.model.served_name, _api_headers(config), ready_timeout_s, console.print)
        console.print(
            f"  try: curl {url}/v1/chat/completions -H 'content-type: application/json' "
            f'-d \'{{"model": "{config.model.served_name}", "messages": [{{"role": "user", "content": "hi"}}]}}\''
        )
        console.print(f"  `pdd status` shows the cluster at a glance; {url}/ready which roles have a live engine")
        _say_where_the_key_is(config, http.get("host", "127.0.0.1"))
        prometheus = _start_prometheus(config, cluster.recorded_temp_dir(address))
        agents = _start_agents(config_path, config) if prometheus is not None else None
        try:
            while True:
                time.sleep(3600)
        finally:
            if agents is not None:
                agents.terminate()
            if prometheus is not None:
                prometheus.stop()
    except KeyboardInterrupt:
        console.print("stopping")
    finally:
        if started is not None:
            cluster.down(started, echo=console.print)


def _api_headers(config) -> dict[str, str]:
    """A key the API accepts, for `pdd run`'s own test completion: PDD_API_KEY (`pdd status`'s), else one
    the app serves with, else the one it generated when it binds beyond loopback (app/api/auth.py)."""
    import os

    from app.api.auth import local_key

    served = [*config.server.api_keys, *config.server.operator_api_keys, *os.environ.get("PDD_API_KEYS", "").split(",")]
    key = os.environ.get("PDD_API_KEY") or next((k.strip() for k in served if k.strip()), None) or local_key()
    return {"authorization": f"Bearer {key}"} if key else {}


def _say_where_the_key_is(config, host: str) -> None:
    """When the app generated its API key (it binds beyond loopback and none is configured): where it is."""
    from app.api.auth import ApiKeys, is_loopback, key_file

    if ApiKeys.configured(config.server).open and not is_loopback(host) and not config.server.allow_anonymous:
        console.print(f"  the API needs a key (none configured; it generated one): export PDD_API_KEY=$(cat {key_file()})")


def failure_summary(message: str) -> str:
    """Serve's failure message without its tracebacks' frames: what failed, and
    the exception each traceback ends in (the cause, e.g. a port in use, is
    otherwise buried under dozens of frames). Frames and code lines are the
    indented ones."""
    kept = []
    for line in Text.from_ansi(message).plain.splitlines():
        line = line.split("Traceback (most recent call last):")[0].rstrip()
        if line and not line[0].isspace() and any(c.isalnum() for c in line):
            kept.append(line)
    return "\n".join(kept)


def _deploy_failed(state: str, message: str) -> NoReturn:
    console.print(f"[red]deploy failed ({state}):[/red] {escape(failure_summary(message))}")
    if message:
        from app.engine.devmodel import default_cache_dir

        full = default_cache_dir() / "last-deploy-error.txt"
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(message + "\n")
        console.print(f"  with its tracebacks: {full}")
    raise typer.Exit(1)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM (`kill`, `docker stop`, systemd) stops like Ctrl-C: Python's default
    would end the process at once and leave the cluster, Prometheus and the agents running."""
    signal.signal(signal.SIGTERM, _interrupt)


def _start_prometheus(config, ray_temp_dir: str | None):
    """Debian's Prometheus against the cluster's service discovery, with the SLO rules; None when absent."""
    from urllib.parse import urlparse

    from app.telemetry import prometheus
    from app.telemetry.observability import write_rules

    if prometheus.binary() is None:
        console.print(f"[yellow]{prometheus.INSTALL_HINT}[/yellow]; metrics stay on Ray's endpoints, agents do not start")
        return None
    workdir = cluster.state_dir() / "prometheus"
    workdir.mkdir(parents=True, exist_ok=True)
    rules_path = write_rules(config, workdir / "pdd-rules.yaml")
    port = urlparse(config.agents.prometheus_url).port or 9090
    server = prometheus.PrometheusServer(port=port, file_sd=prometheus.ray_service_discovery_file(ray_temp_dir), rule_files=[rules_path], workdir=workdir)
    server.start(fresh=True)
    console.print(f"  Prometheus at {server.url} (rules: {rules_path})")
    return server


def _start_agents(config_path: Path, config):
    import subprocess
    import sys

    log = cluster.state_dir() / "agents.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.ops.cli", "agents", "run", "--config", str(config_path), "--new-cluster"], stdout=log.open("a"), stderr=subprocess.STDOUT
    )
    console.print(f"  agents: {config.agents.mode.value} mode, every {config.agents.tick_s:g} s (log: {log}; `pdd agents history`)")
    return proc


if __name__ == "__main__":
    main()

"""`pdd agents ...`: run the swarm, list and decide pending proposals, read the history.

The swarm's modules (LangGraph, Ray Serve's names) load inside the commands,
so other `pdd` commands start without them.
"""

from __future__ import annotations

import getpass
from datetime import datetime, timezone
from itertools import groupby
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from app.config import AgentMode
from app.config_file import ConfigError

console = Console()
agents_cli = typer.Typer(help="The agent swarm that keeps PDD tuned (observe, advise or act).", no_args_is_help=True)

DEFAULT_CONFIG = Path("serve_configs/local.yaml")
ConfigOption = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="Serve config YAML (its `agents` section)")


def _load(config_path: Path):
    from agents.runner import load

    try:
        return load(config_path)
    except (ConfigError, OSError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None


def _print_tick(state: dict) -> None:
    line = f"[bold]{state['tick']}[/bold] {state['mode']}"
    if state.get("error"):
        console.print(f"{line} [red]{state['error']}[/red]")
        return
    situations = [s["name"] + (f":{s['subject']}" if s.get("subject") else "") for s in state.get("situations", [])]
    console.print(f"{line} situations: {', '.join(situations) or 'none'}")
    for d in state.get("decisions", []):
        change = d["proposal"]["change"]
        colour = {"accepted": "green", "held": "yellow", "rejected": "red"}[d["status"]]
        console.print(f"  [{colour}]{d['status']}[/{colour}] {d['proposal']['specialist']}: {change['target']} {change['old']!r} -> {change['new']!r} {d.get('reason') or ''}")
    for v in state.get("verdicts", []):
        console.print(f"  verify {v['unit']['id']}: {v['outcome']}")
    if state.get("__interrupt__"):
        console.print(f"  awaiting approval: pdd agents approve {state['tick']}  (or reject)")


@agents_cli.command("run")
def run(
    config_path: Path = ConfigOption,
    mode: AgentMode | None = typer.Option(None, "--mode", help="Override agents.mode: observe (record only), advise (wait for approval), act"),
    once: bool = typer.Option(False, "--once", help="Run one tick and exit"),
    new_cluster: bool = typer.Option(False, "--new-cluster", help="Forget the stored memory (streaks, cooldowns, unverified changes, waiting proposals): it describes another cluster. `pdd run` passes it; the history stays"),
) -> None:
    """Run the swarm: one tick every agents.tick_s seconds (Ctrl-C to stop)."""
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=mode) as swarm:
        if new_cluster:
            swarm.deps.memory.forget()
        swarm.begin_run(app_name, new_cluster=new_cluster)
        console.print(f"agents: {swarm.agents.mode.value} mode, Prometheus {swarm.agents.prometheus_url}, Serve app '{app_name}' via {swarm.agents.dashboard_url}, router: {swarm.deps.router.name}")
        try:
            swarm.run(once=once, on_tick=_print_tick)
        except KeyboardInterrupt:
            console.print("stopped")


@agents_cli.command("pending")
def pending(config_path: Path = ConfigOption) -> None:
    """Proposals waiting for a person (advise mode)."""
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=AgentMode.advise) as swarm:
        waiting = swarm.pending()
    if not waiting:
        console.print("nothing awaits approval")
        return
    # plain lines, not a table: tick ids must survive copy and paste whole
    for item in waiting:
        console.print(f"[bold]{item['tick']}[/bold]  (pdd agents approve|reject {item['tick']})", soft_wrap=True)
        for p in item["proposals"]:
            c = p["change"]
            console.print(f"  {p['specialist']} / {p['situation']}: {c['target']} {c['old']!r} -> {c['new']!r}  ({p['reason']})", soft_wrap=True)


def _decide(tick: str, config_path: Path, approved: bool, by: str | None, note: str) -> None:
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=AgentMode.advise) as swarm:
        try:
            state = swarm.decide(tick, approved=approved, by=by or getpass.getuser(), note=note)
        except KeyError as err:
            console.print(f"[red]{err.args[0]}[/red]")
            raise typer.Exit(1) from None
    applied = state.get("applied", [])
    if approved:
        console.print(f"approved {tick}: applied {len(applied)} change(s)" + "".join(f"\n  {c['target']}: {c['old']!r} -> {c['new']!r}" for c in applied))
        if state.get("error"):
            console.print(f"[red]{state['error']}[/red]")
    else:
        console.print(f"rejected {tick}")


@agents_cli.command("approve")
def approve(
    tick: str = typer.Argument(..., help="Tick id from `pdd agents pending`"),
    config_path: Path = ConfigOption,
    by: str | None = typer.Option(None, help="Who approves (default: this user)"),
    note: str = typer.Option("", help="Why, for the record"),
) -> None:
    """Approve a tick's proposals: they are checked again and applied through Serve."""
    _decide(tick, config_path, True, by, note)


@agents_cli.command("reject")
def reject(
    tick: str = typer.Argument(..., help="Tick id from `pdd agents pending`"),
    config_path: Path = ConfigOption,
    by: str | None = typer.Option(None, help="Who rejects (default: this user)"),
    note: str = typer.Option("", help="Why, for the record"),
) -> None:
    """Reject a tick's proposals (the same proposal is not filed again within the cooldown)."""
    _decide(tick, config_path, False, by, note)


@agents_cli.command("history")
def history(config_path: Path = ConfigOption, limit: int = typer.Option(20, help="How many ticks, newest first")) -> None:
    """Recent ticks: situations, decisions, what was applied, verification outcomes."""
    from agents.memory import run_of
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=AgentMode.advise) as swarm:
        rows, runs = swarm.history(limit), swarm.runs()
    if not rows:
        console.print("no ticks recorded yet")
        return
    table = Table("tick", "mode", "status", "situations", "decisions / applied / verified")
    table.columns[0].no_wrap = True
    # newest first: each run's ticks under a line naming the run (none over ticks of no recorded run)
    for i, (run, ticks) in enumerate(groupby(rows, key=lambda r: run_of(r["at"], runs))):
        if i:
            table.add_section()
        if run is not None:
            started = datetime.fromtimestamp(run["at"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            table.add_row(f"[bold]run of {started}[/bold]", run["mode"], f"app '{run['app']}'", "-",
                          "new cluster: memory forgotten, history kept" if run["new_cluster"] else "memory carried over", style="dim")
        for r in ticks:
            detail = "\n".join([*r.get("decisions", []), *(f"applied {a}" for a in r.get("applied", [])), *(f"verified {v}" for v in r.get("verdicts", []))])
            table.add_row(r["tick"], r["mode"], r["status"] + (f": {r['error'][:120]}" if r.get("error") else ""), ", ".join(r.get("situations", [])) or "-", detail or "-")
    console.print(table)

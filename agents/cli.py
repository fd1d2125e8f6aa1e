"""`pdd agents ...`: run the swarm, list and decide pending proposals, read the history.

The swarm's modules (LangGraph, Ray Serve's names) load inside the commands,
so other `pdd` commands start without them.
"""

from __future__ import annotations

import getpass
import textwrap
from collections.abc import Mapping
from datetime import UTC, datetime
from itertools import groupby
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from app.config import AgentMode
from app.config.file import ConfigError

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


def _print_tick(state: Mapping[str, Any]) -> None:
    """A tick's final state as graph.invoke returns it (with "__interrupt__" while it awaits approval)."""
    line = f"[bold]{state['tick']}[/bold] {state['mode']}"
    if state.get("error"):
        console.print(f"{line} [red]{state['error']}[/red]")
        return
    situations = [s["name"] + (f":{s['subject']}" if s.get("subject") else "") for s in state.get("situations", [])]
    console.print(f"{line} situations: {', '.join(situations) or 'none'}")
    for d in state.get("decisions", []):
        change = d["proposal"]["change"]
        colour = {"accepted": "green", "held": "yellow", "rejected": "red"}[d["status"]]
        console.print(
            f"  [{colour}]{d['status']}[/{colour}] {d['proposal']['specialist']}: {change['target']} {change['old']!r} -> {change['new']!r} {d.get('reason') or ''}"
        )
    for v in state.get("verdicts", []):
        console.print(f"  verify {v['unit']['id']}: {v['outcome']}")
    if state.get("__interrupt__"):
        console.print(f"  awaiting approval: pdd agents approve {state['tick']}  (or reject)")


@agents_cli.command("run")
def run(
    config_path: Path = ConfigOption,
    mode: AgentMode | None = typer.Option(None, "--mode", help="Override agents.mode: observe (record only), advise (wait for approval), act"),
    once: bool = typer.Option(False, "--once", help="Run one tick and exit"),
    new_cluster: bool = typer.Option(
        False,
        "--new-cluster",
        help="Forget the stored memory (streaks, cooldowns, unverified changes, waiting proposals): it describes another cluster. `pdd run` passes it; the history stays",
    ),
) -> None:
    """Run the swarm: one tick every agents.tick_s seconds (Ctrl-C to stop)."""
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=mode) as swarm:
        if new_cluster:
            swarm.deps.memory.forget()
        swarm.begin_run(app_name, new_cluster=new_cluster)
        console.print(
            f"agents: {swarm.agents.mode.value} mode, Prometheus {swarm.agents.prometheus_url}, Serve app '{app_name}' via {swarm.agents.dashboard_url}, router: {swarm.deps.router.name}"
        )
        try:
            swarm.run(once=once, on_tick=_print_tick)
        except KeyboardInterrupt:
            console.print("stopped")


@agents_cli.command("pending")
def pending(
    config_path: Path = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="The waiting ticks and their proposals as JSON, for scripts"),
) -> None:
    """Proposals waiting for a person (advise mode)."""
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=AgentMode.advise) as swarm:
        waiting = swarm.pending()
    if as_json:
        console.print_json(data=waiting)
        return
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
def history(
    config_path: Path = ConfigOption,
    limit: int = typer.Option(20, help="How many ticks, newest first"),
    wide: bool = typer.Option(False, "--wide", help="One table, every field whole (needs a wide terminal)"),
    as_json: bool = typer.Option(False, "--json", help="The ticks and runs as JSON, for scripts"),
) -> None:
    """Recent ticks: situations, decisions, what was applied, verification outcomes."""
    from agents.memory import run_of
    from agents.runner import Swarm

    config, app_name = _load(config_path)
    with Swarm.open(config, app_name=app_name, mode=AgentMode.advise) as swarm:
        rows, runs = swarm.history(limit), swarm.runs()
    unwatched = not_watched()
    if as_json:
        console.print_json(data={"ticks": rows, "runs": runs, "not_watched": unwatched})
        return
    console.print(f"not watched by the agents (no specialist judges them: a person sets them): {', '.join(unwatched)}", style="dim")
    if not rows:
        console.print("no ticks recorded yet")
        return
    # newest first: each run's ticks under a line naming the run (none over ticks of no recorded run)
    runs_and_ticks = [(run, list(ticks)) for run, ticks in groupby(rows, key=lambda r: run_of(r["at"], runs))]
    console.print(_history_table(runs_and_ticks) if wide else _history_blocks(runs_and_ticks, console.width))


def not_watched() -> list[str]:
    """The live knobs no specialist moves, in the config's order."""
    from agents.knobs import knob_paths
    from agents.specialists import WATCHED

    return [path for path in knob_paths() if path not in WATCHED]


def _run_line(run: dict) -> tuple[str, str, str]:
    started = datetime.fromtimestamp(run["at"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"run of {started}", f"app '{run['app']}'", "new cluster: memory forgotten, history kept" if run["new_cluster"] else "memory carried over"


def _tick_details(r: dict) -> list[str]:
    return [*r.get("decisions", []), *(f"applied {a}" for a in r.get("applied", [])), *(f"verified {v}" for v in r.get("verdicts", []))]


def _history_table(runs_and_ticks: list[tuple[dict | None, list[dict]]]) -> Table:
    table = Table("tick", "mode", "status", "situations", "decisions / applied / verified")
    table.columns[0].no_wrap = True
    for i, (run, ticks) in enumerate(runs_and_ticks):
        if i:
            table.add_section()
        if run is not None:
            name, app, memory = _run_line(run)
            table.add_row(f"[bold]{name}[/bold]", run["mode"], app, "-", memory, style="dim")
        for r in ticks:
            table.add_row(
                r["tick"],
                r["mode"],
                r["status"] + (f": {r['error'][:120]}" if r.get("error") else ""),
                ", ".join(r.get("situations", [])) or "-",
                "\n".join(_tick_details(r)) or "-",
            )
    return table


def _history_blocks(runs_and_ticks: list[tuple[dict | None, list[dict]]], width: int) -> Group:
    """One block per tick, for any terminal: each line at most two rows of `width` (`--wide` for every field whole)."""
    fit = max(40, 2 * width - 6)

    def line(text: str, indent: int) -> Text:
        return Text(" " * indent + textwrap.shorten(text, fit - indent, placeholder=" …"))

    out: list = []
    for run, ticks in runs_and_ticks:
        if run is not None:
            name, app, memory = _run_line(run)
            out.append(Text.assemble((name, "bold"), f" · {run['mode']} · {app} · {memory}", style="dim"))
        for r in ticks:
            out.append(Text.assemble((r["tick"], "bold"), f"  {r['mode']}  {r['status']}"))
            if r.get("error"):
                out.append(line(f"error: {r['error']}", 2))
            out.append(line(f"situations: {', '.join(r.get('situations', [])) or 'none'}", 2))
            out += [line(detail, 2) for detail in _tick_details(r)]
    return Group(*out)

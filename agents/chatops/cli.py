"""`pdd ask "question"`: the answer streams to the terminal, then the figures it used."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console

from agents.chatops.evidence import Figure
from app.config.file import ConfigError

console = Console()
DEFAULT_CONFIG = Path("serve_configs/local.yaml")


def ask(
    question: str = typer.Argument(..., help="A question about the cluster, or a change to propose ('scale MD to 3')"),
    thread: str | None = typer.Option(None, "--thread", "-t", help="Continue a conversation (the thread id printed after an answer)"),
    config_path: Path = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="Serve config YAML (agents.llm, prometheus_url, audit_db, chat_db)"),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The cluster's HTTP address (its /pdd/state and /pdd/requests)"),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="PDD_API_KEY",
        help="Operator key for --url, when the API requires one (default: the key the app generated, if on this machine)",
    ),
) -> None:
    """Ask the cluster about its state in plain words; the answer lists the figures it used.

    Read-only: a change you ask for is filed for approval (`pdd agents pending`), never made.
    """
    from agents.chatops.agent import llm_for
    from agents.runner import load

    try:
        config, app_name = load(config_path)
    except (ConfigError, OSError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    try:
        asyncio.run(_converse(config, app_name, llm_for(config.agents), question, thread, url, api_key))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


async def _converse(config, app_name: str, llm, question: str, thread: str | None, url: str, api_key: str | None) -> None:
    from agents.chatops.agent import build_agent, new_thread_id, sqlite_checkpointer
    from agents.chatops.sources import HttpSource
    from agents.whatif import load_what_if
    from app.api.auth import local_key

    source = HttpSource(url, api_key or local_key())
    saver = await sqlite_checkpointer(config.agents.chat_db) if llm is not None else None
    thread_id = thread or new_thread_id()
    try:
        agent = build_agent(config, llm=llm, source=source, app_name=app_name, checkpointer=saver, what_if=load_what_if())
        async for event in agent.ask(question, thread_id):
            show(event, conversation=llm is not None)
    except Exception as err:  # noqa: BLE001 - the endpoint, Prometheus or the model failed: say which, no traceback
        console.print(f"\n[red]chat-ops failed: {type(err).__name__}: {err}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        await source.aclose()
        if saver is not None:
            await saver.conn.close()


def show(event: dict, conversation: bool = True) -> None:
    """One chat event on the terminal; `conversation`: whether a thread can be continued (only with an LLM)."""
    kind = event["type"]
    if kind == "text":
        console.print(event["text"], end="", markup=False, highlight=False, soft_wrap=True)
    elif kind == "proposal":
        colour = "green" if event.get("filed") else "yellow"
        console.print(f"\n[{colour}]proposal:[/{colour}] {event['message']}", soft_wrap=True, highlight=False)
    elif kind == "figures":
        console.print()
        figures = event["figures"]
        # whole lines, not a table: queries and values must survive copy and paste
        console.print("[bold]figures used[/bold]" if figures else "[dim]no figures fetched for this answer[/dim]")
        for f in figures:
            console.print(f"  {Figure.model_validate(f).line()}", markup=False, highlight=False, soft_wrap=True)
        if conversation:
            console.print(f"[dim]thread {event['thread_id']} (continue with --thread {event['thread_id']})[/dim]")

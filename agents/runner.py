"""The live swarm: ticks against the real Prometheus and Ray Serve, audited in SQLite.

The audit database (`agents.audit_db`) holds the LangGraph checkpoints (every
step of every tick, one thread per tick) and the LangGraph store (memory and
tick summaries). Approvals and rejections resume a tick's thread from any
process that opens the same database: the loop, or `pdd agents approve`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.store.base import BaseStore
from langgraph.store.sqlite import SqliteStore
from langgraph.types import Command

from agents.actuate import Actuator, DryRunActuator, ServeActuator
from agents.entries import EntrySink, FileEntries
from agents.graph import Deps, TickState, build_graph, new_tick_id
from agents.memory import StoreBackend, read_history, read_runs, record_run
from agents.router import Router, make_router
from agents.whatif import WhatIf, load_what_if
from app.config import AgentMode, AgentsConfig, PDDConfig
from app.config.file import load_config
from app.telemetry.queries import QuerySet
from app.telemetry.snapshot import PromSource, Source

DEFAULT_APP = "pdd"


def serve_app_name(config_path: str | Path) -> str:
    """The Serve application name of the PDD app in a serve config file."""
    doc = yaml.safe_load(Path(config_path).read_text()) or {}
    for app in doc.get("applications") or []:
        if str(app.get("import_path", "")).startswith("app.builder:"):
            return app.get("name") or "default"
    return DEFAULT_APP


@contextmanager
def open_audit(path: str | Path) -> Iterator[tuple[SqliteSaver, SqliteStore]]:
    """Checkpointer and store on one SQLite file (separate connections: each manages its own transactions)."""
    db = Path(path).expanduser()
    db.parent.mkdir(parents=True, exist_ok=True)
    ckpt = sqlite3.connect(db, check_same_thread=False, timeout=30)
    kv = sqlite3.connect(db, check_same_thread=False, timeout=30, isolation_level=None)
    try:
        saver, store = SqliteSaver(ckpt), SqliteStore(kv)
        saver.setup()
        store.setup()
        yield saver, store
    finally:
        ckpt.close()
        kv.close()


def live_actuator(config: PDDConfig, agents: AgentsConfig, app_name: str) -> Actuator:
    serve = ServeActuator(agents.dashboard_url, app_name, list(config.roles.present()))
    if agents.mode is AgentMode.observe:
        return DryRunActuator(config.live_knobs(), {r.value: rc.replicas for r, rc in config.roles.present().items()}, reader=serve)
    return serve


def live_source(config: PDDConfig, agents: AgentsConfig, app_name: str) -> Source:
    queries = QuerySet.for_config(config, app_name)
    return PromSource(agents.prometheus_url, queries)


@dataclass
class Swarm:
    """One process's handle on the swarm: its graph compiled over the audit database."""

    config: PDDConfig
    agents: AgentsConfig
    deps: Deps
    graph: Any

    @classmethod
    @contextmanager
    def open(
        cls,
        config: PDDConfig,
        *,
        app_name: str = DEFAULT_APP,
        mode: AgentMode | None = None,
        source: Source | None = None,
        actuator: Actuator | None = None,
        entries: EntrySink | None = None,
        router: Router | None = None,
        what_if: WhatIf | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Iterator[Swarm]:
        agents = config.agents if mode is None else config.agents.model_copy(update={"mode": mode})
        with open_audit(agents.audit_db) as (saver, store):
            deps = Deps(
                config=config,
                agents=agents,
                source=source or live_source(config, agents, app_name),
                actuator=actuator or live_actuator(config, agents, app_name),
                memory=StoreBackend(store),
                entries=entries or FileEntries(agents.actions_dir),
                router=router or make_router(agents.llm),
                what_if=what_if if what_if is not None else load_what_if(),
                store=store,
                clock=clock,
            )
            yield cls(config, agents, deps, build_graph(deps).compile(checkpointer=saver))

    @staticmethod
    def thread(tick: str) -> dict:
        return {"configurable": {"thread_id": tick}}

    def tick(self) -> TickState:
        now = self.deps.clock()
        tick = new_tick_id(now)
        return self.graph.invoke({"tick": tick, "mode": self.agents.mode.value, "now": now}, self.thread(tick))

    def run(self, *, once: bool = False, on_tick: Callable[[TickState], None] | None = None) -> None:
        while True:
            started = time.monotonic()
            state = self.tick()
            if on_tick is not None:
                on_tick(state)
            if once:
                return
            time.sleep(max(0.0, self.agents.tick_s - (time.monotonic() - started)))

    def pending(self) -> list[dict]:
        """Ticks waiting for a person: tick id and the proposals it waits on."""
        ticks = sorted(set(self.deps.memory.load().pending.values()))
        out = []
        for tick in ticks:
            interrupts = self.graph.get_state(self.thread(tick)).interrupts
            if interrupts:
                out.append(interrupts[0].value)
        return out

    def decide(self, tick: str, *, approved: bool, by: str, note: str = "") -> TickState:
        if not self.graph.get_state(self.thread(tick)).interrupts:
            raise KeyError(f"no proposal awaits approval in {tick} (see `pdd agents pending`)")
        return self.graph.invoke(Command(resume={"approved": approved, "by": by, "note": note}), self.thread(tick))

    @property
    def store(self) -> BaseStore:
        """The audit database's store (Swarm.open always gives the deps one)."""
        if self.deps.store is None:
            raise RuntimeError("this swarm's deps have no store")
        return self.deps.store

    def history(self, limit: int = 20) -> list[dict]:
        return read_history(self.store, limit)

    def begin_run(self, app_name: str, *, new_cluster: bool) -> None:
        """Mark in the history where this run's ticks begin."""
        record_run(self.store, self.deps.clock(), self.agents.mode.value, app_name, new_cluster)

    def runs(self) -> list[dict]:
        return read_runs(self.store)


def load(config_path: str | Path) -> tuple[PDDConfig, str]:
    return load_config(config_path), serve_app_name(config_path)

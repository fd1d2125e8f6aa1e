"""What the agents remember between ticks: cooldowns, hysteresis streaks,
changes awaiting verification, rollback blocks, proposals awaiting approval.

Ticks run as separate LangGraph threads (one thread per tick, see
agents/graph.py), and an approval may resume an old tick from the CLI while
the loop runs new ones. So memory lives outside any one thread, in the
LangGraph store (SQLite, the audit database), one key per entry: a tick writes
back only the entries it changed, and two writers touching different knobs
never overwrite each other.
"""

from __future__ import annotations

from typing import Any, Protocol

from langgraph.store.base import BaseStore
from pydantic import BaseModel

from agents.knobs import Change

NAMESPACE = ("pdd-agents",)


class Unit(BaseModel):
    """Changes applied together; verified together and rolled back together."""

    id: str
    tick: str
    applied_at: float
    verify_at: float
    changes: list[Change]
    baseline: dict[str, float]
    """SLO figures (figure / target per objective) when the changes were made."""
    entries: list[str] = []
    """Runbook action entry files to update with the outcome."""
    situations: list[str] = []


class Block(BaseModel):
    """After a rollback: the same move on this target is refused until `until`."""

    until: float
    direction: int
    """+1 up, -1 down, 0 any change (choices)."""
    strikes: int = 1
    """Rollbacks of this move in a row: each one blocks it twice as long as the last."""


class Growth(BaseModel):
    """A replica added for a situation: another for it waits until this one has eased it."""

    situation: str
    """Its situation's key: the record lasts while the situation does."""
    target: str
    at: float
    figure: float
    """The situation's figure when the replica was added."""
    request_rate: float
    """Requests/s then: when the load has grown since, an unchanged figure does not show the replica futile."""


class Filed(BaseModel):
    """The entry filed for a proposal the agents did not act on (observe mode, a notice)."""

    situation: str
    """Its situation's key: while the situation lasts, a proposal for the target from the same
    live value updates this entry, whatever new value it proposes."""
    change: Change
    path: str


class Memory(BaseModel):
    last_change: dict[str, float] = {}
    """Target -> time it last changed (or was rolled back)."""
    raised: dict[str, float] = {}
    """Target -> time a change (or rollback) last raised it: a replica just added
    comes up and draws its share of the load only after a while (diagnose)."""
    noted: dict[str, float] = {}
    """Target -> time a proposal for it was last filed without acting (observe, advise):
    cooldowns count from it too, so an unchanged cluster does not get the same entry every tick."""
    filed: dict[str, Filed] = {}
    """Target -> the entry of its last proposal filed without acting, while its situation lasts:
    a situation that goes on for an hour gets one entry that says so, not one per cooldown."""
    streaks: dict[str, int] = {}
    """Situation key -> consecutive ticks it has been active (absent: inactive)."""
    growth: dict[str, Growth] = {}
    """`situation key|replica target` -> the last replica added for that situation, while it lasts."""
    units: dict[str, Unit] = {}
    """Applied, not yet verified."""
    blocked: dict[str, Block] = {}
    pending: dict[str, str] = {}
    """Target -> tick whose proposal for it awaits approval."""


_FIELDS = tuple(Memory.model_fields)


def growth_key(situation_key: str, target: str) -> str:
    return f"{situation_key}|{target}"


class MemoryBackend(Protocol):
    def load(self) -> Memory: ...

    def save(self, before: Memory, after: Memory) -> None: ...

    def forget(self) -> None: ...


class InMemoryBackend:
    """For the digital twin and unit tests: memory in this process only."""

    def __init__(self, memory: Memory | None = None):
        self.memory = memory or Memory()

    def load(self) -> Memory:
        return self.memory.model_copy(deep=True)

    def forget(self) -> None:
        self.memory = Memory()

    def save(self, before: Memory, after: Memory) -> None:
        data = self.memory.model_dump()
        for field in _FIELDS:
            old, new = getattr(before, field), getattr(after, field)
            for key in old.keys() - new.keys():
                data[field].pop(key, None)
            for key, value in new.items():
                if old.get(key) != value:
                    data[field][key] = value.model_dump() if isinstance(value, BaseModel) else value
        self.memory = Memory.model_validate(data)


def _wrap(value: Any) -> dict:
    return {"v": value.model_dump(mode="json") if isinstance(value, BaseModel) else value}


class StoreBackend:
    """Memory in a LangGraph store, one key per entry (namespace pdd-agents/<field>)."""

    def __init__(self, store: BaseStore):
        self.store = store

    def load(self) -> Memory:
        data: dict[str, dict] = {}
        for field in _FIELDS:
            items = self.store.search((*NAMESPACE, field), limit=10_000)
            data[field] = {item.key: item.value["v"] for item in items}
        return Memory.model_validate(data)

    def forget(self) -> None:
        """Drop every entry (the tick history stays): for a new cluster, which the stored
        streaks, cooldowns, unverified changes and waiting proposals do not describe."""
        for field in _FIELDS:
            for item in self.store.search((*NAMESPACE, field), limit=10_000):
                self.store.delete((*NAMESPACE, field), item.key)

    def save(self, before: Memory, after: Memory) -> None:
        for field in _FIELDS:
            old, new = getattr(before, field), getattr(after, field)
            for key in old.keys() - new.keys():
                self.store.delete((*NAMESPACE, field), key)
            for key, value in new.items():
                if old.get(key) != value:
                    self.store.put((*NAMESPACE, field), key, _wrap(value))


HISTORY = (*NAMESPACE, "history")


def record_history(store: BaseStore, tick: str, summary: dict) -> None:
    store.put(HISTORY, tick, summary)


def read_history(store: BaseStore, limit: int = 20) -> list[dict]:
    items = store.search(HISTORY, limit=100_000)
    rows = sorted((item.value for item in items), key=lambda v: v.get("at", 0), reverse=True)
    return rows[:limit]


RUNS = (*NAMESPACE, "runs")


def record_run(store: BaseStore, at: float, mode: str, app_name: str, new_cluster: bool) -> None:
    """A `pdd agents run` began: the history persists across runs, and shows where each began."""
    store.put(RUNS, f"{at:.6f}", {"at": at, "mode": mode, "app": app_name, "new_cluster": new_cluster})


def read_runs(store: BaseStore) -> list[dict]:
    """Every recorded run, oldest first."""
    return sorted((item.value for item in store.search(RUNS, limit=100_000)), key=lambda v: v["at"])


def run_of(tick_at: float, runs: list[dict]) -> dict | None:
    """The run a tick of that time belongs to (the last begun by then): None for ticks
    older than every recorded run."""
    return next((run for run in reversed(runs) if run["at"] <= tick_at), None)

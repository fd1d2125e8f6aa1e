"""Read-only access to what the agents wrote: runbooks, action entries, tick history, memory.

Runbooks are runbooks/<situation>.md; action entries are the markdown files
agents/entries.py files (YAML front matter); tick summaries live in the audit
database's LangGraph store (agents/memory.py). Nothing here writes: the audit
database is opened read-only.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from langgraph.store.sqlite import SqliteStore

from agents.entries import read_entry
from agents.memory import Memory, StoreBackend, read_history

T = TypeVar("T")

#: The repository root: runbooks/ sits next to agents/.
ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "runbooks"
ENTRY_FIELDS = ("time", "tick", "mode", "situation", "subject", "specialist", "action", "expected_effect", "outcome", "evidence")


def resolve_dir(path: str | Path) -> Path:
    """A configured folder: absolute as given; relative to the working directory when
    it exists there (where `pdd agents run` writes), else to the repository root
    (a Serve replica's working directory is not the repository)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return ROOT / p


def runbook_names(directory: Path = RUNBOOKS) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.md") if p.stem.lower() != "readme")


def read_runbook(situation: str, directory: Path = RUNBOOKS) -> str | None:
    """The runbook for a situation (`rld_overload`, "RLD overload"); None when there is none.

    Only names that exist are read, so a name cannot point outside the folder.
    """
    wanted = "_".join(situation.strip().lower().removesuffix(".md").replace("-", " ").split())
    return (directory / f"{wanted}.md").read_text() if wanted in runbook_names(directory) else None


def recent_entries(directory: Path, limit: int) -> list[dict[str, Any]]:
    """The newest runbook action entries (file names start with their UTC time)."""
    if not directory.is_dir():
        return []
    files = sorted((p for p in directory.glob("*.md") if p.stem.lower() != "readme"), key=lambda p: p.name, reverse=True)
    out = []
    for path in files[:limit]:
        try:
            front, _ = read_entry(path)
        except (ValueError, OSError):
            continue
        out.append({"file": path.name, **{k: front[k] for k in ENTRY_FIELDS if k in front}})
    return out


def _read_store(audit_db: str | Path, read: Callable[[SqliteStore], T], empty: T) -> T:
    """`read` over the audit database's store, opened read-only; `empty` when there is none yet."""
    db = Path(audit_db).expanduser()
    if not db.exists():
        return empty
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None, timeout=10)
    try:
        return read(SqliteStore(conn))
    except sqlite3.OperationalError:
        return empty
    finally:
        conn.close()


def recent_ticks(audit_db: str | Path, limit: int) -> list[dict[str, Any]]:
    """The newest tick summaries from the audit database (none when it does not exist yet)."""
    return _read_store(audit_db, lambda store: read_history(store, limit), [])


def agent_memory(audit_db: str | Path) -> Memory:
    """What the agents remember (situation streaks, proposals awaiting approval), read-only."""
    return _read_store(audit_db, lambda store: StoreBackend(store).load(), Memory())

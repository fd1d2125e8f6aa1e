"""Runbook action entries: one markdown file per action or proposal, in runbooks/actions/.

YAML front matter carries the record (time, situation, evidence = queries and
values, action, expected effect, outcome, rollback); the body says why in
words and points at the situation's runbook. The outcome is updated in place
as the action moves on (approved, applied, kept or rolled back), and when a
proposal not acted on is made again while its situation lasts (agents/graph.py).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import yaml

from agents.knobs import is_notice
from agents.proposal import Proposal

FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EntrySink(Protocol):
    def file(self, proposal: Proposal, *, tick: str, mode: str, at: float, outcome: str, explanation: str) -> str | None: ...

    def update(self, path: str, *, at: float, outcome: str) -> bool:
        """Add an outcome to the entry at `path`; False when it is gone (a person removed it)."""
        ...


class NoEntries:
    """The digital twin files nothing."""

    def file(self, proposal: Proposal, **_) -> str | None:
        return None

    def update(self, path: str, **_) -> bool:
        return False


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60]


class FileEntries:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory).expanduser()

    def file(self, proposal: Proposal, *, tick: str, mode: str, at: float, outcome: str, explanation: str) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        c = proposal.change
        notice = is_notice(c.target)
        front = {
            "time": iso(at),
            "tick": tick,
            "mode": mode,
            "situation": proposal.situation,
            "subject": proposal.subject or None,
            "specialist": proposal.specialist,
            "evidence": [e.model_dump(exclude_defaults=True) for e in proposal.evidence],
            "action": {"kind": "notice", "note": c.new} if notice else {"target": c.target, "from": c.old, "to": c.new},
            "expected_effect": proposal.expected_effect,
            "outcome": outcome,
            "outcomes": [{"time": iso(at), "outcome": outcome}],
            "rollback": None if notice else {"target": c.target, "to": c.old},
            "runbook": f"runbooks/{proposal.situation}.md",
        }
        if proposal.rollback_of:
            front["rollback_of"] = proposal.rollback_of
        stamp = datetime.fromtimestamp(at, tz=UTC).strftime("%Y%m%dT%H%M%S")
        base = f"{stamp}-{_slug(proposal.situation_key)}-{_slug(c.target)}"
        path = self.dir / f"{base}.md"
        n = 1
        while path.exists():
            n += 1
            path = self.dir / f"{base}-{n}.md"
        body = [
            f"# {proposal.situation.replace('_', ' ')}: {c.describe()}",
            "",
            f"Why: {proposal.reason}",
            "",
            f"Expected: {proposal.expected_effect}",
            "",
        ]
        if explanation:
            body += [explanation.strip(), ""]
        body.append(f"What the agents do and what a person checks: [{proposal.situation}](../{proposal.situation}.md)")
        path.write_text("---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---\n\n" + "\n".join(body) + "\n")
        return str(path)

    def update(self, path: str, *, at: float, outcome: str) -> bool:
        p = Path(path)
        if not p.exists():
            return False
        text = p.read_text()
        m = FRONT.match(text)
        if m is None:
            return False
        front = yaml.safe_load(m.group(1)) or {}
        front["outcome"] = outcome
        front.setdefault("outcomes", []).append({"time": iso(at), "outcome": outcome})
        p.write_text("---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---\n" + text[m.end() :])
        return True


def read_entry(path: str | Path) -> tuple[dict, str]:
    """Front matter and body of an entry."""
    text = Path(path).read_text()
    m = FRONT.match(text)
    if m is None:
        raise ValueError(f"{path}: no YAML front matter")
    return yaml.safe_load(m.group(1)) or {}, text[m.end() :]

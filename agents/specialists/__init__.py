"""The specialists: each reads a View and proposes changes for its situations.

Order matters only for the clerk, which always runs last (it files notices for
what the others left alone); routing, handoff and capacity are independent of
each other's order, so whoever routes between them (rules or an LLM) cannot
change the numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from agents.proposal import Proposal
from agents.specialists import capacity, clerk, handoff, routing
from agents.specialists.base import View

PROPOSERS: dict[str, Callable[[View], list[Proposal]]] = {
    routing.NAME: routing.propose,
    handoff.NAME: handoff.propose,
    capacity.NAME: capacity.propose,
}
CLERK = clerk.NAME
ALL: dict[str, Callable[[View], list[Proposal]]] = {**PROPOSERS, CLERK: clerk.propose}
WATCHED = frozenset(routing.KNOBS + handoff.KNOBS)
"""The live knobs some specialist moves (capacity moves replica counts); the rest only a person sets."""

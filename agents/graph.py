"""The tick graph: observe -> diagnose -> specialists (swarm handoffs) -> guard ->
persist -> [approve] -> act -> verify -> record.

One graph run is one tick, on its own LangGraph thread (thread id = tick id):
- the SQLite checkpointer keeps every step of every tick, so a tick's thread
  is its complete, self-contained audit record;
- in advise mode the tick stops at `approve` (a LangGraph `interrupt`) and
  waits, for minutes or days, until `pdd agents approve|reject <tick>` resumes
  exactly that thread, while the loop goes on running new ticks on new
  threads. One long thread could hold only one pending approval at a time.
What must carry from tick to tick (cooldowns, streaks, units awaiting
verification) is the agents' memory in the LangGraph store (agents/memory.py).

`persist` writes memory and the action entries before the interrupt: a node
that calls `interrupt` runs again from its start when resumed, so nothing with
side effects may sit in front of the interrupt inside `approve`.

State values are plain JSON (model dumps), so checkpoints read back anywhere.
The nodes are functions of (state, deps) in agents/nodes.py, the state and
its dependencies in agents/tick.py; this builder only wires them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from langgraph.graph import END, START, StateGraph

from agents import nodes
from agents.specialists import ALL, CLERK, PROPOSERS
from agents.tick import Deps, TickState, new_tick_id

__all__ = ["Deps", "TickState", "build_graph", "new_tick_id"]


class TickNode(Protocol):
    """A node as StateGraph.add_node takes it: called with the state (by the name `state`), returns its update."""

    def __call__(self, state: TickState) -> Any: ...


def build_graph(deps: Deps) -> StateGraph:
    """The tick graph over `deps`: each node is a function of (state, deps) in agents/nodes.py."""

    def bound(node: Callable[..., Any], **kw: Any) -> TickNode:
        return functools.partial(node, deps=deps, **kw)

    g = StateGraph(TickState)
    g.add_node("observe", bound(nodes.observe), destinations=("diagnose", "record"))
    g.add_node("diagnose", bound(nodes.diagnose_node), destinations=tuple(ALL))
    for name in PROPOSERS:
        g.add_node(name, bound(nodes.run_specialist, name=name), destinations=tuple(a for a in ALL if a != name))
    g.add_node(CLERK, bound(nodes.run_specialist, name=CLERK), destinations=("guard",))
    g.add_node("guard", bound(nodes.guard_node))
    g.add_node("persist", bound(nodes.persist), destinations=("approve", "act"))
    g.add_node("approve", nodes.approve)
    g.add_node("act", bound(nodes.act))
    g.add_node("verify", bound(nodes.verify_node))
    g.add_node("record", bound(nodes.record))
    g.add_edge(START, "observe")
    g.add_edge("guard", "persist")
    g.add_edge("approve", "act")
    g.add_edge("act", "verify")
    g.add_edge("verify", "record")
    g.add_edge("record", END)
    return g

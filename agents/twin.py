"""The swarm against the digital twin: the same graph, one tick per call, no I/O.

The twin supplies a Snapshot (its own figures, shaped like Prometheus'
answers) and applies the returned knobs and replica counts itself. Memory
(cooldowns, hysteresis, units awaiting verification) stays in the TwinAgent,
so successive calls behave like successive ticks of the live swarm, including
rollbacks when the twin's next snapshot shows a regression.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.actuate import DryRunActuator
from agents.diagnose import Situation
from agents.entries import NoEntries
from agents.graph import Deps, build_graph, new_tick_id
from agents.knobs import Change
from agents.memory import InMemoryBackend, Memory
from agents.observe import Snapshot, StaticSource
from agents.proposal import Decision
from agents.router import Router, RuleRouter
from agents.verify import Verdict
from agents.whatif import WhatIf
from app.config import AgentMode, LiveKnobs, PDDConfig


@dataclass
class TwinTick:
    knobs: LiveKnobs
    """Knobs after the tick (apply them to the twin)."""
    replicas: dict[str, int]
    """Role -> replica count after the tick."""
    changes: list[Change]
    """What this tick changed, rollbacks included, in order."""
    rollbacks: list[Change]
    situations: list[Situation]
    decisions: list[Decision]
    verdicts: list[Verdict]
    memory: Memory


class TwinAgent:
    def __init__(self, config: PDDConfig, *, what_if: WhatIf | None = None, router: Router | None = None, memory: Memory | None = None):
        self.config = config
        self.source = StaticSource()
        self.actuator = DryRunActuator(config.live_knobs(), {r.value: rc.replicas for r, rc in config.roles.present().items()})
        self.memory = InMemoryBackend(memory)
        self.now = 0.0
        deps = Deps(
            config=config,
            agents=config.agents.model_copy(update={"mode": AgentMode.act}),
            source=self.source,
            actuator=self.actuator,
            memory=self.memory,
            entries=NoEntries(),
            router=router or RuleRouter(),
            what_if=what_if,
            clock=lambda: self.now,
        )
        self.graph = build_graph(deps).compile()

    def tick(self, snapshot: Snapshot, *, knobs: LiveKnobs | None = None, replicas: dict[str, int] | None = None) -> TwinTick:
        """One tick at `snapshot.at`; `knobs` / `replicas` override what the agent last set."""
        if knobs is not None:
            self.actuator.knobs = knobs
        if replicas is not None:
            self.actuator.replicas = dict(replicas)
        self.source.current = snapshot
        self.now = snapshot.at
        state = self.graph.invoke({"tick": new_tick_id(snapshot.at), "mode": AgentMode.act.value, "now": snapshot.at})
        verdicts = [Verdict.model_validate(v) for v in state.get("verdicts", [])]
        rollbacks = [c for v in verdicts for c in v.rollback]
        applied = [Change.model_validate(c) for c in state.get("applied", [])]
        return TwinTick(
            knobs=self.actuator.knobs,
            replicas=dict(self.actuator.replicas),
            changes=applied + rollbacks,
            rollbacks=rollbacks,
            situations=[Situation.model_validate(s) for s in state.get("situations", [])],
            decisions=[Decision.model_validate(d) for d in state.get("decisions", [])],
            verdicts=verdicts,
            memory=self.memory.load(),
        )


def run_tick(config: PDDConfig, snapshot: Snapshot, *, knobs: LiveKnobs, replicas: dict[str, int], memory: Memory | None = None, what_if: WhatIf | None = None) -> TwinTick:
    """One tick as a function: pass the returned `memory` into the next call."""
    return TwinAgent(config, what_if=what_if, memory=memory).tick(snapshot, knobs=knobs, replicas=replicas)

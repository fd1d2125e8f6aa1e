"""A change the operator asks for in chat becomes a proposal in the agents' approval flow.

Nothing here changes the cluster. A request ("scale MD to 3") is read into a
`Change` (target, live value, new value), judged by the swarm's own guard
(bounds, step size, cooldown, pending approvals), and filed exactly like an
advise-mode tick: a thread in the audit database stopped at the `approve`
interrupt, an entry in memory's `pending`, a runbook action entry, a tick
summary. So `pdd agents pending` lists it and `pdd agents approve <tick>`
applies it (after guarding it again against the cluster as it is then).

Filing enters the tick graph (agents/graph.py) after its `guard` node, with
the state that node would have produced, and runs it to the interrupt; the
actuator it is given is a dry run, and `persist` (the only node before the
interrupt that writes) records without acting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, Field

from agents.actuate import DryRunActuator
from agents.chatops import intent
from agents.chatops.evidence import clip
from agents.chatops.records import resolve_dir
from agents.entries import FileEntries
from agents.graph import new_tick_id
from agents.guard import current_value, guard
from agents.knobs import CHOICE_KNOBS, INTEGER_KNOBS, Change, is_replicas, kind_of, replica_target
from agents.proposal import Proposal
from agents.router import RuleRouter
from agents.runner import Swarm
from agents.situations import Evidence
from app.config import AgentMode, LiveKnobs, PDDConfig
from app.telemetry.snapshot import StaticSource

SPECIALIST = "chatops"
#: The situation chat proposals are filed under (their entries' `situation`).
SITUATION = "operator_request"
TOOL_NAME = "file_proposal"

KNOB_TEXT = {
    "routing.max_wan_transfer_ms": "routing threshold, ms: P-MD when the expected WAN transfer takes at most this, else P-RLD-MD",
    "routing.min_hit_rate": "routing threshold, ratio 0..1: P-MD also needs MD's expected prefix hit at least this",
    "routing.singular.min_prompt_tokens": "singular filter: only prompts at least this many tokens",
    "routing.singular.enabled": "singular filter on (true) or off (false)",
    "handoff.mode": "handoff mode: one_shot, catch_up or auto",
    "handoff.catch_up_threshold_tokens": "auto handoff goes catch-up past this many eager tokens",
    "handoff.relay_cap_tokens": "most tokens the relay decoder (RLD) produces per request",
}


class FileProposal(BaseModel):
    """File a change for a person's approval. Nothing changes until they approve it."""

    target: str = Field(description="One of the tunable targets listed, e.g. replicas.main_decode")
    value: str = Field(description="The value exactly as the operator gave it (a number in the target's unit, or a choice)")
    relative: bool = Field(False, description="True when the operator asked for a change by an amount ('add 2', 'lower by 100'): value is then signed")
    reason: str = Field("", description="The operator's reason in a few words, when they gave one")


def proposal_tool() -> dict[str, Any]:
    """The tool, in OpenAI function format, offered to the proposal step only."""
    schema = FileProposal.model_json_schema()
    schema.pop("title", None)
    return {"type": "function", "function": {"name": TOOL_NAME, "description": FileProposal.__doc__, "parameters": schema}}


class Refused(ValueError):
    """The request cannot become a proposal; the message says why, for the operator."""


@dataclass
class Filing:
    filed: bool
    message: str
    tick: str | None = None
    change: str | None = None
    requested: str | None = None

    def data(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def tunable_targets(config: PDDConfig) -> dict[str, str]:
    """Target -> what it is: replica counts of present roles, bounded knobs, choice knobs."""
    out: dict[str, str] = {}
    for role, rc in config.roles.present().items():
        names = ", ".join(intent.ROLE_ALIASES[role.value][:3])
        out[replica_target(role)] = f"{role.value} replicas ({names}), 1..{rc.max_replicas}"
    for target in [*config.agents.bounds, *CHOICE_KNOBS]:
        out[target] = KNOB_TEXT.get(target, target)
    return out


def _parse_number(target: str, raw: str) -> float | int:
    """A number in the target's unit: `0.5s` for a `_ms` knob is 500, `70%` for a ratio is 0.7."""
    text = raw.strip().lower().replace(" ", "")
    scale = 1.0
    if text.endswith("ms"):
        text = text[:-2]
    elif text.endswith("s") and target.endswith("_ms"):
        text, scale = text[:-1], 1000.0
    elif text.endswith("%"):
        text, scale = text[:-1], (0.01 if target.endswith(("_rate", "_load")) else 1.0)
    try:
        value = float(text) * scale
    except ValueError:
        raise Refused(f"'{raw}' is not a number for {target}") from None
    if is_replicas(target) or target in INTEGER_KNOBS:
        if value != int(value):
            raise Refused(f"{target} takes whole numbers, not {raw}")
        return int(value)
    return value


def _parse_choice(target: str, raw: str) -> Any:
    choices = CHOICE_KNOBS[target]
    word = intent.normalize(raw)
    if all(isinstance(c, bool) for c in choices):
        if word in intent.TRUE_WORDS:
            return True
        if word in intent.FALSE_WORDS:
            return False
    for c in choices:
        if not isinstance(c, bool) and intent.normalize(str(c)) == word:
            return c
    raise Refused(f"{target} takes one of {', '.join(map(str, choices))}, not '{raw}'")


def read_request(args: dict[str, Any], asked: str, config: PDDConfig, knobs: LiveKnobs, replicas: dict[str, int]) -> Change:
    """The change a proposal call describes, checked against the operator's own message.

    The target must be tunable and named in the message; the value must be in
    the message. So a value that came from anywhere else (a metric label, a
    runbook, an earlier turn) cannot become a proposal.
    """
    req = FileProposal.model_validate(args)
    target = req.target.strip()
    targets = tunable_targets(config)
    if target not in targets:
        raise Refused(f"'{target}' is not something the agents may change; tunable: {', '.join(targets)}")
    if not intent.mentions_target(target, asked):
        raise Refused(f"the request does not name {target}")
    old = current_value(target, knobs, replicas)
    if kind_of(target) == "choice":
        if req.relative:
            raise Refused(f"{target} takes a choice, not an amount")
        new = _parse_choice(target, req.value)
        if not intent.choice_grounded(new, asked):
            raise Refused(f"the request does not say {new!r}")
        return Change(target=target, old=old, new=new)
    amount = _parse_number(target, req.value)
    if not intent.number_grounded(float(amount), asked):
        raise Refused(f"the request does not contain the value {req.value}")
    if not req.relative:
        return Change(target=target, old=old, new=amount)
    if old is None:
        raise Refused(f"{target} is unset: give the value itself, not an amount")
    # the sign comes from the operator's verb when it says which way ("lower by 100")
    sign = intent.direction(asked)
    return Change(target=target, old=old, new=old + (sign * abs(amount) if sign else amount))


class ProposalDesk:
    """Files chat-ops requests into the agents' approval flow (the audit database of `config`)."""

    def __init__(self, config: PDDConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock

    def targets(self) -> dict[str, str]:
        return tunable_targets(self.config)

    def file(self, args: dict[str, Any], *, asked: str, thread: str, knobs: LiveKnobs, replicas: dict[str, int]) -> Filing:
        """Judge and file one request; a request that cannot be filed says why (never raises Refused)."""
        try:
            change = read_request(args, asked, self.config, knobs, replicas)
        except Refused as err:
            return Filing(False, f"not filed: {err}")
        except ValueError as err:
            return Filing(False, f"not filed: the proposal call was malformed ({clip(str(err), 200)})")
        reason = str(args.get("reason") or "").strip()
        proposal = Proposal(
            specialist=SPECIALIST,
            situation=SITUATION,
            change=change,
            reason=f"an operator asked in chat-ops (thread {thread})" + (f": {clip(reason, 200)}" if reason else ""),
            expected_effect=f"what the operator asked for; checked against the SLO {self.config.agents.verify_after_s:g} s after it is applied, rolled back if worse",
            evidence=[Evidence(query="chat-ops request", value=None, note=clip(asked, 300))],
            streak=self.config.agents.confirm_ticks,
        )
        now = self.clock()
        entries = FileEntries(resolve_dir(self.config.agents.actions_dir))
        actuator = DryRunActuator(knobs, replicas)
        with Swarm.open(
            self.config, mode=AgentMode.advise, source=StaticSource(), actuator=actuator, entries=entries, router=RuleRouter(), clock=self.clock
        ) as swarm:
            memory = swarm.deps.memory.load()
            [decision] = guard([proposal], config=self.config, agents=swarm.agents, knobs=knobs, replicas=replicas, memory=memory, now=now)
            if decision.status != "accepted":
                return Filing(False, f"not filed: the agents' guard {decision.status} it ({decision.reason})", requested=change.describe())
            tick = "chat-" + new_tick_id(now).removeprefix("tick-")
            saved = memory.model_dump(mode="json")
            swarm.graph.update_state(
                swarm.thread(tick),
                {
                    "tick": tick,
                    "mode": AgentMode.advise.value,
                    "now": now,
                    "memory": saved,
                    "memory_saved": saved,
                    "situations": [],
                    "knobs": knobs.model_dump(mode="json"),
                    "replicas": dict(replicas),
                    "decisions": [decision.model_dump(mode="json")],
                },
                as_node="guard",
            )
            swarm.graph.invoke(None, swarm.thread(tick))
        filed = decision.proposal.change
        note = f" ({decision.reason})" if decision.reason else ""
        return Filing(
            True,
            f"filed for approval: {filed.describe()}{note}. Nothing changes until a person runs `pdd agents approve {tick}`.",
            tick=tick,
            change=filed.describe(),
            requested=change.describe(),
        )

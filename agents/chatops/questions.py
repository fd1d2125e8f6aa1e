"""Reading an operator's question without an LLM: what it asks about, and for which part of the cluster.

Pure functions over the message's text. A question is read into topics (the
kinds of answer the rule answerer, agents/chatops/rules.py, can give) and a
scope (pipelines, roles, datacenters named in it). A change request is read
into the arguments of a proposal; the proposal desk then checks them against
the message again (agents/chatops/propose.read_request) and guards them like
any proposal, so these rules only need to be right, not safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agents.chatops import intent
from agents.chatops.intent import has_word
from agents.knobs import CHOICE_KNOBS, REPLICAS
from app.policy import Pipeline


@dataclass(frozen=True)
class Metric:
    """A figure operators ask about, and the named queries that show it."""

    label: str
    words: tuple[str, ...]
    templates: tuple[str, ...]


METRICS: dict[str, Metric] = {
    "ttft": Metric(
        "time to first token",
        ("ttft", "time to first token", "first token", "latency", "slow", "slower", "response time"),
        ("ttft_p_by_pipeline", "ttft_p99_by_pipeline"),
    ),
    "tpot": Metric(
        "time per output token",
        ("tpot", "time per output token", "per token", "itl", "inter token", "decode speed", "tokens per second"),
        ("tpot_p_by_pipeline",),
    ),
    "gap": Metric("worst inter-token gap", ("gap", "gaps", "stall", "stalls", "stutter", "pause", "pauses", "freeze"), ("gap_p99_by_pipeline",)),
    "wan": Metric(
        "KV transfers by link",
        ("wan", "link", "links", "kv", "transfer", "transfers", "pull", "pulls", "bandwidth", "network"),
        ("kv_seconds_p90_by_link", "kv_slowdown_mean_by_link", "kv_bytes_per_transfer_by_link", "kv_transfer_rate_by_link", "kv_failure_rate_by_link"),
    ),
    "hit": Metric("prefix-cache hit", ("hit", "hits", "cache", "cached", "prefix"), ("prefix_hit_by_role",)),
    "traffic": Metric(
        "request rate",
        ("request rate", "throughput", "traffic", "rps", "qps", "load", "busy", "requests per second"),
        ("request_rate_by_pipeline", "ongoing_by_deployment"),
    ),
    "errors": Metric(
        "errors", ("error", "errors", "fail", "fails", "failing", "failed", "failure", "failures", "500"), ("requests_by_outcome", "kv_failures_by_link_reason")
    ),
    "slo": Metric("SLO violations", ("slo", "slos", "violation", "violations", "breach", "breaches", "sla"), ("slo_violations_by_pipeline",)),
}

#: Topic -> words that ask for it (after intent.normalize).
TOPIC_WORDS: dict[str, tuple[str, ...]] = {
    "state": (
        "state",
        "status",
        "health",
        "healthy",
        "ready",
        "replica",
        "replicas",
        "running",
        "alive",
        "overview",
        "up and running",
        "how is the cluster",
        "cluster",
    ),
    "agents": ("agent", "agents", "swarm", "tick", "ticks", "decision", "decisions", "pending", "approval", "approve", "proposal", "proposals"),
    "changes": ("changed", "what changed", "recent changes", "changes", "lately", "recently"),
    "runbook": ("runbook", "runbooks", "playbook", "what should i do", "what do i do", "what to do", "how do i fix", "fix"),
    "requests": ("recent requests", "last requests", "latest requests", "slowest request", "slowest requests", "slowest"),
    "knobs": ("knob", "knobs", "setting", "settings", "tunable", "tunables"),
}
WHY_WORDS = ("why", "what caused", "cause", "reason", "up", "down", "high", "higher", "low", "lower", "worse", "bad", "spike", "spiking", "explain")
REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl)-[A-Za-z0-9_-]+")
_MINUTES = re.compile(r"(?:last|past)\s+(\d+(?:\.\d+)?)\s*(minutes?|mins?|m|hours?|h|seconds?|s)\b")
_VALUE = r"[-+]?\d+(?:\.\d+)?\s*(?:ms|s|%)?"


@dataclass(frozen=True)
class Scope:
    """What part of the cluster a question names; empty parts mean all of it."""

    pipelines: frozenset[str] = frozenset()
    roles: frozenset[str] = frozenset()
    datacenters: frozenset[str] = frozenset()

    def keeps(self, labels: dict[str, str]) -> bool:
        """A Prometheus series belongs to the scope (a label it lacks does not exclude it)."""
        if self.pipelines and "pipeline" in labels and labels["pipeline"] not in self.pipelines:
            return False
        if self.roles and "role" in labels and labels["role"] not in self.roles:
            return False
        if self.roles and "deployment" in labels and labels["deployment"] not in {DEPLOYMENTS[r] for r in self.roles}:
            return False
        if self.datacenters and "link" in labels and not any(dc in labels["link"] for dc in self.datacenters):
            return False
        return True

    def describe(self) -> str:
        return ", ".join(sorted(self.pipelines | self.roles | self.datacenters))


#: Role -> its Serve deployment (the `deployment` label).
DEPLOYMENTS = {"prefill": "Prefill", "relay_decode": "RelayDecode", "main_decode": "MainDecode"}


@dataclass(frozen=True)
class Question:
    text: str
    topics: tuple[str, ...]
    metrics: tuple[str, ...]
    scope: Scope
    why: bool = False
    knobs: tuple[str, ...] = ()
    request_ids: tuple[str, ...] = ()
    situations: tuple[str, ...] = ()
    minutes: float | None = None
    """The span a "last N minutes" asks about."""


def _remove(text: str, phrase: str) -> str:
    return re.sub(rf"(?<![\w]){re.escape(phrase)}(?![\w])", " ", text)


def _scope(text: str, datacenters: list[str]) -> tuple[Scope, str]:
    """The scope named in the text, and the text with pipeline names removed (so `P-MD` is no role)."""
    pipelines = set()
    for p in sorted((p.value for p in Pipeline), key=len, reverse=True):
        name = intent.normalize(p)
        if has_word(text, name):
            pipelines.add(p)
            text = _remove(text, name)
    roles = {role for role, aliases in intent.ROLE_ALIASES.items() if any(has_word(text, a) for a in aliases if a not in ("p", "main"))}
    dcs = {dc for dc in datacenters if has_word(text, intent.normalize(dc))}
    return Scope(frozenset(pipelines), frozenset(roles), frozenset(dcs)), text


#: Names operators give knobs besides their field names.
KNOB_WORDS: dict[str, tuple[str, ...]] = {
    "routing.max_wan_transfer_ms": ("wan threshold", "routing threshold", "wan transfer threshold"),
    "routing.max_relay_load": ("relay load",),
    "routing.singular.enabled": ("singular filter",),
    "handoff.mode": ("handoff mode",),
    "handoff.catch_up_threshold_tokens": ("catch up threshold",),
    "handoff.relay_cap_tokens": ("relay cap",),
    "handoff.min_relay_cap_tokens": ("min relay cap", "minimum relay cap"),
}


def knob_phrases(knob: str) -> list[str]:
    """How a message names a knob: its path, its field name when that is specific, or a known name."""
    leaf = knob.rsplit(".", 1)[-1]
    specific = intent.normalize(leaf) if "_" in leaf else intent.normalize(knob.replace(".", " "))
    return [intent.normalize(knob), specific, *KNOB_WORDS.get(knob, ())]


def knob_names(text: str, knobs: list[str]) -> list[str]:
    """Knobs the text names."""
    named = [k for k in knobs if any(has_word(text, p) for p in knob_phrases(k))]
    # "min relay cap" names min_relay_cap_tokens, not relay_cap_tokens as well
    return [k for k in named if not any(o != k and o.endswith(k.rsplit(".", 1)[-1]) and len(o) > len(k) for o in named)]


def _minutes(text: str) -> float | None:
    m = _MINUTES.search(text)
    if not m:
        return None
    value, unit = float(m.group(1)), m.group(2)
    return value * 60 if unit.startswith("h") else value / 60 if unit.startswith("s") else value


def read_question(message: str, *, datacenters: list[str], knobs: list[str], situations: list[str]) -> Question:
    """What the message asks about (`knobs`: every live knob's path; `situations`: runbook names)."""
    ids = tuple(REQUEST_ID.findall(message))
    text = intent.normalize(REQUEST_ID.sub(" ", message))
    scope, rest = _scope(text, datacenters)
    named_knobs = tuple(knob_names(rest, knobs))
    named_situations = tuple(s for s in situations if has_word(rest, intent.normalize(s)))
    # a knob's or a runbook's name is no question about the figure its words name ("wan_degradation")
    for phrase in [*(p for k in named_knobs for p in knob_phrases(k)), *(intent.normalize(s) for s in named_situations)]:
        rest = _remove(rest, phrase)
    metrics = tuple(name for name, m in METRICS.items() if any(has_word(rest, w) for w in m.words))
    topics = [t for t, words in TOPIC_WORDS.items() if any(has_word(rest, w) for w in words)]
    minutes = _minutes(rest)
    if minutes is not None and "changes" not in topics:
        topics.append("changes")
    if named_situations and "runbook" not in topics:
        topics.append("runbook")
    if named_knobs and "knobs" not in topics:
        topics.append("knobs")
    if ids:  # "why was chatcmpl-… slow?" asks about that request, not the cluster's figures
        topics.append("journey")
        metrics = ()
    # "state" is also a word of other questions ("state of the WAN"): alone only when nothing else matched
    if "state" in topics and (metrics or len(topics) > 1) and not scope.roles:
        topics.remove("state")
    if "agents" in topics and "changes" in topics:
        topics.remove("agents")  # what changed covers the agents' ticks of that span
    why = any(has_word(rest, w) for w in WHY_WORDS)
    return Question(message, tuple(topics), metrics, scope, why, named_knobs, ids, named_situations, minutes)


def _target_phrases(target: str) -> list[str]:
    if target.startswith(REPLICAS):
        return [intent.normalize(target), *intent.ROLE_ALIASES.get(target.removeprefix(REPLICAS), ())]
    return [*knob_phrases(target), *intent.KNOB_ALIASES.get(target, ())]


def change_target(message: str, targets: list[str]) -> tuple[str | None, str]:
    """The one target a change request names (the most specific phrase wins), or None and why."""
    text = intent.normalize(message)
    best: dict[str, int] = {}
    for target in targets:
        lengths = [len(p) for p in _target_phrases(target) if has_word(text, p)]
        if lengths:
            best[target] = max(lengths)
    if not best:
        return None, "it names nothing the agents may change"
    top = max(best.values())
    winners = sorted(t for t, n in best.items() if n == top)
    if len(winners) > 1:
        return None, f"it could mean {' or '.join(winners)}: name one"
    return winners[0], ""


def change_args(message: str, targets: list[str]) -> tuple[dict | None, str]:
    """The proposal a change request describes ({target, value, relative, reason}), or None and why."""
    target, why = change_target(message, targets)
    if target is None:
        return None, why
    text = intent.normalize(message)
    reason = message.split("because", 1)[1].strip() if "because" in message else ""
    if target in CHOICE_KNOBS:
        for choice in CHOICE_KNOBS[target]:
            words = (intent.TRUE_WORDS if choice else intent.FALSE_WORDS) if isinstance(choice, bool) else (intent.normalize(str(choice)),)
            if any(has_word(text, w) for w in words if w not in ("on", "no")):
                return {"target": target, "value": str(choice), "reason": reason}, ""
        return None, f"it gives no value for {target} ({', '.join(map(str, CHOICE_KNOBS[target]))})"
    lowered = message.lower()
    if m := re.search(rf"(?:\bto\b|=)\s*({_VALUE})", lowered):
        return {"target": target, "value": m.group(1).strip(), "relative": False, "reason": reason}, ""
    if m := re.search(rf"\bby\s+({_VALUE})", lowered):
        return {"target": target, "value": m.group(1).strip(), "relative": True, "reason": reason}, ""
    values = re.findall(rf"(?<![\w.]){_VALUE}", lowered)
    if not values:
        return None, f"it gives no value for {target}"
    return {"target": target, "value": values[-1].strip(), "relative": intent.direction(message) != 0, "reason": reason}, ""

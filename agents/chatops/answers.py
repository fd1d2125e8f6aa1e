"""The parts of an answer given without an LLM, each written from what the read-only tools return.

Every function takes the question (agents/chatops/questions.Question) and a
`Reader` over the toolbox, and returns lines of text. Each figure a line
states comes from a tool call the Reader made, so the answer's figure list
holds it too. Values a tool returns are only quoted, never read as words
that steer the answer: a metric label that says "ignore previous
instructions" is printed as the label it is.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from agents.chatops import records
from agents.chatops.evidence import Figure, clip, number
from agents.chatops.questions import METRICS, Question
from agents.chatops.sources import SourceError
from agents.chatops.tools import Toolbox, ToolFailed
from agents.knobs import CHOICE_KNOBS, fmt, get_knob
from app.conductor.readiness import describe, readiness
from app.config import LiveKnobs, Mode, PDDConfig, RoleName

#: Minutes "what changed" looks back when the question gives no span.
DEFAULT_MINUTES = 60.0
#: Templates at the SLO's own percentile -> the `slo` field holding their target (ms).
TARGETS = {"ttft_p_by_pipeline": "ttft_ms", "tpot_p_by_pipeline": "tpot_ms"}


class Failed(str):
    """A tool's refusal or error, worded for the operator."""


class Reader:
    """Calls tools once each per answer and keeps every figure they return."""

    def __init__(self, toolbox: Toolbox):
        self.toolbox = toolbox
        self.figures: list[Figure] = []
        self._seen: dict[tuple, Any] = {}

    async def read(self, tool: str, **args: Any) -> Any:
        """The tool's data, or a Failed saying why there is none."""
        key = (tool, tuple(sorted(args.items())))
        if key not in self._seen:
            try:
                out = await getattr(self.toolbox, tool)(**args)
            except (ToolFailed, SourceError) as err:
                self._seen[key] = Failed(str(err))
            else:
                self.figures += [f for f in out.figures if f not in self.figures]
                self._seen[key] = out.data
        return self._seen[key]


def ms(seconds: float) -> str:
    return f"{number(seconds * 1000):g} ms"


def _formats(config: PDDConfig) -> dict[str, tuple[str, Any]]:
    """Template -> (what it is, how to write a value)."""
    p, w = f"p{config.slo.percentile:g}", f"{config.slo.window_s:g} s"
    count = lambda v: f"{number(v):g}"  # noqa: E731
    per_s = lambda v: f"{number(v):g}/s"  # noqa: E731
    return {
        "ttft_p_by_pipeline": (f"TTFT {p}", ms),
        "ttft_p99_by_pipeline": ("TTFT p99", ms),
        "tpot_p_by_pipeline": (f"TPOT {p}", ms),
        "gap_p99_by_pipeline": ("worst-gap p99", ms),
        "kv_seconds_p90_by_link": ("KV pull time p90", ms),
        "kv_slowdown_mean_by_link": ("WAN pull time / link model (1: healthy)", lambda v: f"{number(v):g}x"),
        "kv_bytes_per_transfer_by_link": ("KV per pull", lambda v: f"{number(v / 1e6):g} MB"),
        "kv_transfer_rate_by_link": ("KV pulls", per_s),
        "kv_failure_rate_by_link": ("failed KV pulls", per_s),
        "prefix_hit_by_role": ("prefix-cache hit", lambda v: f"{number(v * 100):g}%"),
        "request_rate_by_pipeline": ("finished requests", per_s),
        "ongoing_by_deployment": ("requests in progress", count),
        "requests_by_outcome": (f"requests finished in the last {w}", count),
        "kv_failures_by_link_reason": (f"failed KV pulls in the last {w}", count),
        "slo_violations_by_pipeline": (f"requests over an SLO target in the last {w}", count),
        "replicas_healthy_by_deployment": ("healthy replicas (Serve)", count),
    }


def _series_name(labels: dict[str, str]) -> str:
    return " ".join(v for k, v in sorted(labels.items()) if k not in ("__name__",)) or "all"


async def metric_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    """Each asked-for figure, by series, worst first; the SLO target where there is one."""
    formats = _formats(config)
    lines = []
    where = f" for {q.scope.describe()}" if q.scope.describe() else ""
    for key in q.metrics:
        for name in METRICS[key].templates:
            label, write = formats[name]
            data = await r.read("prometheus_query", query=name)
            if isinstance(data, Failed):
                lines.append(f"- {label} ({name}): could not be read: {data}")
                continue
            series = sorted((s for s in data["series"] if q.scope.keeps(s["labels"])), key=lambda s: -(s["value"] or 0))
            shown = [f"{_series_name(s['labels'])} {write(s['value']) if s['value'] is not None else 'no data'}" for s in series]
            line = f"- {label} ({name}){where}: " + (", ".join(shown) if shown else f"no data in the last {config.slo.window_s:g} s")
            target = getattr(config.slo, TARGETS[name]) if name in TARGETS else None
            if target and series:
                over = [f"{_series_name(s['labels'])} ({number(s['value'] * 1000 / target):g}x)" for s in series if s["value"] and s["value"] * 1000 > target]
                line += f"; target {target:g} ms: " + (f"over it: {', '.join(over)}" if over else "all within it")
            lines.append(line)
    return lines


async def diagnosis_lines(r: Reader) -> list[str]:
    data = await r.read("diagnosis")
    if isinstance(data, Failed):
        return [f"The agents' diagnosis could not be made: {data}"]
    found = data["situations"]
    if not found:
        return ["The agents' diagnosis finds no situation now: every check is under its threshold."]
    lines = ["The agents' diagnosis now:"]
    for s in sorted(found, key=lambda s: -s["severity"]):
        lines.append(f"- {s['situation']}: {s['summary']} (acted on by {', '.join(s['specialists'])}; runbook {s['runbook']})")
    return lines


def _readiness(state: dict[str, Any]) -> dict[str, Any]:
    roles = state.get("roles") or {}
    configured = {RoleName(role): info.get("configured_replicas", 0) for role, info in roles.items()}
    live = {RoleName(role): len(info.get("replicas") or []) for role, info in roles.items()}
    return readiness(Mode(state["mode"]), configured, live)


def knob_drift(state: dict[str, Any], config: PDDConfig) -> list[str]:
    """Live knobs that differ from the config file's (the agents or an operator moved them)."""
    live = LiveKnobs.model_validate(state.get("knobs") or {})
    drift = []
    configured_knobs = config.live_knobs()
    for path in knob_paths():
        now, configured = get_knob(live, path), get_knob(configured_knobs, path)
        if now != configured:
            drift.append(f"{path} {fmt(now)} (config {fmt(configured)})")
    return drift


async def state_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    state = await r.read("cluster_state")
    if isinstance(state, Failed):
        return [f"The cluster's state could not be read: {state}"]
    ready = _readiness(state)
    lines = [f"Mode {state['mode']}, model {state.get('model')}. Readiness: {ready['status']} ({describe(ready)})."]
    for role, info in (state.get("roles") or {}).items():
        if q.scope.roles and role not in q.scope.roles:
            continue
        replicas = info.get("replicas") or []
        busy = sum(rep.get("in_flight") or 0 for rep in replicas)
        lines.append(
            f"- {role} in {info.get('datacenter')} ({info.get('accelerator')}): {len(replicas)} live of {info.get('configured_replicas')} configured, {busy} requests in flight"
        )
    lines.append(f"Requests in flight: {state.get('in_flight')}.")
    recent = (state.get("slo") or {}).get("recent") or {}
    for pipeline, figs in (recent.get("by_pipeline") or {}).items():
        ttft = figs.get("ttft_ms") or {}
        lines.append(
            f"- journal, last {recent.get('window_s'):g} s: {pipeline} {figs['requests']} requests, {figs['errors']} errors, TTFT p99 {ttft.get('p99')} ms"
        )
    drift = knob_drift(state, config)
    lines.append("Live knobs " + (f"moved from the config file: {'; '.join(drift)}." if drift else "equal the config file's."))
    healthy = await r.read("prometheus_query", query="replicas_healthy_by_deployment")
    if not isinstance(healthy, Failed) and healthy["series"]:
        lines.append("Healthy replicas by deployment (Serve): " + ", ".join(f"{_series_name(s['labels'])} {fmt(s['value'])}" for s in healthy["series"]) + ".")
    return lines


def _ago(at: float) -> str:
    seconds = max(0.0, time.time() - at)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.1f} min ago"


def _tick_line(t: dict[str, Any]) -> str:
    parts = [f"{t.get('tick')} ({_ago(t.get('at', 0))}, {t.get('mode')}, {t.get('status')})"]
    parts.append("situations: " + (", ".join(t.get("situations") or []) or "none"))
    for key in ("decisions", "applied", "verdicts"):
        if t.get(key):
            parts.append(f"{key}: " + "; ".join(t[key]))
    if t.get("error"):
        parts.append(f"error: {clip(str(t['error']), 200)}")
    return "- " + "; ".join(parts)


def _entry_line(e: dict[str, Any]) -> str:
    subject = f" {e['subject']}" if e.get("subject") else ""
    action = e.get("action")
    if isinstance(action, dict) and {"target", "from", "to"} <= action.keys():
        action = f"{action['target']}: {fmt(action['from'])} -> {fmt(action['to'])}"
    return f"- {e['file']}: {e.get('situation')}{subject}: {action}; outcome {e.get('outcome') or 'none yet'}"


async def agents_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    data = await r.read("agent_actions", limit=5)
    if isinstance(data, Failed):
        return [f"The agents' records could not be read: {data}"]
    ticks, entries = data["ticks"], data["action_entries"]
    if not ticks and not entries:
        lines = [f"The agents have recorded nothing yet ({config.agents.audit_db}, {config.agents.actions_dir}): start them with `pdd agents run`."]
    else:
        lines = ["The agents' last ticks:" if ticks else "No tick recorded yet."]
        lines += [_tick_line(t) for t in ticks]
        if entries:
            lines += ["Their last runbook action entries:", *(_entry_line(e) for e in entries)]
    pending = data["pending"]
    if pending:
        lines.append("Awaiting approval: " + "; ".join(f"{target} (`pdd agents approve {tick}`)" for target, tick in sorted(pending.items())) + ".")
    return lines


def _parsed_time(stamp: Any) -> float:
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0


async def change_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    minutes = q.minutes or DEFAULT_MINUTES
    since = time.time() - minutes * 60
    lines = [f"In the last {minutes:g} minutes:"]
    data = await r.read("agent_actions", limit=100)
    if isinstance(data, Failed):
        lines.append(f"- the agents' records could not be read: {data}")
    else:
        ticks = [t for t in data["ticks"] if t.get("at", 0) >= since and (t.get("decisions") or t.get("applied") or t.get("verdicts"))]
        entries = [e for e in data["action_entries"] if _parsed_time(e.get("time")) >= since]
        lines += [_tick_line(t) for t in ticks] + [_entry_line(e) for e in entries]
        if not ticks and not entries:
            lines.append("- the agents changed, proposed and verified nothing")
    state = await r.read("cluster_state")
    if not isinstance(state, Failed):
        drift = knob_drift(state, config)
        lines.append("Live knobs now " + (f"differ from the config file: {'; '.join(drift)}." if drift else "equal the config file's."))
        moved = [
            f"{role} {len(i.get('replicas') or [])} live of {i.get('configured_replicas')} configured"
            for role, i in (state.get("roles") or {}).items()
            if len(i.get("replicas") or []) != i.get("configured_replicas")
        ]
        lines.append("Replicas " + (f"off their configured count: {'; '.join(moved)}." if moved else "at their configured counts."))
    return lines


def knob_paths() -> list[str]:
    """Every live knob's path (`routing.max_wan_transfer_ms`)."""

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += walk(sub, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    return walk(LiveKnobs, "")


def knob_doc(path: str) -> str:
    model: Any = LiveKnobs
    *parents, leaf = path.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return " ".join((model.model_fields[leaf].description or "").split())


async def knob_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    state = await r.read("cluster_state")
    live = LiveKnobs.model_validate(state.get("knobs") or {}) if not isinstance(state, Failed) else None
    lines = []
    configured = config.live_knobs()
    for path in q.knobs or tuple(knob_paths()):
        now = fmt(get_knob(live, path)) if live else f"unknown ({state})"
        line = f"- {path}: live {now}, config {fmt(get_knob(configured, path))}."
        if q.knobs:
            line += f" {knob_doc(path)}"
            bounds = config.agents.bounds.get(path)
            if bounds:
                line += f" The agents may move it within {fmt(bounds.min)}..{fmt(bounds.max)}, at most {fmt(bounds.max_step)} a step (agents.bounds)."
            elif path in CHOICE_KNOBS:
                line += f" The agents may switch it among {', '.join(map(str, CHOICE_KNOBS[path]))}."
            else:
                line += " The agents do not move it (no agents.bounds entry)."
        lines.append(line)
    return lines


def _runbook_gist(name: str, text: str) -> list[str]:
    """The runbook's title and its "What the agents do" section."""
    body = text.splitlines()
    title = next((line.lstrip("# ").strip() for line in body if line.startswith("# ")), name)
    out, inside = [f"runbooks/{name}.md: {title}"], False
    for line in body:
        if line.startswith("## "):
            inside = line.lower().startswith("## what the agents do")
        elif inside and line.strip():
            out.append("  " + line.rstrip())
    return out


async def runbook_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    names = list(q.situations)
    lines: list[str] = []
    if not names:
        data = await r.read("diagnosis")
        if isinstance(data, Failed):
            return [f"Which runbook applies could not be told: {data}"]
        names = list(dict.fromkeys(s["runbook"].removeprefix("runbooks/").removesuffix(".md") for s in data["situations"] if s["severity"] > 0))
        if not names:
            return [
                "No situation that asks for action is active now, so no runbook applies. Runbooks: "
                + ", ".join(records.runbook_names(r.toolbox.runbooks_dir))
                + "."
            ]
        lines.append("Active situations and their runbooks:")
    for name in names:
        data = await r.read("read_runbook", situation=name)
        lines += [f"Runbook {name} could not be read: {data}"] if isinstance(data, Failed) else _runbook_gist(data["situation"], data["runbook"])
    return lines


async def journey_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    lines = []
    for request_id in q.request_ids:
        j = await r.read("request_journey", request_id=request_id)
        if isinstance(j, Failed):
            lines.append(f"- {request_id}: {j}")
            continue
        handoff = (j.get("handoff") or {}).get("mode") if isinstance(j.get("handoff"), dict) else j.get("handoff")
        lines.append(
            f"- {request_id}: {j.get('pipeline')} ({j.get('mode')}), {j.get('prompt_tokens')} prompt tokens (hits {j.get('hit_tokens')}), "
            f"{j.get('completion_tokens')} completion tokens, TTFT {j.get('ttft_ms')} ms, worst gap {j.get('max_gap_ms')} ms, "
            f"handoff {handoff or 'none'}, error {j.get('error') or 'none'}"
        )
    return lines


async def requests_lines(q: Question, r: Reader, config: PDDConfig) -> list[str]:
    data = await r.read("recent_requests", limit=50)
    if isinstance(data, Failed):
        return [f"Recent requests could not be read: {data}"]
    js = data["requests"]
    if not js:
        return ["The journal holds no request yet."]
    by: dict[str, int] = {}
    for j in js:
        by[str(j.get("pipeline"))] = by.get(str(j.get("pipeline")), 0) + 1
    lines = [f"The last {len(js)} requests: " + ", ".join(f"{p} {n}" for p, n in sorted(by.items())) + "."]
    for field, what in (("ttft_ms", "slowest first token"), ("max_gap_ms", "worst gap")):
        timed = [j for j in js if j.get(field) is not None]
        if timed:
            worst = max(timed, key=lambda j: j[field])
            lines.append(f"- {what}: {worst['request_id']} ({worst.get('pipeline')}) {worst[field]} ms")
    errors = [j["request_id"] for j in js if j.get("error")]
    lines.append(f"- errors: {len(errors)}" + (f" ({', '.join(errors[:5])})" if errors else ""))
    return lines

"""The chat agent's tools: every one reads, none writes.

PromQL (named templates or raw, against the real Prometheus), the cluster's
state, one request's journey, recent requests, the agents' recent actions, a
runbook, the agents' diagnosis now (their own checks on a fresh snapshot),
and the digital twin's what-if when the twin ships one
(agents/whatif.py's interface). Each call yields the data the model sees
(fenced, agents/chatops/evidence.py) and the figures the answer will cite.
Filing a proposal is not among them: it lives in agents/chatops/propose.py
and only the graph's proposal step, driven by the operator's message, reaches it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.tools import BaseTool, StructuredTool
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from pydantic import BaseModel, Field

from agents.chatops import records
from agents.chatops.evidence import Figure, as_data, clip, number
from agents.chatops.sources import DataSource, SourceError, live_values
from agents.chatops.templates import Template, catalogue
from agents.diagnose import diagnose
from agents.whatif import WhatIf, predict
from app.config import PDDConfig
from app.telemetry.snapshot import ObserveError, Snapshot

MAX_SERIES = 40
JOURNEY_FIELDS = (
    "request_id",
    "mode",
    "pipeline",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "max_gap_ms",
    "duration_ms",
    "hit_tokens",
    "handoff",
    "error",
)


class ToolFailed(RuntimeError):
    """A tool could not answer; the model is told why (as data) and no figure is recorded."""


@dataclass
class ToolOutput:
    data: Any
    figures: list[Figure]


class PromQuery(BaseModel):
    query: str = Field(description="A template name from the list, or a PromQL instant query")


class JourneyQuery(BaseModel):
    request_id: str = Field(description="The request id (the `id` of a completion, e.g. chatcmpl-...)")


class Limit(BaseModel):
    limit: int = Field(10, ge=1, le=100, description="How many, newest first")


class RunbookQuery(BaseModel):
    situation: str = Field(description="The situation's name, e.g. rld_overload, wan_degradation")


class WhatIfQuery(BaseModel):
    replicas: dict[str, int] = Field(
        default_factory=dict, description="Role -> replica count to try (prefill, relay_decode, main_decode); roles left out keep today's count"
    )
    load_rps: float = Field(gt=0, description="Requests per second to simulate")


class NoArgs(BaseModel):
    pass


class _Series(TypedDict):
    labels: dict[str, str]
    value: float | None


def _labels(metric: dict[str, str]) -> str:
    return ",".join(f"{k}={clip(v, 120)}" for k, v in sorted(metric.items()) if k != "__name__") or "(no labels)"


def state_summary(state: dict[str, Any]) -> str:
    roles = []
    for role, info in (state.get("roles") or {}).items():
        live = len(info.get("replicas") or [])
        roles.append(f"{role} {live} live of {info.get('configured_replicas')} configured ({info.get('datacenter')})")
    parts = [f"mode {state.get('mode')}", "; ".join(roles), f"in flight {state.get('in_flight')}"]
    recent = ((state.get("slo") or {}).get("recent") or {}).get("by_pipeline") or {}
    for pipeline, figs in recent.items():
        ttft = (figs.get("ttft_ms") or {}).get("p99")
        parts.append(f"{pipeline}: {figs.get('requests')} requests, TTFT p99 {ttft} ms")
    return clip("; ".join(p for p in parts if p))


def journey_summary(j: dict[str, Any]) -> dict[str, Any]:
    return {k: j.get(k) for k in JOURNEY_FIELDS if k in j}


class Toolbox:
    """The read-only tools over one data source, one Prometheus and the agents' records."""

    def __init__(
        self,
        *,
        config: PDDConfig,
        source: DataSource,
        prometheus_url: str,
        named: dict[str, Template],
        audit_db: str | Path,
        actions_dir: Path,
        runbooks_dir: Path = records.RUNBOOKS,
        what_if: WhatIf | None = None,
        observe: Callable[[float], Snapshot] | None = None,
        prometheus_timeout_s: float = 15.0,
    ):
        self.config = config
        self.source = source
        self.prometheus_url = prometheus_url
        self.prom = PrometheusConnect(url=prometheus_url, disable_ssl=True)
        self.prometheus_timeout_s = prometheus_timeout_s
        self.named = named
        self.audit_db = audit_db
        self.actions_dir = actions_dir
        self.runbooks_dir = runbooks_dir
        self.what_if = what_if
        self.observe = observe
        self._tools = {t.name: t for t in self._build()}

    @property
    def tools(self) -> list[BaseTool]:
        return list(self._tools.values())

    async def run(self, name: str, args: dict[str, Any]) -> tuple[str, list[Figure]]:
        """The tool message content (fenced data) and the figures; a failure or a refusal is data too."""
        tool = self._tools.get(name)
        if tool is None:
            refusal = f"'{name}' is not an available tool. Chat-ops only reads; available: {', '.join(self._tools)}."
            return as_data("refused", {"error": refusal}), []
        try:
            out: ToolOutput = await tool.ainvoke(args)
        except (ToolFailed, SourceError) as err:
            return as_data(name, {"error": str(err)}), []
        except ValueError as err:  # arguments that do not fit the tool's schema
            return as_data(name, {"error": f"bad arguments: {clip(str(err))}"}), []
        return as_data(name, out.data), out.figures

    # ---- the tools ---------------------------------------------------------------

    async def prometheus_query(self, query: str) -> ToolOutput:
        template = self.named.get(query.strip())
        promql = template.promql if template else query.strip()
        try:
            result = await asyncio.to_thread(self.prom.custom_query, promql, timeout=self.prometheus_timeout_s)
        except PrometheusApiClientException as err:
            raise ToolFailed(f"Prometheus refused the query: {clip(str(err))}") from err
        except OSError as err:
            raise ToolFailed(f"Prometheus at {self.prometheus_url} unreachable: {clip(str(err))}") from err
        if result and not isinstance(result[0], dict):  # a scalar: [time, "value"]
            result = [{"metric": {}, "value": result}]
        series: list[_Series] = []
        for sample in result[:MAX_SERIES]:
            metric = {k: clip(str(v), 200) for k, v in (sample.get("metric") or {}).items()}
            # a range selector returns "values"; its newest point stands for the series
            point = sample.get("value") or (sample.get("values") or [[None, "NaN"]])[-1]
            raw = float(point[1])
            series.append({"labels": metric, "value": number(raw) if math.isfinite(raw) else None})
        data: dict[str, Any] = {"query": template.name if template else promql, "promql": promql, "series": series}
        if len(result) > MAX_SERIES:
            data["more_series_not_shown"] = len(result) - MAX_SERIES
        shown = "; ".join(f"{_labels(s['labels'])}: {s['value']}" for s in series) or "no data"
        return ToolOutput(data, [Figure(source="prometheus", name=template.name if template else None, query=promql, value=clip(shown))])

    async def cluster_state(self) -> ToolOutput:
        state = await self.source.state()
        return ToolOutput(state, [Figure(source="state", query="GET /pdd/state", value=state_summary(state))])

    async def request_journey(self, request_id: str) -> ToolOutput:
        journey = await self.source.journey(request_id)
        if journey is None:
            raise ToolFailed(f"no request '{request_id}' in the journal (it keeps the most recent requests only)")
        brief = journey_summary(journey)
        return ToolOutput(
            journey, [Figure(source="journey", query=f"GET /pdd/requests/{request_id}", value=clip(", ".join(f"{k}={v}" for k, v in brief.items())))]
        )

    async def recent_requests(self, limit: int = 10) -> ToolOutput:
        journeys = [journey_summary(j) for j in await self.source.recent_requests(limit)]
        value = f"{len(journeys)} requests" + (f", newest {journeys[-1].get('request_id')}" if journeys else "")
        return ToolOutput({"requests": journeys}, [Figure(source="requests", query=f"GET /pdd/requests?limit={limit}", value=value)])

    async def agent_actions(self, limit: int = 10) -> ToolOutput:
        ticks = await asyncio.to_thread(records.recent_ticks, self.audit_db, limit)
        entries = await asyncio.to_thread(records.recent_entries, self.actions_dir, limit)
        pending = (await asyncio.to_thread(records.agent_memory, self.audit_db)).pending
        data = {"ticks": ticks, "action_entries": entries, "pending": pending}
        value = f"{len(ticks)} ticks, {len(entries)} action entries, {len(pending)} awaiting approval" + (
            f", newest entry {entries[0]['file']}" if entries else ""
        )
        return ToolOutput(data, [Figure(source="audit", query=f"{self.audit_db} + {self.actions_dir}", value=value)])

    async def read_runbook(self, situation: str) -> ToolOutput:
        text = records.read_runbook(situation, self.runbooks_dir)
        if text is None:
            raise ToolFailed(f"no runbook for '{situation}'; runbooks: {', '.join(records.runbook_names(self.runbooks_dir))}")
        name = "_".join(situation.strip().lower().replace("-", " ").split())
        return ToolOutput(
            {"situation": name, "runbook": text}, [Figure(source="runbook", query=f"runbooks/{name}.md", value=f"{len(text.splitlines())} lines")]
        )

    async def diagnosis(self) -> ToolOutput:
        """The agents' own checks (agents/diagnose.py) on a fresh snapshot, with their streaks so far."""
        assert self.observe is not None
        now = time.time()
        try:
            snap = await asyncio.to_thread(self.observe, now)
        except ObserveError as err:
            raise ToolFailed(str(err)) from err
        knobs, _ = live_values(await self.source.state())
        memory = await asyncio.to_thread(records.agent_memory, self.audit_db)
        found, _ = diagnose(snap, self.config, self.config.agents, knobs, memory, now)
        situations = [
            {
                "situation": s.key,
                "summary": s.summary,
                "severity": s.severity,
                "specialists": s.specialists,
                "runbook": f"runbooks/{s.name}.md",
                "evidence": [e.model_dump(exclude_defaults=True) for e in s.evidence],
            }
            for s in found
        ]
        value = "; ".join(f"{s.key}: {s.summary}" for s in found) or "no situation"
        query = f"the agents' checks over {len(snap.promql)} Prometheus queries (window {snap.window_s:g} s)"
        return ToolOutput({"situations": situations}, [Figure(source="diagnosis", query=query, value=clip(value))])

    async def twin_what_if(self, load_rps: float, replicas: dict[str, int] | None = None) -> ToolOutput:
        assert self.what_if is not None
        knobs, current = live_values(await self.source.state())
        unknown = set(replicas or {}) - set(current)
        if unknown:
            raise ToolFailed(f"unknown roles {sorted(unknown)}; roles: {sorted(current)}")
        plan = {**current, **(replicas or {})}
        try:
            p = await asyncio.to_thread(predict, self.what_if, self.config, plan, knobs, load_rps)
        except (KeyError, AttributeError, TypeError, ValueError) as err:
            raise ToolFailed(f"the twin could not answer: {clip(str(err))}") from err
        predicted = {"ttft_ms": number(p.ttft_ms), "tpot_ms": number(p.tpot_ms), "gap_ms": number(p.gap_ms)}
        data = {
            "replicas": plan,
            "load_rps": load_rps,
            "predicted": predicted,
            "slo_percentile": self.config.slo.percentile,
        }
        value = f"ttft {predicted['ttft_ms']} ms, tpot {predicted['tpot_ms']} ms, gap {predicted['gap_ms']} ms"
        return ToolOutput(data, [Figure(source="twin", query=f"what_if(replicas={plan}, load_rps={load_rps:g})", value=value)])

    def _build(self) -> list[BaseTool]:
        # (the tool's function, its arguments, what the model reads about it); the name is the function's
        specs: list[tuple[Callable[..., Any], type[BaseModel], str]] = [
            (
                self.prometheus_query,
                PromQuery,
                "Query the cluster's Prometheus (evaluated now). Named templates:\n"
                + catalogue(self.named)
                + "\nTTFT carries no datacenter label: datacenters show in link labels and in cluster_state.",
            ),
            (
                self.cluster_state,
                NoArgs,
                "The cluster's state (GET /pdd/state): mode, roles with replicas per node group and datacenter, live knobs, links, requests in flight, recent SLO figures by pipeline.",
            ),
            (
                self.request_journey,
                JourneyQuery,
                "One request's journey (GET /pdd/requests/{id}): pipeline, prefix hits, KV transfers, handoff, timings.",
            ),
            (self.recent_requests, Limit, "The most recent requests' journeys, summarized (ids, pipeline, TTFT, worst gap, errors)."),
            (
                self.agent_actions,
                Limit,
                "What the ops agents did recently: tick summaries from the audit trail, runbook action entries (situation, evidence, change, outcome) and the proposals awaiting approval (target -> tick).",
            ),
            (self.read_runbook, RunbookQuery, "Read the runbook for a situation. Runbooks: " + ", ".join(records.runbook_names(self.runbooks_dir))),
        ]
        if self.observe is not None:
            specs.append(
                (
                    self.diagnosis,
                    NoArgs,
                    "The ops agents' diagnosis now: each situation (RLD overload, WAN degradation, SLO breaches, ...) with its evidence, the specialists that act on it and its runbook.",
                )
            )
        if self.what_if is not None:
            specs.append(
                (
                    self.twin_what_if,
                    WhatIfQuery,
                    "Ask the digital twin what TTFT, TPOT and worst gap (at the SLO percentile) a replica plan would give at a load.",
                )
            )
        return [StructuredTool.from_function(coroutine=fn, name=fn.__name__, args_schema=schema, description=text) for fn, schema, text in specs]

"""Every metric pdd-serve exports: name, type, labels, meaning. One place.

Metrics go out through Ray's metrics agent (`ray.util.metrics`), so the same
Prometheus scrape that collects Ray Serve's own metrics collects these. Ray
prefixes each name with `ray_` on export (`pdd_requests` is scraped as
`ray_pdd_requests_total`); `prom_name()` gives the scraped name, which
dashboards, rules and agents use.

Every series also carries `application` (the Serve application that recorded
it), like Ray Serve's own metrics: one Ray cluster can run several PDD apps,
and Ray's metrics agent keeps exporting the last values of dead replicas, so
queries must select their application.

Importing this module needs no Ray; the metric objects are created on first use
in the process that records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Latency buckets in seconds, for TTFT, gaps, handoffs and transfers.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
#: Per-output-token latency buckets (TPOT).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Token-count buckets (handoff sizes, relay lengths).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
SLOWDOWN_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


#: The label every PDD series carries besides its spec's own (see the module doc).
APPLICATION_LABEL = "application"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def _spec(name: str, kind: Kind, description: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] | None = None) -> MetricSpec:
    return MetricSpec(name, kind, description, labels, buckets)


REQUESTS = _spec("pdd_requests", "counter", "Requests finished, by mode, pipeline and outcome (ok, error, cancelled).", ("mode", "pipeline", "outcome"))
TTFT = _spec("pdd_ttft_seconds", "histogram", "Time to first token seen by the conductor.", ("pipeline",), LATENCY_BUCKETS)
TPOT = _spec("pdd_tpot_seconds", "histogram", "Mean time per output token after the first, per request.", ("pipeline",), TPOT_BUCKETS)
MAX_GAP = _spec("pdd_max_gap_seconds", "histogram", "Worst inter-token gap of each request (handoffs and transfers show here).", ("pipeline",), LATENCY_BUCKETS)
GAP_ERROR = _spec(
    "pdd_gap_prediction_error_seconds",
    "histogram",
    "How far each P-MD turn's gap (P's first token to MD's) was from the gap routing predicted for it, by link "
    "and direction (under: the gap was longer than predicted; over: shorter). The mean signed error is "
    "(under's _sum - over's _sum) / both _counts.",
    ("link", "direction"),
    LATENCY_BUCKETS,
)
HANDOFF = _spec("pdd_handoff_seconds", "histogram", "RLD -> MD handoff: from the decision to MD's first token.", ("mode",), LATENCY_BUCKETS)
HANDOFF_TOKENS = _spec("pdd_handoff_tokens", "histogram", "Eager tokens MD recomputed at handoff (all steps).", ("mode",), TOKEN_BUCKETS)
KV_BYTES = _spec("pdd_kv_transfer_bytes", "counter", "KV bytes pulled over each link (source datacenter -> destination).", ("link",))
KV_SECONDS = _spec("pdd_kv_transfer_seconds", "histogram", "Duration of each KV pull, by link.", ("link",), LATENCY_BUCKETS)
KV_BLOCKS = _spec("pdd_kv_transfer_blocks", "counter", "KV blocks pulled over each link.", ("link",))
KV_SLOWDOWN = _spec(
    "pdd_kv_transfer_slowdown",
    "histogram",
    "Each WAN pull's time over what the configured link needs for it beside the pulls sharing it, by link "
    "(1: the link as configured; a busy link stays near 1, a slow one rises).",
    ("link",),
    SLOWDOWN_BUCKETS,
)
KV_FAILURES = _spec(
    "pdd_kv_transfer_failures",
    "counter",
    "KV pulls that failed or timed out (the decoder recomputed), by link and reason (the error's type; "
    "LeaseGone: the lease expired while the pull waited, which a full link causes and a broken one does not).",
    ("link", "reason"),
)
KV_LEASE_GONE = "LeaseGone"
"""KV_FAILURES' reason for app.engine.kv.transport.LeaseGone."""
PREFIX_HIT = _spec("pdd_prefix_hit_ratio", "histogram", "Per-request prompt share found in the engine's own prefix cache, by role.", ("role",), RATIO_BUCKETS)
PROMPT_TOKENS = _spec("pdd_prompt_tokens", "counter", "Prompt tokens sent to each role.", ("role",))
CACHED_TOKENS = _spec("pdd_cached_prompt_tokens", "counter", "Prompt tokens each role found in its own prefix cache.", ("role",))
RELAY_TOKENS = _spec("pdd_relay_tokens", "histogram", "Tokens RLD produced for each relayed request.", (), TOKEN_BUCKETS)
SINGULAR = _spec("pdd_singular_requests", "counter", "Requests the singular-traffic filter finished on RLD.")
SLO_VIOLATIONS = _spec("pdd_slo_violations", "counter", "Requests over an SLO target, by pipeline and objective (ttft, tpot, gap).", ("pipeline", "slo"))
FAILOVERS = _spec("pdd_failovers", "counter", "Requests moved mid-stream off a failed engine (extend-decode from the tokens so far).", ("from_role", "to_role"))
LEASES_LIVE = _spec("pdd_kv_leases_live", "gauge", "Prompt KV leases a prefill replica holds for decoders to pull.", ("replica",))
IN_FLIGHT = _spec("pdd_requests_in_flight", "gauge", "Requests the conductor is serving now.", ("replica",))
KNOB = _spec("pdd_knob_value", "gauge", "Current value of each numeric live knob (routing.*, handoff.*).", ("knob",))

ALL: tuple[MetricSpec, ...] = (
    REQUESTS,
    TTFT,
    TPOT,
    MAX_GAP,
    GAP_ERROR,
    HANDOFF,
    HANDOFF_TOKENS,
    KV_BYTES,
    KV_SECONDS,
    KV_BLOCKS,
    KV_SLOWDOWN,
    KV_FAILURES,
    PREFIX_HIT,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    RELAY_TOKENS,
    SINGULAR,
    SLO_VIOLATIONS,
    FAILOVERS,
    LEASES_LIVE,
    IN_FLIGHT,
    KNOB,
)


def prom_name(spec: MetricSpec, suffix: str = "") -> str:
    """The name Prometheus scrapes: Ray's `ray_` prefix, `_total` on counters.

    For histograms pass `_bucket`, `_sum` or `_count`.
    """
    base = f"ray_{spec.name}"
    if spec.kind == "counter":
        return base + "_total"
    return base + suffix


def _application() -> str:
    """The Serve application of this process ("" outside a Serve replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # not in a replica: a benchmark or test recording directly
        return ""


class _Registry:
    """Ray metric objects of this process, created once."""

    def __init__(self) -> None:
        self._objects: dict[str, object] = {}
        self._application = _application()

    def _get(self, spec: MetricSpec):
        obj = self._objects.get(spec.name)
        if obj is None:
            from ray.util import metrics as rm

            tag_keys = (*spec.labels, APPLICATION_LABEL)
            if spec.kind == "counter":
                obj = rm.Counter(spec.name, spec.description, tag_keys=tag_keys)
            elif spec.kind == "gauge":
                obj = rm.Gauge(spec.name, spec.description, tag_keys=tag_keys)
            else:
                obj = rm.Histogram(spec.name, spec.description, boundaries=list(spec.buckets or LATENCY_BUCKETS), tag_keys=tag_keys)
            obj.set_default_tags({APPLICATION_LABEL: self._application})
            self._objects[spec.name] = obj
        return obj

    def inc(self, spec: MetricSpec, value: float = 1.0, **labels: str) -> None:
        if value:
            self._get(spec).inc(value, tags=labels or None)

    def observe(self, spec: MetricSpec, value: float, **labels: str) -> None:
        self._get(spec).observe(value, tags=labels or None)

    def set(self, spec: MetricSpec, value: float, **labels: str) -> None:
        self._get(spec).set(value, tags=labels or None)


_registry: _Registry | None = None


def registry() -> _Registry:
    global _registry
    if _registry is None:
        _registry = _Registry()
    return _registry


def record_journey(journey, slo, outcome: str) -> None:
    """Everything one finished request contributes to the metrics (app/journal.Journey)."""
    r = registry()
    pipeline = journey.pipeline or "none"
    r.inc(REQUESTS, mode=journey.mode, pipeline=pipeline, outcome=outcome)
    if outcome != "ok":
        return
    if journey.ttft_ms is not None:
        r.observe(TTFT, journey.ttft_ms / 1000, pipeline=pipeline)
        if journey.ttft_ms > slo.ttft_ms:
            r.inc(SLO_VIOLATIONS, pipeline=pipeline, slo="ttft")
    tpot = journey.tpot_s
    if tpot is not None:
        r.observe(TPOT, tpot, pipeline=pipeline)
        if tpot * 1000 > slo.tpot_ms:
            r.inc(SLO_VIOLATIONS, pipeline=pipeline, slo="tpot")
    if journey.max_gap_ms is not None and journey.completion_tokens > 1:
        r.observe(MAX_GAP, journey.max_gap_ms / 1000, pipeline=pipeline)
        if journey.max_gap_ms > slo.max_gap_ms:
            r.inc(SLO_VIOLATIONS, pipeline=pipeline, slo="gap")
    predicted = journey.decision.get("predicted_gap_ms")
    if journey.md_gap_ms is not None and predicted is not None:
        error = (journey.md_gap_ms - predicted) / 1000
        r.observe(GAP_ERROR, abs(error), link=journey.decision.get("link", ""), direction="under" if error > 0 else "over")
    record_kv(journey)
    if journey.handoff and journey.handoff.get("mode") != "none":
        mode = journey.handoff["mode"]
        if journey.handoff.get("latency_ms") is not None:
            r.observe(HANDOFF, journey.handoff["latency_ms"] / 1000, mode=mode)
        r.observe(HANDOFF_TOKENS, journey.handoff.get("tokens", 0), mode=mode)
    relay = sum(n for role, n in journey.token_sources if role == "relay_decode")
    if journey.pipeline in ("P-RLD-MD", "P-RLD"):
        r.observe(RELAY_TOKENS, relay)
    if journey.pipeline == "P-RLD":
        r.inc(SINGULAR)


def record_kv(journey) -> None:
    """Prefix hits and KV transfers of a journey not recorded yet.

    Called when the request ends, and again when engine work that outlives it
    (an MD warm-up after the relay finished the request) reports.
    """
    r = registry()
    for role, hit in journey.hit_tokens.items():
        if role in journey.recorded_roles or not journey.prompt_tokens:
            continue
        journey.recorded_roles.add(role)
        r.observe(PREFIX_HIT, min(hit, journey.prompt_tokens) / journey.prompt_tokens, role=role)
        r.inc(PROMPT_TOKENS, journey.prompt_tokens, role=role)
        r.inc(CACHED_TOKENS, min(hit, journey.prompt_tokens), role=role)
    for t in journey.transfers[journey.recorded_transfers :]:
        r.inc(KV_BYTES, t.bytes, link=t.link)
        r.inc(KV_BLOCKS, t.blocks, link=t.link)
        r.observe(KV_SECONDS, t.seconds, link=t.link)
        if t.ok and t.model_seconds:
            r.observe(KV_SLOWDOWN, t.seconds / t.model_seconds, link=t.link)
        if not t.ok:
            r.inc(KV_FAILURES, link=t.link, reason=(t.error or "error").split(":")[0])
    journey.recorded_transfers = len(journey.transfers)


def markdown_table() -> str:
    """The README's metrics table, from the specs above."""
    rows = ["| scraped name | type | labels | meaning |", "|---|---|---|---|"]
    for spec in ALL:
        name = prom_name(spec) if spec.kind != "histogram" else prom_name(spec, "_bucket/_sum/_count")
        rows.append(f"| `{name}` | {spec.kind} | {', '.join(spec.labels) or '-'} | {spec.description} |")
    return "\n".join(rows)

"""Each request's journey (GET /pdd/requests/{id}): pipeline, hits, bytes, handoff, timings."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.engine.token_channel import EngineDelta


@dataclass
class Transfer:
    """One KV pull, as the decoding side's connector reported it."""

    link: str
    """`dc-a->dc-b` style: source datacenter -> destination datacenter."""
    to_role: str
    source: str = ""
    """Address of the prefill replica's node the blocks came from."""
    destination: str = ""
    """Address of the decoder replica's node they went to."""
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """From the pull's start to its last byte."""
    queued_seconds: float = 0.0
    """How long the pull waited for one of the decoder's pull threads before it started."""
    model_seconds: float | None = None
    """What the configured link needs for this pull: its mean latency, and its expected bytes
    sharing the bandwidth with the pulls routed beside it (app.engine.kv.link.LinkShare). None: not
    a pull routing sized (only WAN pulls are)."""
    ok: bool = True
    error: str | None = None


@dataclass
class Journey:
    request_id: str
    mode: str
    prompt_tokens: int
    max_tokens: int
    key_fingerprint: str = ""
    """A hash of the API key that made the request (app/api/auth.py; "" without auth): who may read it."""
    started_at: float = field(default_factory=time.time)
    pipeline: str | None = None
    """Which path the request took: colocated, P-D, P-MD, P-RLD-MD, P-P-MD (no RLD alive), P-RLD (singular)."""
    decision: dict[str, Any] = field(default_factory=dict)
    """The policy's inputs and reason (expected WAN ms, MD hit estimate, ...)."""
    replicas: dict[str, str] = field(default_factory=dict)
    """role -> replica id."""
    hit_tokens: dict[str, int] = field(default_factory=dict)
    """role -> prompt tokens found in that engine's own prefix cache."""
    transfers: list[Transfer] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    """Engines that failed mid-request and where the request went on (at which token)."""
    handoff: dict[str, Any] | None = None
    """mode, point (tokens already sent when MD took over), steps, latency_ms."""
    token_sources: list[list[Any]] = field(default_factory=list)
    """Runs of [role, count] in client order: who produced each token."""
    ttft_ms: float | None = None
    engine_ttft_ms: dict[str, float] = field(default_factory=dict)
    """role -> that engine replica's time from handing the request to vLLM to its
    first token (EngineDelta.engine_ttft_ms). Of `ttft_ms`, what the engines on
    the first token's way did not spend is the serving stack's
    (app/sim/fitting.py `serving_overhead_ms`)."""
    engine_core_ttft_ms: dict[str, float] = field(default_factory=dict)
    """role -> of that engine's `engine_ttft_ms`, the part inside vLLM's engine
    core (queue and steps; EngineDelta.engine_core_ttft_ms), where vLLM timed it."""
    engine_queued_ms: dict[str, float] = field(default_factory=dict)
    """role -> of `engine_core_ttft_ms`, the wait in that engine's queue."""
    decode_ms: float | None = None
    """First to last token."""
    max_gap_ms: float | None = None
    md_gap_ms: float | None = None
    """P-MD: from P's first token to MD's, as the conductor saw them; routing predicted it as
    `decision["predicted_gap_ms"]`."""
    completion_tokens: int = 0
    finish_reason: str | None = None
    outcome: str | None = None
    """ok, error, or cancelled (the client left); None while in flight."""
    error: str | None = None
    finished_at: float | None = None
    recorded_roles: set[str] = field(default_factory=set, repr=False)
    """Bookkeeping of app.telemetry.metrics.record_kv (not part of the journey's story)."""
    recorded_transfers: int = field(default=0, repr=False)

    def note_first_token(self, role: str, delta: EngineDelta, *, replace: bool) -> None:
        """An engine's timing of a request's first token (EngineDelta.engine_ttft_ms
        and its engine-core parts); `replace`: a retried engine's figures win over
        an earlier one's, else the first engine's stay. A delta without a first
        token changes nothing."""
        if delta.engine_ttft_ms is None or (role in self.engine_ttft_ms and not replace):
            return
        for times, value in (
            (self.engine_ttft_ms, delta.engine_ttft_ms),
            (self.engine_core_ttft_ms, delta.engine_core_ttft_ms),
            (self.engine_queued_ms, delta.engine_queued_ms),
        ):
            if value is None:
                times.pop(role, None)
            else:
                times[role] = value

    def note_tokens(self, role: str, count: int) -> None:
        if count <= 0:
            return
        if self.token_sources and self.token_sources[-1][0] == role:
            self.token_sources[-1][1] += count
        else:
            self.token_sources.append([role, count])

    @property
    def tpot_s(self) -> float | None:
        if self.decode_ms is None or self.completion_tokens < 2:
            return None
        return self.decode_ms / 1000 / (self.completion_tokens - 1)

    @property
    def duration_ms(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.started_at) * 1000

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["recorded_roles"], d["recorded_transfers"]
        d["duration_ms"] = self.duration_ms
        return d


#: Journeys kept per conductor replica.
JOURNAL_CAPACITY = 10_000


class Journal:
    """The most recent journeys, bounded so memory stays flat under load."""

    def __init__(self, capacity: int = JOURNAL_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, Journey] = OrderedDict()

    def add(self, journey: Journey) -> Journey:
        self._items[journey.request_id] = journey
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return journey

    def get(self, request_id: str) -> Journey | None:
        return self._items.get(request_id)

    def recent(self, n: int = 100, key_fingerprint: str | None = None) -> list[Journey]:
        """The newest `n`, oldest first; of one key's requests only, given its fingerprint."""
        if key_fingerprint is None:
            return list(self._items.values())[-n:]
        mine = [j for j in reversed(self._items.values()) if j.key_fingerprint == key_fingerprint]
        return mine[:n][::-1]

    def __len__(self) -> int:
        return len(self._items)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 1)


def slo_summary(journeys: list[Journey], slo, window_s: float, now: float | None = None) -> dict[str, Any]:
    """Recent SLO figures by pipeline from finished journeys inside the window."""
    now = time.time() if now is None else now
    recent = [j for j in journeys if j.finished_at is not None and now - j.finished_at <= window_s]
    by_pipeline: dict[str, list[Journey]] = {}
    for j in recent:
        by_pipeline.setdefault(j.pipeline or "none", []).append(j)
    out: dict[str, Any] = {}
    target = f"p{slo.percentile:g}"
    for pipeline, js in sorted(by_pipeline.items()):
        ok = [j for j in js if j.error is None]
        ttft = [j.ttft_ms for j in ok if j.ttft_ms is not None]
        tpot = [j.tpot_s * 1000 for j in ok if j.tpot_s is not None]
        gap = [j.max_gap_ms for j in ok if j.max_gap_ms is not None and j.completion_tokens > 1]
        out[pipeline] = {
            "requests": len(js),
            "errors": len(js) - len(ok),
            # the SLO's own percentile too, so a target at p95 is judged at p95
            "ttft_ms": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99), target: _pct(ttft, slo.percentile)},
            "tpot_ms": {"p50": _pct(tpot, 50), "p90": _pct(tpot, 90), target: _pct(tpot, slo.percentile)},
            "max_gap_ms": {"p50": _pct(gap, 50), "p99": _pct(gap, 99)},
            "slo_violations": {
                "ttft": sum(t > slo.ttft_ms for t in ttft),
                "tpot": sum(t > slo.tpot_ms for t in tpot),
                "gap": sum(g > slo.max_gap_ms for g in gap),
            },
        }
    return {"window_s": window_s, "requests": len(recent), "by_pipeline": out}

"""Running the twin: one run, the goodput search, the hit-rate sweep."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.config import PDDConfig
from app.sim.cluster import PerfArg
from app.sim.report import Summary, summarize
from app.sim.results import RequestResult, Results
from app.sim.outages import Outage
from app.sim.twin import Twin
from app.sim.workload import AgenticWorkload, Request, fixed_hit, read_trace

Workload = AgenticWorkload | Iterable[Request] | str | Path


def requests_of(workload: Workload) -> Iterable[Request]:
    """Requests from a generator's settings, a trace path, or requests as they are."""
    if isinstance(workload, AgenticWorkload):
        return workload.generate()
    if isinstance(workload, (str, Path)):
        return read_trace(workload)
    return workload


@dataclass
class SimRun:
    config: PDDConfig
    results: Results
    delayed_turns: int
    """Turns sent later than scheduled because their conversation's previous turn still ran."""
    events: int

    def records(self) -> list[RequestResult]:
        return self.results.records()

    def summary(self, warmup: float = 0.1) -> Summary:
        return summarize(self.results, self.config, warmup)


def simulate(config: PDDConfig, workload: Workload, perf: PerfArg = None, seed: int = 0,
             progress: Callable[[int], None] | None = None, *, outages: Iterable[Outage] = ()) -> SimRun:
    """Serve `workload` on the cluster `config` describes (its `mode`) and return every request's outcome.

    `outages`: windows in which the WAN is cut or no main decoder is alive (PDD routes around them).
    """
    twin = Twin(config, perf, seed, progress, outages)
    results = twin.run(requests_of(workload))
    return SimRun(config, results, twin.delayed_turns, twin.loop.events)


def scaled(requests: Iterable[Request], factor: float) -> Iterator[Request]:
    """A trace replayed `factor` times faster (arrivals divided by it)."""
    for r in requests:
        yield r._replace(arrival_s=r.arrival_s / factor)


@dataclass
class SearchResult:
    rps: float
    """Highest offered RPS found to meet the SLO (0 when even the lowest probe failed)."""
    summary: Summary | None
    probes: list[tuple[float, float, bool]] = field(default_factory=list)
    """(rps, SLO attainment, met) for every run, in order."""


def goodput_search(config: PDDConfig, workload_at: Callable[[float], Iterable[Request]], *, lo: float = 0.5,
                   rel_tol: float = 0.03, max_runs: int = 20, perf: PerfArg = None, seed: int = 0,
                   warmup: float = 0.1, on_probe: Callable[[float, Summary], None] | None = None) -> SearchResult:
    """Bisection for the highest RPS whose run meets the config's SLO.

    Doubles from `lo` until a run fails (or halves until one meets it, down to
    lo / 64), then bisects (geometrically) until the bracket is within
    `rel_tol`. Every probe replays the same sessions (same seed), only faster
    or slower, so noise between probes stays small.
    """
    out = SearchResult(0.0, None)

    def probe(rps: float) -> bool:
        s = simulate(config, workload_at(rps), perf, seed).summary(warmup)
        ok = s.meets(config.slo)
        out.probes.append((rps, s.slo_attainment, ok))
        if on_probe is not None:
            on_probe(rps, s)
        if ok and rps > out.rps:
            out.rps, out.summary = rps, s
        return ok

    if probe(lo):
        good, bad = lo, None
    else:
        good, bad = None, lo
        while good is None and bad / 2 >= lo / 64 and len(out.probes) < max_runs:
            if probe(bad / 2):
                good = bad / 2
            else:
                bad /= 2
        if good is None:
            return out
    while bad is None and len(out.probes) < max_runs:
        nxt = good * 2
        if probe(nxt):
            good = nxt
        else:
            bad = nxt
    while bad is not None and bad / good > 1 + rel_tol and len(out.probes) < max_runs:
        mid = math.sqrt(good * bad)
        if probe(mid):
            good = mid
        else:
            bad = mid
    return out


def agentic_at(template: AgenticWorkload) -> Callable[[float], Iterable[Request]]:
    return lambda rps: template.with_rps(rps).generate()


@dataclass(frozen=True)
class TimedTraffic:
    """Agentic traffic measured by simulated time, at any load: `warmup_s` seconds
    for the cold start's transient, then `window_s` measured.

    A cluster starts with cold prefix caches. In PDD every live conversation's
    context then crosses the WAN once: at paper_table's scale that is minutes of
    a saturated WAN, and a run counting a share of its arrivals as warm-up
    measured part of it, more of it at higher loads. Runs of fixed simulated
    length put the warm-up where the caches have settled at every load.
    """

    workload: AgenticWorkload
    """Its `requests` and `rps` are set per run."""
    warmup_s: float
    window_s: float

    @property
    def span_s(self) -> float:
        return self.warmup_s + self.window_s

    @property
    def warmup_share(self) -> float:
        """The warm-up as a share of the run (`SimRun.summary`'s `warmup`)."""
        return self.warmup_s / self.span_s

    def at(self, rps: float, seed: int) -> AgenticWorkload:
        """`span_s` seconds of the traffic at `rps`."""
        return self.workload.model_copy(update={"rps": rps, "requests": max(1, round(rps * self.span_s)), "seed": seed})

    def traffic(self, seed: int) -> Callable[[float], Iterable[Request]]:
        """The same sessions at every load (a goodput search's probes differ only in pace)."""
        return lambda rps: self.at(rps, seed).generate()


def hit_sweep(config: PDDConfig, baseline: PDDConfig, template: AgenticWorkload, hits: Iterable[float], *,
              perf: PerfArg = None, seed: int = 0, warmup: float = 0.1,
              on_point: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Benefit against hit rate (the bathtub): for each hit rate of follow-up turns,
    1 - TTFT p90 of `config` / TTFT p90 of `baseline`, at the template's RPS."""
    points = []
    for h in hits:
        w = fixed_hit(template, h)
        mine = simulate(config, w, perf, seed).summary(warmup)
        base = simulate(baseline, w, perf, seed).summary(warmup)
        point = {
            "hit_rate": h,
            "ttft_p90_s": mine.ttft_s[1],
            "baseline_ttft_p90_s": base.ttft_s[1],
            "benefit": 1 - mine.ttft_s[1] / base.ttft_s[1],
            "sla_goodput_rps": mine.sla_goodput_rps,
            "baseline_sla_goodput_rps": base.sla_goodput_rps,
            # past the SLO, latency is queueing and the benefit says more about load than about the design
            "overloaded": float(not (mine.meets(config.slo) and base.meets(baseline.slo))),
        }
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points

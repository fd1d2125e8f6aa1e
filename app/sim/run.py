"""Running the twin: one run, the goodput search, the hit-rate sweep."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from app.config import PDDConfig
from app.sim.cluster import PerfArg
from app.sim.outages import Outage
from app.sim.parallel import run_all
from app.sim.report import Summary, summarize
from app.sim.results import RequestResult, Results
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


def simulate(
    config: PDDConfig,
    workload: Workload,
    perf: PerfArg = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    *,
    outages: Iterable[Outage] = (),
    warm_start: bool = False,
) -> SimRun:
    """Serve `workload` on the cluster `config` describes (its `mode`) and return every request's outcome.

    `outages`: windows in which the WAN is cut or no main decoder is alive (PDD routes around them).
    `warm_start`: conversations under way when the run starts find their context cached where
    routing puts it, as in a cluster that had been serving them (app/sim/twin.py); else caches start cold.
    """
    twin = Twin(config, perf, seed, progress, outages, warm_start)
    results = twin.run(requests_of(workload))
    return SimRun(config, results, twin.delayed_turns, twin.loop.events)


def scaled(requests: Iterable[Request], factor: float) -> Iterator[Request]:
    """A trace replayed `factor` times faster (arrivals divided by it)."""
    for r in requests:
        yield r._replace(arrival_s=r.arrival_s / factor)


def _trace_at(trace: list[Request], base_rps: float, rps: float) -> Iterator[Request]:
    return scaled(trace, rps / base_rps)


def trace_at(trace: list[Request]) -> Callable[[float], Iterable[Request]]:
    """The trace at any mean rate, replayed faster or slower (a function that crosses to other processes)."""
    if len(trace) < 2 or trace[-1].arrival_s <= trace[0].arrival_s:
        raise ValueError("the trace's requests all arrive at one time: it has no rate to replay faster or slower")
    return partial(_trace_at, trace, len(trace) / (trace[-1].arrival_s - trace[0].arrival_s))


@dataclass
class SearchResult:
    rps: float
    """Highest offered RPS found to meet the SLO (0 when even the lowest probe failed)."""
    summary: Summary | None
    probes: list[tuple[float, float, bool]] = field(default_factory=list)
    """(rps, SLO attainment, met) for every run, in order."""


def grid_search(meets: Callable[[int], bool], start: int, *, double: int, floor: int, max_runs: int, confirm: int) -> int | None:
    """Step k of the highest load meeting the SLO on a geometric grid of loads, or None.

    Doubles (`double` steps) from `start` until a load fails, or halves until one
    meets the SLO (down to `floor`), then bisects. Near its knee a run's SLO
    attainment is not monotone in the load (which sessions overlap shifts with
    the pace), so bisection alone lands on whichever passing island its probes
    hit first. The answer is the highest load meeting the SLO with every lower
    load probed meeting it too, and the `confirm` loads just below it probed:
    an answer no longer depends on where the search started unless an island
    of `confirm` + 1 passing loads lies above a failing one.
    """
    seen: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in seen:
            seen[k] = meets(k)
        return seen[k]

    def room() -> bool:
        return len(seen) < max_runs

    good: int | None = start if ok(start) else None
    bad: int | None = None if good is not None else start
    while good is None and bad is not None and bad - double >= floor and room():  # bad is the failing load while good is None
        if ok(bad - double):
            good = bad - double
        else:
            bad -= double
    if good is None:
        return None
    while bad is None and room():
        if ok(good + double):
            good += double
        else:
            bad = good + double
    while bad is not None and bad - good > 1 and room():
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    # walk down until `confirm` loads in a row below the latest answer met the SLO
    k, streak = good - 1, 0
    while streak < confirm and k >= floor and room():
        streak = streak + 1 if ok(k) else -1
        k -= 1
    lowest_failure = min((k for k, met in seen.items() if not met), default=math.inf)
    return max((k for k, met in seen.items() if met and k < lowest_failure), default=None)


def goodput_search(
    config: PDDConfig,
    workload_at: Callable[[float], Iterable[Request]],
    *,
    lo: float = 0.5,
    rel_tol: float = 0.03,
    max_runs: int = 24,
    confirm: int = 2,
    perf: PerfArg = None,
    seed: int = 0,
    warmup: float = 0.1,
    on_probe: Callable[[float, Summary], None] | None = None,
    warm_start: bool = False,
) -> SearchResult:
    """The highest RPS whose run meets the config's SLO (`grid_search`).

    Loads lie on the grid (1 + rel_tol)^k RPS, the same for every search, so
    searches from different starts probe the same loads and get the same runs
    there (the twin is deterministic for a seed). The search
    starts at the grid load at or below `lo` and goes down to lo / 64. Every
    probe replays the same sessions (same seed), only faster or slower, so
    noise between probes stays small. `warm_start` as in `simulate`.
    """
    for name, value in (("lo", lo), ("rel_tol", rel_tol)):
        if not value > 0:
            raise ValueError(f"goodput_search: {name} must be > 0, got {value}")
    step = math.log1p(rel_tol)
    out = SearchResult(0.0, None)
    summaries: dict[int, Summary] = {}

    def meets(k: int) -> bool:
        rps = math.exp(k * step)
        s = simulate(config, workload_at(rps), perf, seed, warm_start=warm_start).summary(warmup)
        ok = s.meets(config.slo)
        summaries[k] = s
        out.probes.append((rps, s.slo_attainment, ok))
        if on_probe is not None:
            on_probe(rps, s)
        return ok

    start = math.floor(math.log(lo) / step + 1e-9)
    found = grid_search(
        meets, start, double=max(1, round(math.log(2) / step)), floor=start - math.ceil(math.log(64) / step), max_runs=max_runs, confirm=confirm
    )
    if found is not None:
        out.rps, out.summary = math.exp(found * step), summaries[found]
    return out


def _agentic_at(template: AgenticWorkload, rps: float) -> Iterator[Request]:
    return template.with_rps(rps).generate()


def agentic_at(template: AgenticWorkload) -> Callable[[float], Iterable[Request]]:
    """The template's sessions at any rate (a function that crosses to other processes)."""
    return partial(_agentic_at, template)


@dataclass(frozen=True)
class TimedTraffic:
    """Agentic traffic measured by simulated time, at any load: `warmup_s` seconds
    of traffic, then `window_s` measured.

    Runs start warm by default: conversations under way find their contexts
    where routing puts them (app/sim/twin.py), as in a cluster that had been
    serving them, so a search finds the load a running cluster sustains. From
    a cold start (`warm_start=False`) every live conversation's context is
    recomputed and, in PDD, crosses the WAN once: at paper_table's scale that
    is minutes of a saturated WAN, and near a fleet's peak the turns it queues
    come back in a burst, so such a search finds the highest load a cold fleet
    settles at within `warmup_s`, below what a warm one sustains.
    """

    workload: AgenticWorkload
    """Its `requests` and `rps` are set per run."""
    warmup_s: float
    window_s: float
    warm_start: bool = field(default=True, kw_only=True)
    jobs: int | None = field(default=1, kw_only=True)
    """Processes for `searches` and `summaries` (app/sim/parallel.py; None: every CPU): the figures are the same for any number."""

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
        return partial(_timed_at, self, seed)

    def run(self, config: PDDConfig, rps: float, seed: int) -> SimRun:
        """`span_s` seconds of the traffic at `rps` on `config` (its figures: `.summary(self.warmup_share)`)."""
        return simulate(config, self.at(rps, seed), seed=seed, warm_start=self.warm_start)

    def search(self, config: PDDConfig, seed: int, *, lo: float, rel_tol: float = 0.03) -> SearchResult:
        """`goodput_search` over this traffic, its window measured."""
        return goodput_search(config, self.traffic(seed), lo=lo, rel_tol=rel_tol, seed=seed, warmup=self.warmup_share, warm_start=self.warm_start)

    def searches(
        self, searches: Iterable[tuple[PDDConfig, int, float]], on_done: Callable[[int, SearchResult], None] | None = None, *, rel_tol: float = 0.03
    ) -> list[SearchResult]:
        """`search` for each (config, seed, lo), on `jobs` processes, in order; `on_done(index, result)` as each ends."""
        return run_all(partial(_search_of, self, rel_tol=rel_tol), searches, jobs=self.jobs, on_done=on_done)

    def summaries(self, runs: Iterable[tuple[PDDConfig, float, int]], on_done: Callable[[int, Summary], None] | None = None) -> list[Summary]:
        """The measured window's figures of `run` for each (config, rps, seed), on `jobs` processes, in order;
        `on_done(index, summary)` as each ends."""
        return run_all(partial(_window_of, self), runs, jobs=self.jobs, on_done=on_done)


def _search_of(traffic: TimedTraffic, search: tuple[PDDConfig, int, float], rel_tol: float) -> SearchResult:
    config, seed, lo = search
    return traffic.search(config, seed, lo=lo, rel_tol=rel_tol)


def _window_of(traffic: TimedTraffic, run: tuple[PDDConfig, float, int]) -> Summary:
    config, rps, seed = run
    return traffic.run(config, rps, seed).summary(traffic.warmup_share)


def _timed_at(traffic: TimedTraffic, seed: int, rps: float) -> Iterator[Request]:
    return traffic.at(rps, seed).generate()


def _summary_of(run: tuple[PDDConfig, Workload, PerfArg, int, bool, float]) -> Summary:
    config, workload, perf, seed, warm_start, warmup = run
    return simulate(config, workload, perf, seed, warm_start=warm_start).summary(warmup)


def hit_sweep(
    config: PDDConfig,
    baseline: PDDConfig,
    template: AgenticWorkload,
    hits: Iterable[float],
    *,
    perf: PerfArg = None,
    seed: int = 0,
    warmup: float = 0.1,
    on_point: Callable[[dict[str, float]], None] | None = None,
    warm_start: bool = False,
    jobs: int | None = 1,
) -> list[dict[str, float]]:
    """Benefit against hit rate (the bathtub): for each hit rate of follow-up turns,
    1 - TTFT p90 of `config` / TTFT p90 of `baseline`, at the template's RPS (`warm_start` as in `simulate`).
    Its runs go on `jobs` processes (None: every CPU; app/sim/parallel.py); `on_point` as each point completes."""
    hits = list(hits)
    runs = [(c, fixed_hit(template, h), perf, seed, warm_start, warmup) for h in hits for c in (config, baseline)]
    done: dict[int, Summary] = {}

    def point(k: int) -> dict[str, float]:
        mine, base = done[2 * k], done[2 * k + 1]
        return {
            "hit_rate": hits[k],
            "ttft_p90_s": mine.ttft_s[1],
            "baseline_ttft_p90_s": base.ttft_s[1],
            "benefit": 1 - mine.ttft_s[1] / base.ttft_s[1],
            "sla_goodput_rps": mine.sla_goodput_rps,
            "baseline_sla_goodput_rps": base.sla_goodput_rps,
            # past the SLO, latency is queueing and the benefit says more about load than about the design
            "overloaded": float(not (mine.meets(config.slo) and base.meets(baseline.slo))),
        }

    def finished(i: int, summary: Summary) -> None:
        done[i] = summary
        if on_point is not None and (i ^ 1) in done:
            on_point(point(i // 2))

    run_all(_summary_of, runs, jobs=jobs, on_done=finished)
    return [point(k) for k in range(len(hits))]

"""The agent swarm tunes the digital twin from bad knobs and ratios; a bounded sweep says how close it gets.

Cluster and traffic: serve_configs/gpu_h100_h200.yaml (`--config`) and
bench/paper_table.py's 64K-context, ~90%-hit agentic workload. Budget: what
the config file's fleet costs (`--budget`); every fleet here stays within it
and within each role's max_replicas, and the agents get it as
`agents.max_cost_per_hour`. Offered load: `--load-share` (0.9) of the SLA
goodput of the config file's own fleet and knobs, the load that fleet is
sized for (`--rps` to fix it). The agents' intent (knobs and replicas they return
toward once a situation clears) is the bad start itself, as when the operator's
mistake is in the file (`--intent file`: the config file's).
Every number derived from the config is printed at the start.

Agents. The start is deliberately bad (`--start...`): half the file's prefill
replicas, one relay replica more, main decode filling the rest of the budget
(prefill starved, decode over-provisioned); the WAN threshold at its upper
bound (every request on P-MD) and forced catch-up handoff at the lowest
catch-up threshold; the relay cap as the file has it (`--start-cap`). Each tick simulates the offered traffic with the current
knobs and replicas from a warm start (app/sim/twin.py; `--cold-start` for cold
caches), `--warmup-s` of warm-up, then the agents' evaluation window
`slo.window_s`, turns the window into the agents' Snapshot (agents/twin.py
`snapshot_from_run`: the figures the real Prometheus queries give) and runs
the real tick graph once (TwinAgent, act mode: diagnose, specialists, guard,
cooldowns, verify and rollback), with the capacity specialist's what-ifs
answered by the twin on other traffic of the same kind (another seed;
`--no-what-if` for the rule-based path). Simulated time advances
`agents.tick_s` per tick. The same knobs and replicas replay the same traffic,
so a tick that changes nothing reuses its run. Converged: no change (rollbacks
included) for `--stable` ticks in a row; ticks to converge counts the ticks up
to the last change.

Sweep (the reference). Fleets: every P:RLD:MD within the budget and the role
bounds that cannot afford one more replica of any role. Stage 1 screens every
fleet x WAN threshold at the offered load; fleets rank by their best point (SLO
attainment, then SLO score). Stage 2 screens each fleet's best point x handoff
mode x relay cap (`--finalists N`: only the N best fleets'), and each fleet's
best screened configuration gets a goodput search: the finals rank by peak
goodput, as the figure does, not by attainment at the offered load (below the
knee nearly every fleet meets the SLO there, and the ranking said little about
headroom: it once left out a fleet with 1.22x the finalists' best). One
finalist per fleet: one fleet's knob variants would otherwise fill the finals. The agents' other knobs (catch-up
threshold, min hit rate, singular filter) stay at the config's values.

SLA goodput (the paper's): the highest offered RPS whose run meets the SLO at
its percentile (app.sim.run.goodput_search, the same sessions replayed faster
or slower, each probe with the same warm-up and window). Also reported:
goodput at the offered load (requests/s of the window that met every target).
Figures are medians over `--seeds` traffic seeds; the agents run once per
seed; the load, the screening and the best finalist come from the first.
goodput_vs_best = the agents' final SLA goodput / the best known: the best
finalist's, or the start's or the config file's where one of them beats it
(agents that worsen a start better than the sweep's best must show it).

Runs and searches that do not wait on each other (a stage's screens, the
goodput searches) go on `--jobs` processes, and so do the seeds' agents (a
seed's ticks run in turn; each process remembers its own runs, so the count of
simulations grows); the figures are the same for any number.

Default run: 3 seeds, a few hundred simulated runs of ~750 simulated seconds;
minutes on two cores (the wall time is printed). Bigger: more `--seeds`,
`--finalists`, `--thresholds`, `--caps`, a longer `--warmup-s`.

    python bench/agents_tuning.py [--seeds 3] [--rps R] [--budget USD_PER_H] [--jobs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from agents.controllers import fleet_cost
from agents.figures import slo_figures, slo_score
from agents.knobs import with_knobs
from agents.twin import TwinAgent, TwinWhatIf, fleet_config, snapshot_from_run
from app.config import LiveKnobs, PDDConfig, RoleName
from app.config.file import load_config
from app.ops import progress
from app.sim import SimRun, Summary
from app.sim.parallel import check_jobs, run_all
from app.sim.run import TimedTraffic
from bench.common import ROOT, median, write_outputs
from bench.paper_table import WARMUP_S, WORKLOAD

console = Console(width=180)
CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"
ROLES = (RoleName.prefill, RoleName.relay_decode, RoleName.main_decode)
SHORT = {RoleName.prefill: "P", RoleName.relay_decode: "RLD", RoleName.main_decode: "MD"}
THRESHOLD = "routing.max_wan_transfer_ms"
CATCH_UP = "handoff.catch_up_threshold_tokens"
CAP = "handoff.relay_cap_tokens"
#: What-if traffic: the same kind as the cluster's, other sessions (seed offset).
WHAT_IF_SEED = 100
#: Goodput searches start here and double: the same probes whatever the offered load.
SEARCH_FROM_RPS = 1.0


@dataclass(frozen=True)
class Setup(TimedTraffic):
    """The offered traffic (`span_s` seconds of it per run) and the agents' config."""

    config: PDDConfig
    """The agents' config: the file's, with the budget as agents.max_cost_per_hour."""
    rps: float


@dataclass(frozen=True)
class Point:
    """Replica counts and knobs: one configuration of the fleet."""

    replicas: tuple[int, int, int]
    knobs: LiveKnobs

    @property
    def fleet(self) -> dict[str, int]:
        return {r.value: n for r, n in zip(ROLES, self.replicas)}

    def key(self) -> str:
        return json.dumps([self.replicas, self.knobs.model_dump(mode="json")], sort_keys=True)

    def describe(self) -> str:
        k = self.knobs
        return (
            f"{self.replicas[0]}P:{self.replicas[1]}RLD:{self.replicas[2]}MD, {k.routing.max_wan_transfer_ms:g} ms, "
            f"{k.handoff.mode.value}/{k.handoff.catch_up_threshold_tokens}/{k.handoff.relay_cap_tokens}"
        )


def point_of(replicas: dict[str, int], knobs: LiveKnobs) -> Point:
    return Point(tuple(replicas[r.value] for r in ROLES), knobs)


class Twin:
    """Simulated runs of points, remembered: the same point and seed replay the same traffic."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.runs: dict[tuple[str, int], SimRun] = {}
        self.searches: dict[tuple[str, int], float] = {}
        self.sims = 0

    def run(self, point: Point, seed: int) -> SimRun:
        key = (point.key(), seed)
        if key not in self.runs:
            s = self.setup
            self.runs[key] = s.run(fleet_config(s.config, point.fleet, point.knobs), s.rps, seed)
            self.sims += 1
        return self.runs[key]

    def summary(self, point: Point, seed: int) -> Summary:
        return self.run(point, seed).summary(self.setup.warmup_share)

    def goodput(self, point: Point, seed: int, rel_tol: float) -> float:
        """SLA goodput: the highest RPS meeting the SLO (goodput_search)."""
        self.prefetch_goodput([(point, seed)], rel_tol)
        return self.searches[(point.key(), seed)]

    def prefetch(self, wanted: Iterable[tuple[Point, int]]) -> None:
        """Simulate the (point, seed) runs not remembered yet, on the setup's `jobs` processes."""
        missing = _missing(wanted, self.runs)
        s = self.setup
        with progress.steps(console, "simulations", len(missing)) as step:
            done = run_all(
                partial(_run_of, s),
                [(fleet_config(s.config, p.fleet, p.knobs), seed) for _, (p, seed) in missing],
                jobs=s.jobs,
                on_done=lambda i, _: step(f"{missing[i][1][0].describe()}, seed {missing[i][1][1]}"),
            )
        self.runs.update((key, run) for (key, _), run in zip(missing, done))
        self.sims += len(missing)

    def prefetch_goodput(self, wanted: Iterable[tuple[Point, int]], rel_tol: float) -> None:
        """Goodput searches of the (point, seed) pairs not searched yet, on the setup's `jobs` processes."""
        missing = _missing(wanted, self.searches)
        s = self.setup
        with progress.steps(console, "goodput searches", len(missing)) as step:
            found = s.searches(
                [(fleet_config(s.config, p.fleet, p.knobs), seed, SEARCH_FROM_RPS) for _, (p, seed) in missing],
                rel_tol=rel_tol,
                on_done=lambda i, r: step(f"{missing[i][1][0].describe()}, seed {missing[i][1][1]}: {r.rps:.2f} RPS"),
            )
        for (key, _), result in zip(missing, found):
            self.searches[key] = result.rps
            self.sims += len(result.probes)


def _missing(wanted: Iterable[tuple[Point, int]], known: dict[tuple[str, int], Any]) -> list[tuple[tuple[str, int], tuple[Point, int]]]:
    """(key, (point, seed)) of each wanted pair not in `known`, once each, in order."""
    return list({(p.key(), seed): (p, seed) for p, seed in wanted if (p.key(), seed) not in known}.items())


def _run_of(setup: Setup, run: tuple[PDDConfig, int]) -> SimRun:
    config, seed = run
    return setup.run(config, setup.rps, seed)


# ---- the agents --------------------------------------------------------------------------


@dataclass
class Tick:
    tick: int
    t_s: float
    point: Point
    figures: dict[str, float]
    """Figure at the SLO percentile / its target (ttft, tpot, gap)."""
    attainment: float
    goodput_at_load: float
    situations: list[str]
    changes: list[str]
    rollbacks: list[str]

    def row(self, config: PDDConfig) -> dict[str, Any]:
        k = self.point.knobs
        return {
            "tick": self.tick,
            "t_s": self.t_s,
            **{SHORT[r]: n for r, n in zip(ROLES, self.point.replicas)},
            "cost_per_hour": fleet_cost(config, self.point.fleet),
            "max_wan_transfer_ms": k.routing.max_wan_transfer_ms,
            "handoff_mode": k.handoff.mode.value,
            "catch_up_threshold": k.handoff.catch_up_threshold_tokens,
            "relay_cap": k.handoff.relay_cap_tokens,
            "min_hit_rate": k.routing.min_hit_rate,
            **{f"{name}_vs_slo": v for name, v in self.figures.items()},
            "slo_attainment": self.attainment,
            "goodput_at_load_rps": self.goodput_at_load,
            "situations": " ".join(self.situations),
            "changes": "; ".join(self.changes),
            "rollbacks": "; ".join(self.rollbacks),
        }


@dataclass
class AgentRun:
    seed: int
    ticks: list[Tick] = field(default_factory=list)
    converged: bool = False

    @property
    def final(self) -> Point:
        return self.ticks[-1].point

    @property
    def ticks_to_converge(self) -> int | None:
        """Ticks up to and including the last change (0: nothing changed); None when it never settled."""
        if not self.converged:
            return None
        changed = [t.tick for t in self.ticks if t.changes]
        return changed[-1] + 1 if changed else 0


def run_agents(twin: Twin, start: Point, seed: int, *, max_ticks: int, stable: int, what_if: bool, intent_is_start: bool) -> AgentRun:
    setup = twin.setup
    config = setup.config
    oracle = None
    if what_if:
        oracle = TwinWhatIf(
            setup.traffic(seed + WHAT_IF_SEED), window_s=setup.window_s, end_s=setup.span_s, seed=seed + WHAT_IF_SEED, warm_start=setup.warm_start
        )
    agent = TwinAgent(fleet_config(config, start.fleet, start.knobs) if intent_is_start else config, what_if=oracle)
    out = AgentRun(seed)
    point, quiet = start, 0
    for k in range(max_ticks):
        now = k * config.agents.tick_s
        run = twin.run(point, seed)
        snap = snapshot_from_run(run, config, now, window_s=setup.window_s, end_s=setup.span_s)
        summary = run.summary(setup.warmup_share)
        result = agent.tick(snap, knobs=point.knobs, replicas=point.fleet)
        out.ticks.append(
            Tick(
                tick=k,
                t_s=now,
                point=point,
                figures=slo_figures(snap, config.slo),
                attainment=summary.slo_attainment,
                goodput_at_load=float(summary.sla_goodput_rps),
                situations=[s.key + ("" if s.severity else "(ok)") for s in result.situations],
                changes=[c.describe() for c in result.changes],
                rollbacks=[c.describe() for c in result.rollbacks],
            )
        )
        point = point_of(result.replicas, result.knobs)
        quiet = 0 if result.changes else quiet + 1
        if quiet >= stable:
            out.converged = True
            break
    return out


def _agents_alone(setup: Setup, seed: int, *, start: Point, **options: Any) -> tuple[AgentRun, int]:
    """`run_agents` on another process, with runs of its own to remember: (the run, its simulations)."""
    twin = Twin(setup)
    return run_agents(twin, start, seed, **options), twin.sims


def show_ticks(run: AgentRun, config: PDDConfig, rps: float) -> None:
    """One row per tick with a change or a new situation; stretches where nothing moved are folded."""
    t = Table(title=f"agents on the twin, seed {run.seed}: {rps:g} RPS offered (figures: value / SLO target at p{config.slo.percentile:g})")
    for col in ("tick", "min", "P:RLD:MD", "$/h", "WAN thr ms", "handoff", "cap", "TTFT", "TPOT", "gap", "in SLO", "goodput", "situations", "changes"):
        t.add_column(col, justify="left" if col in ("situations", "changes", "handoff") else "right", overflow="fold")

    def add(tick: Tick, label: str) -> None:
        k = tick.point.knobs
        fig = {name: f"{v:.2f}" + ("" if v <= 1 else " !") for name, v in tick.figures.items()}
        changes = "; ".join(tick.changes) if not tick.rollbacks else "ROLLBACK " + "; ".join(tick.rollbacks)
        t.add_row(
            label,
            f"{tick.t_s / 60:.1f}",
            ":".join(map(str, tick.point.replicas)),
            f"{fleet_cost(config, tick.point.fleet):g}",
            f"{k.routing.max_wan_transfer_ms:g}",
            f"{k.handoff.mode.value}/{k.handoff.catch_up_threshold_tokens}",
            str(k.handoff.relay_cap_tokens),
            fig.get("ttft", "-"),
            fig.get("tpot", "-"),
            fig.get("gap", "-"),
            f"{tick.attainment:.1%}",
            f"{tick.goodput_at_load:.2f}",
            " ".join(tick.situations) or "-",
            changes or "-",
        )

    folded: list[Tick] = []
    seen: list[str] | None = None
    for tick in run.ticks:
        if tick.changes or tick.situations != seen or tick is run.ticks[-1]:
            if folded:
                label = f"{folded[0].tick}" if len(folded) == 1 else f"{folded[0].tick}-{folded[-1].tick}"
                add(folded[-1], label)
                folded = []
            add(tick, str(tick.tick))
        else:
            folded.append(tick)
        seen = tick.situations
    console.print(t)
    state = f"converged after {run.ticks_to_converge} ticks" if run.converged else f"not settled within {len(run.ticks)} ticks"
    console.print(f"seed {run.seed}: {state}; final {run.final.describe()}")


# ---- the sweep ---------------------------------------------------------------------------


def fleets(config: PDDConfig, budget: float) -> list[tuple[int, int, int]]:
    """Every P:RLD:MD within the budget and max_replicas that cannot afford one more replica of any role."""
    bounds = [config.roles.get(r).max_replicas for r in ROLES]
    cost = [config.node_groups[config.roles.get(r).node_group].cost_per_hour for r in ROLES]
    out = []
    for p in range(1, bounds[0] + 1):
        for r in range(1, bounds[1] + 1):
            for m in range(1, bounds[2] + 1):
                n = (p, r, m)
                total = sum(a * c for a, c in zip(n, cost))
                if total > budget + 1e-9:
                    continue
                if all(n[i] == bounds[i] or total + cost[i] > budget + 1e-9 for i in range(3)):
                    out.append(n)
    return out


@dataclass
class Screened:
    point: Point
    attainment: float
    score: float

    @property
    def rank(self) -> tuple[float, float]:
        return (-self.attainment, self.score)


def sweep(twin: Twin, budget: float, a: argparse.Namespace) -> list[Point]:
    """The finalists: the best screened configuration of each of the `--finalists` best fleets, best first."""
    config = twin.setup.config
    base = config.live_knobs()

    def screen(point: Point) -> Screened:
        run = twin.run(point, a.seed)
        snap = snapshot_from_run(run, config, 0.0, window_s=twin.setup.window_s, end_s=twin.setup.span_s)
        return Screened(point, twin.summary(point, a.seed).slo_attainment, slo_score(slo_figures(snap, config.slo)) or float("inf"))

    def best_by_fleet(screened: list[Screened]) -> dict[tuple[int, int, int], Screened]:
        best: dict[tuple[int, int, int], Screened] = {}
        for s in sorted(screened, key=lambda s: s.rank):
            best.setdefault(s.point.replicas, s)
        return best

    def screen_all(points: list[Point]) -> list[Screened]:
        twin.prefetch((p, a.seed) for p in points)
        return [screen(p) for p in points]

    stage1 = screen_all([Point(n, with_knobs(base, {THRESHOLD: thr})) for n in fleets(config, budget) for thr in a.thresholds])
    leaders = list(best_by_fleet(stage1).values())[: a.finalists]
    stage2 = screen_all(
        [
            Point(s.point.replicas, with_knobs(s.point.knobs, {"handoff.mode": mode, "handoff.relay_cap_tokens": cap}))
            for s in leaders
            for mode in a.modes
            for cap in a.caps
        ]
    )
    leading_fleets = {s.point.replicas for s in leaders}
    finalists = [s for s in best_by_fleet(stage1 + stage2).values() if s.point.replicas in leading_fleets]
    t = Table(
        title=f"sweep: {len(stage1)} fleet x threshold points and {len(stage2)} handoff points screened at {twin.setup.rps:g} RPS; "
        f"finalists: the best point of each of the {len(finalists)} best fleets"
    )
    for col in ("configuration", "$/h", "in SLO", "SLO score"):
        t.add_column(col, justify="right")
    for s in finalists:
        t.add_row(s.point.describe(), f"{fleet_cost(config, s.point.fleet):g}", f"{s.attainment:.1%}", f"{s.score:.2f}")
    console.print(t)
    return [s.point for s in finalists]


# ---- the report --------------------------------------------------------------------------


def start_point(config: PDDConfig, budget: float, a: argparse.Namespace) -> Point:
    """The deliberately bad start: `--start` or prefill halved, one relay more, main decode filling the budget."""
    if a.start:
        replicas = tuple(int(x) for x in a.start.split(":"))
    else:
        p, r, _ = (config.roles.get(role).replicas for role in ROLES)
        p, r = max(1, p // 2), min(r + 1, config.roles.relay_decode.max_replicas)
        md = config.roles.main_decode
        room = budget - fleet_cost(config, {"prefill": p, "relay_decode": r, "main_decode": 0})
        replicas = (p, r, max(1, min(md.max_replicas, int(room // config.node_groups[md.node_group].cost_per_hour))))
    bounds = config.agents.bounds
    threshold = a.start_threshold if a.start_threshold is not None else bounds[THRESHOLD].max
    catch_up = a.start_catch_up if a.start_catch_up is not None else int(bounds[CATCH_UP].min)
    changes = {THRESHOLD: threshold, "handoff.mode": a.start_mode, CATCH_UP: catch_up}
    if a.start_cap is not None:
        changes[CAP] = a.start_cap
    knobs = with_knobs(config.live_knobs(), changes)
    return Point(replicas, knobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--budget", type=float, help="fleet budget in $/h (default: what the config file's fleet costs)")
    ap.add_argument("--rps", type=float, help="offered load the agents tune at (default: --load-share of the file's fleet's SLA goodput)")
    ap.add_argument("--load-share", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=3, help="traffic seeds: the agents run once per seed; figures are medians")
    ap.add_argument("--seed", type=int, default=0, help="first traffic seed")
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S, help="simulated seconds of traffic before the window")
    ap.add_argument(
        "--cold-start", action="store_true", help="start every run with cold prefix caches instead of warm ones (then give it a --warmup-s of 1800 or more)"
    )
    ap.add_argument("--ticks", type=int, default=200, help="tick limit")
    ap.add_argument("--stable", type=int, default=20, help="ticks without a change that count as converged")
    ap.add_argument("--no-what-if", dest="what_if", action="store_false", help="capacity decides by rules, without the twin's what-if")
    ap.add_argument("--start", help="P:RLD:MD replicas at the start (default: derived, see above)")
    ap.add_argument("--start-threshold", type=float, help="WAN threshold at the start (default: its upper bound)")
    ap.add_argument("--start-mode", default="catch_up")
    ap.add_argument("--start-catch-up", type=int, help="catch-up threshold at the start (default: its lower bound)")
    ap.add_argument("--start-cap", type=int, help="relay cap at the start (default: the config file's)")
    ap.add_argument("--intent", choices=["start", "file"], default="start", help="the knobs and replicas the agents hold as intent")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0, 25, 50, 100, 200, 300, 1000, 5000])
    ap.add_argument("--modes", nargs="+", default=["one_shot", "catch_up", "auto"])
    ap.add_argument("--caps", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--finalists", type=int, help="fleets whose best screened configuration gets a goodput search (default: every fleet)")
    ap.add_argument("--rel-tol", type=float, default=0.02, help="goodput search precision")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes for the runs and searches that do not wait on each other, and for the seeds' agents "
        "(default: every CPU); the figures are the same for any number",
    )
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    if a.finalists is not None and a.finalists < 1:
        ap.error("--finalists: at least one fleet must get a goodput search")
    try:
        jobs = check_jobs(a.jobs)
    except ValueError as err:
        ap.error(str(err))
    t0 = time.perf_counter()

    base = load_config(a.config)
    shipped = point_of({r.value: rc.replicas for r, rc in base.roles.present().items()}, base.live_knobs())
    budget = a.budget if a.budget is not None else fleet_cost(base, shipped.fleet)
    config = base.model_copy(update={"agents": base.agents.model_copy(update={"max_cost_per_hour": budget})})
    seeds = list(range(a.seed, a.seed + a.seeds))
    window_s = config.slo.window_s
    sizing = Twin(Setup(WORKLOAD, a.warmup_s, window_s, config, a.rps or 1.0, warm_start=not a.cold_start, jobs=jobs))
    rps = a.rps if a.rps is not None else round(a.load_share * sizing.goodput(shipped, seeds[0], a.rel_tol), 2)
    setup = Setup(WORKLOAD, a.warmup_s, window_s, config, rps, warm_start=not a.cold_start, jobs=jobs)
    twin = Twin(setup)
    twin.searches.update(sizing.searches)  # searches do not depend on the offered load
    twin.sims += sizing.sims
    start = start_point(config, budget, a)
    console.print(
        f"{a.config}: budget ${budget:g}/h, {rps:g} RPS offered, {setup.span_s:g} s simulated per run "
        f"({a.warmup_s:g} s warm-up + {window_s:g} s window, ~{round(rps * setup.span_s):,} requests), seeds {seeds}"
    )
    console.print(
        f"the config file: {shipped.describe()} (${fleet_cost(config, shipped.fleet):g}/h); start: {start.describe()} (${fleet_cost(config, start.fleet):g}/h)"
    )

    t_sweep = time.perf_counter()
    finalists = sweep(twin, budget, a)
    t_sweep = time.perf_counter() - t_sweep

    t_agents = time.perf_counter()
    options = dict(max_ticks=a.ticks, stable=a.stable, what_if=a.what_if, intent_is_start=a.intent == "start")
    with progress.steps(console, "agent runs", len(seeds)) as step:
        if jobs > 1 and len(seeds) > 1:  # a seed's ticks run in turn, the seeds side by side
            alone = run_all(partial(_agents_alone, setup, start=start, **options), seeds, jobs=jobs, on_done=lambda i, _: step(f"seed {seeds[i]}"))
            runs = [run for run, _ in alone]
            twin.sims += sum(sims for _, sims in alone)
        else:
            runs = []
            for seed in seeds:
                runs.append(run_agents(twin, start, seed, **options))
                step(f"seed {seed}")
    for run in runs:
        show_ticks(run, config, rps)
    t_agents = time.perf_counter() - t_agents

    t_search = time.perf_counter()

    def goodput(point: Point, seed: int) -> float:
        return twin.goodput(point, seed, a.rel_tol)

    twin.prefetch_goodput([(p, s) for p in (*finalists, start, shipped) for s in seeds] + [(run.final, run.seed) for run in runs], a.rel_tol)
    best_by_seed = {i: [goodput(p, s) for s in seeds] for i, p in enumerate(finalists)}
    best_i = max(best_by_seed, key=lambda i: (median(best_by_seed[i]), -i))
    best = finalists[best_i]
    agents_goodput = [goodput(run.final, run.seed) for run in runs]
    start_goodput = [goodput(start, s) for s in seeds]
    shipped_goodput = [goodput(shipped, s) for s in seeds]
    sweep_med = median(best_by_seed[best_i])
    # the best known: the sweep's, unless the start or the file itself beats it
    known = max(
        [("sweep's best", best, best_by_seed[best_i]), ("start", start, start_goodput), ("config file", shipped, shipped_goodput)],
        key=lambda x: median(x[2]),
    )
    t_search = time.perf_counter() - t_search

    def at_load(point: Point, seed: int) -> Summary:
        return twin.summary(point, seed)

    rows_final = [
        ("start (deliberately bad)", [start] * len(seeds), start_goodput),
        ("the config file", [shipped] * len(seeds), shipped_goodput),
        ("agents, final", [run.final for run in runs], agents_goodput),
        ("sweep's best", [best] * len(seeds), best_by_seed[best_i]),
    ]
    twin.prefetch((p, s) for _, points, _ in rows_final for p, s in zip(points, seeds))
    best_med = median(known[2])
    best_at_load = median([float(at_load(known[1], s).sla_goodput_rps) for s in seeds])
    t = Table(
        title=f"final: medians of {len(seeds)} seeds at ${budget:g}/h; SLA goodput = highest RPS meeting the SLO (goodput search); "
        f"vs best: against the best known ({known[0]})"
    )
    for col in ("", "configuration", "$/h", "SLA goodput (RPS)", "vs best", f"in SLO @ {rps:g}", f"goodput @ {rps:g}", "vs best @ load", "ticks"):
        t.add_column(col, justify="left" if col in ("", "configuration") else "right")
    summary_rows = []
    for label, points, gp in rows_final:
        describe = points[0].describe() if len({p.key() for p in points}) == 1 else " | ".join(p.describe() for p in points)
        cost = median([fleet_cost(config, p.fleet) for p in points])
        att = median([at_load(p, s).slo_attainment for p, s in zip(points, seeds)])
        gl = median([float(at_load(p, s).sla_goodput_rps) for p, s in zip(points, seeds)])
        ticks = ""
        if label == "agents, final":
            done = [r.ticks_to_converge for r in runs if r.ticks_to_converge is not None]
            ticks = f"{median(done):g}" + ("" if len(done) == len(runs) else f" ({len(runs) - len(done)} unsettled)") if done else "unsettled"
        t.add_row(
            label,
            describe,
            f"{cost:g}",
            f"{median(gp):.2f}",
            f"{median(gp) / best_med:.3f}" if best_med else "-",
            f"{att:.1%}",
            f"{gl:.2f}",
            f"{gl / best_at_load:.3f}" if best_at_load else "-",
            ticks,
        )
        summary_rows.append(
            {
                "label": label,
                "configuration": describe,
                "cost_per_hour": cost,
                "sla_goodput_rps": median(gp),
                "sla_goodput_by_seed": gp,
                "slo_attainment_at_load": att,
                "goodput_at_load_rps": gl,
            }
        )
    console.print(t)

    converged = [r.ticks_to_converge for r in runs if r.ticks_to_converge is not None]
    ratio = median(agents_goodput) / best_med if best_med else float("nan")
    ratio_sweep = median(agents_goodput) / sweep_med if sweep_med else float("nan")
    at_load_ratio = median([float(at_load(r.final, r.seed).sla_goodput_rps) for r in runs]) / best_at_load if best_at_load else float("nan")
    wall = time.perf_counter() - t0
    console.print(
        f"goodput_vs_best {ratio:.3f} (goal >= 0.95; against the {known[0]}; vs the sweep's best {ratio_sweep:.3f}), at {rps:g} RPS {at_load_ratio:.3f}; ticks_to_converge "
        f"{median(converged) if converged else 'none'}; {twin.sims} simulations; sweep {t_sweep:.0f} s, agents {t_agents:.0f} s, "
        f"goodput searches {t_search:.0f} s, total {wall:.0f} s"
    )

    rows = [{"seed": r.seed, **tick.row(config)} for r in runs for tick in r.ticks]
    summary = {
        "goodput_vs_best": ratio,
        "best_known": known[0],
        "goodput_vs_sweep_best": ratio_sweep,
        "ticks_to_converge": median(converged) if len(converged) == len(runs) else None,
        "goodput_at_load_vs_best": at_load_ratio,
        "converged_runs": len(converged),
        "runs": len(runs),
        "ticks_to_converge_by_seed": [r.ticks_to_converge for r in runs],
        "final_by_seed": [r.final.describe() for r in runs],
        "best": best.describe(),
        "finalists": [p.describe() for p in finalists],
        "finalists_sla_goodput_by_seed": {finalists[i].describe(): v for i, v in best_by_seed.items()},
        "rps": rps,
        "budget_per_hour": budget,
        "seeds": seeds,
        "warmup_s": a.warmup_s,
        "window_s": setup.window_s,
        "what_if": a.what_if,
        "table": summary_rows,
        "simulations": twin.sims,
        "wall_s": wall,
    }

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
        for run in runs:
            x = [tick.t_s / 60 for tick in run.ticks]
            axes[0].step(x, [tick.goodput_at_load for tick in run.ticks], where="post", label=f"seed {run.seed}")
            for i, role in enumerate(ROLES):
                axes[1].step(
                    x,
                    [tick.point.replicas[i] for tick in run.ticks],
                    where="post",
                    color=f"C{i}",
                    label=SHORT[role] if run is runs[0] else None,
                    alpha=0.9 if run is runs[0] else 0.4,
                )
            axes[2].step(
                x,
                [tick.point.knobs.routing.max_wan_transfer_ms for tick in run.ticks],
                where="post",
                color="C0",
                label="max_wan_transfer_ms" if run is runs[0] else None,
            )
            axes[2].step(
                x,
                [tick.point.knobs.handoff.relay_cap_tokens for tick in run.ticks],
                where="post",
                color="C1",
                label="relay_cap_tokens" if run is runs[0] else None,
            )
            axes[2].step(
                x,
                [tick.point.knobs.handoff.catch_up_threshold_tokens for tick in run.ticks],
                where="post",
                color="C2",
                label="catch_up_threshold_tokens" if run is runs[0] else None,
            )
        axes[0].axhline(rps, color="grey", lw=0.8, ls=":", label=f"offered {rps:g} RPS")
        axes[0].axhline(best_at_load, color="C3", lw=0.8, ls="--", label=f"best known ({known[0]}) at this load")
        axes[0].set_ylabel("goodput at load (req/s in SLO)")
        axes[0].legend(fontsize=7)
        axes[1].set_ylabel("replicas")
        axes[1].legend(fontsize=7)
        axes[2].set_yscale("symlog", linthresh=10)
        axes[2].set_ylabel("knob value")
        axes[2].set_xlabel("simulated minutes")
        axes[2].legend(fontsize=7)
        fig.suptitle(f"agents tuning the twin: SLA goodput {median(agents_goodput):.2f} RPS vs best known ({known[0]}) {best_med:.2f} ({ratio:.1%})")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    csv_path = write_outputs("agents_tuning", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

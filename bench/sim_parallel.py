"""The twin's independent runs on several processes against one: a hit-rate sweep's wall time.

`pdd sim --sweep-hit`'s sweep (12 hit rates, PDD against naive cross-DC PD:
24 runs) on serve_configs/gpu_h100_h200.yaml, once on one process and once on
`--jobs` (default: every CPU), rounds alternating which goes first. Prints the
median wall time of each, the speed-up (one process / several) and whether
every point came out the same (it must: runs are pure functions of their inputs
and seed, app/sim/parallel.py). On two CPUs the speed-up is at most 2x, less
what spawning the workers and a sweep's uneven runs cost.

    python bench/sim_parallel.py [--requests 5000] [--rps 6] [--rounds 3] [--jobs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import Mode
from app.config.file import load_config
from app.sim.cli import HIT_GRID
from app.sim.cluster import derive
from app.sim.parallel import check_jobs
from app.sim.run import hit_sweep
from app.sim.workload import AgenticWorkload
from bench.common import ROOT, median, write_outputs

console = Console(width=140)
CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000, help="requests per run")
    ap.add_argument("--rps", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None, help="processes of the parallel sweep (default: every CPU)")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    try:
        jobs = check_jobs(a.jobs)
    except ValueError as err:
        ap.error(str(err))

    config = load_config(CONFIG)
    naive = derive(config, mode=Mode.pd_cross_dc_naive)
    template = AgenticWorkload(requests=a.requests, rps=a.rps, seed=0)
    rows, points = [], {}
    for r in range(a.rounds):
        for n in (1, jobs) if r % 2 == 0 else (jobs, 1):
            with console.status(f"round {r + 1}/{a.rounds}: sweep of {2 * len(HIT_GRID)} runs on {n} process(es)"):
                t0 = time.perf_counter()
                points[n] = hit_sweep(config, naive, template, HIT_GRID, warm_start=True, jobs=n)
                wall = time.perf_counter() - t0
            rows.append(
                {
                    "round": r + 1,
                    "jobs": n,
                    "wall_s": wall,
                    "runs": 2 * len(HIT_GRID),
                    "requests_per_run": a.requests,
                    "simulated_requests_per_s": 2 * len(HIT_GRID) * a.requests / wall,
                }
            )
    same = repr(points[1]) == repr(points[jobs])  # repr: a NaN figure equals itself
    one = median([row["wall_s"] for row in rows if row["jobs"] == 1])
    many = median([row["wall_s"] for row in rows if row["jobs"] == jobs])

    table = Table(title=f"hit-rate sweep ({2 * len(HIT_GRID)} runs of {a.requests:,} requests), medians of {a.rounds} rounds")
    for col in ("processes", "wall s", "simulated requests/s", "speed-up vs 1"):
        table.add_column(col, justify="right")
    for n, wall in ((1, one), (jobs, many)):
        table.add_row(str(n), f"{wall:.1f}", f"{2 * len(HIT_GRID) * a.requests / wall:,.0f}", f"{one / wall:.2f}x")
    console.print(table)
    console.print(f"every point the same on {jobs} processes as on one: " + ("[green]yes[/green]" if same else "[red]NO[/red]"))
    summary = {
        "jobs": jobs,
        "wall_s_one": one,
        "wall_s_parallel": many,
        "speedup": one / many,
        "same_points": same,
        "rounds": a.rounds,
        "requests_per_run": a.requests,
    }
    csv_path = write_outputs("sim_parallel", rows, summary, a.json_path)
    console.print(f"wrote {csv_path}")
    if not same:
        raise SystemExit("the parallel sweep's points differ from the serial one's")


if __name__ == "__main__":
    main()

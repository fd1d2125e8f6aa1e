"""How fast the digital twin simulates: requests per second of wall time on this machine.

The main run serves a million agentic requests (generated on the fly, so
generation counts) on serve_configs/gpu_h100_h200.yaml in PDD mode; the goal
is under 60 s, i.e. at least 16,667 requests/s. A shorter run per mode shows
what each pipeline costs. Rates are medians over rounds; ratios are against
the goal rate. The twin's hot modules run compiled where `pdd native build`
built them (app/native.py); a baseline run of the same PDD workload as plain
Python, in a child process, gives the compiled build's speed-up.

    python bench/sim_speed.py [--requests 1000000] [--rounds 1] [--mode-requests 100000]
                              [--python-requests 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from app import native
from app.config import Mode
from app.config.file import load_config
from app.sim import AgenticWorkload, simulate
from app.sim.cluster import derive
from bench.common import ROOT, median, write_outputs

console = Console(width=140)
CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"
GOAL_REQUESTS, GOAL_S = 1_000_000, 60.0


def timed_run(config, requests: int, rps: float, seed: int, label: str) -> dict:
    w = AgenticWorkload(requests=requests, rps=rps, seed=seed)
    with Progress(f"[progress.description]{label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(label, total=requests)
        t0 = time.perf_counter()
        c0 = time.process_time()
        run = simulate(config, w, seed=seed, progress=lambda n: bar.update(task, completed=n))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
    if len(run.results) != requests:
        raise RuntimeError(f"{label}: {len(run.results)} of {requests} requests finished")
    return {
        "mode": config.mode.value,
        "requests": requests,
        "rps_offered": rps,
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_s": requests / wall,
        "requests_per_cpu_s": requests / cpu,
        "events_per_request": run.events / requests,
    }


def python_baseline(requests: int, rps: float) -> dict:
    """The same PDD run with every module as plain Python, in a fresh process (modules load once per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        code = (
            "import json; from bench.sim_speed import CONFIG, timed_run; from app.config.file import load_config; "
            f"r = timed_run(load_config(CONFIG), {requests}, {rps}, 0, 'PDD, plain Python baseline'); "
            f"open({str(out)!r}, 'w').write(json.dumps(r))"
        )
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, native.ENV_SWITCH: "0"}, check=True)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=GOAL_REQUESTS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--mode-requests", type=int, default=100_000, help="requests per mode in the per-mode table (0: skip)")
    ap.add_argument("--python-requests", type=int, default=100_000, help="requests of the plain-Python baseline and its compiled twin run (0: skip)")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    base = load_config(CONFIG)
    goal_rate = GOAL_REQUESTS / GOAL_S
    main_runs = [timed_run(base, a.requests, 6.0, seed, f"PDD, {a.requests:,} requests, round {seed + 1}/{a.rounds}") for seed in range(a.rounds)]
    rows = [{"run": "main", **r} for r in main_runs]
    mode_rows = []
    if a.mode_requests:
        for mode in Mode:
            # 3 RPS: a load every mode sustains (naive cross-DC PD saturates the WAN near 4)
            runs = [timed_run(derive(base, mode=mode), a.mode_requests, 3.0, seed, f"{mode.value}, round {seed + 1}/{a.rounds}") for seed in range(a.rounds)]
            mode_rows.append(
                {
                    "run": "per-mode",
                    "mode": mode.value,
                    "requests": a.mode_requests,
                    "requests_per_s": median([r["requests_per_s"] for r in runs]),
                    "requests_per_cpu_s": median([r["requests_per_cpu_s"] for r in runs]),
                    "events_per_request": median([r["events_per_request"] for r in runs]),
                }
            )
        rows += mode_rows

    compiled = native.compiled_modules()
    build = f"compiled ({len(compiled)} of {len(native.MODULES)} modules)" if compiled else "plain Python"
    baseline_rows = []
    if a.python_requests:
        same = timed_run(base, a.python_requests, 6.0, 0, f"PDD, {build}, {a.python_requests:,} requests")
        python = python_baseline(a.python_requests, 6.0)
        baseline_rows = [{"run": "baseline", "build": build, **same}, {"run": "baseline", "build": "plain Python", **python}]
        rows += baseline_rows

    rate = median([r["requests_per_s"] for r in main_runs])
    cpu_rate = median([r["requests_per_cpu_s"] for r in main_runs])
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table = Table(title=f"digital twin speed, {build} (medians of {a.rounds} round(s); goal {GOAL_REQUESTS:,} requests in {GOAL_S:g} s)")
    for col in ("run", "requests", "requests/s (wall)", "requests/s (CPU)", "events/request", "vs goal rate"):
        table.add_column(col, justify="right")
    table.add_row(
        "PDD (main)",
        f"{a.requests:,}",
        f"{rate:,.0f}",
        f"{cpu_rate:,.0f}",
        f"{median([r['events_per_request'] for r in main_runs]):.2f}",
        f"{rate / goal_rate:.2f}x",
    )
    for r in mode_rows:
        table.add_row(
            r["mode"],
            f"{r['requests']:,}",
            f"{r['requests_per_s']:,.0f}",
            f"{r['requests_per_cpu_s']:,.0f}",
            f"{r['events_per_request']:.2f}",
            f"{r['requests_per_s'] / goal_rate:.2f}x",
        )
    console.print(table)
    speedup = None
    if baseline_rows:
        same, python = baseline_rows
        speedup = same["requests_per_s"] / python["requests_per_s"]
        console.print(
            f"PDD, {a.python_requests:,} requests: {build} {same['requests_per_s']:,.0f} requests/s, plain Python "
            f"{python['requests_per_s']:,.0f} requests/s: [bold]{speedup:.2f}x[/bold]"
        )
    projected = GOAL_REQUESTS / rate
    console.print(
        f"{GOAL_REQUESTS:,} requests take {projected:.1f} s at this rate (goal < {GOAL_S:g} s): "
        + ("[green]met[/green]" if projected < GOAL_S else "[red]missed[/red]")
        + f"; peak memory {peak_rss_mib:,.0f} MiB"
    )
    summary = {
        "requests_per_s": rate,
        "requests_per_cpu_s": cpu_rate,
        "seconds_per_million": projected,
        "build": build,
        "compiled_modules": compiled,
        "speedup_vs_python": speedup,
        "goal_met": projected < GOAL_S,
        "peak_rss_mib": peak_rss_mib,
        "rounds": a.rounds,
        "rows": rows,
    }

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = ["PDD (main)"] + [r["mode"] for r in mode_rows]
        ax.bar(labels, [rate] + [r["requests_per_s"] for r in mode_rows])
        ax.axhline(goal_rate, color="red", ls="--", label="goal: 1M requests in 60 s")
        ax.set_ylabel("simulated requests / s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("sim_speed", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""The calibrated digital twin against the real PDD run of bench/pipelines.py, same trace.

1. Calibrate (app/sim/calibrate.py): a real vLLM engine with bench/pipelines.py's
   config measures prefill and decode steps on this machine; the twin's
   step-time model is fitted to them (`--perf FILE` reuses a fitted model).
2. Replay bench/out/pipelines_trace.jsonl (the pdd run's requests, at the times
   they really went out) through the twin with the same config (links, routing,
   handoff, replicas) and the fitted model on every node group.
3. Compare per-request figures with the real run (bench/out/pipelines.csv,
   mode pdd): TTFT p50/p90/p99, worst gap p99, the pipeline mix, WAN bytes.
   Goal: TTFT p50 and p90 within 20%.

Run bench/pipelines.py first (`--modes pdd` is enough).

    python bench/sim_vs_real.py [--perf bench/out/fitted_perf.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import Mode, parse_config
from app.sim.calibrate import calibrate, with_model_spec
from app.sim.cluster import derive
from app.sim.perf import FittedPerf, save_samples
from app.sim.run import simulate
from app.sim.workload import read_trace
from bench.common import OUT_DIR, percentile, write_outputs
from bench.pipelines import bench_args

console = Console(width=160)
TRACE = OUT_DIR / "pipelines_trace.jsonl"
REAL = OUT_DIR / "pipelines.csv"
FITTED = OUT_DIR / "fitted_perf.json"


def real_rows(path: Path) -> list[dict]:
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["mode"] == Mode.pdd.value and not r.get("error")]
    if not rows:
        raise SystemExit(f"{path} has no successful pdd requests: run `python bench/pipelines.py --modes pdd` first")
    return rows


def figures(ttft_ms: list[float], gap_ms: list[float], pipelines: list[str], wan_bytes: float) -> dict:
    return {
        "ttft_p50": percentile(ttft_ms, 50), "ttft_p90": percentile(ttft_ms, 90), "ttft_p99": percentile(ttft_ms, 99),
        "gap_p99": percentile(gap_ms, 99), "requests": len(ttft_ms), "wan_mb": wan_bytes / 1e6,
        "pipelines": dict(Counter(pipelines)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--perf", type=Path, help="fitted step-time model JSON (default: calibrate now)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the twin's link draws")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    for path in (TRACE, REAL):
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `python bench/pipelines.py --modes pdd` first")

    config = with_model_spec(derive(parse_config(bench_args()), mode=Mode.pdd))
    if a.perf is not None:
        perf = FittedPerf.from_json(a.perf.read_text())
        console.print(f"fitted model from {a.perf}")
    else:
        with console.status("calibrating a real engine") as status:
            perf, samples = calibrate(config, progress=lambda msg: status.update(f"calibrating: {msg}"))
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        FITTED.write_text(perf.to_json())
        save_samples(OUT_DIR / "calibration_samples.json", samples)
        console.print(f"calibrated on {len(samples)} measured steps; wrote {FITTED}")
    console.print(f"step = {perf.a_ms:.2f} ms + {perf.b_ms_per_prefill_token:.4f} ms/prefill token + "
                  f"{perf.c_ms_per_decode_seq:.3f} ms/decode seq + {perf.d_ms_per_kv_token:.6f} ms/context token")

    trace = list(read_trace(TRACE))
    rows = real_rows(REAL)
    run = simulate(config, trace, perf, a.seed)
    sim = run.records()
    real = figures([float(r["ttft_ms"]) for r in rows], [float(r["max_gap_ms"]) for r in rows],
                   [r["pipeline"] for r in rows], sum(float(r["wan_bytes"] or 0) for r in rows))
    twin = figures([r.ttft_s * 1000 for r in sim], [r.max_gap_s * 1000 for r in sim if r.output_tokens > 1],
                   [r.pipeline.value for r in sim], sum(r.wan_bytes for r in sim))
    rel = {k: twin[k] / real[k] - 1 for k in ("ttft_p50", "ttft_p90", "ttft_p99", "gap_p99", "wan_mb") if real[k]}

    table = Table(title=f"twin vs real, pdd, {len(trace)} requests of bench/pipelines.py's trace (twin: calibrated CPU step model)")
    for col in ("figure", "real", "twin", "twin / real - 1"):
        table.add_column(col, justify="right")
    for k, label in (("ttft_p50", "TTFT p50 ms"), ("ttft_p90", "TTFT p90 ms"), ("ttft_p99", "TTFT p99 ms"), ("gap_p99", "worst gap p99 ms"), ("wan_mb", "WAN MB")):
        table.add_row(label, f"{real[k]:.0f}", f"{twin[k]:.0f}", f"{rel.get(k, float('nan')):+.0%}")
    table.add_row("pipelines", ", ".join(f"{p} {n}" for p, n in sorted(real["pipelines"].items())),
                  ", ".join(f"{p} {n}" for p, n in sorted(twin["pipelines"].items())), "")
    console.print(table)
    ok = all(abs(rel[k]) <= 0.2 for k in ("ttft_p50", "ttft_p90"))
    console.print(f"goal (TTFT p50 and p90 within 20%): {'[green]met' if ok else '[red]not met'}[/]")

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt
        import numpy as np

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, values in (("real", [float(r["ttft_ms"]) for r in rows]), ("twin", [r.ttft_s * 1000 for r in sim])):
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title("pdd on this machine: real run vs calibrated twin, same trace")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    summary = {"real": real, "twin": twin, "ttft_p50_rel_err": abs(rel["ttft_p50"]), "ttft_p90_rel_err": abs(rel["ttft_p90"]),
               "rel": rel, "perf": perf.__dict__, "goal_met": ok}
    out_rows = [{"figure": k, "real": real[k], "twin": twin[k], "rel": rel.get(k)} for k in ("ttft_p50", "ttft_p90", "ttft_p99", "gap_p99", "wan_mb")]
    csv_path = write_outputs("sim_vs_real", out_rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""The calibrated digital twin against bench/pipelines.py's real runs, same traces.

1. Calibrate (app/sim/calibrate.py): a real vLLM engine with bench/pipelines.py's
   config measures prefill and decode steps on this machine; the twin's
   step-time model is fitted to them (`--perf FILE` reuses a fitted model).
2. Replay each mode's trace (bench/out/pipelines_trace_MODE.jsonl: its requests,
   at the times they really went out) through the twin with the same config
   (links, routing, handoff, replicas) and the fitted model on every node group.
3. Compare per-request figures with the real run (bench/out/pipelines.csv):
   TTFT p50/p90/p99, TPOT p50, worst gap p99, WAN bytes and the pipeline mix.
   Goal: pdd's TTFT p50 and p90 within 20%, at the conductor.

TTFT is shown twice. At the conductor (the real journeys' `ttft_ms`: from the
request reaching the conductor to its first token) is what the twin models,
and what the goal is judged on. At the client adds what lies outside the
server: the openai SDK itself spends about 13 us per prompt token id before
sending (its request transform: 51 ms for a 4000-token prompt on this
machine), plus HTTP and Serve's proxy.

The other modes (colocated most of all: one engine, no PDD logic) show how far
the twin and the real app part where PDD plays no role: the serving stack and
the machine. The real rows also give the conductor's own TTFT (from its
journeys), so the client-side share (HTTP, Serve's proxy) is visible.

Run bench/pipelines.py first (`--modes colocated,pdd` is enough).

    python bench/sim_vs_real.py [--perf bench/out/fitted_perf.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import math
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
from bench.pipelines import bench_args, trace_path

console = Console(width=160)
REAL = OUT_DIR / "pipelines.csv"
FITTED = OUT_DIR / "fitted_perf.json"
FIGURES = (("server_ttft_p50", "TTFT p50 ms, conductor"), ("server_ttft_p90", "TTFT p90 ms, conductor"),
           ("server_ttft_p99", "TTFT p99 ms, conductor"), ("ttft_p50", "TTFT p50 ms, client"), ("ttft_p90", "TTFT p90 ms, client"),
           ("ttft_p99", "TTFT p99 ms, client"), ("tpot_p50", "TPOT p50 ms"), ("gap_p99", "worst gap p99 ms"), ("wan_mb", "WAN MB"))


def real_rows(path: Path) -> dict[str, list[dict]]:
    """The real run's successful requests per mode."""
    rows: dict[str, list[dict]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            if not r.get("error"):
                rows.setdefault(r["mode"], []).append(r)
    if not rows.get(Mode.pdd.value):
        raise SystemExit(f"{path} has no successful pdd requests: run `python bench/pipelines.py --modes colocated,pdd` first")
    return rows


def figures(ttft_ms: list[float], server_ttft_ms: list[float], tpot_ms: list[float], gap_ms: list[float], pipelines: list[str],
            wan_bytes: float) -> dict:
    return {
        "ttft_p50": percentile(ttft_ms, 50), "ttft_p90": percentile(ttft_ms, 90), "ttft_p99": percentile(ttft_ms, 99),
        **{f"server_ttft_p{q}": percentile(server_ttft_ms, q) for q in (50, 90, 99)},
        "tpot_p50": percentile(tpot_ms, 50), "gap_p99": percentile(gap_ms, 99), "requests": len(ttft_ms),
        "wan_mb": wan_bytes / 1e6, "pipelines": dict(Counter(pipelines)),
    }


def _number(value: str | None) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--perf", type=Path, help="fitted step-time model JSON (default: calibrate now)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the twin's link draws")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    if not REAL.exists():
        raise SystemExit(f"{REAL} is missing: run `python bench/pipelines.py --modes colocated,pdd` first")
    rows = real_rows(REAL)
    modes = [m for m in Mode if m.value in rows and trace_path(m.value).exists()]
    if Mode.pdd not in modes:
        raise SystemExit(f"{trace_path(Mode.pdd.value)} is missing: run `python bench/pipelines.py --modes colocated,pdd` first")

    base = with_model_spec(parse_config(bench_args()))
    if a.perf is not None:
        perf = FittedPerf.from_json(a.perf.read_text())
        console.print(f"fitted model from {a.perf}")
    else:
        with console.status("calibrating a real engine") as status:
            perf, samples = calibrate(derive(base, mode=Mode.pdd), progress=lambda msg: status.update(f"calibrating: {msg}"))
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        FITTED.write_text(perf.to_json())
        save_samples(OUT_DIR / "calibration_samples.json", samples)
        console.print(f"calibrated on {len(samples)} measured steps; wrote {FITTED}")
    console.print(perf.describe())

    real: dict[str, dict] = {}
    twin: dict[str, dict] = {}
    ttfts: dict[str, tuple[list[float], list[float]]] = {}
    for mode in modes:
        mine = rows[mode.value]
        sim = simulate(derive(base, mode=mode), list(read_trace(trace_path(mode.value))), perf, a.seed).records()
        real_ttft = [float(r["ttft_ms"]) for r in mine]
        server = [x for r in mine if (x := _number(r.get("server_ttft_ms"))) is not None]
        real[mode.value] = figures(real_ttft, server, [x for r in mine if (x := _number(r["tpot_ms"])) is not None],
                                   [float(r["max_gap_ms"]) for r in mine], [r["pipeline"] for r in mine],
                                   sum(float(r["wan_bytes"] or 0) for r in mine))
        twin_ttft = [r.ttft_s * 1000 for r in sim]
        twin[mode.value] = figures(twin_ttft, twin_ttft, [r.tpot_s * 1000 for r in sim if r.output_tokens > 1],
                                   [r.max_gap_s * 1000 for r in sim if r.output_tokens > 1],
                                   [r.pipeline.value for r in sim], sum(r.wan_bytes for r in sim))
        ttfts[mode.value] = (server, twin_ttft)
    rel = {mode: {k: twin[mode][k] / real[mode][k] - 1 for k, _ in FIGURES if real[mode][k]} for mode in real}

    table = Table(title=f"twin vs real, same traces as bench/pipelines.py's run (twin: calibrated CPU step model)")
    for col in ("mode", "figure", "real", "twin", "twin / real - 1"):
        table.add_column(col, justify="right")
    for mode in real:
        for k, label in FIGURES:
            if k == "wan_mb" and not real[mode][k] and not twin[mode][k]:
                continue
            table.add_row(mode, label, f"{real[mode][k]:.1f}", f"{twin[mode][k]:.1f}", f"{rel[mode].get(k, float('nan')):+.0%}")
        table.add_row(mode, "pipelines", ", ".join(f"{p} {n}" for p, n in sorted(real[mode]["pipelines"].items())),
                      ", ".join(f"{p} {n}" for p, n in sorted(twin[mode]["pipelines"].items())), "", end_section=True)
    console.print(table)
    pdd = rel[Mode.pdd.value]
    ok = all(abs(pdd[k]) <= 0.2 for k in ("server_ttft_p50", "server_ttft_p90"))
    console.print(f"goal (pdd's TTFT p50 and p90 at the conductor within 20%): {'[green]met' if ok else '[red]not met'}[/]")

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt
        import numpy as np

        fig, ax = plt.subplots(figsize=(7, 4))
        for mode, (real_ttft, twin_ttft) in ttfts.items():
            for label, values, style in (("real", real_ttft, "-"), ("twin", twin_ttft, "--")):
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, label=f"{mode} {label}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT at the conductor (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title("real runs vs calibrated twin on this machine, same traces")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    summary = {"real": real, "twin": twin, "ttft_p50_rel_err": abs(pdd["server_ttft_p50"]), "ttft_p90_rel_err": abs(pdd["server_ttft_p90"]),
               "client_ttft_p50_rel_err": abs(pdd["ttft_p50"]), "client_ttft_p90_rel_err": abs(pdd["ttft_p90"]),
               "rel": rel, "perf": perf.__dict__, "goal_met": ok}
    out_rows = [{"mode": mode, "figure": k, "real": real[mode][k], "twin": twin[mode][k], "rel": rel[mode].get(k)}
                for mode in real for k, _ in FIGURES]
    csv_path = write_outputs("sim_vs_real", out_rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

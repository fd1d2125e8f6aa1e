"""The calibrated digital twin against bench/pipelines.py's real runs, same traces.

1. Calibrate (app/sim/calibrate.py). A real vLLM engine with
   bench/pipelines.py's config is measured alone, now, and the twin's
   step-time model fitted to it (`--base FILE` reuses one). By default that
   model is then fitted per role and mode to the loaded app (`fit_to_app_steps`):
   before each mode's measured run, bench/pipelines.py served that mode a
   calibration trace (another seed) and every engine timed its steps
   (bench/out/pipelines_steps_MODE.json). On this 2-vCPU machine, engines
   sharing it step up to 2-3x slower than alone, the more the more of them are
   busy at once: the fit gives each role its slowdown with no busy neighbor
   engine and per busy neighbor, and the twin applies it to its own replicas,
   all on one host (`--no-host-sharing`: one factor per role). The same
   replay's serving overhead (TTFT at the conductor outside vLLM's engine
   cores: the conductor, Serve's routing, the token channel, the replica's own
   input and output processing), fitted as a base plus a share per other
   request in flight, goes on the model of the role requests enter by, and the
   twin adds it to each request. So does the cost of the KV transport beyond
   the links (each pull inside a datacenter less its idle link's time, fitted
   as a cost per pull plus one per MB), which the twin adds to every pull
   (`--no-kv-pull-cost`: none), and each decoder replica's own time on a
   request it gets after P's first token, its median added to each such
   request (`--no-decoder-overhead`: none). `--calibration idle` keeps the model of the engine alone (no
   overhead); `--calibration run` fits it to the steps of
   the very run compared (in-sample, a diagnosis: what is left when the step
   times are right is the twin's own); `--perf FILE` uses a saved model as is.
2. Replay each mode's trace (bench/out/pipelines_trace_MODE.jsonl: its requests,
   at the times they really went out) through the twin with the same config
   (links, routing, handoff, replicas) and that mode's models.
3. Compare per-request figures with the real run (bench/out/pipelines_open.csv):
   TTFT p50/p90/p99, TPOT p50, worst gap p99, WAN bytes and the pipeline mix.
   Goal: pdd's TTFT p50 and p90 within 20%, at the conductor. With host
   sharing, the twin with one factor per role (the same steps) runs beside it
   as the baseline.

TTFT is shown twice. At the conductor (the real journeys' `ttft_ms`: from the
request reaching the conductor to its first token) is what the twin models,
and what the goal is judged on. At the client adds what lies outside the
server: HTTP and Serve's proxy (bench/pipelines.py hands the openai SDK its
token ids in `extra_body`, past the SDK's own 13-22 us per id).

A last line shows how far the twin's pdd TTFT moves when every step is 1-3%
faster or slower: near a queue's knee, a small error in step times is a large
one in the median.

The other modes (colocated most of all: one engine, no PDD logic) show how far
the twin and the real app part where PDD plays no role: the serving stack and
the machine. The real rows also give the conductor's own TTFT (from its
journeys), so the client-side share (HTTP, Serve's proxy) is visible.

Run bench/pipelines.py first (`--systems colocated,pdd` is enough).

    python bench/sim_vs_real.py [--calibration app|idle|run] [--base FILE] [--perf FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import Mode, RoleName
from app.config.file import parse_config
from app.sim.calibrate import calibrate, with_model_spec
from app.sim.cluster import derive, entry_role
from app.sim.fitting import OverheadSample, PullSample, RoleFit, fit_to_app_steps, with_decoder_overhead, with_kv_pull, with_serving_overhead
from app.sim.perf import FittedPerf, StepSample, load_perf, roles_to_json, save_samples
from app.sim.run import simulate
from app.sim.workload import read_trace
from bench.common import OUT_DIR, percentile, write_outputs
from bench.pipelines import SYSTEMS, bench_args, steps_path, system_args, trace_path

console = Console(width=160)
REAL = OUT_DIR / "pipelines_open.csv"
FITTED = OUT_DIR / "fitted_perf.json"

FIGURES = (
    ("server_ttft_p50", "TTFT p50 ms, conductor"),
    ("server_ttft_p90", "TTFT p90 ms, conductor"),
    ("server_ttft_p99", "TTFT p99 ms, conductor"),
    ("ttft_p50", "TTFT p50 ms, client"),
    ("ttft_p90", "TTFT p90 ms, client"),
    ("ttft_p99", "TTFT p99 ms, client"),
    ("tpot_p50", "TPOT p50 ms"),
    ("gap_p99", "worst gap p99 ms"),
    ("wan_mb", "WAN MB"),
)


STEP_SCALES = (0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.03)
"""Every step a few percent faster or slower: how far that alone moves the twin's pdd TTFT."""


def scaled_perf(perf: FittedPerf | dict[str, FittedPerf], factor: float) -> FittedPerf | dict[str, FittedPerf]:
    return {role: m.scaled(factor) for role, m in perf.items()} if isinstance(perf, dict) else perf.scaled(factor)


def real_rows(path: Path) -> dict[str, list[dict]]:
    """The real run's successful requests per mode."""
    rows: dict[str, list[dict]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            if not r.get("error"):
                rows.setdefault(r["system"], []).append(r)
    if not rows.get(Mode.pdd.value):
        raise SystemExit(f"{path} has no successful pdd requests: run `python bench/pipelines.py --systems colocated,pdd` first")
    return rows


def figures(ttft_ms: list[float], server_ttft_ms: list[float], tpot_ms: list[float], gap_ms: list[float], pipelines: list[str], wan_bytes: float) -> dict:
    return {
        "ttft_p50": percentile(ttft_ms, 50),
        "ttft_p90": percentile(ttft_ms, 90),
        "ttft_p99": percentile(ttft_ms, 99),
        **{f"server_ttft_p{q}": percentile(server_ttft_ms, q) for q in (50, 90, 99)},
        "tpot_p50": percentile(tpot_ms, 50),
        "gap_p99": percentile(gap_ms, 99),
        "requests": len(ttft_ms),
        "wan_mb": wan_bytes / 1e6,
        "pipelines": dict(Counter(pipelines)),
    }


def _number(value: str | None) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def app_models(
    base: FittedPerf, mode: Mode, run: str = "calibration", host_sharing: bool = True, kv_pull_cost: bool = True, decoder_overhead: bool = True
) -> tuple[dict[str, FittedPerf], dict[str, RoleFit], list[OverheadSample], list[PullSample]]:
    """`base` fitted per role to the steps of `mode`'s calibration replay (or measured run) in bench/pipelines.py,
    with the serving overhead, and (unless turned off) the KV transport's cost and the decoders' request
    overhead, fitted to that replay's on the entry role's model; the fits, the overheads and the pulls."""
    path = steps_path(mode.value, run)
    if not path.exists():
        raise SystemExit(f"{path} is missing: run bench/pipelines.py (with --calibration-requests > 0) first, or pass --calibration idle")
    doc = json.loads(path.read_text())
    steps = {RoleName(role): [StepSample(**s) for s in samples] for role, samples in doc["roles"].items()}
    if host_sharing and any(s.start_s is None for samples in steps.values() for s in samples):
        raise SystemExit(f"{path}: steps without start times: run bench/pipelines.py again, or pass --no-host-sharing")
    fits = fit_to_app_steps(base, steps, host_sharing=host_sharing)
    if short := [role for role, fit in fits.items() if fit.factor is None]:
        raise SystemExit(f"{path}: too few steps for {', '.join(short)}: run bench/pipelines.py with more --calibration-requests")
    overheads = [OverheadSample(**sample) for sample in doc.get("serving_overheads") or []]
    if not overheads:
        raise SystemExit(f"{path} has no serving overheads with the requests in flight: run bench/pipelines.py again")
    if "kv_pulls" not in doc or "decoder_request_overheads" not in doc:
        raise SystemExit(f"{path} has no KV pulls or decoder request overheads: run bench/pipelines.py again")
    pulls = [PullSample(**sample) for sample in doc["kv_pulls"]] if kv_pull_cost else []
    models = with_kv_pull(with_serving_overhead({role: fit.model for role, fit in fits.items()}, mode, overheads), mode, pulls)
    models = with_decoder_overhead(models, mode, doc["decoder_request_overheads"] if decoder_overhead else [])
    return models, fits, overheads, pulls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--calibration",
        choices=("app", "idle", "run"),
        default="app",
        help="app: the engine-alone model fitted per role to the steps bench/pipelines.py timed in each mode's calibration "
        "replay; idle: the engine-alone model; run: fitted to the steps of the very run compared (in-sample: what "
        "is left when the step times are right)",
    )
    ap.add_argument("--base", type=Path, help="the engine-alone model JSON (default: measure a real engine now)")
    ap.add_argument("--perf", type=Path, help="a step-time model JSON used as is for every mode (app/sim/perf.py load_perf)")
    ap.add_argument(
        "--no-host-sharing",
        dest="host_sharing",
        action="store_false",
        help="scale each role by one factor instead of fitting how busy engines on this host slow each other",
    )
    ap.add_argument(
        "--no-kv-pull-cost",
        dest="kv_pull_cost",
        action="store_false",
        help="leave out the KV transport's cost beyond the links (fitted to the replay's pulls inside a datacenter)",
    )
    ap.add_argument(
        "--no-decoder-overhead",
        dest="decoder_overhead",
        action="store_false",
        help="leave out the decoder replicas' own time on the requests they get after P's first token",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the twin's link draws")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    if not REAL.exists():
        raise SystemExit(f"{REAL} is missing: run `python bench/pipelines.py --systems colocated,pdd` first")
    rows = real_rows(REAL)
    modes = [m for m in Mode if m.value in rows and trace_path(m.value).exists()]
    if Mode.pdd not in modes:
        raise SystemExit(f"{trace_path(Mode.pdd.value)} is missing: run `python bench/pipelines.py --systems colocated,pdd` first")

    base = with_model_spec(parse_config(bench_args()))
    perfs: dict[Mode, FittedPerf | dict[str, FittedPerf]] = {}
    one_factor: dict[Mode, dict[str, FittedPerf]] = {}
    """The same calibration with one factor per role (the baseline host sharing is compared with)."""
    if a.perf is not None:
        perfs = dict.fromkeys(modes, load_perf(a.perf))
        console.print(f"model from {a.perf}")
    else:
        if a.base is not None:
            alone = FittedPerf.from_json(a.base.read_text())
            console.print(f"engine-alone model from {a.base}")
        else:
            with console.status("calibrating a real engine") as status:
                alone, samples = calibrate(derive(base, mode=Mode.pdd), progress=lambda msg: status.update(f"calibrating: {msg}"))
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            FITTED.write_text(alone.to_json())
            save_samples(OUT_DIR / "calibration_samples.json", samples)
            console.print(f"calibrated on {len(samples)} steps of an engine alone; wrote {FITTED}")
        console.print(alone.describe())
        perfs = dict.fromkeys(modes, alone)
        if a.calibration in ("app", "run"):
            source = "calibration replay" if a.calibration == "app" else "measured run (in-sample)"
            for mode in modes:
                run = "calibration" if a.calibration == "app" else "run"
                models, fits, overheads, pulls = app_models(alone, mode, run, a.host_sharing, a.kv_pull_cost, a.decoder_overhead)
                perfs[mode] = models
                if a.host_sharing:
                    one_factor[mode] = app_models(alone, mode, run, False, a.kv_pull_cost, a.decoder_overhead)[0]
                (OUT_DIR / f"fitted_perf_{mode.value}.json").write_text(roles_to_json(models))
                entry = models[entry_role(mode).value]
                ms = [sample.ms for sample in overheads]
                console.print(
                    f"{mode.value}: fitted per role to the engines' steps in its {source}: "
                    + "; ".join(f"{role} {fit.describe()}" for role, fit in fits.items())
                    + f"; serving overhead {entry.serving_overhead_ms:.1f} ms a request + "
                    f"{entry.serving_overhead_ms_per_in_flight:.1f} ms per other request in flight (fitted to {len(ms)}: "
                    f"median {percentile(ms, 50):.1f} ms, p10-p90 {percentile(ms, 10):.0f}-{percentile(ms, 90):.0f} ms)"
                    + (
                        f"; KV pulls {entry.kv_pull_ms:.1f} ms + {entry.kv_pull_ms_per_mb:.2f} ms/MB beyond the link (fitted to "
                        f"{len(pulls)} pulls inside a datacenter)"
                        if pulls
                        else ""
                    )
                    + (f"; decoder request overhead {entry.decoder_request_overhead_ms:.1f} ms (median)" if entry.decoder_request_overhead_ms else "")
                )
            console.print(f"wrote {OUT_DIR}/fitted_perf_MODE.json")

    real: dict[str, dict] = {}
    twin: dict[str, dict] = {}
    baseline: dict[str, dict] = {}
    ttfts: dict[str, dict[str, list[float]]] = {}
    """Per mode: TTFTs at the conductor, real and twin."""

    def twin_figures(sim) -> dict:
        ttft = [r.ttft_s * 1000 for r in sim]
        return figures(
            ttft,
            ttft,
            [r.tpot_s * 1000 for r in sim if r.output_tokens > 1],
            [r.max_gap_s * 1000 for r in sim if r.output_tokens > 1],
            [r.pipeline.value for r in sim],
            sum(r.wan_bytes for r in sim),
        )

    traces: dict[Mode, list] = {}
    for mode in modes:
        mine = rows[mode.value]
        trace = traces[mode] = list(read_trace(trace_path(mode.value)))
        given = with_model_spec(parse_config(system_args(bench_args(), SYSTEMS[mode.value])))  # the replicas the system ran on
        sim = simulate(derive(given, mode=mode), trace, perfs[mode], a.seed).records()
        ttfts[mode.value] = {"twin": [r.ttft_s * 1000 for r in sim]}
        if mode in one_factor:
            sim_one = simulate(derive(given, mode=mode), trace, one_factor[mode], a.seed).records()
            baseline[mode.value] = twin_figures(sim_one)
            ttfts[mode.value]["twin, one factor"] = [r.ttft_s * 1000 for r in sim_one]
        real_ttft = [float(r["ttft_ms"]) for r in mine]
        server = [x for r in mine if (x := _number(r.get("server_ttft_ms"))) is not None]
        real[mode.value] = figures(
            real_ttft,
            server,
            [x for r in mine if (x := _number(r["tpot_ms"])) is not None],
            [float(r["max_gap_ms"]) for r in mine],
            [r["pipeline"] for r in mine],
            sum(float(r["wan_bytes"] or 0) for r in mine),
        )
        twin[mode.value] = twin_figures(sim)
        ttfts[mode.value]["real"] = server

    def rel_to_real(figs: dict[str, dict]) -> dict[str, dict]:
        return {mode: {k: figs[mode][k] / real[mode][k] - 1 for k, _ in FIGURES if real[mode][k]} for mode in figs}

    rel, rel_baseline = rel_to_real(twin), rel_to_real(baseline)

    calibration = "--perf" if a.perf is not None else a.calibration
    table = Table(title=f"twin vs real, same traces as bench/pipelines.py's run (twin: CPU step models, calibration: {calibration})")
    for col in ("mode", "figure", "real", "twin", "twin / real - 1") + (("twin, one factor per role", "/ real - 1") if baseline else ()):
        table.add_column(col, justify="right")

    def pipelines(figs: dict) -> str:
        return ", ".join(f"{p} {n}" for p, n in sorted(figs["pipelines"].items()))

    for mode in real:
        for k, label in FIGURES:
            if k == "wan_mb" and not real[mode][k] and not twin[mode][k]:
                continue
            extra = (f"{baseline[mode][k]:.1f}", f"{rel_baseline[mode].get(k, float('nan')):+.0%}") if baseline else ()
            table.add_row(mode, label, f"{real[mode][k]:.1f}", f"{twin[mode][k]:.1f}", f"{rel[mode].get(k, float('nan')):+.0%}", *extra)
        table.add_row(
            mode, "pipelines", pipelines(real[mode]), pipelines(twin[mode]), "", *((pipelines(baseline[mode]), "") if baseline else ()), end_section=True
        )
    console.print(table)
    pdd = rel[Mode.pdd.value]
    ok = all(abs(pdd[k]) <= 0.2 for k in ("server_ttft_p50", "server_ttft_p90"))
    console.print(f"goal (pdd's TTFT p50 and p90 at the conductor within 20%): {'[green]met' if ok else '[red]not met'}[/]")
    # a queue near its knee turns a small error in step times into a large one in the median
    sensitivity: dict[str, list[float]] = {"scales": list(STEP_SCALES), "server_ttft_p50_rel": [], "server_ttft_p90_rel": []}
    for factor in STEP_SCALES:
        sim = simulate(derive(base, mode=Mode.pdd), traces[Mode.pdd], scaled_perf(perfs[Mode.pdd], factor), a.seed).records()
        ttft = [r.ttft_s * 1000 for r in sim]
        for q in (50, 90):
            sensitivity[f"server_ttft_p{q}_rel"].append(percentile(ttft, q) / real[Mode.pdd.value][f"server_ttft_p{q}"] - 1)
    console.print(
        "pdd TTFT at the conductor, twin / real - 1, with every step x "
        + ", ".join(f"{f:g}" for f in STEP_SCALES)
        + ":\n"
        + "\n".join(f"  p{q}: " + ", ".join(f"{x:+.0%}" for x in sensitivity[f"server_ttft_p{q}_rel"]) for q in (50, 90))
    )

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt
        import numpy as np

        fig, ax = plt.subplots(figsize=(7, 4))
        styles = {"real": "-", "twin": "--", "twin, one factor": ":"}
        for mode, series in ttfts.items():
            for label, values in series.items():
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), styles[label], label=f"{mode} {label}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT at the conductor (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title("real runs vs calibrated twin on this machine, same traces")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    summary = {
        "real": real,
        "twin": twin,
        "ttft_p50_rel_err": abs(pdd["server_ttft_p50"]),
        "ttft_p90_rel_err": abs(pdd["server_ttft_p90"]),
        "client_ttft_p50_rel_err": abs(pdd["ttft_p50"]),
        "client_ttft_p90_rel_err": abs(pdd["ttft_p90"]),
        "rel": rel,
        "calibration": calibration,
        "host_sharing": bool(baseline),
        "goal_met": ok,
        "twin_one_factor": baseline,
        "rel_one_factor": rel_baseline,
        "step_scale_sensitivity": sensitivity,
        "perf": {mode.value: ({r: m.__dict__ for r, m in p.items()} if isinstance(p, dict) else p.__dict__) for mode, p in perfs.items()},
    }
    out_rows = [
        {
            "mode": mode,
            "figure": k,
            "real": real[mode][k],
            "twin": twin[mode][k],
            "rel": rel[mode].get(k),
            **({"twin_one_factor": baseline[mode][k], "rel_one_factor": rel_baseline[mode].get(k)} if baseline else {}),
        }
        for mode in real
        for k, _ in FIGURES
    ]
    csv_path = write_outputs("sim_vs_real", out_rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

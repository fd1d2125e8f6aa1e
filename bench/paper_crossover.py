"""Does PDD start to pay as outputs grow? paper_table's PDD vs intra-DC H100 PD at longer outputs.

In paper_table, decode is a small share of PDD's cost (V4-Pro's decode step
is one weight read shared by hundreds of sequences, and outputs average ~550
tokens), so the H200s' cheaper decode cannot buy back the prefill replicas PDD
gives up, and PDD sustains fewer requests in SLA than intra-DC PD. The paper's
deployment had decode on 43% of its GPUs. This sweep asks at what output
length the twin's comparison turns PDD's way, with every other parameter as
paper_table has it: each output-length scale multiplies the output median and
cap; for each, both systems get their best split (PDD at 3.5-7.1% lower cost)
and PDD its best routing threshold and relay cap, as in paper_table.

A session's next turn waits for the previous answer streamed at the SLO's TPOT
(`answer_s_per_output_token`) on top of its think time: without it, turns of
long answers come due before their predecessor finishes even on an idle
cluster, and the run's end cuts them off. So the first point (paper_table's
outputs) is not paper_table's run: its sessions are longer.

Prints one row per scale (fleets, RPS in SLA, ratios, decode's share of cost,
TTFT at each system's peak) and where the RPS and BCR ratios cross 1 and where
decode reaches the paper's share of cost (log-linear between the points that
bracket it); writes bench/out/paper_crossover.{csv,png}.

    python bench/paper_crossover.py [--scales 1,2,4] [--seeds 1] [--warmup-s 450] [--window-s 300] [--wan-gbps 40] [--cold-start]
                                    [--jobs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.table import Table

from app.ops import progress
from app.sim.cluster import cost_per_hour
from app.sim.run import TimedTraffic
from app.sim.workload import AgenticWorkload
from bench.common import median, write_outputs
from bench.paper_table import (
    PAPER,
    PAPER_DECODE_SHARE,
    WORKLOAD,
    add_run_arguments,
    as_generated,
    best_intra_and_pdd,
    console,
    decode_cost,
    fleet,
    load_base,
    timed_traffic,
    wan_link_gbps,
)


def scaled_outputs(w: AgenticWorkload, scale: float, answer_s_per_token: float) -> AgenticWorkload:
    return w.model_copy(
        update={
            "output_median": max(1, round(w.output_median * scale)),
            "output_max": max(1, round(w.output_max * scale)),
            "answer_s_per_output_token": answer_s_per_token,
        }
    )


def crossing(xs: list[float], ys: list[float], level: float) -> float | None:
    """First x (log-linear between neighbours) where ys crosses `level`, either way; None when it never does."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 != y1 and min(y0, y1) < level <= max(y0, y1):
            return math.exp(math.log(x0) + (level - y0) / (y1 - y0) * (math.log(x1) - math.log(x0)))
    return None


def point(base, t: TimedTraffic, seeds: int, scale_replicas: int) -> dict:
    """Best fleets for one workload, then both systems searched on every seed."""
    (intra_cfg, intra_rps), (pdd_cfg, pdd_rps) = best_intra_and_pdd(base, t, scale_replicas)
    figs: dict[str, dict[str, list[float]]] = {"pdd": {}, "intra": {}}
    systems = (("pdd", pdd_cfg, pdd_rps), ("intra", intra_cfg, intra_rps))
    searches = [(name, cfg, seed, max(1.0, 0.6 * known)) for seed in range(seeds) for name, cfg, known in systems]
    with progress.steps(console, "RPS in SLA per seed", len(searches)) as step:
        found_all = t.searches([search for _, *search in searches], on_done=lambda i, r: step(f"seed {searches[i][2]} {searches[i][0]}: {r.rps:.2f} RPS"))
    for (name, *_), found in zip(searches, found_all):
        f = figs[name]
        f.setdefault("rps", []).append(found.rps)
        if found.summary is not None:
            for q, v in zip((50, 90, 99), found.summary.ttft_s):
                f.setdefault(f"ttft{q}", []).append(v)
            f.setdefault("relay_share", []).append(found.summary.relay_share)
    med = {n: {k: median(v) for k, v in f.items()} for n, f in figs.items()}
    w = t.workload
    p, i = med["pdd"], med["intra"]
    pdd_cost, intra_cost = cost_per_hour(pdd_cfg), cost_per_hour(intra_cfg)
    return {
        "output_median": w.output_median,
        "output_max": w.output_max,
        "mean_output_tokens": as_generated(w)["mean_output_tokens"],
        "pdd_fleet": fleet(pdd_cfg),
        "pdd_threshold_ms": pdd_cfg.routing.max_wan_transfer_ms,
        "pdd_relay_cap_tokens": pdd_cfg.handoff.relay_cap_tokens,
        "intra_fleet": fleet(intra_cfg),
        "pdd_rps": p["rps"],
        "intra_rps": i["rps"],
        "pdd_cost": pdd_cost,
        "intra_cost": intra_cost,
        "rps_ratio": p["rps"] / i["rps"],
        "bcr_ratio": (p["rps"] / pdd_cost) / (i["rps"] / intra_cost),
        **{f"ttft{q}_ratio": p.get(f"ttft{q}", math.nan) / i.get(f"ttft{q}", math.nan) for q in (50, 90, 99)},
        **{f"pdd_ttft{q}": p.get(f"ttft{q}", math.nan) for q in (50, 90, 99)},
        **{f"intra_ttft{q}": i.get(f"ttft{q}", math.nan) for q in (50, 90, 99)},
        "pdd_decode_share": decode_cost(pdd_cfg) / pdd_cost,
        "intra_decode_share": decode_cost(intra_cfg) / intra_cost,
        "relay_share_of_tokens": p.get("relay_share", math.nan),
    }


def show(rows: list[dict]) -> None:
    t = Table(title="PDD vs intra-DC H100 PD as outputs grow (twin; medians over seeds)")
    for col in (
        "output median / mean",
        "intra-DC fleet",
        "PDD fleet",
        "RPS in SLA intra / PDD",
        "RPS ratio",
        "BCR ratio",
        "TTFT p50 / p90 / p99 ratio",
        "decode share intra / PDD",
        "relay tokens",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r['output_median']:,} / {r['mean_output_tokens']:,.0f}",
            r["intra_fleet"],
            r["pdd_fleet"],
            f"{r['intra_rps']:.2f} / {r['pdd_rps']:.2f}",
            f"{r['rps_ratio']:.3f}",
            f"{r['bcr_ratio']:.3f}",
            f"{r['ttft50_ratio']:.2f} / {r['ttft90_ratio']:.2f} / {r['ttft99_ratio']:.2f}",
            f"{r['intra_decode_share']:.0%} / {r['pdd_decode_share']:.0%}",
            f"{r['relay_share_of_tokens']:.1%}",
        )
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,2,4", help="output-length multipliers of paper_table's workload, comma-separated")
    ap.add_argument("--seeds", type=int, default=1)
    add_run_arguments(ap)
    a = ap.parse_args()
    try:
        scales = sorted(float(s) for s in a.scales.split(","))
    except ValueError:
        ap.error(f"--scales: expected comma-separated numbers, got {a.scales!r}")
    if not scales or scales[0] <= 0:
        ap.error("--scales: every multiplier must be above 0")

    base = load_base(a)
    answer_s = base.slo.tpot_ms / 1000
    t0 = time.perf_counter()
    rows = []
    for k, scale in enumerate(scales, 1):
        t = timed_traffic(scaled_outputs(WORKLOAD, scale, answer_s), a)
        w = t.workload
        console.rule(f"[{k}/{len(scales)}] outputs x{scale:g}: median {w.output_median:,}, cap {w.output_max:,} ({time.perf_counter() - t0:.0f} s so far)")
        rows.append({"scale": scale, **point(base, t, a.seeds, a.scale)})
        show(rows)

    means = [r["mean_output_tokens"] for r in rows]
    found = {
        "rps_ratio_crosses_1_at_mean_output": crossing(means, [r["rps_ratio"] for r in rows], 1.0),
        "bcr_ratio_crosses_1_at_mean_output": crossing(means, [r["bcr_ratio"] for r in rows], 1.0),
        "pdd_decode_share_crosses_paper_at_mean_output": crossing(means, [r["pdd_decode_share"] for r in rows], PAPER_DECODE_SHARE),
    }
    for key, value in found.items():
        console.print(f"{key.replace('_', ' ')}: " + (f"~{value:,.0f} tokens" if value else "not within the sweep"))

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        left.plot(means, [r["rps_ratio"] for r in rows], "o-", label="RPS in SLA")
        left.plot(means, [r["bcr_ratio"] for r in rows], "s-", label="BCR")
        left.plot(means, [r["ttft50_ratio"] for r in rows], "^--", label="TTFT p50 at own peak")
        left.axhline(1.0, color="grey", lw=0.8)
        left.axhline(PAPER["pdd_rps"] / PAPER["intra_rps"], color="C0", lw=0.8, ls=":", label="paper: RPS in SLA")
        left.set_xscale("log")
        left.set_xlabel("mean output tokens per turn")
        left.set_ylabel("PDD / intra-DC H100 PD")
        left.legend(fontsize=8)
        right.plot(means, [r["pdd_decode_share"] for r in rows], "o-", label="PDD (H200 MD)")
        right.plot(means, [r["intra_decode_share"] for r in rows], "s-", label="intra-DC (H100 D)")
        right.axhline(PAPER_DECODE_SHARE, color="grey", lw=0.8, ls=":", label=f"paper: {PAPER['decode_gpus'][0]} of {PAPER['decode_gpus'][1]} GPUs")
        right.set_xscale("log")
        right.set_xlabel("mean output tokens per turn")
        right.set_ylabel("decode's share of the fleet's cost")
        right.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    summary = {
        "seeds": a.seeds,
        "warmup_s": a.warmup_s,
        "window_s": a.window_s,
        "scale": a.scale,
        "wan_link_gbps": wan_link_gbps(base),
        "answer_s_per_output_token": answer_s,
        "rows": rows,
        **found,
        "wall_s": time.perf_counter() - t0,
    }
    csv_path = write_outputs("paper_crossover", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

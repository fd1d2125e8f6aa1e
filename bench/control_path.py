"""What each mode adds to a cached turn's TTFT on an idle app: the control path.

A cached agentic turn (3000 tokens already on the replicas, a few new ones)
costs one short prefill step, so its TTFT at the conductor is mostly the
serving stack: routing, the policy, engine calls and whatever the request waits
for before prefill. Turns go one at a time, `--gap-s` apart (longer than any
per-second refresh of the conductor's views, so a refresh on the request path
would show), through the modes in turn, on bench/pipelines.py's config.
Colocated (one engine call) is the baseline; pdd and pd_intra_dc should cost
about the same.

    python bench/control_path.py [--rounds 3] [--turns 8] [--gap-s 1.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.common import LocalApp, completion_journey, median, percentile, wait_http, write_outputs
from bench.pipelines import bench_args

console = Console(width=140)
MODES = ("colocated", "pd_intra_dc", "pdd")
PROMPT_TOKENS = 3000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the modes (alternating, so machine noise hits all alike)")
    ap.add_argument("--turns", type=int, default=8, help="cached turns per mode per round")
    ap.add_argument("--gap-s", type=float, default=1.5, help="idle time before each turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    rows: list[dict] = []
    with LocalApp(bench_args(), name="control-path") as app:
        wait_http(f"{app.base_url}/health")
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("cached turns", total=a.rounds * len(MODES) * a.turns)
            for round_ in range(a.rounds):
                for mode in MODES:
                    prompt = [rng.randrange(3, 400) for _ in range(PROMPT_TOKENS)]
                    completion_journey(app.base_url, prompt, mode, ignore_eos=True)  # the first turn fills the caches
                    for _ in range(a.turns):
                        time.sleep(a.gap_s)
                        prompt = prompt + [rng.randrange(3, 400) for _ in range(rng.randint(1, 32))]
                        journey = completion_journey(app.base_url, prompt, mode, ignore_eos=True)
                        if journey.get("error") or journey.get("ttft_ms") is None:
                            raise SystemExit(f"{mode}: request {journey.get('request_id')} failed: {journey.get('error')}")
                        rows.append(
                            {
                                "round": round_,
                                "mode": mode,
                                "pipeline": journey["pipeline"],
                                "prompt_tokens": len(prompt),
                                "hit_tokens": max(journey["hit_tokens"].values(), default=0),
                                "ttft_ms": journey["ttft_ms"],
                            }
                        )
                        bar.advance(task)

    ttft = {mode: [r["ttft_ms"] for r in rows if r["mode"] == mode] for mode in MODES}
    base = median(ttft["colocated"])
    table = Table(title=f"cached turns ({PROMPT_TOKENS}-token prefix, 1-32 new tokens) one at a time, {a.gap_s:g} s apart: TTFT at the conductor")
    for col in ("mode", "turns", "TTFT p50 ms", "p90 ms", "p50 vs colocated", "pipelines"):
        table.add_column(col, justify="right")
    summary: dict = {"rounds": a.rounds, "turns": a.turns, "gap_s": a.gap_s}
    for mode in MODES:
        p50 = median(ttft[mode])
        pipelines = sorted({r["pipeline"] for r in rows if r["mode"] == mode})
        table.add_row(mode, str(len(ttft[mode])), f"{p50:.1f}", f"{percentile(ttft[mode], 90):.1f}", f"{p50 / base:.2f}x", ", ".join(pipelines))
        summary[f"{mode}_ttft_p50_ms"] = p50
        summary[f"{mode}_over_colocated"] = p50 / base
    console.print(table)

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot([ttft[m] for m in MODES])
        ax.set_xticks(range(1, len(MODES) + 1), MODES)
        ax.set_ylabel("TTFT at the conductor (ms)")
        ax.set_title("cached turns on an idle app")
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("control_path", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""WAN bytes and transfer time over a multi-turn conversation, swept over prefix-hit rates.

For each hit rate h, a conversation's second turn keeps the first h of the
first turn's prompt and replaces the rest, so the main decoder already holds
exactly floor(h * L / block) blocks. The second turn then runs twice on the same
engines: P-MD (pdd-serve pulls only the blocks MD lacks) and pd_cross_dc_naive
(the whole prompt KV crosses the WAN). Bytes are counted on the link relay's
real byte stream; the floor is the blocks MD lacks x bytes per block; transfer
time is compared with the link model (RTT + bytes / bandwidth).

The encrypted column (bench/kv_tls.py, after the Ray app has stopped): WAN pull
time and intra-DC throughput with mutual TLS vs plaintext, at the transport
level. `--tls-only` runs just that, without Ray.

    python bench/kv_transfer.py [--tokens 2048] [--repeats 3] [--json out.json]
    python bench/kv_transfer.py --tls-only [--tls-repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import LinkConfig
from app.engine.kv.link import LinkModel
from bench import kv_tls
from bench.common import median, write_outputs

console = Console(width=150)
HIT_RATES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
WAN = "dc-a->dc-b"
BLOCK = 32


def bench_args(bandwidth_mbps: float, rtt_ms: float) -> dict:
    from tests.conftest import local_args, set_wan

    args = local_args()
    # every request goes P-MD: this benchmark measures what crosses the WAN, not the relay
    args["routing"] = {"max_wan_transfer_ms": 1e9}
    set_wan(args, bandwidth_mbps, rtt_ms)
    return args


def wan_transfer(journey: dict) -> dict:
    transfers = [t for t in journey["transfers"] if t["link"] == WAN]
    assert len(transfers) == 1 and transfers[0]["ok"], journey["transfers"]
    return transfers[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of each turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-mbps", type=float, default=40.0)
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--tls-only", action="store_true", help="only the encrypted column (bench/kv_tls.py): no Ray app")
    ap.add_argument("--tls-repeats", type=int, default=9, help="alternating TLS / plaintext pairs per measure")
    a = ap.parse_args()
    if a.tls_only:
        tls_rows, tls_summary = kv_tls.run(a.bandwidth_mbps, a.rtt_ms, a.tls_repeats, console)
        csv_path = write_outputs("kv_transfer_tls", tls_rows, tls_summary, a.json_path)
        console.print(f"wrote {csv_path}")
        return

    from app.ops.faults import Faults
    from bench.common import LocalApp, completion_journey, wait_http

    args = bench_args(a.bandwidth_mbps, a.rtt_ms)
    link = LinkModel(LinkConfig(between=("dc-a", "dc-b"), bandwidth_mbps=a.bandwidth_mbps, rtt_ms=a.rtt_ms))
    rng = random.Random(0)
    rows = []
    with LocalApp(args, name="kvbench") as app:
        wait_http(f"{app.base_url}/health")
        from ray import serve

        block_bytes = serve.get_deployment_handle("MainDecode", app_name="kvbench").describe.remote().result().kv_bytes_per_block

        def wan_bytes() -> int:
            return Faults("kvbench").link_counters(WAN)["bytes_down"]

        total = len(HIT_RATES) * a.repeats
        for i, h in enumerate(HIT_RATES):
            for rep in range(a.repeats):
                L = a.tokens
                turn1 = [rng.randrange(10, 500) for _ in range(L)]
                keep = int(h * L)
                turn2 = turn1[:keep] + [rng.randrange(10, 500) for _ in range(L - keep)]
                completion_journey(app.base_url, turn1)  # MD and P now hold turn 1
                before = wan_bytes()
                ours = wan_transfer(completion_journey(app.base_url, turn2))
                ours_bytes = wan_bytes() - before
                before = wan_bytes()
                naive = wan_transfer(completion_journey(app.base_url, turn2, mode="pd_cross_dc_naive"))
                naive_bytes = wan_bytes() - before
                minimum = (math.ceil(L / BLOCK) - keep // BLOCK) * block_bytes
                rows.append(
                    {
                        "hit_rate": h,
                        "repeat": rep,
                        "blocks_sent": ours["blocks"],
                        "min_bytes": minimum,
                        "our_wan_bytes": ours_bytes,
                        "naive_wan_bytes": naive_bytes,
                        "our_seconds": ours["seconds"],
                        "model_seconds": link.transfer_seconds(ours["bytes"]),
                        "naive_seconds": naive["seconds"],
                    }
                )
                console.print(
                    f"[{i * a.repeats + rep + 1}/{total}] hit {h:.0%}: {ours['blocks']} blocks, {ours_bytes / 1e6:.2f} MB vs naive {naive_bytes / 1e6:.2f} MB, {ours['seconds'] * 1000:.0f} ms"
                )

    table = Table(title=f"KV over the WAN ({a.bandwidth_mbps:g} Mbit/s, {a.rtt_ms:g} ms RTT), {a.tokens}-token turns, medians of {a.repeats}")
    for col in ("MD hit", "blocks sent", "ours MB", "minimum MB", "ours/min", "naive MB", "naive/ours", "ours ms", "link model ms", "measured/model"):
        table.add_column(col, justify="right")
    summary_rows = []
    for h in HIT_RATES:
        rs = [r for r in rows if r["hit_rate"] == h]
        ours_b = median([r["our_wan_bytes"] for r in rs])
        min_b = median([r["min_bytes"] for r in rs])
        naive_b = median([r["naive_wan_bytes"] for r in rs])
        ours_s = median([r["our_seconds"] for r in rs])
        model_s = median([r["model_seconds"] for r in rs])
        summary_rows.append({"hit_rate": h, "ours_over_min": ours_b / min_b, "naive_over_ours": naive_b / ours_b, "measured_over_model": ours_s / model_s})
        table.add_row(
            f"{h:.0%}",
            f"{median([r['blocks_sent'] for r in rs]):.0f}",
            f"{ours_b / 1e6:.2f}",
            f"{min_b / 1e6:.2f}",
            f"{ours_b / min_b:.4f}",
            f"{naive_b / 1e6:.2f}",
            f"{naive_b / ours_b:.1f}x",
            f"{ours_s * 1000:.0f}",
            f"{model_s * 1000:.0f}",
            f"{ours_s / model_s:.2f}",
        )
    console.print(table)
    at90 = next(r for r in summary_rows if r["hit_rate"] == 0.9)
    summary = {
        "bytes_over_min_max": max(r["ours_over_min"] for r in summary_rows),
        "naive_over_ours_at_90": at90["naive_over_ours"],
        "measured_over_model_median": median([r["measured_over_model"] for r in summary_rows]),
        "by_hit_rate": summary_rows,
    }
    console.print(
        f"bytes over the minimum: at most {summary['bytes_over_min_max']:.4f}x (goal <= 1.05x); "
        f"naive / ours at 90% hit: {summary['naive_over_ours_at_90']:.1f}x (goal >= 9x)"
    )

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        hs = [r["hit_rate"] * 100 for r in summary_rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("our_wan_bytes", "pdd-serve"), ("naive_wan_bytes", "naive cross-DC PD"), ("min_bytes", "minimum (blocks MD lacks)")):
            ax.plot(hs, [median([r[key] for r in rows if r["hit_rate"] * 100 == h]) / 1e6 for h in hs], marker="o", label=label)
        ax.set_xlabel("MD prefix hit (%)")
        ax.set_ylabel("MB over the WAN per turn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    tls_rows, tls_summary = kv_tls.run(a.bandwidth_mbps, a.rtt_ms, a.tls_repeats, console)
    summary.update(tls_summary)
    tls_csv = write_outputs("kv_transfer_tls", tls_rows, {}, None)
    csv_path = write_outputs("kv_transfer", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path}, {csv_path.with_suffix('.png')} and {tls_csv}")


if __name__ == "__main__":
    main()

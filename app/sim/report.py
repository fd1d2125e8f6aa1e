"""Figures of a run: latency percentiles, SLA goodput, cost, BCR, WAN use."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from app.config import PDDConfig, SLOConfig
from app.sim.cluster import cost_per_hour
from app.sim.results import PIPELINES, Results


@dataclass(frozen=True)
class Summary:
    requests: int
    """Requests measured (arrived after the warm-up)."""
    window_s: float
    """From the end of the warm-up to the last scheduled arrival."""
    offered_rps: float
    ttft_s: tuple[float, float, float]
    """p50, p90, p99."""
    tpot_s: tuple[float, float, float]
    gap_s: tuple[float, float, float]
    worst_gap_s: float
    slo_attainment: float
    """Share of requests meeting the TTFT, TPOT and gap targets together. A turn its
    session held back past the last scheduled arrival misses them: the cluster fell
    behind its sessions, and only the quiet after the arrivals let it through."""
    sla_goodput_rps: float
    """Requests per second that met the SLO."""
    cost_per_hour: float
    bcr: float
    """SLA goodput per unit of hardware cost: requests/s per $/h."""
    wan_gbps: float
    """KV the measured requests sent over the WAN, per second of the window: their demand
    on it, counted when each pull is asked for. Above the link's bandwidth a backlog grows."""
    prefill_hit: float
    """Token-weighted prefix hit at prefill."""
    decode_hit: float
    """Token-weighted prefix hit at the decoder that finished each request (MD in PDD)."""
    relay_share: float
    """Share of output tokens the relay decoder produced."""
    pipelines: dict[str, int] = field(default_factory=dict)

    def meets(self, slo: SLOConfig) -> bool:
        """The SLO holds at its percentile: that share of requests met every target."""
        return self.requests > 0 and self.slo_attainment >= slo.percentile / 100

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Results, config: PDDConfig, warmup: float = 0.1) -> Summary:
    """Figures over requests starting after the first `warmup` share of the arrivals (caches fill then);
    rates over the window from there to the last scheduled arrival."""
    import numpy as np

    a = results.arrays()
    arrival = a["arrival"]
    if len(arrival) == 0:
        raise ValueError("no requests were simulated")
    start, end = results.measured(warmup)
    keep = arrival >= start
    window = max(end - start, 1e-9)
    m = {k: v[keep] for k, v in a.items()}
    n = int(keep.sum())
    slo = config.slo
    tpot = m["tpot"]
    # a turn held back past the last scheduled arrival started only once the arrivals had
    # stopped: its session fell behind, and the quiet after the run must not serve it well
    in_time = m["arrival"] <= end
    ok = in_time & (m["ttft"] <= slo.ttft_ms / 1000) & ((tpot <= slo.tpot_ms / 1000) | np.isnan(tpot)) & (m["gap"] <= slo.max_gap_ms / 1000)
    met = int(ok.sum())

    def pct(v: Any) -> tuple[float, float, float]:
        v = v[~np.isnan(v)]
        if not len(v):
            return (float("nan"),) * 3
        q: Any = np.percentile(v, [50, 90, 99])  # an array of the three (read as a scalar where numpy's types are skipped)
        p50, p90, p99 = (float(x) for x in q)
        return p50, p90, p99

    cost = cost_per_hour(config)
    goodput = met / window
    prompt = max(int(m["prompt"].sum()), 1)
    codes, counts = np.unique(m["pipe"], return_counts=True)
    return Summary(
        requests=n,
        window_s=float(window),
        offered_rps=n / window,
        ttft_s=pct(m["ttft"]),
        tpot_s=pct(tpot),
        gap_s=pct(m["gap"]),
        worst_gap_s=float(m["gap"].max()) if n else float("nan"),
        slo_attainment=met / n if n else 0.0,
        sla_goodput_rps=goodput,
        cost_per_hour=cost,
        bcr=goodput / cost if cost else float("nan"),
        wan_gbps=float(m["wan"].sum()) * 8 / 1e9 / window,
        prefill_hit=float(m["p_hit"].sum()) / prompt,
        decode_hit=float(m["d_hit"].sum()) / prompt,
        relay_share=float(m["relay"].sum()) / max(int(m["output"].sum()), 1),
        pipelines={PIPELINES[int(c)].value: int(k) for c, k in zip(codes, counts)},
    )


def summary_table(rows: list[tuple[str, Summary]], title: str = "digital twin"):
    """A rich table, one column per run."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    for label, _ in rows:
        table.add_column(label, justify="right")

    def line(name: str, fn) -> None:
        table.add_row(name, *(fn(s) for _, s in rows))

    def ms(v: float) -> str:
        return f"{v * 1000:,.0f}"

    line("requests measured", lambda s: f"{s.requests:,}")
    line("offered RPS", lambda s: f"{s.offered_rps:.2f}")
    for i, q in enumerate(("p50", "p90", "p99")):
        line(f"TTFT {q} (ms)", lambda s, i=i: ms(s.ttft_s[i]))
    for i, q in enumerate(("p50", "p90", "p99")):
        line(f"TPOT {q} (ms)", lambda s, i=i: f"{s.tpot_s[i] * 1000:.1f}")
    line("gap p99 (ms)", lambda s: ms(s.gap_s[2]))
    line("worst gap (ms)", lambda s: ms(s.worst_gap_s))
    line("SLO attainment", lambda s: f"{s.slo_attainment:.1%}")
    line("SLA goodput (req/s)", lambda s: f"{s.sla_goodput_rps:.2f}")
    line("GPU cost ($/h)", lambda s: f"{s.cost_per_hour:,.1f}")
    line("BCR (req/s per $/h)", lambda s: f"{s.bcr:.4f}")
    line("WAN (Gbps)", lambda s: f"{s.wan_gbps:.1f}")
    line("prefix hit P / decoder", lambda s: f"{s.prefill_hit:.1%} / {s.decode_hit:.1%}")
    line("relay share of tokens", lambda s: f"{s.relay_share:.1%}")
    line("pipelines", lambda s: " ".join(f"{k}:{v}" for k, v in sorted(s.pipelines.items())))
    return table


def plot_ttft_cdf(path, runs: list[tuple[str, Results]], warmup: float = 0.1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, res in runs:
        a = res.arrays()
        keep = a["arrival"] >= res.measured(warmup)[0]
        v = np.sort(a["ttft"][keep])
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF (digital twin)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bathtub(path, points: list[dict[str, float]], label: str) -> None:
    """Benefit against hit rate, one point per simulated hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p["hit_rate"] for p in points], [p["benefit"] * 100 for p in points], color="C0")
    styles: tuple[tuple[float, dict[str, Any]], ...] = ((0.0, {"marker": "o", "color": "C0"}), (1.0, {"marker": "o", "facecolors": "none", "edgecolors": "C3"}))
    for overloaded, style in styles:
        pts = [p for p in points if p.get("overloaded", 0.0) == overloaded]
        if pts:
            ax.scatter(
                [p["hit_rate"] for p in pts],
                [p["benefit"] * 100 for p in pts],
                zorder=3,
                label="SLO met by both" if not overloaded else "SLO missed (queueing)",
                **style,
            )
    ax.legend()
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("prefix hit rate of follow-up turns")
    ax.set_ylabel("benefit (%)")
    ax.set_title(label)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

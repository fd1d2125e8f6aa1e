"""The paper's comparison on the digital twin: PDD vs intra-DC homogeneous PD vs naive cross-DC PD.

A DeepSeek-V4-pro-like MoE (DeepSeek-V3 figures) on H100s (P, RLD; datacenter
A) and H200s (MD; datacenter B) across a 100 Gb/s, 30 ms WAN, on a 64K-context,
~90%-hit agentic workload. Every figure comes from serve_configs/gpu_h100_h200.yaml
(sources in its comments) or from the workload settings printed below; nothing
is fitted to the paper's results. Our figures stand beside the paper's
(../shared/PDD.md); the last table checks that every comparison points the
same way and shows the size of each gap.

Protocol. Every system gets its best whole-replica split (highest RPS meeting
the SLO) among fleets costing at most the budget (7 H100 replicas by default,
~100 GPUs, near the paper's 75; the 100 Gb/s WAN carries PDD's KV at that
scale): PDD keeps one relay replica and splits the rest between P and MD;
the intra-DC baselines
put P and D on one GPU type in one datacenter (H100 in A, or H200 in B); naive
cross-DC PD uses PDD's P and MD fleets without the relay. Splits are chosen
on the first seed and kept for the others. TTFT percentiles compare systems
at one offered load all of them sustain: the lowest RPS in SLA of PDD and
the intra-DC baselines (PDD vs intra), and the naive baseline's (PDD vs
naive, also WAN use). Figures are medians over seeds.

    python bench/paper_table.py [--seeds 3] [--requests 12000] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import MODE_ROLES, Mode, PDDConfig, RoleName, Roles, load_config
from app.sim.cluster import cost_per_hour, derive
from app.sim.run import SearchResult, agentic_at, goodput_search, simulate
from app.sim.workload import AgenticWorkload, hit_rate
from bench.common import ROOT, median, write_outputs

console = Console(width=160)
CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"

#: ../shared/PDD.md, "Reported results (DeepSeek-V4-pro, real agentic trace, 64K context, 90% hit)".
PAPER = {
    "intra_rps": 9.0, "pdd_rps": 11.5,
    "cost_change": (-0.071, -0.035), "bcr_change": (0.324, 0.375),
    "intra_ttft": (3.9, 10.4, 17.2), "pdd_ttft": (4.2, 9.8, 14.4), "naive_ttft": (6.7, 18.3, 29.7),
    "raw_wan_gbps": 180.0, "wan_cut": 10.0,
}

WORKLOAD = AgenticWorkload(
    first_prompt_median=32_768,   # "64K context": contexts start at half the window and grow to it
    max_context_tokens=65_536,
    output_median=400,            # assumption: agentic turns are tool calls and short answers
)


def parameters(base: PDDConfig, w: AgenticWorkload) -> list[tuple[str, str, str]]:
    m = base.model.spec
    groups = base.node_groups
    wan = base.link("dc-a", "dc-b")
    return [
        ("model", f"{m.total_params_b:g}B total, {m.active_params_b:g}B active, {m.weight_bytes_per_param:g} B/param",
         "DeepSeek-V3 config.json / tech report (V4-pro figures are not public)"),
        ("KV bytes per token", f"{m.kv_bytes_per_token:,}", "MLA latent 61 x (512 + 64) x 2 bytes"),
        ("attention FLOPs per token pair", f"{m.attention_flops_per_token_pair:,.0f}", "2 x 61 layers x 128 heads x (192 + 128)"),
        ("H100 replica", f"{groups['h100-a'].num_gpus:g} GPUs, ${groups['h100-a'].cost_per_hour:g}/h",
         "datasheet 989 TFLOP/s, 3.35 TB/s, 80 GB; weights need two nodes; $3.00/GPU-h (2026 specialty-cloud midpoint)"),
        ("H200 replica", f"{groups['h200-b'].num_gpus:g} GPUs, ${groups['h200-b'].cost_per_hour:g}/h",
         "datasheet 989 TFLOP/s, 4.8 TB/s, 141 GB; $4.00/GPU-h (same source)"),
        ("compute / bandwidth efficiency", f"{groups['h100-a'].spec.compute_efficiency:g} / {groups['h100-a'].spec.bandwidth_efficiency:g}",
         "DeepSeek inference-system note (prefill tokens/s per H800 node) / assumption"),
        ("WAN", f"{wan.bandwidth_mbps / 1000:g} Gb/s, {wan.rtt_ms:g} ms RTT, lognormal jitter {wan.jitter.mean_ms:g} ms, "
         f"stall p={wan.stall.probability:g} x {wan.stall.duration_ms:g} ms", "one 100G DCI wavelength; ~1,500 km of fibre; TCP assumptions"),
        ("routing / handoff", f"P-MD when WAN <= {base.routing.max_wan_transfer_ms:g} ms; {base.handoff.mode.value}, "
         f"cap {base.handoff.relay_cap_tokens}", "config defaults"),
        ("SLO", f"p{base.slo.percentile:g}: TTFT <= {base.slo.ttft_ms / 1000:g} s, TPOT <= {base.slo.tpot_ms:g} ms, gap <= {base.slo.max_gap_ms / 1000:g} s",
         "the paper's TTFT P90s sit near 10 s; TPOT and gap: assumptions"),
        ("workload", f"{w.requests:,} requests per run; sessions of {w.turns_min}-{w.turns_max} turns; first prompt median "
         f"{w.first_prompt_median:,}, window {w.max_context_tokens:,}; output median {w.output_median}; think "
         f"{w.think_time_min_s:g}+exp({w.think_time_mean_s:g}) s", "PDD.md: 64K context, ~90% hit, >95% for most turns, low-hit tail"),
    ]


def _roles(base: PDDConfig, p: int, p_group: str, d: int, d_group: str, d_role: str, relay: int = 0) -> Roles:
    rc = base.roles
    out = {"prefill": rc.prefill.model_copy(update={"node_group": p_group, "replicas": p}),
           d_role: rc.main_decode.model_copy(update={"node_group": d_group, "replicas": d})}
    if relay:
        out["relay_decode"] = rc.relay_decode.model_copy(update={"replicas": relay})
    return Roles(**out)


def split_families(base: PDDConfig, budget: float) -> dict[str, tuple[range, object]]:
    """For each system: the prefill replica counts it may use, and the config for a count
    (the rest of the budget in whole decode replicas)."""
    ca, cb = base.node_groups["h100-a"].cost_per_hour, base.node_groups["h200-b"].cost_per_hour

    def pdd(p: int) -> PDDConfig:
        return derive(base, roles=_roles(base, p, "h100-a", int((budget - (p + 1) * ca) // cb), "h200-b", "main_decode", relay=1))

    def intra(group: str, cost: float):
        n = int(budget // cost)
        return lambda p: derive(base, mode=Mode.pd_intra_dc, roles=_roles(base, p, group, n - p, group, "relay_decode"))

    n_a, n_b = int(budget // ca), int(budget // cb)
    return {
        "PDD": (range(1, int((budget - ca - cb) // ca) + 1), pdd),
        "intra-DC H100": (range(1, n_a), intra("h100-a", ca)),
        "intra-DC H200": (range(1, n_b), intra("h200-b", cb)),
    }


def best_split(name: str, counts: range, make, w: AgenticWorkload) -> PDDConfig:
    """Integer ternary search over the prefill count: RPS in SLA rises with prefill until
    decode binds, then falls (unimodal), so few splits need a full goodput search."""
    seen: dict[int, float] = {}

    def rps(p: int) -> float:
        if p not in seen:
            c = make(p)
            seen[p] = search(c, w, 0, lo=max(seen.values(), default=2.0) * 0.5).rps
            console.print(f"  split {name:14s} {fleet(c):46s} ${cost_per_hour(c):6.0f}/h: {seen[p]:6.2f} RPS in SLA")
        return seen[p]

    lo, hi = counts.start, counts.stop - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if rps(m1) < rps(m2):
            lo = m1 + 1
        elif rps(m1) > rps(m2):
            hi = m2 - 1
        else:
            lo, hi = m1, m2
    best = max(range(lo, hi + 1), key=rps)
    return make(best)


def fleet(c: PDDConfig) -> str:
    parts = []
    for role, rc in c.roles.present().items():
        if role in MODE_PARTS[c.mode]:
            g = c.node_groups[rc.node_group]
            # intra-DC PD decodes on the relay_decode role: it is the plain decoder there
            short = "D" if c.mode is Mode.pd_intra_dc and role is RoleName.relay_decode else ROLE_SHORT[role.value]
            parts.append(f"{rc.replicas}x{g.num_gpus:g} {g.accelerator} {short}")
    return " + ".join(parts)


def fleet_of(c: PDDConfig, role: str) -> str:
    g = c.node_groups[c.roles.get(RoleName(role)).node_group]
    return f"{g.num_gpus:g}-GPU {g.accelerator}"


ROLE_SHORT = {"prefill": "P", "relay_decode": "RLD", "main_decode": "MD"}
MODE_PARTS = {m: set(r) for m, r in MODE_ROLES.items()}


def search(c: PDDConfig, w: AgenticWorkload, seed: int, lo: float = 2.0) -> SearchResult:
    return goodput_search(c, agentic_at(w.model_copy(update={"seed": seed})), lo=lo, rel_tol=0.03, seed=seed)


def at_load(c: PDDConfig, w: AgenticWorkload, rps: float, seed: int):
    return simulate(c, w.model_copy(update={"seed": seed, "rps": rps}), seed=seed).summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20_000, help="requests per simulated run")
    ap.add_argument("--budget-replicas", type=int, default=7,
                    help="budget per system in H100 replicas (7: ~100 GPUs, the paper's deployment is 75)")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    base = load_config(CONFIG)
    w = WORKLOAD.model_copy(update={"requests": a.requests})
    budget = a.budget_replicas * base.node_groups["h100-a"].cost_per_hour
    t0 = time.perf_counter()

    sample = list(w.generate())
    hits = [hit_rate(r) for r in sample]
    realized = {
        "mean_prompt_tokens": sum(r.prompt_tokens for r in sample) / len(sample),
        "mean_hit": sum(hits) / len(hits),
        "share_hit_over_95": sum(h > 0.95 for h in hits) / len(hits),
        "share_hit_under_50": sum(h < 0.5 for h in hits) / len(hits),
    }
    params = Table(title="parameters and their sources")
    for col in ("parameter", "value", "source"):
        params.add_column(col)
    for row in parameters(base, w):
        params.add_row(*row)
    params.add_row("workload as generated", f"mean prompt {realized['mean_prompt_tokens']:,.0f} tokens, mean hit {realized['mean_hit']:.1%}, "
                   f"{realized['share_hit_over_95']:.0%} of turns > 95%, {realized['share_hit_under_50']:.1%} < 50%", "this run")
    params.add_row("budget per system", f"${budget:g}/h", f"{a.budget_replicas} H100 replicas; PDD's one relay replica is "
                   f"{base.node_groups['h100-a'].cost_per_hour / budget:.0%} of it (paper: 3 of 75 GPUs, 4%)")
    console.print(params)

    # ---- splits, chosen on the first seed --------------------------------------------
    chosen = {name: best_split(name, counts, make, w) for name, (counts, make) in split_families(base, budget).items()}
    pdd = chosen["PDD"]
    chosen["naive cross-DC"] = derive(pdd, mode=Mode.pd_cross_dc_naive)
    systems = list(chosen)

    # ---- per seed: RPS in SLA, then TTFT at common loads ---------------------------------
    per_seed: list[dict[str, dict[str, float]]] = []
    for seed in range(a.seeds):
        figs: dict[str, dict[str, float]] = {}
        for name in systems:
            c = chosen[name]
            found = search(c, w, seed)
            figs[name] = {"rps": found.rps, "cost": cost_per_hour(c), "bcr": found.rps / cost_per_hour(c)}
        load_intra = min(figs[n]["rps"] for n in ("PDD", "intra-DC H100", "intra-DC H200"))
        load_naive = figs["naive cross-DC"]["rps"]
        for name in ("PDD", "intra-DC H100", "intra-DC H200"):
            s = at_load(chosen[name], w, load_intra, seed)
            figs[name].update(ttft50=s.ttft_s[0], ttft90=s.ttft_s[1], ttft99=s.ttft_s[2], load_intra=load_intra)
        for name in ("PDD", "naive cross-DC"):
            s = at_load(chosen[name], w, load_naive, seed)
            figs[name].update(naive_ttft50=s.ttft_s[0], naive_ttft90=s.ttft_s[1], naive_ttft99=s.ttft_s[2],
                              wan_gbps=s.wan_gbps, relay_share=s.relay_share, load_naive=load_naive)
        per_seed.append(figs)
        console.print(f"seed {seed}: " + ", ".join(f"{n} {figs[n]['rps']:.2f} RPS" for n in systems))

    med = {n: {k: median([f[n][k] for f in per_seed]) for k in per_seed[0][n]} for n in systems}
    show_tables(med, chosen, a.seeds)
    checks = directions(med)
    show_checks(checks)
    relay_cost = base.node_groups[chosen["PDD"].roles.relay_decode.node_group].cost_per_hour * chosen["PDD"].roles.relay_decode.replicas
    relay_share = relay_cost / med["PDD"]["cost"]
    # what the relay would cost at the paper's share of the fleet (3 of 75 GPUs); its work is unchanged
    paper_relay_cost = (med["PDD"]["cost"] - relay_cost) / (1 - 3 / 75)
    counterfactual = {
        "relay_share_of_cost": relay_share,
        "pdd_bcr_with_paper_relay_share": med["PDD"]["rps"] / paper_relay_cost,
        "vs_intra_h100": med["PDD"]["rps"] / paper_relay_cost / med["intra-DC H100"]["bcr"],
        "vs_intra_h200": med["PDD"]["rps"] / paper_relay_cost / med["intra-DC H200"]["bcr"],
    }
    console.print(
        f"where the gap comes from: PDD's relay is one {fleet_of(chosen['PDD'], 'relay_decode')} replica, {relay_share:.0%} of its cost "
        f"(the weights need two H100 nodes; the paper's relay is 3 of 75 GPUs, 4%) and it produced {med['PDD']['relay_share']:.1%} of the "
        f"tokens (paper ~6%: our WAN moves most misses within the P-MD threshold). Counterfactual, not a result: at the paper's relay "
        f"share PDD's BCR would be {counterfactual['vs_intra_h100']:.3f}x the H100 baseline's and {counterfactual['vs_intra_h200']:.3f}x the H200 one's."
    )

    rows = [{"system": n, "fleet": fleet(chosen[n]), **med[n]} for n in systems]
    summary = {"seeds": a.seeds, "requests_per_run": a.requests, "workload": realized, "systems": rows, "checks": checks,
               "counterfactual_paper_relay_share": counterfactual,
               "directions_matched": sum(c["match"] for c in checks), "directions_total": len(checks),
               "wall_s": time.perf_counter() - t0}

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        labels = [c["comparison"] for c in checks]
        y = range(len(labels))
        axes[0].barh([i + 0.2 for i in y], [c["paper"] for c in checks], height=0.4, label="paper")
        axes[0].barh([i - 0.2 for i in y], [c["twin"] for c in checks], height=0.4, label="twin")
        axes[0].axvline(1.0, color="grey", lw=0.8)
        axes[0].set_yticks(list(y), labels, fontsize=7)
        axes[0].set_xlabel("ratio (PDD / baseline)")
        axes[0].legend()
        for i, name in enumerate(("PDD", "intra-DC H100", "intra-DC H200")):
            axes[1].bar([k + i * 0.27 for k in range(3)], [med[name][f"ttft{q}"] for q in (50, 90, 99)], width=0.27, label=name)
        axes[1].set_xticks([0.27, 1.27, 2.27], ["p50", "p90", "p99"])
        axes[1].set_ylabel(f"TTFT (s) at {med['intra-DC H100']['load_intra']:.1f} RPS")
        axes[1].legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("paper_table", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s)")


def show_tables(med: dict, chosen: dict, seeds: int) -> None:
    t = Table(title=f"twin vs paper (medians of {seeds} seeds)")
    for col in ("figure", "paper PDD", "twin PDD", "paper intra-DC", "twin intra H100", "twin intra H200", "paper naive", "twin naive"):
        t.add_column(col, justify="right")
    p = PAPER
    t.add_row("fleet", "43 A + 32 B GPUs", fleet(chosen["PDD"]), "", fleet(chosen["intra-DC H100"]), fleet(chosen["intra-DC H200"]), "",
              fleet(chosen["naive cross-DC"]))
    t.add_row("RPS in SLA", f"{p['pdd_rps']}", f"{med['PDD']['rps']:.2f}", f"{p['intra_rps']}", f"{med['intra-DC H100']['rps']:.2f}",
              f"{med['intra-DC H200']['rps']:.2f}", "", f"{med['naive cross-DC']['rps']:.2f}")
    t.add_row("cost ($/h)", "-3.5..-7.1% vs intra", f"{med['PDD']['cost']:.0f}", "", f"{med['intra-DC H100']['cost']:.0f}",
              f"{med['intra-DC H200']['cost']:.0f}", "", f"{med['naive cross-DC']['cost']:.0f}")
    t.add_row("BCR (RPS per $/h)", "+32.4..37.5% vs intra", f"{med['PDD']['bcr']:.4f}", "", f"{med['intra-DC H100']['bcr']:.4f}",
              f"{med['intra-DC H200']['bcr']:.4f}", "", f"{med['naive cross-DC']['bcr']:.4f}")
    load = med["intra-DC H100"]["load_intra"]
    for i, q in enumerate((50, 90, 99)):
        t.add_row(f"TTFT p{q} (s) @ {load:.1f} RPS", f"{p['pdd_ttft'][i]}", f"{med['PDD'][f'ttft{q}']:.2f}", f"{p['intra_ttft'][i]}",
                  f"{med['intra-DC H100'][f'ttft{q}']:.2f}", f"{med['intra-DC H200'][f'ttft{q}']:.2f}", "", "")
    nl = med["naive cross-DC"]["load_naive"]
    for i, q in enumerate((50, 90, 99)):
        t.add_row(f"TTFT p{q} (s) @ {nl:.1f} RPS", f"{p['pdd_ttft'][i]}", f"{med['PDD'][f'naive_ttft{q}']:.2f}", "", "", "",
                  f"{p['naive_ttft'][i]}", f"{med['naive cross-DC'][f'naive_ttft{q}']:.2f}")
    t.add_row(f"WAN (Gb/s) @ {nl:.1f} RPS", f"~1/{p['wan_cut']:g} of raw", f"{med['PDD']['wan_gbps']:.1f}", "", "0", "0",
              f"raw > {p['raw_wan_gbps']:g}", f"{med['naive cross-DC']['wan_gbps']:.1f}")
    t.add_row("relay share of tokens", "~6%", f"{med['PDD']['relay_share']:.1%}", "", "", "", "", "")
    console.print(t)


def directions(med: dict) -> list[dict]:
    """Each comparison the paper makes: its ratio, ours, and whether both point the same way."""
    p = PAPER
    pdd = med["PDD"]
    out = []

    def add(comparison: str, paper: float, twin: float) -> None:
        # a tie is no direction: it matches neither "higher" nor "lower"
        match = (paper - 1) * (twin - 1) > 0
        out.append({"comparison": comparison, "paper": paper, "twin": twin, "match": match})

    for base in ("intra-DC H100", "intra-DC H200"):
        b = med[base]
        add(f"RPS in SLA vs {base}", p["pdd_rps"] / p["intra_rps"], pdd["rps"] / b["rps"])
        add(f"cost vs {base}", 1 + sum(p["cost_change"]) / 2, pdd["cost"] / b["cost"])
        add(f"BCR vs {base}", 1 + sum(p["bcr_change"]) / 2, pdd["bcr"] / b["bcr"])
        for i, q in enumerate((50, 90, 99)):
            add(f"TTFT p{q} vs {base}", p["pdd_ttft"][i] / p["intra_ttft"][i], pdd[f"ttft{q}"] / b[f"ttft{q}"])
    n = med["naive cross-DC"]
    for i, q in enumerate((50, 90, 99)):
        add(f"TTFT p{q} vs naive", p["pdd_ttft"][i] / p["naive_ttft"][i], pdd[f"naive_ttft{q}"] / n[f"naive_ttft{q}"])
    add("WAN Gb/s vs naive", 1 / p["wan_cut"], pdd["wan_gbps"] / n["wan_gbps"])
    return out


def show_checks(checks: list[dict]) -> None:
    t = Table(title="every comparison: ratio PDD / baseline (paper beside twin)")
    for col in ("comparison", "paper", "twin", "same direction", "gap (twin - paper)"):
        t.add_column(col, justify="right")
    for c in checks:
        t.add_row(c["comparison"], f"{c['paper']:.3f}", f"{c['twin']:.3f}", "yes" if c["match"] else "[red]NO[/red]",
                  f"{c['twin'] - c['paper']:+.3f}")
    console.print(t)
    console.print(f"{sum(c['match'] for c in checks)} of {len(checks)} comparisons point the paper's way")


if __name__ == "__main__":
    main()

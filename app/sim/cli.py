"""`pdd sim CONFIG`: run the digital twin on a serve config and report.

    pdd sim serve_configs/gpu_h100_h200.yaml --rps 6 --requests 20000
    pdd sim CONFIG --compare pd_intra_dc --compare pd_cross_dc_naive
    pdd sim CONFIG --search              # highest RPS meeting the config's SLO
    pdd sim CONFIG --sweep-hit           # benefit vs hit rate (bathtub) plot
    pdd sim CONFIG --workload trace.jsonl --perf fitted.json

`pdd calibrate CONFIG` measures a real engine of CONFIG on this machine and
writes the fitted step-time model `--perf` reads (app/sim/calibrate.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from app.config import ConfigError, Mode, PDDConfig, RoleName, load_config
from app.sim.calibrate import with_model_spec
from app.sim.cluster import SimConfigError, derive
from app.sim.report import Summary, plot_bathtub, plot_ttft_cdf, summary_table
from app.sim.run import SimRun, Workload, agentic_at, goodput_search, hit_sweep, scaled, simulate
from app.sim.workload import AgenticWorkload, read_trace

console = Console()
cli = typer.Typer(help="Digital twin: simulate a serve config at datacenter scale.", no_args_is_help=True)

HIT_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def _workload(spec: str, rps: float, requests: int, seed: int) -> tuple[AgenticWorkload | None, Workload]:
    """(generator settings or None for a trace, what to simulate)."""
    if spec == "agentic":
        w = AgenticWorkload(requests=requests, rps=rps, seed=seed)
        return w, w
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        import yaml

        w = AgenticWorkload.model_validate({"requests": requests, "rps": rps, "seed": seed, **(yaml.safe_load(path.read_text()) or {})})
        return w, w
    return None, path


def _run(config: PDDConfig, workload: Workload, total: int, perf, seed: int, label: str) -> SimRun:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(label, total=total or None)
        run = simulate(config, workload, perf, seed, progress=lambda n: bar.update(task, completed=n))
    return run


def sim(
    config_path: Path = typer.Argument(..., help="Serve config YAML (its mode is simulated)"),
    workload: str = typer.Option("agentic", help="`agentic`, a generator settings file (.yaml/.json: AgenticWorkload fields) or a trace (.jsonl)"),
    rps: float = typer.Option(4.0, help="Offered requests per second (agentic workloads)"),
    requests: int = typer.Option(5000, help="Requests to simulate (agentic workloads)"),
    seed: int = typer.Option(0, help="Seed of the workload and the link draws"),
    mode: Mode | None = typer.Option(None, help="Simulate this mode instead of the config's"),
    compare: list[Mode] = typer.Option([], help="Also simulate these modes on the same workload (repeatable)"),
    perf: Path | None = typer.Option(None, help="Fitted perf model JSON (app/sim/perf.py) for every node group"),
    warmup: float = typer.Option(0.1, help="Share of the run's start left out of the figures (caches fill)"),
    search: bool = typer.Option(False, help="Also search the highest RPS meeting the SLO (bisection)"),
    sweep_hit: bool = typer.Option(False, "--sweep-hit", help="Also sweep the hit rate and plot the benefit (bathtub)"),
    baseline: Mode = typer.Option(Mode.pd_cross_dc_naive, help="Baseline mode of the hit-rate sweep"),
    out: Path = typer.Option(Path("bench/out"), help="Folder for plots"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the figures as JSON here"),
) -> None:
    """Simulate CONFIG on a workload; print TTFT/TPOT percentiles, SLA goodput, cost, BCR, WAN use."""
    try:
        config = load_config(config_path)
        if mode is not None:
            config = derive(config, mode=mode)
        configs = [config] + [derive(config, mode=m) for m in compare if m is not config.mode]
        template, wl = _workload(workload, rps, requests, seed)
        perf_model = None
        if perf is not None:
            from app.sim.perf import FittedPerf

            perf_model = FittedPerf.from_json(perf.read_text())
            configs = [with_model_spec(c) for c in configs]
        if template is None:
            wl = list(read_trace(wl))
        runs = []
        for c in configs:
            total = len(wl) if isinstance(wl, list) else requests
            runs.append((c.mode.value, _run(c, wl, total, perf_model, seed, f"simulating {c.mode.value}")))
    except (ConfigError, SimConfigError, ValueError, OSError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None

    summaries = [(label, r.summary(warmup)) for label, r in runs]
    console.print(summary_table(summaries, f"digital twin: {config_path.name}"))
    out.mkdir(parents=True, exist_ok=True)
    cdf = out / "sim_ttft_cdf.png"
    plot_ttft_cdf(cdf, [(label, r.results) for label, r in runs], warmup)
    doc: dict = {"runs": {label: s.as_dict() for label, s in summaries}}
    written = [cdf]

    if search:
        if template is None:
            base_rps = len(wl) / max(wl[-1].arrival_s - wl[0].arrival_s, 1e-9)
            def at(target: float, trace=wl):
                return scaled(trace, target / base_rps)
        else:
            at = agentic_at(template)
        doc["search"] = {}
        for c in configs:
            with console.status(f"goodput search: {c.mode.value}") as status:
                def note(r: float, s: Summary, status=status, c=c) -> None:
                    status.update(f"goodput search {c.mode.value}: {r:.2f} RPS -> SLO attainment {s.slo_attainment:.1%}")
                found = goodput_search(c, at, lo=min(0.5, rps), perf=perf_model, seed=seed, warmup=warmup, on_probe=note)
            cost = found.summary.cost_per_hour if found.summary else float("nan")
            console.print(f"{c.mode.value}: highest RPS meeting the SLO (p{c.slo.percentile:g}: TTFT <= {c.slo.ttft_ms:g} ms, "
                          f"TPOT <= {c.slo.tpot_ms:g} ms, gap <= {c.slo.max_gap_ms:g} ms): [bold]{found.rps:.2f}[/bold]"
                          f"  (BCR {found.rps / cost:.4f} per $/h)")
            doc["search"][c.mode.value] = {"rps": found.rps, "probes": found.probes}

    if sweep_hit:
        if template is None:
            console.print("[yellow]--sweep-hit needs a generated workload, not a trace[/yellow]")
        else:
            base_cfg = derive(config, mode=baseline)
            with console.status("hit-rate sweep") as status:
                points = hit_sweep(config, base_cfg, template, HIT_GRID, perf=perf_model, seed=seed, warmup=warmup,
                                   on_point=lambda p: status.update(f"hit-rate sweep: {p['hit_rate']:.0%} -> benefit {p['benefit']:+.1%}"))
            tub = out / "sim_bathtub.png"
            plot_bathtub(tub, points, f"{config.mode.value} vs {baseline.value}: 1 - TTFT p90 ratio at {template.rps:g} RPS")
            written.append(tub)
            doc["hit_sweep"] = points
            for p in points:
                note = "  (SLO missed: queueing dominates)" if p["overloaded"] else ""
                console.print(f"  hit {p['hit_rate']:>4.0%}: benefit {p['benefit']:+.1%}{note}")

    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2, default=float))
        written.append(json_path)
    console.print("wrote " + ", ".join(str(p) for p in written))


cli.command("sim")(sim)


def calibrate(
    config_path: Path = typer.Argument(..., help="Serve config YAML whose engine is measured"),
    role: RoleName = typer.Option(RoleName.prefill, help="Role whose engine arguments are used"),
    out: Path = typer.Option(Path("bench/out/fitted_perf.json"), help="Fitted model JSON (for `pdd sim --perf`)"),
    samples_path: Path | None = typer.Option(None, "--samples", help="Also write the measured steps here"),
) -> None:
    """Measure one real engine of CONFIG (prefill, prefill after a cached prefix, decode) and fit the twin's step-time model."""
    from app.sim.calibrate import calibrate as fit
    from app.sim.perf import save_samples

    try:
        config = load_config(config_path)
        with console.status("calibrating") as status:
            perf, samples = fit(config, role, progress=lambda msg: status.update(f"calibrating: {msg}"))
    except (ConfigError, ValueError, KeyError, OSError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(perf.to_json())
    if samples_path is not None:
        save_samples(samples_path, samples)
    console.print(f"{len(samples)} steps measured: {perf.describe()}")
    console.print(f"wrote {out}" + (f" and {samples_path}" if samples_path else ""))

if __name__ == "__main__":
    cli()

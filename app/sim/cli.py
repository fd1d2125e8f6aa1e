"""`pdd sim CONFIG`: run the digital twin on a serve config and report.

    pdd sim serve_configs/gpu_h100_h200.yaml --rps 6 --requests 20000
    pdd sim CONFIG --compare pd_intra_dc --compare pd_cross_dc_naive
    pdd sim CONFIG --search              # highest RPS meeting the config's SLO
    pdd sim CONFIG --sweep-hit           # benefit vs hit rate (bathtub) plot
    pdd sim CONFIG --workload trace.jsonl --perf fitted.json
    pdd sim CONFIG --compare pd_intra_dc --search -j 4   # independent runs on 4 processes

`pdd calibrate CONFIG` measures a real engine of CONFIG on this machine and
writes the fitted step-time model `--perf` reads (app/sim/calibrate.py).
`pdd calibrate CONFIG --from-app pdd` then scales that model per role to the
steps the engines of the running app timed while serving (roles with
`engine.record_steps`): steps run slower where engines share a host. The
serving overhead of the app's journeys (TTFT outside the engines' cores),
fitted as a base plus a share per other request in flight, goes on the model
of the role requests enter by.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console

from app.config import Mode, PDDConfig, RoleName
from app.config.file import ConfigError, format_validation_error, load_config
from app.sim.calibrate import with_model_spec
from app.sim.cluster import PerfArg, SimConfigError, derive, entry_role
from app.sim.parallel import Report, check_jobs, run_all
from app.sim.perf import FittedPerf
from app.sim.report import plot_bathtub, plot_ttft_cdf, summary_table
from app.sim.run import SearchResult, SimRun, Workload, agentic_at, goodput_search, hit_sweep, simulate, trace_at
from app.sim.workload import AgenticWorkload, Request, check_window, fitted_to_window, read_trace

console = Console()
cli = typer.Typer(help="Digital twin: simulate a serve config at datacenter scale.", no_args_is_help=True)

HIT_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def _workload(spec: str, rps: float, requests: int, seed: int, max_model_len: int) -> tuple[AgenticWorkload | None, Workload]:
    """(generator settings or None for a trace, what to simulate)."""

    def settings(fields: dict, source: str) -> AgenticWorkload:
        try:
            return AgenticWorkload.model_validate({"requests": requests, "rps": rps, "seed": seed, **fields})
        except ValidationError as err:
            raise ValueError(format_validation_error(err, what=f"workload ({source})")) from None

    if spec == "agentic":
        w = fitted_to_window(settings({}, "options"), max_model_len)
        return w, w
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        import yaml

        fields = yaml.safe_load(path.read_text()) or {}
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: expected a mapping of AgenticWorkload fields, got a {type(fields).__name__}")
        w = settings(fields, str(path))
        check_window(w, max_model_len)
        return w, w
    trace = list(read_trace(path))
    if not trace:
        raise ValueError(f"{path}: the trace holds no requests")
    return None, trace


def _simulate(run: tuple[PDDConfig, Workload, PerfArg, int, bool], report: Report) -> SimRun:
    config, workload, perf, seed, warm_start = run
    return simulate(config, workload, perf, seed, progress=report, warm_start=warm_start)


def _simulate_each(configs: list[PDDConfig], workload: Workload, total: int, perf, seed: int, warm_start: bool, jobs: int) -> list[SimRun]:
    """One run per config, on up to `jobs` processes, a progress bar each."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks = [bar.add_task(f"simulating {c.mode.value}", total=total or None) for c in configs]
        return run_all(
            _simulate, [(c, workload, perf, seed, warm_start) for c in configs], jobs=jobs, on_progress=lambda i, n: bar.update(tasks[i], completed=n)
        )


def _search(search: tuple[PDDConfig, Callable[[float], Iterable[Request]], float, PerfArg, int, float, bool], report: Report) -> SearchResult:
    config, at, lo, perf, seed, warmup, warm_start = search
    return goodput_search(
        config, at, lo=lo, perf=perf, seed=seed, warmup=warmup, warm_start=warm_start, on_probe=lambda rps, s: report((rps, s.slo_attainment))
    )


def sim(
    config_path: Path = typer.Argument(..., help="Serve config YAML (its mode is simulated)"),
    workload: str = typer.Option("agentic", help="`agentic`, a generator settings file (.yaml/.json: AgenticWorkload fields) or a trace (.jsonl)"),
    rps: float = typer.Option(4.0, help="Offered requests per second (agentic workloads)"),
    requests: int = typer.Option(5000, help="Requests to simulate (agentic workloads)"),
    seed: int = typer.Option(0, help="Seed of the workload and the link draws"),
    mode: Mode | None = typer.Option(None, help="Simulate this mode instead of the config's"),
    compare: list[Mode] = typer.Option([], help="Also simulate these modes on the same workload (repeatable)"),
    perf: Path | None = typer.Option(None, help="Fitted perf model JSON (app/sim/perf.py `load_perf`): one for every role, or one per role"),
    warmup: float = typer.Option(0.1, help="Share of the run's start left out of the figures (queues and caches fill)"),
    cold_start: bool = typer.Option(
        False,
        "--cold-start",
        help="Start with empty prefix caches (a fresh deployment) instead of holding "
        "the contexts of conversations already under way (a cluster that has been serving them)",
    ),
    search: bool = typer.Option(False, help="Also search the highest RPS meeting the SLO on a 3% grid of loads, confirmed below its answer"),
    sweep_hit: bool = typer.Option(False, "--sweep-hit", help="Also sweep the hit rate and plot the benefit (bathtub)"),
    baseline: Mode = typer.Option(Mode.pd_cross_dc_naive, help="Baseline mode of the hit-rate sweep"),
    out: Path = typer.Option(Path("bench/out"), help="Folder for plots"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the figures as JSON here"),
    jobs: int | None = typer.Option(
        None,
        "--jobs",
        "-j",
        help="Processes for independent runs (the modes compared, their searches, "
        "the sweep's points); default: every CPU. The figures are the same for any number",
    ),
) -> None:
    """Simulate CONFIG on a workload; print TTFT/TPOT percentiles, SLA goodput, cost, BCR, WAN use."""
    try:
        jobs = check_jobs(jobs)
        if not 0 <= warmup < 1:
            raise ValueError(f"--warmup: {warmup:g} is not a share of the run in [0, 1)")
        config = load_config(config_path)
        if mode is not None:
            config = derive(config, mode=mode)
        configs = [config] + [derive(config, mode=m) for m in dict.fromkeys(compare) if m is not config.mode]
        template, wl = _workload(workload, rps, requests, seed, config.model.max_model_len)
        at = _replayed_at(workload, template, wl) if search else None
        perf_model = None
        if perf is not None:
            from app.sim.perf import load_perf

            perf_model = load_perf(perf)
            configs = [with_model_spec(c) for c in configs]
        total = len(wl) if isinstance(wl, list) else requests
        runs = list(zip([c.mode.value for c in configs], _simulate_each(configs, wl, total, perf_model, seed, not cold_start, jobs)))
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
    if at is not None:
        doc["search"] = _goodput_search(configs, [(c, at, min(0.5, rps), perf_model, seed, warmup, not cold_start) for c in configs], jobs)
    if sweep_hit:
        if template is None:
            console.print("[yellow]--sweep-hit needs a generated workload, not a trace[/yellow]")
        else:
            sweep = dict(perf=perf_model, seed=seed, warmup=warmup, warm_start=not cold_start, jobs=jobs)
            doc["hit_sweep"] = _sweep_hit(config, derive(config, mode=baseline), template, out / "sim_bathtub.png", sweep)
            written.append(out / "sim_bathtub.png")
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2, default=float))
        written.append(json_path)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _replayed_at(workload: str, template: AgenticWorkload | None, wl: Any) -> Callable[[float], Any]:
    """The workload at another load, for the goodput search."""
    if template is not None:
        return agentic_at(template)
    try:
        return trace_at(wl)
    except ValueError as err:
        raise ValueError(f"--search replays {workload} faster and slower, but {err}") from None


def _goodput_search(configs: list[PDDConfig], searches: list[tuple], jobs: int) -> dict[str, dict]:
    """Each mode's highest RPS meeting the SLO, printed with its BCR as the searches go."""
    latest = {c.mode.value: "starting" for c in configs}
    with console.status("goodput search") as status:

        def note(i: int, probe: tuple[float, float]) -> None:
            latest[configs[i].mode.value] = f"{probe[0]:.2f} RPS -> SLO attainment {probe[1]:.1%}"
            status.update("goodput search: " + "; ".join(f"{mode} {text}" for mode, text in latest.items()))

        found_all = run_all(_search, searches, jobs=jobs, on_progress=note)
    found_by_mode = {}
    for c, found in zip(configs, found_all):
        cost = found.summary.cost_per_hour if found.summary else float("nan")
        console.print(
            f"{c.mode.value}: highest RPS meeting the SLO (p{c.slo.percentile:g}: TTFT <= {c.slo.ttft_ms:g} ms, "
            f"TPOT <= {c.slo.tpot_ms:g} ms, gap <= {c.slo.max_gap_ms:g} ms): [bold]{found.rps:.2f}[/bold]"
            f"  (BCR {found.rps / cost:.4f} per $/h)"
        )
        found_by_mode[c.mode.value] = {"rps": found.rps, "probes": found.probes}
    return found_by_mode


def _sweep_hit(config: PDDConfig, base_cfg: PDDConfig, template: AgenticWorkload, plot: Path, sweep: dict[str, Any]) -> list[dict]:
    """The benefit over the baseline across hit rates (the bathtub), plotted and printed."""
    with console.status("hit-rate sweep") as status:

        def on_point(p: dict) -> None:
            status.update(f"hit-rate sweep: {p['hit_rate']:.0%} -> benefit {p['benefit']:+.1%}")

        points = hit_sweep(config, base_cfg, template, HIT_GRID, on_point=on_point, **sweep)
    plot_bathtub(plot, points, f"{config.mode.value} vs {base_cfg.mode.value}: 1 - TTFT p90 ratio at {template.rps:g} RPS")
    for p in points:
        note = "  (SLO missed: queueing dominates)" if p["overloaded"] else ""
        console.print(f"  hit {p['hit_rate']:>4.0%}: benefit {p['benefit']:+.1%}{note}")
    return points


cli.command("sim")(sim)


def calibrate(
    config_path: Path = typer.Argument(..., help="Serve config YAML whose engine is measured"),
    role: RoleName = typer.Option(RoleName.prefill, help="Role whose engine arguments are used"),
    from_app: str | None = typer.Option(
        None,
        "--from-app",
        help="Instead, fit --base per role to the steps this running Serve app's engines timed (engine.record_steps), with the slowdown engines sharing the host cause each other",
    ),
    base: Path = typer.Option(Path("bench/out/fitted_perf.json"), help="With --from-app: the model of an engine measured alone (`pdd calibrate CONFIG`)"),
    address: str | None = typer.Option(None, help="With --from-app: its Ray cluster (default: the one `pdd run` started)"),
    url: str = typer.Option(
        "http://127.0.0.1:8000",
        help="With --from-app: its HTTP address, for the journeys that give the serving overhead and KV pull cost (PDD_API_KEY for auth)",
    ),
    out: Path | None = typer.Option(
        None, help="Fitted model JSON for `pdd sim --perf` (default: bench/out/fitted_perf.json; with --from-app, fitted_perf_app.json beside it)"
    ),
    samples_path: Path | None = typer.Option(None, "--samples", help="Also write the measured steps here"),
) -> None:
    """Fit the twin's step-time model to one real engine of CONFIG, or (--from-app) to a running app's engines.

    Alone: measure prefill, prefill after a cached prefix, and decode. With --from-app: fit that model per role to the steps the app's engines timed while serving (and how busy engines on one host slow each other), and add its journeys' serving overhead, decoder request overhead and KV transport cost.
    """
    from app.sim.perf import save_samples

    try:
        config = load_config(config_path)
        if from_app is not None:
            out = out or base.with_name("fitted_perf_app.json")
            text, summary, samples = _calibrate_from_app(config, config_path, base, from_app, address, url)
        else:
            out = out or Path("bench/out/fitted_perf.json")
            text, summary, samples = _calibrate_alone(config, role)
    except (ConfigError, ValueError, KeyError, OSError, ConnectionError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if samples_path is not None:
        save_samples(samples_path, samples)
    console.print(summary)
    console.print(f"wrote {out}" + (f" and {samples_path}" if samples_path else ""))


def _calibrate_alone(config: PDDConfig, role: RoleName) -> tuple[str, str, list]:
    """One engine of `role` measured alone: the model's JSON, a summary, the steps measured."""
    from app.ops.progress import steps
    from app.sim.calibrate import DECODE_SHAPES, PREFILL_TOKENS, PREFIX_SHAPES
    from app.sim.calibrate import calibrate as fit

    with steps(console, "calibrating", 1 + len(PREFILL_TOKENS) + len(PREFIX_SHAPES) + len(DECODE_SHAPES)) as step:
        perf, samples = fit(config, role, progress=lambda msg: step(msg, f"  {msg}"))
    return perf.to_json(), f"{len(samples)} steps measured: {perf.describe()}", samples


def _calibrate_from_app(config: PDDConfig, config_path: Path, base: Path, app_name: str, address: str | None, url: str) -> tuple[str, str, list]:
    """`base` fitted per role to a running app's timed steps, plus its journeys' serving overhead,
    KV pull cost and decoder request overhead: the models' JSON, a summary, the steps used."""
    from app.sim.calibrate import app_journeys
    from app.sim.fitting import decoder_request_overheads, kv_pulls, serving_overheads, with_decoder_overhead, with_kv_pull, with_serving_overhead
    from app.sim.perf import load_perf, roles_to_json

    if not any(rc.engine.record_steps for rc in config.roles.present().values()):
        raise ValueError("no role of the config has engine.record_steps: set it (and redeploy) so the engines time their steps")
    if not base.exists():
        raise ValueError(f"--base {base} is missing: measure an engine alone first (`pdd calibrate {config_path}`)")
    base_model = load_perf(base)
    if not isinstance(base_model, FittedPerf):
        raise ValueError(f"--base {base}: one model of an engine alone is needed, not one per role")
    fits, samples = _fit_from_app(base_model, app_name, address)
    journeys = app_journeys(url)
    overheads, pulls = serving_overheads(journeys, config.mode), kv_pulls(journeys, config)
    models = with_serving_overhead({role: fit.model for role, fit in fits.items()}, config.mode, overheads)
    models = with_kv_pull(models, config.mode, pulls)
    decoder_overheads = decoder_request_overheads(journeys, config.mode)
    models = with_decoder_overhead(models, config.mode, decoder_overheads)
    summary = "\n".join(
        f"{role}: {len(samples[role])} timed steps, {fit.describe()}"
        if fit.factor is not None
        else f"[yellow]{role}: only {len(samples[role])} timed steps: kept at the engine alone's model (send more traffic and run again)[/yellow]"
        for role, fit in fits.items()
    )
    entry = entry_role(config.mode).value
    summary += (
        f"\nserving overhead: {models[entry].serving_overhead_ms:.1f} ms a request + "
        f"{models[entry].serving_overhead_ms_per_in_flight:.1f} ms per other request in flight (fitted to {len(overheads)} "
        f"{config.mode.value} requests' TTFT outside the engines' cores), on {entry}'s model"
        if overheads
        else f"\n[yellow]no {config.mode.value} request in {url}/pdd/requests: no serving overhead (send traffic and run again)[/yellow]"
    )
    if pulls:
        summary += (
            f"\nKV pulls: {models[entry].kv_pull_ms:.1f} ms + {models[entry].kv_pull_ms_per_mb:.2f} ms/MB beyond the link "
            f"(fitted to {len(pulls)} pulls inside a datacenter), on {entry}'s model"
        )
    if decoder_overheads:
        summary += (
            f"\ndecoder request overhead: {models[entry].decoder_request_overhead_ms:.1f} ms (median of "
            f"{len(decoder_overheads)} decoder requests), on {entry}'s model"
        )
    return roles_to_json(models), summary, [s for samples_of in samples.values() for s in samples_of]


def _fit_from_app(base: FittedPerf, app_name: str, address: str | None):
    """`base` fitted per role to the steps the app's engines timed (left with them: a later call sees these and more)."""
    from app.ops.cluster import connected
    from app.sim.calibrate import take_app_steps
    from app.sim.fitting import fit_to_app_steps

    with connected(address):
        steps = take_app_steps(app_name, clear=False)
    if not steps:
        raise ValueError(f"no engine replica of Serve app {app_name!r} is running on {address}")
    return fit_to_app_steps(base, steps), {role.value: samples for role, samples in steps.items()}


if __name__ == "__main__":
    cli()

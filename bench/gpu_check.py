"""The GPU path in one prepared run, for a machine with one CUDA GPU.

From a fresh checkout: install with EXTRAS=gpu,test, then, with all three roles'
engines on the one GPU (each with a share of its memory):
1. token identity: tests/integration/test_gpu.py (every pipeline and handoff
   mode returns the colocated tokens, greedy and seeded with penalties; every
   engine runs the V1 model runner its start check accepts);
2. bench/pipelines.py --gpu: the four modes on a short agentic trace, dummy
   weights of an 8B Llama shape;
3. bench/serve_overhead.py --gpu: our serving stack against vLLM's own server.
Everything goes under one folder (default bench/out/gpu_check-DATE): each
step's log, the benches' JSON, CSV and plots, nvidia-smi's view, summary.json.
A step that fails is reported and the next still runs; the exit status is
non-zero if any failed. Each step has a time limit; together they fit in 8
minutes, install included, on a machine that reaches the package index.

    python3 bench/gpu_check.py [--out DIR] [--skip-install | --python PATH] [--dry-run]

`--dry-run` prints every step and checks, without a GPU, that the commands,
flags, configs and files it would use exist.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    """Each step's share of the 8-minute run."""
    what: str
    script: Path | None = None
    """The Python script argv runs, whose flags --dry-run checks."""
    env: dict[str, str] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    """Files the step writes under the run's folder."""


def steps(out: Path, skip_install: bool, python: Path = VENV_PYTHON) -> list[Step]:
    py = str(python)
    bench_out = {"PDD_BENCH_OUT": str(out)}
    plan = [
        Step("gpu", ["nvidia-smi"], 10, "the card, its driver and memory", outputs=("gpu.log",)),
        Step("install", ["make", "install", "EXTRAS=gpu,test"], 140, "venv with CUDA vLLM and the test tools (make install)", outputs=("install.log",)),
        Step(
            "identity",
            [py, "-m", "pytest", "tests/integration/test_gpu.py", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={out / 'identity.xml'}"],
            130,
            "token identity across every pipeline and handoff mode, greedy and seeded with penalties (float32 dev model)",
            env={"PDD_REQUIRE_GPU": "1"},
            outputs=("identity.log", "identity.xml"),
        ),
        Step(
            "pipelines",
            [py, "bench/pipelines.py", "--gpu", "--requests", "24", "--rps", "2", "--calibration-requests", "0", "--json", str(out / "pipelines.json")],
            110,
            "colocated, pd_intra_dc, pd_cross_dc_naive and pdd on one agentic trace (8B-shaped dummy weights)",
            script=ROOT / "bench" / "pipelines.py",
            env=bench_out,
            outputs=("pipelines.log", "pipelines.json", "pipelines.csv", "pipelines.png"),
        ),
        Step(
            "serve_overhead",
            [py, "bench/serve_overhead.py", "--gpu", "--rounds", "2", "--requests-c1", "6", "--requests-c16", "32", "--json", str(out / "serve_overhead.json")],
            90,
            "our stack against vLLM's own OpenAI server, same engine arguments and environment",
            script=ROOT / "bench" / "serve_overhead.py",
            env=bench_out,
            outputs=("serve_overhead.log", "serve_overhead.json", "serve_overhead.csv", "serve_overhead.png"),
        ),
    ]
    return [s for s in plan if not (skip_install and s.name == "install")]


def dry_run(plan: list[Step], out: Path, python: Path = VENV_PYTHON) -> list[str]:
    """Print the plan; return what would stop it (empty: ready)."""
    problems = []
    total = sum(s.timeout_s for s in plan)
    print(f"gpu_check plan: {len(plan)} steps, at most {total} s ({total / 60:.1f} min), outputs in {out}")
    for i, s in enumerate(plan, 1):
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        print(f"  {i}. {s.name} (limit {s.timeout_s} s): {s.what}\n     $ {env + ' ' if env else ''}{' '.join(s.argv)}\n     writes {', '.join(s.outputs)}")
        tool = s.argv[0]
        if tool == "nvidia-smi" and shutil.which(tool) is None:
            print("     (no nvidia-smi here: it comes with the GPU machine's driver)")
        elif tool != str(python) and shutil.which(tool) is None:
            problems.append(f"{s.name}: command {tool!r} not found")
        if s.script is not None:
            problems += [f"{s.name}: {s.script.name} has no {flag}" for flag in _flags(s.argv) if flag not in _declared_flags(s.script)]
    if total > 480:
        problems.append(f"the steps' limits add up to {total} s, over the 8 minutes the run must fit in")
    for path in ("Makefile", "pyproject.toml", "tests/integration/test_gpu.py", "bench/pipelines.py", "bench/serve_overhead.py"):
        if not (ROOT / path).exists():
            problems.append(f"missing file {path}")
    if not re.search(r'^gpu = \[.*"vllm==', (ROOT / "pyproject.toml").read_text(), re.M):
        problems.append("pyproject.toml declares no `gpu` extra with vllm")
    if not re.search(r"^def test_", (ROOT / "tests/integration/test_gpu.py").read_text(), re.M):
        problems.append("tests/integration/test_gpu.py holds no test")
    if any(s.name == "install" for s in plan):
        make = subprocess.run(["make", "-n", "install", "EXTRAS=gpu,test"], cwd=ROOT, capture_output=True, text=True)
        if make.returncode:
            problems.append(f"make -n install EXTRAS=gpu,test: {make.stderr.strip()}")
    problems += _check_configs(python)
    return problems


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def _declared_flags(script: Path) -> set[str]:
    return set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', script.read_text()))


def _check_configs(python: Path) -> list[str]:
    """The app configs the GPU steps deploy, validated by the app's own loader (needs the environment installed)."""
    if not python.exists():
        if python != VENV_PYTHON:
            return [f"--python {python}: no such interpreter"]
        print("  configs: not checked (no .venv yet: the install step makes it)")
        return []
    probe = (
        "from bench.pipelines import bench_args; from bench.serve_overhead import colocated_args; "
        "from app.config.file import parse_config; from tests.conftest import local_args, on_one_gpu; "
        "configs = {'identity': on_one_gpu(local_args(), model='devmodel', memory_fraction=0.2), "
        "'pipelines': bench_args(gpu=True), 'serve_overhead': colocated_args(4096, gpu=True)}; "
        "[parse_config(args) for args in configs.values()]; "
        "print('  configs: ' + ', '.join(f\"{name} ({args['model'].get('dtype', 'float32')}, {len([r for r in args['roles'].values() if r.get('replicas', 1)])} engines \""
        "f\"of {args['node_groups']['gpu-a']['num_gpus']} GPU)\" for name, args in configs.items()) + ': valid')"
    )
    result = subprocess.run([str(python), "-c", probe], cwd=ROOT, capture_output=True, text=True)
    print(result.stdout.rstrip())
    return [] if result.returncode == 0 else [f"configs: {result.stderr.strip().splitlines()[-1]}"]


def run(plan: list[Step], out: Path, python: Path = VENV_PYTHON) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.monotonic()
    for i, s in enumerate(plan, 1):
        log = out / f"{s.name}.log"
        print(f"[{i}/{len(plan)}] {s.name} (limit {s.timeout_s} s, {time.monotonic() - started:.0f} s so far): {s.what}", flush=True)
        t0 = time.monotonic()
        with log.open("w") as f:
            rc = _run_step(s, f, python)
        seconds = time.monotonic() - t0
        status = "ok" if rc == 0 else f"failed ({rc})"
        print(f"      {status} in {seconds:.0f} s; last lines of {log}:")
        print("\n".join("        " + line for line in log.read_text(errors="replace").splitlines()[-6:]), flush=True)
        results.append({"step": s.name, "status": status, "seconds": round(seconds, 1), "log": str(log)})
    summary = {
        "finished_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "total_s": round(time.monotonic() - started, 1),
        "steps": results,
        "figures": _figures(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _run_step(s: Step, log, python: Path) -> int | str:
    """The step's exit status, or why it has none. A step past its limit is killed with
    everything it started (its Ray cluster, engines holding GPU memory), so the next
    step starts on a free card."""
    try:
        proc = subprocess.Popen(s.argv, cwd=ROOT, env={**os.environ, **s.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except FileNotFoundError as exc:
        return f"not found: {exc.filename}"
    try:
        return proc.wait(timeout=s.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if python.exists():  # engines Ray left behind, reparented to init
            subprocess.run([str(python), "-c", "from app.ops.cluster import kill_orphans; kill_orphans()"], cwd=ROOT)
        return "timeout"


def _figures(out: Path) -> dict:
    """The benches' headline figures, where they wrote them."""
    figures = {}
    keys = {
        "pipelines.json": ("gap_p99_pdd_over_intra", "gap_p99_naive_over_pdd", "ttft_p99_pdd_over_intra"),
        "serve_overhead.json": ("throughput_ratio_c1", "throughput_ratio_c16", "ttft_p50_delta_ms_c1", "ttft_p50_delta_ms_c16"),
    }
    for name, wanted in keys.items():
        path = out / name
        if path.exists():
            data = json.loads(path.read_text())
            figures.update({k: data[k] for k in wanted if k in data})
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="folder for every output (default bench/out/gpu_check-DATE)")
    ap.add_argument("--skip-install", action="store_true", help="the venv is already installed with EXTRAS=gpu,test")
    ap.add_argument(
        "--python",
        type=Path,
        default=None,
        help="run the steps with this interpreter, whose environment already holds CUDA vllm and the test extras "
        "(a machine that reaches no package index); implies --skip-install",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the steps and check what they use; run nothing")
    a = ap.parse_args()
    out = (a.out or ROOT / "bench" / "out" / f"gpu_check-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    python = a.python.absolute() if a.python else VENV_PYTHON
    plan = steps(out, a.skip_install or a.python is not None, python)
    if a.dry_run:
        problems = dry_run(plan, out, python)
        for p in problems:
            print(f"problem: {p}")
        print("dry run: ready" if not problems else f"dry run: {len(problems)} problem(s)")
        sys.exit(1 if problems else 0)
    summary = run(plan, out, python)
    failed = [r["step"] for r in summary["steps"] if r["status"] != "ok"]
    print(f"gpu_check: {len(plan) - len(failed)} of {len(plan)} steps ok in {summary['total_s']:.0f} s; figures {summary['figures']}; everything in {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

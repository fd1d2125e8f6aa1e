"""bench/gpu_check.py's dry run: the GPU run is checked here, where no GPU is, before a GPU machine is spent on it."""

from __future__ import annotations

import subprocess
import sys

from bench.gpu_check import ROOT, Step, dry_run, steps


def test_the_dry_run_lists_every_step_and_finds_what_they_use():
    result = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in ("gpu", "install", "identity", "pipelines", "serve_overhead"):
        assert f". {step} (limit" in result.stdout
    assert "tests/integration/test_gpu.py" in result.stdout and "bench/pipelines.py --gpu" in result.stdout
    assert "configs: identity (float32, 3 engines" in result.stdout and "dry run: ready" in result.stdout


def test_the_dry_run_reports_a_flag_the_bench_does_not_declare_and_a_plan_over_its_time(tmp_path):
    plan = steps(tmp_path, skip_install=True)
    bench = next(s for s in plan if s.name == "pipelines")
    bench.argv.append("--no-such-flag")
    plan.append(Step("slow", ["true"], 600, "a step too long for the run"))
    problems = dry_run(plan, tmp_path)
    assert "pipelines: pipelines.py has no --no-such-flag" in problems
    assert any("over the 8 minutes" in p for p in problems)


def test_a_prepared_interpreter_replaces_the_install_step_and_must_exist(tmp_path):
    plan = steps(tmp_path, skip_install=True, python=tmp_path / "missing-python")
    assert "install" not in [s.name for s in plan] and plan[2].argv[0] == str(tmp_path / "missing-python")
    assert f"--python {tmp_path / 'missing-python'}: no such interpreter" in dry_run(plan, tmp_path, tmp_path / "missing-python")

"""Independent twin runs on several processes (app/sim/parallel.py): order, progress, failures, same figures."""

from __future__ import annotations

import dataclasses
import os

import pytest

from app.config import Mode
from app.sim.cluster import derive
from app.sim.parallel import run_all
from app.sim.run import TimedTraffic, hit_sweep
from app.sim.workload import AgenticWorkload
from tests.unit.test_sim_twin import tiny_config


def square_in_worker(n: int, report) -> tuple[int, int]:
    report(("started", n))
    return n * n, os.getpid()


def fail_on_three(n: int) -> int:
    if n == 3:
        raise ValueError(f"run {n}: bad input")
    return n


def test_results_come_back_in_order_from_other_processes_with_their_progress():
    done: list[int] = []
    progress: list[tuple[int, tuple[str, int]]] = []
    results = run_all(square_in_worker, range(6), jobs=2, on_done=lambda i, _r: done.append(i), on_progress=lambda i, value: progress.append((i, value)))
    assert [r for r, _ in results] == [0, 1, 4, 9, 16, 25]
    assert os.getpid() not in {pid for _, pid in results}
    assert sorted(done) == list(range(6))
    assert sorted(progress) == [(i, ("started", i)) for i in range(6)]


def test_one_job_runs_in_this_process():
    results = run_all(square_in_worker, [2, 3], jobs=1, on_progress=lambda i, value: None)
    assert results == [(4, os.getpid()), (9, os.getpid())]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_run_raises_its_error(jobs):
    with pytest.raises(ValueError, match="run 3: bad input"):
        run_all(fail_on_three, range(5), jobs=jobs)


def test_jobs_must_be_at_least_one():
    with pytest.raises(ValueError, match="--jobs: 0"):
        run_all(fail_on_three, [1], jobs=0)


def test_a_sweep_gives_the_same_points_on_two_processes_as_on_one():
    config = tiny_config()
    template = AgenticWorkload(
        requests=150, rps=2.0, seed=5, first_prompt_median=3000, max_context_tokens=16000, turns_min=2, turns_max=6, output_median=60, output_max=200
    )
    args = (config, derive(config, mode=Mode.pd_cross_dc_naive), template, (0.2, 0.9))
    seen: list[float] = []
    parallel = hit_sweep(*args, jobs=2, on_point=lambda p: seen.append(p["hit_rate"]))
    assert parallel == hit_sweep(*args, jobs=1)
    assert sorted(seen) == [0.2, 0.9]
    assert parallel[0]["ttft_p90_s"] != parallel[1]["ttft_p90_s"]  # the points are runs of their own


def test_timed_traffic_runs_and_searches_give_the_same_figures_on_two_processes():
    config = tiny_config()
    workload = AgenticWorkload(first_prompt_median=3000, max_context_tokens=16000, turns_min=2, turns_max=6, output_median=60, output_max=200)
    two = TimedTraffic(workload, warmup_s=20.0, window_s=40.0, jobs=2)
    one = dataclasses.replace(two, jobs=1)
    runs = [(config, 2.0, 0), (config, 3.0, 1)]
    assert repr(two.summaries(runs)) == repr(one.summaries(runs))
    searches = [(config, 0, 1.0), (derive(config, mode=Mode.pd_cross_dc_naive), 0, 1.0)]
    found = two.searches(searches, rel_tol=0.2)
    assert [(f.rps, f.probes) for f in found] == [(f.rps, f.probes) for f in one.searches(searches, rel_tol=0.2)]
    assert found[0].rps > 0 and found[0].probes != found[1].probes

"""Calibration helpers: the dev model's figures, prompts that never share a prefix, `pdd sim --perf` on the CPU config."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from app.conductor.journal import JOURNAL_CAPACITY
from app.config import Mode, RoleName
from app.config.file import load_config
from app.engine.devmodel import ensure_devmodel
from app.ops.cli import main as pdd
from app.sim.calibrate import _Prompts, app_journeys, model_spec_from_folder, with_model_spec
from app.sim.fitting import (
    OverheadSample,
    PullSample,
    busy_neighbors,
    decoder_request_overheads,
    fit_kv_pulls,
    fit_serving_overhead,
    fit_to_app_steps,
    kv_pulls,
    serving_overhead_ms,
    serving_overheads,
    with_decoder_overhead,
    with_kv_pull,
    with_serving_overhead,
)
from app.sim.perf import FittedPerf, StepSample

LOCAL = "serve_configs/local.yaml"


def test_dev_model_figures_come_from_its_config_json():
    spec = model_spec_from_folder(ensure_devmodel())
    hf = json.loads((ensure_devmodel() / "config.json").read_text())
    # K and V, every layer, every KV head, float32
    assert spec.kv_bytes_per_token == 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 4
    assert spec.weight_bytes_per_param == 4
    assert 0 < spec.active_params_b < 0.01


def test_missing_config_json_names_the_folder(tmp_path):
    try:
        model_spec_from_folder(tmp_path)
    except ValueError as err:
        assert str(tmp_path) in str(err) and "model.spec" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_a_configured_spec_is_kept():
    config = with_model_spec(load_config(LOCAL))
    again = with_model_spec(config)
    assert again.model.spec is config.model.spec


def test_calibration_prompts_never_share_a_first_block():
    prompts = _Prompts(vocab=508)
    seen = [tuple(prompts(64)[:32]) for _ in range(2000)]
    assert len(set(seen)) == len(seen)
    assert all(3 <= t < 508 for p in seen for t in p)


def test_pdd_sim_runs_the_cpu_config_with_a_fitted_model(tmp_path):
    fitted = tmp_path / "fitted.json"
    fitted.write_text(json.dumps({"a_ms": 5.0, "b_ms_per_prefill_token": 0.05, "c_ms_per_decode_seq": 0.5, "d_ms_per_kv_token": 0.0005}))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        pdd, ["sim", LOCAL, "--perf", str(fitted), "--requests", "200", "--rps", "1", "--out", str(tmp_path), "--json", str(out)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["runs"]["pdd"]
    assert run["requests"] > 0 and run["ttft_s"][0] > 0.005  # at least the fitted step overhead


ALONE = FittedPerf(2.0, 0.05, 0.1, 0.0005, 2e-5)


def _steps(slowdown: float, count: int) -> list[StepSample]:
    """Steps of assorted shapes, `slowdown` times as long as ALONE gives them, give or take 30%."""
    out = []
    for i in range(count):
        p, n, k = (0, 300, 1200)[i % 3], 1 + i % 4, 500 + 100 * i
        pairs = p * (p + 1) / 2 + n * k
        out.append(StepSample(p, n, n * k + p, ALONE.step_s(p, n, n * k + p, pairs) * 1000 * slowdown * (0.7, 1.3)[i % 2], pairs))
    return out


def test_each_role_gets_the_model_alone_scaled_to_the_time_its_steps_took():
    fits = fit_to_app_steps(ALONE, {RoleName.prefill: [], RoleName.relay_decode: _steps(1.7, 40), RoleName.main_decode: _steps(1.2, 40)})
    assert set(fits) == {"relay_decode", "main_decode"}  # prefill took no step: not serving in this mode
    models = {role: fit.model for role, fit in fits.items()}
    for role, slowdown in (("relay_decode", 1.7), ("main_decode", 1.2)):
        steps = _steps(slowdown, 40)
        total = math.fsum(models[role].step_s(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read, s.attention_pairs) * 1000 for s in steps)
        assert total == pytest.approx(math.fsum(s.step_ms for s in steps), rel=1e-9)
        factor = fits[role].factor
        assert (factor, fits[role].neighbors) == (pytest.approx(slowdown, rel=0.1), None)  # untimed steps: one factor; the +-30% scatter averages out
        assert models[role].__dict__ == pytest.approx(ALONE.scaled(factor).__dict__)  # the shape is the engine alone's


def _timed(role_engine: str, start_s: float, step_ms: float) -> StepSample:
    return StepSample(0, 1, 100, step_ms, 100.0, start_s=start_s, engine=role_engine)


def test_busy_neighbors_is_the_other_engines_time_in_flight_over_each_step():
    steps = {RoleName.prefill: [_timed("p0", 0.0, 1000), _timed("p0", 1.0, 1000), _timed("p1", 1.5, 1500)], RoleName.main_decode: [_timed("md", 0.5, 1000)]}
    k = busy_neighbors(steps)
    # p0's steps overlap md by half each, and its second also p1 (the same role's other replica) by half
    assert k[RoleName.prefill] == pytest.approx([0.5, 1.0, 0.5 / 1.5])
    assert k[RoleName.main_decode] == pytest.approx([1.0])
    with pytest.raises(ValueError, match="prefill step has no start time"):
        busy_neighbors({RoleName.prefill: [StepSample(0, 1, 100, 5.0)]})


def test_host_sharing_recovers_the_slowdown_alone_and_per_busy_neighbor():
    """P steps alone x (1.3 + 0.5 k): inside the relay's busy blocks k = 1, between them k = 0."""
    prefill, relay = [], []
    for i, s in enumerate(_steps(1.0, 40)):
        alone = ALONE.step_s(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read, s.attention_pairs) * 1000
        busy = i % 2 == 0
        prefill.append(replace(s, step_ms=alone * (1.3 + 0.5 * busy), start_s=10.0 * i + (0.1 if busy else 6.0), engine="p"))
        relay += [_timed("r", 10.0 * i + j, 1000) for j in range(5)]
    fits = fit_to_app_steps(ALONE, {RoleName.prefill: prefill, RoleName.relay_decode: relay})
    p = fits["prefill"]
    assert (p.factor, p.neighbor_slowdown) == (pytest.approx(1.3, rel=1e-6), pytest.approx(0.5 / 1.3, rel=1e-6))
    assert 0 < p.neighbors < 1
    assert p.model == replace(ALONE.scaled(p.factor), neighbor_slowdown=p.neighbor_slowdown)
    assert "1.30x the engine alone with no busy neighbor engine, +38% per busy neighbor" in p.describe()
    plain = fit_to_app_steps(ALONE, {RoleName.prefill: prefill, RoleName.relay_decode: relay}, host_sharing=False)["prefill"]
    assert (plain.neighbor_slowdown, plain.neighbors) == (0.0, None) and 1.3 < plain.factor < 1.8


def test_an_engine_alone_on_its_host_or_steps_without_start_times_get_one_factor():
    alone_on_host = [replace(s, start_s=float(i), engine="c") for i, s in enumerate(_steps(1.5, 30))]
    fit = fit_to_app_steps(ALONE, {RoleName.prefill: alone_on_host})["prefill"]
    assert (fit.factor, fit.neighbor_slowdown, fit.neighbors) == (pytest.approx(1.5, rel=0.1), 0.0, 0.0)
    assert fit_to_app_steps(ALONE, {RoleName.prefill: _steps(1.5, 30)})["prefill"].neighbors is None


def test_a_role_with_too_few_steps_keeps_the_model_alone_and_none_at_all_say_what_to_switch_on():
    fits = fit_to_app_steps(ALONE, {RoleName.main_decode: _steps(2.0, 30), RoleName.relay_decode: _steps(2.0, 5)})
    assert fits["relay_decode"][:2] == (ALONE, None)
    assert fits["main_decode"].factor == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="record_steps"):
        fit_to_app_steps(ALONE, {RoleName.main_decode: []})


def test_serving_overhead_is_ttft_outside_the_engines_the_first_token_waited_for():
    pdd = {"pipeline": "P-RLD-MD", "ttft_ms": 40.0, "engine_ttft_ms": {"prefill": 15.0, "relay_decode": 300.0, "main_decode": 900.0}}
    assert serving_overhead_ms(pdd) == pytest.approx(25.0)  # the first token is P's: the decoders' pulls come after it
    assert serving_overhead_ms({**pdd, "pipeline": "P-MD"}) == pytest.approx(25.0)
    colocated = {"pipeline": "colocated", "ttft_ms": 30.0, "engine_ttft_ms": {"main_decode": 12.5}}
    assert serving_overhead_ms(colocated) == pytest.approx(17.5)
    # naive: the first token reaches the client with the decoder's, after its pull
    assert serving_overhead_ms({"pipeline": "P-D-naive", "ttft_ms": 500.0, "engine_ttft_ms": {"prefill": 15.0, "main_decode": 450.0}}) == pytest.approx(35.0)
    for partial in (
        {**pdd, "engine_ttft_ms": {"relay_decode": 300.0}},
        {**pdd, "ttft_ms": None},
        {**pdd, "error": "boom"},
        {**pdd, "failovers": [{"from_role": "prefill"}]},
        {"pipeline": "P-D-naive", "ttft_ms": 500.0, "engine_ttft_ms": {"prefill": 15.0}},
        {**colocated, "engine_ttft_ms": {}},
        {},
    ):
        assert serving_overhead_ms(partial) is None


def test_serving_overhead_counts_the_replicas_own_processing_where_the_engine_core_timed_the_token():
    pdd = {
        "pipeline": "P-RLD-MD",
        "ttft_ms": 40.0,
        "engine_ttft_ms": {"prefill": 15.0, "relay_decode": 300.0},
        "engine_core_ttft_ms": {"prefill": 9.0, "relay_decode": 280.0},
    }
    assert serving_overhead_ms(pdd) == pytest.approx(31.0)
    naive = {
        "pipeline": "P-D-naive",
        "ttft_ms": 500.0,
        "engine_ttft_ms": {"prefill": 15.0, "main_decode": 450.0},
        "engine_core_ttft_ms": {"prefill": 10.0, "main_decode": 440.0},
    }
    assert serving_overhead_ms(naive) == pytest.approx(50.0)
    # one engine without the core's figures: the replicas' figures for all, never a mix
    assert serving_overhead_ms({**naive, "engine_core_ttft_ms": {"prefill": 10.0}}) == pytest.approx(35.0)


def _journey(start: float, end: float | None, overhead: float, mode: str = "pdd") -> dict:
    return {
        "mode": mode,
        "pipeline": "colocated" if mode == "colocated" else "P-MD",
        "started_at": start,
        "finished_at": end,
        "ttft_ms": 10.0 + overhead,
        "engine_ttft_ms": {"main_decode" if mode == "colocated" else "prefill": 10.0},
    }


def test_each_overhead_comes_with_the_requests_in_flight_when_it_arrived():
    journeys = [
        _journey(0.0, 10.0, 5.0),
        _journey(1.0, 2.0, 6.0),  # one in flight (the first)
        _journey(2.0, 3.0, 7.0),  # the second ended just as it came: one in flight
        _journey(2.5, None, 8.0),  # two: the first and the third; unfinished, in flight to the end
        {**_journey(4.0, 5.0, 0.0), "error": "boom"},  # no overhead of its own, but it loads the app
        _journey(4.5, 6.0, 9.0, "colocated"),  # another mode counts in flight, and gives its own
        _journey(5.5, 6.0, 10.0),  # first, fourth, sixth
        {**_journey(7.0, 8.0, 3.0), "started_at": None},  # no start: neither counted nor counting
    ]
    assert serving_overheads(journeys) == [
        (0, pytest.approx(5.0)),
        (1, pytest.approx(6.0)),
        (1, pytest.approx(7.0)),
        (2, pytest.approx(8.0)),
        (3, pytest.approx(9.0)),
        (3, pytest.approx(10.0)),
    ]
    assert [s.in_flight for s in serving_overheads(journeys, Mode.pdd)] == [0, 1, 1, 2, 3]
    assert serving_overheads([]) == []


def test_the_overhead_line_is_a_median_regression():
    # 10 ms + 4 ms per request in flight, with requests that waited far longer, at the rare high counts most of all
    line = [OverheadSample(n, 10.0 + 4 * n) for n in (0, 0, 0, 0, 1, 1, 1, 2, 2, 3)]
    late = [OverheadSample(0, 400.0), OverheadSample(1, 300.0), OverheadSample(4, 140.0), OverheadSample(5, 100.0)]
    base, slope = fit_serving_overhead(line + late)
    assert (base, slope) == (pytest.approx(10.0, abs=1e-3), pytest.approx(4.0, abs=1e-3))
    assert fit_serving_overhead([OverheadSample(3, 12.0), OverheadSample(3, 20.0)]) == (16.0, 0.0)  # one count: its median
    assert fit_serving_overhead([OverheadSample(0, 30.0), OverheadSample(4, 10.0)]) == (
        pytest.approx(20.0),
        pytest.approx(0.0, abs=1e-5),
    )  # never a negative slope
    base, slope = fit_serving_overhead([OverheadSample(1, 10.0), OverheadSample(2, 30.0)])
    assert (base, slope) == (0.0, pytest.approx(15.0, abs=1e-3))  # nor a negative base
    with pytest.raises(ValueError, match="no serving overhead samples"):
        fit_serving_overhead([])


def test_the_fitted_overhead_goes_on_the_role_requests_enter_by():
    models = {"prefill": ALONE, "relay_decode": ALONE.scaled(1.5), "main_decode": ALONE.scaled(1.2)}
    samples = [OverheadSample(0, 20.0), OverheadSample(0, 500.0), OverheadSample(0, 20.0), OverheadSample(2, 30.0)]
    with_overhead = with_serving_overhead(models, Mode.pdd, samples)
    assert with_overhead["prefill"] == replace(ALONE, serving_overhead_ms=pytest.approx(20.0), serving_overhead_ms_per_in_flight=pytest.approx(5.0))
    assert {r: m for r, m in with_overhead.items() if r != "prefill"} == {r: m for r, m in models.items() if r != "prefill"}
    assert with_serving_overhead(models, Mode.colocated, [OverheadSample(0, 8.0)])["main_decode"].serving_overhead_ms == 8.0
    assert with_serving_overhead(models, Mode.pdd, []) == models
    with pytest.raises(ValueError, match="no step model for prefill, which pdd requests enter by"):
        with_serving_overhead({"main_decode": ALONE}, Mode.pdd, [OverheadSample(0, 8.0)])
    assert (ALONE.scaled(2.0).serving_overhead_ms, ALONE.scaled(2.0).serving_overhead_ms_per_in_flight) == (0.0, 0.0)
    # scaling steps leaves the stack's time alone
    assert with_overhead["prefill"].scaled(2.0) == replace(
        ALONE.scaled(2.0), serving_overhead_ms=pytest.approx(20.0), serving_overhead_ms_per_in_flight=pytest.approx(5.0)
    )


def test_decoder_request_overheads_are_the_decoder_replicas_own_time_where_p_gave_the_first_token():
    journeys = [
        {
            "pipeline": "P-RLD-MD",
            "engine_ttft_ms": {"prefill": 50.0, "relay_decode": 30.0, "main_decode": 400.0},
            "engine_core_ttft_ms": {"prefill": 45.0, "relay_decode": 22.0, "main_decode": 395.0},
        },
        {"pipeline": "P-MD", "engine_ttft_ms": {"prefill": 50.0, "main_decode": 90.0}, "engine_core_ttft_ms": {"prefill": 40.0, "main_decode": 80.0}},
        {"pipeline": "P-D", "engine_ttft_ms": {"relay_decode": 20.0}, "engine_core_ttft_ms": {}},  # the core's figure missing
        {"pipeline": "P-D-naive", "engine_ttft_ms": {"main_decode": 90.0}, "engine_core_ttft_ms": {"main_decode": 70.0}},  # in the serving overhead
        {"pipeline": "colocated", "engine_ttft_ms": {"main_decode": 90.0}, "engine_core_ttft_ms": {"main_decode": 70.0}},
        {"pipeline": "P-MD", "error": "boom", "engine_ttft_ms": {"main_decode": 90.0}, "engine_core_ttft_ms": {"main_decode": 10.0}},
        {"pipeline": "P-MD", "failovers": [{"from": "main_decode"}], "engine_ttft_ms": {"main_decode": 90.0}, "engine_core_ttft_ms": {"main_decode": 10.0}},
    ]
    assert decoder_request_overheads(journeys) == [8.0, 5.0, 10.0]
    models = {"prefill": ALONE, "main_decode": ALONE.scaled(1.2)}
    assert with_decoder_overhead(models, Mode.pdd, [8.0, 5.0, 10.0]) == {**models, "prefill": replace(ALONE, decoder_request_overhead_ms=8.0)}
    assert with_decoder_overhead(models, Mode.pdd, [-3.0])["prefill"].decoder_request_overhead_ms == 0.0
    assert with_decoder_overhead(models, Mode.pdd, []) == models


def test_kv_pulls_are_the_transports_time_beyond_the_link_inside_a_datacenter():
    config = load_config(LOCAL)  # dc-a <-> dc-a: 20 Gbit/s, 0.1 ms; the WAN 40 Mbit/s
    journeys = [
        {
            "transfers": [
                {"link": "dc-a->dc-a", "to_role": "relay_decode", "bytes": 5_000_000, "seconds": 0.030, "ok": True},
                {"link": "dc-a->dc-b", "to_role": "main_decode", "bytes": 5_000_000, "seconds": 1.5, "ok": True},
            ]
        },
        {
            "transfers": [
                {"link": "dc-a->dc-a", "to_role": "relay_decode", "bytes": 1_000_000, "seconds": 9.0, "ok": False},
                {"link": "dc-a->dc-a", "to_role": "relay_decode", "bytes": 0, "seconds": 0.002, "ok": True},
            ]
        },
        {"pipeline": "colocated"},
    ]
    # 5 MB take 2 ms on the link and its 0.1 ms RTT: 27.9 ms are the transport's; the WAN's pull, a failed one and an empty one are not counted
    assert kv_pulls(journeys, config) == [PullSample(5.0, pytest.approx(30.0 - 0.1 - 2.0))]
    assert kv_pulls([], config) == []
    with pytest.raises(KeyError, match="no link between 'dc-c' and 'dc-c'"):
        kv_pulls([{"transfers": [{"link": "dc-c->dc-c", "bytes": 10, "seconds": 0.01, "ok": True}]}], config)


def test_the_kv_pull_line_is_a_median_regression_that_goes_on_the_entry_role():
    # 4 ms + 4.5 ms/MB, and pulls that waited behind others for a busy CPU
    line = [PullSample(mb, 4.0 + 4.5 * mb) for mb in (0.1, 0.3, 0.3, 0.5, 1.0, 2.0, 3.7, 6.0, 10.0)]
    late = [PullSample(0.2, 90.0), PullSample(1.0, 60.0), PullSample(6.0, 150.0)]
    per_pull, per_mb = fit_kv_pulls(line + late)
    assert (per_pull, per_mb) == (pytest.approx(4.0, abs=1e-3), pytest.approx(4.5, abs=1e-3))
    with pytest.raises(ValueError, match="no KV pull samples"):
        fit_kv_pulls([])
    models = {"prefill": ALONE, "relay_decode": ALONE.scaled(1.5), "main_decode": ALONE.scaled(1.2)}
    costly = with_kv_pull(models, Mode.pdd, line)
    assert costly["prefill"] == replace(ALONE, kv_pull_ms=pytest.approx(4.0, abs=1e-3), kv_pull_ms_per_mb=pytest.approx(4.5, abs=1e-3))
    assert {r: m for r, m in costly.items() if r != "prefill"} == {r: m for r, m in models.items() if r != "prefill"}
    assert with_kv_pull(models, Mode.pdd, []) == models
    assert costly["prefill"].scaled(2.0).kv_pull_ms == costly["prefill"].kv_pull_ms  # not a step cost


def test_the_apps_journeys_of_the_mode_give_the_overheads_and_an_unreachable_app_is_named(monkeypatch):
    journeys = [
        {"mode": "pdd", "pipeline": "P-MD", "ttft_ms": 40.0, "engine_ttft_ms": {"prefill": 15.0}, "started_at": 1.0, "finished_at": 9.0},
        {"mode": "pdd", "pipeline": "P-RLD", "ttft_ms": 90.0, "engine_ttft_ms": {"prefill": 60.0, "relay_decode": 5.0}, "started_at": 3.0, "finished_at": 4.0},
        {"mode": "pdd", "pipeline": "P-MD", "ttft_ms": 40.0, "error": "boom", "engine_ttft_ms": {"prefill": 15.0}, "started_at": 2.0, "finished_at": 2.5},
        {"mode": "colocated", "pipeline": "colocated", "ttft_ms": 30.0, "engine_ttft_ms": {"main_decode": 12.5}, "started_at": 0.0, "finished_at": 5.0},
    ]
    seen = []

    class Journal(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("authorization")))
            body = json.dumps({"requests": journeys}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Journal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("PDD_API_KEY", "k1")
    try:
        kept = app_journeys(url)
        assert serving_overheads(kept, Mode.pdd) == [(1, pytest.approx(25.0)), (2, pytest.approx(30.0))]  # every mode in flight
        assert serving_overheads(kept, Mode.colocated) == [(0, pytest.approx(17.5))]
    finally:
        server.shutdown()
        server.server_close()
    assert seen[0] == (f"/pdd/requests?limit={JOURNAL_CAPACITY}", "Bearer k1")
    with pytest.raises(ConnectionError, match=f"cannot read {url}/pdd/requests"):
        app_journeys(url)


def test_calibrating_from_an_app_says_what_is_missing(tmp_path):
    result = CliRunner().invoke(pdd, ["calibrate", LOCAL, "--from-app", "pdd"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "engine.record_steps" in result.output, result.output
    doc = yaml.safe_load(Path(LOCAL).read_text())
    for role in doc["applications"][0]["args"]["roles"].values():
        role["engine"]["record_steps"] = True
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(pdd, ["calibrate", str(config), "--from-app", "pdd", "--base", str(tmp_path / "none.json")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "measure an engine alone first" in result.output, result.output
    (tmp_path / "alone.json").write_text(ALONE.to_json())
    result = CliRunner().invoke(
        pdd, ["calibrate", str(config), "--from-app", "pdd", "--base", str(tmp_path / "alone.json")], env={"COLUMNS": "200", "PDD_CACHE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 2 and "pass --address" in result.output, result.output

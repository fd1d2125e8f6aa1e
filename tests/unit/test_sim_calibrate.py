"""Calibration helpers: the dev model's figures, prompts that never share a prefix, `pdd sim --perf` on the CPU config."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from app.cli import main as pdd
from app.config import load_config
from app.devmodel import ensure_devmodel
from app.sim.calibrate import _Prompts, model_spec_from_folder, with_model_spec

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
    result = CliRunner().invoke(pdd, ["sim", LOCAL, "--perf", str(fitted), "--requests", "200", "--rps", "1", "--out", str(tmp_path), "--json", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["runs"]["pdd"]
    assert run["requests"] > 0 and run["ttft_s"][0] > 0.005  # at least the fitted step overhead

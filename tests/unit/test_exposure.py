"""app/ops/exposure.py: what `pdd validate` and `pdd status` say is open, from the config (and
what the running app reports)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rich.console import Console

from app.config import PDDConfig
from app.config.file import load_config
from app.ops import exposure as ex
from tests.conftest import LOCAL_CONFIG, ROOT, local_args

GPU_CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"
NO_ENV: dict[str, str] = {}


def config_with(server: dict | None = None, security: dict | None = None) -> PDDConfig:
    args = local_args()
    args["server"] = server or {}
    args["security"] = security or {}
    return PDDConfig.model_validate(args)


def row(found: ex.Exposure, what: str) -> ex.Row:
    return next(r for r in found.rows if r.what.strip().startswith(what))


def shown(found: ex.Exposure) -> str:
    console = Console(width=200, record=True)
    console.print(ex.render(found))
    return console.export_text()


def test_the_local_config_opens_the_api_to_this_machine_only_and_warns_of_nothing():
    found = ex.exposure(load_config(LOCAL_CONFIG), yaml.safe_load(LOCAL_CONFIG.read_text()), NO_ENV)
    api = row(found, "public API")
    assert api.where == "127.0.0.1:8000" and "loopback only" in api.access
    plane = row(found, "data plane")
    assert plane.where == "each node's own address" and "mutual TLS" in plane.access
    assert row(found, "encryption").access == "between datacenters: always; within one: on"
    assert found.warnings == []


def test_the_gpu_example_binds_every_interface_so_it_needs_the_generated_key():
    found = ex.exposure(load_config(GPU_CONFIG), yaml.safe_load(GPU_CONFIG.read_text()), NO_ENV)
    api = row(found, "public API")
    assert api.where == "0.0.0.0:8000" and "generated operator key" in api.access
    assert found.warnings == []


def test_anonymous_access_beyond_loopback_is_warned_of():
    doc = {"http_options": {"host": "0.0.0.0", "port": 8080}}
    found = ex.exposure(config_with(server={"allow_anonymous": True}), doc, NO_ENV)
    assert row(found, "public API").access.startswith("ANYONE")
    assert len(found.warnings) == 1 and "allow_anonymous" in found.warnings[0] and "0.0.0.0" in found.warnings[0]
    assert "warning:" in shown(found)
    # on loopback the same config is open to this machine only: nothing to warn of
    assert ex.exposure(config_with(server={"allow_anonymous": True}), {"http_options": {"host": "127.0.0.1"}}, NO_ENV).warnings == []


def test_configured_keys_win_over_allow_anonymous_and_count_the_shells_too():
    doc = {"http_options": {"host": "10.0.0.5"}}
    config = config_with(server={"allow_anonymous": True, "api_keys": ["a", "b"], "operator_api_keys": ["b"]})
    found = ex.exposure(config, doc, {"PDD_API_KEYS": "c, ,a", "PDD_OPERATOR_API_KEYS": "d"})
    assert row(found, "public API").access == "bearer keys: 2 inference, 2 operator"  # a, c; b, d
    assert found.warnings == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_data_plane_without_intra_dc_encryption_or_on_every_interface_is_warned_of(host):
    found = ex.exposure(config_with(security={"intra_dc_encryption": False, "bind_host": host}), {}, NO_ENV)
    assert row(found, "data plane").where == host
    assert "OFF" in row(found, "encryption").access
    assert [w.split(" ")[0] for w in found.warnings] == ["security.intra_dc_encryption", "security.bind_host"]


def test_an_explicit_interface_is_not_every_interface_and_the_bounds_are_the_configs():
    found = ex.exposure(config_with(security={"bind_host": "10.1.2.3", "max_connections_per_peer": 3, "max_connections": 9}), {}, NO_ENV)
    assert row(found, "data plane").where == "10.1.2.3" and found.warnings == []
    assert row(found, "connection bounds").access == "3 per peer, 9 per listener"


def test_a_bare_pdd_config_gets_serves_defaults_and_no_ingress_is_said_so():
    assert ex.http_address({}) == ("127.0.0.1", 8000)
    found = ex.exposure(config_with(), {"http_options": {"host": None}}, NO_ENV)
    assert "null" in row(found, "public API").where


def test_ops_listeners_follow_the_config_and_the_haproxy_admin_variable(monkeypatch):
    args = local_args()
    args["agents"] = {"prometheus_url": "http://127.0.0.1:9191"}
    monkeypatch.setenv("PDD_HAPROXY_ADMIN_HOST", "10.0.0.9")
    found = ex.exposure(PDDConfig.model_validate(args), {}, NO_ENV)
    assert row(found, "Prometheus").where == "127.0.0.1:9191"
    assert row(found, "HAProxy").where == "10.0.0.9:8404, :9101"


def test_status_adds_where_the_live_engines_are():
    state = {
        "roles": {
            "prefill": {"replicas": [{"node_ip": "127.0.0.2"}, {"node_ip": "127.0.0.2"}]},
            "main_decode": {"replicas": [{"node_ip": "127.0.0.3"}]},
            "relay_decode": {"replicas": []},
        }
    }
    rows = ex.live_engines(state, config_with())
    assert [(r.what.strip(), r.where) for r in rows] == [
        ("prefill: 2 engine(s)", "127.0.0.2"),
        ("main_decode: 1 engine(s)", "127.0.0.3"),
        ("relay_decode: 0 engine(s)", "-"),
    ]
    assert ex.live_engines(state, config_with(security={"bind_host": "0.0.0.0"}))[0].where == "0.0.0.0"
    assert ex.probed_api(401).startswith("refuses") and ex.probed_api(200).startswith("answers") and ex.probed_api(None) == "could not be reached"


def test_pdd_validate_prints_the_exposure(tmp_path: Path):
    from typer.testing import CliRunner

    from app.ops.cli import main

    doc = yaml.safe_load(GPU_CONFIG.read_text())
    doc["applications"][0]["args"]["server"] = {"allow_anonymous": True}
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = CliRunner().invoke(main, ["validate", str(path)], env={"COLUMNS": "200", "PDD_API_KEYS": "", "PDD_OPERATOR_API_KEYS": ""})
    assert out.exit_code == 0, out.output
    assert "exposure" in out.output and "0.0.0.0:8000" in out.output and "warning:" in out.output


def test_pdd_status_shows_the_exposure_with_the_live_engines(monkeypatch):
    from app.config import LiveKnobs, SLOConfig
    from app.ops import status

    state = {
        "model": "m",
        "mode": "pdd",
        "in_flight": 0,
        "roles": {
            "prefill": {
                "datacenter": "dc-a",
                "accelerator": "cpu",
                "configured_replicas": 1,
                "replicas": [{"node_ip": "127.0.0.2", "in_flight": 0, "warming": 0, "known_blocks": 0, "kv_blocks": 10}],
            }
        },
        "links": {},
        "knobs": LiveKnobs().model_dump(mode="json"),
        "slo": {"targets": SLOConfig().model_dump(mode="json"), "recent": {"window_s": 300, "by_pipeline": {}}},
    }
    monkeypatch.setattr(status, "fetch_state", lambda url: state)
    monkeypatch.setattr(status, "fetch_snapshot", lambda *a: (_ for _ in ()).throw(RuntimeError("no Prometheus")))
    monkeypatch.setattr(status, "status_without_key", lambda url: 401)
    console = Console(width=200, record=True)
    config = config_with()
    status.show("http://127.0.0.1:8000", "http://127.0.0.1:9090", config, console, exposure=ex.exposure(config, {}, NO_ENV))
    text = console.export_text()
    assert "refuses calls without a key (HTTP 401)" in text
    assert next(line for line in text.splitlines() if "prefill: 1 engine(s)" in line).split()[-2] == "127.0.0.2"

import pytest
import yaml

from app.config import Mode, PDDConfig, RoleName
from app.config.file import ConfigError, load_config, parse_config
from tests.conftest import LOCAL_CONFIG, ROOT


def test_local_config_loads():
    config = load_config(LOCAL_CONFIG)
    assert config.model.source == "devmodel"
    assert config.roles.get(RoleName.main_decode) is not None


@pytest.mark.parametrize("path", sorted((ROOT / "serve_configs").glob("*.yaml")))
def test_every_shipped_config_validates(path):
    load_config(path)


def _error(args) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(args)
    return str(info.value)


def test_typo_names_the_field(args):
    args["roles"]["main_decode"]["replcas"] = 2
    assert "roles.main_decode.replcas" in _error(args)


def test_wrong_type_names_the_field(args):
    args["roles"]["main_decode"]["replicas"] = "two"
    assert "roles.main_decode.replicas" in _error(args)


def test_unknown_node_group(args):
    args["roles"]["main_decode"]["node_group"] = "gpu-z"
    msg = _error(args)
    assert "roles.main_decode.node_group" in msg and "gpu-z" in msg and "gpu-a" in msg


def test_mode_needs_its_roles(args):
    del args["roles"]["prefill"]
    assert "roles.prefill: mode 'pdd' needs at least one replica" in _error(args)
    args["mode"] = "colocated"
    parse_config(args)


def test_pdd_needs_main_decode_in_another_datacenter(args):
    args["mode"] = "pdd"
    args["roles"]["prefill"] = {"node_group": "gpu-a"}
    args["roles"]["relay_decode"] = {"node_group": "gpu-a"}
    args["roles"]["main_decode"]["node_group"] = "gpu-a"
    assert "roles.main_decode" in _error(args)


def test_link_required_between_used_datacenters(args):
    args["links"] = [lc for lc in args["links"] if lc["between"] != ["dc-a", "dc-b"]]
    assert "no link declared between 'dc-a' and 'dc-b'" in _error(args)


def test_duplicate_link_rejected(args):
    args["links"].append({"between": ["dc-b", "dc-a"], "bandwidth_mbps": 1})
    assert "two links" in _error(args)


def test_bad_enum_value(args):
    args["handoff"] = {"mode": "sometimes"}
    assert "handoff.mode" in _error(args)


def test_negative_bandwidth(args):
    args["links"][0]["bandwidth_mbps"] = -5
    assert "links.0.bandwidth_mbps" in _error(args)


def test_block_size_must_be_multiple_of_16(args):
    args["model"]["block_size"] = 20
    assert "model.block_size" in _error(args)


def test_unknown_engine_arg_rejected(args):
    args["roles"]["main_decode"]["engine"]["extra"] = {"not_an_arg": 1}
    assert "not_an_arg" in _error(args)


def test_reserved_engine_arg_rejected(args):
    args["roles"]["main_decode"]["engine"]["extra"] = {"block_size": 64}
    assert "set by pdd-serve" in _error(args)


def test_the_model_runner_is_v1_until_carried_sampling_runs_on_v2(args):
    assert PDDConfig.model_validate(args).roles.prefill.engine.model_runner == "v1"
    for runner in ("v2", "auto"):
        args["roles"]["relay_decode"]["engine"] = {"model_runner": runner}
        message = _error(args)
        assert "roles.relay_decode.engine.model_runner" in message and "carried_sampling" in message and "use 'v1'" in message


def test_relay_caps_ordered(args):
    args["handoff"] = {"relay_cap_tokens": 10, "min_relay_cap_tokens": 20}
    assert "min_relay_cap_tokens" in _error(args)


def test_max_prompt_tokens_below_model_len(args):
    args["server"] = {"max_prompt_tokens": args["model"]["max_model_len"]}
    assert "server.max_prompt_tokens" in _error(args)


def test_serve_config_errors_carry_the_app_prefix(tmp_path):
    doc = yaml.safe_load(LOCAL_CONFIG.read_text())
    doc["applications"][0]["args"]["mode"] = "warp"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "applications.0.args.mode" in str(info.value)


def test_invalid_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("mode: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_live_knobs_roundtrip(args):
    config = PDDConfig.model_validate(args)
    knobs = config.live_knobs().model_dump(mode="json")
    assert set(knobs) == {"routing", "handoff"}
    assert knobs["handoff"]["mode"] == config.handoff.mode.value


def test_link_lookup_is_symmetric(args):
    config = PDDConfig.model_validate(args)
    assert config.link("dc-b", "dc-a") is config.link("dc-a", "dc-b")


def test_modes_enumerated():
    assert {m.value for m in Mode} == {"colocated", "pd_intra_dc", "pd_cross_dc_naive", "pd_cross_dc", "pdd"}


@pytest.mark.parametrize("path", sorted((ROOT / "serve_configs").glob("*.yaml")))
def test_config_survives_the_trip_to_the_replicas(path):
    """Replicas receive the config as JSON and validate it again: defaults included."""
    config = load_config(path)
    assert PDDConfig.model_validate(config.model_dump(mode="json")) == config


def test_a_data_plane_bind_address_that_is_no_address_names_the_field(args):
    args["security"] = {"bind_host": "my-node"}
    with pytest.raises(ConfigError, match=r"security\.bind_host"):
        parse_config(args)
    args["security"] = {"bind_host": "10.0.0.7", "intra_dc_encryption": False}
    assert not parse_config(args).security.intra_dc_encryption

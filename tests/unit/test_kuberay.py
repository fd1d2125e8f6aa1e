"""The KubeRay manifest: generated from the GPU serve config, shaped like a RayService."""

from __future__ import annotations

import json
import stat
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from app.config.file import load_config
from app.engine.cluster_tls import ClusterTLS, Credentials
from app.ops.kuberay import GPUS_PER_NODE, ZONE_LABEL, manifest, render, secret_manifests, write_secrets
from tests.conftest import ROOT

GPU_CONFIG = ROOT / "serve_configs" / "gpu_h100_h200.yaml"
COMMITTED = ROOT / "serve_configs" / "kuberay" / "pdd-rayservice.yaml"
IMAGE = "ghcr.io/pdd-serve/pdd-serve:0.1.0-cuda"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PodTemplate(_Strict):
    metadata: dict[str, Any] = {}
    spec: dict[str, Any]


class HeadGroupSpec(_Strict):
    rayStartParams: dict[str, str]
    template: PodTemplate


class WorkerGroupSpec(_Strict):
    groupName: str
    replicas: int
    minReplicas: int
    maxReplicas: int
    rayStartParams: dict[str, str]
    template: PodTemplate


class RayClusterSpec(_Strict):
    rayVersion: str
    enableInTreeAutoscaling: bool
    headGroupSpec: HeadGroupSpec
    workerGroupSpecs: list[WorkerGroupSpec]


class RayServiceSpec(_Strict):
    serveConfigV2: str
    rayClusterConfig: RayClusterSpec


class RayService(_Strict):
    """The RayService fields (ray.io/v1) this manifest uses, as KubeRay's CRD names them."""

    apiVersion: str
    kind: str
    metadata: dict[str, Any]
    spec: RayServiceSpec


@pytest.fixture(scope="module")
def docs():
    return manifest(GPU_CONFIG, IMAGE)


def test_committed_manifest_is_the_generated_one():
    assert COMMITTED.read_text() == render(GPU_CONFIG, IMAGE), "run `pdd kuberay` to regenerate it"


def test_shapes(docs):
    service = RayService.model_validate(docs[0])
    assert service.apiVersion == "ray.io/v1" and service.kind == "RayService"
    assert [d["kind"] for d in docs] == ["RayService", "ConfigMap", "Deployment"]
    for group in [service.spec.rayClusterConfig.headGroupSpec, *service.spec.rayClusterConfig.workerGroupSpecs]:
        for c in group.template.spec["containers"]:
            assert c["image"] == IMAGE and c["resources"]["limits"] == c["resources"]["requests"]
        assert group.template.metadata["annotations"]["prometheus.io/scrape"] == "true"


def test_embedded_serve_config_is_the_source(docs, tmp_path):
    service = RayService.model_validate(docs[0])
    path = tmp_path / "embedded.yaml"
    path.write_text(service.spec.serveConfigV2)
    assert load_config(path) == load_config(GPU_CONFIG)
    assert yaml.safe_load(service.spec.serveConfigV2)["applications"] == yaml.safe_load(GPU_CONFIG.read_text())["applications"]


def test_worker_groups_carry_each_node_groups_placement(docs):
    config = load_config(GPU_CONFIG)
    groups = {g.groupName: g for g in RayService.model_validate(docs[0]).spec.rayClusterConfig.workerGroupSpecs}
    assert set(groups) == set(config.node_groups)
    for name, node_group in config.node_groups.items():
        g = groups[name]
        assert set(json.loads(g.rayStartParams["resources"].strip("'"))) == set(node_group.resources)
        assert g.rayStartParams["labels"] == f"pdd.io/datacenter={node_group.datacenter}"
        assert g.template.spec["nodeSelector"][ZONE_LABEL] == node_group.datacenter
        gpus_per_pod = int(g.rayStartParams["num-gpus"])
        assert gpus_per_pod == min(GPUS_PER_NODE, node_group.num_gpus)
        needed = sum(rc.replicas * node_group.num_gpus for rc in config.roles.present().values() if rc.node_group == name)
        assert g.replicas * gpus_per_pod >= needed and g.minReplicas <= g.replicas <= g.maxReplicas


def test_agents_read_the_config_through_cluster_services(docs):
    config_map, agents = docs[1], docs[2]
    cfg = yaml.safe_load(config_map["data"]["serve.yaml"])["applications"][0]["args"]["agents"]
    assert cfg["dashboard_url"] == "http://pdd-serve-head-svc:8265"
    container = agents["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["pdd", "agents", "run"]
    assert agents["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


def test_the_head_is_ready_only_while_the_app_can_serve(docs):
    """The serve service routes to the head's proxy; /health would answer while every engine is still starting."""
    head = RayService.model_validate(docs[0]).spec.rayClusterConfig.headGroupSpec.template.spec["containers"][0]
    port = yaml.safe_load(GPU_CONFIG.read_text())["http_options"]["port"]
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert {"containerPort": port, "name": "serve"} in head["ports"]


def test_ray_listens_on_the_pods_own_address():
    """The head's dashboard binds the pod's address, given to the container by the downward API."""
    head = manifest(GPU_CONFIG, IMAGE)[0]["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "$POD_IP"
    env = head["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env


def _ray_pods(docs) -> list[dict[str, Any]]:
    cluster = RayService.model_validate(docs[0]).spec.rayClusterConfig
    return [g.template.spec for g in [cluster.headGroupSpec, *cluster.workerGroupSpecs]]


def test_every_ray_pod_reads_the_keys_and_cluster_credentials_from_secrets(docs):
    for pod in _ray_pods(docs):
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["PDD_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "pdd-serve-api-keys", "key": "inference"}
        assert env["PDD_OPERATOR_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "pdd-serve-api-keys", "key": "operator"}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "cluster-tls")
        assert env["PDD_CLUSTER_TLS_FILE"]["value"] == f"{mount['mountPath']}/credentials.json" and mount["readOnly"]
        assert {"name": "cluster-tls", "secret": {"secretName": "pdd-serve-cluster-tls", "defaultMode": 0o400}} in pod["volumes"]


def _inline_keys_config(tmp_path):
    doc = yaml.safe_load(GPU_CONFIG.read_text())
    doc["applications"][0]["args"]["server"] = {"api_keys": ["inline-inference-key"], "operator_api_keys": ["inline-operator-key"], "max_output_tokens": 512}
    path = tmp_path / "with-keys.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_keys_written_inline_move_into_the_secret_out_of_the_manifest(tmp_path):
    config = _inline_keys_config(tmp_path)
    rendered = render(config, IMAGE)
    assert "inline-inference-key" not in rendered and "inline-operator-key" not in rendered
    embedded = yaml.safe_load(next(yaml.safe_load_all(rendered))["spec"]["serveConfigV2"])
    assert embedded["applications"][0]["args"]["server"] == {"max_output_tokens": 512}  # the rest stays
    keys = secret_manifests(config)[0]
    assert keys["kind"] == "Secret" and keys["stringData"] == {"inference": "inline-inference-key", "operator": "inline-operator-key"}


def test_secrets_go_to_a_private_file_with_fresh_keys_and_a_ca_and_are_kept_once_written(tmp_path):
    path = tmp_path / "private" / "pdd-serve-secrets.yaml"
    assert write_secrets(GPU_CONFIG, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    keys, tls = list(yaml.safe_load_all(path.read_text()))
    assert [keys["metadata"]["name"], tls["metadata"]["name"]] == ["pdd-serve-api-keys", "pdd-serve-cluster-tls"]
    assert keys["stringData"]["inference"] != keys["stringData"]["operator"] and all(len(k) > 40 for k in keys["stringData"].values())
    credentials = Credentials.from_json(tls["stringData"]["credentials.json"].encode())
    ClusterTLS(credentials)  # loads as the replicas load it
    for value in [*keys["stringData"].values(), credentials.key]:
        assert value not in COMMITTED.read_text()
    before = path.read_text()
    assert not write_secrets(GPU_CONFIG, path) and path.read_text() == before  # a new CA would split old pods from new


def test_pdd_kuberay_writes_both_files_and_says_how_to_apply_them(tmp_path):
    from typer.testing import CliRunner

    from app.ops.cli import main

    out, secrets_out = tmp_path / "rayservice.yaml", tmp_path / "secrets.yaml"
    result = CliRunner().invoke(main, ["kuberay", str(GPU_CONFIG), "-o", str(out), "--secrets-out", str(secrets_out)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert out.read_text() == render(GPU_CONFIG, IMAGE) and stat.S_IMODE(secrets_out.stat().st_mode) == 0o600
    assert f"kubectl apply -f {secrets_out} && kubectl apply -f {out}" in result.output
    assert "kept" in CliRunner().invoke(main, ["kuberay", str(GPU_CONFIG), "-o", str(out), "--secrets-out", str(secrets_out)], env={"COLUMNS": "300"}).output

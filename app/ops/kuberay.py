"""A KubeRay RayService (plus the agents' Deployment) generated from a serve config.

One source of truth: the serve config. Its node groups become Ray worker groups
(one per node group, pinned to the group's datacenter as a Kubernetes zone and
to its accelerator as a GPU product), each pod offering the group's Ray
resources and datacenter label exactly as `pdd cluster up` does locally; the
serve config itself is embedded as `serveConfigV2`; the agents run beside the
cluster as their own Deployment, reading the same config from a ConfigMap.

No secret is in that manifest. The API keys and the data plane's TLS credentials
(app/engine/cluster_tls.py) are Kubernetes Secrets, which `secret_manifests` makes (random
keys, a fresh CA) for a file of their own outside the repository; every Ray pod
reads the keys as env (PDD_API_KEYS, PDD_OPERATOR_API_KEYS) and the credentials as
a mounted file (PDD_CLUSTER_TLS_FILE). Keys written inline in the serve config
move into the Secret: they are left out of serveConfigV2 and the ConfigMap.
"""

from __future__ import annotations

import copy
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

import yaml

from app.config import PDDConfig
from app.config.file import load_config
from app.engine.cluster_tls import Credentials
from app.ops.cluster import CLUSTER_ENV, DATACENTER_LABEL

RAY_VERSION = "2.60.0"
METRICS_PORT = 8080
GPUS_PER_NODE = 8
#: Kubernetes node labels (NVIDIA GPU feature discovery, well-known zone label).
GPU_PRODUCT = {"H100": "NVIDIA-H100-80GB-HBM3", "H200": "NVIDIA-H200"}
ZONE_LABEL = "topology.kubernetes.io/zone"
#: The server fields whose values are keys: never in the manifest, in the API keys' Secret instead.
KEY_FIELDS = {"api_keys": "inference", "operator_api_keys": "operator"}
TLS_DIR, TLS_FILE = "/etc/pdd/tls", "credentials.json"


def _container(name: str, image: str, gpus: int, cpus: int, memory: str) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {
        "name": name,
        "image": image,
        "resources": {"limits": limits, "requests": dict(limits)},
        "env": [{"name": k, "value": v} for k, v in CLUSTER_ENV.items()],
        "ports": [{"containerPort": METRICS_PORT, "name": "metrics"}],
    }


def _secret_names(name: str) -> tuple[str, str]:
    """The Secrets of the API keys and of the cluster's TLS credentials."""
    return f"{name}-api-keys", f"{name}-cluster-tls"


def _ray_pod_template(container: dict[str, Any], node_selector: dict[str, str], name: str) -> dict[str, Any]:
    """A Ray pod: the API keys as env from their Secret, the TLS credentials mounted from theirs."""
    keys, tls = _secret_names(name)
    for env, field in (("PDD_API_KEYS", "inference"), ("PDD_OPERATOR_API_KEYS", "operator")):
        container["env"].append({"name": env, "valueFrom": {"secretKeyRef": {"name": keys, "key": field}}})
    container["env"].append({"name": "PDD_CLUSTER_TLS_FILE", "value": f"{TLS_DIR}/{TLS_FILE}"})  # read by app/engine/cluster_tls.py
    container["volumeMounts"] = [{"name": "cluster-tls", "mountPath": TLS_DIR, "readOnly": True}]
    template = _pod_template(container, node_selector)
    template["spec"]["volumes"] = [{"name": "cluster-tls", "secret": {"secretName": tls, "defaultMode": 0o400}}]
    return template


def _pod_template(container: dict[str, Any], node_selector: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container]}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        # Prometheus scrapes every Ray pod's metrics agent (ours and Serve's metrics)
        "metadata": {"annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}},
        "spec": spec,
    }


def _without_keys(doc: dict[str, Any]) -> dict[str, Any]:
    """The serve config with no key in it (they go to the Secret)."""
    doc = copy.deepcopy(doc)
    for app in doc.get("applications") or []:
        server = (app.get("args") or {}).get("server") or {}
        for field in KEY_FIELDS:
            server.pop(field, None)
    return doc


def manifest(serve_config_path: Path, image: str, name: str = "pdd-serve", prometheus_url: str = "http://prometheus:9090") -> list[dict[str, Any]]:
    doc = _without_keys(yaml.safe_load(serve_config_path.read_text()))
    config = load_config(serve_config_path)
    serve_config = {k: v for k, v in doc.items() if k in ("proxy_location", "http_options", "applications")}
    ray_service = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": _head_group(image, (doc.get("http_options") or {}).get("port", 8000), name),
                "workerGroupSpecs": _worker_groups(config, image, name),
            },
        },
    }
    return [ray_service, *_agents(doc, image, name, prometheus_url)]


def _worker_groups(config: PDDConfig, image: str, name: str) -> list[dict[str, Any]]:
    """One worker group per node group, in its datacenter's zone, sized for its roles' replicas."""
    workers = []
    for group_name, group in config.node_groups.items():
        gpus_needed = sum(rc.replicas * group.num_gpus for rc in config.roles.present().values() if rc.node_group == group_name)
        max_gpus = sum(rc.max_replicas * group.num_gpus for rc in config.roles.present().values() if rc.node_group == group_name)
        per_pod = min(GPUS_PER_NODE, int(group.num_gpus)) or GPUS_PER_NODE
        resources = {name_: 100 for name_ in group.resources}
        start_params = {
            "num-gpus": str(per_pod),
            "resources": f"'{json.dumps(resources)}'",
            "labels": f"{DATACENTER_LABEL}={group.datacenter}",
            "metrics-export-port": str(METRICS_PORT),
        }
        selector = {ZONE_LABEL: group.datacenter}
        if group.accelerator in GPU_PRODUCT:
            selector["nvidia.com/gpu.product"] = GPU_PRODUCT[group.accelerator]
        workers.append(
            {
                "groupName": group_name,
                "replicas": max(1, math.ceil(gpus_needed / per_pod)),
                "minReplicas": max(1, math.ceil(gpus_needed / per_pod)),
                "maxReplicas": max(1, math.ceil(max_gpus / per_pod)),
                "rayStartParams": start_params,
                "template": _ray_pod_template(_container("ray-worker", image, per_pod, 32, "1000Gi"), selector, name),
            }
        )
    return workers


def _head_group(image: str, http_port: int, name: str) -> dict[str, Any]:
    # the dashboard listens on the pod's own address (the agents reach it through the head
    # service), not every interface; `ray start` runs in a shell, which expands POD_IP
    head_params = {"dashboard-host": "$POD_IP", "num-gpus": "0", "metrics-export-port": str(METRICS_PORT)}
    head = _container("ray-head", image, 0, 8, "32Gi")
    head["env"].append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    # the serve service sends traffic to the head's proxy (proxy_location HeadOnly) only while the
    # app can serve: /health answers while every engine is still starting, /ready does not
    head["ports"].append({"containerPort": http_port, "name": "serve"})
    head["readinessProbe"] = {"httpGet": {"path": "/ready", "port": http_port}, "periodSeconds": 5, "failureThreshold": 3}
    return {"rayStartParams": head_params, "template": _ray_pod_template(head, {}, name)}


def _agents(doc: dict[str, Any], image: str, name: str, prometheus_url: str) -> list[dict[str, Any]]:
    """The agents' Deployment and the config it reads, which points at in-cluster services."""
    agents_doc = copy.deepcopy(doc)
    agents_args = agents_doc["applications"][0]["args"].setdefault("agents", {})
    agents_args.update(dashboard_url=f"http://{name}-head-svc:8265", prometheus_url=prometheus_url)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config"},
        "data": {"serve.yaml": yaml.safe_dump(agents_doc, sort_keys=False)},
    }
    container = {
        "name": "agents",
        "image": image,
        "command": ["pdd", "agents", "run", "--config", "/etc/pdd/serve.yaml"],
        "env": [{"name": "RAY_AUTH_MODE", "value": "token"}],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/pdd"}],
    }
    agents = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{name}-agents"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": f"{name}-agents"}},
            "template": {
                "metadata": {"labels": {"app": f"{name}-agents"}},
                "spec": {"containers": [container], "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}]},
            },
        },
    }
    return [config_map, agents]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded serve config) as readable `|` blocks."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def secret_manifests(serve_config_path: Path, name: str = "pdd-serve") -> list[dict[str, Any]]:
    """The Secrets the manifest's pods read: API keys (the serve config's inline ones, else one
    random key of each scope) and a new CA and certificate for the data plane."""
    args = yaml.safe_load(serve_config_path.read_text())["applications"][0].get("args") or {}
    server = args.get("server") or {}
    keys = {scope: ",".join(server.get(field) or [f"pdd-{secrets.token_urlsafe(32)}"]) for field, scope in KEY_FIELDS.items()}
    keys_name, tls_name = _secret_names(name)
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": keys_name}, "type": "Opaque", "stringData": keys},
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": tls_name},
            "type": "Opaque",
            "stringData": {TLS_FILE: Credentials.generate().to_json().decode()},
        },
    ]


def write_secrets(serve_config_path: Path, path: Path, name: str = "pdd-serve") -> bool:
    """`secret_manifests` into `path`, readable by this user only; a file already there is kept (a new CA
    would split running pods from new ones). Returns whether it wrote one."""
    if path.exists():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write("# Generated by `pdd kuberay`: secrets. Keep this file out of version control.\n")
        f.write(yaml.dump_all(secret_manifests(serve_config_path, name), Dumper=_Dumper, sort_keys=False))
    return True


def render(serve_config_path: Path, image: str, name: str = "pdd-serve", prometheus_url: str = "http://prometheus:9090") -> str:
    header = (
        f"# Generated by `pdd kuberay` from {serve_config_path.name}; edit the serve config, not this file.\n"
        "# Not yet applied to a real Kubernetes cluster: checked against the RayService schema\n"
        "# fields by tests/unit/test_kuberay.py only (README, 'Run on Kubernetes').\n"
        "# Its pods read API keys and the data plane's credentials from Secrets `pdd kuberay` writes elsewhere.\n"
    )
    return header + yaml.dump_all(manifest(serve_config_path, image, name, prometheus_url), Dumper=_Dumper, sort_keys=False)

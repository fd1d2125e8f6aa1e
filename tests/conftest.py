"""Shared helpers: the example configs every test starts from."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CONFIG = ROOT / "serve_configs" / "local.yaml"


def local_args() -> dict[str, Any]:
    """The PDD config inside serve_configs/local.yaml, as a fresh dict."""
    doc = yaml.safe_load(LOCAL_CONFIG.read_text())
    return copy.deepcopy(doc["applications"][0]["args"])


def set_wan(args: dict[str, Any], bandwidth_mbps: float, rtt_ms: float, jitter: bool = False) -> dict[str, Any]:
    """Give the dc-a <-> dc-b link of an app config these figures (no jitter unless asked)."""
    for link in args["links"]:
        if link["between"] == ["dc-a", "dc-b"]:
            link.update(bandwidth_mbps=bandwidth_mbps, rtt_ms=rtt_ms)
            if not jitter:
                link["jitter"] = {"distribution": "none"}
    return args


def on_one_gpu(args: dict[str, Any], model: str = "llama8b", memory_fraction: float = 0.28) -> dict[str, Any]:
    """Every engine of an app config on one CUDA GPU (the roles' node groups each take a share of
    it), each engine with `memory_fraction` of the card's memory.

    `model`: `llama8b`, dummy weights of Llama-3-8B's shape in bfloat16 (real compute and KV
    sizes, for benchmarks), or `devmodel`, the float32 dev model (token identity between
    pipelines needs its wide logit gaps: a bfloat16 model's near-ties flip with batch shape)."""
    if model == "llama8b":
        from app.engine.devmodel import ensure_llama8b_shape

        args["model"].update(source=str(ensure_llama8b_shape()), load_format="dummy", dtype="bfloat16", block_size=16, max_model_len=16384)
    elif model != "devmodel":
        raise ValueError(f"model: 'llama8b' or 'devmodel', not {model!r}")
    engines = sum(role.get("replicas", 1) for role in args["roles"].values())
    for group in args["node_groups"].values():
        group.update(num_gpus=math.floor(100 / engines) / 100, accelerator="cuda")
    for role in args["roles"].values():
        role["engine"] = {"gpu_memory_utilization": memory_fraction, "max_num_seqs": 64}
    return args


@pytest.fixture
def args() -> dict[str, Any]:
    return local_args()

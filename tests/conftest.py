"""Shared helpers: the example configs every test starts from."""

from __future__ import annotations

import copy
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


@pytest.fixture
def args() -> dict[str, Any]:
    return local_args()

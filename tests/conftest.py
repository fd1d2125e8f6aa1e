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


@pytest.fixture
def args() -> dict[str, Any]:
    return local_args()

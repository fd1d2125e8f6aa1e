"""Reading a configuration: a Serve config file (or a bare PDD config) into a
validated `PDDConfig` (app/config.py), each problem named by its field's path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from app.config import PDDConfig


class ConfigError(ValueError):
    """A configuration failed validation; the message names each bad field."""


def validation_problems(err: ValidationError, prefix: str = "") -> list[str]:
    """One "field.path: message" per error."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if loc:
            lines.append(f"{'.'.join(x for x in (prefix, loc) if x)}: {msg}")
        else:  # whole-model checks start their message with the field's path
            lines.append(f"{prefix}.{msg}" if prefix else msg)
    return lines


def format_validation_error(err: ValidationError, prefix: str = "", what: str = "configuration") -> str:
    return f"invalid {what}:\n  " + "\n  ".join(validation_problems(err, prefix))


def parse_config(data: dict[str, Any], prefix: str = "") -> PDDConfig:
    try:
        return PDDConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix)) from None


def _app_args(doc: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The PDD config inside a file: a Serve config's app args, or a bare PDDConfig."""
    if "applications" not in doc:
        return doc, ""
    apps = doc["applications"] or []
    for i, app in enumerate(apps):
        if str(app.get("import_path", "")).startswith("app.builder:"):
            args = app.get("args") or {}
            if not isinstance(args, dict):
                raise ConfigError(f"{path}: applications.{i}.args must be a mapping")
            return args, f"applications.{i}.args"
    raise ConfigError(f"{path}: no application with import_path app.builder:build_app")


def load_config(path: str | os.PathLike) -> PDDConfig:
    """Load a serve config (or a bare PDD config) YAML; errors name the field."""
    text = Path(path).read_text()
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    args, prefix = _app_args(doc, str(path))
    return parse_config(args, prefix)

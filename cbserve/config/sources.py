"""Where a configuration's raw values come from besides keyword arguments: a YAML file of the fields, or a Serve
config file whose first application's ``args`` (and deployment options) hold them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from cbserve.config.autoscaling import from_serve_deployments


def read_yaml(path: str | os.PathLike[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """The raw values of ``path``, with ``overrides`` (those not None) on top."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    if "applications" in data:  # a Serve config file: take the first application's args
        apps = data["applications"] or [{}]
        data = dict(apps[0].get("args") or {}) | from_serve_deployments(apps[0])
    data.pop("config", None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return data

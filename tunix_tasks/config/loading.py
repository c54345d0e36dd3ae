"""Loading a `RunConfig`: YAML or JSON files, plain dicts, and `dotted.key=value` overrides.

    cfg = load_config("run.yaml", overrides=["actor.num_actors=4", "learner.max_steps=50"])
    cfg = config_from_dict({"env": {"name": "calculator"}}, ["learner.max_steps=10"])

Validation errors become one `ConfigError` listing every bad field as `section.field:
message (got value)`; valid-but-suspicious settings are warned as `ConfigWarning`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tunix_tasks.config.base import ConfigError, ConfigWarning
from tunix_tasks.config.run import RunConfig

__all__ = ["apply_overrides", "config_from_dict", "load_config"]


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(
            f"{loc}: {msg}"
            + (
                f" (got {e['input']!r})"
                if "input" in e and not isinstance(e["input"], dict)
                else ""
            )
        )
    return "invalid run configuration:\n  " + "\n  ".join(lines)


def _parse_value(text: str) -> Any:
    """Override values are YAML scalars/flow collections: 4, 0.5, true, [64,128], sync."""
    return yaml.safe_load(text)


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `dotted.key=value` applied."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return out


def config_from_dict(data: Mapping[str, Any], overrides: Iterable[str] = ()) -> RunConfig:
    """Validate a plain dict (from YAML, JSON, DAG params) into a RunConfig."""
    try:
        cfg = RunConfig.model_validate(apply_overrides(data, overrides))
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    for message in cfg.warnings:
        warnings.warn(message, ConfigWarning, stacklevel=2)
    return cfg


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load YAML or JSON from `path` (or defaults), then apply `key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text)  # YAML is a superset of JSON
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded or {}
    return config_from_dict(data, overrides)

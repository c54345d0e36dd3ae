"""Loading a `RunConfig`: YAML or JSON files, plain dicts, and `dotted.key=value` overrides.

    cfg = load_config("run.yaml", overrides=["actor.num_actors=4", "learner.max_steps=50"])
    cfg = config_from_dict({"env": {"name": "calculator"}}, ["learner.max_steps=10"])

Validation errors become one `ConfigError` listing every bad field as `section.field:
message (got value)`; valid-but-suspicious settings are warned as `ConfigWarning`.

YAML (a file or an override's value) is read within bounds, so a hostile or broken file
fails in one `ConfigError` naming it and the bound, in bounded time and memory: at most
`MAX_CONFIG_BYTES` are read, nesting is at most `MAX_YAML_DEPTH` levels (checked while
composing, before the recursive composer could overflow the stack), and the composed
node graph, aliases expanded, holds at most `MAX_YAML_NODES` values and no recursive
alias (checked before any Python object is built: a "billion laughs" file is refused
without expanding it). docs/configuration.md, "Bounds".
"""

from __future__ import annotations

import json
import reprlib
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tunix_tasks.config.base import ConfigError, ConfigWarning
from tunix_tasks.config.run import RunConfig

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "apply_overrides",
    "config_from_dict",
    "load_config",
]

MAX_CONFIG_BYTES = 1 << 20  # a config file is read up to 1 MiB
MAX_YAML_DEPTH = 64  # nesting levels, aliases expanded (a real config has ~4)
MAX_YAML_NODES = 100_000  # values of the document, aliases expanded (a real one: ~100)
_BOUNDS = "docs/configuration.md, 'Bounds'"

_shown = reprlib.Repr()  # a bad value in an error message: its start, never all of it
_shown.maxstring = _shown.maxother = 120
_shown.maxlist = _shown.maxtuple = _shown.maxdict = _shown.maxset = 8


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        # Our own validators' messages already say "got ..."; pydantic's do not.
        shown = "input" in e and not isinstance(e["input"], dict) and "got " not in msg
        lines.append(f"{loc}: {msg}" + (f" (got {_shown.repr(e['input'])})" if shown else ""))
    return "invalid run configuration:\n  " + "\n  ".join(lines)


def _too_deep(source: str) -> ConfigError:
    return ConfigError(
        f"{source} nests deeper than {MAX_YAML_DEPTH} levels (aliases expanded), the bound "
        f"on a configuration ({_BOUNDS})"
    )


class _BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses nesting deeper than `MAX_YAML_DEPTH` while it
    composes the node graph (PyYAML's composer recurses once per level)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.source, self._depth = source, 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _too_deep(self.source)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_graph(root: yaml.Node, source: str) -> None:
    """Refuse a node graph that, aliases expanded, holds more than `MAX_YAML_NODES`
    values, nests deeper than `MAX_YAML_DEPTH` levels, or contains itself. Each node is
    measured once (a shared node's size is remembered), so this is linear in the file."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
    open_nodes: set[int] = set()

    def measure(node: yaml.Node, level: int) -> tuple[int, int]:
        key = id(node)
        if key in open_nodes:
            raise ConfigError(
                f"{source} has a recursive alias (a node that contains itself, line "
                f"{node.start_mark.line + 1}); a configuration is a tree"
            )
        if key not in measured:
            if level > MAX_YAML_DEPTH:
                raise _too_deep(source)
            open_nodes.add(key)
            values, height = 1, 0
            for child in _children(node):
                n, h = measure(child, level + 1)
                values, height = values + n, max(height, h)
                if values > MAX_YAML_NODES:
                    raise ConfigError(
                        f"{source} expands to more than {MAX_YAML_NODES:,} values (aliases "
                        f"expanded), the bound on a configuration ({_BOUNDS})"
                    )
            open_nodes.discard(key)
            measured[key] = (values, height + 1)
        values, height = measured[key]
        if level + height - 1 > MAX_YAML_DEPTH:
            raise _too_deep(source)
        return values, height

    measure(root, 1)


def load_yaml(text: str, source: str) -> Any:
    """`yaml.safe_load(text)` within the bounds above; `source` names the text in errors
    (`config file run.yaml`). Raises `ConfigError` past a bound, `yaml.YAMLError` for
    text that is not YAML."""
    loader = _BoundedLoader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, source)
        try:
            return loader.construct_document(node)
        except ValueError as err:  # e.g. an integer of more than 4300 digits
            raise ConfigError(
                f"{source}: a value cannot be read: {str(err).split(';')[0]}"
            ) from None
    finally:
        loader.dispose()


def _parse_value(item: str, text: str) -> Any:
    """Override values are YAML scalars/flow collections: 4, 0.5, true, [64,128], sync."""
    return load_yaml(text, f"override {item!r}")


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
        node[parts[-1]] = _parse_value(item, raw)
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
    """Load YAML or JSON from `path` (or defaults), then apply `key=value` overrides.

    The file is read up to `MAX_CONFIG_BYTES` (a bigger one is refused) and parsed
    within the bounds of `load_yaml`."""
    data: dict[str, Any] = {}
    if path is not None:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path} is larger than {MAX_CONFIG_BYTES:,} bytes, the bound on "
                f"a configuration ({_BOUNDS})"
            )
        loaded = load_yaml(raw.decode(), f"config file {path}")  # YAML is a superset of JSON
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded or {}
    return config_from_dict(data, overrides)

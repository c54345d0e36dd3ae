"""Flat forms over `RunConfig`: which dotted keys a form exposes, and their JSON schema.

An orchestrator's form (the Airflow DAG params) is a flat list of fields, each one a
dotted `RunConfig` key. Their type, default, bounds, enumeration and description are
read from `RunConfig.model_json_schema()`, so they are declared once, in `tunix_tasks/config/`:

    specs = form_specs()                    # {"num_actors": FieldSpec(key="actor.num_actors", ...)}
    specs["num_actors"].schema()            # {"type": "integer", "minimum": 1, "maximum": 1024, ...}
    run_config_from_params({"num_actors": 4, "env": "calculator"}, run_name="r1")
    # -> {"actor": {"num_actors": 4}, "env": {"name": "calculator"}, "run_name": "r1"}
    recipe_defaults(load_config("configs/demo.yaml"))
    # -> {"warm_start_steps": 140, ..., "overrides": ["env.latency_jitter=0.5", ...]}:
    #    the form's defaults that reproduce a recipe (fields it lacks go in `overrides`)

Imports only pydantic (through `tunix_tasks.config`): an Airflow DAG file may import it
at parse time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tunix_tasks.config.run import RunConfig

__all__ = [
    "FORM_KEYS",
    "FORM_OPTIONAL",
    "FieldSpec",
    "field_specs",
    "flat_fields",
    "form_specs",
    "recipe_defaults",
    "run_config_from_params",
]

#: The training form: param name -> dotted `RunConfig` key. The names are those of the
#: Airflow DAG params (UI, REST `conf`), kept stable for existing triggers.
FORM_KEYS: dict[str, str] = {
    "store": "store",
    "run_name": "run_name",
    "env": "env.name",
    "model_preset": "model.preset",
    "model_checkpoint": "model.checkpoint",
    "num_actors": "actor.num_actors",
    "envs_per_actor": "actor.envs_per_actor",
    "max_steps": "learner.max_steps",
    "max_staleness": "learner.max_staleness",
    "publish_every": "learner.publish_every",
    "deadline_s": "deadline_s",
    "env_latency_s": "env.latency_s",
    "env_max_turns": "env.max_turns",
    "seed": "seed",
    "warm_start_steps": "warm_start_steps",
    "learning_rate": "learner.learning_rate",
}

#: Form fields a run can do without: the form takes them empty (null, no "required"
#: badge), and empty leaves the config's default (no latency, no deadline, no warm start).
FORM_OPTIONAL: frozenset[str] = frozenset(
    {"env_latency_s", "deadline_s", "seed", "warm_start_steps"}
)


@dataclass(frozen=True)
class FieldSpec:
    """One leaf field of the config, as its JSON schema describes it."""

    key: str  # dotted RunConfig key, e.g. "actor.num_actors"
    type: str | list[str] | None  # JSON type; ["number", "null"] for an optional field
    default: Any = None
    description: str | None = None
    title: str | None = None
    enum: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None

    def schema(self) -> dict[str, Any]:
        """The field's JSON-schema keywords (those set), e.g. for an Airflow `Param`."""
        values = {
            "type": self.type,
            "enum": list(self.enum) if self.enum is not None else None,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "exclusiveMinimum": self.exclusive_minimum,
            "exclusiveMaximum": self.exclusive_maximum,
            "pattern": self.pattern,
            "minLength": self.min_length,
            "maxLength": self.max_length,
            "description": self.description,
        }
        return {k: v for k, v in values.items() if v is not None}


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """Follow `$ref` (also wrapped in a one-element `allOf`), keeping sibling keywords."""
    node = dict(node)
    seen: set[str] = set()
    while True:
        ref = node.pop("$ref", None)
        if ref is None and len(node.get("allOf", ())) == 1 and "$ref" in node["allOf"][0]:
            ref = node.pop("allOf")[0]["$ref"]
        if ref is None:
            return node
        if not ref.startswith("#/$defs/") or ref in seen:
            raise ValueError(f"cannot resolve JSON-schema reference {ref!r}")
        seen.add(ref)
        target = defs[ref.removeprefix("#/$defs/")]
        node = {**target, **node}  # the referring node's keywords (description...) win


def _leaf(node: dict[str, Any], defs: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Collapse `anyOf: [<schema>, {"type": "null"}]` (an Optional field) to its schema."""
    options = node.get("anyOf")
    if not options:
        return node, False
    non_null = [_resolve(o, defs) for o in options if o.get("type") != "null"]
    if len(non_null) != 1:
        raise ValueError(f"field with several non-null types is not a form field: {node}")
    merged = {**non_null[0], **{k: v for k, v in node.items() if k != "anyOf"}}
    return merged, len(non_null) < len(options)


def field_specs(schema: Mapping[str, Any], keys: Iterable[str]) -> dict[str, FieldSpec]:
    """{dotted key: FieldSpec} of each key, read from a pydantic JSON schema.

    `schema` is `RunConfig.model_json_schema()` (or any pydantic model's); `$defs` / `$ref`
    are resolved. Raises KeyError naming a key that is not a leaf field of the schema.
    """
    defs = schema.get("$defs", {})
    out: dict[str, FieldSpec] = {}
    for key in keys:
        node: dict[str, Any] = _resolve(schema, defs)
        for part in key.split("."):
            props = node.get("properties", {})
            if part not in props:
                raise KeyError(f"{key!r} is not a field of {schema.get('title', 'the schema')}")
            node = _resolve(props[part], defs)
        if "properties" in node:
            raise KeyError(f"{key!r} is a section, not a field")
        node, nullable = _leaf(node, defs)
        json_type = node.get("type")
        if nullable and isinstance(json_type, str):
            json_type = [json_type, "null"]
        out[key] = FieldSpec(
            key=key,
            type=json_type,
            default=node.get("default"),
            description=node.get("description"),
            title=node.get("title"),
            enum=tuple(node["enum"]) if "enum" in node else None,
            minimum=node.get("minimum"),
            maximum=node.get("maximum"),
            exclusive_minimum=node.get("exclusiveMinimum"),
            exclusive_maximum=node.get("exclusiveMaximum"),
            pattern=node.get("pattern"),
            min_length=node.get("minLength"),
            max_length=node.get("maxLength"),
        )
    return out


def form_specs(keys: Mapping[str, str] = FORM_KEYS) -> dict[str, FieldSpec]:
    """{param name: FieldSpec} of a form over `RunConfig` (default: the training form)."""
    specs = field_specs(RunConfig.model_json_schema(), keys.values())
    return {name: specs[key] for name, key in keys.items()}


def run_config_from_params(
    params: Mapping[str, Any],
    run_name: str | None = None,
    keys: Mapping[str, str] = FORM_KEYS,
) -> dict[str, Any]:
    """Nest the flat form values onto a `RunConfig` dict (to validate with `config_from_dict`).

    Params that are missing or None are left out (the config's default applies), params
    that are not in `keys` are ignored; `run_name`, when given, wins over the form's.
    """
    out: dict[str, Any] = {}
    for name, key in keys.items():
        value = params.get(name)
        if value is None:
            continue
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    if run_name is not None:
        out["run_name"] = run_name
    return out


def flat_fields(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every non-dict value of a nested dict."""
    for name, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from flat_fields(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def recipe_defaults(recipe: RunConfig, keys: Mapping[str, str] = FORM_KEYS) -> dict[str, Any]:
    """The form values that reproduce `recipe` (e.g. `configs/demo.yaml`): each form
    field's value in it, and `overrides`: `key=value` (JSON, which override values read
    as YAML) for every other field where the recipe differs from `RunConfig`'s defaults.
    `store` and `run_name` are left to the form."""
    data = json.loads(recipe.to_json())
    default = dict(flat_fields(json.loads(RunConfig().to_json())))
    values: dict[str, Any] = dict(flat_fields(data))
    shown = set(keys.values())
    form = {name: values.get(key) for name, key in keys.items() if key not in ("store", "run_name")}
    form["overrides"] = [
        f"{key}={json.dumps(value)}"
        for key, value in values.items()
        if key not in shown | {"store", "run_name"} and default.get(key, ...) != value
    ]
    return form

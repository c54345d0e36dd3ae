"""The DAG-run form of a training run, generated from `tunix_tasks.config.RunConfig`.

Which fields the form exposes, and under which names, is `tunix_tasks.config.params.FORM_KEYS`
(e.g. `num_actors` -> `actor.num_actors`); each field's type, default, bounds, enumeration
and description come from `RunConfig`'s JSON schema, so they are declared once, in
`tunix_tasks/config/`. This module only turns them into `airflow.sdk.Param`s and adds
what belongs to the form alone: titles, the form's own defaults (`form_defaults()`), an
empty `run_name` (derived from the Airflow run_id), an explicit store scheme, fields that
may be left empty (`FORM_OPTIONAL`), and the free-form `overrides` list.

The defaults are the demo's recipe (`configs/demo.yaml`, or the file `TUNIX_FORM_RECIPE`
names): the form's fields take its values, and what it sets beyond them is the default
`overrides` list, so a run triggered with the defaults learns as `make demo` does.

Imported at DAG parse time: only `airflow.sdk` and `tunix_tasks.config.params` (pydantic).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from airflow.sdk import Param

DAGS_DIR = Path(__file__).resolve().parent
REPO_ROOT = DAGS_DIR.parent


def ensure_library_importable() -> None:
    """Make `import tunix_tasks` work in a local checkout started without `PYTHONPATH`.

    Installed deployments (`pip install .` in the Airflow image) need nothing; a local
    checkout gets the repo root appended to `sys.path`.
    """
    if (REPO_ROOT / "tunix_tasks").is_dir() and str(REPO_ROOT) not in sys.path:
        try:
            import tunix_tasks  # noqa: F401
        except ImportError:
            sys.path.append(str(REPO_ROOT))


ensure_library_importable()

from tunix_tasks.config import known_env_names, load_config  # noqa: E402
from tunix_tasks.config.params import (  # noqa: E402
    FORM_KEYS,
    FORM_OPTIONAL,
    form_specs,
    recipe_defaults,
    run_config_from_params,
)

__all__ = [
    "FORM_KEYS",
    "OVERRIDE_PATTERN",
    "check_conf_keys",
    "default_store",
    "ensure_library_importable",
    "form_defaults",
    "form_recipe",
    "run_config_from_params",
    "sanitize_run_name",
    "training_params",
]

#: `overrides` items: `section.field=value` (any RunConfig field), applied last.
OVERRIDE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*=.*$"

TITLES = {
    "store": "Store URI",
    "run_name": "Run name (empty: from the Airflow run_id)",
    "env": "Environment",
    "model_preset": "Model preset",
    "model_checkpoint": "Hugging Face checkpoint (path or gs://; empty: the preset)",
    "num_actors": "Number of actors (mapped tasks in pool 'cpu')",
    "envs_per_actor": "Envs per actor",
    "max_steps": "Max learner steps",
    "max_staleness": "Max staleness",
    "publish_every": "Publish interval (steps)",
    "deadline_s": "Deadline (seconds)",
    "env_latency_s": "Env latency (seconds)",
    "env_max_turns": "Max turns per episode",
    "seed": "Seed",
    "warm_start_steps": "Warm-start steps (imitation of demonstrations before RL)",
    "learning_rate": "Learning rate",
}


def default_store() -> str:
    """`TUNIX_STORE` or `file://<repo>/runs` (evaluated when the DAG file is parsed)."""
    return os.environ.get("TUNIX_STORE") or f"file://{REPO_ROOT / 'runs'}"


def form_recipe() -> Path:
    """The recipe the form's defaults reproduce: `TUNIX_FORM_RECIPE` or configs/demo.yaml."""
    return Path(os.environ.get("TUNIX_FORM_RECIPE") or REPO_ROOT / "configs" / "demo.yaml")


def form_defaults() -> dict[str, Any]:
    """Where the form's defaults differ from RunConfig's: the recipe's values and
    overrides (`form_recipe()`, when the file is there), the store, an empty run name
    (from the run_id) and a deadline."""
    recipe = form_recipe()
    values = recipe_defaults(load_config(recipe)) if recipe.is_file() else {}
    return {**values, "store": default_store(), "run_name": "", "deadline_s": 3600}


def sanitize_run_name(text: str) -> str:
    """Turn an Airflow run_id (``manual__2025-01-01T00:00:00+00:00``) into a run name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "run"


def check_conf_keys(conf: Any, valid: Any) -> None:
    """Raise ValueError naming the trigger `conf` keys that are not params (a typo such as
    `max_step` would otherwise run with the defaults), with the valid ones."""
    import difflib

    valid = sorted(valid)
    unknown = sorted(set(conf or {}) - set(valid))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"unknown param(s) in the trigger conf: {', '.join(hints)}; valid params: "
        f"{', '.join(valid)} (other RunConfig fields go in 'overrides')"
    )


def _form_only(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Form rules on top of the config's schema (never looser than the config)."""
    if name == "run_name":  # empty or null (the UI sends null): derived from the run_id
        return {"type": ["null", "string"], "pattern": f"^$|{schema['pattern']}", "maxLength": 128}
    if name == "store":  # the config also takes plain paths; the form wants a URI
        return {"pattern": r"^(file|gs)://", "minLength": 1}
    if name in FORM_OPTIONAL and isinstance(schema.get("type"), str):  # empty: the default
        return {"type": [schema["type"], "null"]}
    return {}


def training_params(
    *, require_run_name: bool = False, titles: dict[str, str] | None = None, **defaults: Any
) -> dict[str, Param]:
    """The DAG-run form of a training run. `defaults` override the default values,
    `titles` the field titles; `require_run_name` refuses an empty run name."""
    specs = form_specs(FORM_KEYS)
    unknown = set(defaults) - set(specs) - {"overrides"}
    if unknown:
        raise TypeError(f"unknown training params: {sorted(unknown)}")
    values = {name: spec.default for name, spec in specs.items()}
    values["overrides"] = []
    values.update(form_defaults())
    values.update(defaults)
    titles = {**TITLES, **(titles or {})}
    params = {}
    for name, spec in specs.items():
        schema = spec.schema()
        if not (name == "run_name" and require_run_name):
            schema.update(_form_only(name, schema))
        if name == "env" and "enum" in schema:  # plug-ins too: suggestions + free text
            schema.pop("enum")  # (prepare validates the name against the registry)
            schema.update(examples=known_env_names(), minLength=1)
        params[name] = Param(values[name], title=titles.get(name, spec.title), **schema)
    params["overrides"] = Param(
        values["overrides"],
        type=["null", "array"],  # optional: no "required" badge in the UI (empty = null)
        items={"type": "string", "pattern": OVERRIDE_PATTERN},
        title="Extra config overrides",
        description="Advanced: RunConfig overrides as 'section.field=value' "
        "(e.g. 'learner.batch_rows=4'), applied last.",
    )
    return params

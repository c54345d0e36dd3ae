"""`tunix_tasks.config.params`: flat forms read from RunConfig's JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tunix_tasks.config import RunConfig, config_from_dict
from tunix_tasks.config.params import (
    FORM_KEYS,
    field_specs,
    form_specs,
    run_config_from_params,
)

from .conftest import REPO


def test_field_specs_resolve_refs_bounds_and_enums():
    specs = field_specs(
        RunConfig.model_json_schema(),
        ["actor.num_actors", "model.preset", "env.step_timeout_s", "learner.mesh.data"],
    )
    num = specs["actor.num_actors"]
    assert (num.type, num.default, num.minimum, num.maximum) == ("integer", 2, 1, 1024)
    assert num.schema() == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1024,
        "description": num.description,
    }
    assert specs["model.preset"].enum == ("tiny", "small", "base", "custom")
    assert specs["env.step_timeout_s"].exclusive_minimum == 0.0
    assert specs["env.step_timeout_s"].schema()["exclusiveMinimum"] == 0.0
    assert specs["learner.mesh.data"].default == -1  # two levels of $ref


def test_field_specs_optional_field():
    (spec,) = field_specs(
        RunConfig.model_json_schema(), ["learner.warm_start_learning_rate"]
    ).values()
    assert spec.type == ["number", "null"] and spec.exclusive_minimum == 0.0
    assert spec.default is None and spec.description


@pytest.mark.parametrize("key", ["actor", "actor.nope", "nope"])
def test_field_specs_reject_non_fields(key):
    with pytest.raises(KeyError, match=key.split(".")[0]):
        field_specs(RunConfig.model_json_schema(), [key])


def test_form_specs_cover_the_form_with_descriptions():
    specs = form_specs()
    assert list(specs) == list(FORM_KEYS)
    for name, spec in specs.items():
        assert spec.key == FORM_KEYS[name] and spec.description, name
        scalar = (
            spec.type[0] if isinstance(spec.type, list) and spec.type[1:] == ["null"] else spec.type
        )
        assert scalar in ("string", "integer", "number"), name  # or optional (X, null)


def test_defaults_of_the_form_validate():
    params = {name: spec.default for name, spec in form_specs().items()}
    cfg = config_from_dict(run_config_from_params(params))
    assert cfg == RunConfig()


def test_run_config_from_params_is_generic():
    keys = {"a": "learner.max_steps", "b": "learner.mesh.fsdp", "c": "seed"}
    params = {"a": 7, "b": 2, "c": None, "unrelated": 1}
    assert run_config_from_params(params, "r1", keys=keys) == {
        "learner": {"max_steps": 7, "mesh": {"fsdp": 2}},
        "run_name": "r1",
    }
    cfg = config_from_dict(run_config_from_params(params, "r1", keys=keys))
    assert (cfg.learner.max_steps, cfg.learner.mesh.fsdp, cfg.run_name) == (7, 2, "r1")


def test_config_params_import_is_light():
    code = (
        "import sys, tunix_tasks.config.params; "
        "print(sorted(m for m in sys.modules if m.startswith(('tunix_tasks', 'jax', 'numpy'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=REPO,
    ).stdout
    light = {
        "tunix_tasks",
        "tunix_tasks.env_kwargs",  # the env kwargs checks: standard library only
        "tunix_tasks.registry",
        "tunix_tasks.storage",
        "tunix_tasks.storage.uri",
    }
    light |= {
        f"tunix_tasks.config.{m}"
        for m in (
            *("agent", "autopilot", "base", "env", "loading", "model", "objective", "remote"),
            "resume",
        )
    }
    light |= {"tunix_tasks.config", "tunix_tasks.config.params", "tunix_tasks.config.run"}
    assert set(json.loads(out.replace("'", '"'))) == light

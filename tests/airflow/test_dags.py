"""Static checks of the tunix DAGs: import, structure, params form, parse time, layout."""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DAGS, REPO

DAG_FILES = ["tunix_train.py", "tunix_recurring.py", "tunix_eval.py"]
HELPERS = sorted(p.name for p in DAGS.glob("*.py") if p.name not in DAG_FILES)


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == {"tunix_train", "tunix_recurring", "tunix_eval"}


def test_helper_modules_are_not_parsed_as_dags():
    ignored = (DAGS / ".airflowignore").read_text().split()
    assert HELPERS and set(HELPERS) <= set(ignored)
    assert set(HELPERS) == {
        "tunix_api.py",
        "tunix_fleet.py",
        "tunix_k8s.py",
        "tunix_launchers.py",
        "tunix_params.py",
        "tunix_weights.py",
    }


def _sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """Every dags/ module `path` imports, at top level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {n.split(".")[0] for n in names} & siblings
    return out


def test_no_import_circle_in_dags():
    modules = {p.stem: p for p in DAGS.glob("*.py")}
    graph = {name: _sibling_imports(path, set(modules) - {name}) for name, path in modules.items()}
    # helpers never import a DAG file
    dag_modules = {f[:-3] for f in DAG_FILES}
    for name in set(modules) - dag_modules:
        assert not graph[name] & dag_modules, (name, graph[name])
    # no cycle (depth-first search with colours)
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import circle: {' -> '.join([*path, name, dep])}"
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert graph["tunix_params"] == set(), "the form module imports no other helper"


@pytest.mark.parametrize("path", sorted(DAGS.glob("*.py")), ids=lambda p: p.name)
def test_dag_modules_stay_small(path):
    assert len(path.read_text().splitlines()) <= 300, f"{path.name}: split it by concern"


@pytest.mark.parametrize("dag_id", ["tunix_train", "tunix_recurring"])
def test_training_dag_shape(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert "tunix" in dag.tags and "training" in dag.tags
    tasks = {t.task_id: t for t in dag.tasks}
    setup = "prepare" if dag_id == "tunix_train" else "resume"
    assert set(tasks) == {setup, "actor", "learner", "stop_fleet", "report"}

    actor, learner = tasks["actor"], tasks["learner"]
    assert actor.is_mapped and actor.map_index_template == "{{ tunix_label }}"
    assert (actor.pool, actor.queue) == ("cpu", "cpu")
    assert (learner.pool, learner.queue) == ("tpu", "tpu")
    assert learner.retries >= 1 and learner.execution_timeout is not None
    assert actor.retries >= 1 and actor.execution_timeout is not None
    # actors and learner both hang off the setup only: they run concurrently
    assert actor.upstream_task_ids == {setup} and learner.upstream_task_ids == {setup}
    assert tasks[setup].is_setup
    # stop_fleet follows the learner (not the actors), and always runs
    assert tasks["stop_fleet"].is_teardown and "learner" in tasks["stop_fleet"].upstream_task_ids
    assert "actor" not in tasks["stop_fleet"].upstream_task_ids
    assert tasks["report"].is_teardown
    assert {"actor", "stop_fleet"} <= tasks["report"].upstream_task_ids
    for t in ("stop_fleet", "report"):
        assert tasks[t].trigger_rule == "all_done_setup_success"


def test_recurring_schedule(dagbag):
    dag = dagbag.dags["tunix_recurring"]
    assert dag.catchup is False and dag.max_active_runs == 1
    assert dag.timetable.expression == "0 0 * * *"  # @daily (TUNIX_RECURRING_SCHEDULE)
    assert "steps_per_interval" in dag.params
    assert dag.params["run_name"] == "nightly"


def test_eval_is_scheduled_on_weights_asset(dagbag):
    from tunix_weights import WEIGHTS_ASSET

    dag = dagbag.dags["tunix_eval"]
    assert [a.name for a in dag.timetable.asset_condition.objects] == [WEIGHTS_ASSET.name]
    assert dag.get_task("evaluate").pool == "cpu"


# --------------------------------------------------------------------------- params form


def test_params_defaults_are_valid(dagbag):
    for dag_id in dagbag.dag_ids:
        dagbag.dags[dag_id].params.validate()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_actors", -1),
        ("num_actors", 0),
        ("num_actors", 1025),  # ActorConfig.num_actors le=1024
        ("env", ""),  # any other name: checked by prepare (plug-ins are entry points)
        ("model_preset", "huge"),
        ("max_staleness", -1),
        ("max_staleness", "x"),
        ("publish_every", 0),
        ("deadline_s", -5),
        ("env_latency_s", -0.1),
        ("env_max_turns", 65),
        ("seed", -1),
        ("run_name", "bad name!"),
        ("store", "s3://bucket"),
        ("overrides", ["no-equals-sign"]),
    ],
)
@pytest.mark.parametrize("dag_id", ["tunix_train", "tunix_recurring"])
def test_params_reject_bad_values(dagbag, dag_id, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dagbag.dags[dag_id].params)
    with pytest.raises(ParamValidationError, match=name):
        params[name] = value


def test_env_latency_may_be_left_empty(dagbag):
    params = copy.deepcopy(dagbag.dags["tunix_train"].params)
    params["env_latency_s"] = None  # no "required" badge; empty: no latency
    from tunix_params import run_config_from_params

    from tunix_tasks.config import config_from_dict

    values = params.validate()
    assert config_from_dict(run_config_from_params(values, "x")).env.latency_s == 0.0


def test_run_name_empty_only_where_derived(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    train = copy.deepcopy(dagbag.dags["tunix_train"].params)
    train["run_name"] = ""  # derived from the Airflow run_id
    train["run_name"] = None  # what the UI sends for an empty text field
    # optional in the form: the UI shows no "required" badge (type includes "null")
    assert "null" in train.get_param("run_name").schema["type"]
    assert "null" in train.get_param("overrides").schema["type"]
    train["overrides"] = None  # an empty list field in the UI
    recurring = copy.deepcopy(dagbag.dags["tunix_recurring"].params)
    assert recurring.get_param("run_name").schema["type"] == "string"
    with pytest.raises(ParamValidationError, match="run_name"):
        recurring["run_name"] = ""


def _schema_leaf(schema: dict, dotted: str) -> dict:
    """Independent of config_params: walk RunConfig's JSON schema by hand."""
    defs = schema["$defs"]
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
        if "$ref" in node:
            node = {**defs[node["$ref"].split("/")[-1]], **node}
    if "anyOf" in node:  # Optional[X]: the form's type is [X, "null"]
        node = {**node, "type": [t["type"] for t in node["anyOf"]]}
    return node


def test_form_equals_run_config_schema(dagbag):
    """Bounds, enums and descriptions of the form are RunConfig's, for every exposed key."""
    from tunix_tasks.config import RunConfig
    from tunix_tasks.config.params import FORM_KEYS, FORM_OPTIONAL

    schema = RunConfig.model_json_schema()
    keywords = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    for dag_id in ("tunix_train", "tunix_recurring"):
        params = dagbag.dags[dag_id].params
        assert set(FORM_KEYS) | {"overrides"} <= set(params)
        for name, key in FORM_KEYS.items():
            param, leaf = params.get_param(name), _schema_leaf(schema, key)
            form = param.schema
            for kw in keywords:
                want = leaf.get(kw)
                if (dag_id, name, kw) == ("tunix_train", "run_name", "type"):
                    want = ["null", want]  # optional: derived from the run_id
                if name in FORM_OPTIONAL and kw == "type":  # may be left empty
                    want = [want, "null"]
                if (name, kw) == ("env", "enum"):  # plug-ins too: suggestions, free text
                    assert set(want) <= set(form["examples"]), form
                    want = None
                assert form.get(kw) == want, (dag_id, name, kw, form, leaf)
            assert leaf.get("description") and param.description == leaf["description"], name
            if "pattern" in leaf:  # the train form also takes an empty run name
                assert form["pattern"] in (leaf["pattern"], f"^$|{leaf['pattern']}")
    # the values the form offers are the library's
    from tunix_tasks.config import MODEL_PRESETS, builtin_env_names

    params = dagbag.dags["tunix_train"].params
    from tunix_tasks.config import known_env_names

    env = params.get_param("env").schema
    assert "enum" not in env and env["examples"] == known_env_names()
    assert set(builtin_env_names()) <= set(env["examples"])
    params = copy.deepcopy(params)
    params["env"] = "my_plugin_env"  # a plug-in name is not refused by the form
    assert set(MODEL_PRESETS) < set(params.get_param("model_preset").schema["enum"])


def test_builtin_envs_are_registered():
    from tunix_tasks.config import builtin_env_names
    from tunix_tasks.envs import available_envs

    assert set(builtin_env_names()) <= set(available_envs())


def test_form_defaults(dagbag):
    """The demo's recipe (configs/demo.yaml), so a run from the defaults learns."""
    from tunix_params import default_store

    params = dagbag.dags["tunix_train"].params
    assert params["store"] == default_store() and params["run_name"] == ""
    assert (params["max_steps"], params["deadline_s"]) == (200, 3600)
    assert (params["warm_start_steps"], params["learning_rate"]) == (140, 0.001)
    assert "learner.buckets=[64, 128]" in params["overrides"]
    assert (params["num_actors"], params["env"], params["model_preset"]) == (
        2,
        "calculator",
        "tiny",
    )
    for name in params:
        assert params.get_param(name).schema.get("title"), name


def test_run_config_from_params_matches_run_config(dagbag):
    from tunix_params import run_config_from_params

    from tunix_tasks.config import config_from_dict

    params = dagbag.dags["tunix_train"].params.validate()
    cfg = config_from_dict(run_config_from_params(params, "x1"))
    assert cfg.run_name == "x1" and cfg.actor.num_actors == params["num_actors"]
    assert cfg.learner.publish_every == params["publish_every"]
    assert cfg.env.name == params["env"] and cfg.model.preset == params["model_preset"]
    assert cfg.env.latency_s == params["env_latency_s"]
    assert cfg.env.max_turns == params["env_max_turns"] and cfg.seed == params["seed"]
    assert cfg.deadline_s == params["deadline_s"] and cfg.learner.max_steps == 200
    # with the default overrides: the demo itself, but for where it runs and its deadline
    from tunix_tasks.config import load_config

    demo = load_config(REPO / "configs/demo.yaml")
    cfg = config_from_dict(run_config_from_params(params, "demo"), params["overrides"])
    assert cfg.model_copy(update={"store": demo.store, "deadline_s": 0.0}) == demo


def test_sanitize_run_name():
    from tunix_params import sanitize_run_name

    assert sanitize_run_name("manual__2025-01-01T00:00:00.123+00:00") == (
        "manual__2025-01-01T00-00-00.123-00-00"
    )
    assert sanitize_run_name("::") == "run"


_PARSE_PROBE = r"""
import importlib.util, json, sys, time
sys.path.insert(0, sys.argv[1])
import airflow.sdk  # the DAG processor has Airflow loaded already
out = {}
for path in sys.argv[2:]:
    t0 = time.process_time()  # this process's CPU: a test worker beside it takes wall time
    spec = importlib.util.spec_from_file_location("probe_" + path.rsplit("/", 1)[-1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    out[path] = time.process_time() - t0
light = {"tunix_tasks", "tunix_tasks.env_kwargs", "tunix_tasks.registry", "tunix_tasks.storage",
         "tunix_tasks.storage.uri"}
light |= {m for m in sys.modules if m == "tunix_tasks.config" or m.startswith("tunix_tasks.config.")}
heavy = sorted(m for m in sys.modules if m not in light and m.split(".")[0] in ("jax", "jaxlib",
        "flax", "optax", "tunix_tasks", "pyarrow", "orbax", "numpy", "airflow_client"))
print(json.dumps({"times": out, "heavy": heavy}))
"""


def test_parse_time_and_no_heavy_imports():
    """Each DAG file parses in < 1 s of CPU in a fresh process (the first pays for
    pydantic)."""
    files = [str(DAGS / f) for f in DAG_FILES]
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_PROBE, str(DAGS), *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], "DAG files must not import heavy modules at parse time"
    for path, seconds in result["times"].items():
        assert seconds < 1.0, f"{Path(path).name} took {seconds:.2f}s to parse"

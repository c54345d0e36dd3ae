"""RunConfig: validation messages name the field and valid values; files and overrides."""

from __future__ import annotations

import json
import re

import pytest

from tests.paths import REPO
from tunix_tasks.config import ConfigError, RunConfig, config_from_dict, load_config


def test_defaults_and_presets():
    cfg = load_config()
    assert cfg.mode == "async" and cfg.model.d_model == 64
    small = load_config(None, ["model.preset=small"])
    assert (small.model.d_model, small.model.n_layers) == (128, 4)
    custom = load_config(None, ["model.preset=tiny", "model.d_model=96", "model.n_heads=3"])
    assert custom.model.d_model == 96 and custom.model.n_layers == 2


def test_a_preset_with_a_checkpoint_is_refused():
    """Issue #30.9: `model.preset` with `model.checkpoint` was silently accepted, though
    docs/models.md forbids it. The default (`tiny`) reads as unset: a stored config and the
    DAG form write it."""
    from tunix_tasks.config import config_from_dict

    for preset in ("small", "base", "custom"):
        with pytest.raises(
            ConfigError, match=r"model\.checkpoint sets the architecture; remove model\.preset"
        ):
            load_config(None, ["model.checkpoint=/ckpt", f"model.preset={preset}"])
    cfg = load_config(None, ["model.checkpoint=/ckpt"])
    assert config_from_dict(cfg.model_dump()).model == cfg.model


@pytest.mark.parametrize(
    "override,needle",
    [
        ("mode=fast", "mode: Input should be 'async' or 'sync'"),
        ("learner.buckets=[12]", "learner.buckets must be positive multiples of 8"),
        ("actor.num_actors=0", "actor.num_actors: Input should be greater than or equal to 1"),
        ("actor.nope=1", "actor.nope: Extra inputs are not permitted"),
        ("model.preset=huge", "'tiny', 'small', 'base' or 'custom'"),
        ("store=s3://b/x", "valid: file, gs"),
        ("run_name=../x", "run_name must be"),
        ("learner.buckets=[512]", "exceeds model.max_seq_len"),
        ("model.n_heads=5", "divisible by model.n_heads"),
        ("learner.correction=sequence", "'none', 'token_tis', 'sequence_tis', 'gspo', 'ppo'"),
        ("learner.correction=my_pkg.mod", "or 'package.module:function'"),
        ("learner.ppo_clip=0", "learner.ppo_clip: Input should be greater than 0"),
    ],
)
def test_invalid_values_are_named(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_a_message_that_shows_the_value_does_not_repeat_it():
    """Issue #31.9: `got [12] (got [12])`."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["mode=fast", "learner.buckets=[12]"])
    text = str(info.value)
    assert "multiples of 8, got [12]\n" in text + "\n" and text.count("[12]") == 1, text
    assert "mode: Input should be 'async' or 'sync' (got 'fast')" in text


def test_cross_field_errors_name_the_fields():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.group_size=1"])
    assert all(n in str(info.value) for n in ["actor.group_size=1", "learner.advantage=group"])
    assert "batch" in str(info.value)
    load_config(None, ["actor.group_size=1", "learner.advantage=batch"])


def test_sampler_learner_dtype_mismatch_warns():
    from tunix_tasks.config import ConfigWarning

    with pytest.warns(ConfigWarning, match="model.dtype=float32.*learner.compute_dtype"):
        cfg = load_config(None, ["learner.compute_dtype=bfloat16"])
    assert cfg.warnings and not load_config().warnings


def test_yaml_json_and_overrides(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"run_name": "x", "actor": {"num_actors": 3}}))
    cfg = load_config(tmp_path / "a.json", ["actor.envs_per_actor=5", "env.kwargs.difficulty=1"])
    assert (cfg.run_name, cfg.actor.num_actors, cfg.actor.envs_per_actor) == ("x", 3, 5)
    assert cfg.env.kwargs == {"difficulty": 1}
    assert load_config(REPO / "configs/demo.yaml").env.name == "calculator"
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(None, ["actor.num_actors"])
    # Round trip through config.json (what prepare writes and every process reads).
    assert load_config(None, []).model_validate_json(cfg.to_json()) == cfg


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception, match="frozen"):
        cfg.seed = 3  # type: ignore[misc]


def _field_names(model, prefix=""):
    """Dotted names of every leaf field of a config model class."""
    for name, field in model.model_fields.items():
        sub = field.annotation
        if hasattr(sub, "model_fields"):
            yield from _field_names(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_field_is_documented():
    from tunix_tasks.config import RunConfig

    doc = (REPO / "docs/configuration.md").read_text()
    missing = [n for n in _field_names(RunConfig) if f"`{n}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"


# -- what a resume may change ------------------------------------------------------------
def test_resumable_fields_exist_and_are_documented():
    """Every `RESUMABLE` entry is a real field (a rename would silently fix it), and the
    docs' table 'What a resume may change' lists exactly them."""
    from tunix_tasks.config import RESUMABLE, RunConfig

    assert set(RESUMABLE) <= set(_field_names(RunConfig)), set(RESUMABLE) - set(
        _field_names(RunConfig)
    )
    doc = (REPO / "docs/configuration.md").read_text()
    section = doc.split("## What a resume may change", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|")[1] for ln in section.splitlines() if ln.startswith("| `")]
    assert sorted(n for cell in rows for n in re.findall(r"`([\w.]+)`", cell)) == sorted(RESUMABLE)


def test_a_resume_may_change_scale_time_and_cadence():
    from tunix_tasks.config import check_resume, fixed_changes
    from tunix_tasks.config.resume import config_changes

    old = load_config(REPO / "configs/demo.yaml")
    assert config_changes(old, old) == [] and fixed_changes(old, old) == []
    new = load_config(
        REPO / "configs/demo.yaml",
        [
            "learner.max_steps=300",
            "deadline_s=60",
            "actor.num_actors=4",
            "actor.envs_per_actor=32",
            "learner.checkpoint_every=5",
            "learner.mesh.data=1",
            "store=/elsewhere",
        ],
    )
    changed = [c.field for c in config_changes(old, new)]
    assert changed == [
        "store",
        "deadline_s",
        "actor.num_actors",
        "actor.envs_per_actor",
        "learner.max_steps",
        "learner.checkpoint_every",
        "learner.mesh.data",
    ]
    assert fixed_changes(old, new) == []
    check_resume(old, new)  # no error


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["mode=sync"], ["mode async -> sync"]),
        (["actor.kind=vectorized", "env.latency_s=0"], ["actor.kind async -> vectorized"]),
        (["model.preset=small"], ["model.preset tiny -> small", "model.d_model 64 -> 128"]),
        (["model.lora_rank=8"], ["model.lora_rank 0 -> 8"]),
        (["env.kwargs.difficulty=2"], ['env.kwargs {"difficulty": 1} -> {"difficulty": 2}']),
        (["learner.correction=ppo"], ["learner.correction token_tis -> ppo"]),
        (["seed=1", "learner.buckets=[64]"], ["seed 0 -> 1", "learner.buckets [64, 128] -> [64]"]),
    ],
)
def test_a_resume_may_not_change_what_is_trained(overrides, named):
    """Fixed fields are refused in one line naming each (old -> new) and the way out."""
    from tunix_tasks.config import check_resume, fixed_changes

    old = load_config(REPO / "configs/demo.yaml")
    new = load_config(REPO / "configs/demo.yaml", [*overrides, "learner.max_steps=500"])
    changes = [str(c) for c in fixed_changes(old, new)]
    assert set(named) <= set(changes) and "learner.max_steps 200 -> 500" not in changes
    with pytest.raises(ConfigError) as info:
        check_resume(old, new)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"run {new.run_uri} exists")
    assert all(n in message for n in named) and "--run-name NEW" in message
    assert "max_steps" not in message


def test_env_name_is_validated_with_the_valid_names(monkeypatch):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["env.name=no_such_env"])
    msg = str(info.value)
    assert "env.name" in msg and "no_such_env" in msg
    # Every built-in is listed (names other tests registered in this process may sit between).
    listed = msg.split("valid: ", 1)[1].split(" (or a plug-in", 1)[0].split(", ")
    assert {"arithmetic", "calculator", "guess_number", "python_exec", "sorting"} <= set(listed)
    assert listed == sorted(listed) and "tunix_tasks.envs" in msg
    for name in ("calculator", "guess_number", "python_exec"):
        assert load_config(None, [f"env.name={name}"]).env.name == name

    # A plug-in of the `tunix_tasks.envs` entry-point group is a valid name.
    import importlib.metadata

    plugin = importlib.metadata.EntryPoint(
        name="echo_plugin", value="tests.unit.envs.test_registry:_EchoEnv", group="tunix_tasks.envs"
    )
    real = importlib.metadata.entry_points

    def fake_entry_points(**kw):
        if kw.get("group") == "tunix_tasks.envs":
            return importlib.metadata.EntryPoints([*real(**kw), plugin])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert load_config(None, ["env.name=echo_plugin"]).env.name == "echo_plugin"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["env.name=nope"])
    assert "echo_plugin" in str(info.value).split("valid: ", 1)[1].split(" (or a plug-in", 1)[0]


def test_env_validation_imports_no_environment():
    """The learner reads config.json too and must not import environments (nor the
    sandbox): the name and kwargs checks run without importing tunix_tasks.envs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tunix_tasks.config import ConfigError, load_config\n"
        "load_config(None, ['env.name=python_exec', 'env.kwargs.sandbox=bwrap'])\n"
        "try:\n"
        "    load_config(None, ['env.name=python_exec', 'env.kwargs.sandbox=nope'])\n"
        "except ConfigError as err:\n"
        "    assert 'unsafe-audit-only' in str(err)\n"
        "else:\n"
        "    raise SystemExit('accepted an unknown sandbox mode')\n"
        "try:\n"
        "    load_config(None, ['env.name=no_such_env'])\n"
        "except ConfigError as err:\n"
        "    assert 'python_exec' in str(err)\n"
        "else:\n"
        "    raise SystemExit('accepted an unknown env')\n"
        "print(sorted(m for m in sys.modules if m.startswith('tunix_tasks.envs')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "override,needle",
    [
        (
            "sandbox=nope",
            "env.kwargs: sandbox: 'nope' is not a sandbox mode of python_exec; "
            "valid: 'auto', 'bwrap', 'unsafe-audit-only'",
        ),
        ("sandbx=bwrap", "'sandbx': not a python_exec kwarg; valid: 'max_operand', 'max_turns'"),
        ("max_turns=true", "max_turns: python_exec needs a positive integer, got True"),
    ],
)
def test_env_kwargs_are_checked_when_the_config_loads(override, needle):
    """Issue #30.11: `env.kwargs.sandbox: nope` passed `config` and failed in the actor."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["env.name=python_exec", f"env.kwargs.{override}"])
    assert needle in str(info.value)


def test_env_kwargs_checks_are_declared_per_environment(monkeypatch):
    """A check is found by the environment's name in `tunix_tasks.env_kwargs`: valid
    kwargs load, an environment without a check is not checked, a plug-in's runs."""
    import importlib.metadata

    for mode in ("auto", "bwrap", "unsafe-audit-only"):
        cfg = load_config(None, ["env.name=python_exec", f"env.kwargs.sandbox={mode}"])
        assert cfg.env.kwargs == {"sandbox": mode}
    assert load_config(None, ["env.kwargs.anything=1"]).env.kwargs == {"anything": 1}

    check = importlib.metadata.EntryPoint(
        name="calculator", value="tests.unit.test_config:_no_kwargs", group="tunix_tasks.env_kwargs"
    )
    real = importlib.metadata.entry_points

    def fake_entry_points(**kw):
        if kw.get("group") == "tunix_tasks.env_kwargs":
            return importlib.metadata.EntryPoints([*real(**kw), check])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    with pytest.raises(ConfigError, match=r"env\.kwargs: 'anything': calculator takes none"):
        load_config(None, ["env.kwargs.anything=1"])
    assert load_config(None, []).env.kwargs == {}


def _no_kwargs(kwargs: dict) -> None:
    """A kwargs check as a plug-in declares one (see the test above)."""
    if kwargs:
        raise ValueError(f"{', '.join(map(repr, kwargs))}: calculator takes none")


def test_async_max_staleness_0_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["learner.max_staleness=0"])
    msg = str(info.value)
    assert "learner.max_staleness=0" in msg and "mode=sync" in msg
    assert "max_staleness >= 1" in msg
    assert load_config(None, ["learner.max_staleness=1"]).learner.max_staleness == 1
    sync = load_config(None, ["mode=sync", "learner.max_staleness=0"])  # sync ignores it
    assert (sync.mode, sync.learner.max_staleness) == ("sync", 0)


def test_forced_staleness_stays_within_the_bound_and_async():
    """`actor.reload_every_versions` above `learner.max_staleness` would make every episode
    a drop, and a sync learner waits for each version: both refused, naming the fields."""
    for overrides in (
        ["actor.reload_every_versions=5", "learner.max_staleness=4"],
        ["actor.reload_every_versions=2", "mode=sync"],
    ):
        with pytest.raises(ConfigError, match=r"actor.reload_every_versions=\d needs mode=async"):
            load_config(None, overrides)
    cfg = load_config(None, ["actor.reload_every_versions=4", "learner.max_staleness=4"])
    assert cfg.actor.reload_every_versions == 4


def test_shipped_configs_load():
    configs = sorted((REPO / "configs").glob("*.yaml"))
    # the examples' too, but the plug-in's: its env exists once the example is installed
    configs += sorted(
        p for p in (REPO / "examples").glob("*/*.yaml") if "plugin" not in p.parent.name
    )
    assert len(configs) > 5
    for path in configs:
        load_config(path)


# -- bounds: a hostile or broken YAML file is one ConfigError, in bounded time and memory --
def _laughs(levels: int = 10) -> str:
    """A "billion laughs" document: each anchor repeats the previous one 9 times."""
    lines = ['    a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "env:\n  kwargs:\n" + "\n".join(lines) + "\n"


def _alias_chain(n: int) -> str:
    """Anchors nested only through aliases: n levels deep once expanded."""
    lines = ["    b0: &b0 [1]", *(f"    b{i}: &b{i} [*b{i - 1}]" for i in range(1, n))]
    return "env:\n  kwargs:\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text,needle",
    [
        (_laughs(), "expands to more than 100,000 values"),
        ("env:\n  kwargs:\n    x: &a [*a]\n", "has a recursive alias"),
        ("env:\n  kwargs:\n    x: " + "[" * 10_000 + "]" * 10_000 + "\n", "deeper than 64"),
        (_alias_chain(200), "nests deeper than 64 levels (aliases expanded)"),
        ("# " + "x" * (1 << 20) + "\n", "is larger than 1,048,576 bytes"),
        ("seed: " + "9" * 5000 + "\n", "a value cannot be read"),
    ],
)
def test_hostile_yaml_is_one_error_naming_the_file_and_the_bound(tmp_path, text, needle):
    import time

    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    # Far under the hang this bounds (> 90 s); 2 s flaked once on a loaded 2-core host.
    assert time.monotonic() - start < 10.0
    message = str(info.value)
    assert "\n" not in message and str(path) in message and needle in message, message


def test_overrides_are_bounded_too():
    with pytest.raises(ConfigError, match=r"override 'env\.kwargs\.x=.*' has a recursive alias"):
        load_config(None, ["env.kwargs.x=&a [*a]"])


def test_a_config_with_a_few_aliases_still_loads(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text(
        "env:\n  name: calculator\n  kwargs:\n    <<: &easy {difficulty: 1, ops: '+-'}\n"
        "    max_turns: 2\n"
        "actor: {group_size: &g 4, num_actors: *g}\n"
        "learner: {buckets: [64, 128], min_episodes_per_step: *g}\n"
    )
    cfg = load_config(path)
    assert cfg.env.kwargs == {"difficulty": 1, "ops": "+-", "max_turns": 2}
    assert (cfg.actor.num_actors, cfg.learner.min_episodes_per_step) == (4, 4)


# -- numbers: a boolean is not a number ----------------------------------------------------
def _number_fields() -> list[str]:
    from tunix_tasks.config import RunConfig
    from tunix_tasks.config.params import field_specs

    specs = field_specs(RunConfig.model_json_schema(), _field_names(RunConfig))
    numeric = {"integer", "number"}
    return [
        k
        for k, s in specs.items()
        if numeric & set([s.type] if isinstance(s.type, str) else s.type or [])
    ]


def test_booleans_are_not_numbers():
    """Issue #30.11: `--set learner.max_steps=true` was accepted as 1. Every int and float
    field (read from the schema, so a new one is covered) refuses a boolean by name."""
    fields = _number_fields()
    assert {
        "learner.max_steps",
        "learner.learning_rate",
        "learner.warm_start_learning_rate",
    } <= set(fields)
    assert {"learner.buckets", "model.preset", "learner.remat"}.isdisjoint(fields)
    for key in fields:
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}=true"])
        assert f"{key}: Input should be a number, not a boolean (got True)" in str(info.value)
    with pytest.raises(ConfigError, match=r"learner\.buckets\.1: Input should be a number"):
        load_config(None, ["learner.buckets=[64, true]"])


def test_numbers_parse_as_before():
    """A YAML int loads into a float field, and `--set` values parse as before: YAML reads
    `3e-4` as a string, which a float field converts."""
    cfg = load_config(
        None, ["learner.learning_rate=1", "learner.warm_start_learning_rate=3e-4", "seed=7"]
    )
    assert cfg.learner.learning_rate == 1.0 and isinstance(cfg.learner.learning_rate, float)
    assert (cfg.learner.warm_start_learning_rate, cfg.seed) == (3e-4, 7)
    assert load_config(None, ["deadline_s=0.5"]).deadline_s == 0.5


def test_the_forms_defaults_reproduce_a_recipe():
    """The Airflow form's defaults (dags/tunix_params.py) are `recipe_defaults` of the demo:
    its fields take the recipe's values, the rest of it is the default `overrides`, so a
    run triggered with the defaults trains the demo (warm start included)."""
    from tunix_tasks.config.params import (
        FORM_KEYS,
        FORM_OPTIONAL,
        recipe_defaults,
        run_config_from_params,
    )

    demo = load_config(REPO / "configs/demo.yaml")
    form = recipe_defaults(demo)
    assert form["warm_start_steps"] == 140 and form["env_latency_s"] == 0.2
    assert "store" not in form and "run_name" not in form  # the form's own
    assert "env.kwargs.difficulty=1" in form["overrides"]
    assert not any(
        o.startswith(("warm_start_steps=", "learner.max_steps=")) for o in form["overrides"]
    )
    cfg = config_from_dict(run_config_from_params(form, "demo"), form["overrides"])
    assert cfg.model_copy(update={"store": demo.store}) == demo
    assert recipe_defaults(RunConfig())["overrides"] == []
    assert set(FORM_KEYS) >= FORM_OPTIONAL and "env_latency_s" in FORM_OPTIONAL


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["actor.kind=agent"], "actor.kind=agent needs actor.agent.program"),
        (["actor.kind=agent", "actor.agent.program=my_agent"], "is not package.module:function"),
        (["actor.agent.host=0.0.0.0"], "set actor.agent.api_key_env"),
        (["actor.agent.api_key_env=1BAD"], "is not a variable name"),
        (
            [
                "actor.kind=agent",
                "actor.agent.program=a:run",
                "actor.agent.max_concurrent_requests=4",
            ],
            "actor.agent.max_concurrent_requests=4 is below actor.envs_per_actor=8",
        ),
    ],
)
def test_agent_kind_settings_are_checked(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)
    ok = load_config(None, ["actor.kind=agent", "actor.agent.program=pkg.agent:run"])
    assert ok.actor.agent.host == "127.0.0.1"
    wide = ["actor.agent.host=0.0.0.0", "actor.agent.api_key_env=AGENT_TOKEN"]
    assert load_config(None, wide).actor.agent.api_key_env == "AGENT_TOKEN"


@pytest.mark.parametrize("value", ["1e-7", "2e6", "0"])
def test_a_temperature_no_sampler_can_run_is_refused_at_load(value):
    """Outside requests.TEMPERATURES logits / temperature is not finite in float32: the
    config refuses it, not every turn of every actor."""
    from tunix_tasks.policy.requests import TEMPERATURES

    with pytest.raises(ConfigError, match=r"actor\.temperature"):
        load_config(None, [f"actor.temperature={value}"])
    low, high = TEMPERATURES
    for ok in (low, high):
        assert load_config(None, [f"actor.temperature={ok}"]).actor.temperature == ok

"""RunConfig: validation messages name the field and valid values; files and overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunix_tasks.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_presets():
    cfg = load_config()
    assert cfg.mode == "async" and cfg.model.d_model == 64
    small = load_config(None, ["model.preset=small"])
    assert (small.model.d_model, small.model.n_layers) == (128, 4)
    custom = load_config(None, ["model.preset=tiny", "model.d_model=96", "model.n_heads=3"])
    assert custom.model.d_model == 96 and custom.model.n_layers == 2


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
        ("learner.is_level=episode", "'token' or 'sequence'"),
    ],
)
def test_invalid_values_are_named(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_sync_mode_requires_fresh_data_rules():
    with pytest.raises(ConfigError, match="max_staleness=0"):
        load_config(None, ["mode=sync"])
    cfg = load_config(None, ["mode=sync", "learner.max_staleness=0", "learner.publish_every=1"])
    assert cfg.mode == "sync"


def test_yaml_json_and_overrides(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"run_name": "x", "actor": {"num_actors": 3}}))
    cfg = load_config(tmp_path / "a.json", ["actor.envs_per_actor=5", "env.kwargs.difficulty=1"])
    assert (cfg.run_name, cfg.actor.num_actors, cfg.actor.envs_per_actor) == ("x", 3, 5)
    assert cfg.env.kwargs == {"difficulty": 1}
    assert load_config(ROOT / "configs/demo.yaml").env.name == "calculator"
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(None, ["actor.num_actors"])
    # Round trip through config.json (what prepare writes and every process reads).
    assert load_config(None, []).model_validate_json(cfg.to_json()) == cfg


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception, match="frozen"):
        cfg.seed = 3  # type: ignore[misc]


def test_every_field_is_documented():
    from tunix_tasks.config import RunConfig

    doc = (ROOT / "docs/configuration.md").read_text()

    def names(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if hasattr(sub, "model_fields"):
                yield from names(sub, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    missing = [n for n in names(RunConfig) if f"`{n}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"

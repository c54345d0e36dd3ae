"""Run configuration: the one typed, frozen description of a training run.

The same `RunConfig` drives the CLI (`--config run.yaml --set learner.max_steps=10`),
the Airflow DAG params and the tests. Every model is frozen, rejects unknown fields and
validates on construction; errors name the field and, for enumerations, the valid values.
The package imports only pydantic and PyYAML (never JAX): a DAG file may import it.

    cfg = load_config("run.yaml", overrides=["actor.num_actors=4"])
    cfg.run_uri  # "file:///abs/runs/<run_name>"

base.py       `Frozen` (every config model's base), `ConfigError`, `ConfigWarning`
run.py        `RunConfig` and the `actor`, `learner`, `learner.mesh` sections; cross-section rules
agent.py      `AgentConfig`: `actor.agent`, the agent program and its endpoint (`actor.kind: agent`)
remote.py     `RemoteEngineConfig`: `actor.remote`, a completions server as the actor's engine
autopilot.py  `AutopilotConfig`: `actor.autopilot`, the bounds and pace of the self-sizing fleet
env.py        `EnvConfig`; valid environment names from the entry-point groups (no env import)
model.py      `ModelConfig`: a char preset or a Hugging Face checkpoint
objective.py  `ObjectiveConfig`: the RL objective's `learner.*` fields (correction, kl_coef, ...)
loading.py    YAML/JSON files (bounded: size, aliases, nesting) and dicts -> `RunConfig`,
              `dotted.key=value` overrides
params.py     flat forms over `RunConfig` (the Airflow DAG params), generated from its schema
resume.py     what a resume may change (`RESUMABLE`) and `check_resume`, which refuses the rest

A new section: a `Frozen` model in its own module, a field of `RunConfig` (run.py), and
its rules as validators there; the CLI, the DAG form and the docs read the schema.
"""

from tunix_tasks.config.autopilot import MAX_ACTORS
from tunix_tasks.config.base import ConfigError, ConfigWarning, Frozen
from tunix_tasks.config.env import (
    EnvConfig,
    builtin_env_names,
    known_env_names,
    known_vec_env_names,
)
from tunix_tasks.config.loading import apply_overrides, config_from_dict, load_config
from tunix_tasks.config.model import CHECKPOINT_MAX_SEQ_LEN, MODEL_PRESETS, ModelConfig
from tunix_tasks.config.objective import BUILTIN_CORRECTIONS, ObjectiveConfig
from tunix_tasks.config.resume import RESUMABLE, FieldChange, check_resume, fixed_changes
from tunix_tasks.config.run import ActorConfig, LearnerConfig, MeshConfig, RunConfig

__all__ = [
    "BUILTIN_CORRECTIONS",
    "CHECKPOINT_MAX_SEQ_LEN",
    "MAX_ACTORS",
    "MODEL_PRESETS",
    "RESUMABLE",
    "ActorConfig",
    "ConfigError",
    "ConfigWarning",
    "EnvConfig",
    "FieldChange",
    "Frozen",
    "LearnerConfig",
    "MeshConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "RunConfig",
    "apply_overrides",
    "builtin_env_names",
    "check_resume",
    "config_from_dict",
    "fixed_changes",
    "known_env_names",
    "known_vec_env_names",
    "load_config",
]

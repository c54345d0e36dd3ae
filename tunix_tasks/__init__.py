"""tunix-tasks: decoupled asynchronous RL for agentic language models.

The package reads as the pipeline (docs/architecture.md has the map):

    envs/      environments (text protocol, registry, built-ins) and the sandbox
    actor/     actors: concurrent episodes, batched sampling, shards out
    storage/   the run in the object store: layout, shards, weights, lease, metrics
    learner/   shard source -> flow policy -> packing -> sharded update -> snapshots
    policy/    the model, tokenizer and sampler every role shares
    frontdoor/ CLI, local launcher, process entry points, report, eval, inspect
    testing/   helpers for tests and benchmarks (fake GCS, episodes); not in the data flow

    config/    the run configuration (`RunConfig`): frozen, validated, one for CLI, DAGs, tests
    episode.py `Episode`, the one record of an episode; `EpisodeStatus`, `DropReason`
    env_kwargs.py checks of the `env.kwargs` an env owns, run when a config loads (light)
    logs.py    `warn_once`: a warning logged the first time a process meets it
    messages.py the conversation vocabulary envs and policies share (`Action`, `ToolCall`)
    registry.py `Registry`: names -> factories from code and entry points (every plug-in kind)
    seeds.py   the env seed ranges: training, held-out evaluation, demonstrations
    untrusted.py reading what others wrote: a bounded read of a regular file, JSON that cannot crash its reader

The public API, importable from here (loaded on first use, so `import tunix_tasks` stays
light enough for Airflow's DAG parser):

    from tunix_tasks import RunConfig, load_config, prepare_run, run_learner, run_actor
    cfg = load_config("run.yaml", ["learner.max_steps=50"])
    uri = prepare_run(cfg); run_learner(uri)            # and run_actor(uri, i) elsewhere

    from tunix_tasks import Environment, StepResult, register_env   # your own environment
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "tunix_tasks.config",
    "RunConfig": "tunix_tasks.config",
    "config_from_dict": "tunix_tasks.config",
    "load_config": "tunix_tasks.config",
    "Episode": "tunix_tasks.episode",
    "Environment": "tunix_tasks.envs",
    "StepResult": "tunix_tasks.envs",
    "make_env": "tunix_tasks.envs",
    "register_env": "tunix_tasks.envs",
    "RunLayout": "tunix_tasks.storage.layout",
    "open_store": "tunix_tasks.storage.store",
    "AsyncFlow": "tunix_tasks.learner.flow",
    "SyncFlow": "tunix_tasks.learner.flow",
    "prepare_run": "tunix_tasks.frontdoor.entrypoints",
    "run_actor": "tunix_tasks.frontdoor.entrypoints",
    "run_learner": "tunix_tasks.frontdoor.entrypoints",
    "write_report": "tunix_tasks.frontdoor.entrypoints",
    "evaluate_snapshot": "tunix_tasks.frontdoor.entrypoints",
    "train_local": "tunix_tasks.frontdoor.launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tunix_tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

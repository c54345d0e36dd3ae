"""What a resume may change: the fields of a run's config that may differ from its stored
`config.json` when the same run is started again, and the check that refuses the others.

A run is identified by `<store>/<run_name>`; running `train` / `prepare` again resumes it.
Only the fields in `RESUMABLE` may change then: where the run lives, how long it runs,
the fleet and hardware it runs on, I/O cadence, timeouts, retention, and memory layouts
that leave the maths unchanged. Every other field (mode, seed, model, env task, actor
kind and sampling, the learner's data rules, objective and optimiser, and any field
added later until it is listed here) changes what is trained or how, so a resume that
changes it is refused: a new kind of run gets its own `run_name`.

    changes = fixed_changes(stored, new)   # [] when `new` may resume `stored`
    check_resume(stored, new)              # ConfigError naming each change, in one line
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tunix_tasks.config.base import ConfigError
from tunix_tasks.config.run import RunConfig

__all__ = ["RESUMABLE", "FieldChange", "check_resume", "config_changes", "fixed_changes"]

_WHERE = "where the run lives (a moved or copied run)"
_HOW_LONG = "how long the run goes on"
_SCALE = "the fleet and hardware, not what each episode or step computes"
_CADENCE = "how often data, weights and checkpoints are written"
_TIMEOUT = "when slow infrastructure counts as failed"
_RETENTION = "what is kept in the store"
_LAYOUT = "memory layout of the same computation"

#: Dotted field -> why a resume may change it. Everything else is fixed for a run's life.
RESUMABLE: dict[str, str] = {
    "run_name": _WHERE,
    "store": _WHERE,
    "deadline_s": _HOW_LONG,
    "learner.max_steps": _HOW_LONG,
    "actor.num_actors": _SCALE,
    "actor.envs_per_actor": _SCALE,
    "actor.sampler_replicas": _SCALE,
    "actor.kv_cache_slots": _SCALE,
    "actor.decode_rows": _SCALE,
    "actor.batch_wait_s": _SCALE,
    "learner.mesh.data": _SCALE,
    "learner.mesh.fsdp": _SCALE,
    "actor.episodes_per_shard": _CADENCE,
    "actor.shard_interval_s": _CADENCE,
    "actor.weight_poll_s": _CADENCE,
    "actor.flow_control": "when episodes are started, not what is trained on them",
    **{
        f"actor.autopilot.{name}": _SCALE
        for name in (
            "enabled",
            "min_actors",
            "max_actors",
            "target_supply",
            "deadband",
            "cooldown_s",
            "max_factor",
            "interval_s",
        )
    },
    # Where the tokens are sampled (the same policy weights): the fleet's hardware.
    **{
        f"actor.remote.{name}": _SCALE
        for name in (
            "url",
            "model",
            "api_key_env",
            "weights_dir",
            "weights_route",
            "adapter_route",
            "unload_route",
            "max_connections",
        )
    },
    "actor.remote.timeout_s": _TIMEOUT,
    "learner.checkpoint_every": _CADENCE,
    "learner.full_snapshot_every": _CADENCE,
    "env.step_timeout_s": _TIMEOUT,
    "learner.lease_ttl_s": _TIMEOUT,
    "learner.data_timeout_s": _TIMEOUT,
    "learner.keep_snapshots": _RETENTION,
    "learner.keep_every": _RETENTION,
    "tracker": "where the metrics are also sent",
    "learner.delete_consumed_shards": _RETENTION,
    "learner.dedup_window": _RETENTION,
    "learner.remat": _LAYOUT,
    "learner.logits_chunk": _LAYOUT,
    "learner.attention_block": _LAYOUT,
    "learner.scan_layers": _LAYOUT,
    "learner.kl_coef": "adding a KL anchor mid-run: the reference is the restored policy",
}


@dataclass(frozen=True)
class FieldChange:
    """One config field whose value differs between the stored and the new config."""

    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _leaves(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field, value) of every field that is not itself a config section."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def config_changes(old: RunConfig, new: RunConfig) -> list[FieldChange]:
    """Every field whose value differs, in the config's field order."""
    before = dict(_leaves(old))
    return [FieldChange(f, before[f], v) for f, v in _leaves(new) if before[f] != v]


def fixed_changes(old: RunConfig, new: RunConfig) -> list[FieldChange]:
    """The changes a resume may not make (fields not in `RESUMABLE`)."""
    return [c for c in config_changes(old, new) if c.field not in RESUMABLE]


def check_resume(old: RunConfig, new: RunConfig) -> None:
    """Raise a one-line `ConfigError` if `new` changes a fixed field of the run `old`."""
    changes = fixed_changes(old, new)
    if changes:
        raise ConfigError(
            f"run {new.run_uri} exists with another configuration: "
            + ", ".join(map(str, changes))
            + "; a resume may not change these (docs/configuration.md, 'What a resume may "
            "change'): give the new run its own name with --run-name NEW (--set run_name=NEW)"
        )

"""`RunConfig`: the one typed, frozen description of a training run, and its sections.

The same `RunConfig` drives the CLI (`--config run.yaml --set learner.max_steps=10`),
the Airflow DAG params (`params.py`) and the tests. `ActorConfig`, `MeshConfig` and
`LearnerConfig` are defined here; the env, model and objective sections in their own
modules. Cross-section rules (the mode against the staleness bound, the actor kind
against the environment) are `RunConfig`'s validators.

    cfg = RunConfig.model_validate({"env": {"name": "calculator"}})
    cfg.run_uri  # "file:///abs/runs/<run_name>"
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tunix_tasks.config.agent import AgentConfig
from tunix_tasks.config.autopilot import MAX_ACTORS, AutopilotConfig
from tunix_tasks.config.base import Float, FloatOrNone, Frozen, Int
from tunix_tasks.config.env import EnvConfig, known_vec_env_names
from tunix_tasks.config.model import ModelConfig
from tunix_tasks.config.objective import ObjectiveConfig
from tunix_tasks.config.remote import RemoteEngineConfig
from tunix_tasks.storage.uri import normalize_uri

__all__ = ["ActorConfig", "LearnerConfig", "MeshConfig", "RunConfig"]

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ActorConfig(Frozen):
    """The actor fleet."""

    kind: Literal["async", "vectorized", "agent"] = Field(
        "async",
        description="async: environments on an asyncio loop, a batched sampler (any env, any "
        "model); vectorized: JAX environments and the policy in one jitted loop on the "
        "device (envs with a JAX twin, char presets; docs/vectorized.md); agent: your "
        "agent program (actor.agent.program) against an OpenAI-compatible endpoint over "
        "the batched sampler (docs/agents.md)",
    )
    num_actors: Int = Field(2, ge=1, le=MAX_ACTORS, description="actor processes")
    envs_per_actor: Int = Field(
        8, ge=1, le=4096, description="environments each actor steps concurrently"
    )
    group_size: Int = Field(
        4, ge=1, le=64, description="episodes per env seed (advantages are normalized per group)"
    )
    episodes_per_shard: Int = Field(32, ge=1)
    shard_interval_s: Float = Field(
        30.0, gt=0.0, description="flush a partial shard after this long"
    )
    # requests.TEMPERATURES: finite logits / temperature in float32 (a sampler refuses others)
    temperature: Float = Field(1.0, ge=1e-6, le=1e6)
    top_k: Int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: Int = Field(16, ge=1, description="tokens the policy may generate per turn")
    max_episode_tokens: Int = Field(192, ge=8)
    weight_poll_s: Float = Field(1.0, gt=0.0)
    reload_every_versions: Int = Field(
        1,
        ge=1,
        le=1000,
        description="load new weights only once the learner is this many versions ahead "
        "(1: every new version); more forces staleness up to the bound, for studies of "
        "off-policy corrections (async mode, at most learner.max_staleness)",
    )
    flow_control: bool = Field(
        True,
        description="on (true): actors pause starting new episodes while the unread backlog "
        "would be staler than learner.max_staleness when the learner reaches it, and resume "
        "as it drains (async mode; docs/scaling.md, 'Flow control'); off (false): actors "
        "never wait, and what arrives too stale is dropped",
    )
    kv_cache_slots: Int = Field(
        0,
        ge=0,
        le=65536,
        description="conversations whose KV cache the sampler keeps between turns, and the "
        "most rows it decodes in one batch (0: envs_per_actor, or as many as the device's "
        "memory holds); fewer slots re-prefill evicted episodes",
    )
    decode_rows: Int = Field(
        0,
        ge=0,
        le=65536,
        description="the most rows a sampler replica decodes in one batch (0: all its KV-cache "
        "slots); fewer keep a decode step's working set small while the slots still keep "
        "every episode's cache",
    )
    batch_wait_s: Float = Field(
        0.02, ge=0.0, le=1.0, description="gather policy calls this long into one sampler batch"
    )
    sampler_replicas: Int = Field(
        1,
        ge=1,
        le=64,
        description="copies of the policy an async actor samples with, one per local device, "
        "each serving its share of the episodes (on a CPU: JAX CPU devices, a core each); "
        "the KV-cache slots are split among them",
    )

    agent: AgentConfig = Field(default_factory=AgentConfig)
    remote: RemoteEngineConfig = Field(default_factory=RemoteEngineConfig)
    autopilot: AutopilotConfig = Field(default_factory=AutopilotConfig)

    @model_validator(mode="after")
    def _check_autopilot(self) -> ActorConfig:
        pilot = self.autopilot
        if pilot.enabled and not self.flow_control:
            raise ValueError(
                "actor.autopilot.enabled=true needs actor.flow_control=true: the autopilot "
                "aims for more supply than the learner trains, and flow control withholds "
                "the surplus instead of letting it go stale"
            )
        return self

    @model_validator(mode="after")
    def _check_agent(self) -> ActorConfig:
        if self.kind != "agent":
            return self
        if not self.agent.program:
            raise ValueError("actor.kind=agent needs actor.agent.program (package.module:function)")
        for bound in ("max_open_episodes", "max_concurrent_requests"):
            if getattr(self.agent, bound) < self.envs_per_actor:
                raise ValueError(
                    f"actor.agent.{bound}={getattr(self.agent, bound)} is below "
                    f"actor.envs_per_actor={self.envs_per_actor}: the actor's own agents "
                    "would be refused"
                )
        return self

    @property
    def cache_slots(self) -> int:
        """`kv_cache_slots`, or by default one per environment (the actor builds fewer
        if the device's memory does not hold them: `build_sampler(shrink_to_fit=True)`)."""
        return self.kv_cache_slots or self.envs_per_actor


class MeshConfig(Frozen):
    """Device mesh for the learner. -1 on one axis means 'all remaining devices'."""

    data: Int = -1
    fsdp: Int = 1

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        for name in ("data", "fsdp"):
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ValueError(f"mesh.{name} must be a positive device count or -1, got {value}")
        if self.data == -1 and self.fsdp == -1:
            raise ValueError("only one of mesh.data and mesh.fsdp may be -1")
        return self


class LearnerConfig(ObjectiveConfig):
    """The accelerator learner: data rules, shapes, optimisation, publishing; the RL
    objective's fields (`correction`, `kl_coef`, ...) come from `ObjectiveConfig`."""

    max_steps: Int = Field(
        100, ge=1, description="total optimizer steps of the run; the run is DONE when reached"
    )
    batch_rows: Int = Field(8, ge=1, description="rows per training batch (every bucket)")
    buckets: tuple[Int, ...] = Field(
        (64, 128, 256), description="row lengths; sequences are packed into one of these"
    )
    min_episodes_per_step: Int = Field(8, ge=1)
    learning_rate: Float = Field(3e-4, gt=0.0, description="AdamW learning rate of the RL steps")
    warm_start_learning_rate: FloatOrNone = Field(
        None,
        gt=0.0,
        description="learning rate of the supervised warm start (default: learning_rate)",
    )
    warmup_steps: Int = Field(0, ge=0)
    grad_clip: Float = Field(1.0, gt=0.0)
    weight_decay: Float = Field(0.0, ge=0.0)
    max_staleness: Int = Field(
        4, ge=0, description="async: drop episodes more than this many versions old"
    )
    publish_every: Int = Field(2, ge=1, description="async: publish weights every P steps")
    checkpoint_every: Int = Field(10, ge=1)
    lease_ttl_s: Float = Field(30.0, gt=0.0)
    data_timeout_s: Float = Field(
        600.0, gt=0.0, description="give up if no usable data arrives for this long"
    )
    keep_snapshots: Int = Field(
        16, ge=2, le=1_000_000, description="keep the newest K weight snapshots (and LATEST's)"
    )
    keep_every: Int = Field(
        50, ge=0, le=1_000_000, description="also keep versions that are multiples of M; 0: none"
    )
    delete_consumed_shards: bool = Field(
        False, description="delete a shard once a committed checkpoint holds it consumed"
    )
    dedup_window: Int = Field(
        65_536, ge=1, le=10_000_000, description="episode ids remembered to drop replays"
    )
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype the learner holds its params and grads in; bfloat16 keeps a "
        "float32 master copy in the optimizer state (learner/master_copy.py)",
    )
    full_snapshot_every: Int = Field(
        1,
        ge=1,
        le=1000,
        description="publish a full weight snapshot every K versions and compressed deltas "
        "against it in between (1: always full); not used with LoRA (adapters only)",
    )
    remat: bool = Field(
        False, description="recompute each layer in the backward pass (activations of one layer)"
    )
    logits_chunk: Int = Field(
        256,
        ge=0,
        description="positions per chunk of the loss's logits (never [rows, T, V] at once); "
        "0: all at once",
    )
    attention_block: Int = Field(
        128,
        ge=0,
        description="rows longer than this attend in tiles of this many positions, "
        "flash-style (never [rows, T, T] scores); 0: always dense",
    )
    scan_layers: bool = Field(
        False, description="run the layers as one lax.scan: compile time independent of depth"
    )

    @field_validator("buckets")
    @classmethod
    def _buckets(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value:
            raise ValueError("learner.buckets needs at least one length")
        if any(b <= 0 or b % 8 for b in value):
            raise ValueError(f"learner.buckets must be positive multiples of 8, got {list(value)}")
        return tuple(sorted(set(value)))


class RunConfig(Frozen):
    """Everything that defines one run. `run_uri` = `<store>/<run_name>`."""

    run_name: str = Field(
        "demo",
        description="the run's folder under the store: letters, digits, '.', '_', '-'; "
        "reusing a name resumes that run",
        json_schema_extra={"pattern": _RUN_NAME.pattern},
    )
    store: str = Field(
        "file://./runs", description="root URI: file:///abs/dir or gs://bucket/prefix"
    )
    mode: Literal["async", "sync"] = Field(
        "async",
        description="async: actors never wait (AsyncFlow); sync: the lockstep baseline "
        "(SyncFlow: staleness 0, one version per batch of episodes)",
    )
    seed: Int = Field(0, ge=0, description="random seed of the run (model init, episode seeds)")
    deadline_s: Float = Field(
        0.0, ge=0.0, description="stop everything after this long; 0: no deadline"
    )
    warm_start_steps: Int = Field(
        0, ge=0, description="supervised steps on demonstrations before RL"
    )
    tracker: str | None = Field(
        None,
        description="an experiment tracker the learner's metrics also go to, through "
        "your own client and its settings (mlflow: MLFLOW_TRACKING_URI, ...); none by default",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not _RUN_NAME.match(value):
            raise ValueError(
                "run_name must be 1-128 characters of letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit; got {value!r}"
            )
        return value

    @field_validator("tracker")
    @classmethod
    def _tracker(cls, value: str | None) -> str | None:
        if value is not None:  # the registry is light; no tracker client is imported
            from tunix_tasks.storage.trackers import check_tracker

            check_tracker(value)
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        return normalize_uri(value)

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        if max(self.learner.buckets) > self.model.max_seq_len:
            raise ValueError(
                f"learner.buckets max {max(self.learner.buckets)} exceeds model.max_seq_len "
                f"{self.model.max_seq_len}"
            )
        if self.actor.max_episode_tokens > self.model.max_seq_len:
            raise ValueError(
                f"actor.max_episode_tokens={self.actor.max_episode_tokens} exceeds "
                f"model.max_seq_len={self.model.max_seq_len}"
            )
        if self.mode == "async" and self.learner.max_staleness == 0:
            raise ValueError(
                "learner.max_staleness=0 in async mode drops every episode started before the "
                "latest publish (most of the data); use mode=sync (on-policy: it ignores "
                "max_staleness) or learner.max_staleness >= 1"
            )
        if self.actor.kind == "vectorized":
            self._check_vectorized()
        if self.actor.remote.url:
            self._check_remote()
        pilot, n = self.actor.autopilot, self.actor.num_actors
        if self.autopilot_on and not pilot.min_actors <= n <= (pilot.max_actors or n):
            raise ValueError(
                f"actor.num_actors={n} (the fleet the run starts with) is outside "
                f"actor.autopilot's bounds [{pilot.min_actors}, {pilot.max_actors or n}]"
            )
        k = self.actor.reload_every_versions
        if k > 1 and (self.mode == "sync" or k > self.learner.max_staleness):
            raise ValueError(
                f"actor.reload_every_versions={k} needs mode=async and at most "
                f"learner.max_staleness={self.learner.max_staleness} (mode={self.mode}): "
                "a sync learner waits for each version, and staler weights than the bound "
                "make every episode a drop"
            )
        if self.actor.autopilot.enabled is True and self.mode == "sync":
            raise ValueError(
                "actor.autopilot.enabled=true with mode=sync: a sync learner waits for every "
                "actor's share of each batch by design; use mode=async or turn it off"
            )
        if self.learner.advantage == "group" and self.actor.group_size == 1:
            raise ValueError(
                "actor.group_size=1 with learner.advantage=group gives every episode "
                "advantage 0 (a group of one has no baseline); use actor.group_size >= 2 "
                "or learner.advantage=batch"
            )
        return self

    def _check_remote(self) -> None:
        problems = {
            f"actor.kind={self.actor.kind}: only the async kind samples through a server": (
                self.actor.kind != "async"
            ),
        }
        found = [p for p, bad in problems.items() if bad]
        if found:
            raise ValueError("actor.remote.url is set, but " + "; ".join(found))

    def _check_vectorized(self) -> None:
        names = known_vec_env_names()
        problems = {
            f"env.name={self.env.name} has no vectorized twin (valid: {', '.join(names)})": (
                self.env.name not in names
            ),
            "model.checkpoint: on-device envs read the char presets' format only": bool(
                self.model.checkpoint
            ),
            "mode=sync: the on-device loop never waits for a version": self.mode == "sync",
            "env.latency_s simulates a remote env; on-device envs have none": bool(
                self.env.latency_s or self.env.latency_schedule
            ),
            "actor.sampler_replicas > 1: the on-device loop runs on one device": (
                self.actor.sampler_replicas > 1
            ),
        }
        found = [p for p, bad in problems.items() if bad]
        if found:
            raise ValueError(
                "actor.kind=vectorized cannot run with "
                + "; ".join(found)
                + " (or use actor.kind=async)"
            )

    @property
    def warnings(self) -> list[str]:
        """Valid but suspicious settings, logged when the config is loaded."""
        out = []
        if self.model.dtype != self.learner.compute_dtype:
            out.append(
                f"model.dtype={self.model.dtype} (actors) differs from learner.compute_dtype="
                f"{self.learner.compute_dtype}: fresh importance ratios are not exactly 1 "
                "(approx_kl_s0 in the learner metrics measures it)"
            )
        if self.model.lora_rank and (self.learner.param_dtype, self.model.dtype) == (
            "bfloat16",
            "float32",
        ):
            # Adapter snapshots carry no base: the learner rounds it, float32 actors do not.
            out.append(
                "learner.param_dtype=bfloat16 with LoRA holds the frozen base in bfloat16, "
                "the actors (model.dtype=float32) in float32: fresh importance ratios are "
                "not exactly 1"
            )
        return out

    @property
    def autopilot_on(self) -> bool:
        """Does the fleet size itself (`actor.autopilot.enabled`; unset: where it is safe,
        in async mode with flow control, which withholds the surplus it aims for)?"""
        enabled = self.actor.autopilot.enabled
        if enabled is None:
            return self.mode == "async" and self.actor.flow_control
        return enabled

    @property
    def first_active_actors(self) -> int | None:
        """The actors that admit episodes before the autopilot writes its fleet file
        (`control/fleet.json`): `actor.num_actors` where a launcher started the fleet at
        an explicit `actor.autopilot.max_actors`, the others park; None (every actor
        runs) without one, so an actor started by hand (`tunix-tasks actor --actor-id
        N`) runs."""
        if not self.autopilot_on or self.actor.autopilot.max_actors is None:
            return None
        return self.actor.num_actors

    @property
    def sync_groups_per_actor(self) -> int:
        """Synchronous mode: episode groups each actor plays per weights version, so that
        the fleet produces at least `learner.min_episodes_per_step` episodes."""
        per_actor = -(-self.learner.min_episodes_per_step // self.actor.num_actors)
        return max(1, -(-per_actor // self.actor.group_size))

    @property
    def sync_episodes_per_version(self) -> int:
        return self.sync_groups_per_actor * self.actor.group_size * self.actor.num_actors

    @property
    def run_uri(self) -> str:
        return f"{self.store.rstrip('/')}/{self.run_name}"

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

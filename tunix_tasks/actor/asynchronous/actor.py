"""The asynchronous actor: many environments on one asyncio loop, one batched sampler.

One actor process runs `envs_per_actor` episode loops on one asyncio event loop. Env steps
overlap (a slow remote env never blocks the others); policy calls from all loops are
gathered into one batched `Sampler.sample` that runs in a worker thread, so envs keep
stepping while the model computes. Episodes of one group (same env seed) are committed to
the same shard, which is what group-normalised advantages need.

    actor = Actor(cfg, store, actor_id="actor-0")
    summary = actor.run()          # until DONE marker, deadline, SIGTERM/SIGINT/SIGHUP

The lifecycle, weights reload, shards and metrics are `ActorRuntime`'s (actor/runtime.py);
the engine is the run's `Sampler` (or `SamplerReplicas`). Before each policy batch the
engine thread polls for new weights; actors swap weights between policy batches, possibly
mid-episode (the episode keeps the oldest version). With `actor.remote.url` the engine is
a completions server instead (actor/remote/): each turn is a request, and a task on the
event loop polls for weights and pushes them to the server.

Synchronous mode (`mode=sync`): the actor generates one batch of episodes per weights
version, commits it, and waits for the learner to publish the next version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from tunix_tasks.actor.admission import PAUSED_RECHECK_S
from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, play_episode
from tunix_tasks.actor.remote.engine import RemoteEngine, run_weights_folder
from tunix_tasks.actor.runtime import ActorRuntime, episode_seed
from tunix_tasks.config import ModelConfig, RunConfig
from tunix_tasks.envs import make_env
from tunix_tasks.episode import Episode
from tunix_tasks.policy.build import build_actor_sampler, lora_spec, policy_spec
from tunix_tasks.policy.packaged_models import resolve_checkpoint
from tunix_tasks.policy.replicas import SamplerReplicas
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.storage.runs import prepared_at
from tunix_tasks.storage.store import ObjectStore

__all__ = ["Actor"]


class Actor(ActorRuntime):
    """`actor.kind: async` (module docstring)."""

    engine: Sampler | SamplerReplicas | RemoteEngine

    def __init__(self, cfg: RunConfig, store: ObjectStore, **kwargs: Any) -> None:
        super().__init__(cfg, store, **kwargs)
        self._background_error: BaseException | None = None  # of `_watch`, `_reload_loop`
        self.policy: BatchingPolicy | RemoteEngine
        if isinstance(self.engine, RemoteEngine):
            self.policy = self.engine  # a turn is a request; `_reload_loop` pushes weights
        else:
            self.policy = BatchingPolicy(
                self.engine,
                max_new_tokens=cfg.actor.max_new_tokens,
                temperature=cfg.actor.temperature,
                top_k=cfg.actor.top_k,
                seed=episode_seed(cfg.seed, self._seed_key, -1),
                version=lambda: self.version,
                before_batch=self._maybe_reload,
                gather_s=cfg.actor.batch_wait_s,
            )
        self._group_counter = 0
        self._playing = 0  # groups being played (flow control counts them in flight)
        self.limits = EpisodeLimits.from_config(cfg)
        # `env.latency_schedule` counts from the run's preparation, the same for every actor.
        self._prepared_at = prepared_at(store) if cfg.env.latency_schedule else None

    def _build_engine(self) -> Sampler | SamplerReplicas | RemoteEngine:
        # The rollout renders with the engine's own chat format (stop ids, template).
        actor = self.cfg.actor
        if not actor.remote.url:
            self.chat, sampler = build_actor_sampler(self.cfg)
            return sampler
        self.chat, spec = policy_spec(self.cfg.model)  # the shapes only: no model here
        return RemoteEngine(
            actor.remote,
            chat=self.chat,
            spec=spec,
            max_new_tokens=actor.max_new_tokens,
            temperature=actor.temperature,
            top_k=actor.top_k,
            seed=episode_seed(self.cfg.seed, self._seed_key, -1),
            connections=actor.remote.max_connections or actor.envs_per_actor,
            run_folder=run_weights_folder(self.cfg.run_name, self.cfg.run_uri, self.run_id),
            actor_id=self.actor_id,
            config_json=_base_config_json(self.cfg.model),
            lora=lora_spec(self.cfg.model),
        )

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        tasks = [asyncio.create_task(self._watch())]
        if isinstance(self.engine, RemoteEngine):  # no engine thread to reload between steps
            tasks.append(asyncio.create_task(self._reload_loop()))
        for task in tasks:  # nothing awaits them while the actor runs: their error stops it
            task.add_done_callback(self._background_ended)
        try:
            async with self.policy:
                if self.cfg.mode == "sync":
                    await self._run_sync()
                else:
                    slots = max(1, self.cfg.actor.envs_per_actor // self.cfg.actor.group_size)
                    await self._group_loops(slots)
        finally:
            for task in tasks:
                task.cancel()
        if self._background_error is not None:
            raise self._background_error

    def _background_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        self._background_error = self._background_error or err
        self.request_stop(f"failed: {err!r}")

    async def _group_loops(self, slots: int) -> None:
        """`slots` group loops until the actor stops; the first error (a store outage past
        its limit, a failed engine) stops the actor and ends the other loops before it is
        raised, so none is left sampling from a stopped engine."""
        loops = [asyncio.create_task(self._group_loop(i)) for i in range(slots)]
        try:
            await asyncio.gather(*loops)
        except BaseException as err:
            self.request_stop(f"failed: {err!r}")
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            raise

    async def _reload_loop(self) -> None:
        """A remote engine's weights: polled (at `weight_poll_s`) and pushed while turns
        are in flight; a server that stays unreachable stops the actor with its error."""
        while not self._should_stop():
            try:
                await asyncio.to_thread(self._maybe_reload)
            except Exception as err:
                self.request_stop(f"weights push failed: {err}")
                raise
            await asyncio.sleep(min(0.25, self.cfg.actor.weight_poll_s))

    async def _watch(self) -> None:
        """Stop on the run's DONE marker; commit partial shards on time."""
        while not self._should_stop():
            if await asyncio.to_thread(self._watch_once):
                break
            await asyncio.sleep(1.0)

    def _next_group(self) -> tuple[int, int]:
        """(group number, env seed) of the next group: unique per actor incarnation."""
        group = self._group_counter
        self._group_counter += 1
        return group, episode_seed(self.cfg.seed, self._seed_key, group)

    async def _play_group(self) -> list[Episode]:
        group, seed = self._next_group()
        envs = [self._make_env(seed, k) for k in range(self.cfg.actor.group_size)]
        episodes = await asyncio.gather(
            *(
                play_episode(
                    env,
                    self.policy,
                    seed=seed,
                    limits=self.limits,
                    chat=self.chat,
                    builder=self.episodes,
                    group=group,
                    default_version=max(self.version, 0),
                    on_env_step=self.stats.env_step_s.append,
                )
                for env in envs
            )
        )
        del self.stats.env_step_s[:-4000]
        return list(episodes)

    def _make_env(self, seed: int, k: int):
        e = self.cfg.env
        return make_env(
            e.name,
            latency_s=e.latency_s,
            latency_jitter=e.latency_jitter,
            latency_seed=seed * 131 + k,
            latency_schedule=e.latency_schedule,
            started_at=self._prepared_at,
            **e.kwargs,
        )

    async def _admitted(self) -> None:
        """Wait while flow control pauses new groups (groups in flight go on)."""
        g = self.cfg.actor.group_size
        while not self._should_stop() and not self._admit((self._playing + 1) * g):
            self._leave_if_parked(self._playing * g)
            await asyncio.to_thread(self._maybe_reload)  # also reads the learner's position
            if self.writer.pending:
                await asyncio.to_thread(self._flush_early)
            await asyncio.sleep(PAUSED_RECHECK_S)

    async def _group_loop(self, slot: int) -> None:
        while not self._should_stop():
            await self._admitted()
            if self._should_stop():
                break
            self._playing += 1
            try:
                episodes = await self._play_group()
            finally:
                self._playing -= 1
            await asyncio.to_thread(self._commit, episodes)

    async def _run_sync(self) -> None:
        """Classic synchronous loop: one batch per weights version, then wait."""
        groups = self.cfg.sync_groups_per_actor
        while not self._should_stop():
            version = self.version
            results = await asyncio.gather(*(self._play_group() for _ in range(groups)))
            for episodes in results:
                await asyncio.to_thread(self._commit, episodes)
            await asyncio.to_thread(
                self._outage.call, "shard commit", self._locked, self.writer.flush
            )
            while self.version == version and not self._should_stop():
                self._last_poll = 0.0
                await asyncio.to_thread(self._maybe_reload)
                await asyncio.sleep(0.05)

    def _engine_metrics(self) -> dict[str, Any]:  # "batch": a remote engine's turns in flight
        pol = np.asarray(self.policy.latency_s[-500:] or [0.0])
        return {
            "policy_latency_p50_s": float(np.percentile(pol, 50)),
            "policy_batch_mean": float(np.mean(self.policy.batch_sizes[-500:] or [0])),
        }


def _base_config_json(model: ModelConfig) -> Path | None:
    """The base checkpoint's config.json when it is on this machine, for the weights
    folders a remote engine writes (servers that rebuild the model read it)."""
    if model.checkpoint is None:
        return None
    where = resolve_checkpoint(model.checkpoint).removeprefix("file://")
    path = Path(where) / "config.json"
    return path if "://" not in where and path.is_file() else None

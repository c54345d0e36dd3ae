"""The actor's seams: `RolloutEngine` (engine.py), the runtime that drives it, the
`ACTOR_KINDS` registry and the one `EpisodeBuilder`."""

from __future__ import annotations

import importlib
import inspect
import time
import typing

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.actor.engine import RolloutEngine
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.actor.runtime import ActorRuntime
from tunix_tasks.actor.vectorized.device_loop import Shape
from tunix_tasks.actor.vectorized.ondevice import OnDeviceRollout
from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.config import ActorConfig, ModelConfig, load_config
from tunix_tasks.envs.vectorized import make_vec_env
from tunix_tasks.frontdoor.entrypoints import ACTOR_KINDS
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.replicas import SamplerReplicas
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.storage.snapshot_format import Manifest
from tunix_tasks.storage.store import open_store

ENGINES = (Sampler, SamplerReplicas, OnDeviceRollout)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engine_classes_have_the_protocols_shape(cls):
    """What the runtime calls: `model` and `compile_count` properties, and
    `update_params(flat, *, version, only=nnx.Param)` (the runtime passes `only` for
    adapters only)."""
    assert isinstance(cls.model, property) and isinstance(cls.compile_count, property)
    params = inspect.signature(cls.update_params).parameters
    assert params["version"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["only"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["only"].default is nnx.Param


def test_built_engines_are_rollout_engines():
    chat, model = build_policy(ModelConfig(preset="tiny"))
    sampler = Sampler(model, pad_id=chat.tokenizer.pad_id, stop_ids=chat.stop_ids)
    replicas = SamplerReplicas([sampler, Sampler(model, pad_id=0, stop_ids=chat.stop_ids)])
    env = make_vec_env("calculator")
    rollout = OnDeviceRollout(
        model,
        env,
        TokenLayout.from_chat(chat),
        Shape(envs=4, tokens=96, max_new=8, max_turns=2, group_size=2, capacity=8),
        temperature=1.0,
        top_k=0,
        token_seed=1,
        env_seed=2,
    )
    for engine in (sampler, replicas, rollout):
        assert isinstance(engine, RolloutEngine), type(engine).__name__
        assert engine.model is model and engine.compile_count == 0
    assert not isinstance(chat, RolloutEngine)


class _Recording:
    """An engine that records what the runtime asks of it."""

    model = None
    compile_count = 7

    def __init__(self) -> None:
        self.calls: list[tuple[int, type]] = []

    def update_params(self, flat, *, version: int, only: type = nnx.Param) -> None:
        self.calls.append((version, only))


class _Runtime(ActorRuntime):
    built = 0

    def _build_engine(self) -> RolloutEngine:
        type(self).built += 1
        assert self.episodes.group_key == self._seed_key  # the runtime's fields are set
        return _Recording()


def test_runtime_builds_its_engine_once_and_reloads_through_it(tmp_path):
    cfg = load_config(None, [])
    runtime = _Runtime(cfg, open_store(str(tmp_path)), actor_id="a-0", incarnation="i")
    assert _Runtime.built == 1 and isinstance(runtime.engine, RolloutEngine)
    manifest = Manifest(3, 30, "0" * 64, time.time(), 0, {})
    runtime._load({}, manifest)
    assert runtime.engine.calls == [(3, nnx.Param)] and runtime.version == 3


def test_every_actor_kind_is_registered_and_resolves():
    kinds = typing.get_args(ActorConfig.model_fields["kind"].annotation)
    assert set(kinds) == set(ACTOR_KINDS)
    for kind, target in ACTOR_KINDS.items():
        module, name = target.split(":")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, ActorRuntime), kind
        for hook in ("_build_engine", "_serve"):
            assert getattr(cls, hook) is not getattr(ActorRuntime, hook), (kind, hook)


def test_episode_builder_stamps_the_writers_fields():
    episodes = EpisodeBuilder(actor_id="actor-3", env="calculator", group_key="actor-3/abc")
    ep = episodes([1, 5, 2], [0, 1, 0], [0.0, -0.5, 0.0], group=4, seed=91, reward=1, num_turns=1)
    assert (ep.actor_id, ep.env, ep.group_id, ep.seed) == (
        "actor-3",
        "calculator",
        "actor-3/abc/4",
        91,
    )
    assert ep.reward == 1.0 and ep.num_turns == 1 and ep.status == "ok" and ep.policy_version == 0
    assert episodes([1], [0], [0.0], group=4, seed=91).episode_id != ep.episode_id
    # Outside an actor (evaluation, demonstrations): no writer, no group.
    alone = EpisodeBuilder(env="sorting")([1], [0], [0.0], group=None, seed=7, episode_id="d-1")
    assert (alone.actor_id, alone.group_id, alone.env, alone.episode_id) == (
        "",
        "",
        "sorting",
        "d-1",
    )
    assert EpisodeBuilder(group_key="k").group_id(None) == ""
    np.testing.assert_array_equal(ep.loss_mask, [0, 1, 0])


def test_ondevice_restart_starts_every_row_at_the_next_whole_group():
    """Flow control's restart after a long pause: rows in flight are dropped and new
    tickets start at a group boundary, so no GRPO group mixes dropped and new rows."""
    chat, model = build_policy(ModelConfig(preset="tiny"))
    layout, env = TokenLayout.from_chat(chat), make_vec_env("calculator")
    shape = Shape(envs=4, tokens=96, max_new=8, max_turns=2, group_size=3, capacity=8)
    rollout = OnDeviceRollout(
        model, env, layout, shape, temperature=1.0, top_k=0, token_seed=1, env_seed=2
    )
    assert rollout.restart() == 0  # nothing started yet
    rollout._loop = rollout._start(rollout._state, rollout._sampling(), jnp.int32(5))
    assert rollout._loop.rows.ticket.tolist() == [5, 6, 7, 8]  # next ticket 9
    assert rollout.restart() == 9
    assert rollout._loop.rows.ticket.tolist() == [9, 10, 11, 12]
    assert rollout.restart() == 15 and int(rollout._loop.next_ticket) == 19

"""The actor's seams: `RolloutEngine` (engine.py), the runtime that drives it, the
`ACTOR_KINDS` registry and the one `EpisodeBuilder`."""

from __future__ import annotations

import importlib
import inspect
import time
import typing

import numpy as np
import pytest
from flax import nnx

from tunix_tasks.actor.engine import RolloutEngine
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.actor.remote.engine import RemoteEngine
from tunix_tasks.actor.runtime import ActorRuntime
from tunix_tasks.actor.vectorized.device_loop import Shape
from tunix_tasks.actor.vectorized.ondevice import OnDeviceRollout
from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.config import ActorConfig, ModelConfig, load_config
from tunix_tasks.envs.vectorized import make_vec_env
from tunix_tasks.frontdoor.entrypoints import ACTOR_KINDS
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.replicas import SamplerReplicas
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.storage.snapshot_format import Manifest
from tunix_tasks.storage.store import open_store

ENGINES = (Sampler, SamplerReplicas, OnDeviceRollout, RemoteEngine)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engine_classes_have_the_protocols_shape(cls):
    """What the runtime calls: the `compile_count` property, and
    `update_params(flat, *, version, only=nnx.Param)` (the runtime passes `only` for
    adapters only)."""
    assert isinstance(cls.compile_count, property)
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
        assert engine.compile_count == 0
    assert not isinstance(chat, RolloutEngine)


class _Recording:
    """An engine that records what the runtime asks of it."""

    compile_count = 7

    def __init__(self) -> None:
        self.calls: list[tuple[int, type, str, float]] = []

    def update_params(
        self, flat, *, version: int, only: type = nnx.Param, digest="", created_at=0.0
    ) -> None:
        self.calls.append((version, only, digest, created_at))


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
    manifest = Manifest(3, 30, "ab" * 32, time.time(), 0, {})
    runtime._load({}, manifest)  # a remote engine names its folder by the digest, and
    #   orders what its server holds by the time the learner published it
    assert runtime.engine.calls == [(3, nnx.Param, "ab" * 32, manifest.created_at)]
    assert runtime.version == 3


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


def test_ondevice_starts_no_more_episodes_than_the_segments_budget():
    """Flow control's budget: a segment starts at most `budget` new episodes, plus the
    tickets that complete the open group; rows past it finish their episode and idle, and
    a segment with no live row and no budget runs no step. A later budget starts idle
    rows, at the current weights' version."""
    chat, model = build_policy(ModelConfig(preset="tiny"))
    layout, env = TokenLayout.from_chat(chat), make_vec_env("calculator")
    shape = Shape(envs=4, tokens=96, max_new=8, max_turns=2, group_size=3, capacity=8)
    rollout = OnDeviceRollout(
        model, env, layout, shape, temperature=1.0, top_k=0, token_seed=1, env_seed=2
    )
    out, ran, live = rollout.run_segment(4, budget=2)  # tickets 0, 1 start: 2 rows idle
    assert (ran, live, out.count) == (4, 2, 0)
    tickets: list[int] = []
    for _ in range(12):  # about one episode (<= 96 tokens) per segment
        out, ran, live = rollout.run_segment(48, budget=0)
        tickets += out.ticket[: out.count].tolist()
        if live == 0:
            break
    assert sorted(tickets) == [0, 1, 2]  # 2 completes group 0, then nothing
    assert rollout.run_segment(48, budget=0)[1:] == (0, 0)  # nothing live: no step

    rollout.update_params(flat_params(model), version=7)
    out, ran, live = rollout.run_segment(96, budget=5)
    assert live <= 4 and ran == 96 and out.count > 0
    started = set(out.ticket[: out.count].tolist()) | set(rollout._loop.rows.ticket.tolist())
    assert max(started) <= 3 + 5 + 2  # the budget, and at most the rest of a group
    assert min(out.ticket[: out.count]) >= 3 and set(out.version[: out.count].tolist()) == {7}

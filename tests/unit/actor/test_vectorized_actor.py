"""The vectorized actor: JAX environments and the policy in one jitted loop, real store.

Each test publishes snapshots with `WeightsPublisher`, runs a `VectorizedActor` in a
thread and reads back what it wrote through the learner's validating reader: the same
schema and checks as the asynchronous actor's shards, GRPO groups of one task each, exact
behaviour log-probs (a fresh forward pass of the published weights scores every sampled
token the same), exactness across a weights reload in the middle of episodes (rows in
flight are re-cached under the new weights), one compile for the run, and a learner that
trains on the shards of both actor kinds of one run without telling them apart.
"""

from __future__ import annotations

import jax
import numpy as np

from tests.runs import read_ledger_ids
from tests.unit.actor.test_actor import (
    LOGPROB_ATOL,
    _created_again_under,
    _episode_logprobs,
    _peaky,
    _publish,
    _read_episodes,
    _recompute_logprobs,
    _Running,
    compile_cache,  # noqa: F401  (module fixture: a shared XLA cache)
)
from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.actor.vectorized.actor import VectorizedActor
from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.config import RunConfig, config_from_dict
from tunix_tasks.envs.vectorized import make_vec_env
from tunix_tasks.frontdoor.entrypoints import run_learner
from tunix_tasks.policy.build import build_chat
from tunix_tasks.storage.runs import mark_done, write_config


def _config(
    store_uri: str, *, kind: str = "vectorized", per_shard: int = 16, **learner
) -> RunConfig:
    return config_from_dict(
        {
            "store": store_uri,
            "run_name": "vec",
            "model": {"preset": "tiny"},
            "env": {"name": "calculator", "max_turns": 3, "kwargs": {"difficulty": 1}},
            "actor": {
                "kind": kind,
                "envs_per_actor": 8,
                "group_size": 4,
                "episodes_per_shard": per_shard,
                "shard_interval_s": 600.0,
                "max_new_tokens": 8,
                "max_episode_tokens": 96,
                "weight_poll_s": 0.05,
                "temperature": 0.8,
                "top_k": 20,
            },
            "learner": {"batch_rows": 8, "buckets": [128], "min_episodes_per_step": 8, **learner},
        }
    )


def _groups_are_whole(episodes, group_size: int) -> None:
    groups: dict[str, list] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e)
    assert all(len(g) == group_size for g in groups.values())
    # one task per group: the same first prompt (the question) for every member
    for g in groups.values():
        firsts = {bytes(e.tokens[: np.argmax(e.loss_mask)]) for e in g}
        assert len(firsts) == 1


def _seeds_reproduce_the_tasks(cfg: RunConfig, episodes) -> None:
    """An episode's `seed` is its group's env seed: `reset(jax.random.key(seed))` lays out
    exactly its first prompt; groups (and only groups) share one."""
    groups = {e.group_id: e for e in episodes}
    assert len({e.seed for e in groups.values()}) == len(groups)
    assert all(e.seed == groups[e.group_id].seed for e in episodes)
    env = make_vec_env(cfg.env.name, **cfg.env.kwargs)
    layout = TokenLayout.from_chat(build_chat(cfg.model))
    for e in groups.values():
        _, obs = env.reset(jax.random.key(e.seed))
        ids = np.asarray(layout.code_to_id)[np.asarray(obs.codes)[: int(obs.length)]]
        prompt = [*layout.start_prefix, *ids, *layout.start_suffix]
        assert e.tokens[: np.argmax(e.loss_mask)].tolist() == prompt, e.group_id


def test_vectorized_actor_writes_valid_shards_with_exact_logprobs(tmp_path):
    cfg = _config(f"file://{tmp_path}/runs")
    store = write_config(cfg)
    v0 = _peaky(123, cfg)
    _publish(store, cfg, v0, version=0)
    actor = VectorizedActor(cfg, store, actor_id="actor-vec")
    run = _Running(actor)
    run.episodes_at_least(32)
    mark_done(store, "test finished")
    summary = run.join()

    assert summary["stop_reason"].startswith("run done")
    episodes = _read_episodes(store)  # validated, exactly once
    assert len(episodes) == summary["episodes"] >= 32
    assert {e.policy_version for e in episodes} == {0}
    assert {(e.actor_id, e.env) for e in episodes} == {("actor-vec", "calculator")}
    _groups_are_whole(episodes, cfg.actor.group_size)
    _seeds_reproduce_the_tasks(cfg, episodes)
    tok_bos, tok_eos = 1, 2
    for e in episodes:
        assert e.tokens[0] == tok_bos and e.tokens[-1] == tok_eos
        assert e.length <= cfg.actor.max_episode_tokens and 1 <= e.num_turns <= 3
        assert np.all(e.behavior_logprobs[e.loss_mask == 0] == 0.0) and e.loss_mask.sum() > 0
    sample = sorted(episodes, key=lambda e: e.episode_id)[:24]
    recorded, fresh = _recompute_logprobs(cfg, v0, sample)
    assert recorded.size > 100 and np.std(recorded) > 0.1
    np.testing.assert_allclose(recorded, fresh, atol=LOGPROB_ATOL, rtol=0)
    # one segment program and the start for the whole run (no reload happened)
    assert summary["compile_count"] == 2


def test_a_vectorized_actor_whose_run_is_created_again_writes_nothing_there(tmp_path):
    """The rows still on the device when it stops are committed in its `finally`: the
    fence refuses them too (test_actor.py has the asynchronous kinds' paths)."""
    cfg = _config(f"file://{tmp_path}/runs", per_shard=4)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(123, cfg), version=0)
    _created_again_under(VectorizedActor(cfg, store, actor_id="actor-vec"), cfg, stop=False)


class _ReloadsMidEpisode(VectorizedActor):
    """Takes a published snapshot only at a segment boundary where some row has sampled
    tokens of an episode it has not ended. Peaky weights make rows finish in step, so
    otherwise a reload can land where every row has just started afresh (CI saw it):
    the straddling case this test is for would then not happen."""

    def _maybe_reload(self) -> None:
        loop = self.engine._loop
        if loop is not None:
            gen, turns = jax.device_get((loop.rows.gen, loop.rows.turns))
            if not np.any((gen > 0) | (turns > 0)):
                return
        super()._maybe_reload()


def test_reload_mid_episode_keeps_every_logprob_exact(tmp_path):
    """v1 arrives while rows are mid-episode: their later tokens are drawn from v1 over
    keys and values recomputed under v1, so each token is exact under v0 or v1, an
    episode never goes back to v0, and it is tagged with v0 (its oldest version)."""
    cfg = _config(f"file://{tmp_path}/runs")
    store = write_config(cfg)
    v0, v1 = _peaky(123, cfg), _peaky(7, cfg)
    _publish(store, cfg, v0, version=0)
    actor = _ReloadsMidEpisode(cfg, store, actor_id="actor-vec")
    # Peaky weights make every episode alike, so rows finish in step and a segment sized
    # to an episode would end between episodes: short segments end mid-episode.
    actor.segment_steps = 7
    run = _Running(actor)
    run.episodes_at_least(8)
    _publish(store, cfg, v1, version=1)
    run.until(lambda: actor.version == 1, "the reload")
    run.episodes_at_least(actor.stats.episodes + 48)
    mark_done(store, "test finished")
    run.join()

    episodes = _read_episodes(store)
    straddling = 0
    under_v0, under_v1 = (_episode_logprobs(cfg, v, episodes) for v in (v0, v1))
    for e, (rec0, fresh0), (rec1, fresh1) in zip(episodes, under_v0, under_v1, strict=True):
        under0 = np.abs(rec0 - fresh0) <= LOGPROB_ATOL
        under1 = np.abs(rec1 - fresh1) <= LOGPROB_ATOL
        assert np.all(under0 | under1), e.episode_id
        first1 = int(np.argmax(under1 & ~under0)) if np.any(under1 & ~under0) else len(rec0)
        assert np.all(under1[first1:]), "a token after the reload was not exact under v1"
        if 0 < first1 < len(rec0):
            straddling += 1
            assert e.policy_version == 0
        if e.policy_version == 1:
            assert np.all(under1)
    assert straddling > 0, "no episode was in flight during the reload"
    assert actor.engine.compile_count == 3  # start, segment, one refill program


def test_learner_trains_on_shards_of_both_actor_kinds(tmp_path):
    """One run, an asynchronous and a vectorized actor (one after the other, so neither
    floods the buffer before the other writes): the learner trains on both actors'
    episodes, quarantines nothing and never asks which kind wrote a shard."""
    cfg = _config(f"file://{tmp_path}/runs", kind="async", per_shard=4, max_staleness=50)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(123, cfg), version=0)
    for actor in (
        Actor(cfg, store, actor_id="actor-async"),
        VectorizedActor(cfg, store, actor_id="actor-vec"),
    ):
        run = _Running(actor)
        run.until(lambda a=actor: len(a.writer.shards_written) >= 4, "four shards")
        actor.request_stop("enough")
        run.join()
    produced = {e.episode_id: e.actor_id for e in _read_episodes(store)}
    # every step takes >= 8 episodes: 6 steps read past the asynchronous actor's shards
    assert sum(a == "actor-async" for a in produced.values()) < 6 * 8
    summary = run_learner(cfg.run_uri, max_steps=6, handle_signals=False)
    assert summary["steps"] == 6
    assert not store.list("quarantine/")
    trained, _ = read_ledger_ids(store)
    assert {produced[i] for i in trained} == {"actor-async", "actor-vec"}

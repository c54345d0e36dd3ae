"""Tests for tunix_tasks.actor.asynchronous.actor: real actors on a real store (file:// and gs://), no mocks.

Each test publishes weight snapshots with `WeightsPublisher`, runs an `Actor` in a thread
(or `run_actor` in a subprocess) and checks what it wrote: valid shards, exact behaviour
log-probs, weight reloads and refusals, stop conditions, env failures, concurrency,
bounded compilation and metrics.

Speed: a module-wide persistent XLA compilation cache (a temporary directory) lets each
new actor reuse the sampler programs compiled by earlier ones; the environments are tiny
and the model is the "tiny" preset.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from tests.paths import REPO
from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.actor.runtime import ActorRuntime
from tunix_tasks.config import RunConfig, config_from_dict
from tunix_tasks.envs import Action, StepResult, function_tool, register_env
from tunix_tasks.episode import Episode
from tunix_tasks.learner.flow import FlowReport
from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.distribution import token_logprobs
from tunix_tasks.policy.params import flat_params, load_flat_params
from tunix_tasks.policy.tokenizer import Tokenizer
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import RunReplaced, mark_done, run_id, write_config
from tunix_tasks.storage.shards import RUN_ID_KEY
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.weights import (
    MANIFEST_FILE,
    PARAMS_FILE,
    WeightsPublisher,
    encode_snapshot,
    read_latest,
)
from tunix_tasks.testing.shard_factory import block_episodes

TOK = Tokenizer()
LOGPROB_ATOL = 1e-4  # float32: sampler (KV cache, padded batch) vs one full forward pass
WAIT_S = 60.0  # upper bound for any "until" wait; tests finish far sooner


# ---------------------------------------------------------------- environments


class _QuickEnv:
    """Short observations; done (reward 1 if the last action is non-empty) after `turns`
    steps. Raises in `step` on seeds where `seed % fail_mod == 0` (fail_mod > 0)."""

    name = "quick"
    # One tool, so every sampled action reaches `step` (no parse errors from the char format).
    tools = (function_tool("note", "Write a note.", {"text": "the note"}),)

    def __init__(self, turns: int = 2, fail_mod: int = 0) -> None:
        self.turns, self.fail_mod = turns, fail_mod
        self._seed, self._n = 0, 0

    async def reset(self, seed: int) -> str:
        self._seed, self._n = seed, 0
        return f"q{seed % 10}"

    async def step(self, action: Action) -> StepResult:
        self._n += 1
        if self.fail_mod and self._seed % self.fail_mod == 0:
            raise RuntimeError(f"tool crashed on seed {self._seed}")
        done = self._n >= self.turns
        return StepResult(
            f"r{self._n}", float(done and bool(action.content or action.tool_calls)), done
        )

    def demonstration(self, seed: int) -> list[Action]:
        return [Action(content="a")] * self.turns


QUICK = f"test_actor_quick_{uuid.uuid4().hex[:6]}"
register_env(QUICK)(_QuickEnv)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Persistent XLA cache shared by this module's actors (and its subprocess)."""
    path = str(tmp_path_factory.mktemp("xla_cache"))
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (path, 0.0, 0), strict=True):
        jax.config.update(n, v)
    compilation_cache.reset_cache()
    yield path
    for n, v in old.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def _config(store_uri: str, *, env: dict | None = None, **actor) -> RunConfig:
    return config_from_dict(
        {
            "store": store_uri,
            "run_name": "r",
            "model": {"preset": "tiny"},
            "env": {"name": QUICK, "max_turns": 3, "step_timeout_s": 5.0, **(env or {})},
            "actor": {
                "envs_per_actor": 4,
                "group_size": 2,
                "episodes_per_shard": 10_000,  # only time / stop flushes, unless a test says so
                "shard_interval_s": 600.0,
                "max_new_tokens": 6,
                "max_episode_tokens": 48,
                "weight_poll_s": 0.1,
                "temperature": 0.8,
                "top_k": 20,
                **actor,
            },
            # groups of one (some tests) need the batch baseline (config validation)
            "learner": {"advantage": "group" if actor.get("group_size", 2) > 1 else "batch"},
        }
    )


def _peaky(seed: int, cfg: RunConfig) -> dict[str, np.ndarray]:
    """Weights of a fresh policy with a scaled-up output layer: far from uniform, so the
    log-prob check below would notice the wrong weights."""
    _, model = build_policy(cfg.model, seed=seed)
    return {k: v * 300.0 if k == "unembed" else v for k, v in flat_params(model).items()}


def _publish(store: ObjectStore, cfg: RunConfig, flat, version: int) -> WeightsPublisher:
    pub = WeightsPublisher(store)
    pub.publish(flat, version=version, step=version, model=cfg.model.model_dump())
    return pub


def _publish_corrupt(store: ObjectStore, cfg: RunConfig, flat, version: int) -> None:
    """A snapshot whose params were damaged in transit: the manifest's sha256 is of the
    good bytes, one byte of the stored params is flipped; LATEST is moved to it last."""
    blob, manifest = encode_snapshot(
        flat, version=version, step=version, model=cfg.model.model_dump()
    )
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    prefix = RunLayout.snapshot(version)
    store.write_bytes(f"{prefix}/{PARAMS_FILE}", bytes(bad))
    store.write_bytes(f"{prefix}/{MANIFEST_FILE}", manifest.to_json())
    _, _, generation = read_latest(store)
    pointer = json.dumps({"version": version, "path": prefix, "step": version}).encode()
    store.write_if_generation(RunLayout.LATEST, pointer, generation)


class _Running:
    """An Actor running `run()` in a thread; re-raises its exception on `join`."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.summary = self.actor.run()
        except BaseException as err:
            self.error = err

    def until(self, pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self.error is not None:
                raise AssertionError(f"actor died waiting for {what}") from self.error
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def episodes_at_least(self, n: int) -> None:
        self.until(lambda: self.actor.stats.episodes >= n, f"{n} episodes")

    def join(self, timeout: float = WAIT_S) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "actor did not stop"
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary


def _read_episodes(store: ObjectStore) -> list[Episode]:
    """Every episode of every shard, through the learner's validating reader."""
    source = EpisodeSource(store, vocab_size=TOK.vocab_size)
    episodes = block_episodes(source.poll(max_shards=100_000))
    assert not source.quarantined, source.quarantined
    ids = [e.episode_id for e in episodes]
    assert len(set(ids)) == len(ids), "an episode was written twice"
    return episodes


@nnx.jit
def _forward(model, tokens, lengths):
    # Segment ids from the lengths, not from token values: the policy may sample PAD.
    idx = jnp.arange(tokens.shape[1])
    positions = jnp.broadcast_to(idx, tokens.shape)
    return model(tokens, positions, (idx[None, :] < lengths[:, None]).astype(jnp.int32))


def _recompute_logprobs(
    cfg: RunConfig, flat, episodes: list[Episode]
) -> tuple[np.ndarray, np.ndarray]:
    """(recorded, recomputed) log-probs of every policy token of `episodes`."""
    pairs = _episode_logprobs(cfg, flat, episodes)
    return np.concatenate([r for r, _ in pairs]), np.concatenate([f for _, f in pairs])


def _episode_logprobs(
    cfg: RunConfig, flat, episodes: list[Episode]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per episode, (recorded, recomputed) log-probs of its policy tokens: one model and
    one batched forward for all of them."""
    _, model = build_policy(cfg.model, seed=999)
    load_flat_params(model, flat)
    width = cfg.actor.max_episode_tokens
    tokens = np.full((len(episodes), width), TOK.pad_id, np.int32)
    for i, ep in enumerate(episodes):
        tokens[i, : ep.length] = ep.tokens
    lengths = np.asarray([ep.length for ep in episodes], np.int32)
    logits = _forward(model, jnp.asarray(tokens), jnp.asarray(lengths))
    lp = np.asarray(
        token_logprobs(logits, jnp.asarray(tokens), cfg.actor.temperature, cfg.actor.top_k)
    )
    pairs = []
    for i, ep in enumerate(episodes):
        where = np.nonzero(ep.loss_mask)[0]
        assert where.size == 0 or where[0] > 0  # BOS is never a policy token
        pairs.append((ep.behavior_logprobs[where], lp[i, where - 1]))  # lp[t-1] scores t
    return pairs


# ---------------------------------------------------------------- tests


def test_actor_writes_valid_shards_with_exact_logprobs(store_uri):
    """DONE stops the actor; the partial shard is flushed; data, metrics, compiles."""
    cfg = _config(store_uri)
    store = write_config(cfg)
    v0 = _peaky(123, cfg)  # not the actor's own init weights (seed 0): a reload is needed
    _publish(store, cfg, v0, version=0)
    actor = Actor(cfg, store, actor_id="actor-e2e")
    run = _Running(actor)
    run.episodes_at_least(24)
    # Programs are reused: compilations stop once every shape was met, while engine steps
    # keep coming; wait for 3 steps per compilation, so a shape first met after DONE
    # cannot bring the ratio under the 2 asserted below (a loaded host fills batches
    # fuller, with fewer steps, by the time 24 episodes are in).
    run.until(
        lambda: len(actor.policy.batch_sizes) >= 3 * actor.engine.compile_count,
        "3 engine steps per sampler compilation",
    )
    mark_done(store, "test finished")
    summary = run.join()

    assert summary["stop_reason"].startswith("run done")
    assert summary["last_version"] == 0
    episodes = _read_episodes(store)
    # No shard was due by size or time: everything arrives through the final flush.
    assert len(episodes) == summary["episodes"] == actor.stats.episodes >= 24
    assert summary["shards"] == 1
    assert {e.policy_version for e in episodes} == {0}
    assert {e.actor_id for e in episodes} == {"actor-e2e"}
    assert {e.env for e in episodes} == {QUICK}
    # groups of group_size episodes share a seed and a group id, in one shard
    groups: dict[str, set[int]] = {}
    for e in episodes:
        groups.setdefault(e.group_id, set()).add(e.seed)
    assert all(len(s) == 1 for s in groups.values())
    assert all(sum(e.group_id == g for e in episodes) == cfg.actor.group_size for g in groups)
    for e in episodes:
        assert e.tokens[0] == TOK.bos_id and e.tokens[-1] == TOK.eos_id
        assert e.length <= cfg.actor.max_episode_tokens
        assert np.all(e.behavior_logprobs[e.loss_mask == 0] == 0.0)
        assert e.loss_mask.sum() > 0

    # Behaviour log-probs == a fresh full forward pass under the published v0 weights.
    sample = sorted(episodes, key=lambda e: e.episode_id)[:32]
    recorded, fresh = _recompute_logprobs(cfg, v0, sample)
    assert recorded.size > 100
    np.testing.assert_allclose(recorded, fresh, atol=LOGPROB_ATOL, rtol=0)
    assert np.std(recorded) > 0.1  # peaky weights: a real distribution, not near-uniform
    _, wrong = _recompute_logprobs(cfg, _peaky(0, cfg), sample)
    assert np.abs(recorded - wrong).max() > 1e-2  # the check can tell weights apart

    # Compilations: bounded by the shapes the run can use: batch buckets up to the envs,
    # prefill (chunk <= window) and decode (window) length buckets up to the episode length.
    assert max(actor.policy.batch_sizes) <= cfg.actor.envs_per_actor
    buckets = actor.engine.batch_buckets
    batches = [b for b in buckets if b < cfg.actor.envs_per_actor]
    batches.append(next(b for b in buckets if b >= cfg.actor.envs_per_actor))
    lengths = [p for p in actor.engine.prompt_buckets if p < cfg.actor.max_episode_tokens]
    lengths.append(
        next(p for p in actor.engine.prompt_buckets if p >= cfg.actor.max_episode_tokens)
    )
    n = len(lengths)
    assert 1 <= summary["compile_count"] <= len(batches) * (n * (n + 1) // 2 + n)
    # programs are reused: at least two policy calls per compilation
    assert len(actor.policy.batch_sizes) >= 2 * summary["compile_count"]

    # Metrics JSON lines.
    records = read_metrics(store, "actor/actor-e2e")
    assert records and all(r["process"] == "actor/actor-e2e" for r in records)
    final = records[-1]
    assert final["final"] is True and final["episodes"] == summary["episodes"]
    # What it was doing, for the live display (issue #31.5): a record before the first
    # weights, one as the sampler starts compiling, then sampling.
    phases = [r["phase"] for r in records]
    assert phases[:2] == ["waiting for the first weights", "compiling the sampler"], phases
    assert phases[-1] == "stopped" and set(phases[2:-1]) <= {
        "sampling",
        "sampling, first shard not written yet",
    } | {f"compiling the sampler ({n} programs so far)" for n in range(1, 99)}
    for key in (
        "episodes_per_s",
        "tokens_per_s",
        "env_step_p50_s",
        "env_step_p99_s",
        "policy_latency_p50_s",
        "weights_version",
        "reload_s",
    ):
        assert key in final, key
    assert final["episodes_per_s"] > 0 and final["tokens_per_s"] > 0
    assert final["weights_version"] == 0
    assert final["reload_s"] > 0
    assert 0 <= final["env_step_p50_s"] <= final["env_step_p99_s"]
    assert final["policy_latency_p50_s"] > 0
    keys = [i.key for i in store.list("metrics/actor/actor-e2e/")]
    assert keys and all(k.endswith(".jsonl") for k in keys)


@pytest.mark.parametrize("replicas", [1, 2])
def test_actor_reloads_weights_and_refuses_corrupt_snapshot(store_uri, caplog, replicas):
    """Also with two sampler replicas (policy/replicas.py): every replica reloads."""
    cfg = _config(store_uri, sampler_replicas=replicas)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(123, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-w")
    run = _Running(actor)
    run.episodes_at_least(4)

    _publish(store, cfg, _peaky(7, cfg), version=1)
    run.until(lambda: actor.version == 1, "reload of v1")
    n1 = actor.stats.episodes
    run.episodes_at_least(n1 + 3 * cfg.actor.envs_per_actor)  # well past the in-flight ones

    with caplog.at_level(logging.ERROR, logger="tunix_tasks.storage.weights"):
        _publish_corrupt(store, cfg, _peaky(8, cfg), version=2)
        run.until(lambda: 2 in actor.weights.refused, "refusal of the corrupt v2")
        n2 = actor.stats.episodes
        run.episodes_at_least(n2 + 2 * cfg.actor.envs_per_actor)  # keeps running on v1
    assert actor.version == 1 and run.thread.is_alive()
    assert "checksum" in actor.weights.refused[2]
    assert any(
        r.levelno == logging.ERROR and "refusing weights v2" in r.getMessage()
        for r in caplog.records
    )
    mark_done(store, "test finished")
    summary = run.join()

    assert summary["last_version"] == 1
    episodes = _read_episodes(store)
    assert len(episodes) == summary["episodes"]
    versions = [e.policy_version for e in sorted(episodes, key=lambda e: e.created_at)]
    assert set(versions) == {0, 1}
    assert (
        versions[0] == 0 and versions[-cfg.actor.envs_per_actor :] == [1] * cfg.actor.envs_per_actor
    )
    final = read_metrics(store, "actor/actor-w")[-1]
    assert final["weights_version"] == 1 and final["reloads"] == 2
    samplers = getattr(actor.engine, "replicas", [actor.engine])
    assert len(samplers) == replicas and all(s.stats.decode_steps for s in samplers)
    assert {s.version for s in samplers} == {1}


def test_two_threads_polling_at_once_load_a_new_version_once(tmp_path):
    """The engine thread (between batches) and the event loop (group and sync loops)
    both poll; an agent run on SmolLM2 loaded every 514 MB snapshot twice, 0.5 s apart."""
    cfg = _config(f"file://{tmp_path}", weight_poll_s=1e-3)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-p")
    load = actor._load

    def slow_load(flat, manifest):  # both threads are inside the poll at once
        time.sleep(0.3)
        load(flat, manifest)

    actor._load = slow_load
    threads = [threading.Thread(target=actor._maybe_reload) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert actor.version == 0 and actor.stats.reloads == 1


def test_held_weights_move_to_any_newer_version_while_flow_control_pauses(tmp_path):
    """`actor.reload_every_versions=3`: admitted, an actor loads only weights 3 versions
    ahead of its own; paused by flow control, any newer ones (only newer weights make
    room: a learner waiting for data and actors waiting for room waited for each other).
    The learner's side is the real `FlowReport` the learner writes."""
    cfg = _config(f"file://{tmp_path}", weight_poll_s=1e-3, reload_every_versions=3)
    store = write_config(cfg)
    flat = _peaky(1, cfg)
    _publish(store, cfg, flat, version=0)
    actor = Actor(cfg, store, actor_id="actor-k")
    flow = FlowReport(store, every_s=0.0)

    def reload_after(versions: range) -> int:
        for v in versions:
            _publish(store, cfg, flat, version=v)
        time.sleep(0.01)  # past weight_poll_s
        actor._maybe_reload()
        return actor.version

    assert reload_after(range(0)) == 0  # the first weights: whatever LATEST is
    flow.maybe_write(2, consumed={}, consumed_total=0, waited_s=0.0)
    assert reload_after(range(1, 3)) == 0 and actor._admit(in_flight=0)  # 2 ahead: held
    # 40 committed episodes the learner has not read: 40 / 8 versions ahead of it, paused.
    actor.stats.episodes = 40
    assert not actor._admit(in_flight=0)
    assert reload_after(range(0)) == 2  # paused: the newest, however few versions ahead
    flow.maybe_write(2, consumed={actor.gate.actor_key: 40}, consumed_total=40, waited_s=0.0)
    assert reload_after(range(0)) == 2 and actor._admit(in_flight=0)  # all read: admitted
    assert reload_after(range(3, 5)) == 2  # admitted again: 2 ahead is held
    assert reload_after(range(5, 6)) == 5  # 3 ahead is loaded
    assert actor.stats.reloads == 3


def test_env_exceptions_do_not_kill_the_actor(store_uri):
    # shard_interval_s tiny: the watcher's time-based flushes interleave with commits
    # (no episode may be lost or written twice between the two).
    cfg = _config(
        store_uri,
        env={"kwargs": {"fail_mod": 2}},
        group_size=1,
        shard_interval_s=0.01,
    )
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-err")
    run = _Running(actor)
    run.until(
        lambda: (
            actor.stats.status.get("env_error", 0) >= 4 and actor.stats.status.get("ok", 0) >= 4
        ),
        "both failing and healthy episodes",
    )
    run.until(lambda: len(actor.writer.shards_written) >= 3, "time-based shard flushes")
    mark_done(store, "test finished")
    summary = run.join()
    episodes = _read_episodes(store)
    assert len(episodes) == summary["episodes"]
    assert summary["shards"] >= 3
    for e in episodes:
        assert e.status == ("env_error" if e.seed % 2 == 0 else "ok"), (e.seed, e.status)
        if e.status == "env_error":
            assert e.num_turns == 1 and e.reward == 0.0 and e.tokens[-1] == TOK.eos_id


def test_deadline_stops_the_actor_and_flushes(tmp_path):
    cfg = _config(f"file://{tmp_path}", episodes_per_shard=8)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    t0 = time.monotonic()
    summary = Actor(cfg, store, actor_id="actor-d", deadline_s=4.0).run()
    wall = time.monotonic() - t0
    assert summary["stop_reason"] == "deadline"
    assert 4.0 <= wall < 4.0 + 20.0  # + in-flight groups (and cold compiles, run alone)
    assert summary["episodes"] > 0
    episodes = _read_episodes(store)
    assert len(episodes) == summary["episodes"]
    assert summary["shards"] == len(store.list("shards/")) >= 1
    for shard in store.list("shards/"):  # named for this run: the learner checks it
        written = pq.ParquetFile(store.open_input(shard.key)).schema_arrow.metadata
        assert written[RUN_ID_KEY.encode()] == run_id(store).encode() != b""


@pytest.mark.parametrize("how", ["async commits", "sync batches", "stopped for another reason"])
def test_an_actor_whose_run_is_created_again_stops_and_writes_nothing_there(tmp_path, how):
    """A deleted run's leftover actor (a pod, a Celery worker) meets the run created
    again under its URI at its next write, whatever the path: a commit (2 episodes a
    shard), sync mode's batch flush and metrics, or the final flush of a stop for
    another reason. It writes nothing there (no shard, no metrics record) and raises
    `RunReplaced` (the CLI's exit 3: not restarted)."""
    sync = how == "sync batches"
    cfg = config_from_dict(
        {
            **_config(f"file://{tmp_path}", episodes_per_shard=2).model_dump(),
            **(
                {"mode": "sync", "learner": {"advantage": "group", "max_staleness": 0}}
                if sync
                else {}
            ),
        }
    )
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-old")
    _created_again_under(actor, cfg, stop=how == "stopped for another reason")


def _created_again_under(actor: ActorRuntime, cfg: RunConfig, *, stop: bool) -> None:
    """Run `actor` until its first shard, delete its run and create it again (then stop
    the actor, with `stop`); it must raise `RunReplaced` and write nothing there."""
    run = _Running(actor)
    run.until(lambda: len(actor.writer.shards_written) >= 1, "a shard of the first run")
    folder = Path(actor.store.local_path())
    # No commit between a fence's check and its write meanwhile: that window, a write
    # landing in the new run, is what the learner's `other_run` quarantine is for.
    with actor._writer_lock:
        os.rename(folder, f"{folder}-deleted")  # `rm -r`, without racing the actor's writes
        store = write_config(cfg)
    if stop:
        actor.request_stop("SIGTERM")
    again = run_id(store)
    with pytest.raises(RunReplaced, match=f"deleted|created again \\(run_id {again}\\)"):
        run.join()
    assert sorted(i.key for i in store.list("")) == [RunLayout.CONFIG, RunLayout.RUN_ID]
    assert list(Path(f"{folder}-deleted", "shards").rglob("*.parquet"))  # the old run's


def test_a_failed_watch_stops_the_actor_with_its_error(tmp_path, monkeypatch):
    """The DONE check and the timed flushes run in a task nothing awaits while the actor
    samples: its error used to vanish, leaving an actor deaf to DONE until its deadline."""
    cfg = _config(f"file://{tmp_path}")
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-w")

    def broken() -> bool:
        raise RuntimeError("the watch broke")

    monkeypatch.setattr(actor, "_watch_once", broken)
    with pytest.raises(RuntimeError, match="the watch broke"):
        _Running(actor).join()
    assert actor._stop_reason == "failed: RuntimeError('the watch broke')"


def test_stop_while_waiting_for_first_weights(tmp_path):
    """Before any snapshot exists: a stop request, the deadline or DONE end the wait at
    once (no hang until the weights timeout); with none of them, a clear TimeoutError."""
    cfg = _config(f"file://{tmp_path}")
    store = write_config(cfg)

    actor = Actor(cfg, store, actor_id="actor-s")
    threading.Timer(0.5, actor.request_stop, args=("SIGTERM",)).start()
    t0 = time.monotonic()
    summary = actor.run()
    assert summary["stop_reason"] == "SIGTERM" and summary["episodes"] == 0
    assert time.monotonic() - t0 < 5

    summary = Actor(cfg, store, actor_id="actor-s", deadline_s=0.5).run()
    assert summary["stop_reason"] == "deadline" and summary["episodes"] == 0

    with pytest.raises(TimeoutError, match="no weights published"):
        Actor(cfg, store, actor_id="actor-s", weights_timeout_s=0.5).run()

    mark_done(store, "finished early")
    summary = Actor(cfg, store, actor_id="actor-s").run()
    assert summary["stop_reason"].startswith("run done") and summary["episodes"] == 0
    assert not store.list("shards/")


def test_sigterm_subprocess_exits_cleanly_and_flushes(tmp_path, compile_cache):
    cfg = _config(
        f"file://{tmp_path}",
        env={"name": "calculator", "latency_s": 0.05, "max_turns": 2},
        episodes_per_shard=4,
    )
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    script = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from tunix_tasks.frontdoor.entrypoints import run_actor\n"
        "print('SUMMARY ' + json.dumps(run_actor(sys.argv[1], 3)), flush=True)\n"
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": compile_cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", script, cfg.run_uri],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not store.list("shards/"):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no shard from the actor subprocess"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(next(ln for ln in out.splitlines() if ln.startswith("SUMMARY "))[8:])
    assert summary["stop_reason"] == "SIGTERM" and summary["actor_id"] == "actor-0003"
    episodes = _read_episodes(store)
    assert len(episodes) == summary["episodes"] >= 4
    assert summary["shards"] == len(store.list("shards/"))
    assert {e.env for e in episodes} == {"calculator"}


def _episodes_per_s(tmp_path: Path, envs: int, window_s: float) -> float:
    cfg = _config(
        f"file://{tmp_path}/e{envs}",
        env={"latency_s": 0.3, "max_turns": 1, "kwargs": {"turns": 1}},
        envs_per_actor=envs,
        group_size=1,
    )
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    actor = Actor(cfg, store, actor_id=f"actor-c{envs}")
    run = _Running(actor)
    try:
        run.episodes_at_least(2 * envs)  # warm: the first compilations are behind us
        for _ in range(3):  # a window in which a new shape compiled is measured again
            n0, c0, t0 = actor.stats.episodes, actor.engine.compile_count, time.monotonic()
            time.sleep(window_s)
            n1, c1, t1 = actor.stats.episodes, actor.engine.compile_count, time.monotonic()
            if c1 == c0:
                break
    finally:
        actor.request_stop("measured")
        run.join()
    return (n1 - n0) / (t1 - t0)


def test_concurrent_envs_scale_throughput(tmp_path):
    """0.3 s env latency: 16 envs step concurrently, so episodes/s is many times 1 env's."""
    one = _episodes_per_s(tmp_path, 1, window_s=3.0)
    sixteen = _episodes_per_s(tmp_path, 16, window_s=2.0)
    print(f"episodes/s: 1 env {one:.2f}, 16 envs {sixteen:.2f} ({sixteen / one:.1f}x)")
    # ideal: 1 env ~1.6 episodes/s (reset + step = 0.6 s), 16 envs ~16x that
    assert one > 0.5
    assert sixteen > 4 * one, (one, sixteen)


# ------------------------------------------------- snapshots that do not fit (#11)


def _misfits(flat: dict[str, np.ndarray]) -> list[tuple[dict[str, np.ndarray], str]]:
    """Checksum-valid snapshots that do not fit the model, and the reason each is refused."""
    return [
        ({k: v for k, v in flat.items() if k != "unembed"}, "missing keys ['unembed']"),
        ({**flat, "blocks/99/extra": np.zeros(3, np.float32)}, "unexpected keys"),
        ({**flat, "unembed": flat["unembed"][..., :-1]}, "shape mismatches [unembed"),
        ({**flat, "unembed": flat["unembed"].astype(np.float64)}, "dtype mismatches [unembed"),
    ]


def _poison_latest(store: ObjectStore) -> None:
    """CAS a pointer whose version is a path over LATEST (the #11 report)."""
    _, _, generation = read_latest(store)
    store.write_if_generation(RunLayout.LATEST, b'{"version": "../../etc"}', generation)


def test_actor_refuses_snapshots_that_do_not_fit_and_a_poisoned_pointer(store_uri, caplog):
    """A snapshot with a valid checksum but a missing / extra tensor, a wrong shape or a
    wrong dtype is refused and remembered like a checksum failure, before any swap; a
    poisoned LATEST is refused and logged once; the actor keeps v0 throughout and takes
    the next good version. (Before: the actor died in load_flat_params or on the pointer,
    and a float64 snapshot was silently cast and loaded.)"""
    cfg = _config(store_uri)
    store = write_config(cfg)
    _publish(store, cfg, _peaky(123, cfg), version=0)
    actor = Actor(cfg, store, actor_id="actor-fit")
    run = _Running(actor)
    run.episodes_at_least(4)
    good = _peaky(7, cfg)
    misfits = _misfits(good)
    with caplog.at_level(logging.ERROR, logger="tunix_tasks.storage.weights"):
        for version, (flat, why) in enumerate(misfits, start=1):
            _publish(store, cfg, flat, version)
            run.until(lambda v=version: v in actor.weights.refused, f"refusal of v{version}")
            assert why in actor.weights.refused[version], actor.weights.refused[version]
            assert actor.version == 0 and actor.weights.version == 0
        _poison_latest(store)
        run.until(lambda: actor.weights.refused_pointer is not None, "refusal of the pointer")
        t0, n = time.monotonic(), actor.stats.episodes
        run.episodes_at_least(n + 2 * cfg.actor.envs_per_actor)
        run.until(lambda: time.monotonic() - t0 > 1.0, "10 more polls")  # weight_poll_s 0.1
    assert actor.version == 0 and run.thread.is_alive()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("refusing weights pointer" in m for m in messages) == 1, messages
    for version in range(1, len(misfits) + 1):
        assert sum(f"refusing weights v{version}," in m for m in messages) == 1, messages

    _publish(store, cfg, good, version=len(misfits) + 1)  # a learner supersedes the pointer
    run.until(lambda: actor.version == len(misfits) + 1, "reload of the good version")
    mark_done(store, "test finished")
    summary = run.join()
    assert summary["last_version"] == len(misfits) + 1
    assert {e.policy_version for e in _read_episodes(store)} <= {0, len(misfits) + 1}
    assert read_metrics(store, "actor/actor-fit")[-1]["reloads"] == 2


def test_restarted_actor_refuses_a_bad_latest_instead_of_crashing(tmp_path):
    """An actor (re)started on a LATEST that names a snapshot of the wrong shape, or on a
    poisoned pointer, waits for good weights and says why, instead of crashing on every
    restart. (Before: ValueError from load_flat_params / WeightsError at each start.)"""
    cfg = _config(f"file://{tmp_path}")
    store = write_config(cfg)
    _publish(store, cfg, _peaky(1, cfg), version=0)
    wrong_shape, _ = _misfits(_peaky(2, cfg))[2]
    _publish(store, cfg, wrong_shape, version=1)
    for _ in range(2):  # every restart: refused, never a crash
        with pytest.raises(TimeoutError, match=r"refused: v1: .*shape mismatches \[unembed"):
            Actor(cfg, store, actor_id="actor-r", weights_timeout_s=0.5).run()
    _poison_latest(store)
    with pytest.raises(TimeoutError, match=r"refused: .*weights/LATEST is not a valid pointer"):
        Actor(cfg, store, actor_id="actor-r", weights_timeout_s=0.5).run()
    _publish(store, cfg, _peaky(3, cfg), version=2)
    actor = Actor(cfg, store, actor_id="actor-r")
    run = _Running(actor)
    run.until(lambda: actor.version == 2, "the good v2")
    mark_done(store, "test finished")
    assert run.join()["last_version"] == 2


# ---------------------------------------------------------------- supervision (issues #11, #12)


def test_no_episodes_before_the_first_snapshot(tmp_path):
    """Issue #12.11: while the learner warm-starts (no snapshot yet) the actor waits: no
    episode, no shard, no sampler compile. Its first episodes use the first snapshot the
    learner publishes (the post-warm-start weights), so none is born stale."""
    cfg = _config(f"file://{tmp_path}", episodes_per_shard=4)
    store = write_config(cfg)
    actor = Actor(cfg, store, actor_id="actor-w")
    run = _Running(actor)
    try:
        time.sleep(3.0)  # the learner's warm start
        assert actor.stats.episodes == 0 and actor.version == -1
        assert actor.engine.compile_count == 0 and not store.list("shards/")
        _publish(store, cfg, _peaky(1, cfg), version=3)  # e.g. a resumed run's first
        run.episodes_at_least(4)
    finally:
        actor.request_stop("test")
        summary = run.join()
    episodes = _read_episodes(store)
    assert len(episodes) == summary["episodes"] > 0
    assert {e.policy_version for e in episodes} == {3}


def test_store_outage_retries_with_backoff_then_gives_up(tmp_path):
    """`StoreOutage`: a call that must succeed is retried through failures and keeps its
    data; optional calls just report None; only a store call that worked ends an outage
    (not a call that did nothing); past the limit a clear StoreUnavailable."""
    from tunix_tasks.storage.outage import StoreOutage, StoreUnavailable
    from tunix_tasks.storage.store import NotFound, StoreError, open_store

    outage = StoreOutage(limit_s=30.0, backoff_s=(0.01, 0.05))
    calls = []

    def flaky(fail_first: int) -> str:
        calls.append(1)
        if len(calls) <= fail_first:
            raise StoreError("connection refused")
        return "written"

    assert outage.call("shard commit", flaky, 3) == "written" and len(calls) == 4
    assert outage.outages == 1 and outage.failures == 3 and outage.down_s == 0.0
    calls.clear()
    assert outage.tolerate("DONE check", flaky, 1) is None  # failed: try next round
    assert outage.down_s > 0 and outage.tolerate("DONE check", flaky, 1) == "written"
    assert outage.tolerate("metrics", lambda: None) is None and outage.down_s > 0
    store = outage.observe(open_store(f"file://{tmp_path}"))
    assert store.exists("x") is False and outage.down_s == 0.0  # the store answered
    assert outage.tolerate("weights", lambda: (_ for _ in ()).throw(NotFound("gone"))) is None

    stopping = StoreOutage(limit_s=30.0, backoff_s=(0.01, 0.05), should_stop=lambda: True)
    assert stopping.call("shard commit", flaky, 10**6) is None  # a stop ends the retries

    def down() -> None:
        raise StoreError("connection refused")

    short = StoreOutage(limit_s=0.3, backoff_s=(0.01, 0.05))
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"shard commit: object store unreachable"):
        short.call("shard commit", down)
    assert 0.3 <= time.monotonic() - t0 < 5
    deadline = time.monotonic() + 0.2  # a final flush: bounded even if the limit is far
    with pytest.raises(StoreUnavailable):
        StoreOutage(limit_s=3600.0, backoff_s=(0.01, 0.05)).call("final", down, deadline=deadline)


class _WritesDenied:
    """A store whose reads work and whose writes fail (a 403 after an IAM change)."""

    def __init__(self, store: ObjectStore) -> None:
        self._store, self.uri = store, store.uri

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def write_bytes(self, key: str, data) -> None:
        from tunix_tasks.storage.store import StoreError

        raise StoreError("403: write denied")


def test_an_outage_of_writes_alone_reaches_the_actors_limit(tmp_path):
    """The run fence reads `run_id` before each write: that read working must not end the
    outage, or an actor whose writes fail retries its commit forever."""
    from tunix_tasks.storage.outage import StoreUnavailable

    cfg = _config(f"file://{tmp_path}")
    actor = Actor(cfg, _WritesDenied(write_config(cfg)), actor_id="a", store_outage_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="write denied"):
        actor._outage.call("shard commit", actor.store.write_bytes, "shards/x.parquet", b"1")
    assert time.monotonic() - t0 < 10 and actor._outage.outages == 1


@pytest.mark.gcs
def test_actor_rides_out_a_real_store_outage(tmp_path, monkeypatch):
    """Issue #11.8: the gs:// store (a real fake-gcs-server) goes down for many times the
    per-call retry deadline. The actor keeps its episodes, stops producing while blocked,
    writes them once the store is back, and loses or duplicates nothing. With a short
    outage limit it exits with a clear StoreUnavailable instead."""
    from tunix_tasks.storage.outage import StoreUnavailable
    from tunix_tasks.storage.store import RETRY_DEADLINE_ENV
    from tunix_tasks.testing.gcs_outage import OutageGcs

    monkeypatch.setenv(RETRY_DEADLINE_ENV, "1")  # each store call gives up after ~1 s
    with OutageGcs() as gcs:
        cfg = _config(gcs.new_bucket_uri(), episodes_per_shard=4)
        store = write_config(cfg)
        _publish(store, cfg, _peaky(1, cfg), version=0)
        actor = Actor(cfg, store, actor_id="actor-o")
        run = _Running(actor)
        try:
            run.until(lambda: actor.writer.episodes_written >= 4, "a first shard")
            gcs.down()
            t_down, before = time.monotonic(), actor.stats.episodes
            run.until(lambda: actor._outage.down_s > 0, "the outage noticed")
            # Production stops: every group loop blocks on its commit, nothing new piles up.
            last, quiet_since = actor.stats.episodes, time.monotonic()
            while time.monotonic() - quiet_since < 4.0:
                assert time.monotonic() - t_down < 40, "kept producing through the outage"
                if actor.stats.episodes != last:
                    last, quiet_since = actor.stats.episodes, time.monotonic()
                time.sleep(0.1)
            assert last - before <= 2 * cfg.actor.envs_per_actor + cfg.actor.episodes_per_shard
            time.sleep(max(0.0, 8.0 - (time.monotonic() - t_down)))  # >> the retry deadline
            assert run.error is None and run.thread.is_alive()
            written_down = actor.writer.episodes_written
            gcs.up()
            run.until(lambda: actor.writer.episodes_written > written_down + 4, "writes again")
        finally:
            actor.request_stop("test")
            if gcs._proc is None:
                gcs.up()
        summary = run.join()
        assert actor._outage.outages >= 1
        episodes = _read_episodes(store)  # also: no episode written twice
        assert len(episodes) == summary["episodes"] == actor.stats.episodes

        quitter = Actor(cfg, store, actor_id="actor-q", store_outage_s=2.0)
        run = _Running(quitter)
        try:
            run.until(lambda: quitter.writer.episodes_written >= 4, "a first shard")
            gcs.down()
            run.thread.join(timeout=WAIT_S)
            assert not run.thread.is_alive(), "the actor should give up"
        finally:
            quitter.request_stop("test")
            if gcs._proc is None:
                gcs.up()
        assert isinstance(run.error, StoreUnavailable), run.error
        assert "unreachable for" in str(run.error)

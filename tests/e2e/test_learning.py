"""Learning (slow): the trained policy beats the random one and learns to use the tool.

`calculator` (the default task): the random-initialised policy never solves it (reward
0.0 on held-out seeds, measured below in the same test). After the demo's recipe,
shortened (140 supervised warm-start steps + 30 asynchronous RL steps), greedy decoding on
128 held-out seeds must reach a reward of at least 0.30 above it; the same with the
vectorized actor (`actor.kind=vectorized`: JAX calculator and policy in one jitted loop).
Each of these runs is also the end-to-end check of `tunix-tasks train` (file://, 2 actor
processes): the live display, DONE, both actors' shards, reloaded weights, the
exactly-once ledger and the report (`_check_the_run`).

`arithmetic` (the harder task, 2-4 digit operands): in under 90 s the tiny policy does not
learn to copy long numbers reliably (held-out reward 0.00 after this short warm start,
docs/learning.md), but it does learn the protocol: on
held-out questions it calls the calculator first and then answers with an integer, which
the random policy never does.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from flax import nnx

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, play_episode
from tunix_tasks.config import RunConfig
from tunix_tasks.envs import Action, ArithmeticEnv, StepResult
from tunix_tasks.frontdoor.evaluate import evaluate_params, evaluate_snapshot, held_out_seeds
from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.policy.build import build_sampler
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import is_done, read_config
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import load_snapshot, read_latest

pytestmark = pytest.mark.slow
MARGIN = 0.30


def _check_the_run(summary: dict, shown: str, steps: int) -> None:
    """What a finished `tunix-tasks train` run of `steps` steps and 2 actors leaves."""
    store = open_store(summary["run_uri"])
    assert summary["learner_exit_code"] == 0 and summary["actor_exit_codes"] == [0, 0]
    # Not --quiet: stdout is a pipe, so the live display falls back to plain lines read
    # from the learner's metrics records: its last line is the last step.
    lines = [line for line in shown.splitlines() if line.startswith("time ")]
    assert lines and f"step {steps}/{steps}" in lines[-1] and "actors" in lines[-1], shown[-2000:]
    assert summary["last_step"]["step"] == steps
    lag = summary["display"]["lag_s"]
    assert lag["records"] >= steps and lag["max"] < 60, summary["display"]
    assert is_done(store)["reason"].startswith("learner max_steps")
    shards = [i.key for i in store.list("shards/")]
    assert {k.split("/")[1] for k in shards} == {"actor-0000", "actor-0001"}
    assert read_latest(store)[0] >= steps // 2  # publish_every: 2
    actor_versions = [r["weights_version"] for r in read_metrics(store, "actor/")]
    assert max(actor_versions) >= 2, "actors should have reloaded published weights"
    # The ledger accounts each trained/dropped episode once.
    ledger = read_ledger(store)
    ids = [i for e in ledger for i in e["trained"]]
    ids += [i for e in ledger for dropped in e["dropped"].values() for i in dropped]
    assert len(ids) == len(set(ids)) > 0
    report = json.loads(store.read_bytes("report/summary.json"))
    assert report["steps"] == steps
    assert report["reward_first"] is not None and report["reward_last"] is not None
    assert report["compile_count"] <= 2  # one program per bucket
    # One audit (issue #31.2): the report's names a bottleneck from a nonzero supply
    # (episodes over time, start-up excluded), and it is the one train's summary shows.
    audit = report["latency_audit"]
    assert audit["bottleneck"] != "unknown" and audit["actor_supply_eps_per_s"] > 0, audit
    assert summary["latency_audit"] == audit
    assert summary["duty_cycle_steady"] == report["duty_cycle_steady"] is not None
    html = store.read_bytes("report/index.html").decode()
    assert html.count("data:image/png;base64,") >= 5
    assert html.count("<details>") >= 3 and "[model" in html  # what the model wrote


def _train_beats_random(tmp_path, *overrides: str) -> None:
    cmd = [
        sys.executable, "-m", "tunix_tasks.frontdoor.cli", "train", "--json",
        "--config", "configs/demo.yaml",
        "--store", str(tmp_path / "runs"), "--run-name", "learn",
        "--set", "learner.max_steps=30", "--set", "env.latency_s=0",
        "--set", "learner.checkpoint_every=30",
        # Imitation at 1e-3, then a gentler RL step size: 30 RL steps at 1e-3 sometimes
        # undo part of the warm start before they improve on it (seen: 0.26 vs 0.50).
        "--set", "learner.warm_start_learning_rate=1e-3", "--set", "learner.learning_rate=3e-4",
        *(arg for o in overrides for arg in ("--set", o)),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    i = out.stdout.index("\n{") + 1
    summary = json.loads(out.stdout[i:])
    _check_the_run(summary, out.stdout[:i], steps=30)
    run_uri = summary["run_uri"]
    cfg, _ = read_config(run_uri)
    seeds = held_out_seeds(128)
    random_reward = evaluate_params(cfg, None, seeds)["reward_mean"]
    trained = evaluate_snapshot(run_uri, seeds=seeds)
    print(f"random {random_reward:.3f}  trained v{trained['version']} {trained['reward_mean']:.3f}")
    assert trained["reward_mean"] >= random_reward + MARGIN
    # the calculator scores 0 or 1: solved (full marks) and success (> 0) are one figure
    assert trained["solved_rate"] == trained["success_rate"] == trained["reward_mean"]


def test_trained_policy_beats_random(tmp_path):
    _train_beats_random(tmp_path)


def test_vectorized_actor_learns_the_calculator(tmp_path):
    """The same recipe with `actor.kind=vectorized` (JAX calculator and policy in one
    jitted loop), evaluated the same way: on the asynchronous calculator's held-out seeds."""
    _train_beats_random(tmp_path, "actor.kind=vectorized")


class _Recorded(ArithmeticEnv):
    """`arithmetic`, keeping the kind of each step (tool / answer / invalid)."""

    def __init__(self, log: list[list[str]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.kinds: list[str] = []
        log.append(self.kinds)

    async def step(self, action: Action) -> StepResult:
        result = await super().step(action)
        self.kinds.append(result.info["kind"])
        return result


def _step_kinds(cfg: RunConfig, flat: dict | None, seeds: list[int]) -> list[list[str]]:
    """Per held-out episode, the kinds of its steps under greedy decoding."""
    chat, sampler = build_sampler(cfg.model, seed=cfg.seed)
    if flat is not None:
        sampler.update_params(flat, only=nnx.Param)
    log: list[list[str]] = []

    async def play() -> None:
        policy = BatchingPolicy(sampler, max_new_tokens=cfg.actor.max_new_tokens, top_k=1)
        limits = EpisodeLimits.from_config(cfg)
        async with policy:
            envs = [_Recorded(log, **cfg.env.kwargs) for _ in seeds]
            await asyncio.gather(
                *(
                    play_episode(e, policy, seed=s, limits=limits, chat=chat)
                    for e, s in zip(envs, seeds, strict=True)
                )
            )

    asyncio.run(play())
    return log


def test_policy_learns_to_use_the_calculator_on_arithmetic(tmp_path):
    cmd = [
        sys.executable, "-m", "tunix_tasks.frontdoor.cli", "train", "--quiet", "--json",
        "--config", "configs/arithmetic.yaml",
        "--store", str(tmp_path / "runs"), "--run-name", "arith",
        # configs/arithmetic.yaml's task and RL, with a short warm start on smaller
        # batches (256 demonstrations, 150 steps) and 5 synchronous RL steps: ~60 s.
        "--set", "warm_start_steps=150", "--set", "learner.batch_rows=16",
        "--set", "learner.buckets=[128]", "--set", "learner.min_episodes_per_step=32",
        "--set", "mode=sync", "--set", "learner.max_steps=5",
        "--set", "learner.checkpoint_every=5",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run_uri = json.loads(out.stdout[out.stdout.index("\n{") + 1 :])["run_uri"]
    cfg, store = read_config(run_uri)
    seeds = held_out_seeds(64)
    flat, _ = load_snapshot(store, read_latest(store)[0])

    def rates(kinds: list[list[str]]) -> tuple[float, float]:
        """Episodes that call the tool first; that call it, then answer with an integer."""
        first = sum(k[:1] == ["tool"] for k in kinds) / len(kinds)
        return first, sum(k[:2] == ["tool", "answer"] for k in kinds) / len(kinds)

    random_first, random_both = rates(_step_kinds(cfg, None, seeds))
    trained_first, trained_both = rates(_step_kinds(cfg, flat, seeds))
    trained = evaluate_snapshot(run_uri, seeds=held_out_seeds(128))
    print(
        f"tool call first: random {random_first:.2f}, trained {trained_first:.2f}; then an "
        f"integer answer: random {random_both:.2f}, trained {trained_both:.2f}; "
        f"trained reward {trained['reward_mean']:.3f}"
    )
    assert random_first <= 0.05 and random_both <= 0.05
    assert trained_first >= 0.9 and trained_both >= 0.7

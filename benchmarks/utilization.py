"""Learner utilization: asynchronous vs synchronous training with slow environments.

Runs the same training twice in this process's machine, for the same number of learner
steps, with every environment step taking `--latency` seconds (an emulated remote API):

  async: actors keep stepping environments while the learner trains on what is buffered
  sync:  actors generate one batch with the newest weights; the learner waits for it

  vectorized: async, fed by one vectorized actor (`actor.kind=vectorized`: the JAX
         calculator and the policy in one jitted loop, no emulated latency): what the
         learner reaches when supply is not the bottleneck
  limit: right after each run, the learner alone on episodes of that run's lengths (its
         shards' `length` column, so the same packing density), never waiting for data:
         what the learner can do on that load, measured next to the run it normalizes
         rather than once for all of them

and prints side by side, over each run's steady state (`steady_steps`: from where the
learner first waited for data, once the backlog the actors built during the warm start
is trained; the whole run when it never waits; the first step, compilation, never
counts; "steady reached" 0 when fewer than 3 steps were left after it): the learner's duty cycle (the device's time in train steps, launch to result,
over wall time: host work such as packing the next batch is not training; goal: async >=
0.95), real tokens trained per second and that as a fraction of the run's own limit,
learner wall time from first to last step (goal: sync / async >= 5), reward reached, the
fraction of episodes dropped as stale, and the latency audit's verdict.

Where the machine has 2 cores or more, the learner is pinned to core 0 and the actors to
the others (`os.sched_setaffinity`), so the learner's rate is not eaten by the actors.

The vectorized run takes its own number of steps (`--vectorized-steps`): its steps take
~0.2 s against the async runs' seconds, and its steady state starts at its first wait for
data, so 20 steps left it 8 (1.5 s of training), where a single 0.6 s wait put the learner
at 0.71 of its limit (0.57-0.58 in earlier runs); 150 steps give it a window of ~25 s.

    python benchmarks/utilization.py [--steps 30] [--vectorized-steps 150] [--latency 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_tasks.config import load_config
from tunix_tasks.frontdoor.audit import busy_s, learner_steps
from tunix_tasks.frontdoor.entrypoints import prepare_run, run_learner
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.planning import plan_fleet
from tunix_tasks.frontdoor.report import read_records, summarize
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import make_episode

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
LEARNER_CORES = set(CORES[:1])
ACTOR_CORES = set(CORES[1:])


class Pinner(threading.Thread):
    """Pins the processes of a run (found by its URI in /proc/*/cmdline): the learner to
    `LEARNER_CORES`, actors to `ACTOR_CORES`. Does nothing on fewer than 2 cores."""

    def __init__(self, run_uri: str) -> None:
        super().__init__(daemon=True)
        self.path = run_uri.split("://")[-1].rstrip("/")  # file:///x/run and /x/run alike
        self.stopped, self.pinned = threading.Event(), set()

    def run(self) -> None:
        while ACTOR_CORES and not self.stopped.wait(0.5):
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        args = f.read().decode(errors="replace").split("\0")
                    ours = any(a.split("://")[-1].rstrip("/") == self.path for a in args)
                    if pid in self.pinned or not ours:
                        continue
                    if "learner" in args or "actor" in args:
                        cores = LEARNER_CORES if "learner" in args else ACTOR_CORES
                        os.sched_setaffinity(pid, cores)
                        self.pinned.add(pid)
                except OSError:  # gone, or not ours
                    continue


def steady_steps(steps: list[dict]) -> tuple[list[dict], bool]:
    """The learner steps of the steady state, and whether the run reached it. A run whose
    actors fall behind first trains the backlog they built during the warm start and the
    first compiles; its steady state starts where the learner first waited for data
    (its cumulative `wait_s_total` grew by more than half a step). A run that never
    waits is learner-bound throughout: every step but the first (compilation)."""
    for i in range(2, len(steps)):
        waited = steps[i]["wait_s_total"] - steps[i - 1]["wait_s_total"]
        if waited > 0.5 * busy_s(steps[i]):
            return steps[i - 1 :], len(steps) - i >= 3
    return steps[1:], True


def window_rates(steps: list[dict]) -> dict:
    """Real tokens trained per second and the device's duty cycle over `steps` (the time
    from the first step's end to the last's; the steps after the first are inside it)."""
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    if span <= 0:
        return {"tokens/s": None, "duty": None}
    tokens = sum(r["real_tokens"] for r in steps[1:])
    return {"tokens/s": tokens / span, "duty": sum(busy_s(r) for r in steps[1:]) / span}


def learner_limit(root: str, steps: int, run_uri: str, overrides: list[str], name: str) -> dict:
    """The learner alone (pinned to the learner's core) on episodes of the lengths
    `run_uri`'s actors wrote (its shards' `length` column, in order, cycled), in complete
    groups of `group_size`, never waiting for data: what any fleet could get out of it on
    that run's load, measured right after the run."""
    source = open_store(run_uri)
    lengths = [
        n
        for info in source.list("shards/")
        if info.key.endswith(".parquet")
        for n in pq.read_table(source.open_input(info.key), columns=["length"])
        .column("length")
        .to_pylist()
    ]
    cfg = load_config(
        "configs/demo.yaml",
        [*overrides, f"run_name={name}", "warm_start_steps=0", "learner.max_staleness=1000000"],
    )
    uri = prepare_run(cfg)
    writer = ShardWriter(
        open_store(uri), actor_id="actor-0000", max_episodes=cfg.actor.episodes_per_shard
    )
    rng, group = np.random.default_rng(0), cfg.actor.group_size
    # Never short of data: a batch takes as many episodes as its rows can pack.
    per_step = cfg.learner.batch_rows * max(cfg.learner.buckets) // max(8, min(lengths))
    need = (steps + 2) * per_step + 64
    for i in range(need):
        length = max(8, lengths[i % len(lengths)])
        writer.add(make_episode(rng, length=length, group_id=f"g{i // group}"))
    writer.close()
    old = os.sched_getaffinity(0) if ACTOR_CORES else None
    if old:
        os.sched_setaffinity(0, LEARNER_CORES)
    try:
        run_learner(uri, max_steps=steps, handle_signals=False)
    finally:
        if old:
            os.sched_setaffinity(0, old)
    done = learner_steps(read_records(open_store(uri)))
    return window_rates(done[1:]) | {"mean length": _mean_length(done)}


def _mean_length(steps: list[dict]) -> float:
    return sum(r["real_tokens"] for r in steps) / max(1, sum(r["episodes"] for r in steps))


def overrides_for(
    root: str, steps: int, latency: float, actors: int, envs: int, max_staleness: int
) -> list[str]:
    return [
        f"store={root}",
        "model.preset=small",
        "warm_start_steps=100",
        "env.name=calculator",
        "env.kwargs.difficulty=1",
        "env.max_turns=3",
        f"env.latency_s={latency}",
        "env.latency_jitter=0.2",
        f"actor.num_actors={actors}",
        f"actor.envs_per_actor={envs}",
        "actor.episodes_per_shard=16",
        "actor.shard_interval_s=1",
        "actor.max_new_tokens=8",
        "actor.max_episode_tokens=96",
        f"learner.max_steps={steps}",
        "learner.batch_rows=8",
        "learner.buckets=[128]",
        "learner.min_episodes_per_step=16",
        # larger RL rates lose reward after the warm start at this batch size (docs/learning.md)
        "learner.learning_rate=5e-5",
        "learner.warm_start_learning_rate=1e-3",
        "actor.batch_wait_s=0.05",
        f"learner.checkpoint_every={steps}",
        f"learner.max_staleness={max_staleness}",
    ]


def run(mode: str, overrides: list[str]) -> dict:
    overrides = [*overrides, f"run_name={mode}"]
    if mode == "sync":
        overrides.append("mode=sync")  # SyncFlow: staleness 0, one version per batch
    if mode == "vectorized":  # one actor process on the actors' core, 256 rows
        overrides += [
            "actor.kind=vectorized",
            "env.latency_s=0",
            "env.latency_jitter=0",
            "actor.num_actors=1",
            "actor.envs_per_actor=256",
        ]
    cfg = load_config("configs/demo.yaml", overrides)
    pinner = Pinner(f"{cfg.store.rstrip('/')}/{mode}")
    pinner.start()
    try:
        out = train_local(cfg, quiet=True, report=False)
    finally:
        pinner.stopped.set()
    return measure(out["run_uri"], pinned=len(pinner.pinned))


def measure(run_uri: str, *, pinned: int = 0) -> dict:
    s = summarize(open_store(run_uri))
    dropped = sum(s["dropped_total"].values())
    generated = s["trained_episodes_ledger"] + dropped
    steady, reached = steady_steps(learner_steps(read_records(open_store(run_uri))))
    rates = window_rates(steady)
    return {
        "duty (steady)": rates["duty"],
        "tokens/s (steady)": rates["tokens/s"],
        "steady steps": len(steady),
        "steady reached": float(reached),
        "mean length": _mean_length(steady),
        "learner wall s": s["learner_wall_s"],
        "reward first": s["reward_first"],
        "reward last": s["reward_last"],
        "stale dropped": s["dropped_total"].get("stale", 0) / max(1, generated),
        "trained episodes": s["trained_episodes_ledger"],
        "supply/capacity": s["latency_audit"]["supply_over_capacity"],
        "processes pinned": pinned,
        "run_uri": run_uri,
        "audit": s["latency_audit"]["advice"],
    }


def plan_check(run_uri: str, envs_per_actor: int) -> dict:
    """`planning.plan_fleet` fed with what the run measured (env and policy latency,
    turns per episode, learner step time, episodes per step), against what the run's
    actors actually supplied: the planner's error on this machine."""
    audit = summarize(open_store(run_uri))["latency_audit"]
    turns = pq.read_table(f"{run_uri.split('://')[-1]}/shards", columns=["num_turns"])
    plan = plan_fleet(
        env_latency_s=audit["env_step_p50_s"],
        policy_latency_s=audit["policy_latency_p50_s"],
        turns=float(np.mean(turns.column("num_turns").to_numpy())),
        envs_per_actor=envs_per_actor,
        learner_step_s=audit["learner_step_s"],
        episodes_per_step=audit["episodes_per_step"],
    )
    measured = audit["per_actor_eps_per_s"]
    return {
        "per-actor supply, planned eps/s": plan["actor_supply_eps_per_s"],
        "per-actor supply, measured eps/s": measured,
        "planned / measured": plan["actor_supply_eps_per_s"] / measured if measured else None,
        "actors needed, planned": plan["actors_needed"],
        "actors needed, audit": audit["suggest_num_actors"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--vectorized-steps",
        type=int,
        default=150,
        help="the vectorized run's steps: ~0.2 s each, so --steps would leave it a steady "
        "window of a second or two, where one wait for data is a third of it",
    )
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--envs", type=int, default=384)
    p.add_argument(
        "--max-staleness",
        type=int,
        default=16,
        help="async bound; must cover an episode's duration in versions (see docs/architecture.md)",
    )
    p.add_argument("--keep", help="keep the runs under this folder instead of a temp dir")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        results, limits = {}, {}
        for m in ("async", "sync", "vectorized"):  # each run, then the limit on its episodes
            steps = args.vectorized_steps if m == "vectorized" else args.steps
            ov = overrides_for(
                root, steps, args.latency, args.actors, args.envs, args.max_staleness
            )
            results[m] = run(m, ov)
            limits[m] = learner_limit(root, steps, results[m]["run_uri"], ov, f"limit-{m}")
            steady = results[m]["tokens/s (steady)"]
            results[m]["limit tokens/s"] = limits[m]["tokens/s"]
            results[m]["fraction of limit"] = (
                steady / limits[m]["tokens/s"] if steady and limits[m]["tokens/s"] else None
            )
        plan = plan_check(results["async"]["run_uri"], args.envs)
    rows = [r for r in results["async"] if not isinstance(results["async"][r], str)]
    print(
        f"\n{args.steps} learner steps ({args.vectorized_steps} vectorized), env latency "
        f"{args.latency}s/step, {args.actors} actors x {args.envs} envs"
    )
    print(f"{'':<18}" + "".join(f"{m:>12}" for m in results))
    for r in rows:
        values = (results[m][r] for m in results)
        print(
            f"{r:<18}" + "".join(f"{v if v is not None else float('nan'):>12.3f}" for v in values)
        )
    print(
        "limit: the learner alone (core "
        f"{sorted(LEARNER_CORES)}) right after each run, on that run's episodes; steady: "
        "after the warm start's backlog is read; duty: device time (launch to result)"
    )
    for m in results:
        print(f"{m} audit: {results[m]['audit']}")
    ratio = results["sync"]["learner wall s"] / results["async"]["learner wall s"]
    print(f"{'sync/async wall':<18}{ratio:>12.2f}   (goal >= 5)")
    print(
        f"{'async duty':<18}{results['async']['duty (steady)'] or float('nan'):>12.3f}   (goal >= 0.95)"
    )
    vec = results["vectorized"]["fraction of limit"]
    print(f"{'vectorized/limit':<18}{vec or float('nan'):>12.3f}   (goal >= 0.95)")
    for k, v in plan.items():  # docs/scaling.md: the fleet planner checked on this run
        print(f"plan check, {k}: {v if isinstance(v, int) or v is None else round(v, 3)}")
    print(
        json.dumps(
            {
                "results": results,
                "limits": limits,
                "sync_over_async_wall": ratio,
                "plan_check": plan,
            }
        )
    )


if __name__ == "__main__":
    main()

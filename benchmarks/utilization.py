"""Learner utilization: asynchronous vs synchronous training with slow environments.

Runs the same training twice in this process's machine, for the same number of learner
steps, with every environment step taking `--latency` seconds (an emulated remote API):

  async: actors keep stepping environments while the learner trains on what is buffered
  sync:  actors generate one batch with the newest weights; the learner waits for it

and prints side by side: learner duty cycle (time in the train step / wall time, start-up
and compilation excluded; goal: async >= 0.95), learner wall time from first to last step
(goal: sync / async >= 5), real tokens trained per second, reward reached and the
fraction of episodes dropped as stale.

    python benchmarks/utilization.py [--steps 30] [--latency 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_tasks.config import load_config
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.report import summarize
from tunix_tasks.storage.store import open_store


def run(
    mode: str, root: str, steps: int, latency: float, actors: int, envs: int, max_staleness: int
) -> dict:
    overrides = [
        f"store={root}",
        f"run_name={mode}",
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
        "learner.learning_rate=2e-4",
        "learner.warm_start_learning_rate=1e-3",
        "actor.batch_wait_s=0.05",
        f"learner.checkpoint_every={steps}",
        f"learner.max_staleness={max_staleness}",
    ]
    if mode == "sync":
        overrides.append("mode=sync")  # SyncFlow: staleness 0, one version per batch
    cfg = load_config("configs/demo.yaml", overrides)
    out = train_local(cfg, quiet=True, report=False)
    s = summarize(open_store(out["run_uri"]))
    dropped = sum(s["dropped_last_step"].values())
    generated = s["trained_episodes_ledger"] + dropped
    return {
        "duty cycle": s["duty_cycle_steady"],
        "learner wall s": s["learner_wall_s"],
        "tokens/s": s["trained_tokens_per_s"],
        "reward first": s["reward_first"],
        "reward last": s["reward_last"],
        "stale dropped": s["dropped_last_step"].get("stale", 0) / max(1, generated),
        "trained episodes": s["trained_episodes_ledger"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
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
        results = {
            m: run(m, root, args.steps, args.latency, args.actors, args.envs, args.max_staleness)
            for m in ("async", "sync")
        }
    rows = list(results["async"])
    print(
        f"\n{args.steps} learner steps, env latency {args.latency}s/step, {args.actors} actors x {args.envs} envs"
    )
    print(f"{'':<18}{'async':>12}{'sync':>12}")
    for r in rows:
        print(f"{r:<18}{results['async'][r]:>12.3f}{results['sync'][r]:>12.3f}")
    ratio = results["sync"]["learner wall s"] / results["async"]["learner wall s"]
    print(f"{'sync/async wall':<18}{ratio:>12.2f}   (goal >= 5)")
    print(f"{'async duty':<18}{results['async']['duty cycle']:>12.3f}   (goal >= 0.95)")
    print(json.dumps({"results": results, "sync_over_async_wall": ratio}))


if __name__ == "__main__":
    main()

"""Learning under staleness: how much held-out reward each off-policy correction keeps.

One task (`configs/arithmetic.yaml`: 2-4 digit arithmetic with a calculator tool), one
budget (`--steps` RL learner steps), a grid of `learner.max_staleness` {0 = `mode: sync`,
2, 8, 32} x `learner.correction` {none, token_tis, sequence_tis, decoupled_ppo}, `--seeds`
seeds each. Every environment step takes `--latency` seconds (an emulated remote tool), so
the synchronous loop waits for its slowest episode while the asynchronous one does not.

Per seed, one run does the config's supervised warm start (and one synchronous RL step,
whose checkpoint is the fork point); every cell of that seed is a real `train_local` run
that resumes from a copy of that checkpoint (as a learner resumes after a crash), so all
cells of a seed start from the same policy and differ only in their RL phase. The cells
train on smaller batches than the warm start (`--batch-rows` rows of the config's bucket,
~45 episodes; the warm start's large batches are what give it 1024 demonstrations), and
a synchronous version is `--min-episodes` episodes, about one such batch. Per cell:

  reward     greedy reward on `--episodes` held-out seeds after the last step (its
             difference to the synchronous run of the same seed, and the fork point's)
  wall       learner wall time from the end of the first RL step to the end of the last
             (compilation excluded; ratio: cell / sync of the same seed)
  dropped    episodes dropped (stale, ...) / episodes the learner received
  staleness  mean staleness of the trained episodes (versions)

With one seed the table shows single runs; with more, mean ± standard deviation. At
staleness 0 (sync) the data is on-policy, so every correction computes the same update
(importance ratio 1): the sync run is made once per seed and is the baseline of every
ratio. The learning curves (reward of the trained episodes per step, and against learner
wall time) go to `<out>/learning.png`, all numbers to `<out>/learning.json`.

    python benchmarks/learning.py [--seeds 1] [--first-seed 0] [--steps 20]
        [--staleness 0,2,8,32] [--corrections none,token_tis,sequence_tis,decoupled_ppo]
        [--latency 3.0] [--envs 256] [--out bench-out]
    python benchmarks/learning.py --merge a/learning.json b/learning.json --out merged
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import ints, one_of

from tunix_tasks.config import RunConfig, load_config
from tunix_tasks.frontdoor.audit import learner_steps
from tunix_tasks.frontdoor.evaluate import evaluate_snapshot, held_out_seeds
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.report import read_records, summarize
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import open_store

CORRECTIONS = ("none", "token_tis", "sequence_tis", "decoupled_ppo")
STALENESS = (0, 2, 8, 32)
FORK_STEP = 1  # the warm-start run's one synchronous RL step; its checkpoint is copied
# What a cell copies from its seed's warm-start run: the policy and optimizer (checkpoint)
# and the demonstrations `prepare` would otherwise play again. Never the snapshots (the
# resumed learner publishes its own first, so no actor starts on a copied one), nor the
# lease, metrics, shards, ledger or DONE: those are the cell's own.
FORK_KEYS = (RunLayout.CHECKPOINTS, RunLayout.DEMOS)


def local_path(run_uri: str) -> Path:
    return Path(run_uri.removeprefix("file://"))


def warm_run(args: argparse.Namespace, root: str, seed: int) -> tuple[str, dict[str, Any]]:
    """The seed's warm start + one sync RL step, checkpointed: every cell's fork point."""
    cfg = load_config(
        args.config,
        [
            f"store={root}",
            f"run_name=warm-s{seed}",
            f"seed={seed}",
            "mode=sync",
            f"learner.max_steps={FORK_STEP}",
            f"learner.checkpoint_every={FORK_STEP}",
            *args.set,
        ],
    )
    t0 = time.monotonic()
    train_local(cfg, quiet=True, report=False, log_dir=str(Path(root) / "_logs" / cfg.run_name))
    uri = cfg.run_uri
    result = evaluate_snapshot(uri, seeds=held_out_seeds(args.episodes))
    return uri, {"reward": result["reward_mean"], "wall_s": time.monotonic() - t0}


def cell_config(
    args: argparse.Namespace, root: str, seed: int, staleness: int, correction: str
) -> RunConfig:
    mode = ["mode=sync"] if staleness == 0 else ["mode=async", f"learner.max_staleness={staleness}"]
    return load_config(
        args.config,
        [
            f"store={root}",
            f"run_name=s{seed}-st{staleness}-{correction}",
            f"seed={seed}",
            *mode,
            f"learner.correction={correction}",
            f"learner.max_steps={FORK_STEP + args.steps}",
            f"learner.checkpoint_every={FORK_STEP + args.steps}",
            f"env.latency_s={args.latency}",
            "env.latency_jitter=0.5",
            f"actor.envs_per_actor={args.envs}",
            "actor.batch_wait_s=0.1",  # fuller sampler batches while envs wait on latency
            f"learner.batch_rows={args.batch_rows}",
            f"learner.min_episodes_per_step={args.min_episodes}",
            *args.set,
        ],
    )


def fork(base_uri: str, cfg: RunConfig) -> None:
    """Copy the warm-start run's checkpoint and demonstrations into the cell."""
    src, dst = local_path(base_uri), local_path(cfg.run_uri)
    if dst.exists():
        shutil.rmtree(dst)
    for key in FORK_KEYS:
        shutil.copytree(src / key, dst / key)


def measure(run_uri: str, episodes: int) -> dict[str, Any]:
    store = open_store(run_uri)
    s = summarize(store)
    steps = learner_steps(read_records(store))
    dropped = sum(s["dropped_ledger"].values())
    trained = s["trained_episodes_ledger"]
    hist = {int(k): v for k, v in s["staleness_histogram"].items()}
    result = evaluate_snapshot(run_uri, seeds=held_out_seeds(episodes))
    t0 = steps[0]["time"] if steps else 0.0
    return {
        "reward": result["reward_mean"],
        "wall_s": steps[-1]["time"] - t0 if steps else 0.0,
        "dropped_frac": dropped / max(1, dropped + trained),
        "dropped": s["dropped_ledger"],
        "staleness_mean": sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())),
        "steps": len(steps),
        "curve": [(r["step"], r["time"] - t0, r["reward_mean"]) for r in steps],
        "run_uri": run_uri,
    }


def run_grid(args: argparse.Namespace, root: str) -> dict[str, Any]:
    cells = [(0, "none")] if 0 in args.staleness else []
    cells += [(st, c) for st in args.staleness if st > 0 for c in args.corrections]
    out: dict[str, Any] = {"warm": {}, "cells": {}}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        base, out["warm"][seed] = warm_run(args, root, seed)
        print(f"seed {seed}: warm start, held-out reward {out['warm'][seed]['reward']:.3f}")
        for staleness, correction in cells:
            cfg = cell_config(args, root, seed, staleness, correction)
            fork(base, cfg)
            log_dir = str(Path(root) / "_logs" / cfg.run_name)
            train_local(cfg, quiet=True, report=False, log_dir=log_dir)
            m = measure(cfg.run_uri, args.episodes)
            out["cells"].setdefault(f"{staleness}/{correction}", {})[seed] = m
            print(
                f"  staleness {staleness:>2} {correction:<13} reward {m['reward']:.3f}  "
                f"wall {m['wall_s']:6.1f}s  dropped {m['dropped_frac']:.2f}  "
                f"staleness {m['staleness_mean']:.1f}",
                flush=True,
            )
    return out


def _stat(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt.lstrip('+')}}"


def table(out: dict[str, Any]) -> str:
    """Markdown: one row per cell; reward differences and wall ratios against the sync run
    of the same seed."""
    sync = out["cells"].get("0/none", {})
    rows = [
        "| max_staleness | correction | seeds | held-out reward | Δ vs sync | learner wall s "
        "| wall / sync | dropped | mean staleness |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    warm = [w["reward"] for w in out["warm"].values()]
    rows.append(f"| (warm start) | - | {len(warm)} | {_stat(warm, '.3f')} | | | | | |")
    for key, by_seed in out["cells"].items():
        staleness, correction = key.split("/")
        seeds = sorted(by_seed)
        reward = [by_seed[s]["reward"] for s in seeds]
        delta = [by_seed[s]["reward"] - sync[s]["reward"] for s in seeds if s in sync]
        wall = [by_seed[s]["wall_s"] for s in seeds]
        ratio = [by_seed[s]["wall_s"] / sync[s]["wall_s"] for s in seeds if s in sync]
        name = "sync (any: on-policy)" if staleness == "0" else correction
        rows.append(
            f"| {staleness} | {name} | {len(seeds)} | {_stat(reward, '.3f')} | "
            f"{_stat(delta, '+.3f') if staleness != '0' else ''} | {_stat(wall, '.1f')} | "
            f"{_stat(ratio, '.2f') if staleness != '0' else '1'} | "
            f"{_stat([by_seed[s]['dropped_frac'] for s in seeds], '.2f')} | "
            f"{_stat([by_seed[s]['staleness_mean'] for s in seeds], '.1f')} |"
        )
    return "\n".join(rows)


def goals(out: dict[str, Any], staleness: int = 8) -> list[str]:
    """The issue's goal at `staleness`, checked on the means: reward within 0.05 of sync in
    at most a third of its wall time with a correction; without one, visibly worse."""
    sync = out["cells"].get("0/none", {})
    lines = []
    for key, by_seed in out["cells"].items():
        st, correction = key.split("/")
        if int(st) != staleness or not sync:
            continue
        seeds = [s for s in by_seed if s in sync]
        delta = statistics.mean(by_seed[s]["reward"] - sync[s]["reward"] for s in seeds)
        ratio = statistics.mean(by_seed[s]["wall_s"] / sync[s]["wall_s"] for s in seeds)
        met = delta >= -0.05 and ratio <= 1 / 3
        lines.append(
            f"staleness {staleness}, {correction}: Δ reward {delta:+.3f} (goal >= -0.05), "
            f"wall/sync {ratio:.2f} (goal <= 0.33): {'met' if met else 'NOT met'} "
            f"[{len(seeds)} seed(s)]"
        )
    return lines


def plot(out: dict[str, Any], path: Path, smooth: int = 5) -> None:
    """Reward of the trained episodes against learner step (top) and learner wall time
    (bottom), one column per staleness bound, the sync run dashed in each; seed means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bounds = sorted({int(k.split("/")[0]) for k in out["cells"]} - {0}) or [0]
    fig, axes = plt.subplots(2, len(bounds), figsize=(4 * len(bounds), 6.5), squeeze=False)
    colors = dict(zip(CORRECTIONS, ("tab:red", "tab:blue", "tab:green", "tab:purple"), strict=True))

    def series(by_seed: dict[Any, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = min(len(m["curve"]) for m in by_seed.values())
        arr = np.asarray([m["curve"][:n] for m in by_seed.values()], float)  # seed, step, 3
        kernel = np.ones(min(smooth, n)) / min(smooth, n)
        reward = np.convolve(arr[:, :, 2].mean(0), kernel, mode="valid")
        k = len(reward)
        return arr[0, -k:, 0], arr[:, -k:, 1].mean(0), reward

    for col, bound in enumerate(bounds):
        for key, by_seed in out["cells"].items():
            st, correction = key.split("/")
            if int(st) not in (0, bound) or not by_seed:
                continue
            step, wall, reward = series(by_seed)
            style = (
                {"color": "black", "ls": "--", "label": "sync"}
                if st == "0"
                else {"color": colors[correction], "label": correction}
            )
            axes[0][col].plot(step, reward, **style)
            axes[1][col].plot(wall, reward, **style)
        axes[0][col].set_title(f"max_staleness {bound}" if bound else "sync")
        axes[0][col].set_xlabel("learner step")
        axes[1][col].set_xlabel("learner wall time (s)")
    for row in axes:
        row[0].set_ylabel(f"train reward ({smooth}-step mean)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[str]) -> dict[str, Any]:
    """Results of earlier runs (their learning.json), combined seed by seed."""
    out: dict[str, Any] = {"warm": {}, "cells": {}, "total_s": 0.0, "merged": paths}
    for path in paths:
        done = json.loads(Path(path).read_text())
        out["warm"].update({int(k): v for k, v in done["warm"].items()})
        for key, by_seed in done["cells"].items():
            out["cells"].setdefault(key, {}).update({int(k): v for k, v in by_seed.items()})
        out["total_s"] += done["total_s"]
        out["args"] = done["args"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--seeds", type=int, default=1, help="how many seeds")
    p.add_argument("--first-seed", type=int, default=0, help="seeds K..K+N-1")
    p.add_argument("--steps", type=int, default=20, help="RL learner steps of every cell")
    p.add_argument("--staleness", type=ints, default=list(STALENESS), help="e.g. 0,8")
    p.add_argument("--corrections", type=one_of(CORRECTIONS), default=list(CORRECTIONS))
    p.add_argument("--latency", type=float, default=3.0, help="seconds per env step")
    p.add_argument("--envs", type=int, default=256, help="environments per actor")
    p.add_argument("--batch-rows", type=int, default=8, help="RL batch rows of the cells")
    p.add_argument("--min-episodes", type=int, default=40, help="RL episodes per step")
    p.add_argument("--episodes", type=int, default=128, help="held-out evaluation seeds")
    p.add_argument("--set", action="append", default=[], help="extra config override")
    p.add_argument("--out", default="bench-out", help="folder for learning.png/.json")
    p.add_argument("--keep", help="keep the runs under this folder instead of a temp dir")
    p.add_argument("--merge", nargs="+", help="no runs: combine earlier learning.json files")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.merge:
        out = merge(args.merge)
    else:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            out = run_grid(args, args.keep or tmp)
        out["args"] = {k: v for k, v in vars(args).items()}
        out["total_s"] = time.monotonic() - t0
    a = out["args"]
    print(
        f"\n{a['steps']} RL steps per cell after a shared warm start, seeds "
        f"{sorted(out['warm'])}, env latency {a['latency']}s/step, {a['envs']} envs; "
        f"{out['total_s'] / 60:.1f} min of runs"
    )
    print(table(out))
    for line in goals(out):
        print(line)
    plot(out, Path(args.out) / "learning.png")
    (Path(args.out) / "learning.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"curves: {Path(args.out) / 'learning.png'}; numbers: {Path(args.out) / 'learning.json'}")


if __name__ == "__main__":
    main()

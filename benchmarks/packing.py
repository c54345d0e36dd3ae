"""Packing benchmark: pad-to-max vs buckets vs buckets + packing, with real train steps.

On a realistic episode-length distribution (log-normal over 16..2048 tokens,
`tunix_tasks.testing.shard_factory.realistic_lengths`) and buckets (256, 512, 1024, 2048),
compares

  (a) pad_to_max      one episode per row, every row padded to 2048
  (b) bucket_no_pack  one episode per row, padded to its smallest fitting bucket
  (c) pack            first-fit-decreasing packing into the buckets (what the learner does)

and prints, per strategy: real-token density of the batches, XLA compilations of the RL
step over the run (`Trainer.compile_count`), and real tokens/s of actual training steps
of a small model (default d_model 64, 2 layers; `--d-model` to change) on this machine.

Throughput: each strategy trains a fixed number of steps on batches of its plan, in the
same run: per distinct batch shape one warm-up step (the compilation, untimed) and
`--reps` timed steps, interleaved across the strategies. The whole plan's training time is estimated as the sum, over its
batches, of the median step time of the batch's shape; tokens/s = real tokens of the plan
/ that time. (Timing every batch of pad-to-max would take far longer than the others.)
Goal: density >= 0.95 and compilations <= number of buckets for (c).

    python benchmarks/packing.py [--episodes 1000] [--rows 4] [--reps 5] [--d-model 64]

Caveat: attention here is dense over the whole row ([T, T] scores, segments masked), so a
packed 2048-token row pays 2048^2 attention however short its episodes are. With a narrow
model on CPU that quadratic term dominates a step, and packing into long rows can lose to
bucketing without packing despite far fewer padded tokens; with a wider model the linear
layers dominate and density wins. Run with `--d-model 256` to see the other side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from tunix_tasks.config import config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import (
    PackResult,
    bucket_no_pack,
    pack,
    pad_to_max,
)
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.build import build_policy
from tunix_tasks.testing.shard_factory import make_episode, realistic_lengths

BUCKETS = (256, 512, 1024, 2048)
STRATEGIES = {"pad_to_max": pad_to_max, "bucket_no_pack": bucket_no_pack, "pack": pack}


def make_examples(n: int, seed: int) -> list[Episode]:
    rng = np.random.default_rng(seed)
    out = []
    for i, length in enumerate(realistic_lengths(rng, n)):
        e = make_episode(rng, length=int(length))
        out.append(
            Episode(
                f"e{i}", e.tokens, e.loss_mask, e.behavior_logprobs, advantage=float(rng.normal())
            )
        )
    return out


class Plan:
    """One strategy's batches, its own Trainer, and its step times per batch shape."""

    def __init__(self, name: str, result: PackResult, cfg) -> None:
        self.name = name
        self.result = result
        _, model = build_policy(cfg.model, seed=cfg.seed)
        self.trainer = Trainer(cfg, model)
        self.by_shape: dict[tuple[int, int], list] = {}
        for b in result.batches:
            self.by_shape.setdefault(b.shape, []).append(b)
        self.times: dict[tuple[int, int], list[float]] = {s: [] for s in self.by_shape}
        self.steps = 0

    def warm_up(self) -> None:
        for batches in self.by_shape.values():
            self.trainer.step(batches[0])  # compiles this shape (untimed)
            self.steps += 1

    def timed_round(self, k: int) -> None:
        for shape, batches in self.by_shape.items():
            batch = batches[(k + 1) % len(batches)]
            t0 = time.perf_counter()
            self.trainer.step(batch)
            self.times[shape].append(time.perf_counter() - t0)
            self.steps += 1

    def summary(self) -> dict:
        step_s = {s: statistics.median(t) for s, t in self.times.items()}
        plan_s = sum(step_s[b.shape] for b in self.result.batches)
        stats = self.result.stats
        return {
            "density": stats.density,
            "compiles": self.trainer.compile_count,
            "batches": len(self.result.batches),
            "packed": stats.num_packed,
            "real_tokens": stats.real_tokens,
            "plan_s": plan_s,
            "tokens_per_s": stats.real_tokens / plan_s,
            "steps_run": self.steps,
            "per_bucket": stats.batches_per_bucket,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=4, help="batch_rows for every strategy")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per batch shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-model", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    cfg = config_from_dict(
        {
            "model": {
                "preset": "custom",
                "d_model": args.d_model,
                "n_layers": args.layers,
                "n_heads": 4,
                "d_ff": 2 * args.d_model,
                "max_seq_len": max(BUCKETS),
            },
            "learner": {"buckets": list(BUCKETS), "batch_rows": args.rows},
        }
    )
    examples = make_examples(args.episodes, args.seed)
    lengths = np.array([e.length for e in examples])
    print(
        f"{len(examples)} episodes, lengths {lengths.min()}..{lengths.max()} "
        f"(median {int(np.median(lengths))}, mean {lengths.mean():.0f}), "
        f"{lengths.sum()} tokens; buckets {BUCKETS}; batch_rows {args.rows}; "
        f"model d_model={args.d_model} x {args.layers} layers"
    )
    t_all = time.perf_counter()
    plans = []
    for name, fn in STRATEGIES.items():
        t0 = time.perf_counter()
        result = fn(examples, buckets=BUCKETS, batch_rows=args.rows)
        pack_ms = (time.perf_counter() - t0) * 1e3
        plan = Plan(name, result, cfg)
        plan.pack_ms = pack_ms
        plan.warm_up()
        plans.append(plan)
        print(f"  {name}: planned + compiled in {time.perf_counter() - t0:.0f}s", flush=True)
    # Timed rounds interleave the strategies, so load from other processes on a shared
    # machine hits all of them alike; the median per shape is used.
    for k in range(args.reps):
        for plan in plans:
            plan.timed_round(k)
    rows = {p.name: {**p.summary(), "pack_ms": p.pack_ms} for p in plans}

    header = (
        f"{'strategy':<16}{'density':>9}{'compiles':>10}{'batches':>9}{'episodes':>10}"
        f"{'real tok':>10}{'plan s':>9}{'real tok/s':>12}{'pack ms':>9}  batches per bucket"
    )
    print()
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:<16}{r['density']:>9.3f}{r['compiles']:>10d}{r['batches']:>9d}"
            f"{r['packed']:>10d}{r['real_tokens']:>10d}{r['plan_s']:>9.1f}"
            f"{r['tokens_per_s']:>12.0f}{r['pack_ms']:>9.0f}  {r['per_bucket']}"
        )
    c = rows["pack"]
    print()
    print(
        f"pack vs pad_to_max: {c['tokens_per_s'] / rows['pad_to_max']['tokens_per_s']:.2f}x "
        f"tokens/s; pack vs bucket_no_pack: "
        f"{c['tokens_per_s'] / rows['bucket_no_pack']['tokens_per_s']:.2f}x tokens/s"
    )
    ok_density = c["density"] >= 0.95
    ok_compiles = c["compiles"] <= len(BUCKETS)
    print(
        f"goal density >= 0.95: {'OK' if ok_density else 'MISSED'} ({c['density']:.3f}); "
        f"compilations <= {len(BUCKETS)}: {'OK' if ok_compiles else 'MISSED'} "
        f"({c['compiles']}); total {time.perf_counter() - t_all:.0f}s"
    )


if __name__ == "__main__":
    main()

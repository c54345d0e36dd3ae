"""The sampler engine and the train step against this machine's roofline.

Measures, in one run on the machine at hand (figures are medians of `--repeats` timed
samples, interleaved across the configurations of a table so that load from other
processes hits all of them alike; "iqr" is the interquartile range / median):

  0. limits   matmul FLOP/s (a jitted 2048^3 matmul in the compute dtype), DRAM read
              bandwidth (a jitted sum over 256 MB of float32; with several local devices,
              as `--replicas` > 1 makes on a CPU, also one such sum per device at once, and
              the DRAM limit is the better of the two: the machine's, not one core's) and,
              on a CPU, the read bandwidth of the last-level cache (LLC: a quarter of it
              read 32 times in one program), at the start and at the end; the best sample
              is the limit (on a shared machine a slower one is contention).
  1. decode   `Sampler.step()` while every row is decoding: B requests are submitted with
              `stop_ids=()` and a budget that ends exactly after the timed segments; one
              `step()` (the admission prefill + one segment) is untimed, then K further
              `step()` calls (K segments of `segment_steps` tokens per row) are timed:
              tokens/s = B x K x segment_steps / wall. The prompt is chosen so that every
              timed segment attends over the same cache window W (the bucket
              `Sampler.decode_window`: the smallest prompt bucket >= the live
              positions + segment_steps + 1). Two tables: tokens/s against the batch at a
              fixed window (`--batches`, `--window`), and against the window at a fixed
              batch (`--windows`, `--window-batch`). "draw ms" is one `decoding.draw` over
              [B, V] logits alone (sampling logits, the inverse-CDF draw and the drawn
              token's log-prob, as a segment runs them, in a loop in one program), "draw %"
              its share of the measured step. "lane copies" counts the rows the timed
              segments copied into the decode working set (0: every row kept its lane).
              `--replicas 1 2` repeats the batch table with the batch split over that many
              sampler replicas, one per CPU device (`actor.sampler_replicas`; "rep"); the
              roofline still counts the weights once, though each replica reads its copy.
  2. prefill  `step()` on B requests of P tokens with `max_new_tokens=1` (each row is done
              at its prefill, so the step is the one admission prefill call): prompt
              tokens/s = B x P / wall (`--prefill-batches` x `--prefill-lens`).
  3. reuse    a 3-turn episode per row (`--reuse-episodes` rows): 128 context tokens,
              16 new tokens per turn, a 16-token environment reply, with a `session` (the
              slot's cache is reused) or without (every turn re-prefills everything). Per
              turn: prefill tokens (`sampler.stats.prefill_tokens` delta), prefill time
              (the admission alone: `Sampler.admit()`) and the whole turn's time.
  4. train    one `Trainer.step` on a fully packed [--train-rows, --train-len] batch (four
              episodes per row), one row per `--attention-block` value (0: dense; samples
              interleaved): tokens/s, the first step's time (trace + compile), the compiled
              step's memory analysis (XLA's temp / argument sizes) and, in a fresh
              subprocess, the peak RSS growth of one step (high-water mark reset after the
              compile). For scale, next to them: what a [rows, T, V] float32 logits tensor
              would take (the learner scores `learner.logits_chunk` positions at a time, so
              it never holds one) and one layer's [rows, H, T, T] float32 attention scores
              (dense attention keeps them, per layer, for the backward pass unless
              `--remat`; blockwise attention never holds them).

Rooflines: benchmarks/_rooflines.py (`tunix_tasks.policy.costs`'s counts over the
measured limits; "bound": the one that binds, LLC or DRAM bandwidth, or FLOPs).
"of limit" is achieved / limit (1.0 = at the roofline). The host loop between segments
(building the rows' arrays, the device_get of every segment's tokens), sampling (softmax /
categorical over the vocabulary), RoPE and norms are not in the limits: they are what the
gap is made of on a small model.

    python benchmarks/sampler.py                       # "small" preset, ~2 min (make bench)
    python benchmarks/sampler.py --shape mid           # d_model 512, 8 layers, vocab 32k
    python benchmarks/sampler.py --batches 1 4 16 64 256 --windows 64 128 256 512 1024
    python benchmarks/sampler.py --train-len 2048 --vocab 32768   # the train-memory target
    python benchmarks/sampler.py --json                # + raw numbers (every sample)

Reading it: "vs B=1" / "vs W=.." is the achieved ratio against the table's first row and
"ideal" the ratio of the rooflines (near B for a weight-read-bound batch): decode should
track it, i.e. sit at a steady fraction of the limit; a fraction that falls with the window
means the K/V read costs more than its bytes, one that falls with the batch means per-row
work the roofline does not count (sampling over the vocabulary, the host loop). "compiles during timing" must be 0
(programs are compiled once per shape, never per call). Turns 2 and 3 with reuse should
prefill ~17 tokens (the reply + the last drawn token) instead of the whole episode. The
progress log (stderr) carries elapsed seconds; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_tasks.policy import costs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.replicas import sampler_devices

from _machine import iqr, llc_bytes, machine_limits, measure_limits, med
from _rooflines import Roofline
from _sampler_cases import (
    SHAPES,
    decode_cases,
    make_spec,
    prefill_results,
    run_decode,
    run_prefill,
    run_reuse,
)
from _sampler_report import print_tables
from _train_cases import run_train, run_train_rss, train_child

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["small", *SHAPES], default="small")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (0: the shape's)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=8, help="timed samples per configuration")
    p.add_argument("--segment-steps", type=int, default=16)
    p.add_argument("--segments", type=int, default=4, help="timed segments per decode sample")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1],
        help="decode-vs-batch rows for each count of sampler replicas (one per CPU device: "
        "actor.sampler_replicas); the batch is split among them",
    )
    p.add_argument("--window", type=int, default=256, help="cache window of the batch table")
    p.add_argument("--windows", type=int, nargs="*", default=[64, 256, 1024])
    p.add_argument("--window-batch", type=int, default=4)
    p.add_argument("--prefill-batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[64, 256])
    p.add_argument("--reuse-episodes", type=int, default=4, help="0 skips the reuse table")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--reuse-context", type=int, default=128)
    p.add_argument("--reuse-new", type=int, default=16)
    p.add_argument("--reuse-reply", type=int, default=16)
    p.add_argument("--train-len", type=int, default=512, help="0 skips the train step")
    p.add_argument("--train-rows", type=int, default=4)
    p.add_argument("--remat", action="store_true", help="learner.remat=true")
    p.add_argument(
        "--logits-chunk", type=int, default=-1, help="learner.logits_chunk (-1: default)"
    )
    p.add_argument(
        "--attention-block",
        type=int,
        nargs="+",
        default=[-1],
        help="learner.attention_block, one train case each (-1: the default; 0: dense)",
    )
    p.add_argument("--scan-layers", action="store_true", help="learner.scan_layers=true")
    p.add_argument(
        "--train-layers", type=int, default=0, help="the train step's depth (0: the shape's)"
    )
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocess")
    p.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    p.add_argument("--train-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    if args.train_child:
        train_child(args)
        return
    if max(args.replicas) > 1:
        sampler_devices(max(args.replicas))  # CPU devices: before JAX starts
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    res: dict[str, Any] = {"args": vars(args), "cores": cores, "device": str(jax.devices()[0])}
    log(f"limits ({jax.devices()[0].platform}, {cores} cores)")
    llc = llc_bytes()
    limit_samples = measure_limits(args.compute_dtype, args.repeats, llc)

    dtype = jnp.dtype(args.compute_dtype)
    spec = make_spec(args, max([args.window, *args.windows, 512]))
    model = Transformer(spec, rngs=nnx.Rngs(0), compute_dtype=dtype)
    res["spec"], res["params"] = dataclasses.asdict(spec), costs.total_params(spec)
    compiles = 0
    decode_sets = decode_cases(model, args)
    for name, cases in decode_sets.items():
        log(f"{name}: {len(cases)} cases x {args.repeats} repeats (compiles first)")
        compiles += run_decode(cases, args.repeats, seed=len(name))
    prefill = None
    if args.prefill_batches and args.prefill_lens:
        log("prefill")
        sp, times, n = run_prefill(model, args, seed=4)
        prefill, compiles = (sp, times), compiles + n
    if args.reuse_episodes:
        log("multi-turn reuse")
        res["reuse"], n = run_reuse(model, args, seed=3)
        compiles += n
    if args.train_len:
        log(f"train step [{args.train_rows}, {args.train_len}]")
        res["train"] = run_train(args)
        compiles += sum(r["compiles_during_timing"] for r in res["train"])
        for r in [] if args.no_rss else res["train"]:
            log(f"train step peak RSS (subprocess), attention_block {r['attention_block']}")
            argv = [*sys.argv[1:], "--attention-block", str(r["attention_block"])]
            r["rss"] = run_train_rss(__file__, argv)
    log("limits again")
    for k, v in measure_limits(args.compute_dtype, args.repeats, llc).items():
        limit_samples[k] += v
    lim = machine_limits(limit_samples, llc)
    res["limits"], res["limit_samples"] = lim, limit_samples
    res["limit_median"] = {k: med(v) for k, v in limit_samples.items()}
    res["limit_iqr"] = {k: iqr(v) for k, v in limit_samples.items()}
    roof = Roofline(spec, dtype.itemsize)
    for name, cases in decode_sets.items():
        res[name] = [c.result(roof, lim) for c in cases]
    if prefill:
        res["prefill"] = prefill_results(*prefill, roof, lim)
    for t in res.get("train", []):
        t.update(Roofline(t.pop("spec"), dtype.itemsize).train(t["rows"], t["length"], lim))
        t["of_limit"] = t["tokens_per_s"] / t["limit"]
    res["compiles_during_timing"] = compiles
    print_tables(res, args)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    log("done")


if __name__ == "__main__":
    main()

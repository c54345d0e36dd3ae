"""The train-step case of benchmarks/sampler.py: one `Trainer.step` on a fully packed
batch per `--attention-block`, its speed, XLA's memory analysis of the compiled step
(`Trainer.lower_step`) and, in a fresh subprocess, the peak RSS growth of one step.

    rows = run_train(args)                          # timed, samples interleaved
    batch = full_batch(vocab, rows=4, length=512)   # what every case trains on
    rows[0]["rss"] = run_train_rss(script, argv)    # the script re-run with --train-child
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.config import config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import PackedBatch, pack
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy import costs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.spec import DecoderSpec

from _machine import iqr, med, peak, reset_peak, rss, trim
from _sampler_cases import make_spec


def train_setup(args, attention_block: int = -1) -> tuple[DecoderSpec, Trainer, PackedBatch]:
    """A Trainer on a fresh model and one fully packed [rows, T] batch
    (`attention_block` -1: the config's default)."""
    spec = make_spec(args, max(args.train_len, 256))
    if args.train_layers:
        spec = dataclasses.replace(spec, n_layers=args.train_layers)
    model = Transformer(spec, rngs=nnx.Rngs(1), compute_dtype=jnp.dtype(args.compute_dtype))
    cfg = config_from_dict(
        {
            "model": {
                "preset": "custom",
                "d_model": spec.d_model,
                "n_layers": spec.n_layers,
                "n_heads": spec.n_heads,
                "d_ff": spec.d_ff,
                "max_seq_len": spec.max_seq_len,
            },
            "learner": {
                "buckets": [args.train_len],
                "batch_rows": args.train_rows,
                "compute_dtype": args.compute_dtype,
                **({"remat": True} if args.remat else {}),
                **({"logits_chunk": args.logits_chunk} if args.logits_chunk >= 0 else {}),
                **({"attention_block": attention_block} if attention_block >= 0 else {}),
                **({"scan_layers": True} if args.scan_layers else {}),
            },
        }
    )
    return spec, Trainer(cfg, model), full_batch(spec.vocab_size, args.train_rows, args.train_len)


def full_batch(vocab: int, rows: int, length: int) -> PackedBatch:
    """A fully packed [rows, length] batch: four random episodes of length/4 per row, the
    second half of each the policy's (behaviour log-prob: uniform over `vocab`)."""
    rng = np.random.default_rng(0)
    episodes = []
    quarter = length // 4
    for r in range(4 * rows):  # four episodes of T/4 fill each row exactly
        mask = np.zeros(quarter, np.int8)
        mask[quarter // 2 :] = 1  # the second half is the policy's
        episodes.append(
            Episode(
                f"e{r}",
                rng.integers(8, vocab, quarter).astype(np.int32),
                mask,
                np.where(mask == 1, -math.log(vocab), 0.0).astype(np.float32),
                advantage=float(rng.normal()),
            )
        )
    return pack(episodes, buckets=(length,), batch_rows=rows, flush=True).batches[0]


def run_train(args) -> list[dict[str, Any]]:
    """Timed `Trainer.step`s, one case per `--attention-block`, samples interleaved
    (results before the limits: `train_results`)."""
    cases = []
    for block in args.attention_block:
        spec, trainer, batch = train_setup(args, block)
        t0 = time.perf_counter()
        trainer.step(batch)  # trace + compile
        cases.append((spec, trainer, batch, time.perf_counter() - t0, trainer.compile_count))
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.repeats):
        for (_, trainer, batch, *_), samples in zip(cases, times, strict=True):
            t0 = time.perf_counter()
            trainer.step(batch)
            samples.append(time.perf_counter() - t0)
    return [_train_case(args, *case, samples) for case, samples in zip(cases, times, strict=True)]


def _train_case(args, spec, trainer, batch, compile_s, compiles, times) -> dict[str, Any]:
    """One case's figures before the limits (`Roofline.train` adds those)."""
    params = costs.total_params(spec)
    n = batch.tokens.size
    tps = [n / t for t in times]
    learner = trainer.cfg.learner
    r: dict[str, Any] = {
        "spec": spec,
        "params": params,
        "rows": args.train_rows,
        "length": args.train_len,
        "layers": spec.n_layers,
        "density": batch.density,
        "tokens_per_s": med(tps),
        "iqr": iqr(tps),
        "step_s": med(times),
        "first_step_s": compile_s,
        "samples_tokens_per_s": tps,
        "compiles_during_timing": trainer.compile_count - compiles,
        "logits_bytes": 4.0 * n * spec.vocab_size,
        "scores_bytes": 4.0 * args.train_rows * spec.n_heads * args.train_len**2,
        "remat": learner.remat,
        "logits_chunk": learner.logits_chunk,
        "attention_block": learner.attention_block,
        "scan_layers": learner.scan_layers,
        "param_bytes": 4.0 * params,
    }
    try:  # XLA's own accounting of the compiled step (lowering traces it once more)
        ma = trainer.lower_step(batch).compile().memory_analysis()
        r["xla_temp_bytes"] = float(ma.temp_size_in_bytes)
        r["xla_argument_bytes"] = float(ma.argument_size_in_bytes)
        r["xla_output_bytes"] = float(ma.output_size_in_bytes)
    except Exception as err:  # memory analysis is backend-dependent
        r["xla_error"] = f"{type(err).__name__}: {err}"
    return r


def train_child(args) -> None:
    """Subprocess: the peak RSS growth of one train step after its compile."""
    _, trainer, batch = train_setup(args, args.attention_block[0])
    trainer.step(batch)
    trim()
    ok = reset_peak()
    before = rss()
    trainer.step(batch)
    print(json.dumps({"rss_before": before, "peak_growth": peak() - before, "reset": ok}))


def run_train_rss(script: str, argv: list[str]) -> dict[str, Any]:
    """`train_child` in a fresh process: `script` run with `argv` and `--train-child`."""
    proc = subprocess.run(
        [sys.executable, script, *argv, "--train-child"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])

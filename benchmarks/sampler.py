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
              `Sampler._decode_active` picks: the smallest prompt bucket >= the live
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
              (the admission alone: `Sampler._admit()`) and the whole turn's time.
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

Rooflines (counts: `tunix_tasks.policy.costs`; L layers, d d_model, H / KV heads of size
hd, f d_ff, V vocab, B rows, W the attended window; P_mm = L*(2*d*H*hd + 2*d*KV*hd +
3*d*f) + d*V the matmul params per token):
  decode step   bytes = params read once (in the compute dtype, as the sampler holds them;
                        of an untied embedding table only the B gathered rows)
                        + K/V read 2*L*KV*hd*W*B*itemsize
                        + logits written and read 2*4*B*V
                FLOPs = B*(2*P_mm + 4*L*H*hd*W)  (attention over the whole window: the
                        program computes it, masked)
                limit tokens/s = B / max(bytes / bandwidth, FLOPs / FLOP/s), where the
                bandwidth is the LLC's when bytes fit in half the LLC (weights and cache
                then stay resident between steps: "bound LLC"), else DRAM's ("of DRAM lim"
                is the ratio against the DRAM roofline whatever the working set)
  prefill       FLOPs = 2*(P_mm - d*V)*B*P + 2*d*V*B (logits only at each row's last
                token) + 4*L*H*hd*B*P*W; bytes = params + K/V written; limit = B*P / max
  train step    FLOPs = 3 x forward = B*T*(6*P_mm + 12*L*H*hd*T) (dense T x T attention;
                blockwise attention skips the tiles no query needs, so does fewer)
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
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.config import ModelConfig, config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy import costs, decoding
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.replicas import SamplerReplicas, replicate, sampler_devices
from tunix_tasks.policy.sampling import DEFAULT_BATCH_BUCKETS, DEFAULT_PROMPT_BUCKETS, Sampler
from tunix_tasks.policy.spec import DecoderSpec, spec_from_preset
from tunix_tasks.policy.tokenizer import CharTokenizer

from _machine import (
    iqr,
    llc_bytes,
    machine_limits,
    measure_limits,
    med,
    peak,
    reset_peak,
    rss,
    trim,
)

GB = 1e9
SHAPES: dict[str, dict[str, int]] = {
    "mid": {"d_model": 512, "n_layers": 8, "n_heads": 8, "d_ff": 2048, "vocab": 32768},
}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ helpers


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


# ------------------------------------------------------------------------------ model


def make_spec(args, max_seq_len: int) -> DecoderSpec:
    if args.shape == "small":
        vocab = args.vocab or CharTokenizer().vocab_size
        spec = spec_from_preset(ModelConfig(preset="small"), vocab_size=vocab)
        return dataclasses.replace(spec, max_seq_len=max_seq_len)
    s = SHAPES[args.shape]
    return DecoderSpec(
        family="char",
        vocab_size=args.vocab or s["vocab"],
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_heads"],
        head_dim=s["d_model"] // s["n_heads"],
        d_ff=s["d_ff"],
        max_seq_len=max_seq_len,
    )


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The limits of one spec on this machine's measured rates (module docstring); the
    counts are `tunix_tasks.policy.costs`."""

    spec: DecoderSpec
    itemsize: int  # bytes per param and K/V element: the compute dtype, as the sampler holds them

    @staticmethod
    def bandwidth(nbytes: float, lim: dict) -> tuple[float, str]:
        """The read bandwidth for a working set of `nbytes`: the last-level cache's when it
        fits in half of it (it stays resident between steps), else DRAM's."""
        if lim.get("cache_bw") and nbytes <= lim.get("llc_bytes", 0) / 2:
            return lim["cache_bw"], "LLC"
        return lim["mem_bw"], "DRAM"

    def decode(self, rows: int, window: int, lim: dict) -> dict[str, Any]:
        s = self.spec
        nbytes = (
            costs.weight_read_bytes(s, rows, self.itemsize)
            + costs.kv_bytes(s, rows * window, self.itemsize)
            + 8.0 * rows * s.vocab_size
        )
        flops = rows * costs.forward_flops_per_token(s, window)
        bw, where = self.bandwidth(nbytes, lim)
        t_bw, t_fl = nbytes / bw, flops / lim["matmul_flops"]
        return {
            "bytes_per_step": nbytes,
            "flops_per_step": flops,
            "limit_bw": rows / t_bw,
            "limit_dram": rows * lim["mem_bw"] / nbytes,
            "limit_flops": rows / t_fl,
            "limit": rows / max(t_bw, t_fl),
            "bound": where if t_bw >= t_fl else "FLOPs",
        }

    def prefill(self, rows: int, length: int, window: int, lim: dict) -> dict[str, float]:
        s = self.spec
        flops = costs.prefill_flops(s, rows * length, window, logits=rows)
        nbytes = costs.weight_read_bytes(s, rows * length, self.itemsize) + costs.kv_bytes(
            s, rows * length, self.itemsize
        )
        t = max(nbytes / self.bandwidth(nbytes, lim)[0], flops / lim["matmul_flops"])
        return {"flops": flops, "limit": rows * length / t}

    def train(self, rows: int, length: int, lim: dict) -> dict[str, float]:
        flops = costs.train_flops(self.spec, rows * length, length)
        return {"flops": flops, "limit": rows * length * lim["matmul_flops"] / flops}


# ------------------------------------------------------------------------------ limits


# ------------------------------------------------------------------------------ decode


def _context(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(8, vocab, n).tolist()


def measure_draw(batch: int, vocab: int, steps: int, repeats: int) -> float:
    """Seconds per decode step of `decoding.draw` alone over [batch, vocab] logits (the
    log-softmax and the categorical draw each step does besides the model), as a decode
    segment runs it: `steps` draws in one program (temperature 1, no top-k)."""
    rows = decoding.RowParams(
        jnp.arange(batch, dtype=jnp.int32),
        jnp.ones(batch, jnp.float32),
        jnp.zeros(batch, jnp.int32),
        jnp.full(batch, 1 << 20, jnp.int32),
        jnp.full((batch, 8), -1, jnp.int32),
    )
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab), np.float32))

    @jax.jit
    def draws(logits, key, rows):
        def body(i, acc):  # acc feeds back so no draw can be hoisted out of the loop
            tok, lp = decoding.draw(logits + 1e-9 * acc[:, None], key, rows, rows.seed * 0 + i)
            return acc + lp + tok.astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, body, jnp.zeros(batch, jnp.float32))

    key = jax.random.key(0)
    jax.block_until_ready(draws(logits, key, rows))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(draws(logits, key, rows))
        times.append(time.perf_counter() - t0)
    return med(times) / steps


@dataclasses.dataclass
class DecodeCase:
    """B rows decoding with every timed segment attending over window W."""

    sampler: Sampler
    batch: int
    window: int
    segments: int  # timed segments per sample (K)
    prompt: int  # P
    times: list[float] = dataclasses.field(default_factory=list)
    draw_s: float = 0.0  # `measure_draw` at this batch (per step)
    lane_copies: int = 0  # rows copied into the decode working set by timed segments

    @classmethod
    def plan(cls, sampler: Sampler, batch: int, window: int, segments: int) -> DecodeCase:
        buckets = sampler.prompt_buckets
        if window not in buckets:
            raise SystemExit(f"window {window} is not a prompt bucket of the sampler {buckets}")
        s = sampler.segment_steps
        below = max((b for b in buckets if b < window), default=0)
        # The first segment (untimed) must already reach W: P + S + 1 > the bucket below.
        prompt = max(1, below - s + 1)
        k = min(segments, (window - 1 - prompt) // s - 1)
        if k < 1:
            raise SystemExit(f"window {window} is too small for segment_steps={s}")
        return cls(sampler, batch, window, k, prompt)

    def run(self, rng: np.random.Generator, timed: bool = True) -> None:
        sp = self.sampler
        s = sp.segment_steps
        vocab = sp.model.vocab_size
        done: list[Any] = []
        for i in range(self.batch):
            sp.submit(
                _context(rng, vocab, self.prompt),
                max_new_tokens=1 + (self.segments + 1) * s,  # ends after the timed segments
                stop_ids=(),
                seed=i,
                on_done=done.append,
            )
        sp.step()  # admission prefill + the first segment: untimed
        assert sp.active_rows == self.batch, (sp.active_rows, self.batch)
        used = [r for r in _replicas(sp) if r.active_rows]
        steps0, copies0 = [r.stats.decode_steps for r in used], sp.stats.lane_copies
        t0 = time.perf_counter()
        for k in range(self.segments):
            if not timed:  # check the plan: every timed segment attends over this window
                pos = max(len(r.sequence) - 1 for one in used for r in one._active)
                assert pos == self.prompt + (k + 1) * s, (pos, self.prompt, k)
                window = _bucket(min(pos + s + 1, sp.max_seq_len), sp.prompt_buckets)
                assert window == self.window, (window, self.window)
            sp.step()
        dt = time.perf_counter() - t0
        assert not sp.busy and len(done) == self.batch
        assert all(
            r.stats.decode_steps - n == self.segments * s for r, n in zip(used, steps0, strict=True)
        )
        if timed:
            self.times.append(dt)
            self.lane_copies += sp.stats.lane_copies - copies0

    @property
    def tokens(self) -> int:
        return self.batch * self.segments * self.sampler.segment_steps

    def result(self, roof: Roofline, lim: dict) -> dict[str, Any]:
        tps = [self.tokens / t for t in self.times]
        r = {
            "batch": self.batch,
            "replicas": len(_replicas(self.sampler)),
            "window": self.window,
            "prompt": self.prompt,
            "timed_steps": self.segments * self.sampler.segment_steps,
            "tokens_per_s": med(tps),
            "iqr": iqr(tps),
            "ms_per_step": 1e3 * med(self.times) / (self.segments * self.sampler.segment_steps),
            "samples_tokens_per_s": tps,
            "draw_ms": 1e3 * self.draw_s,
            "lane_copies": self.lane_copies,
            **roof.decode(self.batch, self.window, lim),
        }
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
        r["draw_share"] = r["draw_ms"] / r["ms_per_step"]
        return r


def _replicas(sampler: Sampler | SamplerReplicas) -> list[Sampler]:
    return list(getattr(sampler, "replicas", [sampler]))


def run_decode(cases: list[DecodeCase], repeats: int, seed: int) -> int:
    """Warm every case (compiles), then `repeats` interleaved rounds; returns the compiles
    that happened during the timed rounds (must be 0)."""
    rng = np.random.default_rng(seed)
    for c in cases:
        c.run(rng, timed=False)
    before = sum(s.compile_count for s in {id(c.sampler): c.sampler for c in cases}.values())
    for _ in range(repeats):
        for c in cases:
            c.run(rng)
    after = sum(s.compile_count for s in {id(c.sampler): c.sampler for c in cases}.values())
    for c in cases:
        c.draw_s = measure_draw(
            c.batch, c.sampler.model.vocab_size, c.sampler.segment_steps, repeats
        )
    return after - before


# ------------------------------------------------------------------------------ prefill


def run_prefill(
    sampler: Sampler, batches: list[int], lens: list[int], repeats: int, seed: int
) -> tuple[dict[tuple[int, int], list[float]], int]:
    """Seconds of each (batch, length) admission prefill, interleaved; compiles in timing."""
    rng = np.random.default_rng(seed)
    vocab = sampler.model.vocab_size
    cases = [(b, n) for n in lens for b in batches]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}

    def once(b: int, n: int) -> float:
        fed = sampler.stats.prefill_tokens
        for i in range(b):
            sampler.submit(
                _context(rng, vocab, n), max_new_tokens=1, stop_ids=(), seed=i, on_done=id
            )
        t0 = time.perf_counter()
        sampler.step()  # every row is done at its prefill: this is the prefill call alone
        dt = time.perf_counter() - t0
        assert not sampler.busy and sampler.stats.prefill_tokens - fed == b * n
        return dt

    for c in cases:
        once(*c)
    compiles = sampler.compile_count
    for _ in range(repeats):
        for c in cases:
            times[c].append(once(*c))
    return times, sampler.compile_count - compiles


def prefill_results(sampler: Sampler, times: dict, roof: Roofline, lim: dict) -> list[dict]:
    rows = []
    for (b, n), ts in times.items():
        window = _bucket(n, sampler.prompt_buckets)
        tps = [b * n / t for t in ts]
        r = {
            "batch": b,
            "length": n,
            "window": window,
            "tokens_per_s": med(tps),
            "iqr": iqr(tps),
            "ms_per_call": 1e3 * med(ts),
            "samples_tokens_per_s": tps,
            **roof.prefill(b, n, window, lim),
        }
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
        rows.append(r)
    return rows


# ------------------------------------------------------------------------------ reuse


def run_reuse(sampler: Sampler, args, seed: int) -> tuple[dict[str, Any], int]:
    """3-turn episodes with and without a session, interleaved; per-turn figures."""
    rng = np.random.default_rng(seed)
    vocab = sampler.model.vocab_size
    n, turns, modes = args.reuse_episodes, args.turns, ("reuse", "full")
    fields = ("prefill_tokens", "prefill_s", "turn_s")
    out: dict[str, Any] = {m: {f: [[] for _ in range(turns)] for f in fields} for m in modes}

    def episode(mode: str, tag: str, record: bool) -> None:
        ctxs = [_context(rng, vocab, args.reuse_context) for _ in range(n)]
        for t in range(turns):
            done: dict[int, Any] = {}
            for i, ctx in enumerate(ctxs):
                sampler.submit(
                    ctx,
                    max_new_tokens=args.reuse_new,
                    stop_ids=(),
                    seed=i,
                    session=f"{tag}-{i}" if mode == "reuse" else None,
                    on_done=lambda s, i=i, done=done: done.__setitem__(i, s),
                )
            fed = sampler.stats.prefill_tokens
            t0 = time.perf_counter()
            sampler._admit()  # the admission prefill alone (step() = this + a segment)
            t1 = time.perf_counter()
            while sampler.busy:
                sampler.step()
            t2 = time.perf_counter()
            assert len(done) == n and all(len(s.tokens) == args.reuse_new for s in done.values())
            if record:
                r = out[mode]
                r["prefill_tokens"][t].append((sampler.stats.prefill_tokens - fed) / n)
                r["prefill_s"][t].append(t1 - t0)
                r["turn_s"][t].append(t2 - t0)
            reply = _context(rng, vocab, args.reuse_reply)
            ctxs = [c + done[i].tokens + reply for i, c in enumerate(ctxs)]

    for mode in modes:
        episode(mode, f"warm-{mode}", record=False)
    compiles = sampler.compile_count
    for k in range(args.repeats):
        for mode in modes:
            episode(mode, f"r{k}", record=True)
    return out, sampler.compile_count - compiles


# ------------------------------------------------------------------------------ train


def train_setup(args, attention_block: int = -1):
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
    trainer = Trainer(cfg, model)
    rng = np.random.default_rng(0)
    episodes = []
    quarter = args.train_len // 4
    for r in range(4 * args.train_rows):  # four episodes of T/4 fill each row exactly
        mask = np.zeros(quarter, np.int8)
        mask[quarter // 2 :] = 1  # the second half is the policy's
        episodes.append(
            Episode(
                f"e{r}",
                rng.integers(8, spec.vocab_size, quarter).astype(np.int32),
                mask,
                np.where(mask == 1, -math.log(spec.vocab_size), 0.0).astype(np.float32),
                advantage=float(rng.normal()),
            )
        )
    batch = pack(
        episodes, buckets=(args.train_len,), batch_rows=args.train_rows, flush=True
    ).batches[0]
    return spec, trainer, batch


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
        with jax.set_mesh(trainer.mesh):
            lowered = trainer._step_fns["rl"].lower(
                trainer.model, trainer.optimizer, trainer.device_batch(batch), trainer.reference
            )
        ma = lowered.compile().memory_analysis()
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


def run_train_rss(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--train-child"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ output


def _fmt(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB" if x >= 1e6 else f"{x / 1e3:.0f} kB"


def print_decode(title: str, rows: list[dict], base_label: str) -> None:
    """One decode table; "ideal" = the ratio of the rooflines (what a constant fraction of
    the limit would give), next to the achieved ratio against the first row."""
    print(f"\n{title}")
    head = (
        f"{'batch':>6}{'rep':>4}{'window':>7}{'tok/s':>9}{'iqr':>6}{'ms/step':>9}{base_label:>9}"
        f"{'ideal':>8}{'MB/step':>9}{'lim tok/s':>11}{'bound':>7}{'of limit':>10}"
        f"{'of DRAM lim':>13}{'draw ms':>9}{'draw %':>8}"
    )
    print(head)
    print("-" * len(head))
    base = rows[0]
    for r in rows:
        print(
            f"{r['batch']:>6}{r['replicas']:>4}{r['window']:>7}{_fmt(r['tokens_per_s']):>9}{r['iqr']:>6.0%}"
            f"{r['ms_per_step']:>9.2f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x"
            f"{r['limit'] / base['limit']:>7.2f}x{r['bytes_per_step'] / 1e6:>9.1f}"
            f"{_fmt(r['limit']):>11}{r['bound']:>7}{r['of_limit']:>10.3f}"
            f"{r['tokens_per_s'] / min(r['limit_dram'], r['limit_flops']):>13.3f}"
            f"{r['draw_ms']:>9.3f}{r['draw_share']:>8.0%}"
        )


def print_tables(res: dict[str, Any], args) -> None:
    lim, spec = res["limits"], res["spec"]
    med_, iqr_ = res["limit_median"], res["limit_iqr"]
    n = len(res["limit_samples"]["mem_bw"])
    print(
        f"\nModel {args.shape}: d_model {spec['d_model']}, {spec['n_layers']} layers, "
        f"{spec['n_heads']} heads (kv {spec['n_kv_heads']}) x {spec['head_dim']}, d_ff "
        f"{spec['d_ff']}, vocab {spec['vocab_size']}; {res['params'] / 1e6:.2f}M params "
        f"({_mb(4 * res['params'])} float32); compute {args.compute_dtype}; "
        f"segment_steps {args.segment_steps}; {res['device']}, {res['cores']} cores"
    )

    def fig(k: str, unit: str) -> str:
        best = max(res["limit_samples"][k])
        return f"{best / GB:.1f} {unit} (median {med_[k] / GB:.1f}, iqr {iqr_[k]:.0%})"

    parts = [f"DRAM read {lim['mem_bw'] / GB:.1f} GB/s: one program {fig('mem_bw', 'GB/s')}"]
    if "mem_bw_devices" in med_:
        parts[0] += f", one per device at once {fig('mem_bw_devices', 'GB/s')}"
    if "cache_bw" in lim:
        parts.append(f"LLC ({_mb(lim['llc_bytes'])}) read {fig('cache_bw', 'GB/s')}")
    parts.append(f"matmul {fig('matmul_flops', 'GFLOP/s')}")
    print(f"Machine, best of {n} samples: " + "; ".join(parts))
    if res.get("decode_batch"):
        print_decode(
            f"Decode vs batch (window {args.window}; tok/s = rows x steps / wall of step() "
            "calls; bound LLC: the working set fits the last-level cache)",
            res["decode_batch"],
            "vs B=1",
        )
    if res.get("decode_window"):
        w0 = res["decode_window"][0]["window"]
        print_decode(
            f"Decode vs window (batch {args.window_batch}; the window is the cache bucket "
            f"attended; vs W={w0})",
            res["decode_window"],
            f"vs W={w0}",
        )
    decoded = res.get("decode_batch", []) + res.get("decode_window", [])
    if decoded:
        copies = sum(r["lane_copies"] for r in decoded)
        print(f"lane copies during timed decode (0: every row kept its lane): {copies}")
    if res.get("prefill"):
        rows = res["prefill"]
        print(
            "\nPrefill (B prompts of P tokens in one admission call; logits only at each "
            "row's last token)"
        )
        head = (
            f"{'batch':>6}{'P':>6}{'tok/s':>9}{'iqr':>6}{'ms/call':>9}{'vs first':>10}"
            f"{'GFLOP':>8}{'lim tok/s':>11}{'of limit':>10}"
        )
        print(head)
        print("-" * len(head))
        for r in rows:
            print(
                f"{r['batch']:>6}{r['length']:>6}{_fmt(r['tokens_per_s']):>9}{r['iqr']:>6.0%}"
                f"{r['ms_per_call']:>9.1f}{r['tokens_per_s'] / rows[0]['tokens_per_s']:>9.2f}x"
                f"{r['flops'] / 1e9:>8.2f}{_fmt(r['limit']):>11}{r['of_limit']:>10.3f}"
            )
    if res.get("reuse"):
        ru, fu = res["reuse"]["reuse"], res["reuse"]["full"]
        print(
            f"\nMulti-turn prefix reuse ({args.reuse_episodes} episodes at once; context "
            f"{args.reuse_context}, {args.reuse_new} new tokens per turn, {args.reuse_reply}-token"
            f" reply; per episode; reuse = session, full = re-prefill every turn)"
        )
        head = (
            f"{'turn':>5}{'prefill tok':>13}{'full tok':>10}{'ideal':>7}{'prefill ms':>12}"
            f"{'full ms':>9}{'speed-up':>10}{'turn ms':>9}{'full ms':>9}{'speed-up':>10}"
        )
        print(head)
        print("-" * len(head))
        for t in range(args.turns):
            ideal = args.reuse_context if t == 0 else args.reuse_reply + 1
            pr, pf = med(ru["prefill_s"][t]), med(fu["prefill_s"][t])
            tr, tf = med(ru["turn_s"][t]), med(fu["turn_s"][t])
            print(
                f"{t + 1:>5}{med(ru['prefill_tokens'][t]):>13.0f}"
                f"{med(fu['prefill_tokens'][t]):>10.0f}{ideal:>7}{1e3 * pr:>12.1f}"
                f"{1e3 * pf:>9.1f}{pf / pr:>9.2f}x{1e3 * tr:>9.1f}{1e3 * tf:>9.1f}{tf / tr:>9.2f}x"
            )
        er = sum(med(x) for x in ru["turn_s"])
        ef = sum(med(x) for x in fu["turn_s"])
        print(
            f"whole episode: {1e3 * er:.0f} ms with reuse, {1e3 * ef:.0f} ms without: {ef / er:.2f}x"
        )
    if res.get("train"):
        print_train(res["train"], spec["vocab_size"])
    print(f"\ncompiles during timing (must be 0): {res['compiles_during_timing']}")


def print_train(rows: list[dict], vocab: int) -> None:
    """The train step: one line of speed and one of memory per attention block."""
    r = rows[0]
    print(
        f"\nTrain step (Trainer.step, RL loss, {r['layers']} layers, [{r['rows']}, {r['length']}] "
        f"packed batch, density {r['density']:.2f}, vocab {vocab}; remat {r['remat']}, logits_chunk "
        f"{r['logits_chunk']}, scan_layers {r['scan_layers']}); FLOP limit {_fmt(r['limit'])} "
        f"tok/s ({r['flops'] / 1e9:.1f} GFLOP/step, dense attention)"
    )
    for r in rows:
        block = r["attention_block"]
        print(
            f"  attention_block {block}{' (dense)' if block == 0 else ''}: "
            f"{_fmt(r['tokens_per_s'])} tok/s (iqr {r['iqr']:.0%}, {1e3 * r['step_s']:.0f} "
            f"ms/step, {r['of_limit']:.3f} of limit); first step (trace + compile) "
            f"{r['first_step_s']:.1f} s; compiles during timing {r['compiles_during_timing']}"
        )
        mem = [f"params {_mb(r['param_bytes'])}"]
        if "xla_temp_bytes" in r:
            mem.append(
                f"XLA temp {_mb(r['xla_temp_bytes'])} + arguments {_mb(r['xla_argument_bytes'])}"
            )
        else:
            mem.append(f"XLA memory analysis unavailable ({r.get('xla_error')})")
        rss = r.get("rss")
        if rss and "peak_growth" in rss:
            mem.append(f"peak RSS growth of a step {_mb(rss['peak_growth'])}")
        elif rss:
            mem.append(f"RSS child failed: {rss.get('error')}")
        print("    memory: " + "; ".join(mem))
    print(
        f"  for scale: a full [rows, T, V] float32 logits tensor {_mb(r['logits_bytes'])}; one "
        f"layer's [rows, H, T, T] float32 attention scores {_mb(r['scores_bytes'])}"
    )


# ------------------------------------------------------------------------------ main


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


def make_sampler(
    model: Transformer, max_seq_len: int, max_batch: int, args, replicas: int = 1
) -> Sampler | SamplerReplicas:
    """A sampler for `max_batch` rows; with `replicas` > 1, one per CPU device, the rows
    split evenly among them (`replicate`, as `build_sampler` does for
    `actor.sampler_replicas`)."""

    def make(device: jax.Device | None, rows: int) -> Sampler:
        return Sampler(
            model,
            pad_id=0,
            stop_ids=[model.vocab_size - 1],
            max_seq_len=max_seq_len,
            max_sequences=rows,
            batch_buckets=sorted({*DEFAULT_BATCH_BUCKETS, rows}),
            prompt_buckets=DEFAULT_PROMPT_BUCKETS,
            segment_steps=args.segment_steps,
            kv_dtype=jnp.dtype(args.compute_dtype),
            device=device,
        )

    return replicate(make, max_batch, replicas)


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

    windows = sorted(args.windows)
    dtype = jnp.dtype(args.compute_dtype)
    spec = make_spec(args, max([args.window, *windows, 512]))
    model = Transformer(spec, rngs=nnx.Rngs(0), compute_dtype=dtype)
    roof = Roofline(spec, dtype.itemsize)
    res["spec"], res["params"] = dataclasses.asdict(spec), costs.total_params(spec)
    compiles = 0
    decode_sets: dict[str, list[DecodeCase]] = {}
    if args.batches:
        decode_sets["decode_batch"] = []
        for n in sorted(set(args.replicas)):
            sp = make_sampler(model, args.window, max(args.batches), args, replicas=n)
            decode_sets["decode_batch"] += [
                DecodeCase.plan(sp, b, args.window, args.segments) for b in sorted(args.batches)
            ]
    if windows:
        sp = make_sampler(model, windows[-1], args.window_batch, args)
        decode_sets["decode_window"] = [
            DecodeCase.plan(sp, args.window_batch, w, args.segments) for w in windows
        ]
    for name, cases in decode_sets.items():
        log(f"{name}: {len(cases)} cases x {args.repeats} repeats (compiles first)")
        compiles += run_decode(cases, args.repeats, seed=len(name))
    prefill = None
    if args.prefill_batches and args.prefill_lens:
        log("prefill")
        longest = _bucket(2 * max(args.prefill_lens), (*DEFAULT_PROMPT_BUCKETS, 1 << 30))
        sp = make_sampler(model, longest, max(args.prefill_batches), args)
        times, n = run_prefill(
            sp, sorted(args.prefill_batches), sorted(args.prefill_lens), args.repeats, seed=4
        )
        prefill, compiles = (sp, times), compiles + n
    if args.reuse_episodes:
        log("multi-turn reuse")
        turns_len = args.reuse_context + args.turns * (args.reuse_new + args.reuse_reply)
        longest = _bucket(turns_len + 1, (*DEFAULT_PROMPT_BUCKETS, 1 << 30))
        sp = make_sampler(model, longest, 2 * args.reuse_episodes, args)
        res["reuse"], n = run_reuse(sp, args, seed=3)
        compiles += n
    if args.train_len:
        log(f"train step [{args.train_rows}, {args.train_len}]")
        res["train"] = run_train(args)
        compiles += sum(r["compiles_during_timing"] for r in res["train"])
        for r in [] if args.no_rss else res["train"]:
            log(f"train step peak RSS (subprocess), attention_block {r['attention_block']}")
            r["rss"] = run_train_rss(
                [*sys.argv[1:], "--attention-block", str(r["attention_block"])]
            )
    log("limits again")
    for k, v in measure_limits(args.compute_dtype, args.repeats, llc).items():
        limit_samples[k] += v
    lim = machine_limits(limit_samples, llc)
    res["limits"], res["limit_samples"] = lim, limit_samples
    res["limit_median"] = {k: med(v) for k, v in limit_samples.items()}
    res["limit_iqr"] = {k: iqr(v) for k, v in limit_samples.items()}
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

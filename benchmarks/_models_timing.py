"""The timed parts of benchmarks/models.py: the machine's limits and each family's
rooflines, the forward and sampling rates, and the snapshot publish / reload path.

    lim = limits("float32", repeats)                   # matmul FLOP/s, DRAM read bandwidth
    tokens_per_s, xla_flops_per_token = measure_forward(model, batch, seq, repeats)
    tps, wall, compiles, steps = measure_sampling(make_sampler(model, 128, 16), 16, 32, 16, 3)
    sampler, rows = sampling_rows(model, args, log)   # one row per --sample-batches
    reload = measure_reload("file:///tmp/run", model, sampler, repeats, probe_dir)
    apply_limits(result, lim)                          # the roofline figures, at the end

Every figure is a median of `repeats` timed calls after the compile (`timed`); a plain
read or write of as many bytes is the reference next to each transfer.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load as st_load

from tunix_tasks.policy import costs
from tunix_tasks.policy.distribution import sampling_log_probs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import DEFAULT_PROMPT_BUCKETS, Sampler
from tunix_tasks.policy.spec import DecoderSpec
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import WeightsPublisher, encode_snapshot, load_snapshot

from _machine import machine_limits, measure_limits, med

MB = 1e6


def timed(fn, repeats: int, *, best: bool = False) -> float:
    """Median (or best) wall seconds of `fn()` (result blocked on) over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times) if best else med(times)


def read_bandwidth(paths: list[Path], repeats: int) -> float:
    """MB/s of plain `open().read()` of the files (page-cached after writing)."""
    total = sum(p.stat().st_size for p in paths)

    def read() -> int:
        n = 0
        for p in paths:
            with open(p, "rb") as f:
                n += len(f.read())
        return n

    return total / MB / timed(read, repeats, best=True)


def limits(compute_dtype: str, repeats: int) -> dict[str, float]:
    """Matmul FLOP/s and DRAM read bandwidth (`_machine`): the best of the samples."""
    lim = machine_limits(measure_limits(compute_dtype, max(repeats, 5), llc=0), llc=0)
    return {"matmul_flops": lim["matmul_flops"], "mem_bw": lim["mem_bw"]}


def raise_limits(lim: dict[str, float], new: dict[str, float]) -> None:
    """Keep the best of every measurement: on a shared machine a slow one is contention."""
    for k, v in new.items():
        lim[k] = max(lim.get(k, 0.0), v)


def apply_limits(r: dict[str, Any], lim: dict[str, float]) -> None:
    """The roofline figures of one family's results, from the run's final limits."""
    spec = DecoderSpec(**r["spec"])
    r["read_ref"] = lim["read_MBps"]
    f = r["forward"]
    f["matmul_flops"] = lim["matmul_flops"]
    f["limit_tokens_per_s"] = lim["matmul_flops"] / f["flops_per_token"]
    for s in r["sampling"]:
        t = sampling_limit_s(
            spec, lim, s["batch"], s["prompt_bucket"], s["decode_segments"], s["itemsize"]
        )
        s["limit_tokens_per_s"] = s["batch"] * s["new_tokens"] / t


def sampling_limit_s(
    spec: DecoderSpec,
    lim: dict,
    batch: int,
    prompt: int,
    segments: list[tuple[int, int]],
    itemsize: int,
) -> float:
    """Lower bound on the wall time of one sampling call (module docstring): the prefill of
    `prompt` (bucket) tokens per row over a window of as many, then each decode segment's
    (steps, window). Weights and K/V in the compute dtype: the sampler holds both in it."""

    def step_bytes(window: int) -> int:  # of an untied embedding table, only B rows
        return costs.weight_read_bytes(spec, batch, itemsize) + costs.kv_bytes(
            spec, batch * window, itemsize
        )

    t = max(
        costs.prefill_flops(spec, batch * prompt, prompt, logits=batch) / lim["matmul_flops"],
        step_bytes(prompt) / lim["mem_bw"],
    )
    for steps, window in segments:
        t += steps * max(
            batch * costs.forward_flops_per_token(spec, window) / lim["matmul_flops"],
            step_bytes(window) / lim["mem_bw"],
        )
    return t


def measure_forward(model, batch: int, seq: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of the jitted packed training forward at [batch, seq] (compile excluded),
    and the FLOPs per token XLA's cost analysis counts in that compiled program (the
    cross-check of the cost model's count the roofline uses)."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t, p, g: nnx.merge(graphdef, s)(t, p, g))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (batch, seq)), jnp.int32)
    half = seq // 2  # two packed segments per row: positions restart at the second
    positions = jnp.asarray(np.tile(np.r_[np.arange(half), np.arange(seq - half)], (batch, 1)))
    segments = jnp.asarray(np.tile(np.r_[np.ones(half), np.full(seq - half, 2)], (batch, 1)))
    args = (state, tokens, positions.astype(jnp.int32), segments.astype(jnp.int32))
    compiled = fwd.lower(*args).compile()  # the program timed below, and its FLOPs
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list in older jax
    jax.block_until_ready(compiled(*args))
    tokens_per_s = batch * seq / timed(lambda: compiled(*args), repeats)
    return tokens_per_s, float(cost["flops"]) / (batch * seq)


def measure_sampling(
    sampler: Sampler, batch: int, prompt: int, new: int, repeats: int
) -> tuple[float, float, int, int]:
    """`Sampler.sample` of `batch` prompts, exactly `new` tokens each: (tokens/s, seconds
    per call, compiles during the timed calls, decode steps per call) after a warm-up
    call. The prefill draws each row's first token, so a call decodes `new - 1` steps."""
    rng = np.random.default_rng(batch)
    vocab = sampler.model.vocab_size
    ctx = [rng.integers(0, vocab, prompt).tolist() for _ in range(batch)]
    calls = iter(range(1_000_000))

    def call() -> int:
        out = sampler.sample(
            ctx, max_new_tokens=new, stop_ids=(), rng=jax.random.PRNGKey(next(calls))
        )
        n = sum(len(s.tokens) for s in out)
        assert n == batch * new, (n, batch * new)
        return n

    steps = sampler.stats.decode_steps
    call()  # compiles every program this call shape uses
    steps = sampler.stats.decode_steps - steps
    compiles = sampler.compile_count
    wall = timed(call, repeats)
    return batch * new / wall, wall, sampler.compile_count - compiles, steps


def make_sampler(model, max_seq_len: int, max_batch: int) -> Sampler:
    """A sampler whose KV cache fits this run (not the spec's 4096 positions): the slot
    sampler allocates max_sequences x max_seq_len up front."""
    return Sampler(
        model,
        pad_id=0,
        stop_ids=[model.vocab_size - 1],
        max_seq_len=max_seq_len,
        max_sequences=max_batch,
    )


def measure_logprobs_step(batch: int, vocab: int, repeats: int) -> float:
    """Seconds of one `sampling_log_probs` over [batch, vocab] logits (top_k=0, as sampled
    here): the per-token distribution work each decode step does besides the model."""
    f = jax.jit(sampling_log_probs)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab), np.float32))
    jax.block_until_ready(f(x, jnp.float32(1.0), jnp.int32(0)))
    return timed(lambda: f(x, jnp.float32(1.0), jnp.int32(0)), max(repeats, 3), best=True)


def sampling_rows(
    model: Transformer, args, log: Callable[[str], None]
) -> tuple[Sampler, list[dict[str, Any]]]:
    """`measure_sampling` at each `--sample-batches` on one sampler sized for the run, with
    the vocabulary share of each call: (the sampler, one row per batch)."""
    spec = model.spec
    need = args.prompt + args.new_tokens + 1
    seq = next((b for b in DEFAULT_PROMPT_BUCKETS if b >= need), need)
    sampler = make_sampler(model, seq, max(args.sample_batches))
    itemsize = jnp.dtype(args.compute_dtype).itemsize
    width = next(b for b in sampler.prompt_buckets if b >= args.prompt)
    # The decode segments as `Sampler.decode_window` picks them: after the prefill's token
    # the furthest row sits at position `prompt`; each segment attends over the bucket
    # holding its furthest position + segment_steps + 1 (not the whole cache).
    segments, furthest, left = [], args.prompt, args.new_tokens - 1
    while left > 0:
        steps = min(sampler.segment_steps, left)
        reach = min(furthest + sampler.segment_steps + 1, sampler.max_seq_len)
        segments.append((steps, next(w for w in sampler.prompt_buckets if w >= reach)))
        furthest, left = furthest + steps, left - steps
    rows = []
    for b in args.sample_batches:
        tps, wall, recompiles, steps = measure_sampling(
            sampler, b, args.prompt, args.new_tokens, args.repeats
        )
        assert steps == sum(n for n, _ in segments), (steps, segments)
        lp = measure_logprobs_step(b, spec.vocab_size, args.repeats)
        rows.append(
            {
                "batch": b,
                "prompt": args.prompt,
                "new_tokens": args.new_tokens,
                "prompt_bucket": width,
                "decode_segments": segments,
                "itemsize": itemsize,
                "tokens_per_s": tps,
                "call_s": wall,
                "compiles_in_measurement": recompiles,
                "logprobs_step_s": lp,
                "logprobs_share": args.new_tokens * lp / wall,
            }
        )
        log(f"sampling batch {b}: {tps:.0f} tokens/s")
    return sampler, rows


def _plain_write(path: Path, data: bytes) -> float:
    """Seconds of `open().write()` + fsync of `data` to a new file (then removed)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def measure_reload(
    store_uri: str, model, sampler: Sampler, repeats: int, probe_dir: Path | None
) -> dict[str, Any]:
    """Publish `repeats` versions, reload each the actor's way; medians. With `probe_dir`,
    a plain write + fsync of as many bytes right before each publish (the disk's rate at
    that moment: a shared disk's rate drifts by several times within a minute)."""
    store = open_store(store_uri)
    publisher = WeightsPublisher(store)
    meta = {"family": model.spec.family}
    pub, flat_s, reload, plain, nbytes = [], [], [], [], 0
    data = b""
    if probe_dir is not None:
        size = sum(v.nbytes for v in flat_params(model).values())
        data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
    for version in range(repeats):
        if data:
            plain.append(len(data) / MB / _plain_write(probe_dir / "write-probe.bin", data))
        t0 = time.perf_counter()
        flat = flat_params(model)
        t1 = time.perf_counter()
        manifest = publisher.publish(flat, version=version, step=version, model=meta)
        pub.append(time.perf_counter() - t1)
        flat_s.append(t1 - t0)
        nbytes = manifest.num_bytes
        del flat
        gc.collect()
        t0 = time.perf_counter()
        got, _ = load_snapshot(store, version)  # WeightsClient.poll -> Actor._load
        sampler.update_params(got)
        jax.block_until_ready(nnx.state(sampler.model))
        reload.append(time.perf_counter() - t0)
        del got
    # Where the time goes: the same steps once more, one at a time.
    key = f"weights/v{repeats - 1:08d}/params.safetensors"
    t = [time.perf_counter()]
    flat = flat_params(model)
    blob, _ = encode_snapshot(flat, version=repeats, step=0, model=meta)  # encode + sha256
    t.append(time.perf_counter())
    store.write_bytes("probe/params.safetensors", blob)
    t.append(time.perf_counter())
    del blob, flat
    t.append(time.perf_counter())
    blob = store.read_bytes(key)
    t.append(time.perf_counter())
    hashlib.sha256(blob).hexdigest()
    t.append(time.perf_counter())
    got = st_load(blob)
    t.append(time.perf_counter())
    del blob
    sampler.update_params(got)
    jax.block_until_ready(nnx.state(sampler.model))
    t.append(time.perf_counter())
    d = np.diff(t)
    return {
        "flat_params_s": med(flat_s),
        "publish_s": med(pub),
        "reload_s": med(reload),
        "snapshot_bytes": nbytes,
        "plain_write_MBps": med(plain) if plain else None,
        "breakdown_s": {
            "publish: flat_params+encode+sha": d[0],
            "publish: write_bytes (fsync)": d[1],
            "reload: read_bytes": d[3],
            "reload: sha256": d[4],
            "reload: safetensors.load": d[5],
            "reload: update_params": d[6],
        },
    }

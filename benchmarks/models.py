"""Real-architecture models end to end: checkpoint import, forward, sampling, weight reload.

For each family (Qwen3: tied, q/k norm, `rope_parameters` config; Llama 3: untied, llama3
rope scaling in the older top-level config form) at one shape (`--shape`), with random
weights, in one run:

  1. write    a random-weight Hugging Face checkpoint (config.json + safetensors in
              `--ckpt-dtype`, split into `model-0000i-of-0000n.safetensors` + index once it
              exceeds `--shard-mb`), one shard in memory at a time.
  2. import   `HFCheckpoint(dir).load_model(spec)` in a FRESH subprocess (clean RSS): wall
              time (median of `--repeats` loads in that process) and the peak RSS of the
              first load over the RSS just before it (the high-water mark is reset with
              /proc/self/clear_refs), divided by the model's float32 bytes. Ideal: 1.0 (the
              model itself: on CPU the params live in host memory) plus about one tensor.
              Baseline, same run, also a fresh subprocess: the naive import, every file
              through `safetensors.numpy.load_file` into one dict, all converted to float32
              in our layout, then device_put (about 2.5x for bf16). Throughput = checkpoint
              bytes / import time, against plain `open().read()` of the same files (page-
              cached: the practical limit of reading them at all).
  3. compute  the packed training forward `model(tokens, positions, segment_ids)` jitted at
              [--fwd-batch, --seq] (two segments per row), and `Sampler.sample` at each
              batch of `--sample-batches` with `--prompt`-token prompts and exactly
              `--new-tokens` new tokens (no stop id can end a row), compile excluded (one
              warm-up call per shape). Decode tokens/s = batch * new tokens / wall time of
              the call (prefill included: a short prompt makes it decode-dominated).
  4. reload   `WeightsPublisher.publish(flat_params(model))` to a file:// store (gs:// with
              `--gcs`), then the actor's reload path (`Actor._load` via `WeightsClient.poll`):
              `load_snapshot` + `sampler.update_params(flat)`; seconds, MB/s, bytes written,
              and the peak RSS of the reload over the RSS before it / model bytes (measured
              in this process, high-water mark reset first). References: plain
              `open().write()` + fsync of as many bytes (publish) and `open().read()` (reload).

Roofline, measured in the same run on the same device: matmul FLOP/s (a jitted 2048^3
matmul in the compute dtype) and memory read bandwidth (a jitted sum over 256 MB of f32).
With L layers, d d_model, h / kv heads of size hd, f d_ff, V vocab, P_mm the matmul params
per token = L*(2*d*h*hd + 2*d*kv*hd + 3*d*f) + d*V (the output projection, tied or not):
  forward FLOPs/token       = 2*P_mm + 4*L*h*hd*T   (T = --seq: the masked T x T attention
                              is computed in full); limit = FLOP/s / that
  decode step, batch B      FLOPs = B*(2*P_mm + 4*L*h*hd*S), S = the sampler's cache length
                            bytes = params read (float32 as stored, all but an untied
                                    embedding table, of which B rows) + the K/V cache read,
                                    2*L*B*kv*S*hd*itemsize(compute dtype)
                            time >= max(FLOPs / FLOP/s, bytes / bandwidth)
  sampling call             limit = prefill (B*prompt tokens, FLOP- or weight-read-bound)
                                    + new_tokens decode steps; tokens/s limit = B*new / that
Ratios "x of limit" are achieved / limit (1.0 = at the roofline; sort/softmax over the
vocabulary, RoPE, norms and the Python loop between calls are not in the limit).

    python benchmarks/models.py                      # toy shape (make bench), ~1-2 min
    python benchmarks/models.py --shape cpu          # ~185M / ~218M params, a few minutes
    python benchmarks/models.py --shape qwen3-0.6b   # the real Qwen3-0.6B shape (accelerator)
    python benchmarks/models.py --gcs --json         # + gs:// (fake-gcs-server); raw numbers

Reading the figures: "import peak RSS" should sit near 1.0x model bytes (import streams
tensor by tensor); the naive baseline shows what it saves. "import throughput" / disk
read is the fraction of the plain read rate the import keeps (conversion to float32 and
the layout transposes cost the rest). Forward and sampling "x of limit" say how far the
implementation is from what the device allows; "reload" is what an actor pauses for at
each new weight version.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, hf_tensor_shapes
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import DecoderSpec, spec_from_hf_config
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import WeightsPublisher, load_snapshot

MB = 1e6
FAMILIES = ("qwen3", "llama3")

# Model shapes (HF config keys). qwen3-0.6b is huggingface.co/Qwen/Qwen3-0.6B's config.json
# (as in benchmarks/model_memory.py); the llama3 family takes the same dimensions, untied.
SHAPES: dict[str, dict[str, int]] = {
    "toy": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 32000,
    },
    "cpu": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 3072,
        "vocab_size": 32000,
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
    },
}
# Per-shape defaults of the run flags (a flag given on the command line wins).
RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "toy": {"fwd_batch": 4, "seq": 256, "sample_batches": [1, 16, 64], "new_tokens": 32},
    # 2-core CPUs: batch 64 of a ~200M model takes minutes per call; fewer new tokens.
    "cpu": {"fwd_batch": 2, "seq": 256, "sample_batches": [1, 16], "new_tokens": 16},
    "qwen3-0.6b": {"fwd_batch": 8, "seq": 1024, "sample_batches": [1, 16, 64], "new_tokens": 64},
}


# ------------------------------------------------------------------------------ helpers


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _timed(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` (its result blocked on) over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return _median(times)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------ checkpoint


def hf_config(family: str, shape: str, ckpt_dtype: str) -> dict[str, Any]:
    s = SHAPES[shape]
    common = {
        **s,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "qwen3":  # the newer form, as Qwen3 checkpoints on the Hub now carry
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "tie_word_embeddings": True,
            "dtype": ckpt_dtype,
        }
    cfg = {  # Llama 3.1's older top-level rope form; head_dim only when not d / heads
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": ckpt_dtype,
    }
    if s["head_dim"] * s["num_attention_heads"] == s["hidden_size"]:
        del cfg["head_dim"]
    return cfg


def write_checkpoint(
    directory: Path, config: dict[str, Any], spec: DecoderSpec, dtype: str, shard_mb: float, seed
) -> dict[str, Any]:
    """Random-weight HF checkpoint; one shard's tensors in memory at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    shapes = hf_tensor_shapes(spec)
    nbytes = {k: math.prod(v) * np_dtype.itemsize for k, v in shapes.items()}
    groups: list[list[str]] = [[]]
    size = 0
    for name in shapes:  # plan shards by size (a tensor larger than a shard gets its own)
        if groups[-1] and size + nbytes[name] > shard_mb * MB:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    n = len(groups)
    files = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for file, names in zip(files, groups, strict=True):
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                w = np.ones(shapes[name], np.float32)
            else:
                w = rng.standard_normal(shapes[name], dtype=np.float32)
                w *= 0.02
            tensors[name] = w.astype(np_dtype)
            del w
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    if n > 1:
        index = {
            "metadata": {"total_size": sum(nbytes.values())},
            "weight_map": {k: f for f, names in zip(files, groups, strict=True) for k in names},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_s = time.perf_counter() - t0
    return {
        "files": files,
        "ckpt_bytes": sum((directory / f).stat().st_size for f in files),
        "write_s": write_s,
    }


def read_bandwidth(paths: list[Path], repeats: int) -> float:
    """MB/s of plain `open().read()` of the files (page-cached after writing)."""
    total = sum(p.stat().st_size for p in paths)

    def read() -> int:
        n = 0
        for p in paths:
            with open(p, "rb") as f:
                n += len(f.read())
        return n

    return total / MB / _timed(read, repeats)


def write_bandwidth(directory: Path, nbytes: int, repeats: int) -> float:
    """MB/s of plain `open().write()` + fsync of `nbytes` (what a file:// publish does)."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    path = directory / "write-probe.bin"

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    mbs = nbytes / MB / _timed(write, repeats)
    path.unlink()
    return mbs


# ------------------------------------------------------------------------------ import (child)


def _naive_load(directory: str, spec: DecoderSpec) -> Any:
    """The naive import: whole files into a dict, all converted, then device_put."""
    from safetensors.numpy import load_file

    from tunix_tasks.policy.hf_checkpoint import _targets
    from tunix_tasks.policy.model import Transformer

    tensors: dict[str, np.ndarray] = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    flat = {
        ours: np.ascontiguousarray(t.to_ours(tensors[t.hf_name]), dtype=np.float32)
        for ours, t in _targets(spec).items()
    }
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0))))
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(flat["/".join(map(str, path))]))
    return nnx.merge(graphdef, state)


def child_import(mode: str, uri: str, repeats: int) -> dict[str, Any]:
    """Runs in a fresh process: import `uri` `repeats` times; RSS figures of the first."""
    ckpt = HFCheckpoint(uri)
    spec = ckpt.spec(max_seq_len=4096)
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # runtime up before baseline

    def load():
        if mode == "naive":
            return _naive_load(urlpath(uri), spec)
        return ckpt.load_model(spec)

    times, out = [], {}
    for i in range(repeats):
        gc.collect()
        base = _rss()
        reset = _reset_peak()
        t0 = time.perf_counter()
        model = load()
        jax.block_until_ready(nnx.state(model))
        times.append(time.perf_counter() - t0)
        if i == 0:
            out = {"base_rss": base, "peak_rss": _peak(), "after_rss": _rss(), "reset": reset}
        del model
    return {**out, "load_s": _median(times), "load_s_all": times}


def urlpath(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def run_child(mode: str, uri: str, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--child-uri", uri, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} import subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ roofline


def machine_limits(compute_dtype: str, repeats: int) -> dict[str, float]:
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), compute_dtype)
    mm = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(mm(a, a))
    flops = 2 * n**3 / _timed(lambda: mm(a, a), max(repeats, 5))
    x = jnp.ones((64 << 20,), jnp.float32)  # 256 MB: far beyond any cache
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    bandwidth = x.nbytes / _timed(lambda: total(x), max(repeats, 5))
    return {"matmul_flops": flops, "mem_bw": bandwidth}


def param_counts(spec: DecoderSpec) -> dict[str, int]:
    d, h, kv, hd, f, v, L = (
        spec.d_model,
        spec.n_heads,
        spec.n_kv_heads,
        spec.head_dim,
        spec.d_ff,
        spec.vocab_size,
        spec.n_layers,
    )
    total = sum(math.prod(s) for s in hf_tensor_shapes(spec).values())
    matmul = L * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f) + d * v
    return {"params": total, "matmul": matmul, "embed": d * v}


def forward_flops_per_token(spec: DecoderSpec, seq: int) -> float:
    pc = param_counts(spec)
    return 2 * pc["matmul"] + 4 * spec.n_layers * spec.n_heads * spec.head_dim * seq


def sampling_limit_s(
    spec: DecoderSpec, lim: dict, batch: int, prompt: int, new: int, cache: int, itemsize: int
) -> float:
    """Lower bound on the wall time of one sampling call (module docstring)."""
    pc = param_counts(spec)
    weight_bytes = 4 * pc["params"]
    if not spec.tie_embeddings:  # an untied table is only gathered: B rows per step
        weight_bytes -= 4 * pc["embed"] - 4 * batch * spec.d_model
    attn = 4 * spec.n_layers * spec.n_heads * spec.head_dim * cache
    kv_bytes = 2 * spec.n_layers * batch * spec.n_kv_heads * cache * spec.head_dim * itemsize
    prefill = max(
        batch * prompt * (2 * pc["matmul"] + attn) / lim["matmul_flops"],
        (weight_bytes + kv_bytes) / lim["mem_bw"],
    )
    step = max(
        batch * (2 * pc["matmul"] + attn) / lim["matmul_flops"],
        (weight_bytes + kv_bytes) / lim["mem_bw"],
    )
    return prefill + new * step


# ------------------------------------------------------------------------------ compute


def measure_forward(model, batch: int, seq: int, repeats: int) -> float:
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t, p, g: nnx.merge(graphdef, s)(t, p, g))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (batch, seq)), jnp.int32)
    half = seq // 2  # two packed segments per row: positions restart at the second
    positions = jnp.asarray(np.tile(np.r_[np.arange(half), np.arange(seq - half)], (batch, 1)))
    segments = jnp.asarray(np.tile(np.r_[np.ones(half), np.full(seq - half, 2)], (batch, 1)))
    args = (state, tokens, positions.astype(jnp.int32), segments.astype(jnp.int32))
    jax.block_until_ready(fwd(*args))  # compile
    return batch * seq / _timed(lambda: fwd(*args), repeats)


def measure_sampling(sampler: Sampler, batch: int, prompt: int, new: int, repeats: int):
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

    call()  # compile (and warm up) this (batch, prompt, cache) shape
    compiles = sampler.compile_count
    wall = _timed(call, repeats)
    assert sampler.compile_count == compiles, "sampling recompiled during the measurement"
    return batch * new / wall, wall


# ------------------------------------------------------------------------------ reload


def measure_reload(store_uri: str, model, sampler: Sampler, repeats: int) -> dict[str, float]:
    """Publish `repeats` versions, reload each the actor's way; medians."""
    store = open_store(store_uri)
    publisher = WeightsPublisher(store)
    meta = {"family": model.spec.family}
    pub, flat_s, reload, peak, nbytes = [], [], [], [], 0
    for version in range(repeats):
        t0 = time.perf_counter()
        flat = flat_params(model)
        t1 = time.perf_counter()
        manifest = publisher.publish(flat, version=version, step=version, model=meta)
        pub.append(time.perf_counter() - t1)
        flat_s.append(t1 - t0)
        nbytes = manifest.num_bytes
        del flat
        gc.collect()
        base = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        got, _ = load_snapshot(store, version)  # WeightsClient.poll -> Actor._load
        sampler.update_params(got)
        jax.block_until_ready(nnx.state(sampler.model))
        reload.append(time.perf_counter() - t0)
        del got
        peak.append(_peak() - base)
    return {
        "flat_params_s": _median(flat_s),
        "publish_s": _median(pub),
        "reload_s": _median(reload),
        "reload_peak_extra": peak[0],
        "snapshot_bytes": nbytes,
    }


# ------------------------------------------------------------------------------ one family


def run_family(family: str, args, root: Path, lim: dict, gcs) -> dict[str, Any]:
    config = hf_config(family, args.shape, args.ckpt_dtype)
    spec = spec_from_hf_config(config, max_seq_len=4096)
    pc = param_counts(spec)
    model_bytes = 4 * pc["params"]
    ckdir = root / f"ckpt-{family}"
    r: dict[str, Any] = {
        "family": family,
        "shape": args.shape,
        "spec": {k: v for k, v in vars(spec).items() if k != "rope_scaling"},
        "params": pc["params"],
        "model_bytes_fp32": model_bytes,
        "largest_tensor_fp32": 4 * max(math.prod(s) for s in hf_tensor_shapes(spec).values()),
    }
    r.update(write_checkpoint(ckdir, config, spec, args.ckpt_dtype, args.shard_mb, seed=1))
    paths = [ckdir / f for f in r["files"]]
    r["read_MBps"] = read_bandwidth(paths, args.repeats)
    log(f"[{family}] checkpoint {r['ckpt_bytes'] / MB:.1f} MB in {len(paths)} file(s)")

    for mode in ("ours", "naive"):
        c = run_child(mode, f"file://{ckdir}", args.repeats)
        r[f"import_{mode}"] = c
        r[f"import_{mode}_peak_ratio"] = (c["peak_rss"] - c["base_rss"]) / model_bytes
        r[f"import_{mode}_resident_ratio"] = (c["after_rss"] - c["base_rss"]) / model_bytes
        r[f"import_{mode}_MBps"] = r["ckpt_bytes"] / MB / c["load_s"]
        log(f"[{family}] import {mode}: {c['load_s']:.2f} s")
    if gcs is not None:
        uri = gcs.new_bucket_uri(f"ckpt-{family}")
        store = open_store(uri)
        for p in [ckdir / "config.json", *paths, ckdir / "model.safetensors.index.json"]:
            if p.exists():
                store.write_bytes(p.name, p.read_bytes())
        t0 = time.perf_counter()
        for p in paths:
            store.read_bytes(p.name)
        r["gcs_read_MBps"] = r["ckpt_bytes"] / MB / (time.perf_counter() - t0)
        c = run_child("ours", uri, args.repeats)
        r["import_gcs"] = c
        r["import_gcs_MBps"] = r["ckpt_bytes"] / MB / c["load_s"]
        log(f"[{family}] import gs://: {c['load_s']:.2f} s")

    model = HFCheckpoint(f"file://{ckdir}").load_model(spec, compute_dtype=args.compute_dtype)
    tps = measure_forward(model, args.fwd_batch, args.seq, args.repeats)
    fpt = forward_flops_per_token(spec, args.seq)
    r["forward"] = {
        "batch": args.fwd_batch,
        "seq": args.seq,
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "limit_tokens_per_s": lim["matmul_flops"] / fpt,
    }
    log(f"[{family}] forward {tps:.0f} tokens/s")

    sampler = Sampler(model, pad_id=0, stop_ids=[spec.vocab_size - 1])
    itemsize = jnp.dtype(args.compute_dtype).itemsize
    width = next(b for b in sampler.prompt_buckets if b >= args.prompt)
    cache = next(
        b for b in sampler.prompt_buckets if b >= min(width + args.new_tokens, spec.max_seq_len)
    )
    r["sampling"] = []
    for b in args.sample_batches:
        tps, wall = measure_sampling(sampler, b, args.prompt, args.new_tokens, args.repeats)
        limit = sampling_limit_s(spec, lim, b, width, args.new_tokens, cache, itemsize)
        r["sampling"].append(
            {
                "batch": b,
                "prompt": args.prompt,
                "new_tokens": args.new_tokens,
                "cache_len": cache,
                "tokens_per_s": tps,
                "call_s": wall,
                "limit_tokens_per_s": b * args.new_tokens / limit,
            }
        )
        log(f"[{family}] sampling batch {b}: {tps:.0f} tokens/s")

    r["reload_file"] = measure_reload(f"file://{root}/run-{family}", model, sampler, args.repeats)
    r["write_MBps"] = write_bandwidth(root, r["reload_file"]["snapshot_bytes"], args.repeats)
    if gcs is not None:
        r["reload_gcs"] = measure_reload(gcs.new_bucket_uri(), model, sampler, args.repeats)
    # the reloaded weights still sample, with the programs compiled before the reload
    compiles = sampler.compile_count
    measure_sampling(sampler, args.sample_batches[0], args.prompt, args.new_tokens, 1)
    r["recompiles_after_reload"] = sampler.compile_count - compiles
    shutil_rmtree(ckdir)
    return r


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ printing


def rows(r: dict[str, Any], lim: dict[str, float]) -> list[tuple]:
    """(figure, value, unit, reference, reference value, ratio) rows of one family."""
    mb = r["ckpt_bytes"] / MB
    out: list[tuple] = [
        ("checkpoint write", r["write_s"], "s", "", None, None),
        ("import (load_model) file://", r["import_ours"]["load_s"], "s", "naive load_file",
         r["import_naive"]["load_s"], r["import_ours"]["load_s"] / r["import_naive"]["load_s"]),
        ("import throughput", r["import_ours_MBps"], "MB/s", "open().read()", r["read_MBps"],
         r["import_ours_MBps"] / r["read_MBps"]),
        ("import peak RSS", r["import_ours_peak_ratio"], "x model", "naive load_file",
         r["import_naive_peak_ratio"], r["import_ours_peak_ratio"] / r["import_naive_peak_ratio"]),
        ("import resident after", r["import_ours_resident_ratio"], "x model", "naive load_file",
         r["import_naive_resident_ratio"], None),
    ]  # fmt: skip
    if "import_gcs" in r:
        out.append(
            ("import gs:// throughput", r["import_gcs_MBps"], "MB/s", "gs read_bytes",
             r["gcs_read_MBps"], r["import_gcs_MBps"] / r["gcs_read_MBps"])
        )  # fmt: skip
    f = r["forward"]
    out.append(
        (f"forward {f['batch']}x{f['seq']} packed", f["tokens_per_s"], "tokens/s", "FLOP roofline",
         f["limit_tokens_per_s"], f["tokens_per_s"] / f["limit_tokens_per_s"])
    )  # fmt: skip
    for s in r["sampling"]:
        out.append(
            (f"sample b={s['batch']} {s['prompt']}+{s['new_tokens']} tok", s["tokens_per_s"],
             "tokens/s", "roofline", s["limit_tokens_per_s"],
             s["tokens_per_s"] / s["limit_tokens_per_s"])
        )  # fmt: skip
    for where in ("file", "gcs"):
        if f"reload_{where}" not in r:
            continue
        rl, snap = r[f"reload_{where}"], r[f"reload_{where}"]["snapshot_bytes"] / MB
        ref_w = ("open().write()+fsync", r["write_MBps"]) if where == "file" else ("", None)
        ref_r = ("open().read()", r["read_MBps"]) if where == "file" else ("", None)
        out += [
            (f"snapshot bytes {where}", snap, "MB", "", None, None),
            ("flat_params", rl["flat_params_s"], "s", "", None, None),
            (f"publish {where}", snap / rl["publish_s"], "MB/s", *ref_w,
             snap / rl["publish_s"] / ref_w[1] if ref_w[1] else None),
            (f"publish {where} time", rl["publish_s"], "s", "", None, None),
            (f"reload {where} (load+update)", snap / rl["reload_s"], "MB/s", *ref_r,
             snap / rl["reload_s"] / ref_r[1] if ref_r[1] else None),
            (f"reload {where} time", rl["reload_s"], "s", "", None, None),
            (f"reload {where} peak RSS", rl["reload_peak_extra"] / r["model_bytes_fp32"],
             "x model", "", None, None),
        ]  # fmt: skip
    del mb, lim
    return out


def print_tables(results: list[dict], lim: dict[str, float], args) -> None:
    print(
        f"\nMachine ({jax.default_backend()}, {jax.devices()[0].device_kind}, "
        f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}"
        f" cores): matmul {lim['matmul_flops'] / 1e9:.1f} GFLOP/s ({args.compute_dtype}, "
        f"2048^3), memory read {lim['mem_bw'] / 1e9:.1f} GB/s (sum over 256 MB)"
    )
    for r in results:
        s = r["spec"]
        print(
            f"\n{r['family']} @ {r['shape']}: d_model {s['d_model']}, {s['n_layers']} layers, "
            f"{s['n_heads']}/{s['n_kv_heads']} heads x {s['head_dim']}, d_ff {s['d_ff']}, vocab "
            f"{s['vocab_size']}, {'tied' if s['tie_embeddings'] else 'untied'}: "
            f"{r['params'] / 1e6:.1f}M params = {r['model_bytes_fp32'] / MB:.1f} MB fp32; "
            f"checkpoint {args.ckpt_dtype} {r['ckpt_bytes'] / MB:.1f} MB in {len(r['files'])} "
            f"file(s); compute {args.compute_dtype}"
        )
        print(
            f"{'figure':<34}{'value':>12} {'unit':<9}{'reference':<22}{'ref value':>12}{'ratio':>8}"
        )
        for name, value, unit, ref, ref_value, ratio in rows(r, lim):
            rv = f"{ref_value:>12.2f}" if ref_value is not None else " " * 12
            ra = f"{ratio:>8.3f}" if ratio is not None else ""
            print(f"{name:<34}{value:>12.2f} {unit:<9}{ref:<22}{rv}{ra}")
        ideal = 1 + r["largest_tensor_fp32"] / r["model_bytes_fp32"]
        print(
            f"(import peak ideal ~{ideal:.2f}x = model + its largest tensor; "
            f"recompiles after reload: {r['recompiles_after_reload']})"
        )


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="toy")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--ckpt-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shard-mb", type=float, default=200.0)
    parser.add_argument("--fwd-batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--sample-batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gcs", action="store_true", help="also gs:// (fake-gcs-server)")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    parser.add_argument("--child", choices=["ours", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--child-uri", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_import(args.child, args.child_uri, args.repeats)))
        return
    for key, value in RUN_DEFAULTS[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.shape == "cpu" and jax.default_backend() == "cpu":
        log(
            f"cpu shape on a CPU: sampling batches {args.sample_batches}, "
            f"{args.new_tokens} new tokens, forward {args.fwd_batch}x{args.seq}"
        )
    lim = machine_limits(args.compute_dtype, args.repeats)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp, contextlib.ExitStack() as st:
        gcs = None
        if args.gcs:
            from tests.gcs_server import FakeGcs

            gcs = st.enter_context(FakeGcs())
        for family in args.families:
            results.append(run_family(family, args, Path(tmp), lim, gcs))
            gc.collect()
    print_tables(results, lim, args)
    if args.json:
        print(json.dumps({"machine": lim, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()

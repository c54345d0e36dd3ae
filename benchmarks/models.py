"""Real-architecture models end to end: checkpoint import, forward, sampling, weight reload.

For each family (Qwen3: tied, q/k norm, `rope_parameters` config; Llama 3: untied, llama3
rope scaling in the older top-level config form) at one shape (`--shape`), with random
weights, in one run:

  1. write    a random-weight Hugging Face checkpoint (config.json + safetensors in
              `--ckpt-dtype`, split into `model-0000i-of-0000n.safetensors` + index once it
              exceeds `--shard-mb`), one shard's tensors in memory at a time.
  2. import   `HFCheckpoint(dir).load_model(spec)` in a FRESH subprocess (clean RSS): wall
              time (median of `--repeats` loads in that process) and the peak RSS of the
              first load over the RSS just before it (high-water mark reset through
              /proc/self/clear_refs), divided by the model's float32 bytes. Ideal: 1.0 (the
              model itself: on CPU the params live in host memory) plus one tensor, the
              largest ("model + largest tensor"). Baseline, same run, also a fresh
              subprocess: the naive import, every file through `safetensors.numpy.load_file`
              into one dict, all converted to float32 in our layout, then device_put.
              Throughput = checkpoint bytes / import time, against plain `open().read()` of
              the same files (page-cached: the practical limit of reading them at all);
              "read+convert" is the import's own host work without any device_put.
  3. compute  the packed training forward `model(tokens, positions, segment_ids)` jitted at
              [--fwd-batch, --seq] (two segments per row), and `Sampler.sample` at each
              batch of `--sample-batches` with `--prompt`-token prompts and exactly
              `--new-tokens` new tokens (no stop id can end a row), compile excluded (a
              warm-up call per shape; the compile count is checked). Decode tokens/s =
              batch * new tokens / wall time of the call (prefill included: a short prompt
              keeps it decode-dominated). "vocab sort share" = new tokens x the time of one
              jitted `sampling_log_probs` over [batch, vocab] (top_k=0, measured alone) /
              the call: the distribution work each decode step does besides the model.
  4. reload   `WeightsPublisher.publish(flat_params(model))` to a file:// store (gs:// with
              `--gcs`), then the actor's reload path (`Actor._load` via `WeightsClient.poll`):
              `load_snapshot` + `sampler.update_params(flat)`, medians of `--repeats`
              versions; seconds, MB/s, snapshot bytes, a breakdown by step, and (in the
              fresh import subprocess, old weights resident as in an actor) the reload's
              peak RSS over the RSS before it / model bytes. References: plain
              `open().write()` + fsync of as many bytes right before each publish (a shared
              disk's rate drifts) and `open().read()` of the checkpoint (reload).

Roofline, measured in the same run on the same device: matmul FLOP/s (a jitted 2048^3
matmul in the compute dtype) and memory read bandwidth (a jitted sum over 256 MB of f32),
each the best of its measurements at the start, before each family and at the end (on a
shared machine a slower one is contention). The cost model is `tunix_tasks.policy.costs`;
with L layers, d d_model, h / kv heads of size hd, f d_ff, V vocab, P_mm the matmul params
per token = L*(2*d*h*hd + 2*d*kv*hd + 3*d*f) + d*V (the output projection, tied or not):
  forward FLOPs/token       = 2*P_mm + 4*L*h*hd*T   (T = --seq: the masked T x T attention
                              is computed in full); limit = FLOP/s / that
  decode step, batch B      FLOPs = B*(2*P_mm + 4*L*h*hd*S), S = the sampler's cache length
                            bytes = params read (float32 as stored, all but an untied
                                    embedding table, of which B rows) + the K/V cache read,
                                    2*L*B*kv*S*hd*itemsize(compute dtype)
                            time >= max(FLOPs / FLOP/s, bytes / bandwidth)
  prefill, B*N tokens       FLOPs = 2*(P_mm - d*V)*B*N + 2*d*V*B (the output layer only at
                                    each row's last token: the only logits sampling needs)
                                    + 4*L*h*hd*B*N*S, N = the prompt bucket; bytes as a step
  sampling call             limit = prefill (FLOP- or weight-read-bound) + new_tokens
                                    decode steps; tokens/s = B*new / that
"ratio" against a roofline is achieved / limit (1.0 = at the roofline; the sort/softmax over
the vocabulary, RoPE, norms and the host loop between calls are not in the limit).

    python benchmarks/models.py                      # toy shape (make bench), ~2 min
    python benchmarks/models.py --shape cpu          # 184M / 217M params, ~4 min on 2 cores
    python benchmarks/models.py --shape qwen3-0.6b   # the real Qwen3-0.6B shape (accelerator)
    python benchmarks/models.py --gcs --json         # + gs:// (fake-gcs-server); raw numbers

Reading the figures: "import peak RSS" should sit near "model + largest tensor" (import
streams tensor by tensor); the naive baseline shows what that saves. "import throughput"
against open().read() is the fraction of the plain read rate the import keeps (conversion
to float32, layout transposes and device_put cost the rest). Forward and sampling ratios
say how far the implementation is from what the device allows; "reload" is what an actor
pauses for at each new weight version, and its peak RSS what it must have free for it.
The progress log (stderr) carries elapsed seconds; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import inspect
import json
import math
import os
import shutil
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
from safetensors.numpy import load as st_load
from safetensors.numpy import save_file

from tunix_tasks.policy import costs
from tunix_tasks.policy.distribution import sampling_log_probs
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, hf_tensor_shapes
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import DEFAULT_PROMPT_BUCKETS, Sampler
from tunix_tasks.policy.spec import DecoderSpec, spec_from_hf_config
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import WeightsPublisher, encode_snapshot, load_snapshot
from tunix_tasks.testing.published import PUBLISHED_CONFIGS

from _machine import machine_limits, measure_limits, med, peak, reset_peak, rss, trim

MB = 1e6
FAMILIES = ("qwen3", "llama3")

# Model shapes (HF config keys). qwen3-0.6b is huggingface.co/Qwen/Qwen3-0.6B's config.json
# (`tunix_tasks.testing.published`); the llama3 family takes the same dimensions, untied.
_TOY = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "vocab_size": 32000,
}
SHAPES: dict[str, dict[str, int]] = {
    "toy": _TOY,
    "cpu": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 3072,
        "vocab_size": 32000,
    },
    "qwen3-0.6b": {k: PUBLISHED_CONFIGS["Qwen3-0.6B"][k] for k in _TOY},
}
# Per-shape defaults of the run flags (a flag given on the command line wins).
RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "toy": {"fwd_batch": 4, "seq": 256, "sample_batches": [1, 16, 64], "new_tokens": 16},
    # 2-core CPUs: batch 64 of a ~200M model takes minutes per call; fewer new tokens.
    "cpu": {"fwd_batch": 2, "seq": 256, "sample_batches": [1, 16], "new_tokens": 16},
    "qwen3-0.6b": {"fwd_batch": 8, "seq": 1024, "sample_batches": [1, 16, 64], "new_tokens": 64},
}


# ------------------------------------------------------------------------------ helpers


def _timed(fn, repeats: int, *, best: bool = False) -> float:
    """Median (or best) wall seconds of `fn()` (result blocked on) over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times) if best else med(times)


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

    return total / MB / _timed(read, repeats, best=True)


# ------------------------------------------------------------------------------ import (child)


def _naive_load(directory: str, spec: DecoderSpec) -> Any:
    """The naive import: whole files into a dict, all converted, then device_put."""
    from safetensors.numpy import load_file

    from tunix_tasks.policy.hf_checkpoint import _targets, _to_ours
    from tunix_tasks.policy.model import Transformer

    tensors: dict[str, np.ndarray] = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    flat = {
        ours: _to_ours(jax.numpy.asarray(tensors[t.hf_name]), layout=t.layout, dims=t.dims)
        for ours, t in _targets(spec).items()
    }
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0))))
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(flat["/".join(map(str, path))]))
    return nnx.merge(graphdef, state)


def child_import(mode: str, uri: str, repeats: int) -> dict[str, Any]:
    """Runs in a fresh process: import `uri` `repeats` times; RSS figures of the first.

    "ours" then also measures the actor's reload in this clean process: publish the model's
    params to a file:// store, then peak RSS of `load_snapshot` + `Sampler.update_params`
    over the RSS before it (old weights resident, as in an actor)."""
    ckpt = HFCheckpoint(uri)
    spec = ckpt.spec(max_seq_len=4096)
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # runtime up before baseline

    def load():
        if mode == "naive":
            return _naive_load(urlpath(uri), spec)
        return ckpt.load_model(spec)

    times, out = [], {}
    for i in range(repeats):
        model = None
        trim()
        base = rss()
        reset = reset_peak()
        t0 = time.perf_counter()
        model = load()
        jax.block_until_ready(nnx.state(model))
        times.append(time.perf_counter() - t0)
        if i == 0:
            out = {"base_rss": base, "peak_rss": peak(), "after_rss": rss(), "reset": reset}
    out.update(load_s=med(times), load_s_all=times)
    if mode == "ours":
        sampler = make_sampler(model, 64, 1)
        with tempfile.TemporaryDirectory(prefix="bench-models-reload-") as tmp:
            store = open_store(f"file://{tmp}")
            flat = flat_params(model)
            WeightsPublisher(store).publish(flat, version=0, step=0, model={})
            del flat
            trim()
            base = rss()
            reset_peak()
            got, _ = load_snapshot(store, 0)
            sampler.update_params(got)
            del got
            jax.block_until_ready(nnx.state(sampler.model))
            out.update(reload_base_rss=base, reload_peak_rss=peak())
    return out


def urlpath(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def run_child(mode: str, uri: str, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--child-uri", uri, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} import subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ roofline


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
    r["forward"]["limit_tokens_per_s"] = lim["matmul_flops"] / r["forward"]["flops_per_token"]
    for s in r["sampling"]:
        t = sampling_limit_s(
            spec,
            lim,
            s["batch"],
            s["prompt_bucket"],
            s["new_tokens"],
            s["cache_len"],
            s["kv_itemsize"],
        )
        s["limit_tokens_per_s"] = s["batch"] * s["new_tokens"] / t


def sampling_limit_s(
    spec: DecoderSpec, lim: dict, batch: int, prompt: int, new: int, cache: int, itemsize: int
) -> float:
    """Lower bound on the wall time of one sampling call (module docstring)."""
    # float32 as stored; of an untied embedding table only the B gathered rows
    nbytes = costs.weight_read_bytes(spec, batch, 4) + costs.kv_bytes(spec, batch * cache, itemsize)
    prefill = max(
        costs.prefill_flops(spec, batch * prompt, cache, logits=batch) / lim["matmul_flops"],
        nbytes / lim["mem_bw"],
    )
    step = max(
        batch * costs.forward_flops_per_token(spec, cache) / lim["matmul_flops"],
        nbytes / lim["mem_bw"],
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

    call()  # compiles every program this call shape uses
    compiles = sampler.compile_count
    wall = _timed(call, repeats)
    return batch * new / wall, wall, sampler.compile_count - compiles


def make_sampler(model, max_seq_len: int, max_batch: int) -> Sampler:
    """A sampler whose KV cache fits this run (not the spec's 4096 positions): the slot
    sampler allocates max_sequences x max_seq_len up front."""
    kwargs: dict[str, Any] = {"max_seq_len": max_seq_len}
    if "max_sequences" in inspect.signature(Sampler).parameters:
        kwargs["max_sequences"] = max_batch
    return Sampler(model, pad_id=0, stop_ids=[model.vocab_size - 1], **kwargs)


def measure_logprobs_step(batch: int, vocab: int, repeats: int) -> float:
    """Seconds of one `sampling_log_probs` over [batch, vocab] logits (top_k=0, as sampled
    here): the per-token distribution work each decode step does besides the model."""
    f = jax.jit(sampling_log_probs)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab), np.float32))
    jax.block_until_ready(f(x, jnp.float32(1.0), jnp.int32(0)))
    return _timed(lambda: f(x, jnp.float32(1.0), jnp.int32(0)), max(repeats, 3), best=True)


# ------------------------------------------------------------------------------ reload


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
    blob, _ = encode_snapshot(flat, version=repeats, step=0, model=meta)  # st_save + sha256
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
            "publish: flat_params+st_save+sha": d[0],
            "publish: write_bytes (fsync)": d[1],
            "reload: read_bytes": d[3],
            "reload: sha256": d[4],
            "reload: safetensors.load": d[5],
            "reload: update_params": d[6],
        },
    }


# ------------------------------------------------------------------------------ one family


def run_family(family: str, args, root: Path, lim: dict, gcs) -> dict[str, Any]:
    config = hf_config(family, args.shape, args.ckpt_dtype)
    spec = spec_from_hf_config(config, max_seq_len=4096)
    params = costs.total_params(spec)
    model_bytes = 4 * params
    ckdir = root / f"ckpt-{family}"
    r: dict[str, Any] = {
        "family": family,
        "shape": args.shape,
        "spec": {k: v for k, v in vars(spec).items() if k != "rope_scaling"},
        "params": params,
        "model_bytes_fp32": model_bytes,
        "largest_tensor_fp32": 4 * max(math.prod(s) for s in hf_tensor_shapes(spec).values()),
    }
    r["import_ideal_ratio"] = 1 + r["largest_tensor_fp32"] / model_bytes
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
        if "reload_peak_rss" in c:
            r["reload_peak_ratio"] = (c["reload_peak_rss"] - c["reload_base_rss"]) / model_bytes
        log(f"[{family}] import {mode}: {c['load_s']:.2f} s")
    # again after the imports: right after writing, reads can be slow (dirty pages, reclaim)
    r["read_MBps"] = max(r["read_MBps"], read_bandwidth(paths, args.repeats))
    raise_limits(lim, {"read_MBps": r["read_MBps"]})  # the page-cache read rate: run-wide
    if gcs is not None:
        uri = gcs.new_bucket_uri(f"ckpt-{family}")
        store = open_store(uri)
        for p in [ckdir / "config.json", *paths, ckdir / "model.safetensors.index.json"]:
            if p.exists():
                store.write_bytes(p.name, p.read_bytes())
        read_all = lambda: sum(len(store.read_bytes(p.name)) for p in paths)  # noqa: E731
        r["gcs_read_MBps"] = r["ckpt_bytes"] / MB / _timed(read_all, args.repeats, best=True)
        c = run_child("ours", uri, args.repeats)
        r["import_gcs"] = c
        r["import_gcs_MBps"] = r["ckpt_bytes"] / MB / c["load_s"]
        log(f"[{family}] import gs://: {c['load_s']:.2f} s")

    ckpt = HFCheckpoint(f"file://{ckdir}")
    with contextlib.suppress(AttributeError):  # a private generator: skipped if it changes
        t0 = time.perf_counter()
        from tunix_tasks.policy.hf_checkpoint import _to_ours

        for _, t, stored in ckpt._tensors(spec):  # read + convert to float32 in our layout
            jax.block_until_ready(_to_ours(jax.numpy.asarray(stored), layout=t.layout, dims=t.dims))
        r["import_read_convert_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = ckpt.load_model(spec, compute_dtype=args.compute_dtype)
    jax.block_until_ready(nnx.state(model))
    r["import_parent_s"] = time.perf_counter() - t0
    raise_limits(lim, limits(args.compute_dtype, args.repeats))
    tps = measure_forward(model, args.fwd_batch, args.seq, args.repeats)
    r["forward"] = {
        "batch": args.fwd_batch,
        "seq": args.seq,
        "tokens_per_s": tps,
        "flops_per_token": costs.forward_flops_per_token(spec, args.seq),
    }
    log(f"[{family}] forward {tps:.0f} tokens/s")

    need = args.prompt + args.new_tokens + 1
    seq = next((b for b in DEFAULT_PROMPT_BUCKETS if b >= need), need)
    sampler = make_sampler(model, seq, max(args.sample_batches))
    itemsize = jnp.dtype(args.compute_dtype).itemsize
    width = next(b for b in sampler.prompt_buckets if b >= args.prompt)
    cache = next(
        b for b in sampler.prompt_buckets if b >= min(width + args.new_tokens, spec.max_seq_len)
    )
    r["sampling"] = []
    for b in args.sample_batches:
        tps, wall, recompiles = measure_sampling(
            sampler, b, args.prompt, args.new_tokens, args.repeats
        )
        lp = measure_logprobs_step(b, spec.vocab_size, args.repeats)
        r["sampling"].append(
            {
                "batch": b,
                "prompt": args.prompt,
                "new_tokens": args.new_tokens,
                "prompt_bucket": width,
                "cache_len": cache,
                "kv_itemsize": itemsize,
                "tokens_per_s": tps,
                "call_s": wall,
                "compiles_in_measurement": recompiles,
                "logprobs_step_s": lp,
                "logprobs_share": args.new_tokens * lp / wall,
            }
        )
        log(f"[{family}] sampling batch {b}: {tps:.0f} tokens/s")

    r["reload_file"] = measure_reload(
        f"file://{root}/run-{family}", model, sampler, args.repeats, probe_dir=root
    )
    if gcs is not None:
        r["reload_gcs"] = measure_reload(gcs.new_bucket_uri(), model, sampler, args.repeats, None)
    # the reloaded weights still sample, with the programs compiled before the reload
    compiles = sampler.compile_count
    measure_sampling(sampler, args.sample_batches[0], args.prompt, args.new_tokens, 1)
    r["recompiles_after_reload"] = sampler.compile_count - compiles
    shutil.rmtree(ckdir, ignore_errors=True)
    return r


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"{time.perf_counter() - _T0:7.1f}s {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ printing


def rows(r: dict[str, Any]) -> list[tuple]:
    """(figure, value, unit, reference, reference value, ratio) rows of one family."""
    ours, naive = r["import_ours"], r["import_naive"]
    out: list[tuple] = [
        ("checkpoint write", r["write_s"], "s", "", None, None),
        (
            "import load_model file://",
            ours["load_s"],
            "s",
            "naive load_file",
            naive["load_s"],
            ours["load_s"] / naive["load_s"],
        ),
        (
            "import throughput",
            r["import_ours_MBps"],
            "MB/s",
            "open().read()",
            r["read_ref"],
            r["import_ours_MBps"] / r["read_ref"],
        ),
        (
            "import peak RSS",
            r["import_ours_peak_ratio"],
            "x model",
            "naive load_file",
            r["import_naive_peak_ratio"],
            r["import_ours_peak_ratio"] / r["import_naive_peak_ratio"],
        ),
        (
            "import peak RSS",
            r["import_ours_peak_ratio"],
            "x model",
            "model + largest tensor",
            r["import_ideal_ratio"],
            r["import_ours_peak_ratio"] / r["import_ideal_ratio"],
        ),
        (
            "import RSS after",
            r["import_ours_resident_ratio"],
            "x model",
            "naive load_file",
            r["import_naive_resident_ratio"],
            None,
        ),
    ]
    if "import_read_convert_s" in r:
        out.append(
            (
                "  import: read + convert, tensor by tensor",
                r["import_read_convert_s"],
                "s",
                "whole load_model",
                r["import_parent_s"],
                r["import_read_convert_s"] / r["import_parent_s"],
            )
        )
    if "import_gcs" in r:
        out.append(
            (
                "import gs:// throughput",
                r["import_gcs_MBps"],
                "MB/s",
                "gs:// read_bytes",
                r["gcs_read_MBps"],
                r["import_gcs_MBps"] / r["gcs_read_MBps"],
            )
        )
    f = r["forward"]
    out.append(
        (
            f"forward {f['batch']}x{f['seq']} packed",
            f["tokens_per_s"],
            "tokens/s",
            "FLOP roofline",
            f["limit_tokens_per_s"],
            f["tokens_per_s"] / f["limit_tokens_per_s"],
        )
    )
    for s in r["sampling"]:
        out.append(
            (
                f"sample b={s['batch']} {s['prompt']}+{s['new_tokens']} tok",
                s["tokens_per_s"],
                "tokens/s",
                "roofline",
                s["limit_tokens_per_s"],
                s["tokens_per_s"] / s["limit_tokens_per_s"],
            )
        )
    for s in r["sampling"]:
        out.append(
            (
                f"  b={s['batch']}: vocab sort share",
                s["logprobs_share"],
                "of call",
                "sampling_log_probs ms",
                1000 * s["logprobs_step_s"],
                None,
            )
        )
    for where in ("file", "gcs"):
        if f"reload_{where}" not in r:
            continue
        rl = r[f"reload_{where}"]
        snap = rl["snapshot_bytes"] / MB
        w_ref, r_ref = rl["plain_write_MBps"], r["read_ref"] if where == "file" else None
        out += [
            (f"snapshot {where}", snap, "MB", "", None, None),
            (f"publish {where} time", rl["publish_s"], "s", "", None, None),
            (
                f"publish {where}",
                snap / rl["publish_s"],
                "MB/s",
                "open().write()+fsync" if w_ref else "",
                w_ref,
                snap / rl["publish_s"] / w_ref if w_ref else None,
            ),
            (f"reload {where} time (load+update)", rl["reload_s"], "s", "", None, None),
            (
                f"reload {where}",
                snap / rl["reload_s"],
                "MB/s",
                "open().read()" if r_ref else "",
                r_ref,
                snap / rl["reload_s"] / r_ref if r_ref else None,
            ),
        ]
        if where == "file" and "reload_peak_ratio" in r:
            out.append(
                (
                    "reload file peak RSS (fresh process)",
                    r["reload_peak_ratio"],
                    "x model",
                    "new weights + 1 tensor",
                    r["import_ideal_ratio"],
                    r["reload_peak_ratio"] / r["import_ideal_ratio"],
                )
            )
        out += [(f"  {k}", v, "s", "", None, None) for k, v in rl["breakdown_s"].items()]
    return out


def print_tables(results: list[dict], lim: dict[str, float], args) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"\nMachine: {jax.default_backend()} ({jax.devices()[0].device_kind}, {cores} cores): "
        f"matmul {lim['matmul_flops'] / 1e9:.1f} GFLOP/s ({args.compute_dtype}, 2048^3), "
        f"memory read {lim['mem_bw'] / 1e9:.1f} GB/s (jitted sum over 256 MB), page-cache "
        f"read {lim['read_MBps']:.0f} MB/s (open().read() of the checkpoints); best of the "
        f"measurements at the start, before each family and at the end; load average "
        f"{args.load[0][0]:.1f} at the start, {args.load[1][0]:.1f} at the end"
    )
    print(
        f"Run: --shape {args.shape}, forward {args.fwd_batch}x{args.seq}, sampling batches "
        f"{args.sample_batches} x {args.prompt}-token prompts + {args.new_tokens} new tokens, "
        f"median of {args.repeats}" + (f"; {args.note}" if args.note else "")
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
            f"{'figure':<40}{'value':>11} {'unit':<9}{'reference':<23}{'ref value':>11}{'ratio':>8}"
        )
        for name, value, unit, ref, ref_value, ratio in rows(r):
            rv = f"{ref_value:>11.2f}" if ref_value is not None else " " * 11
            ra = f"{ratio:>8.3f}" if ratio is not None else ""
            print(f"{name:<40}{value:>11.3f} {unit:<9}{ref:<23}{rv}{ra}".rstrip())
        timed = sum(x["compiles_in_measurement"] for x in r["sampling"])
        print(
            f"(sampling compiles after a reload: {r['recompiles_after_reload']}; during the "
            f"timed sampling calls, after their warm-up: {timed})"
        )


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="toy")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--ckpt-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shard-mb", type=float, default=200.0)
    parser.add_argument("--fwd-batch", type=int, default=None, help="default: per shape")
    parser.add_argument("--seq", type=int, default=None, help="default: per shape")
    parser.add_argument("--sample-batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: per shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gcs", action="store_true", help="also gs:// (fake-gcs-server)")
    parser.add_argument("--json", action="store_true", help="also print the raw numbers (JSON)")
    parser.add_argument("--child", choices=["ours", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--child-uri", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_import(args.child, args.child_uri, args.repeats)))
        return
    defaults = RUN_DEFAULTS[args.shape]
    reduced = [k for k, v in defaults.items() if getattr(args, k) is None]
    for key in reduced:
        setattr(args, key, defaults[key])
    args.note = ""
    if args.shape == "cpu" and {"sample_batches", "new_tokens"} & set(reduced):
        args.note = (
            "cpu shape: sampling reduced (batches 1 and 16, 16 new tokens) to keep a 2-core "
            "run to minutes"
        )
    load = os.getloadavg()
    lim = limits(args.compute_dtype, args.repeats)
    log(f"matmul {lim['matmul_flops'] / 1e9:.0f} GFLOP/s, read {lim['mem_bw'] / 1e9:.1f} GB/s")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp, contextlib.ExitStack() as st:
        gcs = None
        if args.gcs:
            from tunix_tasks.testing.gcs_server import FakeGcs

            gcs = st.enter_context(FakeGcs())
        for family in args.families:
            results.append(run_family(family, args, Path(tmp), lim, gcs))
            gc.collect()
    raise_limits(lim, limits(args.compute_dtype, args.repeats))
    for r in results:
        apply_limits(r, lim)
    args.load = (load, os.getloadavg())
    print_tables(results, lim, args)
    if args.json:
        print(json.dumps({"machine": lim, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()

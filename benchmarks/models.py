"""Real-architecture models end to end: checkpoint import, forward, sampling, weight reload.

For each family (Qwen3: tied, q/k norm, `rope_parameters` config; Llama 3: untied, llama3
rope scaling in the older top-level config form; `--families gemma3` too: Gemma 3's five
sliding layers (window 512) to a global one, sandwich norms, GeGLU; `mistral`: every layer
sliding, window 512) at one shape
(`--shape`), with random weights, in one run:

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
                              is computed in full, and logits at every token); limit =
                              FLOP/s / that. XLA's cost analysis of the compiled forward
                              is printed next to it ("forward FLOP/s (XLA count)"): the
                              two counts agree within ~0.5% (norms, softmax, RoPE)
  decode step, batch B      FLOPs = B*(2*P_mm + 4*L*h*hd*S), S = the segment's window (the
                                    bucket `Sampler.decode_window` picks, not the cache)
                            bytes = params read (in the compute dtype, as the sampler holds
                                    them; of an untied embedding table only B rows) + the
                                    K/V read, 2*L*B*kv*S*hd*itemsize(compute dtype)
                            time >= max(FLOPs / FLOP/s, bytes / bandwidth)
  prefill, B*N tokens       FLOPs = 2*(P_mm - d*V)*B*N + 2*d*V*B (the output layer only at
                                    each row's last token: the only logits sampling needs)
                                    + 4*L*h*hd*B*N*N, N = the prompt bucket (its window);
                                    bytes as a step over N positions
  sampling call             limit = prefill (FLOP- or weight-read-bound) + new_tokens - 1
                                    decode steps (the prefill draws the first token; the
                                    steps are counted by the sampler's stats); tokens/s =
                                    B*new / that
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
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
from flax import nnx

from tunix_tasks.policy import costs
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, hf_tensor_shapes
from tunix_tasks.policy.spec import spec_from_hf_config
from tunix_tasks.storage.store import open_store

from _models_checkpoint import SHAPES, child_import, hf_config, run_child, write_checkpoint
from _models_report import print_tables
from _models_timing import (
    MB,
    apply_limits,
    limits,
    measure_forward,
    measure_reload,
    measure_sampling,
    raise_limits,
    read_bandwidth,
    sampling_rows,
    timed,
)

FAMILIES = ("qwen3", "llama3", "gemma3", "mistral")
# Per-shape defaults of the run flags (a flag given on the command line wins).
RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "toy": {"fwd_batch": 4, "seq": 256, "sample_batches": [1, 16, 64], "new_tokens": 16},
    # 2-core CPUs: batch 64 of a ~200M model takes minutes per call; fewer new tokens.
    "cpu": {"fwd_batch": 2, "seq": 256, "sample_batches": [1, 16], "new_tokens": 16},
    "qwen3-0.6b": {"fwd_batch": 8, "seq": 1024, "sample_batches": [1, 16, 64], "new_tokens": 64},
}


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"{time.perf_counter() - _T0:7.1f}s {msg}", file=sys.stderr, flush=True)


def run_family(family: str, args, root: Path, lim: dict, gcs) -> dict[str, Any]:
    """One family, every step of the module docstring; the limits are raised as measured."""
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
        c = run_child(__file__, mode, f"file://{ckdir}", args.repeats)
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
        r["gcs_read_MBps"] = r["ckpt_bytes"] / MB / timed(read_all, args.repeats, best=True)
        c = run_child(__file__, "ours", uri, args.repeats)
        r["import_gcs"] = c
        r["import_gcs_MBps"] = r["ckpt_bytes"] / MB / c["load_s"]
        log(f"[{family}] import gs://: {c['load_s']:.2f} s")

    ckpt = HFCheckpoint(f"file://{ckdir}")
    t0 = time.perf_counter()
    for _, param in ckpt.tensors(spec):  # read + convert to float32 in our layout
        jax.block_until_ready(param)
    r["import_read_convert_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = ckpt.load_model(spec, compute_dtype=args.compute_dtype)
    jax.block_until_ready(nnx.state(model))
    r["import_parent_s"] = time.perf_counter() - t0
    raise_limits(lim, limits(args.compute_dtype, args.repeats))
    tps, xla_flops = measure_forward(model, args.fwd_batch, args.seq, args.repeats)
    r["forward"] = {
        "batch": args.fwd_batch,
        "seq": args.seq,
        "tokens_per_s": tps,
        "flops_per_token": costs.forward_flops_per_token(spec, args.seq),
        "xla_flops_per_token": xla_flops,  # the compiled program's own count: a cross-check
    }
    log(f"[{family}] forward {tps:.0f} tokens/s")

    sampler, r["sampling"] = sampling_rows(model, args, log=lambda m: log(f"[{family}] {m}"))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="toy")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=["qwen3", "llama3"])
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

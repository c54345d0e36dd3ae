"""The cases of benchmarks/accelerator.py: the device's limits, sampler decode against the
memory roofline and the train step's MFU, on random weights of published shapes.

    lim = device_limits(args)        # {"mem_bw", "matmul_flops", "source"}: table or measured
    rows = decode_rows(spec, args, lim)
    row = train_row(spec, rows=4, length=2048, args=args, lim=lim)

Every case warms its programs first and checks that none compiled while it was timed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_tasks.config import config_from_dict
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy import costs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.spec import DecoderSpec, spec_from_hf_config
from tunix_tasks.testing.published import published_spec

from _machine import machine_limits, measure_limits, med
from _rooflines import Roofline
from _sampler_cases import DecodeCase, make_sampler, run_decode
from _train_cases import full_batch

#: SmolLM2-135M-Instruct's config.json (what `tunix-tasks fetch-model` imports).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}

#: Dense bf16 matmul FLOP/s and HBM bandwidth of known accelerators (vendor data sheets),
#: by a substring of `jax.Device.device_kind`; anything else is measured.
KNOWN_DEVICES: dict[str, dict[str, float]] = {
    "H200": {"matmul_flops": 989e12, "mem_bw": 4.8e12},
    "H100": {"matmul_flops": 989e12, "mem_bw": 3.35e12},
    "A100": {"matmul_flops": 312e12, "mem_bw": 2.0e12},
    "L4": {"matmul_flops": 121e12, "mem_bw": 0.3e12},
}


def model_spec(name: str, max_seq_len: int, smoke: bool) -> DecoderSpec:
    """ "smollm2" or a `published.py` name; `smoke`: 2 layers, d_model 64, vocab 512."""
    spec = (
        spec_from_hf_config(SMOLLM2, max_seq_len=max_seq_len)
        if name == "smollm2"
        else dataclasses.replace(published_spec(name), max_seq_len=max_seq_len)
    )
    if smoke:
        heads = spec.n_heads // spec.n_kv_heads
        small = {"n_layers": 2, "d_model": 64, "d_ff": 128, "vocab_size": 512, "head_dim": 16}
        spec = dataclasses.replace(spec, **small, n_heads=heads, n_kv_heads=1)
    return spec


def device_limits(args) -> dict[str, Any]:
    """The device's matmul FLOP/s and memory bandwidth: the data sheet's for a known
    accelerator, else measured here (`_machine.measure_limits`, best sample)."""
    kind = jax.devices()[0].device_kind
    for name, lim in KNOWN_DEVICES.items():
        if name in kind:
            return {**lim, "source": f"{name} data sheet", "device_kind": kind}
    lim = machine_limits(measure_limits(args.compute_dtype, 4, llc=0), 0)
    return {**lim, "source": "measured", "device_kind": kind}


def decode_rows(spec: DecoderSpec, args, lim: dict) -> list[dict[str, Any]]:
    """Steady decode tokens/s at each `--batches` over window `--window`, random weights in
    the compute dtype, against the memory roofline (weights + K/V window per step)."""
    model = Transformer(spec, rngs=nnx.Rngs(0), compute_dtype=jnp.dtype(args.compute_dtype))
    sampler = make_sampler(model, args.window, max(args.batches), args)
    cases = [DecodeCase.plan(sampler, b, args.window, args.segments) for b in args.batches]
    compiles = run_decode(cases, args.repeats, seed=0)
    assert compiles == 0, "a decode program compiled inside a timed window"
    roof = Roofline(spec, jnp.dtype(args.compute_dtype).itemsize)
    out = []
    for c in cases:
        r = c.result(roof, lim)
        out.append({k: r[k] for k in ("batch", "tokens_per_s", "ms_per_step", "limit_dram")})
        out[-1]["of_roofline"] = r["tokens_per_s"] / r["limit_dram"]
    return out


def train_row(spec: DecoderSpec, rows: int, length: int, args, lim: dict) -> dict[str, Any]:
    """`Trainer.step` on a fully packed [rows, length] batch (full fine-tuning, the compute
    dtype, per-layer remat): tokens/s and MFU (costs.train_flops per second / peak)."""
    spec = dataclasses.replace(spec, max_seq_len=length)
    model = Transformer(spec, rngs=nnx.Rngs(1), compute_dtype=jnp.dtype(args.compute_dtype))
    cfg = config_from_dict(
        {
            "model": {"preset": "tiny", "max_seq_len": length},
            "actor": {"max_episode_tokens": min(length, 192)},
            "learner": {
                "buckets": [length],
                "batch_rows": rows,
                "compute_dtype": args.compute_dtype,
                "remat": True,
            },
        }
    )
    trainer = Trainer(cfg, model)
    batch = full_batch(spec.vocab_size, rows, length)
    t0 = time.perf_counter()
    trainer.step(batch)
    first = time.perf_counter() - t0
    compiles = trainer.total_compiles
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - t0)
    assert trainer.total_compiles == compiles, "a train step compiled inside a timed window"
    step = med(times)
    flops = costs.train_flops(spec, rows * length, length)
    return {
        "rows": rows,
        "length": length,
        "first_step_s": first,
        "tokens_per_s": rows * length / step,
        "mfu": flops / step / lim["matmul_flops"],
    }

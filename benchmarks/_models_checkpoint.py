"""The checkpoints of benchmarks/models.py: random-weight Hugging Face checkpoints of each
family at each shape, and their import (ours and the naive whole-file baseline) in a fresh
process, where the actor's reload is measured too (old weights resident).

    config = hf_config("qwen3", "toy", "bfloat16")
    write_checkpoint(directory, config, spec, "bfloat16", shard_mb=200, seed=1)
    figures = run_child(script, "ours", f"file://{directory}", repeats)   # child_import
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, hf_tensor_shapes, params_from_hf
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.spec import DecoderSpec
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import WeightsPublisher, load_snapshot
from tunix_tasks.testing.published import PUBLISHED_CONFIGS

from _machine import med, peak, reset_peak, rss, trim
from _models_timing import MB, make_sampler

# Model shapes (HF config keys). qwen3-0.6b is huggingface.co/Qwen/Qwen3-0.6B's config.json
# (`tunix_tasks.testing.published`); the llama3 family takes the same dimensions, untied;
# gemma3 the same, tied, with Gemma 3's sliding layers and sandwich norms; mistral the same
# as llama3 with every layer sliding.
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


def hf_config(family: str, shape: str, ckpt_dtype: str) -> dict[str, Any]:
    """config.json of `family` at `shape`, as the Hub's checkpoints of it write it."""
    s = SHAPES[shape]
    common = {
        **s,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "gemma3":  # gemma-3-1b-it's form: five sliding layers (512), then a global one
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **{k: v for k, v in common.items() if k != "hidden_act"},
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": s["head_dim"],
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": None,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
            "torch_dtype": ckpt_dtype,
        }
    if family == "mistral":  # Mistral-7B-v0.1's form, its window (4096) cut to 512 to bind
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            **common,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10_000.0,
            "sliding_window": 512,
            "tie_word_embeddings": False,
            "torch_dtype": ckpt_dtype,
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


def naive_load(directory: str, spec: DecoderSpec) -> Transformer:
    """The naive import: whole files into a dict, all converted, then device_put."""
    tensors: dict[str, np.ndarray] = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    flat = params_from_hf(tensors, spec)
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
            return naive_load(urlpath(uri), spec)
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


def run_child(script: str, mode: str, uri: str, repeats: int) -> dict[str, Any]:
    """`child_import` in a fresh process (clean RSS): `script` re-run with `--child`."""
    cmd = [sys.executable, script, "--child", mode, "--child-uri", uri, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} import subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

"""GGUF import: a llama.cpp `.gguf` file -> the Hugging Face checkpoint directory the project reads.

This module owns turning one GGUF file into `config.json`, `model.safetensors` (float32),
`tokenizer.json` and `tokenizer_config.json` (with the chat template), which
`HFCheckpoint` (policy/hf_checkpoint.py), `HFTokenizer` and `TemplateChat` then read like
any other checkpoint. It reads the file through `gguf_file.py`, dequantizes one tensor at
a time with `gguf.quants.dequantize`, undoes llama.cpp's q/k row permutation for Llama,
takes the tokenizer files from `gguf_tokenizer.py`, and writes into a temporary directory
that is renamed into place only when complete:

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "ckpt/")   # -> Path("ckpt")
    ckpt = HFCheckpoint("ckpt"); spec = ckpt.spec(max_seq_len=2048)

Supported: architectures llama, qwen2, qwen3 (`gguf_file.ARCHS`); tensor types in
`gguf_file.SUPPORTED_TYPES`; the `gpt2` (byte-level BPE) tokenizer with a pre-tokenizer in
`gguf_tokenizer.PRE_TOKENIZERS`; llama3 rope scaling given as llama.cpp's
`rope_freqs.weight`. Anything else is refused before anything is written, with one line
(`GGUFImportError`) naming what and, where it helps, what is supported.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from tunix_tasks.policy.gguf_file import (
    ARCHS,
    SUPPORTED_TYPES,
    GgufFile,
    GGUFImportError,
    open_gguf,
)
from tunix_tasks.policy.gguf_tokenizer import tokenizer_files
from tunix_tasks.policy.hf_headers import SINGLE, hf_tensor_shapes
from tunix_tasks.policy.rope import Llama3Scaling
from tunix_tasks.policy.spec import (
    HF_FAMILIES,
    DecoderSpec,
    UnsupportedCheckpoint,
    rope_inv_freq,
    spec_from_hf_config,
)
from tunix_tasks.storage.local_folder import check_free, folder_in_place

__all__ = ["GGUFImportError", "Progress", "gguf_hf_config", "import_gguf", "unpermute_qk"]


#: `progress(done, total, tensor_name)`, called after each tensor is written.
Progress = Callable[[int, int, str], None]


# -- q/k row permutation ------------------------------------------------------------------
def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `LlamaModel.permute` of a q/k projection's rows
    ([n_heads * head_dim, ...]): it made each head's rotate-half pairs (i, i + head_dim/2)
    adjacent rows (2i, 2i + 1) for its interleaved RoPE; this puts them back in Hugging
    Face's order, exactly (a reshape and a transpose, no arithmetic)."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# -- config.json ----------------------------------------------------------------------------
def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06):
    the shortest repr that rounds to the same float32, as config.json had it."""
    return float(str(np.float32(value)))


def _llama3_scaling(
    factors: np.ndarray, theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """The llama3 `rope_scaling` whose frequency factors are llama.cpp's `rope_freqs`
    (one divisor per rotary pair). The formula depends on original_max_position_embeddings
    only through its ratios to the two freq factors, so low_freq_factor 1 and
    high_freq_factor 4 (Meta's values) lose nothing where a medium-band factor exists; the
    result is checked by recomputing every factor."""
    factors = np.asarray(factors, np.float64)
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / base
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0
    if medium.any():  # 1/f = (1 - s)/factor + s, s = (orig/wavelen - low)/(high - low)
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        orig = float(np.median(wavelen[medium] * (s * (high - low) + low)))
    else:  # the bands' edges fall between two wavelengths: orig just below the first full one
        orig = float(np.floor(wavelen[factors >= factor * (1 - 1e-6)].min()))
    scaling = Llama3Scaling(factor, low, high, round(orig))
    spec = DecoderSpec(
        "llama", 1, head_dim, 1, 1, 1, head_dim, 1, 1, rope_theta=theta, rope_scaling=scaling
    )
    ours = rope_inv_freq(spec)
    if not np.allclose(ours, (base / factors).astype(np.float32), rtol=1e-5, atol=0):
        raise GGUFImportError(
            f"{path}: tensor rope_freqs.weight holds frequency factors that are not llama3 "
            "rope scaling (supported: none, llama3)"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _config(g: GgufFile) -> dict[str, Any]:
    arch = g.arch
    family = HF_FAMILIES[ARCHS[arch][0]]

    def key(name: str) -> Any:
        return g.need(f"{arch}.{name}")

    scaling_type = g.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise GGUFImportError(
            f"{g.path}: rope scaling {scaling_type!r} is not supported (supported: none, "
            "llama3 as rope_freqs.weight)"
        )
    if g.get(f"{arch}.attention.sliding_window"):
        raise GGUFImportError(f"{g.path}: sliding-window attention is not supported")
    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(g.get(f"{arch}.attention.key_length") or d_model // n_heads)
    if int(g.get(f"{arch}.attention.value_length") or head_dim) != head_dim:
        raise GGUFImportError(f"{g.path}: attention key_length != value_length is not supported")
    theta = _f32(g.get(f"{arch}.rope.freq_base", 10_000.0))
    rope_scaling = None
    if "rope_freqs.weight" in g.tensors:
        rope_scaling = _llama3_scaling(g.dequantize("rope_freqs.weight"), theta, head_dim, g.path)
    tokens = g.need("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": family.model_type,
        "vocab_size": int(g.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": d_model,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g.get(f"{arch}.attention.head_count_kv") or n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        value = g.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = int(value)
    return config


def gguf_hf_config(src: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face `config.json` (a dict) of a GGUF file's metadata."""
    return _config(open_gguf(src))


# -- tensors -------------------------------------------------------------------------------
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name of a Hugging Face one (gguf's TensorNameMap, for these
    families)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    assert m is not None and m.group(2) in _LAYER_NAMES, hf_name
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


@dataclass(frozen=True)
class _Plan:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    unpermute_heads: (
        int  # 0: rows as stored; else undo llama.cpp's permutation over that many heads
    )


def _plan(g: GgufFile, spec: DecoderSpec) -> list[_Plan]:
    """Every HF tensor of `spec`, its GGUF tensor and transform; checked (present, shape,
    type, no tensor left over) from the tensor directory alone."""
    permuted = ARCHS[g.arch][1]
    plans = []
    for hf_name, shape in hf_tensor_shapes(spec).items():
        name = _gguf_name(hf_name)
        if name not in g.tensors:
            raise GGUFImportError(f"{g.path}: missing tensor {name} (for {hf_name})")
        if g.hf_shape(name) != shape:
            raise GGUFImportError(
                f"{g.path}: tensor {name} has shape {list(g.hf_shape(name))}, the metadata "
                f"implies {list(shape)}"
            )
        if g.type_name(name) not in SUPPORTED_TYPES:
            raise GGUFImportError(
                f"{g.path}: tensor {name} has type {g.type_name(name)}, not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        heads = 0
        if permuted and hf_name.endswith("q_proj.weight"):
            heads = spec.n_heads
        elif permuted and hf_name.endswith("k_proj.weight"):
            heads = spec.n_kv_heads
        plans.append(_Plan(hf_name, name, shape, heads))
    used = {p.gguf_name for p in plans} | {"rope_freqs.weight"}
    extra = sorted(set(g.tensors) - used)
    if extra:
        raise GGUFImportError(
            f"{g.path}: tensor(s) this {g.arch} decoder has no place for: {', '.join(extra[:5])}"
        )
    return plans


def _write_safetensors(path: Path, g: GgufFile, plans: list[_Plan], progress: Progress) -> None:
    """model.safetensors written tensor by tensor: the header first (every shape is known,
    every tensor float32), then each tensor dequantized, fixed and written, so memory holds
    one tensor at a time (the `safetensors` package only writes a whole dict at once)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * 4
        header[p.hf_name] = {
            "dtype": "F32",
            "shape": list(p.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, p in enumerate(plans, start=1):
            w = g.dequantize(p.gguf_name)
            if p.unpermute_heads:
                w = unpermute_qk(w, p.unpermute_heads)
            f.write(np.ascontiguousarray(w, dtype="<f4").tobytes())
            progress(i, len(plans), p.gguf_name)


# -- the import -----------------------------------------------------------------------------
def _no_progress(done: int, total: int, name: str) -> None:
    pass


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> Path:
    """Convert the GGUF file `src` into the checkpoint directory `dest` (local; it must not
    exist, or be empty). Everything is checked before a byte is written; the files are
    written into a temporary sibling directory renamed to `dest` at the end, so `dest`
    either is complete or does not exist. Returns `dest`."""
    dest = Path(dest)
    check_free(dest, error=GGUFImportError)
    g = open_gguf(src)
    config = _config(g)
    try:
        spec = spec_from_hf_config(config, max_seq_len=config["max_position_embeddings"])
    except UnsupportedCheckpoint as err:
        raise GGUFImportError(f"{g.path}: {err}") from None
    plans = _plan(g, spec)
    tokenizer_json, tokenizer_config = tokenizer_files(g)
    n_tokens = tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    if n_tokens > spec.vocab_size:
        raise GGUFImportError(
            f"{g.path}: the tokenizer has {n_tokens} tokens, the embedding {spec.vocab_size} rows"
        )
    with folder_in_place(dest) as tmp:
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_safetensors(tmp / SINGLE, g, plans, progress or _no_progress)
    return dest

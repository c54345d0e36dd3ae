"""Memory per model size, computed from the real Hugging Face shapes (no network, no jax).

For Qwen3-0.6B, Qwen3-8B, Llama-3.1-8B and Llama-3.1-70B it prints markdown tables for
`docs/models.md`: parameter counts, learner memory (FSDP), actor memory (KV cache), and how
many chips of a TPU v5e, a TPU v5p and an NVIDIA H200 each needs.

    python benchmarks/model_memory.py          # markdown tables
    python benchmarks/model_memory.py --json   # the same numbers as JSON

Shapes. `CONFIGS` holds the fields of each model's `config.json` that the formulas use,
under the same keys. Sources (read from stored public copies of the files):
  Qwen3-0.6B     huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json; cross-checked with
                 AI-Hypercomputer/maxtext src/MaxText/configs/models/qwen3-0.6b.yml
  Qwen3-8B       huggingface.co/Qwen/Qwen3-8B config.json as quoted in citsjtu2020/LLM-Prof
                 sglang/Model_Config.md; maxtext .../models/qwen3-8b.yml
  Llama-3.1-8B   huggingface.co/meta-llama/Llama-3.1-8B config.json as quoted in
                 citsjtu2020/LLM-Prof sglang/Model_Config.md; maxtext .../llama3.1-8b.yml
  Llama-3.1-70B  huggingface.co/meta-llama/Llama-3.1-70B config.json (public copies of it);
                 maxtext .../models/llama3.1-70b.yml
The Llama configs carry no `head_dim`: transformers then uses hidden_size //
num_attention_heads (= 128, as maxtext's `head_dim: 128`). Qwen3 (`model_type` "qwen3")
adds an RMSNorm over head_dim to q and to k in every layer. No biases anywhere.

Formulas (h hidden_size, I intermediate_size, L layers, nq / nkv heads, d head_dim,
V vocab_size, T tokens in a training row, C context of an actor sequence):
  params      = V*h (embedding) + L*[h*nq*d + 2*h*nkv*d + nq*d*h (q,k,v,o)
                + 3*h*I (gate, up, down) + 2*h (two RMSNorms) + 2*d (q/k norm, Qwen3 only)]
                + h (final norm) + V*h (lm_head, unless tie_word_embeddings)
  learner state, FSDP-sharded evenly over the chips, two regimes:
                fp32: fp32 params + fp32 grads + AdamW m, v fp32   = 16 bytes/param
                bf16: bf16 params + bf16 grads + AdamW m, v fp32   = 12 bytes/param
  gathered    = 2 * 2 * max(one layer's params, V*h): the largest weight FSDP all-gathers
                at once (a layer or the vocab matrix), unsharded in bf16, plus its gradient
  activations of one row of T tokens, per-layer rematerialisation (jax.checkpoint per block),
  bf16 activations, fp32 attention scores and logits:
    residuals = L*T*h*2                 the saved input of every layer
    layer     = 2 * 2*T*(3h + 2*nq*d + 2*nkv*d + 3I) + nq*B*T*(4+2)
                one layer recomputed in the backward: its normed inputs, q, k, v,
                attention output, residual, gate, up, silu(gate)*up, and their gradients
                (the 2*), plus fp32 scores + bf16 probabilities of one query block of
                B = min(512, T) rows (chunked/flash attention)
    logits    = 2*T*V*4                 fp32 logits and their log-softmax (or gradient)
    dense     = nq*T*T*(4+2)            for comparison: one layer's full TxT scores + probs,
                what dense attention (`learner.attention_block` 0, or rows no longer than
                it) holds instead
  Without remat (`learner.remat` false, the default) every layer keeps its working set:
  about L * layer instead of residuals + layer.
  KV cache    = 2 (K and V) * L * nkv * d * C * 2 bytes (bf16) per sequence
  actor weights = 2 bytes/param (bf16)

Chip rules (HBM per chip: v5e 16 GiB, v5p 95 GiB, H200 139 GiB usable of its 141 GB):
  learner chips = the smallest power of two n with state/n <= 0.8 * HBM; the other 20% is
                  headroom for the gathered weights, activations, XLA temporaries and
                  fragmentation.
  rows/chip     = floor((HBM - state/n - gathered) / activations per row) at that n, for the
                  bf16 regime: the batch each chip can process (0: use 2n chips, or a
                  chunked loss / shorter rows).
  actor chips   = the smallest power of two n with weights/n <= 0.8 * HBM: the chips of
                  one actor replica (1 unless the model does not fit one chip; n > 1 means
                  tensor parallelism over the heads).
  seqs/replica  = floor((0.8 * HBM - weights/n) / (KV per sequence / min(n, nkv))): the
                  concurrent sequences of context C the replica holds (beyond nkv chips
                  the KV heads are replicated, so the KV cache shards at most nkv ways).
These are budgets from shapes, not measurements: an XLA/CUDA runtime reserves some HBM,
and compiled programs may keep more temporaries than the working set counted here.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

GiB = 2**30

# The config.json fields the formulas use, keys as in the files (sources: module docstring).
CONFIGS: dict[str, dict] = {
    "Qwen3-0.6B": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "Llama-3.1-70B": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}

# Published sizes, for the cross-check: Qwen model cards ("Number of Parameters: 0.6B",
# "8.2B"); the Hugging Face hub's size for the Llama-3.1 safetensors (8.03B, 70.6B).
PUBLISHED_PARAMS: dict[str, float] = {
    "Qwen3-0.6B": 0.6e9,
    "Qwen3-8B": 8.2e9,
    "Llama-3.1-8B": 8.03e9,
    "Llama-3.1-70B": 70.6e9,
}

STATE_BYTES_PER_PARAM = {"fp32": 16, "bf16": 12}  # params + grads + AdamW m, v
HEADROOM = 0.2  # of HBM, kept free when sizing the chips for state or weights
ATTN_BLOCK = 512  # query rows of one attention block (chunked/flash attention)
TRAIN_LENGTHS = (2048, 8192)
CONTEXTS = (4096, 32768)


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelShape:
        return cls(
            name=name,
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab=cfg["vocab_size"],
            tied=cfg["tie_word_embeddings"],
            qk_norm=cfg["model_type"] == "qwen3",
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        mlp = 3 * h * self.intermediate
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def params(self) -> int:
        lm_head = 0 if self.tied else self.embedding_params
        return self.embedding_params + self.layers * self.layer_params + self.hidden + lm_head

    @property
    def non_embedding_params(self) -> int:
        return self.layers * self.layer_params + self.hidden


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: int


ACCELERATORS = (
    Accelerator("TPU v5e", 16 * GiB),
    Accelerator("TPU v5p", 95 * GiB),
    Accelerator("H200", 139 * GiB),  # 141 GB on the datasheet; ~139 GiB allocatable
)


def shapes() -> list[ModelShape]:
    return [ModelShape.from_config(name, cfg) for name, cfg in CONFIGS.items()]


# -- learner ------------------------------------------------------------------------------


def learner_state_bytes(m: ModelShape, regime: str) -> int:
    return m.params * STATE_BYTES_PER_PARAM[regime]


def gathered_bytes(m: ModelShape) -> int:
    return 2 * 2 * max(m.layer_params, m.embedding_params)


def activation_bytes(m: ModelShape, tokens: int) -> dict[str, int]:
    """Bytes one training row of `tokens` tokens needs (formulas in the module docstring)."""
    t, h, d = tokens, m.hidden, m.head_dim
    block = min(ATTN_BLOCK, t)
    residuals = m.layers * t * h * 2
    tensors = 3 * h + 2 * m.heads * d + 2 * m.kv_heads * d + 3 * m.intermediate
    layer = 2 * 2 * t * tensors + m.heads * block * t * (4 + 2)
    logits = 2 * t * m.vocab * 4
    return {
        "residuals": residuals,
        "layer": layer,
        "logits": logits,
        "total": residuals + layer + logits,
        "dense_scores": m.heads * t * t * (4 + 2),
    }


def min_chips(nbytes: int, hbm_bytes: int) -> int:
    """Smallest power of two n with nbytes / n <= (1 - HEADROOM) * hbm_bytes."""
    n = 1
    while nbytes / n > (1 - HEADROOM) * hbm_bytes:
        n *= 2
    return n


def learner_chips(m: ModelShape, acc: Accelerator, regime: str) -> int:
    return min_chips(learner_state_bytes(m, regime), acc.hbm_bytes)


def rows_per_chip(m: ModelShape, acc: Accelerator, tokens: int, regime: str = "bf16") -> int:
    state = learner_state_bytes(m, regime)
    free = acc.hbm_bytes - state / learner_chips(m, acc, regime) - gathered_bytes(m)
    return max(0, math.floor(free / activation_bytes(m, tokens)["total"]))


# -- actor --------------------------------------------------------------------------------


def weight_bytes(m: ModelShape) -> int:
    return 2 * m.params  # bf16


def kv_bytes(m: ModelShape, context: int, bytes_per_value: int = 2) -> int:
    """KV cache of one sequence: 2 (K, V) * layers * kv_heads * head_dim * context * bytes."""
    return 2 * m.layers * m.kv_heads * m.head_dim * context * bytes_per_value


def actor_chips(m: ModelShape, acc: Accelerator) -> int:
    return min_chips(weight_bytes(m), acc.hbm_bytes)


def sequences_per_replica(m: ModelShape, acc: Accelerator, context: int) -> int:
    """Concurrent sequences of `context` tokens one actor replica (`actor_chips` chips) holds.

    Each chip keeps 1/n of the weights and 1/min(n, kv_heads) of every sequence's KV cache:
    beyond kv_heads chips the KV heads are replicated, not split further.
    """
    n = actor_chips(m, acc)
    free_per_chip = (1 - HEADROOM) * acc.hbm_bytes - weight_bytes(m) / n
    kv_per_chip = kv_bytes(m, context) / min(n, m.kv_heads)
    return max(0, math.floor(free_per_chip / kv_per_chip))


# -- report -------------------------------------------------------------------------------


def report() -> dict:
    models = {}
    for m in shapes():
        learner = {
            "state_bytes": {r: learner_state_bytes(m, r) for r in STATE_BYTES_PER_PARAM},
            "gathered_bytes": gathered_bytes(m),
            "activation_bytes_per_row": {t: activation_bytes(m, t) for t in TRAIN_LENGTHS},
            "chips": {
                a.name: {r: learner_chips(m, a, r) for r in STATE_BYTES_PER_PARAM}
                for a in ACCELERATORS
            },
            "rows_per_chip_bf16": {
                a.name: {t: rows_per_chip(m, a, t) for t in TRAIN_LENGTHS} for a in ACCELERATORS
            },
        }
        actor = {
            "weight_bytes": weight_bytes(m),
            "kv_bytes_per_token": kv_bytes(m, 1),
            "kv_bytes_per_sequence": {c: kv_bytes(m, c) for c in CONTEXTS},
            "chips": {a.name: actor_chips(m, a) for a in ACCELERATORS},
            "sequences_per_replica": {
                a.name: {c: sequences_per_replica(m, a, c) for c in CONTEXTS} for a in ACCELERATORS
            },
        }
        models[m.name] = {
            "config": CONFIGS[m.name],
            "shape": asdict(m),
            "params": m.params,
            "non_embedding_params": m.non_embedding_params,
            "published_params": PUBLISHED_PARAMS[m.name],
            "learner": learner,
            "actor": actor,
        }
    return {
        "assumptions": {
            "state_bytes_per_param": STATE_BYTES_PER_PARAM,
            "headroom": HEADROOM,
            "attention_block": ATTN_BLOCK,
            "hbm_bytes": {a.name: a.hbm_bytes for a in ACCELERATORS},
        },
        "models": models,
    }


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / 2**20:,.0f} MiB"


def _b(n: float) -> str:
    return f"{n / 1e9:.3f}B"


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown() -> str:
    ms = shapes()
    out = ["### Shapes and parameters", ""]
    out.append(
        _table(
            ["Model", "layers", "hidden", "MLP", "heads q/kv", "head_dim", "vocab", "tied",
             "params", "non-embedding", "published"],
            [
                [m.name, m.layers, m.hidden, m.intermediate, f"{m.heads}/{m.kv_heads}",
                 m.head_dim, m.vocab, "yes" if m.tied else "no", _b(m.params),
                 _b(m.non_embedding_params), f"{PUBLISHED_PARAMS[m.name] / 1e9:g}B"]
                for m in ms
            ],
        )
    )  # fmt: skip
    out += ["", "### Learner: state, sharded evenly by FSDP", ""]
    out.append(
        _table(
            ["Model", "fp32 state (16 B/param)", "bf16 state (12 B/param)",
             "largest gathered weight + grad (bf16)"],
            [
                [m.name, _gib(learner_state_bytes(m, "fp32")),
                 _gib(learner_state_bytes(m, "bf16")), _gib(gathered_bytes(m))]
                for m in ms
            ],
        )
    )  # fmt: skip
    out += ["", "### Learner: activations of one row of T tokens (per-layer remat)", ""]
    rows = []
    for m in ms:
        for t in TRAIN_LENGTHS:
            a = activation_bytes(m, t)
            rows.append(
                [m.name, t, _gib(a["residuals"]), _gib(a["layer"]), _gib(a["logits"]),
                 _gib(a["total"]), _gib(a["dense_scores"])]
            )  # fmt: skip
    out.append(
        _table(
            ["Model", "T", "saved residuals", "one layer (chunked attn)", "fp32 logits",
             "total / row", "unchunked TxT scores (one layer)"],
            rows,
        )
    )  # fmt: skip
    out += ["", "### Learner: minimum chips (power of 2, state <= 80% HBM) and rows per chip", ""]
    rows = []
    for m in ms:
        for a in ACCELERATORS:
            rows.append(
                [m.name, a.name, learner_chips(m, a, "fp32"), learner_chips(m, a, "bf16")]
                + [rows_per_chip(m, a, t) for t in TRAIN_LENGTHS]
            )
    out.append(
        _table(
            ["Model", "chip", "chips fp32", "chips bf16"]
            + [f"rows/chip T={t} (bf16)" for t in TRAIN_LENGTHS],
            rows,
        )
    )
    out += [
        "",
        "rows/chip 0: at that chip count the state leaves too little HBM for one row; use 2x",
        "the chips, a chunked loss (the fp32 logits dominate small models), or shorter rows.",
    ]
    out += ["", "### Actor: bf16 weights and KV cache (bf16)", ""]
    out.append(
        _table(
            ["Model", "weights", "KV / token"] + [f"KV / seq @{c // 1024}k" for c in CONTEXTS],
            [
                [m.name, _gib(weight_bytes(m)), f"{kv_bytes(m, 1) // 1024} KiB"]
                + [_gib(kv_bytes(m, c)) for c in CONTEXTS]
                for m in ms
            ],
        )
    )
    out += ["", "### Actor: concurrent sequences per replica (weights + KV <= 80% HBM)", ""]
    rows = []
    for m in ms:
        for a in ACCELERATORS:
            rows.append(
                [m.name, a.name, actor_chips(m, a)]
                + [f"{sequences_per_replica(m, a, c):,}" for c in CONTEXTS]
            )
    out.append(
        _table(
            ["Model", "chip", "chips / replica"]
            + [f"seqs / replica @{c // 1024}k" for c in CONTEXTS],
            rows,
        )
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)
    print(json.dumps(report(), indent=2) if args.json else markdown())


if __name__ == "__main__":
    main()

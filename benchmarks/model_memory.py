"""Memory per model size, computed from the real Hugging Face shapes (no network, no jax).

For Qwen3-0.6B, Qwen3-8B, Llama-3.1-8B and Llama-3.1-70B it prints markdown tables for
`docs/models.md`: parameter counts, learner memory (FSDP), actor memory (KV cache), and how
many chips of a TPU v5e, a TPU v5p and an NVIDIA H200 each needs.

    python benchmarks/model_memory.py          # markdown tables
    python benchmarks/model_memory.py --json   # the same numbers as JSON

Shapes: `tunix_tasks.testing.published` (each model's `config.json` fields and sources, as
a `DecoderSpec`). Formulas: `tunix_tasks.policy.costs` (parameters, KV cache, weights,
learner state, activations) and the chip rules of `tunix_tasks.frontdoor.planning`; in
short (h hidden_size, I intermediate_size, L layers, nq / nkv heads, d head_dim, V
vocab_size, T tokens in a training row, C context of an actor sequence):
  params      = V*h (embedding) + L*[h*nq*d + 2*h*nkv*d + nq*d*h (q,k,v,o)
                + 3*h*I (gate, up, down) + 2*h (two RMSNorms) + 2*d (q/k norm, Qwen3 only)]
                + h (final norm) + V*h (lm_head, unless tie_word_embeddings)
  learner state, FSDP-sharded evenly over the chips, two regimes:
                `learner.param_dtype`, what `Trainer` holds (STATE_BYTES_PER_PARAM,
                measured against the code by tests/unit/learner/test_master_copy.py):
                fp32: fp32 params + fp32 grads + AdamW m, v fp32          = 16 bytes/param
                bf16: bf16 params + bf16 grads + fp32 master + m, v fp32  = 16 bytes/param
                The same memory: bf16 params save compute (no cast per use) and FSDP
                all-gather bytes, not state; a smaller state would need bf16 AdamW
                moments (12) or no separate grads, which the code does not have.
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
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_tasks.frontdoor.planning import (
    ACCELERATORS,
    HEADROOM,
    GiB,
    actor_chips,
    learner_chips,
    rows_per_chip,
    sequences_per_replica,
)
from tunix_tasks.policy.costs import (
    STATE_BYTES_PER_PARAM,
    activation_bytes,
    gathered_bytes,
    kv_bytes,
    learner_state_bytes,
    non_embedding_params,
    total_params,
    weight_bytes,
)
from tunix_tasks.policy.spec import DecoderSpec
from tunix_tasks.testing.published import PUBLISHED_CONFIGS, PUBLISHED_PARAMS, published_spec

ATTN_BLOCK = 512  # query rows of one attention block (`activation_bytes`' default)
TRAIN_LENGTHS = (2048, 8192)
CONTEXTS = (4096, 32768)


def specs() -> dict[str, DecoderSpec]:
    return {name: published_spec(name) for name in PUBLISHED_CONFIGS}


# -- report -------------------------------------------------------------------------------


def report() -> dict:
    models = {}
    for name, m in specs().items():
        learner = {
            "state_bytes": {r: learner_state_bytes(m, r) for r in STATE_BYTES_PER_PARAM},
            "gathered_bytes": gathered_bytes(m),
            "activation_bytes_per_row": {
                t: activation_bytes(m, t, ATTN_BLOCK) for t in TRAIN_LENGTHS
            },
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
        models[name] = {
            "config": PUBLISHED_CONFIGS[name],
            "spec": dataclasses.asdict(m),
            "params": total_params(m),
            "non_embedding_params": non_embedding_params(m),
            "published_params": PUBLISHED_PARAMS[name],
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
    ms = specs()
    out = ["### Shapes and parameters", ""]
    header = ["Model", "layers", "hidden", "MLP", "heads q/kv", "head_dim", "vocab", "tied"]
    out.append(
        _table(
            [*header, "params", "non-embedding", "published"],
            [
                [
                    *(name, m.n_layers, m.d_model, m.d_ff, f"{m.n_heads}/{m.n_kv_heads}"),
                    *(m.head_dim, m.vocab_size, "yes" if m.tie_embeddings else "no"),
                    *(_b(total_params(m)), _b(non_embedding_params(m))),
                    f"{PUBLISHED_PARAMS[name] / 1e9:g}B",
                ]
                for name, m in ms.items()
            ],
        )
    )
    out += ["", "### Learner: state, sharded evenly by FSDP", ""]
    out.append(
        _table(
            [
                "Model",
                f"param_dtype float32 ({STATE_BYTES_PER_PARAM['fp32']} B/param)",
                f"param_dtype bfloat16 ({STATE_BYTES_PER_PARAM['bf16']} B/param)",
                "largest gathered weight + grad (bf16)",
            ],
            [
                [
                    name,
                    _gib(learner_state_bytes(m, "fp32")),
                    _gib(learner_state_bytes(m, "bf16")),
                    _gib(gathered_bytes(m)),
                ]
                for name, m in ms.items()
            ],
        )
    )
    out += ["", "### Learner: activations of one row of T tokens (per-layer remat)", ""]
    rows = []
    for name, m in ms.items():
        for t in TRAIN_LENGTHS:
            a = activation_bytes(m, t, ATTN_BLOCK)
            parts = ("residuals", "layer", "logits", "total", "dense_scores")
            rows.append([name, t, *(_gib(a[k]) for k in parts)])
    out.append(
        _table(
            [
                "Model",
                "T",
                "saved residuals",
                "one layer (chunked attn)",
                "fp32 logits",
                "total / row",
                "unchunked TxT scores (one layer)",
            ],
            rows,
        )
    )
    out += ["", "### Learner: minimum chips (power of 2, state <= 80% HBM) and rows per chip", ""]
    rows = []
    for name, m in ms.items():
        for a in ACCELERATORS:
            rows.append(
                [name, a.name, learner_chips(m, a, "fp32"), learner_chips(m, a, "bf16")]
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
                [name, _gib(weight_bytes(m)), f"{kv_bytes(m, 1) // 1024} KiB"]
                + [_gib(kv_bytes(m, c)) for c in CONTEXTS]
                for name, m in ms.items()
            ],
        )
    )
    out += ["", "### Actor: concurrent sequences per replica (weights + KV <= 80% HBM)", ""]
    rows = []
    for name, m in ms.items():
        for a in ACCELERATORS:
            rows.append(
                [name, a.name, actor_chips(m, a)]
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

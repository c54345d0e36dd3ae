"""The cost model of a decoder: parameters, FLOPs and bytes, from its `DecoderSpec` alone.

Pure arithmetic over the shapes (no JAX, nothing built): what the benchmarks hold measured
throughput against and what chip planning (`frontdoor/planning.py`) sizes memory by. L
layers, d d_model, H / KV query / key-value heads of size hd, f d_ff, V vocab:

  params       embedding V*d; per layer d*H*hd + 2*d*KV*hd + H*hd*d (q, k, v, o)
               + 3*d*f (gate, up, down) + 2*d (two RMSNorms) [+ 2*hd: q/k norm, Qwen3]
               [+ (H + 2*KV)*hd: q/k/v bias, Qwen2]; total = embedding + L*layer + d (final
               norm) + V*d (output layer, unless tied: a tied table is counted once)
  matmul       P_mm = L*(2*d*H*hd + 2*d*KV*hd + 3*d*f) + d*V: the weights one token is
               multiplied by (the embedding is a gather, the output layer a matmul, tied
               or not); a multiply-add is 2 FLOPs
  forward      per token attending over T positions: 2*P_mm + 4*L*H*hd*T (QK^T and PV;
               masked positions are computed)
  prefill      N tokens over a window W, logits at n of them (sampling needs each row's
               last): 2*(P_mm - d*V)*N + 2*d*V*n + 4*L*H*hd*N*W
  train step   3 x the forward (the backward is twice the forward)
  KV cache     2 (K, V) * L * KV * hd * itemsize bytes per token
  sampler      weights + the slot cache ((slots + 1 scratch) x max_seq_len positions) + the
               decode working set (up to min(rows, slots) x max_seq_len positions);
               `sampler_slots`: the most slots a memory budget holds
  weights      params * itemsize; one step of R rows reads all of them but, of an untied
               embedding table, only the R rows it gathers
  learner      params * bytes per param of state (params, grads, AdamW m and v), the
               largest weight FSDP gathers at once, and one training row's activations
               under per-layer rematerialisation (`activation_bytes`)
"""

from __future__ import annotations

from tunix_tasks.policy.spec import DecoderSpec

__all__ = [
    "HEADROOM",
    "STATE_BYTES_PER_PARAM",
    "activation_bytes",
    "attention_flops",
    "embedding_params",
    "forward_flops_per_token",
    "gathered_bytes",
    "kv_bytes",
    "layer_params",
    "learner_state_bytes",
    "matmul_params",
    "non_embedding_params",
    "prefill_flops",
    "sampler_bytes",
    "sampler_slots",
    "total_params",
    "train_flops",
    "weight_bytes",
    "weight_read_bytes",
]

#: Of a device's memory, kept free when sizing what it holds (XLA temporaries, activations,
#: fragmentation); chip planning (`frontdoor/planning.py`) and `build_sampler` use it.
HEADROOM = 0.2

#: Learner state per trained parameter, as `Trainer` holds it, by `learner.param_dtype`
#: (fp32: float32, bf16: bfloat16): params + grads in that dtype + AdamW m, v in float32,
#: and with bfloat16 the float32 master copy in the optimizer state
#: (`learner/master_copy.py`); tests/unit/learner/test_master_copy.py measures it.
STATE_BYTES_PER_PARAM = {"fp32": 4 + 4 + 8, "bf16": 2 + 2 + 4 + 8}


# -- parameters ---------------------------------------------------------------------------


def embedding_params(spec: DecoderSpec) -> int:
    """The token embedding table (V x d); the output layer has as many."""
    return spec.vocab_size * spec.d_model


def layer_params(spec: DecoderSpec) -> int:
    """One decoder block: attention, gated MLP, its norms (four with sandwich norms; q/k
    norm, q/k/v bias)."""
    d, hd, q, kv = spec.d_model, spec.head_dim, spec.n_heads * spec.head_dim, spec.n_kv_heads
    attention = 2 * d * q + 2 * d * kv * hd
    norms = (4 if spec.sandwich_norms else 2) * d + (2 * hd if spec.qk_norm else 0)
    bias = q + 2 * kv * hd if spec.qkv_bias else 0
    return attention + 3 * d * spec.d_ff + norms + bias


def non_embedding_params(spec: DecoderSpec) -> int:
    """Every block and the final norm: the model cards' "non-embedding" count."""
    return spec.n_layers * layer_params(spec) + spec.d_model


def total_params(spec: DecoderSpec) -> int:
    """Every parameter, a tied embedding/output table once."""
    tables = 1 if spec.tie_embeddings else 2
    return tables * embedding_params(spec) + non_embedding_params(spec)


# -- FLOPs --------------------------------------------------------------------------------


def matmul_params(spec: DecoderSpec) -> int:
    """P_mm: the weights one token's forward multiplies by (output layer included)."""
    d, hd = spec.d_model, spec.head_dim
    per_layer = 2 * d * spec.n_heads * hd + 2 * d * spec.n_kv_heads * hd + 3 * d * spec.d_ff
    return spec.n_layers * per_layer + embedding_params(spec)


def attention_flops(spec: DecoderSpec, queries: int, window: int) -> float:
    """QK^T and PV of `queries` tokens, each over `window` positions (masked ones too)."""
    return 4.0 * spec.n_layers * spec.n_heads * spec.head_dim * queries * window


def forward_flops_per_token(spec: DecoderSpec, window: int) -> float:
    """One token's forward, logits included, attending over `window` positions."""
    return 2.0 * matmul_params(spec) + attention_flops(spec, 1, window)


def prefill_flops(spec: DecoderSpec, tokens: int, window: int, logits: int) -> float:
    """A prefill of `tokens` tokens over `window` positions that needs the logits of only
    `logits` of them (one per row for sampling): the output layer runs on those alone."""
    out = embedding_params(spec)
    return (
        2.0 * (matmul_params(spec) - out) * tokens
        + 2.0 * out * logits
        + attention_flops(spec, tokens, window)
    )


def train_flops(spec: DecoderSpec, tokens: int, length: int) -> float:
    """Forward + backward (3 x forward) of `tokens` tokens in rows of `length`."""
    return 3.0 * tokens * forward_flops_per_token(spec, length)


# -- bytes --------------------------------------------------------------------------------


def kv_bytes(spec: DecoderSpec, tokens: int, itemsize: int = 2) -> int:
    """KV cache of `tokens` positions (summed over sequences): 2 * L * KV * hd * itemsize each."""
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * tokens * itemsize


def weight_bytes(spec: DecoderSpec, itemsize: int = 2) -> int:
    """Every parameter at `itemsize` bytes (2: bfloat16)."""
    return total_params(spec) * itemsize


def sampler_bytes(
    spec: DecoderSpec, *, slots: int, max_seq_len: int, itemsize: int = 2, rows: int = 0
) -> int:
    """What one sampler with `slots` KV-cache slots decoding up to `rows` of them at once
    (0: every slot) holds at most: its weights, the slot cache (+1 scratch slot for batch
    padding) and the decode working set at the longest window (`policy/lanes.py`)."""
    lanes = min(rows, slots) if rows else slots
    positions = (slots + 1 + lanes) * max_seq_len
    return weight_bytes(spec, itemsize) + kv_bytes(spec, positions, itemsize)


def sampler_slots(
    spec: DecoderSpec, *, budget_bytes: float, max_seq_len: int, itemsize: int = 2, rows: int = 0
) -> int:
    """The most slots with `sampler_bytes` within `budget_bytes` (0: not even one)."""
    free = budget_bytes - weight_bytes(spec, itemsize) - kv_bytes(spec, max_seq_len, itemsize)
    both = max(0, int(free // kv_bytes(spec, 2 * max_seq_len, itemsize)))  # a lane per slot
    if not rows or both < rows:
        return both
    return int(
        (free - kv_bytes(spec, rows * max_seq_len, itemsize))
        // kv_bytes(spec, max_seq_len, itemsize)
    )


def weight_read_bytes(spec: DecoderSpec, rows: int, itemsize: int) -> int:
    """Weight bytes one step over `rows` tokens reads: all of them, except that an untied
    embedding table is only gathered, one row per token (a tied one is the output layer)."""
    n = total_params(spec)
    if not spec.tie_embeddings:
        n -= embedding_params(spec) - rows * spec.d_model
    return n * itemsize


def learner_state_bytes(spec: DecoderSpec, regime: str) -> int:
    """Params + grads + AdamW moments in a `STATE_BYTES_PER_PARAM` regime."""
    return total_params(spec) * STATE_BYTES_PER_PARAM[regime]


def gathered_bytes(spec: DecoderSpec) -> int:
    """The largest weight FSDP all-gathers at once (a layer or the vocabulary table),
    unsharded in bfloat16, plus its gradient."""
    return 2 * 2 * max(layer_params(spec), embedding_params(spec))


def activation_bytes(spec: DecoderSpec, tokens: int, attention_block: int = 512) -> dict[str, int]:
    """One training row of `tokens` tokens under per-layer remat, bfloat16 activations,
    fp32 scores and logits: the saved input of every layer (`residuals`), one layer
    recomputed in the backward with its gradients and the fp32 scores + bf16 probabilities
    of one `attention_block` of queries (`layer`), fp32 logits and their log-softmax
    (`logits`); `dense_scores` is one layer's full T x T scores, for comparison."""
    t, d, hd, h = tokens, spec.d_model, spec.head_dim, spec.n_heads
    block = min(attention_block, t)
    residuals = spec.n_layers * t * d * 2
    tensors = 3 * d + 2 * h * hd + 2 * spec.n_kv_heads * hd + 3 * spec.d_ff
    layer = 2 * 2 * t * tensors + h * block * t * (4 + 2)
    logits = 2 * t * spec.vocab_size * 4
    return {
        "residuals": residuals,
        "layer": layer,
        "logits": logits,
        "total": residuals + layer + logits,
        "dense_scores": h * t * t * (4 + 2),
    }

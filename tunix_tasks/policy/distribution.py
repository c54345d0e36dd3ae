"""The sampling distribution: what the sampler draws from and the learner scores with.

Both must use these functions so behaviour log-probs match the learner's recomputation:
`sampling_logits` / `sampling_log_probs` (temperature, top-k), `token_logprobs` over full
logits, and
`chunked_target_logprobs`, the learner's memory-lean form that never holds [B, T, V].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "chunked_target_logprobs",
    "output_logits",
    "sampling_log_probs",
    "sampling_logits",
    "token_logprobs",
]


def output_logits(hidden: jax.Array, w_out: jax.Array) -> jax.Array:
    """Final hidden states [..., d] x output matrix [d, V] -> float32 logits [..., V]."""
    return jnp.einsum("...d,dv->...v", hidden, w_out, preferred_element_type=jnp.float32).astype(
        jnp.float32
    )


def sampling_logits(
    logits: jax.Array, temperature: float | jax.Array = 1.0, top_k: int | jax.Array = 0
) -> jax.Array:
    """Logits [..., V] of the distribution tokens are sampled from: logits / temperature,
    restricted (-inf elsewhere) to the top_k largest when top_k > 0 (ties at the k-th value
    are all kept). `temperature` and `top_k` are scalars or arrays broadcastable to
    `logits[..., 0]` (per row), possibly traced. The vocabulary is sorted only when some
    top_k > 0 (a runtime branch when traced). float32.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)[..., None]
    x = logits / temperature
    if isinstance(top_k, int) and top_k <= 0:
        return x
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), x.shape[:-1])[..., None]

    def kth(logits: jax.Array) -> jax.Array:
        # kth largest = the (V-1-k)-th smallest; a sort is what XLA does well for any k.
        # Sorted before scaling: dividing by temperature > 0 keeps the order, so this is
        # the kth largest of x exactly, and the branch reads the logits as they are
        # (x stays an expression its consumers fuse, never a [.., V] array of its own).
        k = jnp.clip(top_k, 1, logits.shape[-1]) - 1
        value = jnp.take_along_axis(jnp.sort(logits, axis=-1), logits.shape[-1] - 1 - k, -1)
        return jnp.where(top_k > 0, value / temperature, -jnp.inf)

    none = lambda logits: jnp.full((*logits.shape[:-1], 1), -jnp.inf)  # noqa: E731
    threshold = jax.lax.cond(jnp.any(top_k > 0), kth, none, logits)
    return jnp.where(x >= threshold, x, -jnp.inf)


def sampling_log_probs(
    logits: jax.Array, temperature: float | jax.Array = 1.0, top_k: int | jax.Array = 0
) -> jax.Array:
    """Log-probs [..., V] of the distribution tokens are sampled from: the log-softmax of
    `sampling_logits` (same arguments). float32."""
    return jax.nn.log_softmax(sampling_logits(logits, temperature, top_k), axis=-1)


def chunked_target_logprobs(
    hidden: jax.Array,
    w_out: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array = 0,
    *,
    chunk: int = 256,
    with_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log p(targets[:, t]) under `sampling_log_probs(hidden[:, t] @ w_out)`: [B,T] float32.

    The learner's log-probs without materialising [B,T,V] logits: `chunk` positions at a
    time, each chunk rematerialised in the backward pass, so the working set is one chunk's
    logits, log-probs and their gradients (~4 x [B,chunk,V] float32) instead of ~2 x
    [B,T,V] (tests/unit/learner/test_learner_memory.py). Equal to the unchunked computation.

    `with_entropy`: also the entropy `H_t = -sum_v p_v log p_v` of that distribution at
    every position ([B,T] float32, differentiable), from the same chunk's log-probs.
    """
    b, t, d = hidden.shape
    if chunk <= 0 or chunk >= t:
        chunk = t
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(hy):
        hc, yc = hy
        logp = sampling_log_probs(output_logits(hc, w_out), temperature, top_k)
        picked = jnp.take_along_axis(logp, yc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if not with_entropy:
            return picked
        # Tokens outside the top-k have p = 0 and log p = -inf: 0 * -inf is NaN, and a
        # where() on the product alone would still send NaN into the gradient.
        finite = jnp.where(jnp.isfinite(logp), logp, 0.0)
        return picked, -jnp.sum(jnp.exp(logp) * finite, axis=-1)

    def unchunk(x: jax.Array) -> jax.Array:  # [n, B, chunk] -> [B, T]
        return x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

    out = jax.lax.map(one, (h, y))
    return (unchunk(out[0]), unchunk(out[1])) if with_entropy else unchunk(out)


def token_logprobs(
    logits: jax.Array,
    tokens: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array = 0,
) -> jax.Array:
    """Log-prob of each next token: out[:, t] = log p(tokens[:, t+1] | logits[:, t]).

    logits [B,T,V], tokens [B,T] -> [B,T-1] float32, under `sampling_log_probs`, i.e. the
    exact distribution the sampler draws from (same temperature / top_k).
    """
    logp = sampling_log_probs(logits[:, :-1], temperature, top_k)
    return jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]

"""Batched policy sampling for the CPU actors, on the model's KV cache.

This module owns `Sampler` (and its `Sample` result): turning a list of token contexts of
different lengths into sampled continuations with the behaviour log-prob of every sampled
token, compiling only a bounded set of shapes.

Shapes. A call's batch is padded up to a batch bucket (extra rows are inert) and every
context is RIGHT-padded to one prompt-length bucket P; the KV cache (slot index ==
position) is the smallest length bucket >= min(P + max_new_tokens, max_seq_len), because
decode cost grows with cache length. So the compiled shapes are (batch bucket, prompt
bucket, cache bucket >= prompt bucket): at most |B| x |L|(|L|+1)/2, and about |B| x |L| for
a fixed `max_new_tokens`, whatever the contexts. Temperature, top_k, max_new_tokens and
stop ids are traced arguments; so are the weights: `update_params` never recompiles.

Each call is one jitted program: a prefill over the padded contexts, then a
`lax.while_loop` decoding one token per step for every row until all rows stopped (stop
token, `max_new_tokens`, or the next position would reach `max_seq_len`). The cache is a
loop carry, so XLA updates it in place without a Python round trip per token.

Log-probs come from `model.sampling_log_probs`, the same function the learner uses via
`token_logprobs`, so they match a full forward pass over the sampled sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.policy.model import Transformer, sampling_log_probs
from tunix_tasks.policy.params import load_flat_params

__all__ = ["DEFAULT_BATCH_BUCKETS", "DEFAULT_PROMPT_BUCKETS", "Sample", "Sampler"]

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_MAX_STOP_IDS = 8  # stop ids are padded to this fixed size so they stay a traced argument

FinishReason = Literal["stop", "length", "max_seq_len"]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One continuation. `tokens` includes the stop token when one was sampled.

    `logprobs[i]` is the log-prob of `tokens[i]` under the distribution it was drawn from
    (temperature-scaled, top-k filtered). `finish_reason`: "stop" (stop token), "length"
    (`max_new_tokens` reached) or "max_seq_len" (the context is full).
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Sampler:
    """Samples continuations of many contexts at once from a `Transformer`.

    sampler = Sampler(model, pad_id=chat.tokenizer.pad_id, stop_ids=chat.stop_ids)
    out = sampler.sample(contexts, max_new_tokens=16, temperature=1.0, rng=key)
    sampler.update_params(flat)  # new weights, same compiled programs
    """

    def __init__(
        self,
        model: Transformer,
        *,
        pad_id: int,
        stop_ids: Sequence[int],
        max_seq_len: int | None = None,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
    ):
        self.max_seq_len = int(max_seq_len or model.max_seq_len)
        if self.max_seq_len <= 1:
            raise ValueError(f"max_seq_len must be > 1, got {self.max_seq_len}")
        if not batch_buckets or min(batch_buckets) < 1:
            raise ValueError(f"batch_buckets must be positive, got {list(batch_buckets)}")
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        # Clip prompt buckets to max_seq_len and make max_seq_len itself the last bucket.
        clipped = {b for b in prompt_buckets if 0 < b < self.max_seq_len}
        self.prompt_buckets = (*sorted(clipped), self.max_seq_len)
        if not 0 < len(stop_ids) <= _MAX_STOP_IDS:
            raise ValueError(f"need 1..{_MAX_STOP_IDS} stop ids, got {list(stop_ids)}")
        self.pad_id = int(pad_id)
        self.default_stop_ids = tuple(int(i) for i in stop_ids)
        self._model = model
        self._graphdef, self._state = nnx.split(model)
        self._traces = 0
        self._generate = jax.jit(self._generate_impl, static_argnames=("cache_len",))

    # ------------------------------------------------------------------ weights

    def update_params(self, flat: Mapping[str, np.ndarray]) -> None:
        """Load `flat_params`-style weights (e.g. from a safetensors snapshot); no recompile.

        Names, shapes and dtypes (float32) are checked against the model BEFORE anything is
        swapped: a ValueError naming every mismatch leaves the sampler on its old weights.
        """
        load_flat_params(self._model, flat)  # checks everything first, then swaps
        self._state = nnx.state(self._model)

    @property
    def model(self) -> Transformer:
        return self._model

    @property
    def compile_count(self) -> int:
        """How many times the sampling program was traced (== XLA compilations it caused)."""
        return self._traces

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        contexts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        stop_ids: Sequence[int] | None = None,
        rng: jax.Array,
    ) -> list[Sample]:
        """Sample a continuation of every context (order preserved).

        `stop_ids` defaults to the constructor's. Greedy decoding: `top_k=1`. A context
        must be non-empty and at most `max_seq_len` tokens long.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stops = tuple(self.default_stop_ids if stop_ids is None else stop_ids)
        if len(stops) > _MAX_STOP_IDS:
            raise ValueError(f"at most {_MAX_STOP_IDS} stop ids, got {len(stops)}")
        for i, ctx in enumerate(contexts):
            if not 0 < len(ctx) <= self.max_seq_len:
                raise ValueError(
                    f"context {i} has {len(ctx)} tokens; need 1..max_seq_len={self.max_seq_len}"
                )
        stop_arr = np.full((_MAX_STOP_IDS,), -1, np.int32)
        stop_arr[: len(stops)] = stops
        args = (
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.int32(max_new_tokens),
            jnp.asarray(stop_arr),
        )
        out: list[Sample] = []
        chunk = self.batch_buckets[-1]
        for c, start in enumerate(range(0, len(contexts), chunk)):
            part = contexts[start : start + chunk]
            out.extend(self._sample_chunk(part, jax.random.fold_in(rng, c), args, set(stops)))
        return out

    def _sample_chunk(self, contexts, rng, args, stops: set[int]) -> list[Sample]:
        n = len(contexts)
        max_new = int(args[2])
        batch = _bucket(n, self.batch_buckets)
        width = _bucket(max(len(c) for c in contexts), self.prompt_buckets)
        cache_len = _bucket(min(width + max_new, self.max_seq_len), self.prompt_buckets)
        tokens = np.full((batch, width), self.pad_id, np.int32)
        lengths = np.ones((batch,), np.int32)  # padding rows: one pad token, inactive
        active = np.zeros((batch,), bool)
        for i, ctx in enumerate(contexts):
            tokens[i, : len(ctx)] = ctx
            lengths[i] = len(ctx)
            active[i] = True
        out_tok, out_lp, n_gen = jax.device_get(
            self._generate(self._state, tokens, lengths, active, rng, *args, cache_len=cache_len)
        )
        samples = []
        for i in range(n):
            k = int(n_gen[i])
            toks = out_tok[i, :k].tolist()
            if toks and toks[-1] in stops:
                reason: FinishReason = "stop"
            elif k >= max_new:
                reason = "length"
            else:
                reason = "max_seq_len"
            samples.append(Sample(toks, out_lp[i, :k].tolist(), reason))
        return samples

    def _generate_impl(
        self,
        state,
        tokens,
        lengths,
        active,
        rng,
        temperature,
        top_k,
        max_new,
        stop_ids,
        *,
        cache_len: int,
    ):
        """Prefill + while_loop decode. Traced once per (batch, prompt, cache) bucket.

        `cache_len` >= every position this call feeds back (see `_sample_chunk`).
        """
        self._traces += 1  # runs only while tracing: counts compilations
        model = nnx.merge(self._graphdef, state)
        batch, width = tokens.shape
        seq = self.max_seq_len
        rows = jnp.arange(batch)

        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = model.init_cache(batch, cache_len)
        logits, cache = model.forward_with_cache(tokens, positions, cache)
        last = logits[rows, lengths - 1]  # logits that score each row's next token

        # Output buffers are cache_len wide: a static bound on any row's generation.
        init = (
            jnp.int32(0),
            cache,
            last,
            jnp.zeros((batch, cache_len), jnp.int32),
            jnp.zeros((batch, cache_len), jnp.float32),
            jnp.zeros((batch,), jnp.int32),
            ~active | (lengths >= seq),  # done: padding rows, and rows with no room left
        )

        def cond(carry):
            step, *_, done = carry
            return (step < max_new) & ~jnp.all(done)

        def body(carry):
            step, cache, last, out_tok, out_lp, n_gen, done = carry
            logp = sampling_log_probs(last, temperature, top_k)
            tok = jax.random.categorical(jax.random.fold_in(rng, step), logp).astype(jnp.int32)
            lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
            slot = jnp.where(done, cache_len, n_gen)  # out of range for done rows: dropped
            out_tok = out_tok.at[rows, slot].set(tok, mode="drop")
            out_lp = out_lp.at[rows, slot].set(lp, mode="drop")
            n_gen = n_gen + (~done).astype(jnp.int32)
            pos = lengths + n_gen - 1  # position of the token just sampled
            hit_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            done = done | hit_stop | (n_gen >= max_new) | (pos + 1 >= seq)
            # Feed the token back (finished rows feed junk that is never read).
            feed_pos = jnp.minimum(pos, cache_len - 1)[:, None]
            logits, cache = model.forward_with_cache(tok[:, None], feed_pos, cache)
            return step + 1, cache, logits[:, 0], out_tok, out_lp, n_gen, done

        _, _, _, out_tok, out_lp, n_gen, _ = jax.lax.while_loop(cond, body, init)
        return out_tok, out_lp, n_gen

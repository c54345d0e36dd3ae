"""The sampler: continuous batching over a slot KV cache with multi-turn prefix reuse.

This module owns `Sampler` (and `Sample`): turning token contexts into sampled
continuations with the behaviour log-prob of every sampled token.

    sampler = Sampler(model, pad_id=chat.tokenizer.pad_id, stop_ids=chat.stop_ids)
    out = sampler.sample(contexts, max_new_tokens=16, temperature=1.0, rng=key)   # blocking
    sampler.submit(context, max_new_tokens=16, session="ep-7", on_done=callback)  # engine
    while sampler.busy:
        sampler.step()               # admit waiting requests, decode one segment
    sampler.update_params(flat, version=3)   # new weights, same compiled programs

Slots and prefix reuse. The KV cache has `max_sequences` slots. A request may name a
`session` (the actor passes its episode id): the slot that served the session's previous
turn still holds its keys and values, so the next turn prefills only what is new (the
environment's reply) instead of the whole episode. Idle slots are reused least recently
used first; a new weights version invalidates every slot, since keys and values computed
with old weights would condition new tokens on the old policy.

Continuous batching. `step()` first admits waiting requests into free slots (`admit()`:
one prefill call for all of them, which also draws their first token), then runs one
decode segment of at most `segment_steps` tokens for every active row. A row that finishes hands back its
`Sample` at the end of the segment and its slot takes the next request; nobody waits for
the slowest row of a batch. Rows in flight when the weights change are re-admitted: their
context so far is prefilled again under the new weights and generation continues, so each
token's log-prob is exact under the version that drew it (`Sample.version` is the oldest).

Shapes. Batches are padded to a batch bucket (by default `row_buckets(max_sequences)`:
powers of two up to the slot count, so every slot can decode in one batch); a prefill chunk to a chunk bucket (the
`prompt_buckets`); attention reads a window of the cache: the smallest bucket holding every
position the call can touch (decode attends over the live positions' bucket, not the whole
cache: `decode_window`). Compiles are bounded by |batch buckets| x |buckets|^2; weights,
temperature, top-k, budgets and stop ids are traced, so `update_params` never recompiles.

Layers. By default the programs run the decoder's layers as a Python loop (unrolled: a
30-layer model's decode program takes ~6 s to compile on 2 CPU cores). `scan_layers=True`
runs them as one `lax.scan` over the blocks' params, stacked once per weights version
(`split_stacked`; the sampler then holds a stacked copy of the blocks besides the model's
own), and a stacked KV cache: the same numbers, programs that compile ~2x faster whatever
the depth, but on XLA:CPU each layer's weights are copied out of the stack at every step,
so steady decode ran at 0.41-0.78x (docs/models.md, "A real model on 2 cores"): for
short-lived samplers (evaluation, tests), not for an actor that runs for hours.

Devices. A sampler's weights, cache and programs live on one device (`device`, default
the default one); `SamplerReplicas` (policy/replicas.py) runs one sampler per device.

Log-probs come from `sampling_log_probs`, the function the learner scores with, over
float32 logits. A request may also ask for each token's `top_logprobs` most likely
alternatives (`submit(top_logprobs=)`): the batches holding such a row run programs with a
static top-k pass (`decoding.draw(top=)`), every other batch the programs without one. Precision: a model with `compute_dtype` bfloat16 is held in bfloat16
(`policy/precision.py`; snapshots load into it rounded, `update_params` keeps it so), its
KV cache is bfloat16, and its logits are bfloat16 matmul inputs accumulated in float32,
so the recorded log-probs differ from a float32 learner's by bf16 rounding only
(`max_abs_logprob_diff_s0` in the learner's metrics measures it).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.policy import decoding
from tunix_tasks.policy.lanes import DecodeLanes
from tunix_tasks.policy.model import KVCache, Transformer, merge_stacked, split_stacked
from tunix_tasks.policy.params import load_flat_params
from tunix_tasks.policy.precision import cast_params
from tunix_tasks.policy.requests import (
    TOP_LOGPROBS,
    BlockingSample,
    Request,
    Sample,
    SamplerStats,
    check_request,
    row_params,
)
from tunix_tasks.policy.slots import SlotTable

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "Sample",
    "Sampler",
    "row_buckets",
]

DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_MAX_STOP_IDS = 8  # stop ids are padded to this fixed size so they stay a traced argument


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The batch buckets of a sampler that decodes up to `max_rows` rows at once: the
    powers of two below it, then `max_rows` itself (384: 1, 2, ..., 256, 384), so the
    programs compiled per window stay at most log2(max_rows) + 2."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return (*(1 << i for i in range((max_rows - 1).bit_length())), max_rows)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _top(rows: Sequence[Request | None]) -> int:
    """The programs' static top-k width: TOP_LOGPROBS when a row wants alternatives, else
    0 (no top-k pass, the programs every other batch runs)."""
    return TOP_LOGPROBS if any(r is not None and r.top_logprobs for r in rows) else 0


def _slot_array(rows: list[Request], batch: int, scratch: int) -> np.ndarray:
    slots = np.full(batch, scratch, np.int32)  # padding rows: the scratch slot
    slots[: len(rows)] = [r.slot for r in rows]
    return slots


class Sampler(BlockingSample):
    """Samples continuations of many contexts from a `Transformer` (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        *,
        pad_id: int,
        stop_ids: Sequence[int],
        max_seq_len: int | None = None,
        max_sequences: int = 64,
        batch_buckets: Sequence[int] | None = None,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        segment_steps: int = 16,
        kv_dtype: jnp.dtype | None = None,
        device: jax.Device | None = None,
        scan_layers: bool = False,
    ):
        self.max_seq_len = int(max_seq_len or model.max_seq_len)
        if self.max_seq_len <= 1:
            raise ValueError(f"max_seq_len must be > 1, got {self.max_seq_len}")
        if not 0 < len(stop_ids) <= _MAX_STOP_IDS:
            raise ValueError(f"need 1..{_MAX_STOP_IDS} stop ids, got {list(stop_ids)}")
        if segment_steps < 1 or max_sequences < 1:
            raise ValueError("segment_steps and max_sequences must be >= 1")
        if batch_buckets is None:  # every slot may decode at once (module docstring, Shapes)
            batch_buckets = row_buckets(max_sequences)
        if not batch_buckets or min(batch_buckets) < 1:
            raise ValueError(f"batch_buckets must be positive, got {list(batch_buckets)}")
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        # Length buckets up to max_seq_len, which is always the last one.
        clipped = {b for b in prompt_buckets if 0 < b < self.max_seq_len}
        self.prompt_buckets = (*sorted(clipped), self.max_seq_len)
        self.pad_id = int(pad_id)
        self.default_stop_ids = tuple(int(i) for i in stop_ids)
        self.segment_steps = int(segment_steps)
        self.max_sequences = max_sequences
        self.max_batch = min(self.batch_buckets[-1], max_sequences)
        self.stats = SamplerStats()
        self.version = -1
        self._model = model
        # Held in the compute dtype: a decode step reads every weight (module docstring).
        cast_params(model, model.compute_dtype)
        # Every array the programs take lives on `device` (None: the default one), so they
        # run there; `SamplerReplicas` (policy/replicas.py) puts one sampler per device.
        self._device = device
        self.scan_layers = bool(scan_layers)  # module docstring, Layers
        self._graphdef, self._state = self._split()
        # The last cache row is scratch: padding rows of a batch read and write there.
        self._cache = jax.device_put(
            self._init_cache(max_sequences + 1, self.max_seq_len, kv_dtype), device
        )
        self._slots = SlotTable(max_sequences)
        self._lanes = DecodeLanes()  # the decode working set (policy/lanes.py)
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._lock = threading.Lock()  # `submit` may come from another thread than `step`
        self._key = jax.random.key(0)
        self._traces = 0
        self.compiles: collections.Counter[str] = collections.Counter()  # by program kind
        static = ("window", "max_seq_len", "top")
        self._prefill = jax.jit(self._prefill_impl, static_argnames=static, donate_argnums=1)
        self._decode = jax.jit(
            self._decode_impl,
            static_argnames=("steps", "max_seq_len", "top"),
            donate_argnums=(1, 2),
        )

    # ------------------------------------------------------------------ weights

    def update_params(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        version: int = -1,
        only: type[nnx.Variable] = nnx.Param,
        digest: str = "",
        created_at: float = 0.0,
    ) -> None:
        """Load `flat_params`-style weights (e.g. from a safetensors snapshot); no recompile.
        `only=nnx.LoRAParam`: the flat dict holds adapters, the base stays. `digest` and
        `created_at` (the snapshot's content id and publish time) are not needed: the
        weights stay in this process.

        Names, shapes and dtypes (float32) are checked against the model BEFORE anything is
        swapped: a ValueError naming every mismatch leaves the sampler on its old weights.
        A bfloat16-held model stays bfloat16 (each tensor is rounded as it loads).
        Every cached slot is invalidated and rows in flight are re-admitted (module doc).
        """
        load_flat_params(self._model, flat, only)  # checks everything first, then swaps
        self.adopt_params(version)

    def adopt_params(self, version: int) -> None:
        """Start sampling with the weights the model now holds (`update_params` loads them;
        replicas sharing one model load once and adopt): slots invalidated, rows in flight
        re-admitted."""
        _, self._state = self._split()
        self.version = version
        self._slots.invalidate()
        self._lanes.clear()
        with self._lock:
            for row in reversed(self._active):
                self._release(row)
                self._waiting.appendleft(row)
            self._active = []

    def _split(self) -> tuple[nnx.GraphDef, tuple[nnx.State, nnx.State | None]]:
        """The programs' graphdef and weights on the device: the model's state, or (scanned)
        the params outside the blocks and the blocks stacked (`split_stacked`)."""
        if self.scan_layers:
            graphdef, rest, layers = split_stacked(self._model)
            return graphdef, jax.device_put((rest, layers), self._device)
        graphdef, state = nnx.split(self._model)
        return graphdef, (jax.device_put(state, self._device), None)

    def _merge(self, state: tuple[nnx.State, nnx.State | None]) -> Transformer:
        rest, layers = state
        if layers is None:
            return nnx.merge(self._graphdef, rest)
        return merge_stacked(self._graphdef, rest, layers)

    def _init_cache(self, batch: int, length: int, dtype: jnp.dtype | None) -> KVCache:
        return self._model.init_cache(batch, length, dtype, stacked=self.scan_layers)

    @property
    def model(self) -> Transformer:
        return self._model

    @property
    def compile_count(self) -> int:
        """How many times a sampling program was traced (== XLA compilations it caused)."""
        return self._traces

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        context: Sequence[int],
        *,
        max_new_tokens: int,
        on_done: Callable[[Sample], None],
        temperature: float = 1.0,
        top_k: int = 0,
        stop_ids: Sequence[int] | None = None,
        session: Hashable | None = None,
        seed: int = 0,
        top_logprobs: int = 0,
    ) -> None:
        """Queue one request; `on_done(Sample)` is called from `step()` when it finishes.

        `seed` picks the row's random stream; `session` names a conversation whose next
        turn should reuse this one's cache (module docstring). Greedy: `top_k=1`.
        `top_logprobs` > 0: each token's most likely alternatives too (`Sample`); the
        batches that hold such a row run programs with a top-k pass (compiled apart).
        """
        check_request(context, max_new_tokens, temperature, top_k, self.max_seq_len, top_logprobs)
        stops = tuple(self.default_stop_ids if stop_ids is None else stop_ids)
        if len(stops) > _MAX_STOP_IDS:
            raise ValueError(f"at most {_MAX_STOP_IDS} stop ids, got {len(stops)}")
        row = Request(
            list(context),
            session,
            seed=int(seed) & 0x7FFFFFFF,
            temperature=float(temperature),
            top_k=int(top_k),
            max_new=int(max_new_tokens),
            stop_ids=stops,
            on_done=on_done,
            top_logprobs=int(top_logprobs),
        )
        if len(row.context) >= self.max_seq_len:  # no room for a single token
            row.finish()
            return
        with self._lock:
            self._waiting.append(row)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def active_rows(self) -> int:
        return len(self._active)

    @property
    def decode_window(self) -> int:
        """The cache window (a prompt bucket) the next decode segment attends over: the
        smallest bucket holding the furthest live row's position plus a segment of new
        ones (module docstring, Shapes); 0 while no row decodes."""
        if not self._active:
            return 0
        furthest = max(len(r.sequence) - 1 for r in self._active)
        return _bucket(
            min(furthest + self.segment_steps + 1, self.max_seq_len), self.prompt_buckets
        )

    @property
    def load(self) -> int:
        """Requests waiting or decoding."""
        return len(self._waiting) + len(self._active)

    def seed(self, rng: jax.Array) -> None:
        """The key every row's random stream derives from (with the row's seed)."""
        self._key = rng

    # ------------------------------------------------------------------ the engine

    def step(self) -> int:
        """Admit waiting requests (one prefill), then decode one segment for active rows.
        Returns how many rows this step computed for."""
        admitted = self.admit()
        decoded = len(self._active)
        if decoded:
            self._decode_active()
        return max(admitted, decoded)

    def _release(self, row: Request) -> None:
        if row.slot >= 0:
            self._slots.release(row.slot, row.session)
            row.slot = -1

    def admit(self) -> int:
        """Run the admission prefill of queued requests now: as many as free slots and the
        largest batch bucket allow, in one prefill call that also draws each one's first
        token (a row done at that token hands back its `Sample` here). `step()` is this
        plus one decode segment; alone it times or schedules the prefill apart from
        decoding. Returns how many requests were admitted."""
        rows: list[Request] = []
        with self._lock:
            while self._waiting and len(self._active) + len(rows) < self.max_batch:
                slot = self._slots.acquire(self._waiting[0].session)
                if slot is None:
                    break
                row = self._waiting.popleft()
                row.slot = slot
                rows.append(row)
        if rows:
            self._prefill_rows(rows)
        return len(rows)

    def _prefill_rows(self, rows: list[Request]) -> None:
        seqs = [r.sequence for r in rows]
        # Feed at least each row's last token: its logits draw the next one.
        reuse = [
            min(self._slots.reusable(r.slot, q), len(q) - 1)
            for r, q in zip(rows, seqs, strict=True)
        ]
        width = _bucket(
            max(len(s) - n for s, n in zip(seqs, reuse, strict=True)), self.prompt_buckets
        )
        window = _bucket(max(width, *map(len, seqs)), self.prompt_buckets)
        batch = _bucket(len(rows), self.batch_buckets)
        tokens = np.full((batch, width), self.pad_id, np.int32)
        starts, last = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
        for i, seq in enumerate(seqs):
            # The chunk ends at the sequence's end; it re-feeds cached tokens before the new
            # ones when it is wider (identical keys/values), so no position past the end is
            # written for rows whose context is long enough.
            start = max(0, len(seq) - width)
            chunk = seq[start : start + width]
            tokens[i, : len(chunk)] = chunk
            starts[i], last[i] = start, len(seq) - 1 - start
            self.stats.prefill_tokens += len(seq) - reuse[i]
            self.stats.reused_tokens += reuse[i]
        slots = _slot_array(rows, batch, self._slots.slots)
        params = row_params(rows, batch, _MAX_STOP_IDS)
        n_gen = np.zeros(batch, np.int32)
        n_gen[: len(rows)] = [len(r.generated) for r in rows]
        top = _top(rows)
        self._cache, drawn, done = self._prefill(
            self._state,
            self._cache,
            slots,
            tokens,
            starts,
            last,
            n_gen,
            self._key,
            params,
            window=window,
            max_seq_len=self.max_seq_len,
            top=top,
        )
        (tok, lp, top_ids, top_lp), done = jax.device_get((drawn, done))
        for i, (r, seq) in enumerate(zip(rows, seqs, strict=True)):
            self._slots.hold(r.slot, seq)
            r.record(
                [int(tok[i])], [float(lp[i])], self.version, (top_ids[i : i + 1], top_lp[i : i + 1])
            )
            if done[i]:
                self._finish(r)
            else:
                self._active.append(r)

    def _decode_active(self) -> None:
        batch = _bucket(len(self._active), self.batch_buckets)
        steps = self.segment_steps
        window = self.decode_window
        plan = self._lanes.plan(self._active, batch, window, scratch=self._slots.slots)
        work = self._lanes.work
        if work is None:
            dtype = self._cache.k[0].dtype
            work = jax.device_put(self._init_cache(batch, window, dtype), self._device)
        top = _top(plan.rows)
        self._cache, work, out, done, pos = self._decode(
            self._state,
            self._cache,
            work,
            *plan.arrays,
            self._key,
            row_params(plan.rows, batch, _MAX_STOP_IDS),
            steps=steps,
            max_seq_len=self.max_seq_len,
            top=top,
        )
        self._lanes.keep(work)
        (out_tok, out_lp, top_ids, top_lp), done, pos = jax.device_get((out, done, pos))
        self.stats.segments += 1
        self.stats.lane_copies += plan.n_stale
        self.stats.decode_steps += int((out_tok >= 0).any(axis=0).sum())
        still = []
        for i, r in enumerate(plan.rows):
            if r is None:
                continue
            keep = out_tok[i] >= 0
            r.record(
                out_tok[i][keep].tolist(),
                out_lp[i][keep].tolist(),
                self.version,
                (top_ids[i][keep], top_lp[i][keep]),
            )
            # Cached for this slot: every position before the last drawn token.
            self._slots.hold(r.slot, r.sequence[: int(pos[i])])
            if done[i]:
                self._finish(r)
            else:
                still.append(r)
        self._active = still
        if not still:
            self._lanes.clear()  # frees the working set while nothing decodes

    def _finish(self, row: Request) -> None:
        self._release(row)
        row.finish()

    # ------------------------------------------------------------------ jitted programs

    def _prefill_impl(self, state, cache, *args, window: int, max_seq_len: int, top: int):
        self._traces += 1  # runs only while tracing: counts compilations
        self.compiles["prefill"] += 1
        return decoding.prefill(
            self._merge(state),
            cache,
            *args,
            window=window,
            max_seq_len=max_seq_len,
            top=top,
            layers=state[1],
        )

    def _decode_impl(self, state, cache, work, *args, steps: int, max_seq_len: int, top: int):
        self._traces += 1
        self.compiles["decode"] += 1
        return decoding.decode_segment(
            self._merge(state),
            cache,
            work,
            *args,
            steps=steps,
            max_seq_len=max_seq_len,
            top=top,
            layers=state[1],
        )

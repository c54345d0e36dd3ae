"""What the sampler is asked and what it answers: `Request`, `Sample`, and their stats.

A `Request` is one context to continue, with its sampling settings and where it stands
(tokens generated so far, its cache slot); the sampler calls `on_done(Sample)` when it
finishes. `row_params` lays a batch of requests' settings out as the device programs'
traced arguments. `BlockingSample` gives an engine (`submit` / `step` / `busy` / `seed`)
its blocking `sample()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from tunix_tasks.policy.decoding import RowParams

__all__ = [
    "INT32_MAX",
    "TEMPERATURES",
    "TOP_LOGPROBS",
    "BlockingSample",
    "FinishReason",
    "Request",
    "Sample",
    "SamplerStats",
    "check_request",
    "row_params",
]

FinishReason = Literal["stop", "length", "max_seq_len"]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One continuation. `tokens` includes the stop token when one was sampled.

    `logprobs[i]` is the log-prob of `tokens[i]` under the distribution it was drawn from
    (temperature-scaled, top-k filtered). `finish_reason`: "stop" (stop token), "length"
    (`max_new_tokens` reached) or "max_seq_len" (the context is full). `version`: the
    oldest weights version (`Sampler.update_params(version=)`) that drew any of its
    tokens, -1 when no version was given. `top_logprobs[i]` (when the request asked for
    `top_logprobs` > 0): the most likely ids at `tokens[i]`'s position and their log-probs
    under the same distribution, most likely first (ids the distribution excludes left
    out).
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int = -1
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One request in the sampler, from `submit` to its `Sample`."""

    context: list[int]
    session: Hashable | None
    seed: int
    temperature: float
    top_k: int
    max_new: int
    stop_ids: tuple[int, ...]
    on_done: Callable[[Sample], None]
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    version: int = -1
    slot: int = -1
    top_logprobs: int = 0  # alternatives wanted per token (<= TOP_LOGPROBS)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    @property
    def sequence(self) -> list[int]:
        """The context and what was generated so far (what a re-admission prefills)."""
        return self.context + self.generated

    def record(
        self,
        tokens: list[int],
        logprobs: list[float],
        version: int,
        top: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Tokens drawn; `top`: (ids, log-probs) [len(tokens), >= top_logprobs] of each."""
        self.generated.extend(tokens)
        self.logprobs.extend(logprobs)
        self.version = version if self.version < 0 else min(self.version, version)
        if self.top_logprobs:
            ids, lps = top
            k = self.top_logprobs
            for row_ids, row_lps in zip(ids, lps, strict=True):
                pairs = zip(row_ids[:k].tolist(), row_lps[:k].tolist(), strict=True)
                self.top.append([(i, lp) for i, lp in pairs if lp > -np.inf])

    def finish(self) -> None:
        if self.generated and self.generated[-1] in self.stop_ids:
            reason: FinishReason = "stop"
        elif len(self.generated) >= self.max_new:
            reason = "length"
        else:
            reason = "max_seq_len"
        top = self.top if self.top_logprobs else None
        self.on_done(Sample(self.generated, self.logprobs, reason, self.version, top))


@dataclasses.dataclass
class SamplerStats:
    prefill_tokens: int = 0  # new tokens fed by prefills (cached and padding ones excluded)
    reused_tokens: int = 0  # context tokens whose keys/values a session's slot already held
    decode_steps: int = 0  # decode steps (one token for every active row)
    segments: int = 0
    lane_copies: int = 0  # rows copied into the decode working set (policy/lanes.py)

    def __add__(self, other: SamplerStats) -> SamplerStats:
        return SamplerStats(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )


def row_params(rows: Sequence[Request | None], batch: int, max_stops: int) -> RowParams:
    """The rows' sampling settings as [batch] arrays (padding rows, or None: inert defaults)."""
    seed = np.zeros(batch, np.int32)
    temperature, top_k = np.ones(batch, np.float32), np.zeros(batch, np.int32)
    max_new = np.ones(batch, np.int32)
    stops = np.full((batch, max_stops), -1, np.int32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        seed[i], temperature[i], top_k[i], max_new[i] = r.seed, r.temperature, r.top_k, r.max_new
        stops[i, : len(r.stop_ids)] = r.stop_ids
    return RowParams(seed, temperature, top_k, max_new, stops)


TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's bound too)
INT32_MAX = 2**31 - 1  # `row_params` lays counts out as int32: a larger one fails a step
# Temperatures that keep logits / temperature finite in float32: 1e-46 is 0 there, and
# past 3.4e38 inf (a masked logit's -inf / inf is NaN); either gives NaN log-probs. At
# 1e-6 sampling is all but greedy, at 1e6 all but uniform.
TEMPERATURES = (1e-6, 1e6)


def check_request(
    context: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    max_seq_len: int,
    top_logprobs: int = 0,
) -> None:
    """ValueError naming the bad setting of a request. Checked before it is queued: a
    setting the engine cannot lay out would fail its step, and every request with it."""
    if not 0 <= top_logprobs <= TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in 0..{TOP_LOGPROBS}, got {top_logprobs}")
    low, high = TEMPERATURES
    if not low <= temperature <= high:  # NaN too
        raise ValueError(
            f"temperature must be in [{low:g}, {high:g}] (use top_k=1 for greedy), "
            f"got {temperature}"
        )
    if not 0 <= top_k <= INT32_MAX:
        raise ValueError(f"top_k must be in 0..{INT32_MAX}, got {top_k}")
    if not 1 <= max_new_tokens <= INT32_MAX:
        raise ValueError(f"max_new_tokens must be in 1..{INT32_MAX}, got {max_new_tokens}")
    if not 0 < len(context) <= max_seq_len:
        raise ValueError(f"a context has {len(context)} tokens; need 1..max_seq_len={max_seq_len}")


class BlockingSample:
    """`sample()` for an engine with `submit`, `step`, `busy`, `seed` and `max_seq_len`."""

    max_seq_len: int
    busy: bool
    submit: Callable[..., None]
    step: Callable[[], int]
    seed: Callable[[jax.Array], None]

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
        """Sample a continuation of every context (order preserved); blocks until done.
        Row i draws from the stream `(rng, i)`: its output does not depend on the others."""
        for ctx in contexts:
            check_request(ctx, max_new_tokens, temperature, top_k, self.max_seq_len)
        if self.busy:
            raise RuntimeError("sample() needs an idle sampler; use submit()/step() instead")
        self.seed(rng)
        out: list[Any] = [None] * len(contexts)
        for i, ctx in enumerate(contexts):
            self.submit(
                ctx,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                stop_ids=stop_ids,
                seed=i,
                on_done=lambda s, i=i: out.__setitem__(i, s),
            )
        while self.busy:
            self.step()
        return [s for s in out if s is not None]

"""Serves the policy calls of many concurrent episodes from one continuously batched sampler.

Each episode coroutine awaits `policy(context, session=episode_id)`. The request goes to
the `Sampler`'s queue; one engine thread keeps stepping the sampler while there is work
(admit waiting requests, decode a segment for every active row), so environments keep
stepping on the event loop while the model computes, a request that arrives mid-batch joins
at the next segment, and a finished row answers at once instead of waiting for the batch.
Between steps the engine thread runs `before_batch` (the actor's weights reload) and any
call queued by `between_steps` (a server's weight update: actor/remote/server.py).

    policy = BatchingPolicy(sampler, max_new_tokens=16, temperature=1.0, top_k=0, seed=0)
    async with policy:                       # starts / stops the engine thread
        episode = await play_episode(env, policy, ...)
        await policy.between_steps(lambda: sampler.update_params(flat, version=3))
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from tunix_tasks.policy.replicas import SamplerReplicas
from tunix_tasks.policy.sampling import Sample, Sampler

__all__ = ["BatchingPolicy"]


class BatchingPolicy:
    def __init__(
        self,
        sampler: Sampler | SamplerReplicas,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        version: Callable[[], int] = lambda: 0,
        before_batch: Callable[[], None] | None = None,
        gather_s: float = 0.002,
    ) -> None:
        self.sampler = sampler
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self._version = version
        self._before_batch = before_batch
        self._gather_s = gather_s
        self._seed = seed
        self._requests = itertools.count()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._calls: deque[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]]
        self._calls = deque()
        self.calls = 0  # engine steps
        self.latency_s: list[float] = []  # per request, submit -> sample
        self.batch_sizes: list[int] = []  # active rows per engine step

    async def __aenter__(self) -> BatchingPolicy:
        self.sampler.seed(jax.random.key(self._seed))
        self._stopping.clear()
        self._thread = threading.Thread(target=self._engine, name="sampler-engine", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # Nothing answers a request once the engine is gone (a task that outlived its
        # cancellation must not wait forever).
        self._reject_all(RuntimeError("the policy's engine has stopped"))

    @property
    def failed(self) -> BaseException | None:
        """What stopped the engine thread (every later call raises it); None while it runs."""
        return self._failed

    async def __call__(
        self,
        context: Sequence[int],
        *,
        session: Hashable | None = None,
        max_new_tokens: int | None = None,
        **_conversation: object,
    ) -> tuple[list[int], list[float], int]:
        """One turn: (tokens, behaviour log-probs, weights version); `max_new_tokens`
        overrides the policy's budget for this call (an endpoint request's `max_tokens`)."""
        s = await self.sample(context, session=session, max_new_tokens=max_new_tokens)
        return s.tokens, s.logprobs, s.version

    async def sample(
        self,
        context: Sequence[int],
        *,
        session: Hashable | None = None,
        max_new_tokens: int | None = None,
        top_logprobs: int = 0,
        temperature: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> Sample:
        """One turn as the sampler's `Sample` (its version resolved), with each token's
        `top_logprobs` most likely alternatives when asked (the endpoint's `top_logprobs`);
        `temperature`, `top_k` and `seed` override the policy's for this call (a server's
        request). A request the sampler refuses (its bounds) raises its ValueError."""
        loop, fut = self._future()
        n = next(self._requests)
        self._pending[n] = (loop, fut)
        t0 = time.perf_counter()

        def on_done(sample: Sample) -> None:  # on the engine thread
            self._pending.pop(n, None)
            self.latency_s.append(time.perf_counter() - t0)
            loop.call_soon_threadsafe(_resolve, fut, sample)

        try:
            self.sampler.submit(
                context,
                max_new_tokens=max_new_tokens or self.max_new_tokens,
                temperature=self.temperature if temperature is None else temperature,
                top_k=self.top_k if top_k is None else top_k,
                session=session,
                seed=self._seed * 1_000_003 + n if seed is None else seed,
                on_done=on_done,
                top_logprobs=top_logprobs,
            )
        except ValueError:
            self._pending.pop(n, None)
            raise
        self._wake.set()
        sample: Sample = await fut
        if sample.version < 0:
            sample = dataclasses.replace(sample, version=self._version())
        return sample

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the engine thread between two sampler steps (or while idle), where
        the sampler's weights may change; its result, or its exception raised here."""
        loop, fut = self._future()
        self._calls.append((fn, loop, fut))
        self._wake.set()
        return await fut

    def _future(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Future]:
        """A future the engine thread resolves, once the engine is known to run."""
        if self._thread is None:
            raise RuntimeError("use `async with BatchingPolicy(...)` before calling it")
        if self._failed is not None:
            raise self._failed
        if self._stopping.is_set():  # the engine may not take another step for it
            raise RuntimeError("the policy's engine is stopping")
        loop = asyncio.get_running_loop()
        return loop, loop.create_future()

    def _run_calls(self) -> None:
        while self._calls:
            fn, loop, fut = self._calls.popleft()
            try:
                result = fn()
            except Exception as err:  # the caller's error, not the engine's
                loop.call_soon_threadsafe(_reject, fut, err)
            else:
                loop.call_soon_threadsafe(_resolve, fut, result)

    def _engine(self) -> None:
        while not self._stopping.is_set():
            self._run_calls()
            if not self.sampler.busy:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                # Requests that arrive together (e.g. a group's first turns) share a prefill.
                time.sleep(self._gather_s)
                continue
            try:
                if self._before_batch is not None:
                    self._before_batch()  # e.g. reload weights
                rows = self.sampler.step()
            except Exception as err:  # surface to the episodes; never leave them hanging
                self._fail(err)
                return
            self.calls += 1
            self.batch_sizes.append(rows)
            del self.latency_s[:-10000], self.batch_sizes[:-10000]

    def _fail(self, err: BaseException) -> None:
        self._failed = err
        self._reject_all(err)

    def _reject_all(self, err: BaseException) -> None:
        for loop, fut in list(self._pending.values()):
            loop.call_soon_threadsafe(_reject, fut, err)
        self._pending.clear()
        while self._calls:
            _fn, loop, fut = self._calls.popleft()
            loop.call_soon_threadsafe(_reject, fut, err)


def _resolve(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _reject(fut: asyncio.Future, err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)

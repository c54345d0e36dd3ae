"""Gathers policy calls from many concurrent episodes into one batched sampler call.

Each episode coroutine awaits `policy(context)`; a single batcher task collects every
request pending at that moment, runs `Sampler.sample` once in a worker thread (so
environments keep stepping on the event loop while the model computes), and resolves
each request with its action tokens, log-probs and the weights version used.

    policy = BatchingPolicy(sampler, max_new_tokens=16, temperature=1.0, top_k=0, seed=0)
    async with policy:                       # starts / stops the batcher task
        record = await play_episode(env, policy, ...)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

from tunix_tasks.policy.sampling import Sampler


@dataclass
class _Request:
    context: list[int]
    future: asyncio.Future


class BatchingPolicy:
    def __init__(
        self,
        sampler: Sampler,
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
        self._rng = jax.random.PRNGKey(seed)
        self._version = version
        self._before_batch = before_batch
        self._gather_s = gather_s
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task | None = None
        self.calls = 0
        self.latency_s: list[float] = []
        self.batch_sizes: list[int] = []

    async def __aenter__(self) -> BatchingPolicy:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def __call__(
        self, context: Sequence[int], **_conversation: object
    ) -> tuple[list[int], list[float], int]:
        if self._queue is None:
            raise RuntimeError("use `async with BatchingPolicy(...)` before calling it")
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(list(context), fut))
        return await fut

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            first = await self._queue.get()
            await asyncio.sleep(self._gather_s)  # let episodes about to ask join this batch
            batch = [first]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                if self._before_batch is not None:
                    await asyncio.to_thread(self._before_batch)  # e.g. reload weights
                version = self._version()
                self.calls += 1
                t0 = time.perf_counter()
                samples = await asyncio.to_thread(
                    self.sampler.sample,
                    [r.context for r in batch],
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    top_k=self.top_k,
                    rng=jax.random.fold_in(self._rng, self.calls),
                )
                self.latency_s.append(time.perf_counter() - t0)
                self.batch_sizes.append(len(batch))
                del self.latency_s[:-10000], self.batch_sizes[:-10000]
                for req, s in zip(batch, samples, strict=True):
                    if not req.future.done():
                        req.future.set_result((s.tokens, s.logprobs, version))
            except Exception as err:  # surface to the episodes; never leave them hanging
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(err)

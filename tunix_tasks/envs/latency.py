"""``LatencyWrapper``: adds simulated remote-API latency to any environment.

It forwards ``name`` and ``tools`` (and any other attribute) to the wrapped environment.
Each ``reset`` and ``step`` first awaits ``asyncio.sleep(d)`` with ``d = latency_s`` or,
with ``jitter = j > 0``, ``d ~ Uniform[latency_s * (1 - j), latency_s * (1 + j)]``.
Sleeping (not blocking) is the point: many wrapped environments overlap their waits
under ``asyncio.gather``, like real tool calls.

With a ``schedule`` of ``(after_s, latency_s)`` pairs the base delay changes over time:
from ``after_s`` seconds after ``started_at`` (a wall-clock time, the run's preparation:
every actor of a run changes together), ``latency_s`` replaces the constructor's.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections.abc import Sequence
from typing import Any

from tunix_tasks.envs.base import Environment, StepResult
from tunix_tasks.messages import Action


class LatencyWrapper:
    def __init__(
        self,
        env: Environment,
        latency_s: float,
        jitter: float = 0.0,
        rng: random.Random | None = None,
        *,
        schedule: Sequence[tuple[float, float]] = (),
        started_at: float | None = None,
    ) -> None:
        if latency_s < 0 or not 0.0 <= jitter <= 1.0:
            raise ValueError("need latency_s >= 0 and 0 <= jitter <= 1")
        self.env, self.latency_s, self.jitter = env, latency_s, jitter
        self.rng = rng or random.Random()
        self._after = [a for a, _ in schedule]
        self._latency = [lat for _, lat in schedule]
        self.started_at = time.time() if started_at is None else started_at
        self.name = env.name
        self.tools: Sequence[dict] = env.tools

    def current_latency(self, now: float | None = None) -> float:
        """The base delay at wall-clock time `now`: the schedule's latest entry begun."""
        elapsed = (time.time() if now is None else now) - self.started_at
        i = bisect.bisect_right(self._after, elapsed)
        return self._latency[i - 1] if i else self.latency_s

    def sample_delay(self) -> float:
        base = self.current_latency()
        if self.jitter == 0.0:
            return base
        return self.rng.uniform(base * (1 - self.jitter), base * (1 + self.jitter))

    async def _delay(self) -> None:
        if (d := self.sample_delay()) > 0:
            await asyncio.sleep(d)

    async def reset(self, seed: int) -> str:
        await self._delay()
        return await self.env.reset(seed)

    async def step(self, action: Action) -> StepResult:
        await self._delay()
        return await self.env.step(action)

    def demonstration(self, seed: int) -> list[Action]:
        return self.env.demonstration(seed)

    def __getattr__(self, attr: str) -> Any:
        # Expose the wrapped env's extras (max_turns, ...) transparently.
        if attr == "env":
            raise AttributeError(attr)
        return getattr(self.env, attr)

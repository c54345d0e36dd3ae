"""A real endpoint for the tests: the tiny Qwen3 checkpoint's sampler behind uvicorn on a
free loopback port, with a recording wrapper around the real `BatchingPolicy` (what it
sampled, in order; an optional gate that holds a request before it reaches the sampler)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tests.paths import HF_FIXTURES
from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.server import EndpointServer, build_app
from tunix_tasks.actor.endpoint.service import EndpointLimits, EndpointService
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import ModelConfig
from tunix_tasks.episode import Episode
from tunix_tasks.policy.build import build_sampler

TEMPERATURE = 0.7
MAX_EPISODE_TOKENS = 1024
# Generous: the first request compiles the sampler, which takes seconds on a loaded CI core.
HTTP_TIMEOUT_S = 120.0


class Recording:
    """The real policy, recording every sample; `gate` (when set) must open first."""

    def __init__(self, policy: BatchingPolicy) -> None:
        self.policy = policy
        self.sampled: list[tuple[list[int], list[float]]] = []
        self.samples: list = []  # the `Sample`s themselves (top_logprobs)
        self.gate: asyncio.Event | None = None

    async def sample(self, context, **kwargs):
        if self.gate is not None:
            await self.gate.wait()
        sample = await self.policy.sample(context, **kwargs)
        self.sampled.append((list(sample.tokens), list(sample.logprobs)))
        self.samples.append(sample)
        return sample


@dataclass
class Endpoint:
    url: str
    service: EndpointService
    registry: EpisodeRegistry
    policy: Recording
    sampler: object
    chat: object
    groups: list[list[Episode]] = field(default_factory=list)


_BUILT: dict[str, tuple] = {}


def tiny_qwen3():
    """(chat, sampler) of the tiny Qwen3 checkpoint, built once per test process."""
    if "qwen3" not in _BUILT:
        _BUILT["qwen3"] = build_sampler(
            ModelConfig(checkpoint=str(HF_FIXTURES / "tiny-qwen3"), max_seq_len=MAX_EPISODE_TOKENS),
            seed=0,
        )
    return _BUILT["qwen3"]


@contextlib.asynccontextmanager
async def endpoint(
    *,
    max_new_tokens: int = 24,
    max_concurrent_requests: int = 64,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
) -> AsyncIterator[Endpoint]:
    chat, sampler = tiny_qwen3()
    async with BatchingPolicy(
        sampler, max_new_tokens=max_new_tokens, temperature=TEMPERATURE, seed=3
    ) as inner:
        groups: list[list[Episode]] = []
        registry = EpisodeRegistry(
            EpisodeBuilder(actor_id="actor-t", env="agent", group_key="actor-t/x"),
            end_ids=tuple(chat.end_ids),
            on_group=lambda _name, eps: groups.append(eps),
            timeout_s=timeout_s,
            max_open=512,
        )
        policy = Recording(inner)
        limits = EndpointLimits(
            model="tiny-qwen3",
            max_episode_tokens=MAX_EPISODE_TOKENS,
            max_new_tokens=max_new_tokens,
            temperature=TEMPERATURE,
            top_k=0,
            max_concurrent_requests=max_concurrent_requests,
        )
        service = EndpointService(chat, policy, registry, limits)
        app = build_app(service, api_key=api_key, max_request_bytes=max_request_bytes)
        async with EndpointServer(
            app, host="127.0.0.1", port=0, registry=registry, sweep_s=0.05
        ) as server:
            yield Endpoint(server.base_url, service, registry, policy, sampler, chat, groups)

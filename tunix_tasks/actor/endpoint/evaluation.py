"""`play_program`: the run's agent program scored on given seeds, outside any run.

Held-out evaluation of an `actor.kind: agent` run measures what training changed: the
same program, unchanged, against the model. So each seed is one episode of the program
(`run(client, task)`, a group of one) on a private endpoint bound to loopback: the run's
chat template, token fidelity and limits, the given policy (greedy for evaluation), and
no shards, no weights polling, no flow control. An episode the program or its client
ends without a reward (`agent_error`, `abandoned`, ...) scores 0 under that status.

    outcomes = await play_program(cfg, chat, policy, seeds, make_env)
    [(reward, num_turns, status), ...]            # one per seed, in `seeds` order
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.runner import AgentRunner, load_program
from tunix_tasks.actor.endpoint.server import EndpointServer, build_app
from tunix_tasks.actor.endpoint.service import EndpointLimits, EndpointService, Policy
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import RunConfig
from tunix_tasks.envs.base import Environment
from tunix_tasks.episode import Episode
from tunix_tasks.policy.chat import ChatFormat

__all__ = ["play_program"]


async def play_program(
    cfg: RunConfig,
    chat: ChatFormat,
    policy: Policy,
    seeds: list[int],
    make_env: Callable[[], Environment],
) -> list[tuple[float, int, str]]:
    """(reward, turns, status) of one program episode per seed (module docstring)."""
    agent = cfg.actor.agent
    ended: dict[str, Episode] = {}
    registry = EpisodeRegistry(
        EpisodeBuilder(env=cfg.env.name),
        end_ids=tuple(chat.end_ids),
        on_group=lambda name, episodes: ended.update({name: episodes[0]}),  # groups of one
        timeout_s=agent.episode_timeout_s,
        max_open=len(seeds) + 1,
    )
    service = EndpointService(chat, policy, registry, EndpointLimits.from_config(cfg))
    app = build_app(service, api_key=None, max_request_bytes=agent.max_request_bytes)
    async with EndpointServer(app, host="127.0.0.1", port=0, registry=registry) as server:
        runner = AgentRunner(
            load_program(agent.program),
            registry,
            server.base_url,
            request_timeout_s=agent.episode_timeout_s,
            connections=len(seeds),
        )
        try:
            outcomes = await asyncio.gather(
                *(_play(runner, registry, f"eval-{s}", s, make_env(), ended) for s in seeds)
            )
        finally:
            await runner.aclose()
    return outcomes


async def _play(
    runner: AgentRunner,
    registry: EpisodeRegistry,
    group: str,
    seed: int,
    env: Environment,
    ended: dict[str, Episode],
) -> tuple[float, int, str]:
    (episode_id,) = await runner.play_group(group, seed=seed, envs=[env])
    if group in ended:
        ep = ended.pop(group)
        return ep.reward, ep.num_turns, ep.status
    return 0.0, 0, registry.how_ended(episode_id) or "dropped"

"""`actor.kind: agent`: a user's agent program trains through an OpenAI-compatible endpoint.

The actor is the async kind's (the same continuously batched `Sampler`, `BatchingPolicy`,
weights reloads, shards, sync mode) with its environment loop replaced: it serves the
endpoint (server.py) on its own event loop and runs `envs_per_actor` copies of the
program (`actor.agent.program`), `group_size` at a time on one task of `env.name`
(runner.py). Each program talks to its episode's `base_url` with the real `openai`
client; each episode it closes becomes an `Episode` in this actor's shards, its group
committed together. External harnesses may open episodes on the same endpoint
(`POST /episodes`); their groups are committed the same way, and while flow control
pauses the actor a new group is refused with 429 `flow_control_paused`.

    actor = AgentActor(cfg, store, actor_id="actor-0")   # cfg.actor.kind == "agent"
    actor.run()
    actor.endpoint_url       # http://127.0.0.1:<port> while it runs
"""

from __future__ import annotations

import asyncio
from typing import Any

from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.runner import AgentRunner, load_program
from tunix_tasks.actor.endpoint.server import EndpointServer, build_app
from tunix_tasks.actor.endpoint.service import EndpointLimits, EndpointService
from tunix_tasks.config import RunConfig
from tunix_tasks.config.agent import api_key_from_env
from tunix_tasks.episode import Episode
from tunix_tasks.storage.store import ObjectStore

__all__ = ["AgentActor"]


class AgentActor(Actor):
    """`actor.kind: agent` (module docstring)."""

    def __init__(self, cfg: RunConfig, store: ObjectStore, **kwargs: Any) -> None:
        super().__init__(cfg, store, **kwargs)
        agent = cfg.actor.agent
        self.program = load_program(agent.program)
        self.api_key = api_key_from_env(agent.api_key_env, what="actor.agent.api_key_env")
        self.registry = EpisodeRegistry(
            self.episodes,
            end_ids=tuple(self.chat.end_ids),
            on_group=self._on_group,
            timeout_s=agent.episode_timeout_s,
            max_open=agent.max_open_episodes,
            default_version=lambda: max(self.version, 0),
            refuse_group=self._refuse_group,
        )
        self.service = EndpointService(
            self.chat,
            self.policy,
            self.registry,
            EndpointLimits.from_config(cfg),
        )
        self.endpoint_url = ""
        self._runner: AgentRunner | None = None
        self._own: dict[str, list[Episode]] = {}  # groups the runner is playing
        self._commits: set[asyncio.Task] = set()

    async def _main(self) -> None:
        agent = self.cfg.actor.agent
        app = build_app(
            self.service,
            api_key=self.api_key,
            max_request_bytes=agent.max_request_bytes,
            default_group_size=self.cfg.actor.group_size,
        )
        server = EndpointServer(app, host=agent.host, port=agent.port, registry=self.registry)
        async with server:
            self.endpoint_url = server.base_url
            self._runner = AgentRunner(
                self.program,
                self.registry,
                server.base_url,
                api_key=self.api_key,
                request_timeout_s=agent.episode_timeout_s,
                connections=max(16, self.cfg.actor.envs_per_actor),
            )
            try:
                await super()._main()
                await asyncio.gather(*self._commits)
            finally:
                await self._runner.aclose()

    async def _play_group(self) -> list[Episode]:
        assert self._runner is not None
        group, seed = self._next_group()
        name = f"{self.actor_id}/{group}"
        envs = [self._make_env(seed, k) for k in range(self.cfg.actor.group_size)]
        self._own[name] = []
        try:
            await self._runner.play_group(name, seed=seed, envs=envs)
            return self._own[name]
        finally:
            del self._own[name]

    def _refuse_group(self, name: str) -> str | None:
        """Flow control for an external harness's new groups (the runner's own groups
        were admitted by their group loop): the gate's last decision, refreshed at every
        poll while it pauses."""
        if name in self._own or self.gate is None or self.gate.last.admit:
            return None
        return f"flow control: {self.gate.last.reason}"

    def _leave_if_parked(self, in_flight: int) -> None:
        """An external harness's open episodes are in flight too: leave only once they
        ended and their groups are committed."""
        super()._leave_if_parked(in_flight + len(self.registry) + len(self._commits))

    def _on_group(self, name: str, episodes: list[Episode]) -> None:
        """The registry's hand-over of an ended group (on the event loop): the runner's
        own groups go back to their group loop, an external harness's are committed here."""
        if name in self._own:
            self._own[name] = episodes
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._commit, episodes))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)
        task.add_done_callback(self._background_ended)  # its error stops the actor

    def _engine_metrics(self) -> dict[str, Any]:
        over = sorted(self.service.overhead_s[-2000:]) or [0.0]
        return {
            **super()._engine_metrics(),
            "endpoint_requests": self.service.requests,
            "endpoint_refused": dict(self.service.refused),
            "endpoint_dropped": dict(self.registry.dropped),
            "endpoint_open_episodes": len(self.registry),
            "endpoint_overhead_p50_ms": 1000 * over[len(over) // 2],
        }

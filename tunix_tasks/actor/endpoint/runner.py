"""Running a user's agent program: `run(client, task) -> reward`, unchanged, many at once.

The program is any async function, importable as `package.module:function`, that talks to
the model only through the OpenAI client it is given (an `openai.AsyncOpenAI` whose
`base_url` is one episode's) and returns the episode's reward. Tasks come from the run's
environment (`env.name`): each member of a GRPO group gets its own env instance reset
to the group's seed, and the task is

    {"prompt": <the env's first observation>, "tools": <the env's tool schemas>,
     "seed": <the env seed>, "grade": <async (answer: str) -> float: the env's reward>}

so the env decides what is asked and how an answer scores, and the program decides how
to get there (which messages, which tools, how many turns):

    runner = AgentRunner(load_program("my_pkg.agent:run"), registry, base_url, api_key)
    await runner.play_group("g-17", seed=17, envs=[env_a, env_b])   # group_size members

An episode whose program raises, or returns no finite number, is dropped as
`agent_error` (logged once per program error type); its group is committed without it.
A program whose episode the registry drops meanwhile (`abandoned`: no request for
`actor.agent.episode_timeout_s`; `disconnected`) is cancelled, so a hung one does not run
on beside the episodes that replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry, OpenEpisode
from tunix_tasks.envs.base import Environment
from tunix_tasks.episode import MAX_ABS_REWARD, reward_in_range
from tunix_tasks.messages import Action

__all__ = ["AgentProgram", "AgentRunner", "load_program"]

log = logging.getLogger(__name__)

_POOL = 8  # connections per HTTP client pool

AgentProgram = Callable[[Any, dict[str, Any]], Awaitable[float]]


def load_program(path: str) -> AgentProgram:
    """The async function at `package.module:function`; ValueError naming what is wrong."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"actor.agent.program {path}: cannot import {module_name}: {e}") from e
    program = getattr(module, name, None)
    if program is None:
        raise ValueError(f"actor.agent.program {path}: {module_name} has no {name!r}")
    if not inspect.iscoroutinefunction(program):
        raise ValueError(
            f"actor.agent.program {path}: not an async function (async def run(client, task))"
        )
    return program


def _openai():
    try:
        import openai
    except ImportError as e:
        raise ImportError(
            "actor.kind=agent gives the program an openai client: pip install openai"
        ) from e
    return openai


class AgentRunner:
    """Plays groups of a program's episodes against the endpoint (module docstring)."""

    def __init__(
        self,
        program: AgentProgram,
        registry: EpisodeRegistry,
        base_url: str,
        *,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        connections: int = 256,
    ) -> None:
        import httpx

        self.program = program
        self.registry = registry
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key or "unused"
        self._openai = _openai()
        # Small pools: httpcore matches a request to a connection in time linear in the
        # pool's connections, so one pool of 256 spent most of a 256-episode run there.
        self._http = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(request_timeout_s, connect=30.0),
                limits=httpx.Limits(max_connections=_POOL, max_keepalive_connections=_POOL),
            )
            for _ in range(max(1, -(-connections // _POOL)))
        ]
        self._episodes = 0
        self._logged: set[str] = set()

    async def aclose(self) -> None:
        for http in self._http:
            await http.aclose()

    async def play_group(self, group: str, *, seed: int, envs: Sequence[Environment]) -> list[str]:
        """One group: a program run per env, all at once, each closed or dropped; the
        episode ids, in `envs` order."""
        opened = [self.registry.open(group=group, group_size=len(envs), seed=seed) for _ in envs]
        await asyncio.gather(
            *(self._play(ep, env, seed) for ep, env in zip(opened, envs, strict=True))
        )
        return [ep.id for ep in opened]

    async def _play(self, episode: OpenEpisode, env: Environment, seed: int) -> None:
        episode_id = episode.id
        client = self._openai.AsyncOpenAI(
            base_url=f"{self.base_url}/episodes/{episode_id}/v1",
            api_key=self._api_key,
            http_client=self._http[self._episodes % len(self._http)],
        )
        self._episodes += 1
        try:
            task = await self._task(env, seed)
            finished, reward = await self._until_ended(self.program(client, task), episode)
            if not finished:  # dropped meanwhile (abandoned, disconnected): counted there
                return
            if (
                isinstance(reward, bool)
                or not isinstance(reward, int | float)
                or not reward_in_range(reward)
            ):
                raise TypeError(
                    f"the program returned {reward!r}, not a number within +-{MAX_ABS_REWARD:g}"
                )
        except Exception as err:  # the program's failure ends its episode, not the actor
            kind = type(err).__name__
            if kind not in self._logged:
                self._logged.add(kind)
                log.warning("agent program failed (episode dropped as agent_error): %r", err)
            self.registry.drop(episode_id, "agent_error")
            return
        try:
            self.registry.close(episode_id, reward=float(reward))
        except Exception as err:  # ended meanwhile (abandoned, disconnected)
            log.info("episode %s not closed: %s", episode_id, err)

    @staticmethod
    async def _until_ended(run: Awaitable[Any], episode: OpenEpisode) -> tuple[bool, Any]:
        """(True, the program's return value), or (False, None) once its episode ended
        without it (the registry dropped it: idle past the timeout, or its client went
        away): the program is cancelled then, as when the actor stops, so a program that
        hangs does not run on forever."""
        program = asyncio.ensure_future(run)
        ended = asyncio.ensure_future(episode.ended.wait())
        try:
            await asyncio.wait({program, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not program.done():
                program.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await program  # its finally blocks run before the slot is reused
        if program.cancelled():
            return False, None
        return True, program.result()

    @staticmethod
    async def _task(env: Environment, seed: int) -> dict[str, Any]:
        prompt = await env.reset(seed)

        async def grade(answer: str) -> float:
            return float((await env.step(Action(content=str(answer)))).reward)

        return {
            "prompt": prompt,
            "tools": list(getattr(env, "tools", ())),
            "seed": seed,
            "grade": grade,
        }

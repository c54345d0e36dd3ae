"""The vectorized actor (`actor.kind: vectorized`): JAX environments and the policy on the device.

    actor = VectorizedActor(cfg, store, actor_id="actor-0")
    summary = actor.run()          # until DONE marker, deadline, SIGTERM/SIGINT/SIGHUP

`envs_per_actor` rows step in one jitted loop (the engine, `ondevice.OnDeviceRollout`,
`device_loop.py`); between segments the actor reloads weights, and while the device runs
the next segment it turns the last one's finished episodes into `Episode`s (the runtime's
`EpisodeBuilder`; `seed` is the group's env seed: `env.reset(jax.random.key(seed))` is
its task) and commits each GRPO group (`group_size` episodes of one task) once all its
members are in. The shards are the asynchronous actor's: same schema, same validation,
one learner for both.

Flow control (`actor/admission.py`) sets each segment's budget of new episodes: its
room, what can start before the last would reach the learner past the staleness bound
(0 while paused). Rows that finish past the budget go idle (after completing the open
group), so nothing is held through a pause to arrive stale, and while no row is live and
there is no room, no segment is launched.
"""

from __future__ import annotations

import time
from typing import Any

from tunix_tasks.actor.admission import PAUSED_RECHECK_S
from tunix_tasks.actor.runtime import ActorRuntime, episode_seed
from tunix_tasks.actor.vectorized.device_loop import Finished, Shape
from tunix_tasks.actor.vectorized.ondevice import UNLIMITED, OnDeviceRollout
from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.config import RunConfig
from tunix_tasks.envs.vectorized import make_vec_env
from tunix_tasks.episode import Episode, EpisodeStatus
from tunix_tasks.policy.build import build_policy
from tunix_tasks.storage.store import ObjectStore

__all__ = ["VectorizedActor"]


class VectorizedActor(ActorRuntime):
    """`actor.kind: vectorized` (module docstring)."""

    engine: OnDeviceRollout

    def __init__(self, cfg: RunConfig, store: ObjectStore, **kwargs: Any) -> None:
        super().__init__(cfg, store, **kwargs)
        self.segment_steps = cfg.actor.max_episode_tokens  # about one episode per row per segment
        self._groups: dict[int, list[Episode]] = {}
        # Every row feeds one token per step: row steps/s is the loop's speed.
        self.row_steps = 0  # since the start, as of `collected_at` (a segment's end)
        self.collected_at = time.monotonic()
        self._rate_from = (0, self.collected_at)  # at the previous metrics record

    def _build_engine(self) -> OnDeviceRollout:
        cfg, a = self.cfg, self.cfg.actor
        chat, model = build_policy(cfg.model, seed=cfg.seed)
        env = make_vec_env(cfg.env.name, **cfg.env.kwargs)
        e = a.envs_per_actor
        shape = Shape(
            e, a.max_episode_tokens, a.max_new_tokens, cfg.env.max_turns, a.group_size, 2 * e
        )
        return OnDeviceRollout(
            model,
            env,
            TokenLayout.from_chat(chat),
            shape,
            temperature=a.temperature,
            top_k=a.top_k,
            token_seed=episode_seed(cfg.seed, self._seed_key, -1),
            env_seed=episode_seed(cfg.seed, self._seed_key, -2),
        )

    def _serve(self) -> None:
        pending, budget = None, 0  # the segment launched, not yet fetched, and its budget
        last_watch = 0.0
        live = 0  # rows playing an episode, as of the last segment fetched
        try:
            while not self._should_stop():
                self._maybe_reload()  # rows in flight continue under the new weights
                # Started, not committed: rows playing, the pending segment's starts (at
                # most its budget, and never more than its rows and finished slots) and the
                # finished members of open groups.
                held = sum(len(m) for m in self._groups.values())
                starts = min(budget, self.engine.shape.envs + self.engine.shape.capacity)
                in_flight = live + (starts if pending else 0) + held
                room = self._room(in_flight)
                if not room and self.gate is not None and self.gate.confirm:
                    self._maybe_reload()  # a fresh position and newer weights may make room
                    room = self._room(in_flight)
                launched, budget = None, int(min(room, UNLIMITED))
                if budget or live:  # no room: the live rows finish, then idle
                    launched = self.engine.launch(self.segment_steps, budget=budget)
                if pending is not None:
                    live = self._collect(*self.engine.fetch(pending))
                self._flush_early()
                pending = launched
                if pending is None:
                    self._leave_if_parked(live + sum(len(m) for m in self._groups.values()))
                    time.sleep(PAUSED_RECHECK_S)
                if time.monotonic() - last_watch >= 1.0:
                    last_watch = time.monotonic()
                    if self._watch_once():
                        break
        finally:  # what already finished on the device is not lost
            if pending is not None:
                self._collect(*self.engine.fetch(pending))

    def _collect(self, out: Finished, ran: int, live: int) -> int:
        """Episodes of a segment; commit every group whose members are all in. Returns
        the rows still `live` at its end."""
        g = self.cfg.actor.group_size
        self.row_steps += ran * self.engine.shape.envs
        self.collected_at = time.monotonic()
        for i in range(int(out.count)):
            n, group = int(out.length[i]), int(out.ticket[i]) // g
            ep = self.episodes(
                out.tokens[i, :n],
                out.mask[i, :n],
                out.logprobs[i, :n],
                group=group,
                seed=int(out.seed[i]),
                reward=out.reward[i],
                policy_version=out.version[i],
                num_turns=out.turns[i],
                status=EpisodeStatus.TRUNCATED if out.truncated[i] else EpisodeStatus.OK,
            )
            members = self._groups.setdefault(group, [])
            members.append(ep)
            if len(members) == g:
                self._commit(self._groups.pop(group))
        return live

    def _engine_metrics(self) -> dict[str, Any]:
        steps, since = self._rate_from
        dt = self.collected_at - since
        rate = (self.row_steps - steps) / dt if dt > 0 else None
        self._rate_from = (self.row_steps, self.collected_at)
        return {
            "envs": self.engine.shape.envs,
            "groups_open": len(self._groups),
            "row_steps_per_s": rate,
        }

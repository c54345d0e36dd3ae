"""`EpisodeBuilder`: the one place an `Episode` is assembled from a finished rollout.

Both actor kinds, evaluation and the demonstrations make their episodes here, so the
fields mean the same whoever wrote the shard: `actor_id` and `env` name the writer and
the environment's registry name, `group_id` is `<group_key>/<group>` (the GRPO group, one
task: group_key is the actor's `<actor_id>/<incarnation>`, so ids never repeat across
restarts) and `seed` is the environment seed that reproduces the group's task (`Episode`).

    episodes = EpisodeBuilder(actor_id="actor-0", env="calculator", group_key="actor-0/3fa2")
    ep = episodes(tokens, mask, logprobs, group=5, seed=8127, reward=1.0, policy_version=3,
                  num_turns=2, status="ok")     # group_id "actor-0/3fa2/5"
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from tunix_tasks.episode import Episode

__all__ = ["EpisodeBuilder"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeBuilder:
    """The fields every episode of one writer shares (module docstring); outside an actor
    (evaluation, demonstrations) `actor_id` and `group_key` are empty and so are group ids."""

    actor_id: str = ""
    env: str = ""
    group_key: str = ""

    def group_id(self, group: int | None) -> str:
        return f"{self.group_key}/{group}" if self.group_key and group is not None else ""

    def __call__(
        self,
        tokens: np.ndarray | list[int],
        loss_mask: np.ndarray | list[int],
        behavior_logprobs: np.ndarray | list[float],
        *,
        group: int | None,
        seed: int,
        reward: float = 0.0,
        policy_version: int = 0,
        num_turns: int = 0,
        status: str = "ok",
        episode_id: str | None = None,
    ) -> Episode:
        return Episode(
            episode_id or uuid.uuid4().hex,
            tokens,
            loss_mask,
            behavior_logprobs,
            reward=float(reward),
            policy_version=int(policy_version),
            actor_id=self.actor_id,
            env=self.env,
            group_id=self.group_id(group),
            seed=int(seed),
            num_turns=int(num_turns),
            status=status,
        )

"""One episode, token by token: the layout shared by actors, evaluation and warm start.

    BOS  USER obs ASSISTANT  action END  USER obs ASSISTANT  action END ...  EOS
    mask: 0 on everything the environment or the layout wrote, 1 on policy tokens

`play_episode` drives one environment with any `Policy` (the actor's batched sampler, a
greedy evaluator, or a scripted demonstration) and returns the `Episode`: tokens, loss
mask, behaviour log-probs, reward, turns, status and the oldest weights version used:

    ep = await play_episode(env, policy, seed=7, limits=EpisodeLimits(...), tok=tok)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tunix_tasks.config import RunConfig
from tunix_tasks.envs.base import Environment
from tunix_tasks.episode import Episode
from tunix_tasks.policy.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Policy(Protocol):
    """Continues a token context by one action (ending with END when it stops itself)."""

    async def __call__(self, context: Sequence[int]) -> tuple[list[int], list[float], int]:
        """Returns (action tokens, their behaviour log-probs, weights version used)."""
        ...


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int
    max_new_tokens: int
    step_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EpisodeLimits:
        return cls(
            max_turns=cfg.env.max_turns,
            max_episode_tokens=cfg.actor.max_episode_tokens,
            max_new_tokens=cfg.actor.max_new_tokens,
            step_timeout_s=cfg.env.step_timeout_s,
        )


@dataclass
class _Transcript:
    """The episode as it is being played (mutable); `episode()` freezes it."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    status: str = "ok"
    versions: set[int] = field(default_factory=set)

    def extend(
        self, tokens: Sequence[int], *, policy: bool, logprobs: Sequence[float] = ()
    ) -> None:
        self.tokens.extend(tokens)
        self.loss_mask.extend([1 if policy else 0] * len(tokens))
        self.logprobs.extend(logprobs if policy else [0.0] * len(tokens))


async def play_episode(
    env: Environment,
    policy: Policy,
    *,
    seed: int,
    limits: EpisodeLimits,
    tok: Tokenizer,
    episode_id: str | None = None,
    env_name: str | None = None,
    actor_id: str = "",
    group_id: str = "",
    default_version: int = 0,
    on_env_step: Callable[[float], None] | None = None,
) -> Episode:
    """Run one episode. Environment errors end it with status `env_error`, slow steps and
    the token budget with `truncated`; neither raises. `env_name` defaults to `env.name`
    (the actor passes the registry name it was made by); `default_version` is the
    episode's policy version when no policy call was made; `on_env_step(seconds)` sees
    every step's duration."""
    rec = _Transcript()

    def episode() -> Episode:
        rec.extend([tok.eos_id], policy=False)  # every episode ends with EOS
        return Episode(
            episode_id or uuid.uuid4().hex,
            rec.tokens,
            rec.loss_mask,
            rec.logprobs,
            reward=rec.reward,
            policy_version=min(rec.versions, default=default_version),
            actor_id=actor_id,
            env=env_name if env_name is not None else getattr(env, "name", ""),
            group_id=group_id,
            seed=seed,
            num_turns=rec.turns,
            status=rec.status,
        )

    rec.extend([tok.bos_id], policy=False)
    loop = asyncio.get_running_loop()
    try:
        obs = await asyncio.wait_for(env.reset(seed), limits.step_timeout_s)
    except TimeoutError:
        rec.status = "truncated"
        return episode()
    except Exception as err:
        log.warning("env %s reset(seed=%d) failed: %r", getattr(env, "name", "?"), seed, err)
        rec.status = "env_error"
        return episode()
    for _ in range(limits.max_turns):
        prompt = [tok.user_id, *tok.encode(obs), tok.assistant_id]
        room = limits.max_episode_tokens - len(rec.tokens) - len(prompt) - 1  # keep EOS slot
        if room < 2:
            rec.status = "truncated"
            break
        rec.extend(prompt, policy=False)
        tokens, logprobs, version = await policy(rec.tokens)
        tokens, logprobs = (
            tokens[: min(room, limits.max_new_tokens)],
            logprobs[: min(room, limits.max_new_tokens)],
        )
        rec.versions.add(version)
        rec.extend(tokens, policy=True, logprobs=logprobs)
        rec.turns += 1
        action = tok.decode(t for t in tokens if t not in (tok.end_id, tok.eos_id))
        t0 = loop.time()
        try:
            result = await asyncio.wait_for(env.step(action), limits.step_timeout_s)
        except TimeoutError:
            rec.status = "truncated"
            break
        except Exception as err:
            log.warning("env %s step failed: %r", getattr(env, "name", "?"), err)
            rec.status = "env_error"
            break
        finally:
            if on_env_step is not None:
                on_env_step(loop.time() - t0)
        rec.reward += float(result.reward)
        obs = result.observation
        if result.done:
            break
    else:
        rec.status = "truncated"  # ran out of turns without the env finishing
    return episode()


class ScriptedPolicy:
    """Replays fixed action strings (demonstrations for the supervised warm start)."""

    def __init__(self, actions: Sequence[str], tok: Tokenizer) -> None:
        self._actions = list(actions)
        self._tok = tok

    async def __call__(self, context: Sequence[int]) -> tuple[list[int], list[float], int]:
        text = self._actions.pop(0) if self._actions else ""
        tokens = [*self._tok.encode(text), self._tok.end_id]
        return tokens, [0.0] * len(tokens), 0

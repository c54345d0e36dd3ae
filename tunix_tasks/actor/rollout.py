"""One episode, token by token: the layout shared by actors, evaluation and warm start.

    BOS  USER obs ASSISTANT  action END  USER obs ASSISTANT  action END ...  EOS
    mask: 0 on everything the environment or the layout wrote, 1 on policy tokens

`play_episode` drives one environment with any `Policy` (the actor's batched sampler, a
greedy evaluator, or a scripted demonstration) and returns the tokens, loss mask,
behaviour log-probs, reward, turns and status of the episode:

    record = await play_episode(env, policy, seed=7, limits=EpisodeLimits(...), tok=tok)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tunix_tasks.config import RunConfig
from tunix_tasks.envs.base import Environment
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
class EpisodeRecord:
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    status: str = "ok"
    versions: set[int] = field(default_factory=set)
    env_step_s: list[float] = field(default_factory=list)

    def extend(
        self, tokens: Sequence[int], *, policy: bool, logprobs: Sequence[float] = ()
    ) -> None:
        self.tokens.extend(tokens)
        self.loss_mask.extend([1 if policy else 0] * len(tokens))
        self.logprobs.extend(logprobs if policy else [0.0] * len(tokens))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.asarray(self.tokens, np.int32),
            np.asarray(self.loss_mask, np.int8),
            np.asarray(self.logprobs, np.float32),
        )


async def play_episode(
    env: Environment,
    policy: Policy,
    *,
    seed: int,
    limits: EpisodeLimits,
    tok: Tokenizer,
) -> EpisodeRecord:
    """Run one episode. Environment errors end it with status `env_error`, slow steps and
    the token budget with `truncated`; neither raises."""
    rec = EpisodeRecord()
    rec.extend([tok.bos_id], policy=False)
    loop = asyncio.get_running_loop()
    try:
        obs = await asyncio.wait_for(env.reset(seed), limits.step_timeout_s)
    except TimeoutError:
        rec.status = "truncated"
        rec.extend([tok.eos_id], policy=False)  # every episode ends with EOS
        return rec
    except Exception as err:
        log.warning("env %s reset(seed=%d) failed: %r", getattr(env, "name", "?"), seed, err)
        rec.status = "env_error"
        rec.extend([tok.eos_id], policy=False)
        return rec
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
            rec.env_step_s.append(loop.time() - t0)
        rec.reward += float(result.reward)
        obs = result.observation
        if result.done:
            break
    else:
        rec.status = "truncated"  # ran out of turns without the env finishing
    rec.extend([tok.eos_id], policy=False)
    return rec


class ScriptedPolicy:
    """Replays fixed action strings (demonstrations for the supervised warm start)."""

    def __init__(self, actions: Sequence[str], tok: Tokenizer) -> None:
        self._actions = list(actions)
        self._tok = tok

    async def __call__(self, context: Sequence[int]) -> tuple[list[int], list[float], int]:
        text = self._actions.pop(0) if self._actions else ""
        tokens = [*self._tok.encode(text), self._tok.end_id]
        return tokens, [0.0] * len(tokens), 0

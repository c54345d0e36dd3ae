"""One episode, token by token: the layout shared by actors, evaluation and warm start.

The policy's `ChatFormat` (policy/chat.py) lays the conversation out as tokens; the
environment speaks messages and tool calls (envs/base.py). Token-in / token-out: the ids a
policy sampled go into the episode exactly as sampled, and each environment reply is
appended as the chat format's own ids for that message, never decoded and re-tokenized:

    start(first user message) | sampled turn [close] | reply(tool/user message) | ... | end
    mask: 0 on everything the environment or the template wrote, 1 on sampled tokens

`play_episode` drives one environment with any `Policy` (the actor's batched sampler, a
greedy evaluator, or a scripted demonstration) and returns the `Episode`: tokens, loss
mask, behaviour log-probs, reward, turns, status and the oldest weights version used:

    ep = await play_episode(env, policy, seed=7, limits=EpisodeLimits(...), chat=chat)

A turn whose tool call cannot be parsed is answered with `error: <why>` (role user: no call
was read for a tool message to name) without calling the environment; it still counts as
a turn. A turn's tool calls are answered one message each when the environment gives one
result per call (`Action.replies`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import RunConfig
from tunix_tasks.envs.base import Environment, StepResult
from tunix_tasks.episode import MAX_ABS_REWARD, Episode, EpisodeStatus, reward_in_range
from tunix_tasks.logs import warn_once
from tunix_tasks.messages import Action, Message
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.template_sandbox import ChatTemplateError

log = logging.getLogger(__name__)


class Policy(Protocol):
    """Continues a token context by one turn (ending with a stop id when it stops itself).

    `messages` and `tools` are the conversation the context encodes (a sampler ignores
    them; a scripted policy renders its next action after them); `session` is the
    episode's id, the same on every turn (a sampler keeps that episode's KV cache)."""

    async def __call__(
        self,
        context: Sequence[int],
        *,
        messages: Sequence[Message] = (),
        tools: Sequence[dict[str, Any]] = (),
        session: str | None = None,
    ) -> tuple[list[int], list[float], int]:
        """Returns (turn tokens, their behaviour log-probs, weights version used)."""
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
class Transcript:
    """The episode as it is being played (mutable); `episode()` freezes it."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    status: EpisodeStatus = EpisodeStatus.OK
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
    chat: ChatFormat,
    episode_id: str | None = None,
    builder: EpisodeBuilder | None = None,
    group: int | None = None,
    default_version: int = 0,
    on_env_step: Callable[[float], None] | None = None,
) -> Episode:
    """Run one episode. Environment errors end it with status `env_error`, a reset or step
    slower than `step_timeout_s` with `env_timeout` (the learner drops both: slow
    infrastructure is no evidence about the policy), the token or turn budget with
    `truncated`; none raises. `builder` stamps the episode (the actor's: its id, the
    env's registry name, `group`'s id; by default none and `env.name`); `default_version`
    is the episode's policy version when no policy call was made; `on_env_step(seconds)`
    sees every step's duration."""
    rec = Transcript()
    tools = list(getattr(env, "tools", ()))
    episode_id = episode_id or uuid.uuid4().hex
    builder = builder or EpisodeBuilder(env=getattr(env, "name", ""))

    def episode() -> Episode:
        if not rec.tokens:  # the env never started: an empty first prompt keeps it non-empty
            rec.extend(chat.start([{"role": "user", "content": ""}], tools), policy=False)
        rec.extend(chat.end_ids, policy=False)
        return builder(
            rec.tokens,
            rec.loss_mask,
            rec.logprobs,
            group=group,
            seed=seed,
            reward=rec.reward,
            policy_version=min(rec.versions, default=default_version),
            num_turns=rec.turns,
            status=rec.status,
            episode_id=episode_id,
        )

    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(limits.step_timeout_s):  # not wait_for: see _answer
            first = await env.reset(seed)
    except TimeoutError:
        rec.status = EpisodeStatus.ENV_TIMEOUT
        return episode()
    except Exception as err:
        log.warning("env %s reset(seed=%d) failed: %r", getattr(env, "name", "?"), seed, err)
        rec.status = EpisodeStatus.ENV_ERROR
        return episode()
    history: list[Message] = [{"role": "user", "content": first}]
    prompt = chat.start(history, tools)
    # Room kept for closing the turn and the episode's end ids.
    reserve = len(chat.end_ids) + 1
    for _ in range(limits.max_turns):
        room = limits.max_episode_tokens - len(rec.tokens) - len(prompt) - reserve
        if room < 2:
            rec.status = EpisodeStatus.TRUNCATED
            break
        rec.extend(prompt, policy=False)
        tokens, logprobs, version = await policy(
            rec.tokens, messages=history, tools=tools, session=episode_id
        )
        keep = min(room, limits.max_new_tokens)
        tokens, logprobs = tokens[:keep], logprobs[:keep]
        rec.versions.add(version)
        rec.extend(tokens, policy=True, logprobs=logprobs)
        rec.extend(chat.close_turn(tokens), policy=False)
        rec.turns += 1
        action = chat.parse(tokens, tools).with_call_ids(rec.turns)
        history.append(action.message())
        t0 = loop.time()
        try:
            result = await _answer(env, action, limits.step_timeout_s)
        except TimeoutError:
            rec.status = EpisodeStatus.ENV_TIMEOUT
            break
        except Exception as err:
            log.warning("env %s step failed: %r", getattr(env, "name", "?"), err)
            rec.status = EpisodeStatus.ENV_ERROR
            break
        finally:
            if on_env_step is not None:
                on_env_step(loop.time() - t0)
        if not reward_in_range(rec.reward + float(result.reward)):
            log.warning(
                "env %s step reward %r: not finite or beyond +-%g (episode.MAX_ABS_REWARD); "
                "episode ended as env_error",
                getattr(env, "name", "?"),
                result.reward,
                MAX_ABS_REWARD,
            )
            rec.status = EpisodeStatus.ENV_ERROR
            break
        rec.reward += float(result.reward)
        if result.done:
            break
        try:
            replies = action.replies(result.observation)
        except ValueError as err:
            log.warning(
                "env %s step: %s; episode ended as env_error", getattr(env, "name", "?"), err
            )
            rec.status = EpisodeStatus.ENV_ERROR
            break
        try:
            prompt = chat.reply(history, replies, tools)
        except ChatTemplateError as err:
            # The template refuses the conversation the policy's turn made (Mistral's v7+
            # refuse an assistant turn with neither content nor a call): the episode ends
            # there, trained on as it stands, rather than the actor.
            warn_once(log, f"episode ended: its next prompt does not render: {err}")
            rec.status = EpisodeStatus.TRUNCATED
            break
        history.extend(replies)
    else:
        rec.status = EpisodeStatus.TRUNCATED  # ran out of turns without the env finishing
    return episode()


async def _answer(env: Environment, action: Action, timeout_s: float) -> StepResult:
    """The environment's answer, or the parse error of an action it cannot receive."""
    if action.error is not None:
        return StepResult(f"error: {action.error}", 0.0, False, {"parse_error": action.error})
    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
    # lands as the step completes, and the cancelled episode played on against a stopped
    # sampler (an actor giving up in a store outage then never finished stopping).
    async with asyncio.timeout(timeout_s):
        return await env.step(action)


class ScriptedPolicy:
    """Replays fixed actions (demonstrations for the supervised warm start), each rendered
    the way the chat format's model writes it after the conversation so far."""

    def __init__(self, actions: Sequence[Action], chat: ChatFormat) -> None:
        self._actions = list(actions)
        self._chat = chat

    async def __call__(
        self,
        context: Sequence[int],
        *,
        messages: Sequence[Message] = (),
        tools: Sequence[dict[str, Any]] = (),
        session: str | None = None,
    ) -> tuple[list[int], list[float], int]:
        action = self._actions.pop(0) if self._actions else Action()
        turn = 1 + sum(m.get("role") == "assistant" for m in messages)  # as play_episode's
        tokens = self._chat.render_action(messages, action.with_call_ids(turn), tools)
        return tokens, [0.0] * len(tokens), 0

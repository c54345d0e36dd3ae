"""`EndpointService`: one chat-completion request of one episode, token in / token out.

    service = EndpointService(chat, policy, registry, limits)
    body = await service.complete(episode_id, request, disconnected=...)  # chat.completion

The request's messages are matched against the episode (fidelity.py): only the new ones
are rendered by the chat template (`chat.start` on the first request, `chat.reply` after a
sampled turn) and appended to the episode's tokens; the policy (the actor's continuously
batched sampler, `BatchingPolicy`) continues those tokens, and the sampled ids, their
behaviour log-probs and version are recorded exactly as sampled, like `play_episode` does.
The parsed turn (content, tool calls) is what the client receives and must send back.
A forced `tool_choice` prefixes the turn with the template's tool-call opening, recorded
as prompt tokens (tool_choice.py).

Sampling settings are the run's: the learner recomputes log-probs with `actor.temperature`
and `actor.top_k`, so a request asking for another `temperature` (or `top_p` < 1) is
refused with a 400 naming the setting rather than sampled with a distribution the learner
would not score. `n` > 1 samples n choices of the turn; the client's next request continues
one of them, the others end as branches of the episode (episodes.py). `stream: true` gets
the same turns as server-sent events (`wire.completion_chunks`), sent once they are
sampled. `stop` strings end a turn at the first token whose text completes one (the kept
ids are a prefix of the sample, their log-probs unchanged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry, OpenEpisode, PendingTurn
from tunix_tasks.actor.endpoint.fidelity import HistoryMismatch, match_history
from tunix_tasks.actor.endpoint.tool_choice import as_text, forced_opening, read_tool_choice
from tunix_tasks.actor.endpoint.wire import ApiError, ChatRequest, choice, completion
from tunix_tasks.config import RunConfig
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.chat_template import ChatTemplateError
from tunix_tasks.policy.requests import Sample

__all__ = ["EndpointLimits", "EndpointService"]


class Policy(Protocol):
    """What the endpoint samples from: the actor's `BatchingPolicy`."""

    async def sample(
        self,
        context: Sequence[int],
        *,
        session: Hashable | None = None,
        max_new_tokens: int | None = None,
        top_logprobs: int = 0,
    ) -> Sample: ...


@dataclass(frozen=True, kw_only=True)
class EndpointLimits:
    """The run's sampling settings and the endpoint's bounds (docs/agents.md, "Limits")."""

    model: str
    max_episode_tokens: int
    max_new_tokens: int
    temperature: float
    top_k: int
    max_concurrent_requests: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EndpointLimits:
        return cls(
            model=cfg.model.served_name,
            max_episode_tokens=cfg.actor.max_episode_tokens,
            max_new_tokens=cfg.actor.max_new_tokens,
            temperature=cfg.actor.temperature,
            top_k=cfg.actor.top_k,
            max_concurrent_requests=cfg.actor.agent.max_concurrent_requests,
        )


class EndpointService:
    """Serves chat completions of the registry's episodes (module docstring)."""

    def __init__(
        self,
        chat: ChatFormat,
        policy: Policy,
        registry: EpisodeRegistry,
        limits: EndpointLimits,
    ) -> None:
        self.chat = chat
        self.policy = policy
        self.registry = registry
        self.limits = limits
        self.in_flight = 0
        self.requests = 0
        self.refused: dict[str, int] = {}
        self.overhead_s: list[float] = []  # per request: wall time minus the policy call

    async def complete(
        self,
        episode_id: str,
        request: ChatRequest,
        *,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> dict:
        """The `chat.completion` of the episode's next turn; ApiError for every refusal.
        `disconnected()` returns when the client has gone away (the episode is dropped)."""
        t0 = time.perf_counter()
        try:
            ep = self.registry.get(episode_id)
            self._check(ep, request)
            tools = request.tools or []
            tool_choice = read_tool_choice(request.tool_choice, tools)
            prompt, new = self._render(ep, request)
            forced = forced_opening(self.chat, [*ep.recorded, *new], tools, tool_choice)
            prompt += forced
            room = self._room(ep, prompt)
            max_new = min(request.max_new or self.limits.max_new_tokens, room)
            ep.busy = True
            self.in_flight += 1
            try:
                t1 = time.perf_counter()
                samples = await self._sample(
                    ep, ep.record.tokens + prompt, max_new, request, disconnected
                )
                policy_s = time.perf_counter() - t1
            finally:
                ep.busy = False
                ep.last_active = time.monotonic()
                self.in_flight -= 1
        except ApiError as err:
            code = err.body["error"]["code"] or str(err.status)
            self.refused[code] = self.refused.get(code, 0) + 1
            raise
        self.requests += 1
        body = self._record(ep, request, tool_choice, prompt, forced, new, samples)
        self.overhead_s.append(time.perf_counter() - t0 - policy_s)
        del self.overhead_s[:-10000]
        return body

    def _check(self, ep: OpenEpisode, request: ChatRequest) -> None:
        lim = self.limits
        if ep.busy:
            raise ApiError(
                409, f"episode {ep.id} already has a request in flight", code="episode_busy"
            )
        if self.in_flight >= lim.max_concurrent_requests:
            raise ApiError(
                429,
                f"{self.in_flight} requests in flight, the limit "
                f"(actor.agent.max_concurrent_requests) is {lim.max_concurrent_requests}; retry",
                type="rate_limit_error",
                code="too_many_concurrent_requests",
            )
        unsupported = {
            "temperature": request.temperature not in (None, lim.temperature)
            and f"this run samples at temperature {lim.temperature} (actor.temperature), "
            "the one the learner scores with",
            "top_p": request.top_p not in (None, 1.0) and "only top_p=1 (actor.top_k filters)",
            "top_logprobs": bool(request.top_logprobs)
            and not request.logprobs
            and "needs logprobs: true",
        }
        for param, why in unsupported.items():
            if why:
                raise ApiError(400, f"{param}: {why}", param=param, code="unsupported_value")
        if ep.tools is not None and (request.tools or []) != ep.tools:
            raise ApiError(
                409,
                "tools differ from the episode's first request (they are part of the rendered "
                "prompt); open a new episode",
                param="tools",
                code="history_mismatch",
            )

    def _render(self, ep: OpenEpisode, request: ChatRequest) -> tuple[list[int], list]:
        """The ids of the request's new messages (and those messages)."""
        try:
            new = self._match(ep, request.messages)
        except HistoryMismatch as err:
            raise ApiError(
                409,
                f"the conversation does not extend this episode's: {err} (docs/agents.md, "
                "token fidelity); open a new episode for another conversation",
                param=f"messages[{err.index}]",
                code="history_mismatch",
            ) from None
        except ValueError as err:
            raise ApiError(400, f"messages: {err}", param="messages") from None
        try:
            tools = request.tools or []
            if ep.recorded:
                return self.chat.reply(ep.recorded, new, tools), new
            return self.chat.start(new, tools), new
        except ChatTemplateError as err:
            raise ApiError(400, f"messages: {err}", param="messages") from None

    @staticmethod
    def _match(ep: OpenEpisode, messages: list) -> list:
        """`match_history`'s new messages; after an `n` > 1 turn, the choice the client
        sent back is the one the episode continues with (HistoryMismatch if none is)."""
        if ep.pending is None:
            return match_history(ep.recorded, messages)
        mismatch = None
        for j, (_, message) in enumerate(ep.pending.choices):
            try:
                new = match_history([*ep.recorded, *ep.pending.new, message], messages)
            except HistoryMismatch as err:
                mismatch = mismatch or err
                continue
            ep.continue_with(j)
            return new
        raise mismatch

    def _room(self, ep: OpenEpisode, prompt: Sequence[int]) -> int:
        """New tokens the episode has room for; ApiError context_length_exceeded when none."""
        limit = self.limits.max_episode_tokens
        held = len(ep.record.tokens) + len(prompt)
        room = limit - held - len(self.chat.end_ids) - 1  # closing the turn and the episode
        if room < 1:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens "
                f"(actor.max_episode_tokens); the episode and its new messages hold {held}",
                param="messages",
                code="context_length_exceeded",
            )
        return room

    async def _sample(self, ep, context, max_new, request, disconnected) -> list[Sample]:
        """`request.n` samples continuing `context`; the first keeps the episode's cache
        slot (session)."""
        call = asyncio.ensure_future(
            asyncio.gather(
                *(
                    self.policy.sample(
                        context,
                        session=ep.id if i == 0 else None,
                        max_new_tokens=max_new,
                        top_logprobs=request.top_logprobs or 0,
                    )
                    for i in range(request.n or 1)
                )
            )
        )
        if disconnected is None:
            return await call
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not call.done():
            # The sampler finishes the row's turn and frees it; the episode is dropped.
            call.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.registry.drop(ep.id, "disconnected")
            raise ApiError(499, "client disconnected", code="client_disconnected")
        return call.result()

    def _record(self, ep, request, tool_choice, prompt, forced, new, samples) -> dict:
        """Each sample as a choice of the turn (the episode's next turn when n = 1, else
        pending until the client continues one) and the `chat.completion` of them all."""
        ep.tools = request.tools or []  # fixed by the first turn recorded
        context = len(ep.record.tokens) + len(prompt)  # what the turns were sampled after
        decode = self.chat.tokenizer.decode
        turns, choices, sampled = [], [], 0
        for index, sample in enumerate(samples):
            tokens, logprobs, finish, stopped = self._cut_at_stop(
                sample.tokens, sample.logprobs, request.stop
            )
            rec = dataclasses.replace(
                ep.record,
                tokens=[*ep.record.tokens, *prompt],
                loss_mask=[*ep.record.loss_mask, *[0] * len(prompt)],
                logprobs=[*ep.record.logprobs, *[0.0] * len(prompt)],
                versions={*ep.record.versions, sample.version},
                turns=ep.record.turns + 1,
            )
            rec.extend(tokens, policy=True, logprobs=logprobs)
            rec.extend(self.chat.close_turn(tokens), policy=False)
            turn = forced + tokens  # the turn as written: a forced tool-call opening, the sample
            action = (
                as_text(self.chat, turn)
                if tool_choice.mode == "none"
                else self.chat.parse(turn, ep.tools).with_call_ids()  # the ids sent and kept
            )
            if stopped:  # OpenAI leaves the stop text out of the content
                at = [action.content.find(x) for x in request.stop if x in action.content]
                action = dataclasses.replace(
                    action, content=action.content[: min(at, default=None)]
                )
            turns.append((rec, action.message()))
            top = None
            if sample.top_logprobs is not None:
                top = [
                    [(decode([i]), lp) for i, lp in alternatives]
                    for alternatives in sample.top_logprobs[: len(tokens)]
                ]
            choices.append(
                choice(
                    index,
                    action,
                    finish_reason=finish,
                    tokens=[decode([t]) for t in tokens],
                    logprobs=logprobs if request.logprobs else None,
                    top=top,
                )
            )
            sampled += len(tokens)
        ep.pending = PendingTurn(new, turns)
        if len(turns) == 1:
            ep.continue_with(0)
        return completion(
            choices, model=self.limits.model, prompt_tokens=context, completion_tokens=sampled
        )

    def _cut_at_stop(self, tokens, logprobs, stops):
        """The turn up to the first token whose text completes a `stop` string, else the
        whole turn; with the OpenAI finish reason and whether a stop string ended it."""
        if stops:
            decode = self.chat.tokenizer.decode
            for k in range(1, len(tokens) + 1):
                text = decode(tokens[:k])
                if any(s in text for s in stops):
                    return tokens[:k], logprobs[:k], "stop", True
        finish = "stop" if tokens and tokens[-1] in self.chat.stop_ids else "length"
        return tokens, logprobs, finish, False

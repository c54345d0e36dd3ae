"""`EpisodeRegistry`: the endpoint's open episodes, their groups, and how each one ends.

A harness opens an episode (its GRPO group and the env seed of its task), talks to it
through its scoped `base_url`, and closes it with a reward; the registry then builds
the `Episode` with the actor's `EpisodeBuilder` (tokens, loss mask and behaviour log-probs
as recorded turn by turn, the oldest weights version used) and hands over a group once
all its members have ended (`on_group(name, episodes)`), so a GRPO group always lands
in one shard:

    reg = EpisodeRegistry(builder, end_ids=chat.end_ids, on_group=commit, timeout_s=600)
    ep = reg.open(group="task-17", group_size=4, seed=17)      # an `OpenEpisode`
    ...                                                       # requests record turns on ep
    reg.close(ep.id, reward=1.0)

Episodes that end without a close are dropped, never written, each counted under its
status in `dropped`: `abandoned` (no request or close within `timeout_s`: `sweep`),
`disconnected` (the client went away mid-request), `agent_error` (the agent program
raised), `no_turns` (closed before any sampled turn). A dropped episode's id answers 409;
its group is handed over without it.

A request with `n` > 1 samples n choices of the turn (`PendingTurn`). The client's next
request continues one of them (the one whose message it sends back); the others end there
as branches. At close every branch becomes an `Episode` of the group too, with the
episode's reward (id `<episode>.<k>`): the program picked among the choices, so each one
had a part in the outcome. A close right after an `n` > 1 request may
score its choices one by one (`rewards`), as a GRPO group of one prompt.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from tunix_tasks.actor.asynchronous.rollout import Transcript
from tunix_tasks.actor.endpoint.wire import ApiError
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.episode import Episode, EpisodeStatus
from tunix_tasks.messages import Message

__all__ = ["DROP_STATUSES", "EpisodeRegistry", "OpenEpisode", "PendingTurn"]

DROP_STATUSES = ("abandoned", "disconnected", "agent_error", "no_turns")


@dataclass(frozen=True)
class PendingTurn:
    """The choices of a request with `n` > 1, until the client continues one: the request's
    new messages, and per choice the transcript through it and its parsed message."""

    new: list[Message]
    choices: list[tuple[Transcript, Message]]


@dataclass(eq=False)
class OpenEpisode:
    """One episode between open and close: its transcript and the conversation so far."""

    id: str
    group: str
    seed: int
    record: Transcript = field(default_factory=Transcript)
    recorded: list[Message] = field(default_factory=list)  # fidelity.match_history's
    tools: list[dict] | None = None  # fixed by the first recorded turn
    busy: bool = False  # a request in flight
    last_active: float = field(default_factory=time.monotonic)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when it ends, however
    pending: PendingTurn | None = None  # an n > 1 turn not yet continued
    branches: list[Transcript] = field(default_factory=list)  # choices not continued

    def continue_with(self, index: int) -> None:
        """The conversation goes on from the pending turn's choice `index`; its other
        choices end there as branches of the episode."""
        turn = self.pending
        self.record, message = turn.choices[index]
        self.recorded += [*turn.new, message]
        self.branches += [t for i, (t, _) in enumerate(turn.choices) if i != index]
        self.pending = None


@dataclass(eq=False)
class _Group:
    number: int
    size: int
    opened: int = 0
    ended: int = 0
    episodes: list[Episode] = field(default_factory=list)


class EpisodeRegistry:
    """The endpoint's episodes (module docstring)."""

    def __init__(
        self,
        builder: EpisodeBuilder,
        *,
        end_ids: tuple[int, ...],
        on_group: Callable[[str, list[Episode]], None],
        timeout_s: float,
        max_open: int,
        default_version: Callable[[], int] = lambda: 0,
        refuse_group: Callable[[str], str | None] = lambda _name: None,
    ) -> None:
        self._builder = builder
        self._refuse_group = refuse_group  # why a new group may not start now (flow control)
        self._end_ids = list(end_ids)
        self._on_group = on_group
        self._timeout_s = timeout_s
        self._max_open = max_open
        self._default_version = default_version
        self._open: dict[str, OpenEpisode] = {}
        self._groups: dict[str, _Group] = {}
        self._numbers = 0
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.dropped: dict[str, int] = dict.fromkeys(DROP_STATUSES, 0)
        self.closed = 0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, *, group: str | None = None, group_size: int = 1, seed: int = 0) -> OpenEpisode:
        """A new episode in `group` (a new group of one when None); ApiError 429 when
        `max_open` episodes are open or `refuse_group` refuses a new group, 409 when the
        group already has `group_size` members."""
        if len(self._open) >= self._max_open:
            raise ApiError(
                429,
                f"{len(self._open)} episodes are open, the limit (actor.agent.max_open_episodes) "
                "is reached; close some first",
                type="rate_limit_error",
                code="too_many_open_episodes",
            )
        name = group if group is not None else uuid.uuid4().hex
        g = self._groups.get(name)
        if g is None:
            refused = self._refuse_group(name)
            if refused:  # a group already started gets all its members
                raise ApiError(
                    429,
                    f"new episodes are paused: {refused}; retry in a few seconds",
                    type="rate_limit_error",
                    code="flow_control_paused",
                )
            g = self._groups[name] = _Group(self._numbers, group_size)
            self._numbers += 1
        elif g.size != group_size:
            raise ApiError(
                409, f"group {name!r} has group_size {g.size}, not {group_size}", param="group_size"
            )
        if g.opened >= g.size:
            raise ApiError(
                409,
                f"group {name!r} already has its {g.size} episodes",
                param="group",
                code="group_full",
            )
        g.opened += 1
        ep = OpenEpisode(uuid.uuid4().hex, name, int(seed))
        self._open[ep.id] = ep
        return ep

    def get(self, episode_id: str) -> OpenEpisode:
        """The open episode; ApiError 404 (unknown) or 409 (already ended, and how)."""
        ep = self._open.get(episode_id)
        if ep is not None:
            return ep
        ended = self._ended.get(episode_id)
        if ended is not None:
            raise ApiError(409, f"episode {episode_id} has ended ({ended})", code="episode_ended")
        raise ApiError(404, f"no episode {episode_id!r} on this endpoint", code="episode_not_found")

    def how_ended(self, episode_id: str) -> str | None:
        """'closed' or the drop status of an ended episode (the last 100,000); None else."""
        return self._ended.get(episode_id)

    def close(
        self,
        episode_id: str,
        *,
        reward: float,
        rewards: list[float] | None = None,
        truncated: bool = False,
    ) -> list[Episode]:
        """End the episode with `reward`: its `Episode`s (one per branch, module docstring),
        or none when it had no sampled turn (dropped as `no_turns`). `rewards` scores the
        choices of a last request with `n` > 1 one by one (ApiError 400 otherwise)."""
        ep = self.get(episode_id)
        if ep.busy:
            raise ApiError(
                409, f"episode {episode_id} has a request in flight", code="episode_busy"
            )
        last = [ep.record] if ep.pending is None else [t for t, _ in ep.pending.choices]
        if rewards is not None and (ep.pending is None or len(rewards) != len(last)):
            raise ApiError(
                400,
                f"rewards: one per choice of a last request with n > 1 (this episode's last "
                f"request had {len(last)} choice{'s' * (len(last) > 1)})",
                param="rewards",
            )
        if last[0].turns == 0:
            self.drop(episode_id, "no_turns")
            return []
        status = EpisodeStatus.TRUNCATED if truncated else EpisodeStatus.OK
        ends = [*zip(last, rewards or [reward] * len(last), strict=True)]
        ends += [(b, reward) for b in ep.branches]
        episodes = [
            self._episode(ep, rec, r, status, ep.id if k == 0 else f"{ep.id}.{k}")
            for k, (rec, r) in enumerate(ends)
        ]
        self.closed += 1
        self._end(ep, "closed", episodes)
        return episodes

    def _episode(
        self, ep: OpenEpisode, rec: Transcript, reward: float, status: EpisodeStatus, eid: str
    ) -> Episode:
        return self._builder(
            [*rec.tokens, *self._end_ids],
            [*rec.loss_mask, *[0] * len(self._end_ids)],
            [*rec.logprobs, *[0.0] * len(self._end_ids)],
            group=self._groups[ep.group].number,
            seed=ep.seed,
            reward=reward,
            policy_version=min(rec.versions, default=self._default_version()),
            num_turns=rec.turns,
            status=status,
            episode_id=eid,
        )

    def drop(self, episode_id: str, status: str) -> None:
        """End the episode without writing it, counted under `status` (DROP_STATUSES)."""
        ep = self._open.get(episode_id)
        if ep is not None:
            self.dropped[status] += 1
            self._end(ep, status, [])

    def sweep(self, now: float | None = None) -> list[str]:
        """Drop the episodes idle (no request in flight) for longer than the timeout."""
        now = time.monotonic() if now is None else now
        idle = [
            ep.id
            for ep in self._open.values()
            if not ep.busy and now - ep.last_active > self._timeout_s
        ]
        for episode_id in idle:
            self.drop(episode_id, "abandoned")
        return idle

    def _end(self, ep: OpenEpisode, how: str, episodes: list[Episode]) -> None:
        del self._open[ep.id]
        ep.ended.set()
        self._ended[ep.id] = how
        while len(self._ended) > 100_000:  # bounded memory of ended ids
            self._ended.popitem(last=False)
        g = self._groups[ep.group]
        g.ended += 1
        g.episodes += episodes
        if g.ended == g.size:
            del self._groups[ep.group]
            if g.episodes:
                self._on_group(ep.group, g.episodes)

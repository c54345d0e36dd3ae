"""The interfaces between a policy's tokens and a conversation: `Tokenizer` and `ChatFormat`.

Two implementations of each: the character tokenizer with its built-in turn markers
(`policy/tokenizer.py`, the demo presets), and a Hugging Face checkpoint's `tokenizer.json`
with its jinja chat template (`policy/chat_template.py`). The rollout only sees these
protocols, so an episode is token-in / token-out whatever the model: the sampled ids go into
the episode exactly as sampled, and every environment reply is appended as the template's
own tokens for that message (never decode-and-re-tokenize):

    ids = chat.start([{"role": "user", "content": obs}], tools)   # ends with the generation prompt
    while not done:
        sampled = sampler(ids)                                    # stops at one of chat.stop_ids
        ids += sampled + chat.close_turn(sampled)                 # end-of-turn if it never stopped
        action = chat.parse(sampled, tools).with_call_ids(turn)   # Action(content, tool_calls, error)
        history += [action.message()]                             # calls named: Mistral checks
        replies = action.replies(env_observation)                 # a tool message per result
        ids += chat.reply(history, replies, tools)                # replies + generation prompt
        history += replies
    ids += chat.end_ids
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from tunix_tasks.messages import Action, Message

__all__ = ["ChatFormat", "Tokenizer"]

Tools = Sequence[dict[str, Any]]


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids, special tokens included as their text (`"<|im_end|>"` is one id)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, adding no BOS/EOS of its own (templates write those)."""
        ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str: ...


@runtime_checkable
class ChatFormat(Protocol):
    """Renders conversations as token ids and parses sampled turns (module docstring)."""

    tokenizer: Tokenizer

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a policy turn (the sampler stops after emitting one)."""
        ...

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Ids appended once when an episode ends (e.g. EOS); may be empty."""
        ...

    def start(self, messages: Sequence[Message], tools: Tools = ()) -> list[int]:
        """The first prompt: `messages` (system/user) then the generation prompt."""
        ...

    def reply(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Tools = ()
    ) -> list[int]:
        """Ids that follow a closed assistant turn (the last message of `history`):
        `new_messages` (tool results / user) then the generation prompt."""
        ...

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """[] when `sampled` ends with a stop id, else the ids that close the turn."""
        ...

    def parse(self, sampled: Sequence[int], tools: Tools = ()) -> Action:
        """The action a sampled turn expresses; malformed tool calls set `Action.error`."""
        ...

    def render_action(
        self, history: Sequence[Message], action: Action, tools: Tools = ()
    ) -> list[int]:
        """`action` as this model writes it after `history`, ending with a stop id
        (scripted demonstrations)."""
        ...

"""`TokenLayout`: a chat format's episode layout as constant token pieces, for the device loop.

The asynchronous rollout asks the `ChatFormat` for every piece of an episode as it goes
(`start`, `close_turn`, `reply`, `end_ids`). The on-device loop cannot call Python per
turn, so it takes those pieces once, as constants, and checks that the format really lays
every observation out as `prefix + encode(text) + suffix`:

    layout = TokenLayout.from_chat(chat, tools)
    layout.start_prefix, layout.start_suffix   # around the first observation
    layout.reply_prefix, layout.reply_suffix   # around every later observation
    layout.close, layout.end                   # closing a turn that did not stop; the end

and the tables between token ids and the character codes vectorized envs read and write
(`envs/vectorized/base.py`: ASCII, `TOOL`, `ANSWER`, `SPECIAL`). Only character-level
formats qualify (one token per character, the `TOOL` / `ANSWER` markers): `CharChat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunix_tasks.envs.vectorized.base import ANSWER, SPECIAL, TOOL
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.tokenizer import CharChat

__all__ = ["TokenLayout"]

_PROBES = ("0", "12+7=?", "error: x")


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    start_prefix: tuple[int, ...]
    start_suffix: tuple[int, ...]
    reply_prefix: tuple[int, ...]
    reply_suffix: tuple[int, ...]
    close: tuple[int, ...]
    end: tuple[int, ...]
    stop_ids: tuple[int, ...]
    id_to_code: np.ndarray  # [V] int32: a token's character code, or a marker code
    code_to_id: np.ndarray  # [128] int32: a character's token id ('?' when it has none)

    @classmethod
    def from_chat(cls, chat: ChatFormat, tools: Sequence[dict[str, Any]] = ()) -> TokenLayout:
        """Raises ValueError when `chat` is not a character-level format."""
        if not isinstance(chat, CharChat):
            raise ValueError(
                "actor.kind=vectorized needs a character-level chat format (the char presets: "
                "model.checkpoint unset); a checkpoint's template writes tool calls as JSON, "
                "which the on-device environments do not parse. Use actor.kind=async."
            )
        tok = chat.tokenizer

        def pieces(render) -> tuple[tuple[int, ...], tuple[int, ...]]:
            found = set()
            for probe in _PROBES:
                ids, body = render(probe), tok.encode(probe)
                at = next(
                    (i for i in range(len(ids) - len(body) + 1) if ids[i : i + len(body)] == body),
                    None,
                )
                if at is None:
                    raise ValueError(f"{type(chat).__name__} does not render {probe!r} verbatim")
                found.add((tuple(ids[:at]), tuple(ids[at + len(body) :])))
            if len(found) != 1:
                raise ValueError(f"{type(chat).__name__} lays observations out unevenly")
            return found.pop()

        start = pieces(lambda text: chat.start([{"role": "user", "content": text}], tools))
        history = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "1"}]
        replies = {
            role: pieces(lambda text, r=role: chat.reply(history, [{"role": r, "content": text}]))
            for role in ("tool", "user")
        }
        if replies["tool"] != replies["user"]:
            raise ValueError(f"{type(chat).__name__} renders tool and user replies differently")
        id_to_code = np.full(tok.vocab_size, SPECIAL, np.int32)
        for i in range(tok.vocab_size):
            if not tok.is_special(i):
                id_to_code[i] = ord(tok.decode([i]))
        id_to_code[tok.tool_id], id_to_code[tok.answer_id] = TOOL, ANSWER
        unknown = tok.encode("?")[0]
        code_to_id = np.asarray(
            [(ids[0] if len(ids := tok.encode(chr(c))) == 1 else unknown) for c in range(128)],
            np.int32,
        )
        return cls(
            *start,
            *replies["tool"],
            close=tuple(chat.close_turn([code_to_id[ord("x")]])),
            end=tuple(chat.end_ids),
            stop_ids=tuple(chat.stop_ids),
            id_to_code=id_to_code,
            code_to_id=code_to_id,
        )

    def prompt_len(self, obs_len: int) -> int:
        """The longest start prompt for observations of `obs_len` characters."""
        return len(self.start_prefix) + obs_len + len(self.start_suffix)

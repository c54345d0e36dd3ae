"""Character-level tokenizer and its chat format (`CharChat`), with built-in turn markers.

Small on purpose: the built-in tasks (arithmetic, number guessing, tiny Python programs)
are written in printable ASCII, and a ~110-token vocabulary lets a ~1M-parameter policy
learn them on CPU. Special tokens appear in text as their marker strings:

    tok = CharTokenizer()
    ids = tok.encode("<|tool|>12+7")        # [TOOL, '1', '2', '+', '7']
    tok.decode(ids) == "<|tool|>12+7"

`CharChat` is the `ChatFormat` (policy/chat.py) of this tokenizer. Layout of one episode:

    BOS USER <observation> ASSISTANT <action> END USER <observation> ASSISTANT ... EOS

An action is `TOOL <argument>` (a call of the environment's first tool with its first
parameter) or `ANSWER <text>`; unmarked text is an answer too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tunix_tasks.messages import Action, Message, ToolCall, tool_argument_names
from tunix_tasks.policy.chat import Tools

__all__ = ["ANSWER", "TOOL", "CharChat", "CharTokenizer", "Tokenizer"]

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
TOOL = "<|tool|>"
ANSWER = "<|answer|>"

SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, USER, ASSISTANT, END, TOOL, ANSWER)
_CHARS: tuple[str, ...] = ("\n", *(chr(c) for c in range(32, 127)))
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_UNKNOWN = "?"


class CharTokenizer:
    """Maps text <-> token ids. Ids 0..7 are the special tokens; PAD is 0."""

    def __init__(self) -> None:
        self._id_to_piece: tuple[str, ...] = SPECIAL_TOKENS + _CHARS
        self._piece_to_id = {p: i for i, p in enumerate(self._id_to_piece)}
        self.pad_id = self._piece_to_id[PAD]
        self.bos_id = self._piece_to_id[BOS]
        self.eos_id = self._piece_to_id[EOS]
        self.user_id = self._piece_to_id[USER]
        self.assistant_id = self._piece_to_id[ASSISTANT]
        self.end_id = self._piece_to_id[END]
        self.tool_id = self._piece_to_id[TOOL]
        self.answer_id = self._piece_to_id[ANSWER]

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_piece)

    def token_id(self, piece: str) -> int:
        """Id of one special token or character."""
        return self._piece_to_id[piece]

    def encode(self, text: str) -> list[int]:
        """Encode text; characters outside the vocabulary become '?'."""
        ids: list[int] = []
        unknown = self._piece_to_id[_UNKNOWN]
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            special = self._piece_to_id.get(part) if part in SPECIAL_TOKENS else None
            if special is not None:
                ids.append(special)
            else:
                ids.extend(self._piece_to_id.get(ch, unknown) for ch in part)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Decode ids; raises ValueError on an id outside the vocabulary."""
        out: list[str] = []
        n = len(self._id_to_piece)
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"token id {i} outside vocabulary [0, {n})")
            piece = self._id_to_piece[i]
            if skip_special and piece in SPECIAL_TOKENS:
                continue
            out.append(piece)
        return "".join(out)

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < len(SPECIAL_TOKENS)


Tokenizer = CharTokenizer  # the old name, until its users move to `CharTokenizer`


class CharChat:
    """The `ChatFormat` of the character tokenizer (layout in the module docstring).

    Every message, whatever its role, is `USER <content>`; tool schemas are not rendered
    (the environments' observations say how to act).
    """

    def __init__(self, tokenizer: CharTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or CharTokenizer()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.end_id, self.tokenizer.eos_id)

    @property
    def end_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_id,)

    def _turns(self, messages: Sequence[Message]) -> list[int]:
        """`USER <content>` per message, then the generation prompt."""
        tok = self.tokenizer
        ids: list[int] = []
        for msg in messages:
            ids += [tok.user_id, *tok.encode(str(msg.get("content") or ""))]
        return [*ids, tok.assistant_id]

    def start(self, messages: Sequence[Message], tools: Tools = ()) -> list[int]:
        return [self.tokenizer.bos_id, *self._turns(messages)]

    def reply(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Tools = ()
    ) -> list[int]:
        return self._turns(new_messages)

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        return [] if sampled and sampled[-1] in self.stop_ids else [self.tokenizer.end_id]

    def parse(self, sampled: Sequence[int], tools: Tools = ()) -> Action:
        text = self.tokenizer.decode(t for t in sampled if t not in self.stop_ids).strip()
        if text.startswith(TOOL):
            return _tool_action(text[len(TOOL) :].strip(), tools)
        if text.startswith(ANSWER):
            return Action(content=text[len(ANSWER) :].strip())
        return Action(content=text)

    def render_action(
        self, history: Sequence[Message], action: Action, tools: Tools = ()
    ) -> list[int]:
        if action.tool_calls:
            args = list(action.tool_calls[0].arguments.values())
            text = TOOL + (str(args[0]) if args else "")
        else:
            text = ANSWER + action.content
        return [*self.tokenizer.encode(text), self.tokenizer.end_id]


def _tool_action(argument: str, tools: Tools) -> Action:
    """`TOOL <argument>`: a call of the first tool with `argument` as its first parameter."""
    if not tools:
        return Action(error="no tool available")
    name = tools[0]["function"]["name"]
    params = tool_argument_names(tools[0])
    if not params:
        return Action(error=f"tool {name!r} takes no argument")
    return Action(tool_calls=(ToolCall(name=name, arguments={params[0]: argument}),))

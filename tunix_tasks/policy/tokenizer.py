"""Character-level tokenizer with the special tokens the agentic environments speak.

Small on purpose: the built-in tasks (arithmetic, number guessing, tiny Python programs)
are written in printable ASCII, and a ~110-token vocabulary lets a ~1M-parameter policy
learn them on CPU. Special tokens appear in text as their marker strings, so
environments read and write plain text:

    tok = Tokenizer()
    ids = tok.encode("<|tool|>12+7")        # [TOOL, '1', '2', '+', '7']
    tok.decode(ids) == "<|tool|>12+7"

Layout of one episode (the actor builds it, the learner trains on it):

    BOS USER <observation> ASSISTANT <action> END USER <observation> ASSISTANT ... EOS
"""

from __future__ import annotations

import re
from collections.abc import Iterable

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


class Tokenizer:
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

"""A Hugging Face checkpoint's tokenizer (`tokenizer.json` + `tokenizer_config.json`).

Wraps the `tokenizers` library so it satisfies the `Tokenizer` protocol (policy/chat.py)
and tokenizes exactly as transformers does for a rendered chat template
(`apply_chat_template(tokenize=True)` encodes the rendered string with
`add_special_tokens=False`): special tokens written in the text become their single ids.

    tok = HFTokenizer(Path("tokenizer.json").read_text(), json.loads(config_text))
    tok.encode("<|im_start|>user\\nhi<|im_end|>")   # <|im_start|> and <|im_end|> one id each
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers

__all__ = ["SPECIAL_TOKEN_KEYS", "HFTokenizer", "special_tokens"]

# The tokenizer_config.json keys transformers passes to a chat template (its special_tokens_map).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json: special token {value!r} is not a string")
    return value


def special_tokens(config: Mapping[str, Any]) -> dict[str, str | list[str]]:
    """The special tokens a tokenizer_config names, as strings; unset ones are left out.
    transformers 5's `extra_special_tokens` counts too: a list is its name for
    `additional_special_tokens`, an object names tokens (each then a template variable)."""
    out: dict[str, str | list[str]] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if key == "additional_special_tokens":
            out[key] = [_token_text(v) for v in value]
        else:
            out[key] = _token_text(value)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):  # named ones ({"image_token": ...}): a variable each
        for name, value in extra.items():
            out.setdefault(name, _token_text(value))
    elif isinstance(extra, list):  # transformers 5's name for additional_special_tokens
        out.setdefault("additional_special_tokens", [_token_text(v) for v in extra])
    elif extra is not None:
        raise ValueError(
            "tokenizer_config.json: extra_special_tokens is neither a list nor an object"
        )
    return out


class HFTokenizer:
    """`tokenizer.json` text <-> ids; `pad_id` from the config's pad token, else its eos."""

    def __init__(self, tokenizer_json: str | bytes, config: Mapping[str, Any]) -> None:
        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode("utf-8")
        try:
            self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"tokenizer.json: cannot be loaded: {e}") from e
        self.special_tokens = special_tokens(config)
        pad = self.special_tokens.get("pad_token") or self.special_tokens.get("eos_token")
        if not isinstance(pad, str):
            raise ValueError("tokenizer_config.json: names neither pad_token nor eos_token")
        self._pad_id = self.token_id(pad)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int:
        """Id of one token given as its text (e.g. `"<|im_end|>"`)."""
        token = self._tok.token_to_id(text)
        if token is None:
            raise KeyError(f"token {text!r} is not in tokenizer.json's vocabulary")
        return token

    def token_text(self, token: int) -> str:
        """The vocabulary entry of one id: for special tokens, their text in templates."""
        text = self._tok.id_to_token(token)
        if text is None:
            raise KeyError(f"token id {token} is not in tokenizer.json's vocabulary")
        return text

    def special_added_tokens(self) -> dict[str, int]:
        """The added tokens marked special, {text: id}."""
        added = self._tok.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special}

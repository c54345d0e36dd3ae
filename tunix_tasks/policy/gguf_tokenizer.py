"""A GGUF file's tokenizer as Hugging Face files: `tokenizer.json` and `tokenizer_config.json`.

This module owns rebuilding the original byte-level BPE tokenizer from `tokenizer.ggml.*`
(vocabulary, merges, token types -> special and added tokens, bos / eos / pad) with the
`tokenizers` library, the pre-tokenizer of the family named by `tokenizer.ggml.pre`
(`PRE_TOKENIZERS`), and the chat template from `tokenizer.chat_template`:

    tokenizer_json, tokenizer_config = gguf_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")

Other tokenizer models and pre-tokenizers are refused with one line (`GGUFImportError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from tunix_tasks.policy.gguf_file import GgufFile, GGUFImportError, open_gguf

__all__ = ["PRE_TOKENIZERS", "gguf_tokenizer", "tokenizer_files"]


# The regexes of the real tokenizer.json files (Llama 3 splits digits in 1-3s, Qwen singly).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How the original HF tokenizer.json of a `tokenizer.ggml.pre` family splits text."""

    pre_tokenizer: Callable[[], Any]
    normalizer: Callable[[], Any] | None = None
    ignore_merges: bool = False  # Llama 3's BPE takes whole words found in the vocab


def _split_then_bytes(pattern: str) -> Any:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


#: `tokenizer.ggml.pre` -> the pre-tokenizer of the family's original tokenizer.json.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    # SmolLM / SmolLM2 (StarCoder-style): every digit alone, then GPT-2's byte-level regex.
    "smollm": _PreTokenizer(
        lambda: pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    ),
    "llama-bpe": _PreTokenizer(lambda: _split_then_bytes(_LLAMA3_SPLIT), ignore_merges=True),
    "qwen2": _PreTokenizer(lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC),
}

# llama.cpp's token types (gguf.TokenType): control tokens are HF's special added tokens,
# user-defined ones its non-special added tokens (<tool_call>, ...).
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_files(g: GgufFile) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict) of an open GGUF file."""
    model = g.need("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(
            f"{g.path}: tokenizer model {model!r} is not supported (supported: gpt2, i.e. "
            "byte-level BPE)"
        )
    pre_name = g.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GGUFImportError(
            f"{g.path}: pre-tokenizer {pre_name!r} is not supported (supported: "
            f"{', '.join(PRE_TOKENIZERS)})"
        )
    tokens: list[str] = g.need("tokenizer.ggml.tokens")
    types: list[int] = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in g.need("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, merges, ignore_merges=pre.ignore_merges)
    tok = tokenizers.Tokenizer(bpe)
    if pre.normalizer is not None:
        tok.normalizer = pre.normalizer()
    tok.pre_tokenizer = pre.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    # Ids are the vocabulary's: an added token already in the vocab keeps its id.
    tok.add_tokens(
        [
            AddedToken(t, special=ty == _CONTROL, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    bos = token("bos")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    post = [processors.ByteLevel(trim_offsets=False)]
    if add_bos:
        post.append(
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        )
    tok.post_processor = processors.Sequence(post)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(g.get(f"{g.arch}.context_length") or 2048),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (text := token(key)) is not None:
            config[f"{name}_token"] = text
    template = g.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok.to_str(), config


def gguf_tokenizer(src: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict) of a GGUF file's tokenizer."""
    return tokenizer_files(open_gguf(src))

"""The token-in / token-out completions contract between a remote engine and its server.

The subset of `POST /v1/completions` that vLLM and SGLang serve and `tunix-tasks serve`
implements (server.py): the prompt as token ids, one choice, the sampled token ids and
each one's log-prob. Ids travel as ids both ways, so nothing is decoded and re-tokenized:

    body = completion_request(model="m", prompt=[1, 2, 3], max_tokens=16, temperature=1.0,
                              top_k=0, seed=7, stop_ids=(2,), session="ep-1")
    turn = parse_completion(response_json, vocab_size=32768)   # Turn(tokens, logprobs, ...)

A choice gives its ids as `token_ids` (vLLM's `return_token_ids`) or, failing that, as
`logprobs.tokens` entries `"token_id:<id>"` (vLLM's and SGLang's
`return_tokens_as_token_ids`); log-probs are `logprobs.token_logprobs`. A reply that
breaks the contract raises `RemoteError` naming what is wrong.

New weights reach the server as a Hugging Face checkpoint folder it loads by path
(SGLang's `POST /update_weights_from_disk`):

    weights_request("/shared/w/v3", version=3)  # {"model_path": ..., "weight_version": "3"}
    # the folder holds WEIGHTS_FILE (HF names and layouts) and the base's config.json
    # reply: {"success": true, "message": "..."}; success false or a 4xx: refused

A LoRA run's new adapters reach it as a PEFT folder it loads under a name (vLLM's
`POST /v1/load_lora_adapter`), which the turns then give as their `model`:

    adapter_request("run-1a2b3c4d-v3", "/shared/w/v3")  # {"lora_name", "lora_path"}
    # the folder holds ADAPTER_FILE and ADAPTER_CONFIG (policy/hf_adapters.py)
    # reply: 200 (vLLM: text; SGLang: {"success": true}); a 400 "already ... loaded": the
    # name is loaded; another 4xx or success false: refused
    # POST /v1/unload_lora_adapter {"lora_name"}; a turn naming an adapter the server does
    # not hold (it restarted) is a 404
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "WEIGHTS_FILE",
    "RemoteError",
    "Turn",
    "adapter_request",
    "completion_request",
    "parse_completion",
    "served_version",
    "token_label",
    "weights_request",
]

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

_PREFIX = "token_id:"
# A sampled token's log-prob is <= 0; servers' float32 rounding may put it a hair above.
_LOGPROB_SLACK = 1e-3


class RemoteError(RuntimeError):
    """The server refused (`status`: its HTTP status), broke the contract, or stayed
    unreachable past the deadline."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Turn:
    """One sampled turn: ids, their behaviour log-probs, and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def token_label(token: int) -> str:
    """A token as `logprobs.tokens` names it when `return_tokens_as_token_ids` is on."""
    return f"{_PREFIX}{token}"


def completion_request(
    *,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    stop_ids: Sequence[int],
    session: str | None,
    adapter: str | None = None,
) -> dict[str, Any]:
    """The request body of one turn. `session` travels as OpenAI's `user` field (ignored
    by vLLM, whose prefix cache finds the shared context by itself; `tunix-tasks serve`
    keeps that conversation's KV cache by it). `adapter`: a LoRA adapter's name, given as
    the `model` (vLLM's way) and as `lora_path` (SGLang's; vLLM ignores the field)."""
    body: dict[str, Any] = {
        "model": adapter or model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "top_k": int(top_k) if top_k > 0 else -1,
        "seed": int(seed),
        "n": 1,
        "logprobs": 0,  # the sampled token's own log-prob, no alternatives
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stop_token_ids": [int(t) for t in stop_ids],
        "skip_special_tokens": False,
    }
    if session is not None:
        body["user"] = session
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def parse_completion(body: Any, *, vocab_size: int) -> Turn:
    """The turn a completions reply holds (module docstring); `RemoteError` when the
    reply breaks the contract."""
    try:
        choice = body["choices"][0]
        lp = choice["logprobs"]
        logprobs = lp["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise RemoteError(
            "the reply has no choices[0].logprobs.token_logprobs (does the server return "
            f"log-probs?): {str(body)[:200]}"
        ) from None
    tokens = choice.get("token_ids")
    if tokens is None:
        tokens = [_parse_label(t) for t in lp.get("tokens") or []]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise RemoteError(f"choices[0].token_ids is not a list of ints: {str(tokens)[:200]}")
    if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
        raise RemoteError(
            f"the reply has {len(tokens)} token ids and "
            f"{len(logprobs) if isinstance(logprobs, list) else 'no list of'} log-probs"
        )
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RemoteError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    values = []
    for x in logprobs:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise RemoteError(f"a log-prob is not a finite number: {x!r}")
        if x > _LOGPROB_SLACK:
            raise RemoteError(f"a sampled token's log-prob is {x} > 0")
        values.append(min(float(x), 0.0))
    finish = choice.get("finish_reason")
    return Turn(tokens, values, finish if isinstance(finish, str) else "length")


def served_version(body: Any) -> int | None:
    """The weights version a reply says drew it, None when the server does not say:
    `weight_version` (`tunix-tasks serve`; -1 before any push) or SGLang's
    `metadata.weight_version` (the `weight_version` of its last `update_weights_from_disk`;
    "default" before one, since it started: -1, the base). Any other that is not a number
    says nothing this engine can compare: None, as a server that does not say."""
    if not isinstance(body, dict):
        return None
    value = body.get("weight_version")
    if value is None and isinstance(body.get("metadata"), dict):
        value = body["metadata"].get("weight_version")
    if value == "default":
        return -1
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _parse_label(label: Any) -> int:
    if not isinstance(label, str) or not label.startswith(_PREFIX):
        raise RemoteError(
            f"logprobs.tokens entry {str(label)[:40]!r} is not 'token_id:<id>' (ask the server "
            "for return_tokens_as_token_ids, or for token_ids)"
        )
    try:
        return int(label[len(_PREFIX) :])
    except ValueError:
        raise RemoteError(f"logprobs.tokens entry {label[:40]!r} has no integer id") from None


def weights_request(model_path: str, *, version: int) -> dict[str, Any]:
    """The body that asks the server to load the checkpoint folder `model_path` as
    weights `version`."""
    return {"model_path": model_path, "weight_version": str(version)}


def adapter_request(name: str, path: str) -> dict[str, Any]:
    """The body that asks the server to load the PEFT folder `path` as adapter `name`."""
    return {"lora_name": name, "lora_path": path}

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

    weights_request("/shared/w/v3", version=3, run="run-1a2b3c4d", created_at=1.7e9)
    # {"model_path", "weight_version": "3", "weight_run", "created_at"}: the folder holds
    # WEIGHTS_FILE (HF names and layouts) and the base's config.json
    # reply: {"success": true, "message": "..."}; success false or a 4xx: refused

`weight_run` (the run's folder name) and `created_at` (its manifest's publish time) say
whose snapshot it is. vLLM and SGLang ignore both; `tunix-tasks serve` loads by them
(`supersedes`: the run that pushes last has the server) and says whose weights drew a
reply (`weight_run` beside `weight_version`): an actor of another run then stops
(`served_run`).

A LoRA run's new adapters reach it as a PEFT folder it loads under a name (vLLM's
`POST /v1/load_lora_adapter`), which the turns then give as their `model`:

    adapter_request("run-1a2b3c4d-9f86d081-v3", "/shared/w/v3", run="run-1a2b3c4d",
                    created_at=1.7e9)
    # {"lora_name", "lora_path", "weight_run", "created_at"}
    # the folder holds ADAPTER_FILE and ADAPTER_CONFIG (policy/hf_adapters.py)
    # reply: 200 (vLLM: text; SGLang: {"success": true}); a 400 "already ... loaded": the
    # name is loaded; another 4xx or success false: refused
    # POST /v1/unload_lora_adapter {"lora_name"}; a turn naming an adapter the server does
    # not hold (it restarted) is a 404
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from tunix_tasks.storage.snapshot_format import short_repr

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "WEIGHTS_FILE",
    "RemoteError",
    "Turn",
    "adapter_request",
    "completion_request",
    "parse_completion",
    "publish_time_problem",
    "served_run",
    "served_version",
    "supersedes",
    "token_label",
    "weights_request",
]

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

_PREFIX = "token_id:"
# A sampled token's log-prob is <= 0; servers' float32 rounding may put it a hair above.
_LOGPROB_SLACK = 1e-3
_FUTURE_S = 86400.0  # a snapshot "published" further ahead of the reader's clock is refused


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


def served_run(body: Any) -> str | None:
    """The run whose weights a reply says drew it or are held (`weight_run`, its folder
    name as the push named it), None when the server does not say (vLLM, SGLang, or
    `tunix-tasks serve` before a push naming a run)."""
    run = body.get("weight_run") if isinstance(body, dict) else None
    return run if isinstance(run, str) else None


def publish_time_problem(value: Any) -> str | None:
    """What makes `value` no publish time (a manifest's `created_at`), or None: a JSON
    number from 0 to a day ahead of this clock. One further ahead (or Infinity, which
    Python's JSON reads) would be later than every snapshot a re-created run publishes."""
    if type(value) not in (int, float) or not 0 <= value <= time.time() + _FUTURE_S:
        return f"created_at is not a time before tomorrow: {short_repr(value)}"
    return None


def supersedes(
    run: str | None, created_at: float, version: int, *, held: tuple[str | None, float, int]
) -> bool:
    """Whether a server holding the snapshot `held` (its run, publish time and version)
    loads a push of (`run`, `created_at`, `version`), so that a fleet's pushes, which
    arrive in any order, never move it back:
    - a push that names no run (vLLM's and SGLang's callers): a higher version;
    - another run's: always (the run that pushes last has the server: the next run on a
      server kept running, or a run resumed after another used it);
    - the held run's: a higher version (a run publishes its versions in order, whatever
      its learners' clocks say), or one published later: the run re-created under the
      same URI, counting from 0 again (a lagging fleet mate's is published earlier)."""
    held_run, held_at, held_version = held
    if run is None:
        return version > held_version
    return run != held_run or version > held_version or created_at > held_at


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


def weights_request(
    model_path: str, *, version: int, run: str, created_at: float
) -> dict[str, Any]:
    """The body that asks the server to load the checkpoint folder `model_path` as
    weights `version` of `run`, published at `created_at`."""
    return {
        "model_path": model_path,
        "weight_version": str(version),
        "weight_run": run,
        "created_at": created_at,
    }


def adapter_request(name: str, path: str, *, run: str, created_at: float) -> dict[str, Any]:
    """The body that asks the server to load the PEFT folder `path` as adapter `name` of
    `run`, published at `created_at`."""
    return {"lora_name": name, "lora_path": path, "weight_run": run, "created_at": created_at}

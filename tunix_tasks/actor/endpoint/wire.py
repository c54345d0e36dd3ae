"""The OpenAI wire format: the chat-completion request, the response, the error body.

`ChatRequest` validates a request's known fields (a wrong type is a 400 naming the field;
unknown fields are ignored, as OpenAI-compatible servers do); `choice` and `completion`
build the `chat.completion` object of a request's sampled turns; `ApiError` is every refusal, answered as
OpenAI answers them:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages",
               "code": "context_length_exceeded"}}
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tunix_tasks.messages import Action
from tunix_tasks.untrusted import json_loads

__all__ = [
    "ApiError",
    "ChatRequest",
    "body_object",
    "choice",
    "completion",
    "completion_chunks",
    "parse_request",
    "validated",
]

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A refusal: HTTP `status` and the OpenAI error object's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


class ChatRequest(BaseModel):
    """The fields of `POST /v1/chat/completions` this endpoint reads (docs/agents.md)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=16)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def body_object(raw: bytes) -> dict[str, Any]:
    """A request body as its JSON object; ApiError 400 for malformed JSON (nesting too
    deep for the parser included) or another JSON value."""
    try:
        data = json_loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def parse_request(raw: bytes) -> ChatRequest:
    """The request from its body; ApiError 400 for malformed JSON or a field of the
    wrong type (naming the field)."""
    return validated(ChatRequest, body_object(raw))


def validated(model: type[M], data: dict[str, Any]) -> M:
    """`data` as the request `model`; ApiError 400 naming the first wrong field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{param}: {first['msg']}", param=param) from None


FinishReason = Literal["stop", "length", "tool_calls"]


def choice(
    index: int,
    action: Action,
    *,
    finish_reason: FinishReason,
    tokens: list[str],
    logprobs: list[float] | None,
    top: list[list[tuple[str, float]]] | None = None,
) -> dict[str, Any]:
    """One choice of a `chat.completion`: a sampled turn (`tokens`: each sampled id's text,
    for the optional `logprobs`; `top`: each token's most likely (text, log-prob))."""
    message: dict[str, Any] = {"role": "assistant", "content": action.content or None}
    if action.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,  # the episode's record holds the same (service.py)
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": json.dumps(dict(call.arguments), ensure_ascii=False),
                },
            }
            for call in action.tool_calls
        ]
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    out: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None,
    }
    if logprobs is not None:
        top = top or [[] for _ in tokens]
        out["logprobs"] = {
            "content": [
                _token(text, lp) | {"top_logprobs": [_token(t, x) for t, x in alternatives]}
                for text, lp, alternatives in zip(tokens, logprobs, top, strict=True)
            ]
        }
    return out


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion(
    choices: list[dict[str, Any]], *, model: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The `chat.completion` object of a request's sampled `choices` (`choice`)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def completion_chunks(body: dict[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """A `chat.completion` as the `chat.completion.chunk` objects of a streamed reply: each
    choice's whole turn in one delta (the turns are sampled before anything is sent), then
    each choice's finish reason, then the usage when the request asked for it
    (`stream_options.include_usage`, whose chunks otherwise carry `usage: null`)."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    usage = {"usage": None} if include_usage else {}
    deltas, finishes = [], []
    for c in body["choices"]:
        message = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **t} for i, t in enumerate(message["tool_calls"])]
        part = {"index": c["index"], "logprobs": c["logprobs"], "finish_reason": None}
        deltas.append(head | usage | {"choices": [part | {"delta": delta}]})
        end = {"index": c["index"], "delta": {}, "logprobs": None}
        finishes.append(head | usage | {"choices": [end | {"finish_reason": c["finish_reason"]}]})
    chunks = deltas + finishes
    if include_usage:
        chunks.append(head | {"choices": [], "usage": body["usage"]})
    return chunks

"""Token fidelity: does a client's conversation extend what its episode holds? (pure)

An episode records, turn by turn, the messages it has rendered or sampled (`recorded`):
the first request's messages, then each sampled assistant turn (as its parsed message) and
the messages the client sent after it. When the client sends the conversation again, the
recorded prefix must come back unchanged; only what follows it is new and is rendered by
the chat template, while the earlier assistant turns keep the ids that were sampled for
them (they are never re-encoded):

    new = match_history(recorded, client_messages)      # the messages to render now
    # raises HistoryMismatch(index, reason): edited, truncated or reordered history

Messages are compared in one normal form (`normalize`): role, text content (a list of text
parts is joined, None is ""), and for assistant turns the tool calls' names and decoded
arguments. Call ids (`tool_calls[].id`, a tool message's `tool_call_id`) are kept for the
template (Mistral's renders and checks them) but play no part in the comparison, nor do the
client's own extra fields. The new messages must not end with an assistant turn (there is nothing to answer), nor
hold one after the first request: a turn the model did not sample has no behaviour
log-probs, so it cannot be trained as if it had.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tunix_tasks.messages import Message

__all__ = ["HistoryMismatch", "match_history", "normalize"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class HistoryMismatch(ValueError):
    """The client's messages do not extend the episode's: `index` is the first message
    that differs (or is missing), `reason` says how."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"message {index}: {reason}")
        self.index = index
        self.reason = reason


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(
        f"content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"tool call arguments are not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return value


def normalize(message: Mapping[str, Any]) -> Message:
    """`message` in the form the chat template renders and the comparison uses
    (module docstring); ValueError naming what is wrong with it."""
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    out: Message = {"role": "system" if role == "developer" else role}
    out["content"] = _text(message.get("content"))
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls") or []
    if calls and role == "assistant":
        out["tool_calls"] = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError("a tool call needs function.name")
            named = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
            function = {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}
            out["tool_calls"].append({**named, "type": "function", "function": function})
    return out


def _without_ids(message: Message) -> Message:
    """`message` (normalized) as compared: its call ids left out."""
    out = {k: v for k, v in message.items() if k != "tool_call_id"}
    if "tool_calls" in out:
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out["tool_calls"]]
    return out


def match_history(
    recorded: Sequence[Message], client: Sequence[Mapping[str, Any]]
) -> list[Message]:
    """The client's messages after the recorded ones, normalized; HistoryMismatch when
    the client's conversation does not start with exactly the recorded messages, adds
    nothing, or adds an assistant turn (module docstring). ValueError: a malformed message."""
    messages = [normalize(m) for m in client]
    compared = [_without_ids(m) for m in messages]
    for i, held in enumerate(map(_without_ids, recorded)):
        if i >= len(messages):
            raise HistoryMismatch(
                i,
                f"truncated: the episode holds {len(recorded)} messages, the request sends {len(messages)}",
            )
        if compared[i] != held:
            what = "reordered or edited" if held in compared else "edited"
            raise HistoryMismatch(
                i,
                f"{what}: a {messages[i]['role']} message where the episode holds its {held['role']} message",
            )
    new = messages[len(recorded) :]
    if not new:
        raise HistoryMismatch(len(messages), "nothing new after the episode's last turn")
    if new[-1]["role"] == "assistant":
        raise HistoryMismatch(
            len(messages) - 1, "the last message is an assistant turn: nothing to answer"
        )
    if recorded:  # the first request's assistant messages are prompt (loss-masked) context
        for i, m in enumerate(new, start=len(recorded)):
            if m["role"] == "assistant":
                raise HistoryMismatch(
                    i, "an assistant turn the model did not sample (it has no behaviour log-probs)"
                )
    return new

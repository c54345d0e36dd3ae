"""The conversation vocabulary environments and policies share, independent of any tokenizer.

An environment offers `tools` (OpenAI-style function schemas), receives the policy's turn
as an `Action` (its text `content` and parsed `tool_calls`) and answers in text; the
policy's chat format turns messages into tokens and sampled tokens back into an `Action`:

    tools = env.tools                                   # [{"type": "function", "function": {...}}]
    action = chat.parse(sampled_ids)                    # Action(content, tool_calls, error)
    action.message()                                    # {"role": "assistant", ...} for the template
    replies = action.replies(result.observation)        # [{"role": "tool"|"user", "content": ...}]

`Action.error` is set when the policy's text could not be parsed (a malformed tool call);
the rollout then answers with the error instead of calling the environment.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Action",
    "Message",
    "ToolCall",
    "call_id",
    "function_tool",
    "is_call_id",
    "tool_argument_names",
]

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call of a tool the environment offers; `arguments` is the decoded JSON object."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    id: str = ""  # links the call to its result; Mistral's template wants 9 alphanumerics

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat-message form of the call."""
        call = {
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }
        return {"id": self.id, **call} if self.id else call

    def __str__(self) -> str:
        return f"{self.name}({json.dumps(dict(self.arguments), ensure_ascii=False)})"


@dataclasses.dataclass(frozen=True)
class Action:
    """One policy turn: free text (the answer when there is no tool call) and tool calls."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None  # why the text could not be parsed; None when it could

    @property
    def reply_role(self) -> str:
        """Role of the message that answers this action: tool results or the user."""
        return "tool" if self.tool_calls else "user"

    def message(self) -> Message:
        """The assistant message a chat template renders for this action."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.as_openai() for c in self.tool_calls]
        return msg

    def with_call_ids(self, turn: int | None = None) -> Action:
        """This action with every call named that has no id of 9 alphanumerics (one the
        model wrote itself is kept: its tokens hold it): `call_id(turn, k)` in turn `turn`
        (the rollout's: unique within an episode), or with no turn a random one (the
        endpoint's: unique across the many episodes one agent program runs)."""
        calls = tuple(
            c if is_call_id(c.id) else dataclasses.replace(c, id=call_id(turn, k))
            for k, c in enumerate(self.tool_calls)
        )
        return dataclasses.replace(self, tool_calls=calls)

    def replies(self, observation: str | Sequence[str]) -> list[Message]:
        """The messages that answer this action: the user's next words (a string); or its
        tool results, one message per call (a sequence of strings, in the calls' order,
        each naming its call) or one message answering them all (a string, naming the
        first call). Raises ValueError for results that do not match the calls."""
        if isinstance(observation, str):
            msg: Message = {"role": self.reply_role, "content": observation}
            if self.tool_calls and self.tool_calls[0].id:
                msg["tool_call_id"] = self.tool_calls[0].id
            return [msg]
        results = list(observation)
        if not self.tool_calls:
            raise ValueError(
                f"{len(results)} tool results answer a turn without tool calls: answer it "
                "with one string (the user's next words)"
            )
        if len(results) != len(self.tool_calls):
            raise ValueError(
                f"{len(results)} tool results answer a turn of {len(self.tool_calls)} tool "
                "calls: give one result per call, in the calls' order, or one string"
            )
        return [
            {"role": "tool", "content": r, **({"tool_call_id": c.id} if c.id else {})}
            for c, r in zip(self.tool_calls, results, strict=True)
        ]


def call_id(turn: int | None, k: int) -> str:
    """The id of an episode's `k`-th tool call in turn `turn` (None: a random id): 9
    alphanumerics, as the strictest template (Mistral's) wants."""
    if turn is None:
        return uuid.uuid4().hex[:9]
    return f"t{turn % 10_000:04d}c{k % 1_000:03d}"


def is_call_id(value: object) -> bool:
    """Is `value` a tool-call id every template accepts (9 ASCII alphanumerics)?"""
    return isinstance(value, str) and len(value) == 9 and value.isascii() and value.isalnum()


def function_tool(
    name: str, description: str, parameters: Mapping[str, str], *, required: Sequence[str] = ()
) -> dict[str, Any]:
    """An OpenAI-style tool schema with string parameters ({name: description})."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": "string", "description": d} for p, d in parameters.items()
                },
                "required": list(required or parameters),
            },
        },
    }


def tool_argument_names(tool: Mapping[str, Any]) -> list[str]:
    """Parameter names of an OpenAI-style tool schema, in declaration order."""
    return list(tool.get("function", {}).get("parameters", {}).get("properties", {}))

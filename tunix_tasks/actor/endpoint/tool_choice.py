"""`tool_choice`, enforced without touching the sampled distribution.

OpenAI's four forms, and what this endpoint does with each:

    "auto" (or absent)   the model decides; its turn is parsed for tool calls
    "none"               the turn is returned as text: any tool-call markup stays in the
                         content, no `tool_calls` (the tools are still in the prompt, as the
                         episode's first request rendered them)
    "required"           the turn starts with the chat template's own opening of a tool call,
                         up to the function's name; the model writes the name and arguments
    {"type": "function", "function": {"name": N}}
                         the opening includes the name N; the model writes the arguments

The forced opening is the template's text for a tool call (`chat.render_action` of a call
with sentinel name and arguments, cut before the sentinel), so it works for every format
the chat template renders (Hermes `<tool_call>`, Llama 3.1 JSON, Mistral's forms). Its ids
join the episode as prompt tokens (not trained, like a template's text); only the
continuation is the policy's sample, so the behaviour log-probs and the learner's
recomputation still agree. The model may still write a malformed call after the opening:
that turn comes back as content with `finish_reason: "stop"`, as any unparseable turn does.

    choice = read_tool_choice(request.tool_choice, tools)       # ApiError 400 if invalid
    forced = forced_opening(chat, history, tools, choice)       # ids, [] unless forced
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tunix_tasks.actor.endpoint.wire import ApiError
from tunix_tasks.messages import Action, Message, ToolCall, call_id
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.template_sandbox import ChatTemplateError
from tunix_tasks.policy.toolcalls import strip_think

__all__ = ["ToolChoice", "as_text", "forced_opening", "read_tool_choice"]

_NAME = "tunix_forced_tool_name"
_ARGS = "tunix_forced_tool_args"


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None  # mode "function": the function the turn must call


def _tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]


def read_tool_choice(
    raw: str | dict[str, Any] | None, tools: Sequence[dict[str, Any]]
) -> ToolChoice:
    """The request's `tool_choice`, checked against its `tools`; ApiError 400 naming what
    is wrong."""
    if raw is None or raw == "auto":
        return ToolChoice("auto")
    if raw == "none":
        return ToolChoice("none")
    names = _tool_names(tools)
    if raw == "required":
        if not names:
            raise ApiError(400, "tool_choice: 'required' needs `tools`", param="tool_choice")
        return ToolChoice("required")
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            "tool_choice: expected 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise ApiError(
            400,
            f"tool_choice: function {name!r} is not in `tools` ({', '.join(map(str, names))})",
            param="tool_choice",
        )
    return ToolChoice("function", name)


def _opening(text: str, sentinel: str) -> str | None:
    """`text` up to the sentinel; for the arguments' sentinel, up to the JSON object that
    holds it (its `{`), so the model writes the whole object."""
    at = text.find(sentinel)
    if at < 0:
        return None
    head = text[:at]
    if sentinel == _ARGS:
        brace = head.rstrip().removesuffix('"').rstrip()
        if brace.endswith("{"):
            head = brace[:-1]
    return head


def forced_opening(
    chat: ChatFormat,
    history: Sequence[Message],
    tools: Sequence[dict[str, Any]],
    choice: ToolChoice,
) -> list[int]:
    """Ids that open the turn after `history` as a tool call (module docstring); [] for
    "auto" and "none". ApiError 400 when the chat format renders no tool call to open."""
    if choice.mode in ("auto", "none"):
        return []
    name, sentinel = (_NAME, _NAME) if choice.mode == "required" else (choice.name, _ARGS)
    # A random id, as the endpoint names calls: Mistral's v11 form writes it before the
    # arguments, so it is in the opening, and the call keeps it.
    call = ToolCall(name=name, arguments={_ARGS: _ARGS}, id=call_id(None, 0))
    try:
        action = chat.render_action(history, Action(tool_calls=(call,)), tools)
    except ChatTemplateError as err:  # Mistral's drops a system message once a turn follows
        raise ApiError(400, f"tool_choice: {err}; use 'auto'", param="tool_choice") from None
    rendered = chat.tokenizer.decode(action)
    head = _opening(rendered, sentinel)
    if not head:
        raise ApiError(
            400,
            f"tool_choice: this model's chat format writes no tool call this endpoint can "
            f"open (rendered {rendered[:60]!r}); use 'auto'",
            param="tool_choice",
            code="unsupported_value",
        )
    return chat.tokenizer.encode(head)


def as_text(chat: ChatFormat, turn: Sequence[int]) -> Action:
    """The turn as plain content (tool_choice "none"): its text, reasoning removed, any
    tool-call markup kept as written."""
    text = chat.tokenizer.decode([t for t in turn if t not in chat.stop_ids])
    return Action(content=strip_think(text).strip())

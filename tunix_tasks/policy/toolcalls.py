"""Tool-call parsers: a sampled assistant turn's text -> `Action`, per model family.

Pure functions of the decoded text (special tokens kept as their text, stop token removed).
They never raise: text that looks like a tool call but cannot be read becomes
`Action(content=<the text>, error="malformed tool call: <reason>")`, which the rollout
answers with the error instead of calling the environment.

    parse_hermes('<tool_call>\\n{"name": "calc", "arguments": {"x": "1+2"}}\\n</tool_call>')
    # Action(tool_calls=(ToolCall("calc", {"x": "1+2"}),))
    parse_llama3_json('{"name": "calc", "parameters": {"x": "1+2"}}')   # the same action
    parse_mistral('[TOOL_CALLS] [{"name": "calc", "arguments": {"x": "1+2"}}]')  # again
    parse_mistral('[TOOL_CALLS]calc[ARGS]{"x": "1+2"}')    # and in Mistral's newer form
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tunix_tasks.messages import Action, ToolCall, is_call_id

__all__ = ["parse_hermes", "parse_llama3_json", "parse_mistral", "strip_think"]

#: (open, close) of a reasoning block: Qwen3 / DeepSeek-R1's, Magistral's (Mistral v11+)
THINK_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"


class _Malformed(ValueError):
    """A tool call that cannot be read; its message is the short reason."""


def strip_think(text: str) -> str:
    """`text` without its leading reasoning block.

    Reasoning is `<think>...</think>` (or `[THINK]...[/THINK]`) at the start, or everything
    up to a closing tag with no opening one (templates that write the opening tag into the
    generation prompt). An unclosed opening tag means the turn was all reasoning.
    """
    stripped = text.lstrip()
    for think_open, think_close in THINK_TAGS:
        if stripped.startswith(think_open):
            end = stripped.find(think_close)
            return "" if end < 0 else stripped[end + len(think_close) :]
        end = text.find(think_close)
        if end >= 0 and think_open not in text[:end]:
            return text[end + len(think_close) :]
    return text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: a template's tojson rewrites it


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _json(text: str, pos: int = 0) -> tuple[Any, int]:
    """(the JSON value at `pos` in `text`, where it ends); raises _Malformed, never a
    RecursionError (deep nesting) or the ValueError of an over-long integer."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        raise _Malformed(f"bad JSON: {e.msg}") from None
    except RecursionError:
        raise _Malformed("bad JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits, NaN
        raise _Malformed(f"bad JSON: {str(e)[:80]}") from None


def _whole_json(text: str) -> Any:
    """The JSON value that is all of `text` (surrounding whitespace allowed); _Malformed."""
    value, end = _json(text, len(text) - len(text.lstrip()))
    if text[end:].strip():
        raise _Malformed("bad JSON: Extra data")
    return value


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall:
    """A ToolCall from a decoded {"name": ..., <one of args_keys>: {...}} object."""
    if not isinstance(obj, dict):
        raise _Malformed("not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _Malformed('missing "name"')
    key = next((k for k in args_keys if k in obj), args_keys[0])
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON-encoded string
        try:
            args = _whole_json(args)
        except _Malformed as e:
            reason = str(e).removeprefix("bad JSON: ")
            raise _Malformed(f'"{key}" string is not JSON: {reason}') from None
    if not isinstance(args, dict):
        raise _Malformed(f'"{key}" is not an object')
    return ToolCall(name=name, arguments=args)


def _hermes_calls(text: str) -> tuple[list[ToolCall], str]:
    """(calls, text outside the call blocks); raises _Malformed."""
    calls: list[ToolCall] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        outside.append(text[pos:] if start < 0 else text[pos:start])
        if CALL_CLOSE in outside[-1]:
            raise _Malformed(f"{CALL_CLOSE} without {CALL_OPEN}")
        if start < 0:
            return calls, "".join(outside)
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            raise _Malformed(f"unclosed {CALL_OPEN}")
        obj = _whole_json(text[start + len(CALL_OPEN) : end])
        calls.append(_call(obj, ("arguments",)))
        pos = end + len(CALL_CLOSE)


def parse_hermes(text: str) -> Action:
    """Hermes / Qwen: each `<tool_call>{"name", "arguments"}</tool_call>` block is a call;
    the text outside the blocks (reasoning removed) is the content."""
    text = strip_think(text)
    try:
        calls, outside = _hermes_calls(text)
    except _Malformed as e:
        return Action(content=text.strip(), error=f"malformed tool call: {e}")
    return Action(content=outside.strip(), tool_calls=tuple(calls))


def _llama3_calls(body: str) -> list[ToolCall]:
    """Calls from `{...}[; {...}]*`; raises _Malformed."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        obj, pos = _json(body, pos)
        calls.append(_call(obj, ("parameters", "arguments")))
        rest = body[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise _Malformed("text after the tool call")
        next_call = rest[1:].lstrip()  # raw_decode does not skip leading whitespace
        pos = len(body) - len(next_call)


def parse_llama3_json(text: str) -> Action:
    """Llama 3.1 JSON tool calls: `[<|python_tag|>]{"name", "parameters"}[; {...}]*`.

    Text that does not start with `{` (after the optional tag) is plain content.
    """
    text = text.strip()
    body = text.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return Action(content=text)
    try:
        return Action(tool_calls=tuple(_llama3_calls(body)))
    except _Malformed as e:
        return Action(content=text, error=f"malformed tool call: {e}")


def _with_id(call: ToolCall, value: object) -> ToolCall:
    """`call` with the id the model wrote, where it is one of 9 alphanumerics (the rollout
    names the others: `Action.with_call_ids`)."""
    return dataclasses.replace(call, id=value) if is_call_id(value) else call


def _mistral_list(body: str) -> list[ToolCall]:
    """Calls from `[{"name", "arguments"[, "id"]}, ...]` (tokenizers v3 and v7); raises
    _Malformed."""
    objs = _whole_json(body)
    objs = [objs] if isinstance(objs, dict) else objs
    if not isinstance(objs, list) or not objs:
        raise _Malformed("not a list of calls")
    return [_with_id(_call(obj, ("arguments",)), obj.get("id")) for obj in objs]


def _mistral_named(body: str) -> list[ToolCall]:
    """Calls from `name[CALL_ID]id[ARGS]{...}` (tokenizer v11) or `name[ARGS]{...}` (v13
    and later), each after its own [TOOL_CALLS] (the first one already read); raises
    _Malformed."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        at = body.find(MISTRAL_ARGS, pos)
        if at < 0:
            raise _Malformed(f"no {MISTRAL_ARGS} after the tool's name")
        name, _, call_id = body[pos:at].partition(MISTRAL_CALL_ID)
        if MISTRAL_CALLS in name:  # a call before this one ended at its name
            raise _Malformed(f"no {MISTRAL_ARGS} after the tool's name")
        args_at = at + len(MISTRAL_ARGS)
        args_at += len(body[args_at:]) - len(body[args_at:].lstrip())
        args, pos = _json(body, args_at)
        call = _call({"name": name.strip(), "arguments": args}, ("arguments",))
        calls.append(_with_id(call, call_id.strip()))
        rest = body[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(MISTRAL_CALLS):
            raise _Malformed("text after the tool call")
        pos = len(body) - len(rest) + len(MISTRAL_CALLS)


def parse_mistral(text: str) -> Action:
    """Mistral, in either form its templates write, the text before the first marker (if
    any) as the content:

        [TOOL_CALLS] [{"name", "arguments"[, "id"]}, ...]          tokenizers v3 and v7
        [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}[TOOL_CALLS]...      v11 (v13 and later: no id)

    An id of 9 alphanumerics the model wrote is kept (the rollout names the others:
    `Action.with_call_ids`). Reasoning (`[THINK]...[/THINK]`, Magistral's) is removed."""
    text = strip_think(text)
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return Action(content=text.strip())
    content, body = text[:start].strip(), text[start + len(MISTRAL_CALLS) :].strip()
    try:
        named = body.startswith((MISTRAL_ARGS, MISTRAL_CALL_ID))  # with the name left out
        listed = body[:1] in ("[", "{", "") and not named
        calls = _mistral_list(body) if listed else _mistral_named(body)
    except _Malformed as e:
        return Action(content=text.strip(), error=f"malformed tool call: {e}")
    return Action(content=content, tool_calls=tuple(calls))

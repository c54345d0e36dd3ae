"""Tool-call parsers: valid calls, reasoning blocks, every malformed case, and no input raises."""

from __future__ import annotations

import json
import random

import pytest

from tunix_tasks.messages import Action, ToolCall
from tunix_tasks.policy.toolcalls import parse_hermes, parse_llama3_json, parse_mistral, strip_think


def hermes_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_hermes_single_call_with_content() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
    assert parse_hermes(text) == Action(
        content="Let me add.", tool_calls=(ToolCall("calc", {"expr": "1+2"}),)
    )


def test_hermes_multiple_calls_in_order() -> None:
    text = (
        hermes_call('{"name": "a", "arguments": {"x": 1}}')
        + "\n"
        + hermes_call('{"name": "b", "arguments": {}}')
    )
    action = parse_hermes(text)
    assert action.tool_calls == (ToolCall("a", {"x": 1}), ToolCall("b", {}))
    assert action.content == "" and action.error is None


def test_hermes_arguments_as_json_string_and_missing_arguments() -> None:
    text = hermes_call('{"name": "calc", "arguments": "{\\"expr\\": \\"2*3\\"}"}')
    assert parse_hermes(text).tool_calls == (ToolCall("calc", {"expr": "2*3"}),)
    assert parse_hermes(hermes_call('{"name": "now"}')).tool_calls == (ToolCall("now", {}),)


def test_hermes_unicode() -> None:
    text = "Voilà " + hermes_call('{"name": "météo", "arguments": {"ville": "Zürich 東京"}}')
    action = parse_hermes(text)
    assert action.content == "Voilà"
    assert action.tool_calls == (ToolCall("météo", {"ville": "Zürich 東京"}),)


def test_hermes_plain_text_is_content() -> None:
    assert parse_hermes("  The answer is 4.\n") == Action(content="The answer is 4.")


def test_hermes_think_block_is_not_content_and_its_calls_are_ignored() -> None:
    call = hermes_call('{"name": "calc", "arguments": {}}')
    text = f"<think>\nmaybe {hermes_call('{bad')} first\n</think>\n\nok {call}"
    assert parse_hermes(text) == Action(content="ok", tool_calls=(ToolCall("calc", {}),))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>a</think>\n\nanswer", "\n\nanswer"),
        ("  <think>a</think>answer", "answer"),
        ("<think>still thinking", ""),
        ("reasoning the template opened\n</think>\n\nanswer", "\n\nanswer"),
        ("no reasoning", "no reasoning"),
        ("text <think>late</think> more", "text <think>late</think> more"),
        ("[THINK]2+3 is 5[/THINK]The answer is 5.", "The answer is 5."),  # Magistral's
        ("opened by the template[/THINK]5", "5"),
    ],
)
def test_strip_think(text: str, expected: str) -> None:
    assert strip_think(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (hermes_call('{"name": "calc", "arguments": {"x": 1}'), "bad JSON"),
        (hermes_call("not json"), "bad JSON"),
        (hermes_call(""), "bad JSON"),
        (hermes_call('{"arguments": {}}'), 'missing "name"'),
        (hermes_call('{"name": "", "arguments": {}}'), 'missing "name"'),
        (hermes_call('{"name": 3, "arguments": {}}'), 'missing "name"'),
        (hermes_call('{"name": "f", "arguments": [1]}'), '"arguments" is not an object'),
        (hermes_call('{"name": "f", "arguments": "[1]"}'), '"arguments" is not an object'),
        (hermes_call('{"name": "f", "arguments": "{oops"}'), '"arguments" string is not JSON'),
        (hermes_call('["f", {}]'), "not a JSON object"),
        ('<tool_call>\n{"name": "f", "arguments": {}}', "unclosed <tool_call>"),
        ('{"name": "f"}</tool_call>', "</tool_call> without <tool_call>"),
        (
            hermes_call('{"name": "f", "arguments": {}}') + "<tool_call>{",
            "unclosed <tool_call>",
        ),
    ],
)
def test_hermes_malformed_sets_error(text: str, reason: str) -> None:
    action = parse_hermes(text)
    assert action.tool_calls == ()
    assert action.error is not None and action.error.startswith("malformed tool call: ")
    assert reason in action.error
    assert action.content == text.strip()


def test_llama3_single_call_with_python_tag() -> None:
    text = '<|python_tag|>{"name": "calc", "parameters": {"expr": "1+2"}}'
    assert parse_llama3_json(text) == Action(tool_calls=(ToolCall("calc", {"expr": "1+2"}),))


def test_llama3_arguments_key_and_string_arguments() -> None:
    assert parse_llama3_json('{"name": "f", "arguments": {"a": "é"}}').tool_calls == (
        ToolCall("f", {"a": "é"}),
    )
    assert parse_llama3_json('{"name": "f", "parameters": "{\\"a\\": 1}"}').tool_calls == (
        ToolCall("f", {"a": 1}),
    )


def test_llama3_calls_separated_by_semicolons() -> None:
    text = ' {"name": "a", "parameters": {"s": "x;y"}} ;\n{"name": "b", "parameters": {}}\n'
    assert parse_llama3_json(text).tool_calls == (ToolCall("a", {"s": "x;y"}), ToolCall("b", {}))


def test_llama3_plain_text_is_content() -> None:
    assert parse_llama3_json(" The answer is {4}. ") == Action(content="The answer is {4}.")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "f", "parameters": {"x": 1}', "bad JSON"),
        ('<|python_tag|>{"name": "f", ', "bad JSON"),
        ('{"parameters": {}}', 'missing "name"'),
        ('{"name": "f", "parameters": 3}', '"parameters" is not an object'),
        ('{"name": "f", "parameters": {}} and more', "text after the tool call"),
        ('{"name": "f", "parameters": {}};', "bad JSON"),
        ('{"name": "f", "parameters": {}}; 7', "not a JSON object"),
        ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": []}', "not an object"),
    ],
)
def test_llama3_malformed_sets_error(text: str, reason: str) -> None:
    action = parse_llama3_json(text)
    assert action.tool_calls == ()
    assert action.error is not None and action.error.startswith("malformed tool call: ")
    assert reason in action.error


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    ";",
    '"f"',
    '"{}"',
    '"\\u00e9"',
    "1",
    "null",
    " ",
    "\n",
    "text",
    "\\",
    '"',
]


@pytest.mark.parametrize("parse", [parse_hermes, parse_llama3_json, parse_mistral])
def test_no_input_raises(parse) -> None:
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))
        action = parse(text)
        assert isinstance(action, Action)
        assert action.error is None or not action.tool_calls
        assert all(isinstance(c.arguments, dict) for c in action.tool_calls)


@pytest.mark.parametrize(
    ("parse", "opening"),
    [
        (parse_hermes, '<tool_call>{"name": "f", "arguments": '),
        (parse_llama3_json, '{"name": "f", "parameters": '),
        (parse_mistral, '[TOOL_CALLS] [{"name": "f", "arguments": '),
        (parse_mistral, "[TOOL_CALLS]f[ARGS]"),
    ],
)
def test_hostile_json_is_a_malformed_call_not_an_exception(parse, opening) -> None:
    """What the JSON decoder raises besides JSONDecodeError would have ended the actor:
    nesting past the recursion limit, an integer past Python's 4300 digits; NaN parses
    but no template writes it back as JSON."""
    for payload, reason in [
        ("[" * 100_000, "nested too deeply"),
        ('{"x": ' + "1" * 5000 + "}", "integer string conversion"),
        ('{"x": NaN}', "NaN is not JSON"),
    ]:
        action = parse(opening + payload + ("}</tool_call>" if parse is parse_hermes else ""))
        assert action.tool_calls == () and reason in (action.error or ""), action.error


def test_mistral_reasoning_is_not_content_and_may_mention_the_marker() -> None:
    text = "[THINK]I could write [TOOL_CALLS] here[/THINK]" + '[TOOL_CALLS]calc[ARGS]{"x": 1}'
    assert parse_mistral(text) == Action(tool_calls=(ToolCall("calc", {"x": 1}),))
    assert parse_mistral("[THINK]2+3 is 5[/THINK]The answer is 5.") == Action(
        content="The answer is 5."
    )


def test_mistral_calls_after_the_marker() -> None:
    text = ' [TOOL_CALLS] [{"name": "a", "arguments": {"s": "x"}}, {"name": "b", "arguments": {}}]'
    assert parse_mistral(text) == Action(tool_calls=(ToolCall("a", {"s": "x"}), ToolCall("b", {})))
    # An id of 9 alphanumerics the model wrote is kept (its tokens hold it), another is
    # dropped (the rollout names the call); text before the marker is content.
    text = 'Let me add.[TOOL_CALLS] {"name": "a", "arguments": "{}", "id": "abcdefgh9"}'
    call = ToolCall("a", {}, id="abcdefgh9")
    assert parse_mistral(text) == Action(content="Let me add.", tool_calls=(call,))
    for bad in ("call_1", "abcdefgh", "abcdéfgh9", 123456789):
        text = f'[TOOL_CALLS] [{{"name": "a", "arguments": {{}}, "id": {json.dumps(bad)}}}]'
        assert parse_mistral(text).tool_calls == (ToolCall("a", {}),)
    assert parse_mistral(" The answer is [4]. ") == Action(content="The answer is [4].")


def test_mistral_calls_in_the_newer_forms() -> None:
    """Tokenizer v11: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call; v13 and later
    without the id. The JSON may be followed by the next call, or spaces."""
    text = '[TOOL_CALLS]calc[ARGS]{"x": "1+2"}'
    assert parse_mistral(text) == Action(tool_calls=(ToolCall("calc", {"x": "1+2"}),))
    text = 'Let me add.[TOOL_CALLS]a[CALL_ID]abcdefgh9[ARGS]{"s": "x"}[TOOL_CALLS] b [ARGS] {} \n'
    calls = (ToolCall("a", {"s": "x"}, id="abcdefgh9"), ToolCall("b", {}))
    assert parse_mistral(text) == Action(content="Let me add.", tool_calls=calls)
    # an id that is not 9 alphanumerics is dropped (the rollout names the call)
    text = '[TOOL_CALLS]a[CALL_ID]call_1[ARGS]"{\\"s\\": 1}"'  # arguments as a JSON string
    assert parse_mistral(text) == Action(tool_calls=(ToolCall("a", {"s": 1}),))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[TOOL_CALLS]calc{}", "no [ARGS] after the tool's name"),
        ('[TOOL_CALLS]a[ARGS]{"s": 1}[TOOL_CALLS]b', "no [ARGS] after the tool's name"),
        ("[TOOL_CALLS]a[TOOL_CALLS]b[ARGS]{}", "no [ARGS] after the tool's name"),
        ("[TOOL_CALLS][ARGS]{}", 'missing "name"'),
        ("[TOOL_CALLS][CALL_ID]abcdefgh9[ARGS]{}", 'missing "name"'),
        ("[TOOL_CALLS]calc[ARGS]{", "bad JSON"),
        ("[TOOL_CALLS]calc[ARGS]", "bad JSON"),
        ('[TOOL_CALLS]calc[ARGS]{"x": 1} and more', "text after the tool call"),
        ("[TOOL_CALLS]calc[ARGS][1]", '"arguments" is not an object'),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {}}', "bad JSON"),
        ("[TOOL_CALLS]", "bad JSON"),
        ("[TOOL_CALLS] []", "not a list of calls"),
        ('[TOOL_CALLS] "f"', "no [ARGS]"),  # not a list: read as the newer form
        ('[TOOL_CALLS] [{"arguments": {}}]', 'missing "name"'),
        ('[TOOL_CALLS] [{"name": "f", "arguments": [1]}]', '"arguments" is not an object'),
        ('[TOOL_CALLS] [{"name": "f"}, 3]', "not a JSON object"),
    ],
)
def test_mistral_malformed_sets_error(text: str, reason: str) -> None:
    action = parse_mistral(text)
    assert action.tool_calls == () and action.content == text.strip()
    assert action.error is not None and reason in action.error

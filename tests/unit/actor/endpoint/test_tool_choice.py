"""Tests for tunix_tasks.actor.endpoint.tool_choice: the forced opening of a tool call is
each template's own text, joins the episode as prompt tokens (loss-masked), and the sampled
continuation keeps its exact ids and the learner's log-probs; "none" returns text; invalid
choices are 400s naming `tool_choice`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.mistral_forms import mistral_checkpoint
from tests.paths import HF_FIXTURES
from tests.unit.actor.endpoint.harness import HTTP_TIMEOUT_S, endpoint
from tests.unit.actor.endpoint.test_server import (
    CALCULATE,
    learner_logprobs,
    open_episode,
    policy_spans,
)
from tunix_tasks.actor.endpoint.tool_choice import (
    ToolChoice,
    as_text,
    forced_opening,
    read_tool_choice,
)
from tunix_tasks.actor.endpoint.wire import ApiError
from tunix_tasks.policy.chat_template import load_template_chat

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def _chat(name: str, folder: Path | None = None):
    folder = folder or HF_FIXTURES / name
    return load_template_chat(
        lambda f: (folder / f).read_bytes() if (folder / f).exists() else None
    )


@pytest.mark.parametrize(
    ("fixture", "required", "named"),
    [
        (
            "tiny-qwen3",
            '<tool_call>\n{"name": "',
            '<tool_call>\n{"name": "calculate", "arguments": ',
        ),
        ("tiny-llama3", '{"name": "', '{"name": "calculate", "parameters": '),
        (
            "tiny-mistral",
            '[TOOL_CALLS] [{"name": "',
            '[TOOL_CALLS] [{"name": "calculate", "arguments": ',
        ),
    ],
)
def test_the_forced_opening_is_the_templates_own_tool_call_text(fixture, required, named):
    chat = _chat(fixture)
    decode = chat.tokenizer.decode
    assert decode(forced_opening(chat, QUESTION, [CALCULATE], ToolChoice("required"))) == required
    opening = forced_opening(chat, QUESTION, [CALCULATE], ToolChoice("function", "calculate"))
    assert decode(opening) == named
    assert forced_opening(chat, QUESTION, [CALCULATE], ToolChoice("auto")) == []
    assert forced_opening(chat, QUESTION, [CALCULATE], ToolChoice("none")) == []


@pytest.mark.parametrize("form", ["v7", "v11", "v13"])
def test_the_forced_opening_in_mistrals_other_forms(tmp_path, form):
    """v7's list with its arguments as a JSON string (tests/mistral_forms.py), v11's and
    v13's call per marker. v11 writes the call's id before its arguments: a named
    choice's opening holds a random id, which the parsed call keeps."""
    chat = _chat("", mistral_checkpoint(tmp_path / form, form))
    decode = chat.tokenizer.decode
    required = decode(forced_opening(chat, QUESTION, [CALCULATE], ToolChoice("required")))
    named = ToolChoice("function", "calculate")
    first, second = (decode(forced_opening(chat, QUESTION, [CALCULATE], named)) for _ in "ab")
    if form == "v7":
        assert required == '[TOOL_CALLS][{"name": "'
        assert first == second == '[TOOL_CALLS][{"name": "calculate", "arguments": '
        return
    assert required == "[TOOL_CALLS]"
    if form == "v13":
        assert first == second == "[TOOL_CALLS]calculate[ARGS]"
        return
    assert re.fullmatch(r"\[TOOL_CALLS\]calculate\[CALL_ID\][0-9a-f]{9}\[ARGS\]", first)
    assert first != second  # each forced turn names its call anew
    action = chat.parse(chat.tokenizer.encode(first + '{"expression": "2+3"}'))
    assert action.tool_calls[0].id == first[-15:-6] and action.error is None


def test_a_forced_call_the_template_cannot_render_after_its_prompt_is_a_400():
    """Mistral v0.3 writes a system message into the last user turn only: once a call
    follows, the prompt is gone from the rendering, and no opening can be cut from it."""
    chat = _chat("tiny-mistral")
    history = [{"role": "system", "content": "Be brief."}, *QUESTION]
    with pytest.raises(ApiError, match=r"tool_choice: .*not prefix-stable") as err:
        forced_opening(chat, history, [CALCULATE], ToolChoice("required"))
    assert err.value.status == 400


def test_invalid_tool_choices_name_what_is_wrong():
    assert read_tool_choice(None, []) == ToolChoice("auto")
    assert read_tool_choice("none", [CALCULATE]) == ToolChoice("none")
    named = {"type": "function", "function": {"name": "calculate"}}
    assert read_tool_choice(named, [CALCULATE]) == ToolChoice("function", "calculate")
    for raw, words in [
        ("required", "needs `tools`"),
        ({"type": "function", "function": {"name": "search"}}, "'search' is not in `tools`"),
        ({"type": "function"}, "expected 'auto'"),
        ("sometimes", "expected 'auto'"),
    ]:
        with pytest.raises(ApiError, match=words) as err:
            read_tool_choice(raw, [] if raw == "required" else [CALCULATE])
        assert err.value.status == 400 and err.value.body["error"]["param"] == "tool_choice"


def test_none_returns_tool_call_markup_as_content():
    chat = _chat("tiny-qwen3")
    text = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    turn = [*chat.tokenizer.encode(text), chat.stop_ids[0]]
    assert chat.parse(turn).tool_calls  # what "auto" would return
    action = as_text(chat, turn)
    assert action.tool_calls == () and action.content == text


def test_a_named_tool_choice_opens_the_call_and_the_sample_continues_it():
    """Through HTTP: the episode holds the opening as loss-masked prompt tokens right before
    the sampled span; the span is the sampled ids with the learner's log-probs; "none" has
    no tool_calls; an unknown function is a 400 that leaves the episode usable."""
    named = {"type": "function", "function": {"name": "calculate"}}

    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base = await open_episode(http, ep.url, seed=2)
            body = {"messages": QUESTION, "tools": [CALCULATE]}
            bad = {"type": "function", "function": {"name": "search"}}
            r = await http.post(f"{base}/chat/completions", json=body | {"tool_choice": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            r = await http.post(f"{base}/chat/completions", json=body | {"tool_choice": named})
            assert r.status_code == 200, r.text
            first = r.json()["choices"][0]["message"]
            messages = [*QUESTION, {k: v for k, v in first.items() if v is not None}]
            if "tool_calls" in first:
                messages += [
                    {"role": "tool", "tool_call_id": c["id"], "content": "5"}
                    for c in first["tool_calls"]
                ]
            else:
                messages.append({"role": "user", "content": "Use the tool."})
            r = await http.post(
                f"{base}/chat/completions",
                json=body | {"messages": messages, "tool_choice": "none"},
            )
            assert r.status_code == 200, r.text
            assert "tool_calls" not in r.json()["choices"][0]["message"]
            await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 1.0})
            return ep

    ep = asyncio.run(run())
    [[episode]] = ep.groups
    decode = ep.chat.tokenizer.decode
    opening = '<tool_call>\n{"name": "calculate", "arguments": '
    (start, _), _ = policy_spans(episode)
    assert decode(episode.tokens[:start].tolist()).endswith(opening)
    assert not episode.loss_mask[start - len(ep.chat.tokenizer.encode(opening)) : start].any()
    recomputed = learner_logprobs(ep.sampler.model, episode)
    for (a, b), (tokens, logprobs) in zip(policy_spans(episode), ep.policy.sampled, strict=True):
        assert episode.tokens[a:b].tolist() == tokens
        np.testing.assert_array_equal(episode.behavior_logprobs[a:b], logprobs)
        np.testing.assert_allclose(recomputed[a - 1 : b - 1], logprobs, atol=1e-4)

"""Tests for tunix_tasks.actor.endpoint.wire: a sampled tool call as the OpenAI response,
and back: the client's echo of it matches what the episode recorded (fidelity)."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tests.unit.actor.endpoint.harness import tiny_qwen3
from tunix_tasks.actor.endpoint.fidelity import normalize
from tunix_tasks.actor.endpoint.wire import (
    ApiError,
    choice,
    completion,
    completion_chunks,
    parse_request,
)
from tunix_tasks.messages import Action, ToolCall


def test_a_sampled_tool_call_becomes_openai_tool_calls_and_its_echo_matches():
    chat, _ = tiny_qwen3()
    history = [{"role": "user", "content": "What is 23+45?"}]
    action = Action(content="", tool_calls=(ToolCall("calculate", {"expression": "23+45"}),))
    tokens = chat.render_action(history, action, [])  # the ids the model writes for the call
    parsed = chat.parse(tokens, []).with_call_ids()  # named as the service names them
    text = chat.tokenizer.decode(tokens[:-1])
    plain = Action(content="68")  # a second choice (n=2): a plain answer
    body = completion(
        [
            choice(
                0,
                parsed,
                finish_reason="stop",
                tokens=[chat.tokenizer.decode([t]) for t in tokens],
                logprobs=None,
            ),
            choice(1, plain, finish_reason="stop", tokens=["6", "8"], logprobs=[-0.5, -0.25]),
        ],
        model="m",
        prompt_tokens=7,
        completion_tokens=len(tokens) + 2,
    )
    first, second = body["choices"]
    assert text.startswith("<tool_call>")
    assert second["message"] == {"role": "assistant", "content": "68"}
    assert [c["logprob"] for c in second["logprobs"]["content"]] == [-0.5, -0.25]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    [call] = first["message"]["tool_calls"]
    # 9 alphanumerics: Mistral's template refuses any other id an agent echoes back
    assert call["type"] == "function" and call["id"] == parsed.tool_calls[0].id
    assert len(call["id"]) == 9 and call["id"].isalnum()
    assert call["function"]["name"] == "calculate"
    assert json.loads(call["function"]["arguments"]) == {"expression": "23+45"}
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": len(tokens) + 2,
        "total_tokens": 7 + len(tokens) + 2,
    }
    # What the client sends back is what the endpoint recorded for the turn.
    assert normalize(first["message"]) == parsed.message()
    # Streamed (stream=true), openai's own accumulator rebuilds the same completion.
    for include_usage in (False, True):
        state = ChatCompletionStreamState()
        for chunk in completion_chunks(body, include_usage=include_usage):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        final = state.get_final_completion()
        assert [c.finish_reason for c in final.choices] == ["tool_calls", "stop"]
        message = final.choices[0].message.model_dump(exclude_none=True)
        assert normalize(message) == parsed.message()
        assert final.choices[1].message.content == "68"
        assert (final.usage is not None) is include_usage


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"[1, 2]", None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}',
            "stop",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": "yes please"}', "logprobs"),
    ],
)
def test_requests_of_the_wrong_shape_name_the_field(raw, param):
    with pytest.raises(ApiError) as err:
        parse_request(raw)
    assert err.value.status == 400 and err.value.body["error"]["param"] == param


def test_unknown_fields_are_ignored_and_max_completion_tokens_wins():
    req = parse_request(
        b'{"messages": [{"role": "user", "content": "x"}], "store": true, "metadata": {"a": 1},'
        b' "max_tokens": 9, "max_completion_tokens": 5, "stop": "END"}'
    )
    assert req.max_new == 5 and req.stop == ["END"]

"""Tests for tunix_tasks.actor.endpoint.fidelity: which client histories extend an episode's."""

from __future__ import annotations

import pytest

from tunix_tasks.actor.endpoint.fidelity import HistoryMismatch, match_history, normalize
from tunix_tasks.messages import Action, ToolCall

USER = {"role": "user", "content": "What is 23+45?"}
CALL = Action(content="", tool_calls=(ToolCall("calculate", {"expression": "23+45"}),))
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "68"}
ANSWER = Action(content="68")


def _as_client(action: Action, call_id: str = "call_1") -> dict:
    """The assistant message as the openai client sends it back (JSON-string arguments)."""
    msg = {"role": "assistant", "content": action.content or None}
    if action.tool_calls:
        msg["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": '{"expression": "23+45"}'},
            }
            for c in action.tool_calls
        ]
    return msg


# The episode as the endpoint records it: the first request's messages, then each sampled
# turn as its parsed message and the messages that followed it.
RECORDED = [normalize(USER), CALL.message(), normalize(TOOL), ANSWER.message()]


def test_first_request_is_all_new_and_may_hold_few_shot_assistant_turns():
    shots = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        USER,
    ]
    new = match_history([], shots)
    assert new[0] == {"role": "system", "content": "Be brief."}  # parts joined
    assert [m["role"] for m in new] == ["system", "user", "assistant", "user"]


def test_the_client_echo_of_sampled_turns_matches_and_only_the_tail_is_new():
    """Call ids play no part in the match; the new messages keep theirs for the template
    (Mistral's renders and checks them)."""
    client = [USER, _as_client(CALL, "call_other_id"), TOOL]
    assert match_history(RECORDED[:2], client) == [
        {"role": "tool", "content": "68", "tool_call_id": "call_1"}
    ]
    assert normalize(_as_client(CALL))["tool_calls"][0]["id"] == "call_1"
    follow = {"role": "user", "content": "and 2+2?"}
    assert match_history(RECORDED, [*client, _as_client(ANSWER), follow]) == [follow]


@pytest.mark.parametrize(
    ("client", "index", "words"),
    [
        # an edited user message
        ([{**USER, "content": "What is 23+46?"}, _as_client(CALL), TOOL], 0, "edited"),
        # an edited assistant turn: other arguments than were sampled
        (
            [
                USER,
                {
                    **_as_client(CALL),
                    "tool_calls": [
                        {
                            "id": "x",
                            "type": "function",
                            "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'},
                        }
                    ],
                },
                TOOL,
            ],
            1,
            "edited",
        ),
        # truncated: the sampled turn is missing
        ([USER], 1, "truncated"),
        # reordered
        ([_as_client(CALL), USER, TOOL], 0, "reordered"),
        # nothing after the episode's last turn
        ([USER, _as_client(CALL)], 2, "nothing new"),
        # an assistant turn the model never sampled, after the first request
        (
            [
                USER,
                _as_client(CALL),
                TOOL,
                {"role": "assistant", "content": "69"},
                {"role": "user", "content": "?"},
            ],
            3,
            "did not sample",
        ),
        # ending with an assistant turn: nothing to answer
        ([USER, _as_client(CALL), {"role": "assistant", "content": "x"}], 2, "nothing to answer"),
    ],
    ids=[
        "edited-user",
        "edited-assistant",
        "truncated",
        "reordered",
        "nothing-new",
        "unsampled-assistant",
        "ends-with-assistant",
    ],
)
def test_histories_that_do_not_extend_the_episode_are_refused_with_the_index(client, index, words):
    with pytest.raises(HistoryMismatch) as err:
        match_history(RECORDED[:2], client)
    assert err.value.index == index and words in err.value.reason


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "wizard", "content": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": 7},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
    ],
)
def test_malformed_messages_are_value_errors_not_mismatches(bad):
    with pytest.raises(ValueError) as err:
        match_history([], [bad, USER])
    assert not isinstance(err.value, HistoryMismatch)


def test_the_ids_the_endpoint_sent_reach_mistrals_template():
    """The service records a sampled call under the id it sends (`with_call_ids`); the
    client's echo and its tool result, matched and normalized, render with Mistral's
    template, which refuses a call or result without its 9-character id."""
    from tests.unit.actor.endpoint.test_tool_choice import _chat

    chat = _chat("tiny-mistral")
    sampled = CALL.with_call_ids()
    [sent] = sampled.tool_calls
    recorded = [normalize(USER), sampled.message()]
    result = {"role": "tool", "tool_call_id": sent.id, "content": "68"}
    new = match_history(recorded, [USER, _as_client(CALL, sent.id), result])
    reply = chat.tokenizer.decode(chat.reply(recorded, new, []))
    assert reply == f'[TOOL_RESULTS] {{"content": 68, "call_id": "{sent.id}"}}[/TOOL_RESULTS]'
    with pytest.raises(ValueError, match="Tool call IDs should be alphanumeric"):
        chat.reply([normalize(USER), CALL.message()], [normalize(result)], [])

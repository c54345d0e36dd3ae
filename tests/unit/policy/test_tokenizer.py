"""The character tokenizer and its chat format: the episode layout, markers, round trips."""

from __future__ import annotations

from tunix_tasks.messages import Action, ToolCall, function_tool
from tunix_tasks.policy import tokenizer as char
from tunix_tasks.policy.chat import ChatFormat, Tokenizer
from tunix_tasks.policy.tokenizer import ANSWER, TOOL, CharChat, CharTokenizer

TOOLS = [function_tool("calculator", "Evaluate arithmetic.", {"expression": "e.g. 12+7"})]


def test_char_tokenizer_satisfies_the_protocol_and_keeps_its_old_name() -> None:
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer) and char.Tokenizer is CharTokenizer
    ids = tok.encode(f"{TOOL}12+7")
    assert ids[0] == tok.tool_id and tok.decode(ids) == f"{TOOL}12+7"
    assert tok.pad_id == 0 and tok.token_id(ANSWER) == tok.answer_id


def test_two_turn_layout() -> None:
    chat = CharChat()
    tok = chat.tokenizer
    assert isinstance(chat, ChatFormat)
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "1+2=?"}]
    ids = chat.start(first, TOOLS)
    assert ids == [
        tok.bos_id,
        tok.user_id,
        *tok.encode("sys"),
        tok.user_id,
        *tok.encode("1+2=?"),
        tok.assistant_id,
    ]
    history = list(first)
    sampled = [*tok.encode(f"{TOOL}1+2"), tok.end_id]
    action = chat.parse(sampled, TOOLS)
    ids += sampled + chat.close_turn(sampled)
    history.append(action.message())
    reply = {"role": action.reply_role, "content": "3"}
    ids += chat.reply(history, [reply], TOOLS)
    sampled = tok.encode(f"{ANSWER}3")  # ran out of tokens before END
    ids += sampled + chat.close_turn(sampled) + list(chat.end_ids)
    assert tok.decode(ids) == (
        "<|bos|><|user|>sys<|user|>1+2=?<|assistant|><|tool|>1+2<|end|>"
        "<|user|>3<|assistant|><|answer|>3<|end|><|eos|>"
    )
    assert chat.stop_ids == (tok.end_id, tok.eos_id) and chat.end_ids == (tok.eos_id,)


def test_parse_markers() -> None:
    chat = CharChat()
    tok = chat.tokenizer

    def parse(text: str, tools=TOOLS) -> Action:
        return chat.parse([*tok.encode(text), tok.eos_id], tools)

    assert parse(f" {TOOL} 12+7 ") == Action(
        tool_calls=(ToolCall("calculator", {"expression": "12+7"}),)
    )
    assert parse(f"{ANSWER} 19") == Action(content="19")
    assert parse(" plain ") == Action(content="plain")
    assert parse(f"{TOOL}1", tools=()) == Action(error="no tool available")
    no_params = [function_tool("now", "The time.", {})]
    assert parse(f"{TOOL}x", tools=no_params).error == "tool 'now' takes no argument"


def test_render_action_round_trips_through_parse() -> None:
    chat = CharChat()
    call = Action(tool_calls=(ToolCall("calculator", {"expression": "3*4"}),))
    for action in (call, Action(content="12")):
        ids = chat.render_action([], action, TOOLS)
        assert ids[-1] == chat.tokenizer.end_id and chat.close_turn(ids) == []
        assert chat.parse(ids, TOOLS) == action
    assert chat.tokenizer.decode(chat.render_action([], call, TOOLS)) == f"{TOOL}3*4<|end|>"

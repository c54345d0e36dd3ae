"""TemplateChat and HFTokenizer: transformers' render semantics, token-in / token-out
multi-turn episodes, end-of-turn discovery, loading errors, and the transformers fixtures.

The templates are small Hermes (Qwen 2.5) and Llama 3.1 style ones written here; the
tokenizer is a byte-level BPE trained here with both families' special tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.mistral_forms import mistral_checkpoint
from tests.paths import HF_FIXTURES
from tunix_tasks.messages import Action, Message, ToolCall, function_tool
from tunix_tasks.policy.chat import ChatFormat, Tokenizer
from tunix_tasks.policy.chat_template import (
    ChatTemplateError,
    TemplateChat,
    compile_template,
    load_template_chat,
)
from tunix_tasks.policy.hf_tokenizer import HFTokenizer, special_tokens

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
ID = {s: i for i, s in enumerate(SPECIALS)}  # the trainer numbers special tokens first

HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- continue %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if LAST_TURN_THINK and loop.last %}
            {{- '<think>\\n\\n</think>\\n\\n' }}
        {%- endif %}
        {{- message.content }}
        {%- for call in message.tool_calls | default([]) %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception("unknown role " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, respond with a JSON function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson + "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_CONFIG: dict[str, Any] = {
    "eos_token": "<|im_end|>",
    "pad_token": {"content": "<|endoftext|>", "special": True},
    "bos_token": None,
    "chat_template": HERMES_TEMPLATE,
}
QWEN_GENERATION = {"eos_token_id": [ID["<|im_end|>"], ID["<|endoftext|>"]]}
LLAMA_CONFIG: dict[str, Any] = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
LLAMA_GENERATION = {"eos_token_id": [ID["<|end_of_text|>"], ID["<|eom_id|>"], ID["<|eot_id|>"]]}

TOOLS = [
    function_tool("calc", "Evaluate an arithmetic expression <exactly>.", {"expr": "é.g. 1+2"})
]
FIXTURES = HF_FIXTURES


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [HERMES_TEMPLATE, LLAMA_TEMPLATE, json.dumps(TOOLS), "What is 12+7 then doubled?"]
    tok.train_from_iterator(corpus * 3, trainer)
    return tok.to_str()


@pytest.fixture
def qwen(tokenizer_json: str) -> TemplateChat:
    return TemplateChat.from_files(tokenizer_json, QWEN_CONFIG, None, QWEN_GENERATION)


@pytest.fixture
def llama(tokenizer_json: str) -> TemplateChat:
    return TemplateChat.from_files(
        tokenizer_json,
        LLAMA_CONFIG,
        LLAMA_TEMPLATE,
        LLAMA_GENERATION,
        template_kwargs={"date_string": "26 Jul 2024"},
    )


def calc(expr: str) -> Action:
    return Action(tool_calls=(ToolCall("calc", {"expr": expr}),))


# --- HFTokenizer ------------------------------------------------------------------------


def test_hf_tokenizer_special_tokens_are_single_ids(tokenizer_json: str) -> None:
    tok = HFTokenizer(tokenizer_json, QWEN_CONFIG)
    ids = tok.encode("<|im_start|>user\nhi é<|im_end|>")
    assert ids[0] == ID["<|im_start|>"] and ids[-1] == ID["<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>user\nhi é<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\nhi é"
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 600 and tok.pad_id == ID["<|endoftext|>"]
    assert HFTokenizer(tokenizer_json, LLAMA_CONFIG).pad_id == ID["<|end_of_text|>"]
    with pytest.raises(KeyError, match="<nope>"):
        tok.token_id("<nope>")


def test_hf_tokenizer_errors_name_the_file(tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot be loaded"):
        HFTokenizer("{not json", QWEN_CONFIG)
    with pytest.raises(ValueError, match="neither pad_token nor eos_token"):
        HFTokenizer(tokenizer_json, {})


def test_special_tokens_as_strings_or_dicts() -> None:
    config = {"bos_token": None, "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}
    config["additional_special_tokens"] = ["<a>", {"content": "<b>"}]
    assert special_tokens(config) == {
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "additional_special_tokens": ["<a>", "<b>"],
    }


def test_transformers_5_extra_special_tokens_are_read() -> None:
    """Issue #30.9: transformers 5 writes `extra_special_tokens` (a list: the new name of
    `additional_special_tokens`; an object: named tokens), which were not read."""
    listed = {"eos_token": "</s>", "extra_special_tokens": ["<a>", {"content": "<b>"}]}
    assert special_tokens(listed) == {
        "eos_token": "</s>",
        "additional_special_tokens": ["<a>", "<b>"],
    }
    named = {"eos_token": "</s>", "extra_special_tokens": {"image_token": "<|image|>"}}
    assert special_tokens(named) == {"eos_token": "</s>", "image_token": "<|image|>"}
    source = "{{ image_token }}{{ additional_special_tokens | join }}"
    assert compile_template(source).render(**special_tokens(named)) == "<|image|>"
    with pytest.raises(ValueError, match="extra_special_tokens is neither a list nor an object"):
        special_tokens({"extra_special_tokens": "<a>"})


# --- rendering semantics ----------------------------------------------------------------


def test_trim_blocks_lstrip_blocks_and_loopcontrols() -> None:
    assert compile_template("{% if true %}\nA\n  {% endif %}\nB").render() == "A\nB"
    loop = "{% for i in [1, 2, 3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}"
    assert compile_template(loop).render() == "13"


def test_tojson_is_json_dumps_without_html_escaping() -> None:
    value = {"b": "<é & 東>", "a": [1, None]}
    assert compile_template("{{ x | tojson }}").render(x=value) == json.dumps(
        value, ensure_ascii=False
    )
    indented = compile_template("{{ x | tojson(indent=2, sort_keys=true) }}").render(x=value)
    assert indented == json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)


def test_render_writes_tools_and_special_tokens(qwen: TemplateChat) -> None:
    text = qwen.render([{"role": "user", "content": "hi"}], TOOLS, add_generation_prompt=True)
    assert "\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" not in qwen.render([{"role": "user", "content": "hi"}], ())
    source = "{% if bos_token is defined %}B{% endif %}{{ pad_token }}"
    assert compile_template(source).render(**special_tokens(QWEN_CONFIG)) == "<|endoftext|>"


@pytest.mark.parametrize(
    "source,message",
    [
        ("{{ 1 / 0 }}", "failed to render: ZeroDivisionError: division by zero"),
        ("{{ ('a' * 100000000) * 40 }}", r"\* would build 100000000 characters"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion too deep"),
    ],
)
def test_a_template_failing_any_render_is_refused_at_load(
    qwen: TemplateChat, source: str, message: str
) -> None:
    """Issue #30.7: loading (what `prepare` does) renders the template under the budget."""
    with pytest.raises(ChatTemplateError, match=message):
        TemplateChat(qwen.tokenizer, source)


def test_raise_exception_is_a_clear_error(qwen: TemplateChat, llama: TemplateChat) -> None:
    with pytest.raises(ChatTemplateError, match="chat template raised: unknown role bogus"):
        qwen.render([{"role": "bogus", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        llama.render(
            [
                {"role": "user", "content": "x"},
                Action(tool_calls=calc("1").tool_calls * 2).message(),
            ]
        )


def test_strftime_now_is_today(tokenizer_json: str) -> None:
    import datetime

    chat = TemplateChat.from_files(tokenizer_json, LLAMA_CONFIG, LLAMA_TEMPLATE, LLAMA_GENERATION)
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}\n" in chat.render([{"role": "user", "content": "hi"}])


# --- end of turn ------------------------------------------------------------------------


def test_end_of_turn_is_the_stop_token_after_assistant_content(
    qwen: TemplateChat, llama: TemplateChat
) -> None:
    assert (qwen.eot_text, qwen.eot_id) == ("<|im_end|>", ID["<|im_end|>"])
    assert qwen.stop_ids == (ID["<|im_end|>"], ID["<|endoftext|>"])
    assert (llama.eot_text, llama.eot_id) == ("<|eot_id|>", ID["<|eot_id|>"])
    assert llama.stop_ids == (ID["<|end_of_text|>"], ID["<|eom_id|>"], ID["<|eot_id|>"])
    assert qwen.end_ids == () and qwen.tool_format == "hermes"
    assert llama.tool_format == "llama3_json"
    assert isinstance(qwen, ChatFormat) and isinstance(llama, ChatFormat)


def test_end_of_turn_falls_back_to_a_special_token(tokenizer_json: str) -> None:
    base = {**QWEN_CONFIG, "eos_token": "<|endoftext|>"}  # a base checkpoint's config
    chat = TemplateChat.from_files(tokenizer_json, base)
    assert chat.eot_text == "<|im_end|>"
    assert chat.stop_ids == (ID["<|endoftext|>"], ID["<|im_end|>"])


def test_tool_format_is_checked(tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match="tool_format 'xml'"):
        TemplateChat.from_files(tokenizer_json, QWEN_CONFIG, tool_format="xml")


def test_end_of_turn_missing_is_an_error(tokenizer_json: str) -> None:
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="closes assistant turns with no special token"):
        TemplateChat.from_files(tokenizer_json, QWEN_CONFIG, plain)


# --- token in / token out -----------------------------------------------------------------


def conversation(
    chat: TemplateChat,
) -> tuple[list[Message], list[Action], list[list[Message]]]:
    """(first messages, assistant actions, the replies after each action)."""
    first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+7 then doubled?"},
    ]
    if chat.tool_format == "mistral":
        # v0.3 writes the system message into the last user turn only, so a conversation
        # that goes on drops it: no prompt is a prefix (the rollout sends no system turn).
        first = first[1:]
    probe = calc("12+7").with_call_ids(1)  # calls named as the rollout names them
    try:
        chat.render([*first, probe.message(), *probe.replies("19")])
    except ChatTemplateError:  # Gemma 3: user and model turns alternate, no tool role
        actions = [Action(content="19, doubled: 38."), Action(content="It is 38.")]
        replies = [
            [{"role": "user", "content": "Sure?"}],
            [{"role": "user", "content": "Thanks! And 1+1?"}],
        ]
        return first, actions, replies
    # Two calls, each answered in its own message (Llama 3.1's template refuses two).
    calls, r1 = (*calc("12+7").tool_calls, *calc("1+1").tool_calls), ("19", "2")
    if chat.tool_format == "hermes":
        a1 = Action(content="Adding first.", tool_calls=calls)
    elif chat.tool_format == "mistral":
        a1 = Action(tool_calls=calls)
    else:
        a1, r1 = calc("12+7"), ("19",)
    actions = [a1.with_call_ids(1), calc("19*2").with_call_ids(2), Action(content="It is 38.")]
    replies = [
        actions[0].replies(r1),
        actions[1].replies("38"),
        [{"role": "user", "content": "Thanks! And 1+1?"}],
    ]
    if chat.tool_format == "mistral":  # a user turn moves the tools list: not a prefix
        return first, actions[:2], replies[:2]
    return first, actions, replies


def assert_token_in_token_out(chat: TemplateChat, *, stopped: bool = True) -> None:
    """Play `conversation` through the ChatFormat loop (policy/chat.py): after every reply
    the episode's ids are exactly the encoding of the whole rendered conversation."""
    first, actions, replies = conversation(chat)
    history = list(first)
    ids = chat.start(history, TOOLS)
    assert ids == chat.tokenizer.encode(chat.render(history, TOOLS, add_generation_prompt=True))
    for action, reply in zip(actions, replies, strict=True):
        sampled = chat.render_action(history, action, TOOLS)
        assert sampled[-1] == chat.eot_id
        if not stopped:  # the sampler ran out of tokens right before the end of turn
            sampled = sampled[:-1]
        assert chat.close_turn(sampled) == ([] if stopped else [chat.eot_id])
        turn = 1 + sum(m["role"] == "assistant" for m in history)
        assert chat.parse(sampled, TOOLS).with_call_ids(turn) == action  # as play_episode
        ids += sampled + chat.close_turn(sampled)
        history.append(action.message())
        ids += chat.reply(history, reply, TOOLS)
        history += reply
        full = chat.render(history, TOOLS, add_generation_prompt=True)
        assert ids == chat.tokenizer.encode(full)


@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("stopped", [True, False])
def test_episode_ids_equal_the_full_rendering(family: str, stopped: bool, request) -> None:
    assert_token_in_token_out(request.getfixturevalue(family), stopped=stopped)


def test_reply_is_the_text_after_the_closed_turn(qwen: TemplateChat) -> None:
    history = [{"role": "user", "content": "2+2?"}, calc("2+2").message()]
    reply = qwen.reply(history, [{"role": "tool", "content": "4"}], TOOLS)
    assert qwen.tokenizer.decode(reply) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_action_is_the_assistant_turn(qwen: TemplateChat, llama: TemplateChat) -> None:
    history = [{"role": "user", "content": "2+2?"}]
    answer = qwen.render_action(history, Action(content="4"), TOOLS)
    assert qwen.tokenizer.decode(answer) == "4<|im_end|>"
    call = qwen.tokenizer.decode(qwen.render_action(history, calc("2+2"), TOOLS))
    assert (
        call
        == '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call><|im_end|>'
    )
    call = llama.tokenizer.decode(llama.render_action(history, calc("2+2"), TOOLS))
    assert call == '{"name": "calc", "parameters": {"expr": "2+2"}}<|eot_id|>'


def test_parse_keeps_special_text_and_reports_malformed_calls(qwen: TemplateChat) -> None:
    sampled = qwen.tokenizer.encode("<think>hm</think>\n\n<tool_call>\n{bad}\n</tool_call>")
    action = qwen.parse([*sampled, ID["<|endoftext|>"]], TOOLS)
    assert action.error is not None and action.error.startswith("malformed tool call")
    assert qwen.close_turn([]) == [qwen.eot_id]
    assert qwen.close_turn([ID["<|endoftext|>"]]) == []


def test_last_turn_may_render_differently(tokenizer_json: str) -> None:
    """Qwen3 writes an empty think block only into the last assistant turn."""
    chat = TemplateChat.from_files(
        tokenizer_json, QWEN_CONFIG, template_kwargs={"LAST_TURN_THINK": True}
    )
    history = [{"role": "user", "content": "2+2?"}, calc("2+2").message()]
    assert "<think>" in chat.render(history)
    reply = chat.reply(history, [{"role": "tool", "content": "4"}])
    assert chat.tokenizer.decode(reply).startswith("\n<|im_start|>user\n<tool_response>\n4\n")


def test_not_prefix_stable_is_logged_once_for_replies_and_refused_for_actions(
    tokenizer_json: str, caplog
) -> None:
    """A reply follows the closed turn however earlier turns render now (the episode keeps
    its ids: Mistral moves its tools list to the last user message); an action rendered
    for a demonstration must extend its prompt exactly."""
    template = "[{{ messages | length }}]" + HERMES_TEMPLATE
    chat = TemplateChat.from_files(tokenizer_json, QWEN_CONFIG, template)
    history = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    for _ in range(2):
        reply = chat.reply(history, [{"role": "user", "content": "and 3+3?"}])
        assert chat.tokenizer.decode(reply) == (
            "\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
        )
    [warning] = [r.getMessage() for r in caplog.records if "prefix-stable" in r.getMessage()]
    assert re.search(r"at char 1: '2\].* became '3\]", warning)
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        chat.render_action(history[:1], Action(content="4"))


def test_a_reply_where_earlier_turns_moved_must_follow_the_same_turn(tokenizer_json: str):
    """Counting end-of-turns finds the closed turn only if it ends the same way there: a
    template that keeps only its last messages, or moved text holding an end-of-turn, is a
    clear error instead of a reply cut at the wrong place."""
    window = (
        "{%- for m in messages[-3:] %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    chat = TemplateChat.from_files(tokenizer_json, QWEN_CONFIG, window)
    history = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        chat.reply(history, [{"role": "user", "content": "q3"}])
    mistral, _ = fixture_chat("tiny-mistral")
    odd = [function_tool("calc", "Evaluate </s> an expression.", {"expr": "1+2"})]
    history = [{"role": "user", "content": "12+7?"}, {"role": "assistant", "content": "19"}]
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        mistral.reply(history, [{"role": "user", "content": "1+1?"}], odd)


# --- loading ------------------------------------------------------------------------------


def reader(files: dict[str, Any]):
    def read(name: str) -> bytes | None:
        value = files.get(name)
        if value is None or isinstance(value, bytes):
            return value
        return (value if isinstance(value, str) else json.dumps(value)).encode()

    return read


def test_load_template_chat_reads_the_checkpoint_files(tokenizer_json: str) -> None:
    config = {k: v for k, v in QWEN_CONFIG.items() if k != "chat_template"}
    files = {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config}
    files |= {"chat_template.jinja": HERMES_TEMPLATE, "generation_config.json": QWEN_GENERATION}
    chat = load_template_chat(reader(files))
    assert chat.template == HERMES_TEMPLATE and chat.stop_ids == qwen_stop_ids()
    named = {**config, "chat_template": [{"name": "tool_use", "template": "x"}]}
    named["chat_template"].append({"name": "default", "template": HERMES_TEMPLATE})
    files = {"tokenizer.json": tokenizer_json, "tokenizer_config.json": named}
    assert load_template_chat(reader(files)).template == HERMES_TEMPLATE


def qwen_stop_ids() -> tuple[int, ...]:
    return (ID["<|im_end|>"], ID["<|endoftext|>"])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"tokenizer.json": None}, FileNotFoundError, r"tokenizer\.json: not found"),
        ({"tokenizer_config.json": None}, FileNotFoundError, "tokenizer_config.json: not found"),
        ({"tokenizer_config.json": "{"}, ValueError, "tokenizer_config.json: not valid JSON"),
        ({"tokenizer_config.json": "[]"}, ValueError, "tokenizer_config.json: not a JSON object"),
        ({"tokenizer_config.json": {"eos_token": "<|im_end|>"}}, ChatTemplateError, "no chat"),
        (
            {"tokenizer_config.json": {**QWEN_CONFIG, "chat_template": [{"name": "x"}]}},
            ChatTemplateError,
            'no template named "default"',
        ),
        # Issue #30.9: template errors name the template's file, not only the directory.
        (
            {"chat_template.jinja": "{% if %}"},
            ChatTemplateError,
            r"^chat_template\.jinja: chat template: syntax error on line 1",
        ),
        (
            {"tokenizer_config.json": {**QWEN_CONFIG, "chat_template": "{{ x | nope }}"}},
            ChatTemplateError,
            r"^tokenizer_config\.json: chat template: syntax error",
        ),
        (
            {"chat_template.jinja": "{{ raise_exception('boom') }}"},
            ChatTemplateError,
            r"^chat_template\.jinja: chat template raised: boom",
        ),
        (
            {"generation_config.json": {"eos_token_id": "x"}},
            ValueError,
            "generation_config.json: eos_token_id 'x'",
        ),
    ],
)
def test_load_errors_name_the_file(tokenizer_json: str, change, error, match) -> None:
    files = {"tokenizer.json": tokenizer_json, "tokenizer_config.json": QWEN_CONFIG} | change
    with pytest.raises(error, match=match):
        load_template_chat(reader(files))


# --- transformers reference fixtures ------------------------------------------------------

FIXTURE_NAMES = sorted(
    {"tiny-qwen3", "tiny-llama3", *(p.parent.name for p in FIXTURES.glob("*/reference.json"))}
)


def fixture_chat(name: str) -> tuple[TemplateChat, dict[str, Any]]:
    """The fixture checkpoint's chat and its reference.json (skips when absent)."""
    root = FIXTURES / name
    if not (root / "reference.json").exists():
        pytest.skip(f"{root} has no reference.json")

    def read(file: str) -> bytes | None:
        path = root / file
        return path.read_bytes() if path.exists() else None

    return load_template_chat(read), json.loads((root / "reference.json").read_text())


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_render_matches_transformers(name: str) -> None:
    chat, reference = fixture_chat(name)
    assert reference["chat"]
    for case in reference["chat"]:
        args = (case["messages"], case.get("tools") or (), case["add_generation_prompt"])
        if case.get("error"):
            with pytest.raises(ChatTemplateError, match=re.escape(case["error"])):
                chat.render(*args)
            continue
        text = chat.render(*args)
        assert text == case["text"], case["name"]
        assert chat.tokenizer.encode(text) == case["ids"], case["name"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_encode_matches_transformers(name: str) -> None:
    chat, reference = fixture_chat(name)
    assert chat.tokenizer.vocab_size == reference["vocab_size"]
    for case in reference["encode"]:
        assert chat.tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_episode_ids_equal_the_full_rendering(name: str) -> None:
    chat, _ = fixture_chat(name)
    assert chat.eot_text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "</s>")
    assert chat.eot_id in chat.stop_ids
    assert_token_in_token_out(chat)


def test_mistral_user_reply_after_tools_moves_the_tools_list() -> None:
    """v0.3 lists the tools before the last user message: a user turn after a tool
    episode's answer renders them again there (the episode keeps its earlier ids)."""
    chat, _ = fixture_chat("tiny-mistral")
    action = calc("12+7").with_call_ids(1)
    history = [
        {"role": "user", "content": "12+7?"},
        action.message(),
        *action.replies("19"),
        Action(content="It is 19.").message(),
    ]
    text = chat.tokenizer.decode(chat.reply(history, [{"role": "user", "content": "1+1?"}], TOOLS))
    assert text.startswith("[AVAILABLE_TOOLS] [") and text.endswith("[INST] 1+1?[/INST]")


def test_arguments_are_a_json_string_only_where_an_object_does_not_read_back(tmp_path) -> None:
    """mistral-common's v7 template writes `arguments|tojson|safe` after plain text: given
    an object, jinja's `str + Markup` HTML-escapes that text (transformers renders it so too),
    and the call reads back as bad JSON. There, and only there, calls' arguments reach the
    template as JSON strings (OpenAI's form), and the list reads back whole."""
    for name in FIXTURE_NAMES:
        assert not fixture_chat(name)[0].string_arguments, name
    root = mistral_checkpoint(tmp_path / "v7", "v7")
    chat = load_template_chat(lambda f: (root / f).read_bytes() if (root / f).exists() else None)
    assert chat.string_arguments
    action = Action(tool_calls=(ToolCall("calc", {"x": "<1>"}), ToolCall("f", {}))).with_call_ids(2)
    written = chat.tokenizer.decode(chat.render_action([{"role": "user", "content": "?"}], action))
    assert written == (
        '[TOOL_CALLS][{"name": "calc", "arguments": {"x": "<1>"}, "id": "t0002c000"}, '
        '{"name": "f", "arguments": {}, "id": "t0002c001"}]</s>'
    )
    assert chat.parse(chat.tokenizer.encode(written)) == action
    chat.string_arguments = False  # the object, as Hugging Face passes it
    escaped = chat.render_action([{"role": "user", "content": "?"}], action)
    assert chat.tokenizer.decode(escaped).startswith("[TOOL_CALLS][{&#34;name&#34;: &#34;calc")

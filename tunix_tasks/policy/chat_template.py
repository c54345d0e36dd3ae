"""`TemplateChat`: the `ChatFormat` of a Hugging Face checkpoint, from its jinja chat template.

Renders the checkpoint's template with the same jinja environment, filters, globals and
variables as transformers' `apply_chat_template`, and tokenizes the rendered text with
the checkpoint's `tokenizer.json` (policy/hf_tokenizer.py), so a prompt is token for token
what transformers would build. Multi-turn episodes stay token-in / token-out
(policy/chat.py): `reply` returns only the template's text that follows the closed
assistant turn, found by rendering the conversation with and without the new messages.

    chat = load_template_chat(lambda name: read_bytes_or_none(ckpt_dir / name))
    ids = chat.start([{"role": "user", "content": "2+2?"}], tools)
    action = chat.parse(sampled, tools)        # tool calls in the family's format

The end-of-turn token (`<|im_end|>`, `<|eot_id|>`, ...) is discovered by rendering a probe
conversation; tool calls are parsed as Hermes (`<tool_call>` JSON, Qwen), Llama 3.1 JSON or
Mistral (`[TOOL_CALLS] [...]`, or `[TOOL_CALLS]name[ARGS]{...}` in its newer templates).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jinja2

from tunix_tasks.messages import Action, Message, ToolCall, call_id, function_tool
from tunix_tasks.policy.chat import Tools
from tunix_tasks.policy.hf_tokenizer import HFTokenizer
from tunix_tasks.policy.template_sandbox import BoundedEnvironment, ChatTemplateError
from tunix_tasks.policy.toolcalls import parse_hermes, parse_llama3_json, parse_mistral

__all__ = [
    "PROBE_CALL",
    "PROBE_CALLS",
    "PROBE_QUESTION",
    "PROBE_TOOLS",
    "TOOL_PARSERS",
    "ChatTemplateError",
    "TemplateChat",
    "ToolFormat",
    "compile_template",
    "detect_tool_format",
    "load_template_chat",
    "same_calls",
    "select_template",
]

log = logging.getLogger(__name__)

ToolFormat = Literal["auto", "hermes", "llama3_json", "mistral"]
#: tool_format -> the parser of an assistant turn's text (policy/toolcalls.py)
TOOL_PARSERS: dict[str, Callable[[str], Action]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
_PROBE = [{"role": "user", "content": "PROBE_U"}, {"role": "assistant", "content": "PROBE_A"}]
#: A tool call as the rollout makes one (named, 9-character id) after a question: what a
#: template must write so that its parser reads it back (`TemplateChat.write_probe_call`).
PROBE_CALL = Action(tool_calls=(ToolCall("probe", {"x": "1"}, id=call_id(1, 0)),))
#: Two calls in one turn, as Qwen and Mistral write them (`preflight.several_calls_error`).
PROBE_CALLS = Action(
    tool_calls=(*PROBE_CALL.tool_calls, ToolCall("probe", {"x": "2"}, id=call_id(1, 1)))
)
PROBE_TOOLS = (function_tool("probe", "A tool call the template renders.", {"x": "any"}),)
PROBE_QUESTION = ({"role": "user", "content": "?"},)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja's own `tojson` HTML-escapes and takes no json.dumps options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str, **budget: Any) -> jinja2.Template:
    """`source` compiled in the environment transformers renders chat templates in, each
    render held to a time and size budget (template_sandbox.py; `budget`: its `seconds`
    and `chars`)."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, **budget)
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: syntax error on line {e.lineno}: {e}") from e


def select_template(config: Mapping[str, Any], chat_template: str | None) -> str:
    """The template text: chat_template.jinja if given, else tokenizer_config's."""
    if chat_template is not None:
        return chat_template
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if value is None:
        raise ChatTemplateError(
            'no chat template: neither chat_template.jinja nor "chat_template" in '
            "tokenizer_config.json"
        )
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(
            'tokenizer_config.json: "chat_template" list has no template named "default" '
            f"(names: {sorted(map(str, named))})"
        )
    raise ChatTemplateError(
        'tokenizer_config.json: "chat_template" is neither a string nor a list of {name, template}'
    )


def detect_tool_format(template: str) -> Literal["hermes", "llama3_json", "mistral"]:
    """The tool-call format a template's assistant turns use."""
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3_json"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return "hermes"


class TemplateChat:
    """A checkpoint's chat template as a `ChatFormat` (policy/chat.py)."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        template: str,
        *,
        eos_ids: Iterable[int] = (),
        tool_format: ToolFormat = "auto",
        template_kwargs: Mapping[str, Any] | None = None,
        origin: str | None = None,
    ) -> None:
        """`eos_ids`: generation_config's eos_token_id(s), stop ids besides the config's
        eos token; `template_kwargs`: extra template variables (e.g. `enable_thinking`);
        `origin`: the file the template comes from, named by every template error."""
        self.tokenizer = tokenizer
        self.template = template
        self._origin = f"{origin}: " if origin else ""
        self._warned_unstable = False  # `_after_last_turn` logs the first difference only
        try:
            self._compiled = compile_template(template)
        except ChatTemplateError as e:
            raise self._error(str(e)) from None
        self._variables = {**tokenizer.special_tokens, **(template_kwargs or {})}
        if tool_format == "auto":
            tool_format = detect_tool_format(template)
        if tool_format not in TOOL_PARSERS:
            raise ValueError(
                f"tool_format {tool_format!r} is not one of {sorted(TOOL_PARSERS)} or auto"
            )
        self.tool_format = tool_format
        self._parse_text = TOOL_PARSERS[tool_format]
        # A call's arguments reach the template as an object (Hugging Face's form), or as
        # a JSON string (OpenAI's) where only that reads back: mistral-common's templates
        # write `arguments|tojson|safe` after plain text, and `str + Markup` HTML-escapes
        # that text (`[{&#34;name&#34;: ...`), in transformers too, given an object.
        self.string_arguments = False
        eos = tokenizer.special_tokens.get("eos_token")
        eos_id = [tokenizer.token_id(eos)] if isinstance(eos, str) else []
        stops = list(dict.fromkeys([*eos_id, *eos_ids]))  # deduplicated, in order
        self.eot_text, self.eot_id = self._discover_eot(stops)
        self._stop_ids = tuple(dict.fromkeys([*stops, self.eot_id]))
        if not self._reads_back_probe():
            self.string_arguments = True
            self.string_arguments = self._reads_back_probe()

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str | bytes,
        tokenizer_config: Mapping[str, Any],
        chat_template: str | None = None,
        generation_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TemplateChat:
        """From the checkpoint's file contents; `kwargs` as in the constructor."""
        template = select_template(tokenizer_config, chat_template)
        eos = (generation_config or {}).get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        if not isinstance(eos_ids, list) or not all(isinstance(i, int) for i in eos_ids):
            raise ValueError(
                f"generation_config.json: eos_token_id {eos!r} is neither an int nor a list of ints"
            )
        tokenizer = HFTokenizer(tokenizer_json, tokenizer_config)
        return cls(tokenizer, template, eos_ids=eos_ids, **kwargs)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def end_ids(self) -> tuple[int, ...]:
        return ()  # the template closed the last turn already

    def render(
        self, messages: Sequence[Message], tools: Tools = (), add_generation_prompt: bool = False
    ) -> str:
        """The template's text for `messages`, exactly as `apply_chat_template` renders it
        (calls' arguments as JSON strings where `string_arguments`)."""
        if self.string_arguments:
            messages = [_with_string_arguments(m) for m in messages]
        try:
            return self._compiled.render(
                messages=list(messages),
                tools=list(tools) or None,
                documents=None,  # transformers always passes it
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except ChatTemplateError as e:
            raise self._error(str(e)) from None
        except jinja2.TemplateError as e:
            raise self._error(f"chat template failed to render: {e}") from e
        except (ArithmeticError, LookupError, TypeError, ValueError) as e:  # template code's own
            raise self._error(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def _error(self, message: str) -> ChatTemplateError:
        """A template error, naming the template's file when it came from one."""
        return ChatTemplateError(self._origin + message)

    def start(self, messages: Sequence[Message], tools: Tools = ()) -> list[int]:
        return self.tokenizer.encode(self.render(messages, tools, add_generation_prompt=True))

    def reply(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Tools = ()
    ) -> list[int]:
        prefix = self.render(history, tools)
        full = self.render([*history, *new_messages], tools, add_generation_prompt=True)
        return self.tokenizer.encode(full[self._after_last_turn(prefix, full) :])

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        return [] if sampled and sampled[-1] in self._stop_ids else [self.eot_id]

    def parse(self, sampled: Sequence[int], tools: Tools = ()) -> Action:
        ids = list(sampled)
        if ids and ids[-1] in self._stop_ids:
            ids.pop()
        return self._parse_text(self.tokenizer.decode(ids))

    def render_action(
        self, history: Sequence[Message], action: Action, tools: Tools = ()
    ) -> list[int]:
        prompt = self.render(history, tools, add_generation_prompt=True)
        full = self.render([*history, action.message()], tools)
        if not full.startswith(prompt):
            raise self._not_prefix_stable(prompt, full)
        end = full.find(self.eot_text, len(prompt))
        if end < 0:
            raise self._error(f"chat template wrote no {self.eot_text!r} after the action")
        return self.tokenizer.encode(full[len(prompt) : end + len(self.eot_text)])

    def _after_last_turn(self, prefix: str, full: str) -> int:
        """Where `full` continues after the turn that closes `prefix` (its last end-of-turn).

        Everything before that turn renders identically with more messages in most
        templates; the turn itself may not (Qwen3 writes an empty `<think></think>` only
        into the last assistant turn): its ids in the episode are the sampled ones either
        way. Where earlier turns change too, `_after_moved_turns` finds the place.
        """
        eot = self.eot_text
        last = prefix.rfind(eot)
        if last < 0:
            raise self._error(f"history renders no {eot!r}: no closed turn to reply to")
        before = prefix.rfind(eot, 0, last)
        turn_start = 0 if before < 0 else before + len(eot)
        if not full.startswith(prefix[:turn_start]):
            return self._after_moved_turns(prefix, full, last)
        end = full.find(eot, turn_start)
        if end < 0:
            raise self._not_prefix_stable(prefix, full)
        return end + len(eot)

    def _after_moved_turns(self, prefix: str, full: str, last: int) -> int:
        """`_after_last_turn` where more messages change earlier turns (Mistral lists the
        tools before the last user message, and writes the system message into it): after
        as many end-of-turns as `prefix` holds, where `full` must end the turn with the
        same text (what follows its last special token: " 4" after "[/INST]"), or the
        count would have met an end-of-turn text inside moved content, or a template that
        drops old turns. The episode keeps the ids it was played with, so it then differs
        there from the template's rendering of the whole conversation (what a server would
        prompt with), never from the ids its policy sampled or its learner trains on;
        logged once per chat."""
        eot = self.eot_text
        end = -len(eot)
        for _ in range(prefix.count(eot)):
            end = full.find(eot, end + len(eot))
            if end < 0:  # the new messages removed a turn
                raise self._not_prefix_stable(prefix, full)
        found = [(prefix.rfind(t, 0, last), t) for t in self.tokenizer.special_added_tokens()]
        own = prefix[max((at + len(t) for at, t in found if at >= 0), default=0) : last]
        if not full.endswith(own, 0, end):
            raise self._not_prefix_stable(prefix, full)
        if not self._warned_unstable:
            self._warned_unstable = True
            log.warning(
                "%s; episodes keep the ids they were played with", self._unstable(prefix, full)
            )
        return end + len(eot)

    def _unstable(self, prefix: str, full: str) -> str:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), None)
        at = min(len(prefix), len(full)) if at is None else at
        return (
            f"{self._origin}chat template is not prefix-stable: adding messages changed the "
            f"text of earlier turns at char {at}: {prefix[at : at + 40]!r} became "
            f"{full[at : at + 40]!r}"
        )

    def _not_prefix_stable(self, prefix: str, full: str) -> ChatTemplateError:
        return ChatTemplateError(self._unstable(prefix, full))

    def write_probe_call(self) -> tuple[list[int], Action]:
        """(`PROBE_CALL` as the template writes it after `PROBE_QUESTION`, what the parser
        reads in it); ChatTemplateError where the template cannot write it."""
        written = self.render_action(PROBE_QUESTION, PROBE_CALL, PROBE_TOOLS)
        return written, self.parse(written, PROBE_TOOLS)

    def _reads_back_probe(self) -> bool:
        try:
            _, read = self.write_probe_call()
        except ChatTemplateError:
            return False
        return same_calls(read, PROBE_CALL)

    def _discover_eot(self, stop_ids: Sequence[int]) -> tuple[str, int]:
        """The token that closes an assistant turn: the first stop token after the probe's
        assistant content, else the first special token there (base checkpoints whose eos
        is not the template's end of turn)."""
        probe = self.render(_PROBE)
        after = probe.find("PROBE_A")
        if after < 0:
            raise self._error("chat template does not render assistant content")
        for candidates in (
            {self.tokenizer.token_text(i): i for i in stop_ids},
            self.tokenizer.special_added_tokens(),
        ):
            found = [(probe.find(t, after), -len(t), t, i) for t, i in candidates.items()]
            found = [f for f in found if f[0] >= 0]
            if found:  # the earliest; at one position, the longest
                *_, text, token = min(found)
                return text, token
        raise self._error(
            f"chat template closes assistant turns with no special token: {probe[after:]!r}"
        )


def same_calls(a: Action, b: Action) -> bool:
    """Do `a` and `b` call the same tools with the same arguments (ids aside)?"""
    return [(c.name, c.arguments) for c in a.tool_calls] == [
        (c.name, c.arguments) for c in b.tool_calls
    ]


def _with_string_arguments(message: Message) -> Message:
    """`message` with each call's object arguments as a JSON string (transformers' tojson)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message

    def one(call: Any) -> Any:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), dict):
            return call
        arguments = json.dumps(fn["arguments"], ensure_ascii=False)
        return {**call, "function": {**fn, "arguments": arguments}}

    return {**message, "tool_calls": [one(c) for c in calls]}


def _read_json(read: Callable[[str], bytes | None], name: str) -> dict[str, Any] | None:
    raw = read(name)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name}: not a JSON object")
    return value


def load_template_chat(read: Callable[[str], bytes | None], **kwargs: Any) -> TemplateChat:
    """A checkpoint's `TemplateChat` from its files, read by name (`read` returns None for
    a missing file): tokenizer.json, tokenizer_config.json, chat_template.jinja (optional),
    generation_config.json (optional). `kwargs` as in the `TemplateChat` constructor."""
    tokenizer_json = read("tokenizer.json")
    if tokenizer_json is None:
        raise FileNotFoundError("tokenizer.json: not found")
    config = _read_json(read, "tokenizer_config.json")
    if config is None:
        raise FileNotFoundError("tokenizer_config.json: not found")
    template = read("chat_template.jinja")
    try:
        template_text = None if template is None else template.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"chat_template.jinja: not UTF-8: {e}") from e
    generation = _read_json(read, "generation_config.json")
    origin = "chat_template.jinja" if template_text is not None else "tokenizer_config.json"
    return TemplateChat.from_files(
        tokenizer_json, config, template_text, generation, origin=origin, **kwargs
    )

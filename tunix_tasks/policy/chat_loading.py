"""The chat format (tokenizer + template) of a run's model, built without JAX.

`tunix-tasks inspect` and the report decode episodes with it; `policy/build.py:
build_chat` (actors, learner, evaluation) wraps it with the policy's error.

    chat = load_chat(cfg.model)   # CharChat for a preset, TemplateChat for a checkpoint
"""

from __future__ import annotations

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.chat_template import load_template_chat
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer
from tunix_tasks.storage.store import NotFound, open_store

__all__ = ["load_chat"]


def load_chat(cfg: ModelConfig) -> ChatFormat:
    """The character chat format of a preset, or the checkpoint's tokenizer and chat
    template read through its store. Raises `FileNotFoundError` / `ValueError` naming
    the file."""
    if cfg.checkpoint is None:
        return CharChat(CharTokenizer())
    store = open_store(cfg.checkpoint)

    def read(name: str) -> bytes | None:
        try:
            return store.read_bytes(name)
        except NotFound:
            return None

    return load_template_chat(read, tool_format=cfg.tool_format)

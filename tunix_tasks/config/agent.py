"""`AgentConfig`: `actor.agent`, the OpenAI-compatible endpoint of `actor.kind: agent` and the
agent program it runs (docs/agents.md). Checked without importing the program: its path
is only validated as `package.module:function` here; the actor imports it at start.
"""

from __future__ import annotations

import ipaddress
import os
import re

from pydantic import Field, model_validator

from tunix_tasks.config.base import ConfigError, Float, Frozen, Int

__all__ = ["ENV_VAR", "AgentConfig", "api_key_from_env", "is_loopback"]

_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def api_key_from_env(var: str, *, what: str) -> str | None:
    """The bearer token held by environment variable `var` (None when `var` is empty:
    no token); ConfigError naming `what` (the field or flag) when the variable is unset."""
    if not var:
        return None
    key = os.environ.get(var, "")
    if not key:
        raise ConfigError(f"{what} names ${var}, which is unset")
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AgentConfig(Frozen):
    """The agent program and its endpoint (`actor.kind: agent`)."""

    program: str = Field(
        "",
        description="package.module:function, an async `run(client, task) -> reward` "
        "(client: an openai.AsyncOpenAI scoped to one episode); required by actor.kind=agent",
    )
    host: str = Field(
        "127.0.0.1", description="the address the endpoint binds; beyond loopback needs api_key_env"
    )
    port: Int = Field(0, ge=0, le=65535, description="the endpoint's port (0: a free one)")
    api_key_env: str = Field(
        "",
        description="environment variable holding the bearer token every request must carry "
        "(empty: none; required when host is not a loopback address)",
    )
    episode_timeout_s: Float = Field(
        600.0, gt=0.0, description="an episode idle this long is dropped as abandoned"
    )
    max_open_episodes: Int = Field(
        1024, ge=1, le=65536, description="open episodes at once; more are refused (429)"
    )
    max_concurrent_requests: Int = Field(
        512, ge=1, le=65536, description="chat requests in flight at once; more are refused (429)"
    )
    max_request_bytes: Int = Field(
        1 << 20, ge=1024, le=1 << 30, description="largest request body accepted (413 beyond)"
    )

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if self.program and not _IMPORT_PATH.fullmatch(self.program):
            raise ValueError(f"actor.agent.program {self.program!r} is not package.module:function")
        if self.api_key_env and not ENV_VAR.fullmatch(self.api_key_env):
            raise ValueError(f"actor.agent.api_key_env {self.api_key_env!r} is not a variable name")
        if not is_loopback(self.host) and not self.api_key_env:
            raise ValueError(
                f"actor.agent.host={self.host} is reachable from other machines: set "
                "actor.agent.api_key_env (the variable holding the bearer token)"
            )
        return self

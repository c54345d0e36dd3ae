"""Environment contract: owns ``StepResult``, the ``Environment`` protocol and tool-schema checks.

Environments speak messages and tool calls, never tokens. An environment offers
``tools`` (OpenAI-style function schemas, ``()`` when it has none) and receives each
policy turn as an :class:`~tunix_tasks.messages.Action`: the turn's text ``content`` and
its parsed ``tool_calls``. The policy's chat format (``tunix_tasks/policy/``) turns the
model's own tool-call syntax into that ``Action`` and renders the observation as the
template's message. One episode:

    env = make_env("calculator")
    obs = await env.reset(seed)                 # the first user message, e.g. "23+45=?"
    for _ in range(max_turns):
        action = policy(obs, env.tools)         # Action(tool_calls=(ToolCall("calculate",
                                                #   {"expression": "23+45"}),))
        result = await env.step(action)         # StepResult(observation, reward, done, info)
        obs = result.observation                # after tool calls: their results, one per
        if result.done:                         # call (a tuple) or one for all (a string);
            break                               # else the user's next words (a string)

A final answer is an action without tool calls: its ``content`` is the answer. When the
policy's text cannot be parsed (a malformed tool call) the rollout answers
``error: malformed tool call: ...`` itself and never calls ``step``.

``reset``/``step`` are coroutines so one actor can step many environments with
``asyncio.gather``; an environment that blocks (the sandbox) does so off the event loop.
``demonstration(seed)`` returns expert actions that solve that seed (supervised warm start).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tunix_tasks.messages import Action, ToolCall, tool_argument_names

__all__ = [
    "Action",
    "Environment",
    "StepResult",
    "ToolCall",
    "check_environment",
    "check_tools",
    "string_argument",
]


@dataclass(frozen=True)
class StepResult:
    """What one action did: the next observation, its reward, whether the episode ended.

    The observation answers the action: after a turn with tool calls, one result per call
    in the calls' order (a tuple of strings; each goes back as its call's tool message),
    or one string answering them all; after a turn without calls, the user's next words.
    """

    observation: str | tuple[str, ...]
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        obs = self.observation
        if not isinstance(obs, str):
            if not isinstance(obs, Sequence) or not all(isinstance(o, str) for o in obs):
                raise TypeError(
                    "StepResult.observation must be a string, or one string per tool call, "
                    f"got {reprlib.repr(obs)}"
                )
            object.__setattr__(self, "observation", tuple(obs))  # a list reads as a tuple


@runtime_checkable
class Environment(Protocol):
    """A task the agent acts in with messages and tool calls (module docstring: the loop)."""

    name: str
    tools: Sequence[dict]  # OpenAI-style function schemas offered to the model; () when none

    async def reset(self, seed: int) -> str:
        """Start an episode deterministically from ``seed``; returns the first user message."""
        ...

    async def step(self, action: Action) -> StepResult:
        """Apply one policy turn; the observation answers it (a tool result or a user turn)."""
        ...

    def demonstration(self, seed: int) -> list[Action]:
        """Expert actions that earn the maximum reward for ``seed``."""
        ...


def check_tools(tools: Any, owner: str = "environment") -> None:
    """Raise ``TypeError`` naming ``owner`` unless ``tools`` is a sequence of OpenAI-style
    function schemas with unique names: ``{"type": "function", "function": {"name": str,
    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}``."""
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"{owner}: `tools` must be a sequence of tool schemas, got {tools!r}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        problem = _tool_problem(tool)
        if problem is None and tool["function"]["name"] in names:
            problem = "duplicate tool name"
        if problem:
            raise TypeError(f"{owner}: tools[{i}] {problem}: {tool!r}")
        names.append(tool["function"]["name"])


def _tool_problem(tool: Any) -> str | None:
    """What makes ``tool`` not an OpenAI-style function schema; None when it is one."""
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or tool.get("type") != "function":
        return 'is not {"type": "function", "function": {...}}'
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return "has no function.name"
    params = fn.get("parameters")
    if not isinstance(params, Mapping) or params.get("type") != "object":
        return 'has no function.parameters {"type": "object", ...}'
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(props, Mapping) or not all(isinstance(p, Mapping) for p in props.values()):
        return "has parameters.properties that do not map names to schemas"
    if isinstance(required, str) or not isinstance(required, Sequence):
        return "has parameters.required that is not a list"
    if any(r not in props for r in required):
        return "requires parameters that are not in parameters.properties"
    return None


def check_environment(env: Any, name: str) -> None:
    """Raise ``TypeError`` naming environment ``name`` unless ``env`` has the protocol's
    members: ``name``, valid ``tools``, and callable ``reset``/``step``/``demonstration``."""
    owner = f"environment {name!r} ({type(env).__module__}.{type(env).__qualname__})"
    if not isinstance(getattr(env, "name", None), str):
        raise TypeError(f"{owner} has no string `name`")
    if not hasattr(env, "tools"):
        raise TypeError(
            f"{owner} has no `tools`: the Environment protocol (tunix_tasks/envs/base.py) "
            "needs OpenAI-style function schemas, or `tools = ()` when it offers none"
        )
    check_tools(env.tools, owner)
    missing = [m for m in ("reset", "step", "demonstration") if not callable(getattr(env, m, None))]
    if missing:
        raise TypeError(f"{owner} lacks {', '.join(missing)} (see tunix_tasks/envs/base.py)")


def string_argument(call: ToolCall, tools: Sequence[dict]) -> str:
    """The string value of ``call``'s first parameter (per the schema of its tool in
    ``tools``); raises ``ValueError`` with an observation-ready reason otherwise."""
    schema = next((t for t in tools if t["function"]["name"] == call.name), None)
    if schema is None:
        available = ", ".join(t["function"]["name"] for t in tools) or "none"
        raise ValueError(f"unknown tool {call.name}; available: {available}")
    params = tool_argument_names(schema)
    if not params:
        raise ValueError(f"{call.name} takes no argument")
    param = params[0]
    value = call.arguments.get(param) if isinstance(call.arguments, Mapping) else None
    if value is None:
        raise ValueError(f"{call.name} needs the argument {param!r}")
    if not isinstance(value, str):
        raise ValueError(f"{call.name}: argument {param!r} must be a string")
    return value

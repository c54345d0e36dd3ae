import importlib.metadata

import pytest

import tunix_tasks.envs as envs
from tunix_tasks.envs import (
    Action,
    LatencyWrapper,
    StepResult,
    available_envs,
    function_tool,
    make_env,
    register_env,
)


class _EchoEnv:
    """Echoes the content, or the first call's text; also the plug-in of tests/unit/test_config.py."""

    name = "echo"
    tools = (function_tool("shout", "Echo the text in capitals.", {"text": "what to echo"}),)

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward

    async def reset(self, seed: int) -> str:
        return f"say {seed}"

    async def step(self, action: Action) -> StepResult:
        if action.tool_calls:
            return StepResult(str(action.tool_calls[0].arguments["text"]).upper(), 0.0, False)
        return StepResult(action.content, self.reward, True, {})

    def demonstration(self, seed: int) -> list[Action]:
        return [Action(content=str(seed))]


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    monkeypatch.setattr(envs, "_REGISTRY", envs._REGISTRY.copy())


def test_builtins_available():
    assert {"guess_number", "calculator", "python_exec"} <= set(available_envs())
    assert make_env("guess_number", max_n=32).max_n == 32


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError) as err:
        make_env("nope")
    msg = str(err.value)
    assert "nope" in msg and "guess_number" in msg and "calculator" in msg


def test_register_custom_env():
    register_env("echo_test")(_EchoEnv)
    assert "echo_test" in available_envs()
    env = make_env("echo_test", reward=0.5)
    assert isinstance(env, _EchoEnv) and env.reward == 0.5
    register_env("echo_test")(_EchoEnv)  # idempotent
    with pytest.raises(ValueError):
        register_env("echo_test")(lambda: _EchoEnv())


def test_entry_point_plugin(monkeypatch):
    ep = importlib.metadata.EntryPoint(
        name="echo_plugin",
        value="tests.unit.envs.test_registry:_EchoEnv",
        group=envs.ENTRY_POINT_GROUP,
    )

    def fake_entry_points(**kw):
        assert kw == {"group": envs.ENTRY_POINT_GROUP}
        return importlib.metadata.EntryPoints([ep])

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert "echo_plugin" in available_envs()
    env = make_env("echo_plugin", latency_s=0.01)
    assert isinstance(env, LatencyWrapper) and isinstance(env.env, _EchoEnv)
    assert env.name == "echo" and env.demonstration(3) == [Action(content="3")]
    assert env.tools == _EchoEnv.tools


class _OldEnv:
    """An environment of the old text protocol: no `tools`."""

    name = "old"

    async def reset(self, seed: int) -> str:
        return ""

    async def step(self, action: str) -> StepResult:
        return StepResult("", 0.0, True)

    def demonstration(self, seed: int) -> list[str]:
        return []


def test_make_env_checks_the_protocol():
    register_env("old_test")(_OldEnv)
    with pytest.raises(TypeError, match=r"environment 'old_test' \(.*_OldEnv\) has no `tools`"):
        make_env("old_test")

    def bad_tools(tools):
        env = _EchoEnv()
        env.tools = tools
        return env

    register_env("bad_tools_test")(bad_tools)
    for tools, why in [
        ({"type": "function"}, "must be a sequence"),
        (["calculate"], r"tools\[0\] is not"),
        ([{"type": "function", "function": {"name": "f"}}], "parameters"),
        ([{"type": "function", "function": {"parameters": {"type": "object"}}}], "name"),
        (_EchoEnv.tools * 2, "duplicate tool name"),
    ]:
        with pytest.raises(TypeError, match="environment 'bad_tools_test'") as err:
            make_env("bad_tools_test", tools=tools)
        assert err.match(why)
    assert make_env("bad_tools_test", tools=()).tools == ()

    class NoStep(_EchoEnv):
        step = None

    register_env("no_step_test")(NoStep)
    with pytest.raises(TypeError, match=r"'no_step_test'.* lacks step"):
        make_env("no_step_test")


def test_plugin_authors_import_from_the_package():
    """`tunix_tasks.envs` speaks messages: it re-exports them and no tokenizer marker."""
    from tunix_tasks import messages

    assert envs.Action is messages.Action and envs.ToolCall is messages.ToolCall
    assert not {"TOOL", "ANSWER", "ACTION_MARKERS"} & set(dir(envs))
    assert not {"TOOL", "ANSWER", "ACTION_MARKERS"} & set(dir(envs.base))

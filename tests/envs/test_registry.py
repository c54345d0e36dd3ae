import importlib.metadata

import pytest

import tunix_tasks.envs as envs
from tunix_tasks.envs import LatencyWrapper, StepResult, available_envs, make_env, register_env


class _EchoEnv:
    name = "echo"

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward

    async def reset(self, seed: int) -> str:
        return f"say {seed}"

    async def step(self, action: str) -> StepResult:
        return StepResult(action, self.reward, True, {})

    def demonstration(self, seed: int) -> list[str]:
        return [str(seed)]


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))


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
        name="echo_plugin", value="tests.envs.test_registry:_EchoEnv", group=envs.ENTRY_POINT_GROUP
    )

    def fake_entry_points(**kw):
        assert kw == {"group": envs.ENTRY_POINT_GROUP}
        return importlib.metadata.EntryPoints([ep])

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert "echo_plugin" in available_envs()
    env = make_env("echo_plugin", latency_s=0.01)
    assert isinstance(env, LatencyWrapper) and isinstance(env.env, _EchoEnv)
    assert env.name == "echo" and env.demonstration(3) == ["3"]


def test_every_action_marker_is_one_token_of_the_character_tokenizer():
    """The env protocol owns its markers; the tokenizer must encode each as one token."""
    from tunix_tasks.envs import ACTION_MARKERS
    from tunix_tasks.policy.tokenizer import Tokenizer

    tok = Tokenizer()
    for marker in ACTION_MARKERS:
        (token,) = tok.encode(marker)
        assert tok.is_special(token) and tok.decode([token]) == marker

import asyncio

import pytest

from tests.paths import REPO
from tests.unit.envs.conftest import call, demo_policy, play, random_baseline, rollout
from tunix_tasks.envs import Action, PythonExecEnv, ToolCall, make_env
from tunix_tasks.envs.python_exec import DEFAULT_LIMITS, prepare_source, program_of
from tunix_tasks.envs.sandbox import SandboxLimits, SandboxUnavailable, check_isolation


def _seed_with(template_word: str) -> tuple[int, str]:
    env = PythonExecEnv()
    for seed in range(100):
        task, target, _ = env._task_for(seed)
        if template_word in task:
            return seed, target
    raise AssertionError(template_word)


def _run(code: str) -> Action:
    return call("run_python", code=code)


def test_prepare_source_repl_semantics():
    assert "print(print(1))" not in prepare_source("print(1)")
    assert "_r = (3 + 4)" in prepare_source("3+4")
    assert prepare_source("x=1\nprint(x)") == "x=1\nprint(x)"


def test_program_of_tool_call_or_content():
    assert program_of(_run("print(1)")) == "print(1)"
    both = Action(content="print(2)", tool_calls=(ToolCall("run_python", {"code": "print(1)"}),))
    assert program_of(both) == "print(1)"  # a call wins over the content
    assert program_of(Action(content="print(2)")) == "print(2)"
    assert program_of(Action(content="```python\nx = 2\nprint(x)\n```\n")) == "x = 2\nprint(x)"
    assert program_of(Action(content="```\nprint(3)```")) == "print(3)"
    assert program_of(Action(content="see ```print(3)```")) == "see ```print(3)```"  # not fenced
    for bad, why in [
        (call("python", code="1"), "unknown tool python; available: run_python"),
        (call("run_python"), "'code'"),
        (call("run_python", code=["print(1)"]), "must be a string"),
    ]:
        with pytest.raises(ValueError, match=why):
            program_of(bad)


def test_hand_checked_episode():
    env = PythonExecEnv(max_turns=3)
    seed, target = _seed_with("sum of")
    task = asyncio.run(env.reset(seed))
    a, b = (int(w) for w in task.split() if w.isdigit())
    assert target == str(a + b)
    actions = [_run("print("), _run(f"print({a}-{b}-1)"), _run(f"{a}+{b}")]
    _, res = asyncio.run(play(env, seed, actions))
    assert res[0].observation[0].startswith("SyntaxError") and res[0].info["ran"] is False
    assert res[1].reward == 0.0 and res[1].observation == (str(a - b - 1),) and not res[1].done
    assert res[2].reward == 1.0 and res[2].done  # a bare expression prints its value


def test_content_path_with_a_fence():
    env = PythonExecEnv(max_turns=3)
    seed, target = _seed_with("sum of")
    task = asyncio.run(env.reset(seed))
    a, b = (int(w) for w in task.split() if w.isdigit())
    fenced = f"```python\nx = {a}\nprint(x + {b})\n```"
    _, res = asyncio.run(play(env, seed, [Action(content=fenced)]))
    assert res[0].info["ran"] and res[0].observation == target
    assert res[0].reward == 1.0 and res[0].done
    _, res = asyncio.run(play(env, seed, [Action(content=f"{a}+{b}")]))  # plain, unfenced
    assert res[0].reward == 1.0


def test_bad_tool_calls_do_not_run():
    env = PythonExecEnv(max_turns=2)
    seed, _ = _seed_with("sum of")
    _, res = asyncio.run(play(env, seed, [call("exec", code="1"), call("run_python", src="1")]))
    assert res[0].observation == ("error: unknown tool exec; available: run_python",)
    assert res[1].observation[0].startswith("error:") and "'code'" in res[1].observation[0]
    assert [r.info["ran"] for r in res] == [False, False]
    assert [r.done for r in res] == [False, True] and all(r.reward == 0.0 for r in res)


def test_one_program_runs_a_turn_and_each_call_is_answered():
    env = PythonExecEnv(max_turns=2)
    seed, target = _seed_with("sum of")
    task = asyncio.run(env.reset(seed))
    a, b = (int(w) for w in task.split() if w.isdigit())
    calls = (*_run(f"print({a}+{b})").tool_calls, *_run("print(1/0)").tool_calls)
    _, res = asyncio.run(play(env, seed, [Action(tool_calls=calls)]))
    assert res[0].observation == (
        target,
        "error: not run: only a turn's first call runs",
    )
    assert res[0].reward == 1.0 and res[0].info["ran"]


def test_errors_and_max_turns():
    env = PythonExecEnv(max_turns=2)
    seed, _ = _seed_with("*")
    actions = [_run("1//0"), _run("import socket; socket.socket()")]
    _, res = asyncio.run(play(env, seed, actions))
    assert res[0].observation == ("ZeroDivisionError: integer division or modulo by zero",)
    assert res[0].info["status"] == "error" and not res[0].done
    (denied,) = res[1].observation
    assert "PermissionError" in denied or "not allowed" in denied
    assert res[1].done and res[1].reward == 0.0


def test_determinism_and_demonstration():
    env = PythonExecEnv()
    assert [env._task_for(s) for s in range(50)] == [
        PythonExecEnv()._task_for(s) for s in range(50)
    ]

    async def all_demos() -> list[float]:
        envs = [PythonExecEnv() for _ in range(8)]
        return [
            r[0]
            for r in await asyncio.gather(
                *(rollout(e, demo_policy(e, s), s, 2) for s, e in enumerate(envs))
            )
        ]

    for s in range(200):
        (demo,) = env.demonstration(s)
        (demo_call,) = demo.tool_calls
        assert demo_call.name == "run_python" and len(demo_call.arguments["code"]) <= 16
        assert demo_call.arguments["code"] == env._task_for(s)[2]
    assert asyncio.run(all_demos()) == [1.0] * 8


def test_random_baseline_is_low():
    mean = random_baseline(lambda: make_env("python_exec"), range(200), max_turns=2)
    print(f"python_exec random-policy mean reward over 200 seeds: {mean:.3f}")
    assert mean < 0.05


def test_model_code_cannot_read_the_project():
    if check_isolation(DEFAULT_LIMITS) != "bwrap":
        pytest.skip("bubblewrap not usable here")
    env = PythonExecEnv()
    seed, _ = _seed_with("sum of")
    code = f"print(open({str(REPO / 'pyproject.toml')!r}).read())"
    _, res = asyncio.run(play(env, seed, [_run(code)]))
    assert res[0].observation[0].startswith("FileNotFoundError"), res[0].observation
    assert res[0].reward == 0.0


def test_sandbox_mode_from_env_kwargs():
    """``env.kwargs.sandbox`` picks the mode; no real isolation means no environment."""
    with pytest.raises(ValueError, match="sandbox mode"):
        make_env("python_exec", sandbox="off")
    bare = SandboxLimits(wall_s=3.0, cpu_s=1, bwrap="/nonexistent/bwrap", isolate_network=False)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        PythonExecEnv(limits=bare)
    env = make_env("python_exec", limits=bare, sandbox="unsafe-audit-only")
    assert env.limits.mode == "unsafe-audit-only"
    seed, target = _seed_with("sum of")
    task = asyncio.run(env.reset(seed))
    a, b = (int(w) for w in task.split() if w.isdigit())
    res = asyncio.run(env.step(Action(content=f"{a}+{b}")))
    assert res.reward == 1.0 and res.observation == target


def test_the_config_checks_the_kwargs_python_exec_takes():
    """`tunix_tasks.env_kwargs` (what the config checks, without importing the env) lists
    the constructor's kwargs a config can give (not `limits`, a Python object) and the
    sandbox's modes."""
    import inspect
    import typing

    from tunix_tasks.env_kwargs import PYTHON_EXEC_KWARGS, SANDBOX_MODES
    from tunix_tasks.envs.python_exec import PythonExecEnv
    from tunix_tasks.envs.sandbox import limits

    params = set(inspect.signature(PythonExecEnv).parameters) - {"limits"}
    assert params == set(PYTHON_EXEC_KWARGS)
    assert limits.MODES == SANDBOX_MODES == typing.get_args(limits.Mode)

"""verifiers (0.4.0, `verifiers.v1`) environments played against the endpoint by verifiers'
own rollout code: Env -> Agent -> its bundled `null` chat-loop program -> its interception
server -> `EvalClient` -> the episode's `base_url`. Run by the verifiers environment's
interpreter (`make venv-verifiers`: verifiers needs openai<3, the project's venv has 3.x):

    .venv-verifiers/bin/python verifiers_rollouts.py --episodes-url http://127.0.0.1:PORT \
        --model tiny-qwen3

Each rollout opens an episode (`POST /episodes`), is played at its `base_url`, and closes
it with verifiers' reward; one JSON line per rollout: {"env", "episode_id", "reward",
"ok", "errors", "tools", "messages", "close"}. Two environments: "single" (two questions,
scored by a reward function) and "tool" (one question and a calculator tool server).

This file is also the environment plugin verifiers imports by name (`taskset.id`: the one
`Taskset` in `__all__`) and the calculator's MCP server (verifiers starts it as
`python -m verifiers_rollouts` with VF_CONFIG set), so its folder goes on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import operator
import os
import sys
from pathlib import Path

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HERE = Path(__file__).resolve().parent
MODULE = Path(__file__).stem
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    raise ValueError("only integers, +, - and *")


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    """One python-function tool; the model sees it as `calc_evaluate`."""

    TOOL_PREFIX = "calc"

    @vf.tool
    def evaluate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression such as '17*23'."""
        try:
            return str(_arithmetic(ast.parse(expression, mode="eval").body))
        except (SyntaxError, ValueError) as e:
            return f"error: {e}"


class Row(vf.TaskData):
    answer: str = ""


class RowConfig(vf.TaskConfig):
    calculator: vf.ToolsetConfig | None = None  # {} gives every task the calculator


class RowTask(vf.Task[Row, vf.State, RowConfig]):
    @classmethod
    def toolsets(cls, config: RowConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.calculator)] if config.calculator is not None else []

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0


class RowsConfig(vf.TasksetConfig):
    mode: str = "single"
    task: RowConfig = RowConfig()


ROWS = {
    "single": [("What is 2+2? Answer with a number.", "4"), ("What is 3+3?", "6")],
    "tool": [("Use the calculator tool to compute 17*23.", "391")],
}


class Rows(vf.Taskset[RowTask, RowsConfig]):
    def load(self) -> list[RowTask]:
        return [
            RowTask(
                Row(id=f"{self.config.mode}-{i}", prompt=q, answer=a, system_prompt="Be brief."),
                self.config.task,
            )
            for i, (q, a) in enumerate(ROWS[self.config.mode])
        ]


__all__ = ["Rows"]


def use_this_interpreter_for_the_chat_program() -> None:
    """verifiers prepares its chat program with `uv sync --script` (uv and PyPI); this
    interpreter already has the program's packages (openai, mcp, httpx), so register it as
    the script's environment instead. Private to verifiers 0.4.0 (pinned in the lock)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


def env_config(mode: str, timeout_s: float) -> vf.EnvConfig:
    return vf.resolve_env_config(
        {
            "taskset": {
                "id": MODULE,
                "mode": mode,
                "task": {"calculator": {}} if mode == "tool" else {},
            },
            "agent": {
                "harness": {"id": "null"},  # the chat loop; the default (bash) adds a host shell
                "runtime": {"type": "subprocess"},  # the default is a remote Prime sandbox
                "timeout": {"setup": timeout_s, "rollout": timeout_s, "scoring": timeout_s},
                "max_turns": 4,
            },
        }
    )


async def run(url: str, model: str, timeout_s: float) -> int:
    os.environ["VF_ROLLOUTS_KEY"] = "unused"
    failures = 0
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        for mode in ROWS:
            env = vf.load_environment(env_config(mode, timeout_s))
            async with env.serving():
                for task in env.taskset:
                    opened = (await http.post(f"{url}/episodes", json={})).json()
                    client = vf.EvalClientConfig(
                        base_url=opened["base_url"], api_key_var="VF_ROLLOUTS_KEY"
                    )
                    ctx = vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig())
                    episode = await env.run_episode(task, ctx)
                    [trace] = episode.traces
                    close = await http.post(
                        f"{url}/episodes/{opened['episode_id']}/close",
                        json={"reward": float(trace.reward), "truncated": bool(trace.is_truncated)},
                    )
                    line = {
                        "env": mode,
                        "episode_id": opened["episode_id"],
                        "reward": trace.reward,
                        "ok": trace.ok,
                        "errors": [f"{e.type}: {e.message}"[:500] for e in trace.errors],
                        "tools": [t.name for t in trace.tools],
                        "messages": [message_to_wire(m) for m in trace.messages],
                        "close": close.json(),
                    }
                    print(json.dumps(line), flush=True)
                    failures += not trace.ok
    return 1 if failures else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))  # the plugin, here and in verifiers' subprocesses
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )
    use_this_interpreter_for_the_chat_program()
    sys.exit(asyncio.run(run(args.episodes_url.rstrip("/"), args.model, args.timeout)))


if __name__ == "__main__":
    if os.environ.get("VF_CONFIG") is not None:
        CalcToolset.run()  # started by verifiers as the calculator's MCP server
    else:
        main()

"""A calculator agent written with the plain OpenAI client: it knows nothing of tunix-tasks.

`run(client, task)` is what `actor.kind: agent` calls, once per episode, with an
`openai.AsyncOpenAI` whose base_url is that episode's, and the task the run's environment
set (docs/agents.md): the question, the tools to offer, and `grade(answer)`, the
environment's reward for a final answer. The agent runs the `calculate` tool itself.
Pointed at any OpenAI-compatible server (and a task dict of your own), it runs the same.
"""

from __future__ import annotations

import ast
import json
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def calculate(arguments: str) -> str:
    """The tool: integer + - * // of a JSON {"expression": ...}; errors as text."""
    try:
        expression = json.loads(arguments)["expression"]

        def ev(node: ast.AST) -> int:
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](ev(node.left), ev(node.right))
            raise ValueError("only integers and + - * //")

        return str(ev(ast.parse(str(expression)[:64], mode="eval").body))
    except Exception as e:  # the model sees the error and may try again
        return f"error: {e}"


async def run(client, task) -> float:
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=task["tools"]
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return await task["grade"](message.content or "")
        for call in message.tool_calls:
            result = calculate(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0

"""A one-shot question answerer written with the plain OpenAI client (no tunix-tasks import).

`run(client, task)` asks the model the task's question once and has the answer graded:
what an evaluation harness or a simple chat app does. `actor.kind: agent` calls it once
per episode with a client whose base_url is that episode's (docs/agents.md); the config
beside it trains SmolLM2-135M-Instruct through it on reasoning-gym's chain_sum.
"""

from __future__ import annotations


async def run(client, task) -> float:
    response = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    )
    return await task["grade"](response.choices[0].message.content or "")

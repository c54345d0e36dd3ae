"""A question answerer written with the OpenAI Agents SDK (`pip install openai-agents`; no
tunix-tasks import).

`run(client, task)` runs an SDK `Agent` on the task's question, with the client it is
given as the agent's model (`OpenAIChatCompletionsModel`), and has the agent's final
output graded. `actor.kind: agent` calls it once per episode with a client whose base_url
is that episode's (docs/agents.md), so every turn the SDK samples is recorded token for
token; held-out evaluation (`tunix-tasks eval`) runs it the same way, greedily. Train it
on SmolLM2-135M-Instruct and reasoning-gym's chain_sum with the config beside it:

    PYTHONPATH=examples/openai_agent tunix-tasks agents --program sdk_agent:run \
        --config examples/openai_agent/smollm2_chain_sum.yaml --run-name smollm2_sdk_agent

(held-out 0.281 -> 0.418 in 40 steps on 2 cores, docs/agents.md)
"""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

set_tracing_disabled(True)  # traces stay here: no export to OpenAI's servers


async def run(client, task) -> float:
    agent = Agent(
        name="solver",
        instructions="Solve the arithmetic problem.",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    result = await Runner.run(agent, task["prompt"], max_turns=1)
    return await task["grade"](str(result.final_output))

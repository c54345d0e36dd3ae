"""The OpenAI Agents SDK (`openai-agents`) drives the endpoint unchanged: an `Agent` with a
function tool, run by `Runner.run` through `OpenAIChatCompletionsModel`; the episode holds
exactly the sampled ids and log-probs equal to the learner's recomputation (staleness 0)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from tests.unit.actor.endpoint.harness import HTTP_TIMEOUT_S, endpoint
from tests.unit.actor.endpoint.test_server import learner_logprobs, open_episode, policy_spans


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression."""
    return "68"


def test_agents_sdk_agent_with_a_function_tool():
    set_tracing_disabled(True)  # no export of traces to OpenAI

    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base_url = await open_episode(http, ep.url, seed=5)
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
            agent = Agent(
                name="calculator",
                instructions="Use calculate, then answer with the number.",
                tools=[calculate],
                model=OpenAIChatCompletionsModel(model="tiny-qwen3", openai_client=client),
            )
            result = await Runner.run(agent, "What is 23+45?", max_turns=4)
            assert isinstance(result.final_output, str)
            r = await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 0.25})
            assert r.status_code == 200, r.text
            return ep

    ep = asyncio.run(run())
    [[episode]] = ep.groups
    assert episode.reward == 0.25 and episode.num_turns == len(ep.policy.sampled) >= 1
    text = ep.chat.tokenizer.decode(episode.tokens.tolist())
    assert '"name": "calculate"' in text and "Use calculate" in text  # the SDK's tool, rendered
    spans = policy_spans(episode)
    assert len(spans) == len(ep.policy.sampled)
    recomputed = learner_logprobs(ep.sampler.model, episode)
    for (start, end), (tokens, logprobs) in zip(spans, ep.policy.sampled, strict=True):
        assert episode.tokens[start:end].tolist() == tokens
        np.testing.assert_array_equal(episode.behavior_logprobs[start:end], logprobs)
        np.testing.assert_allclose(recomputed[start - 1 : end - 1], logprobs, atol=1e-4)

"""Token-in / token-out episodes of a chat model (the tiny Qwen3, Llama 3 and Mistral
checkpoints, Mistral's with its template in each of its four call forms).

A multi-turn tool-calling calculator episode: the first turn is a demonstrated tool call
in the model's own format (`<tool_call>{json}</tool_call>`, Llama JSON, `[TOOL_CALLS]`), the next turns
are sampled by the real KV-cache sampler. Every sampled id lands in the episode exactly as
sampled, at the loss-masked positions, and its behaviour log-prob equals the learner's
recomputation over the whole episode (staleness 0, fp32, atol 1e-4).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import numpy as np
import pytest
from flax import nnx

from tests.mistral_forms import mistral_checkpoint
from tests.paths import HF_FIXTURES
from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.config import ModelConfig
from tunix_tasks.envs import Action, StepResult, ToolCall, make_env
from tunix_tasks.envs.calculator import safe_eval
from tunix_tasks.policy.build import build_sampler
from tunix_tasks.policy.distribution import token_logprobs

FIXTURES = HF_FIXTURES
TEMPERATURE = 0.7


class _DemoThenSample:
    """Turn 1: the env's demonstrated tool call; later turns: the sampler (recorded)."""

    def __init__(self, demo, chat, sampler_policy: BatchingPolicy) -> None:
        self.scripted = ScriptedPolicy(demo[:1], chat)
        self.sampler_policy = sampler_policy
        self.turn = 0
        self.sampled: list[tuple[list[int], list[float]]] = []

    async def __call__(self, context: Sequence[int], **conversation):
        self.turn += 1
        if self.turn == 1:
            return await self.scripted(context, **conversation)
        tokens, logprobs, version = await self.sampler_policy(context)
        self.sampled.append((tokens, logprobs))
        return tokens, logprobs, version


@pytest.mark.parametrize(
    "name",
    [
        "tiny-qwen3",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-mistral-v7",
        "tiny-mistral-v11",
        "tiny-mistral-v13",
    ],
)
def test_sampled_ids_and_logprobs_survive_the_episode(name, tmp_path):
    # -v7 / -v11 / -v13: the template writes calls in Mistral's other forms (mistral_forms.py)
    _, _, form = name.partition("-v")
    ckpt = mistral_checkpoint(tmp_path / name, f"v{form}") if form else FIXTURES / name
    chat, sampler = build_sampler(ModelConfig(checkpoint=str(ckpt), max_seq_len=1024), seed=0)
    env = make_env("calculator", max_turns=3)
    # room for the demonstrated call (Mistral's, with its id, is 55 ids in this vocabulary)
    limits = EpisodeLimits(
        max_turns=3, max_episode_tokens=1024, max_new_tokens=96, step_timeout_s=10.0
    )

    async def play():
        inner = BatchingPolicy(sampler, max_new_tokens=24, temperature=TEMPERATURE, seed=3)
        async with inner:
            policy = _DemoThenSample(env.demonstration(5), chat, inner)
            episode = await play_episode(env, policy, seed=5, limits=limits, chat=chat)
        return episode, policy

    episode, policy = asyncio.run(play())
    assert episode.num_turns == 3 and len(policy.sampled) == 2  # calculator never answered
    # The tool's result came back as the template's tool message.
    expression = env.demonstration(5)[0].tool_calls[0].arguments["expression"]
    text = chat.tokenizer.decode(episode.tokens.tolist())
    tool_turn = {
        "tiny-qwen3": "<tool_response>\n{}\n</tool_response>",
        "tiny-llama3": 'ipython<|end_header_id|>\n\n"{}"',
        # named as the demonstrated call was (its turn, its index)
        "tiny-mistral": '[TOOL_RESULTS] {{"content": {}, "call_id": "t0001c000"}}[/TOOL_RESULTS]',
        "tiny-mistral-v7": "[TOOL_RESULTS]t0001c000[TOOL_CONTENT]{}[/TOOL_RESULTS]",
        "tiny-mistral-v11": "[TOOL_RESULTS]t0001c000[TOOL_CONTENT]{}[/TOOL_RESULTS]",
        "tiny-mistral-v13": "[TOOL_RESULTS]{}[/TOOL_RESULTS]",
    }[name]
    assert tool_turn.format(safe_eval(expression)) in text
    args = json.dumps({"expression": expression})
    demonstrated = {  # the demonstrated call as the template wrote it
        "v7": f'[TOOL_CALLS][{{"name": "calculate", "arguments": {args}, "id": "t0001c000"}}]</s>',
        "v11": f"[TOOL_CALLS]calculate[CALL_ID]t0001c000[ARGS]{args}</s>",
        "v13": f"[TOOL_CALLS]calculate[ARGS]{args}</s>",
    }
    assert form == "" or demonstrated[f"v{form}"] in text

    # The sampled turns, in order, are exactly the ids at the masked positions after turn 1.
    mask = episode.loss_mask.astype(bool)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    spans = list(zip(runs[::2], runs[1::2], strict=True))
    assert len(spans) == 3
    for (start, end), (tokens, logprobs) in zip(spans[1:], policy.sampled, strict=True):
        assert episode.tokens[start:end].tolist() == tokens
        np.testing.assert_array_equal(episode.behavior_logprobs[start:end], logprobs)

    # The learner's recomputation at staleness 0 (same weights, same temperature).
    model = sampler.model
    tokens = episode.tokens[None]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits = nnx.jit(lambda m, t, p, s: m(t, p, s))(model, tokens, positions, np.ones_like(tokens))
    recomputed = np.asarray(token_logprobs(logits, tokens, TEMPERATURE))[0]
    for start, end in spans[1:]:
        np.testing.assert_allclose(
            recomputed[start - 1 : end - 1], episode.behavior_logprobs[start:end], atol=1e-4
        )


def test_a_turn_the_template_cannot_continue_ends_the_episode_not_the_actor(tmp_path, caplog):
    """Mistral's v7 and later templates refuse an assistant turn with neither content nor
    calls: a policy that writes only its stop token leaves a conversation whose next prompt
    does not render. The episode ends there (truncated, trained on as it stands) and says
    why once; the next episode plays too."""
    ckpt = mistral_checkpoint(tmp_path / "ckpt", refuse_empty=True)
    chat, _ = build_sampler(ModelConfig(checkpoint=str(ckpt), max_seq_len=256), seed=0)
    stop = chat.stop_ids[0]

    async def silent(context: Sequence[int], **conversation):
        return [stop], [-0.5], 7

    limits = EpisodeLimits(max_turns=3, max_episode_tokens=256, max_new_tokens=8)

    async def play():
        env = make_env("calculator", max_turns=3)
        return [await play_episode(env, silent, seed=s, limits=limits, chat=chat) for s in (1, 2)]

    with caplog.at_level("WARNING"):
        episodes = asyncio.run(play())
    for episode in episodes:
        assert (episode.status, episode.num_turns, episode.policy_version) == ("truncated", 1, 7)
        assert episode.loss_mask.sum() == 1  # the stop token, its log-prob kept
    warnings = [r.getMessage() for r in caplog.records if "does not render" in r.getMessage()]
    assert len(warnings) == 1 and "Assistant message must have content" in warnings[0]


class _Answers:
    """The calculator, answering a turn's calls with `results(calls)` when given."""

    def __init__(self, results=None) -> None:
        self.env, self.results = make_env("calculator", max_turns=3), results
        self.name, self.tools = self.env.name, self.env.tools

    async def reset(self, seed: int) -> str:
        return await self.env.reset(seed)

    async def step(self, action: Action) -> StepResult:
        result = await self.env.step(action)
        if self.results is None or not action.tool_calls:
            return result
        return StepResult(self.results(action.tool_calls), result.reward, result.done)

    def demonstration(self, seed: int) -> list[Action]:
        return self.env.demonstration(seed)


def _tool_turns_then_the_answer(env: _Answers) -> list[Action]:
    """Two calls, one call, the answer."""
    question, answer = env.env.question_for(4)
    calls = (
        ToolCall("calculate", {"expression": question}),
        ToolCall("calculate", {"expression": "9*9"}),
    )
    again = ToolCall("calculate", {"expression": "2+2"})
    return [Action(tool_calls=calls), Action(tool_calls=(again,)), Action(content=str(answer))]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-mistral", "tiny-mistral-v11"])
def test_each_tool_call_of_a_turn_gets_its_own_result_message(name, tmp_path):
    """A turn of two calls is answered with two tool messages, each naming its call, and
    the episode's ids are the template's rendering of that conversation and the tool turn
    after it."""
    _, _, form = name.partition("-v")
    ckpt = mistral_checkpoint(tmp_path / name, f"v{form}") if form else FIXTURES / name
    chat, _ = build_sampler(ModelConfig(checkpoint=str(ckpt), max_seq_len=1024), seed=0)
    env = _Answers()
    actions = _tool_turns_then_the_answer(env)
    # room for Mistral's two calls with their ids (about 120 ids in this vocabulary)
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=1024, max_new_tokens=256)
    scripted, asked = ScriptedPolicy(actions, chat), []

    async def policy(context, **conversation):  # the scripted turns; what each was shown
        asked.append(list(conversation["messages"]))
        return await scripted(context, **conversation)

    episode = asyncio.run(play_episode(env, policy, seed=4, limits=limits, chat=chat))
    assert (episode.status, episode.reward, episode.num_turns) == ("ok", 1.0, 3)
    question = actions[0].tool_calls[0].arguments["expression"]
    two, one = actions[0].with_call_ids(1), actions[1].with_call_ids(2)
    history = [
        {"role": "user", "content": f"{question}=?"},
        two.message(),
        *two.replies((str(safe_eval(question)), "81")),
        one.message(),
        *one.replies(("4",)),
    ]
    ids = [m.get("tool_call_id") for m in history if m["role"] == "tool"]
    assert ids == ["t0001c000", "t0001c001", "t0002c000"]
    assert asked[-1] == history  # the conversation the answer turn was asked after
    prompt = chat.render(history, env.tools, add_generation_prompt=True)  # before the answer
    rendered = chat.tokenizer.encode(prompt)
    assert episode.tokens.tolist()[: len(rendered)] == rendered


@pytest.mark.parametrize(
    "results", [lambda calls: ("5",), lambda calls: ("5", "81", "1")], ids=["fewer", "more"]
)
def test_tool_results_that_do_not_match_the_calls_end_the_episode_as_env_error(
    results, caplog
) -> None:
    chat, _ = build_sampler(
        ModelConfig(checkpoint=str(FIXTURES / "tiny-qwen3"), max_seq_len=512), seed=0
    )
    env = _Answers(results)
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=512, max_new_tokens=96)
    policy = ScriptedPolicy(_tool_turns_then_the_answer(env), chat)
    with caplog.at_level("WARNING"):
        episode = asyncio.run(play_episode(env, policy, seed=4, limits=limits, chat=chat))
    assert (episode.status, episode.num_turns) == ("env_error", 1)
    assert any(
        "tool results answer a turn of 2 tool calls" in r.getMessage() for r in caplog.records
    )

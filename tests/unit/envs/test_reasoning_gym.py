"""The `reasoning_gym` environment: reasoning-gym's generators and scorers behind the protocol."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.envs.conftest import call, demo_policy, play, rollout
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.envs import Action, ReasoningGymEnv, available_envs, check_environment, make_env
from tunix_tasks.envs.reasoning_gym import ANSWER_INSTRUCTION
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer

REPO = Path(__file__).resolve().parents[3]
SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 3}


def env(task: str = "chain_sum", **kwargs) -> ReasoningGymEnv:
    return make_env("reasoning_gym", task=task, **kwargs)


def test_registered_through_the_entry_point_and_checked():
    assert "reasoning_gym" in available_envs()
    e = env(config=SMALL)
    check_environment(e, "reasoning_gym")
    assert e.name == "reasoning_gym" and e.tools == () and e.max_turns == 1


def test_questions_are_deterministic_per_seed_and_differ_across_seeds():
    first = [asyncio.run(env(config=SMALL).reset(s)) for s in range(20)]
    again = [asyncio.run(env(config=SMALL).reset(s)) for s in range(20)]
    assert first == again
    assert len(set(first)) >= 15  # 2-3 terms of 1-3 digits: collisions are rare
    dataset, item = env(config=SMALL).item(7)
    assert dataset.seed == 7 and len(dataset) == 1  # the env seed is the dataset's seed
    assert first[7] == f"{item['question'].rstrip()}\n\n{ANSWER_INSTRUCTION}"
    bare = asyncio.run(env(config=SMALL, instruction="").reset(7))
    assert bare == item["question"].rstrip()


def test_config_reaches_the_generator():
    _, item = env(config={"min_terms": 4, "max_terms": 4, "min_digits": 2, "max_digits": 2}).item(3)
    assert item["metadata"]["num_terms"] == 4 and item["metadata"]["num_digits"] == 2


@pytest.mark.parametrize("task", ["chain_sum", "products", "leg_counting", "word_sorting"])
def test_reference_answer_scores_one_and_a_wrong_one_less(task):
    e = env(task)
    for seed in range(3):
        (answer,) = e.demonstration(seed)
        _, res = asyncio.run(play(e, seed, [answer]))
        assert (res[0].reward, res[0].done, res[0].observation) == (1.0, True, "correct")
        assert res[0].info == {"turns": 1, "kind": "answer", "used_tool": False}
        _, res = asyncio.run(play(e, seed, [Action(content=answer.content + "0 nope")]))
        assert 0.0 <= res[0].reward < 1.0 and res[0].done and res[0].observation.startswith("wrong")


def test_answer_tags_win_over_the_rest_of_the_content():
    e = env(config=SMALL)
    (answer,) = e.demonstration(5)
    thought = (
        f"<think>maybe 12</think> so <answer>9999</answer> no: <answer> {answer.content} </answer>"
    )
    _, res = asyncio.run(play(e, 5, [Action(content=thought)]))
    assert res[0].reward == 1.0
    _, res = asyncio.run(play(e, 5, [Action(content=f"the answer is {answer.content}.")]))
    assert res[0].reward < 1.0  # untagged: the whole content is the answer


def test_last_number_answers_score_the_number_a_sentence_ends_on():
    e = env(config=SMALL, answer_format="last_number")
    (answer,) = e.demonstration(5)
    for content in (
        f"So the total is {answer.content}.",
        f"1 + 2 = 3, then <answer>{answer.content}</answer> (checked: 12)",
        answer.content,
    ):
        _, res = asyncio.run(play(e, 5, [Action(content=content)]))
        assert res[0].reward == 1.0, content
    _, res = asyncio.run(play(e, 5, [Action(content=f"{answer.content} or 12345678")]))
    assert res[0].reward < 1.0  # the last number is the answer
    _, res = asyncio.run(play(e, 5, [Action(content="no idea")]))
    assert res[0].reward < 1.0


def test_a_scorer_that_raises_gives_zero():
    e = env("prime_factorization")  # its scorer parses the answer as integers
    _, res = asyncio.run(play(e, 0, [Action(content="no idea")]))
    assert res[0].reward == 0.0 and res[0].done and "score_error" in res[0].info


def test_a_tool_call_without_the_tool_ends_the_single_turn_with_nothing():
    _, res = asyncio.run(play(env(config=SMALL), 0, [call("calculate", expression="1+1")]))
    assert res[0].observation == ("error: unknown tool calculate; available: none",)
    assert (res[0].reward, res[0].done) == (0.0, True)


def test_calculator_variant_computes_then_answers():
    e = env("products", tools="calculator", max_turns=3)
    assert [t["function"]["name"] for t in e.tools] == ["calculate"] and e.max_turns == 3
    _, item = e.item(4)
    expression, answer = item["metadata"]["expression"], item["answer"]
    actions = [call("calculate", expression=expression), Action(content=answer)]
    _, res = asyncio.run(play(e, 4, actions))
    assert res[0].observation == (answer,) and not res[0].done and res[0].reward == 0.0
    assert (res[1].reward, res[1].done) == (1.0, True)
    assert res[1].info == {"turns": 2, "kind": "answer", "used_tool": True}
    assert e.demonstration(4) == [call("calculate", expression=expression), Action(content=answer)]
    # Tool errors are observations; the episode ends at max_turns without an answer.
    bad = [call("calculate", expression="2**8"), call("calc", expression="1"), call("calculate")]
    _, res = asyncio.run(play(e, 4, bad))
    assert all(r.observation[0].startswith("error:") and r.reward == 0.0 for r in res)
    assert [r.done for r in res] == [False, False, True]


def test_calculator_demonstrations_earn_one_including_basic_arithmetic_division():
    async def one(task: str, seed: int) -> tuple[float, list[Action]]:
        e = env(task, tools="calculator")
        actions = e.demonstration(seed)
        return (await rollout(e, demo_policy(e, seed), seed, e.max_turns))[0], actions

    for task in ("basic_arithmetic", "chain_sum", "products"):
        results = [asyncio.run(one(task, s)) for s in range(12)]
        assert all(reward == 1.0 for reward, _ in results), task
        assert sum(len(actions) == 2 for _, actions in results) >= 8, task  # mostly via the tool
    divisions = [
        a[0].tool_calls[0].arguments["expression"]
        for _, a in (asyncio.run(one("basic_arithmetic", s)) for s in range(40))
        if a[0].tool_calls
    ]
    assert any("//" in x for x in divisions)  # `/` is the generator's floor division


def test_errors_name_what_is_wrong():
    with pytest.raises(
        ValueError, match=r"unknown reasoning_gym task 'chain_summ' \(did you mean chain_sum"
    ):
        env("chain_summ")
    with pytest.raises(ValueError, match=r"valid: .*basic_arithmetic.*products"):
        env("no_such_task")
    with pytest.raises(
        ValueError, match="unknown config key 'min_term'; valid: min_terms, max_terms"
    ):
        env(config={"min_term": 2})
    with pytest.raises(ValueError, match="config key 'seed' is set by the environment"):
        env(config={"seed": 3})
    with pytest.raises(
        ValueError, match=r"chain_sum.*invalid config.*max_terms must be >= min_terms"
    ):
        env(config={"min_terms": 5, "max_terms": 2})
    with pytest.raises(ValueError, match=r"does not fit task 'leg_counting'.*chain_sum, products"):
        env("leg_counting", tools="calculator")
    with pytest.raises(ValueError, match="tools must be 'calculator'"):
        env(tools="python")
    with pytest.raises(ValueError, match="unknown answer_format 'number'; valid: tag, last_number"):
        env(answer_format="number")
    with pytest.raises(ValueError, match=r"no reference answer.*warm_start_steps: 0"):
        env("graph_color").demonstration(0)


def test_an_episode_through_the_real_rollout_with_the_char_chat():
    chat = CharChat(CharTokenizer())
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=512, max_new_tokens=32)

    async def episode(e: ReasoningGymEnv, seed: int):
        policy = ScriptedPolicy(e.demonstration(seed), chat)
        return await play_episode(e, policy, seed=seed, limits=limits, chat=chat)

    plain = asyncio.run(episode(env(config=SMALL), 11))
    assert (plain.reward, plain.num_turns, plain.status) == (1.0, 1, "ok")
    tool = asyncio.run(episode(env("chain_sum", config=SMALL, tools="calculator"), 11))
    assert (tool.reward, tool.num_turns, tool.status) == (1.0, 2, "ok")
    assert plain.env == tool.env == "reasoning_gym" and plain.seed == 11


def test_config_validation_accepts_it_without_importing_reasoning_gym():
    code = (
        "import sys\n"
        "from tunix_tasks.config import load_config\n"
        "import tunix_tasks.envs\n"
        "cfg = load_config(None, ['env.name=reasoning_gym', 'env.kwargs.task=products',\n"
        "                         'env.kwargs.tools=calculator'])\n"
        "assert cfg.env.kwargs == {'task': 'products', 'tools': 'calculator'}, cfg.env.kwargs\n"
        "print(sorted(m for m in ('reasoning_gym', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_disjoint_env_seeds_stay_disjoint_dataset_seeds():
    # The env seeds its dataset with the env seed itself, so the actors', demonstrations'
    # and held-out evaluation's disjoint seed ranges (tests/unit/actor/test_seed_ranges.py)
    # are disjoint dataset seeds: distinct random streams.
    from tunix_tasks.actor.demonstrations import DEMO_SEED_BASE
    from tunix_tasks.actor.runtime import HELD_OUT_SEED_BASE, episode_seed

    e = env(config=SMALL)
    seeds = [episode_seed(0, "actor-0/inc", 0), HELD_OUT_SEED_BASE, DEMO_SEED_BASE + 5]
    assert [e.item(s)[0].seed for s in seeds] == seeds

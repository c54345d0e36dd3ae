"""The `dataset` environment: a task from a JSONL/Parquet file, its split, rewards and tool."""

import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.envs.conftest import call, demo_policy, play, rollout
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.envs import (
    Action,
    DatasetEnv,
    available_envs,
    check_environment,
    dataset_files,
    make_env,
)
from tunix_tasks.envs.answers import ANSWER_INSTRUCTION, last_number, numeric_match
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer
from tunix_tasks.seeds import DEMO_SEED_BASE, HELD_OUT_SEED_BASE
from tunix_tasks.storage.store import open_store

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "dataset_task"


def half_credit(answer: str, reference: str, row: Mapping[str, Any]) -> float:
    """A custom reward (imported by path in the tests): 1 for the answer, 0.5 for its tag."""
    if answer == reference:
        return 1.0
    return 0.5 if answer == row["tag"] else 0.0


def not_a_reward(answer: str) -> float:
    return 0.0


def problems(n: int = 40) -> list[dict]:
    return [
        {
            "q": f"What is {i} + {i}?",
            "a": str(2 * i),
            "expr": f"{i}+{i}",
            "tag": f"t{i}",
            "word": "none",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def jsonl(tmp_path) -> str:
    return write_jsonl(tmp_path / "p.jsonl", problems())


@pytest.fixture
def held(tmp_path) -> str:
    """A held-out file: with it, training seed i plays line i of `jsonl`."""
    return write_jsonl(tmp_path / "held.jsonl", problems(45)[40:])


def env(path: str, **kwargs) -> DatasetEnv:
    return make_env("dataset", path=path, **{"prompt_field": "q", "answer_field": "a", **kwargs})


def prompts(e: DatasetEnv, seeds) -> list[str]:
    return [asyncio.run(e.reset(s)) for s in seeds]


def test_registered_and_checked(jsonl):
    assert "dataset" in available_envs()
    e = env(jsonl)
    check_environment(e, "dataset")
    assert e.name == "dataset" and e.tools == () and e.max_turns == 1


def test_jsonl_and_parquet_read_alike(tmp_path, jsonl):
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(problems()), parquet)
    seeds = [0, 7, HELD_OUT_SEED_BASE + 3, DEMO_SEED_BASE + 1]
    assert prompts(env(jsonl), seeds) == prompts(env(str(parquet)), seeds)
    assert prompts(env(f"file://{jsonl}"), seeds) == prompts(env(jsonl), seeds)


@pytest.mark.gcs
def test_reads_gs_through_the_store(gcs_server, jsonl):
    uri = gcs_server.new_bucket_uri("data")
    open_store(uri).write_bytes("p.jsonl", Path(jsonl).read_bytes())
    e = env(f"{uri}/p.jsonl")
    assert prompts(e, range(5)) == prompts(env(jsonl), range(5))
    with pytest.raises(ValueError, match="no such object"):
        env(f"{uri}/missing.jsonl")


def test_seeds_map_to_rows_deterministically_and_splits_are_disjoint(jsonl):
    e = env(jsonl)
    n_train, n_held = len(e.train), len(e.held_out)
    assert n_train + n_held == 40 and n_held >= 1
    assert {it.prompt for it in e.train}.isdisjoint(it.prompt for it in e.held_out)
    index = {f"What is {i} + {i}?": i for i in range(40)}  # prompt -> row index
    assert [index[it.prompt] for it in e.train] == sorted(index[it.prompt] for it in e.train)
    assert e.item(5) == e.item(5 + n_train) == e.train[5]  # training: seed % n_train
    assert e.item(DEMO_SEED_BASE) == e.train[DEMO_SEED_BASE % n_train]  # demonstrations too
    assert e.item(HELD_OUT_SEED_BASE + 1) == e.held_out[1 % n_held]
    first = prompts(e, [3, HELD_OUT_SEED_BASE])
    assert first == prompts(env(jsonl), [3, HELD_OUT_SEED_BASE])
    assert first[0] == f"{e.train[3].prompt}\n\n{ANSWER_INSTRUCTION}"
    # The hash split keeps its rows when rows are appended.
    bigger = env(write_jsonl(Path(jsonl).with_name("big.jsonl"), problems(80)))
    assert {it.prompt for it in e.held_out} <= {it.prompt for it in bigger.held_out}


def test_eval_path_is_the_held_out_split(jsonl, held):
    e = env(jsonl, eval_path=held)
    assert len(e.train) == 40 and e.held_out[0].prompt == "What is 40 + 40?"
    bare = env(jsonl, eval_path=held, instruction="", preamble="Add.")
    assert asyncio.run(bare.reset(HELD_OUT_SEED_BASE)) == "Add.\n\nWhat is 40 + 40?"


def test_exact_reward_and_the_answer_tag(jsonl, held):
    e = env(jsonl, eval_path=held)
    (answer,) = e.demonstration(4)
    assert answer.content == "8"
    _, res = asyncio.run(play(e, 4, [answer]))
    assert (res[0].reward, res[0].done, res[0].observation) == (1.0, True, "correct")
    assert res[0].info == {"turns": 1, "kind": "answer", "used_tool": False}
    tagged = Action(content="<think>4+4</think> <answer>9</answer> no: <answer> 8 </answer>")
    assert asyncio.run(play(e, 4, [tagged]))[1][0].reward == 1.0
    assert asyncio.run(play(e, 4, [Action(content="it is 8")]))[1][0].reward == 0.0
    whole = env(jsonl, eval_path=held, answer_format="content")
    assert asyncio.run(whole.reset(4)) == "What is 4 + 4?"  # no answer-format line
    assert asyncio.run(play(whole, 4, [tagged]))[1][0].reward == 0.0


def test_numeric_reward_with_tolerance(tmp_path):
    rows = [{"q": "Price?", "a": "Cost: 3 * 4.1 = 12.3\n#### 1,234.5"}]
    path = write_jsonl(tmp_path / "n.jsonl", rows * 20)
    for content, reward in [("$1,234.50", 1.0), ("about 1234.6", 0.0), ("none", 0.0)]:
        _, res = asyncio.run(
            play(env(path, reward="numeric", eval_fraction=0.5), 0, [Action(content=content)])
        )
        assert res[0].reward == reward, content
    loose = env(path, reward="numeric", tolerance=0.2, eval_fraction=0.5)
    assert asyncio.run(play(loose, 0, [Action(content="1234.6")]))[1][0].reward == 1.0
    assert last_number("2024-05 and -7.") == -7.0 and numeric_match("x", "1") == 0.0


def test_contains_and_imported_rewards(jsonl, held):
    e = env(jsonl, eval_path=held, reward="contains", answer_format="content")
    assert asyncio.run(play(e, 4, [Action(content="It is 8!")]))[1][0].reward == 1.0
    custom = env(jsonl, eval_path=held, reward=f"{__name__}:half_credit")
    _, res = asyncio.run(play(custom, 4, [Action(content="t4")]))
    assert (res[0].reward, res[0].observation) == (0.5, "wrong (score 0.50)")


def test_calculator_variant_computes_then_answers(jsonl, held):
    e = env(jsonl, eval_path=held, tools="calculator", expression_field="expr", max_turns=3)
    assert [t["function"]["name"] for t in e.tools] == ["calculate"] and e.max_turns == 3
    demo = e.demonstration(6)
    assert demo == [call("calculate", expression="6+6"), Action(content="12")]
    _, res = asyncio.run(play(e, 6, demo))
    assert (res[0].observation, res[0].done) == (("12",), False)
    assert (res[1].reward, res[1].done) == (1.0, True)
    assert res[1].info == {"turns": 2, "kind": "answer", "used_tool": True}
    bad = [call("calculate", expression="2**8"), call("calc", expression="1"), call("calculate")]
    _, res = asyncio.run(play(e, 6, bad))
    assert all(r.observation[0].startswith("error:") for r in res)
    assert [r.done for r in res] == [False, False, True]
    assert asyncio.run(rollout(e, demo_policy(e, 9), 9, 3))[0] == 1.0
    # A turn's calls are each evaluated and answered, in order.
    calls = [call("calculate", expression="6+6"), call("calc"), call("calculate", expression="9*9")]
    turn = Action(tool_calls=tuple(c.tool_calls[0] for c in calls))
    _, res = asyncio.run(play(e, 6, [turn]))
    assert res[0].observation == ("12", "error: unknown tool calc; available: calculate", "81")
    # Without the tool a call is answered with an error and ends the single turn.
    _, res = asyncio.run(play(env(jsonl), 0, [call("calculate", expression="1+1")]))
    assert res[0].observation == ("error: unknown tool calculate; available: none",)
    assert res[0].done


def test_loads_the_file_once_for_many_instances(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "once.jsonl", problems())
    parsed = []
    real = dataset_files._jsonl
    monkeypatch.setattr(
        dataset_files, "_jsonl", lambda uri, data: parsed.append(uri) or real(uri, data)
    )
    envs = [env(path) for _ in range(64)]
    assert len(parsed) == 1 and all(e.train is envs[0].train for e in envs)
    write_jsonl(Path(path), problems(41))  # an edited local file is read again
    assert len(env(path).train) + len(env(path).held_out) == 41 and len(parsed) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"prompt_field": "question"},
            r"row 0: no field 'question' \(at 'question'; fields there: q, a, expr, tag, word\)",
        ),
        ({"answer_field": "a.b"}, r"no field 'a.b' \(at 'b'; fields there: none\)"),
        (
            {"reward": "fuzzy"},
            r"unknown reward 'fuzzy'; valid: exact, numeric, contains, or 'pkg.module:function'",
        ),
        ({"reward": "no_such_pkg.x:f"}, r"cannot import reward 'no_such_pkg.x:f'.*valid: exact"),
        ({"reward": f"{__name__}:missing"}, r"cannot import reward"),
        (
            {"reward": f"{__name__}:not_a_reward"},
            r"callable as function\(answer_text, reference, row\)",
        ),
        (
            {"reward": "numeric", "answer_field": "word"},
            r"row 0: reward 'numeric' needs a number.*'none'",
        ),
        ({"answer_format": "json"}, r"unknown answer_format 'json'; valid: tag, content"),
        ({"tools": "python"}, r"tools must be 'calculator' or unset"),
        ({"expression_field": "expr"}, r"expression_field is for the tool variant"),
        ({"eval_fraction": 0}, r"eval_fraction must be in \(0, 1\)"),
        ({"eval_fraction": 0.001}, r"eval_fraction=0.001 leaves 40 training and 0 held-out rows"),
        ({"eval_path": "x.jsonl", "eval_fraction": 0.2}, r"eval_path or eval_fraction, not both"),
        (
            {"max_prompt_chars": 10},
            r"row 0: the prompt has 14 characters, over max_prompt_chars=10",
        ),
        ({"max_file_mb": 0.0001}, r"MB is over the limit of 0.0 MB \(raise max_file_mb"),
    ],
)
def test_refusals_are_one_clear_value_error(jsonl, kwargs, message):
    with pytest.raises(ValueError, match=message):
        env(jsonl, **kwargs)


def test_bad_sources_are_one_clear_value_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown format; valid: .jsonl, .parquet"):
        env(str(tmp_path / "p.csv"))
    with pytest.raises(ValueError, match="no such file"):
        env(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no rows"):
        env(str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"q": "1", "a": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: a row must be a JSON object"):
        env(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a Parquet file"):
        env(str(tmp_path / "bad.parquet"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(
        ValueError, match=r"'hf:openai/gsm8k:main@test'.*`datasets` is not installed"
    ):
        env("hf:openai/gsm8k:main@test")


def test_an_episode_through_the_real_rollout_with_the_char_chat(jsonl):
    chat = CharChat(CharTokenizer())
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=256, max_new_tokens=16)

    async def episode(e: DatasetEnv, seed: int):
        policy = ScriptedPolicy(e.demonstration(seed), chat)
        return await play_episode(e, policy, seed=seed, limits=limits, chat=chat)

    plain = asyncio.run(episode(env(jsonl), 11))
    assert (plain.reward, plain.num_turns, plain.status) == (1.0, 1, "ok")
    tool = asyncio.run(episode(env(jsonl, tools="calculator", expression_field="expr"), 11))
    assert (tool.reward, tool.num_turns, tool.status) == (1.0, 2, "ok")
    assert plain.env == tool.env == "dataset" and plain.seed == 11


def test_the_example_dataset_is_what_its_script_writes_and_its_demonstrations_score():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import make_problems
    finally:
        sys.path.remove(str(EXAMPLE))
    lines = (EXAMPLE / "problems.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == make_problems.rows()
    e = make_env(
        "dataset",
        path=str(EXAMPLE / "problems.jsonl"),
        prompt_field="question",
        answer_field="answer",
        reward="numeric",
        tools="calculator",
        expression_field="expression",
    )
    seeds = [*range(20), *(HELD_OUT_SEED_BASE + i for i in range(10))]
    assert all(len(e.demonstration(s)) == 2 for s in seeds)
    assert all(asyncio.run(rollout(e, demo_policy(e, s), s, 3))[0] == 1.0 for s in seeds)

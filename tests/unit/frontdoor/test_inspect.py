"""`inspect --conversations`: episodes from real shards decoded as conversations with the
run's tokenizer (prompt, model turns with tool calls marked, env replies), without JAX;
and the report's phases of a run (early / middle / late by weights version)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from tunix_tasks.config import config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.frontdoor.inspect import (
    answer_phases,
    conversation,
    inspect_uri,
    pick_episodes,
    read_episodes,
    run_of,
)
from tunix_tasks.policy.tokenizer import CharChat
from tunix_tasks.storage.runs import run_id, write_config
from tunix_tasks.storage.shards import RUN_ID_KEY, ShardWriter
from tunix_tasks.testing.shard_factory import make_episode

CHAT = CharChat()


def _talk(i: int, *, version: int, reward: float, answer: str) -> Episode:
    """A calculator episode laid out as the rollout lays it: the prompt, a tool call, the
    env's reply, the answer; loss mask 1 on the sampled turns only."""
    tok = CHAT.tokenizer
    parts = [
        (CHAT.start([{"role": "user", "content": f"What is {i}+7?"}]), 0),
        ([*tok.encode(f"<|tool|>{i}+7"), tok.end_id], 1),
        (CHAT.reply([], [{"role": "tool", "content": str(i + 7)}]), 0),
        ([*tok.encode(f"<|answer|>{answer}"), tok.end_id], 1),
        (list(CHAT.end_ids), 0),
    ]
    tokens = [t for ids, _ in parts for t in ids]
    mask = [m for ids, m in parts for _ in ids]
    return Episode(
        f"ep-{i}",
        tokens,
        mask,
        np.where(np.array(mask) == 1, -0.5, 0.0),
        reward=reward,
        policy_version=version,
        env="calculator",
        num_turns=2,
        created_at=1_700_000_000 + i,
    )


def test_conversation_marks_prompt_tool_call_env_reply_and_answer():
    turns = conversation(_talk(12, version=3, reward=1.0, answer="19"), CHAT)
    assert [(t.role, t.tool_call) for t in turns] == [
        ("prompt", False),
        ("model", True),
        ("env", False),
        ("model", False),
        ("end", False),
    ]
    assert "What is 12+7?" in turns[0].text
    assert turns[1].text == "<|tool|>12+7<|end|>"
    assert "19" in turns[2].text and turns[3].text == "<|answer|>19<|end|>"


@pytest.fixture
def run(tmp_path):
    """A run (config.json: the char preset) whose shards hold 9 conversations over
    versions 0-8, reward rising with the version, and one random-token episode."""
    store = write_config(config_from_dict({"store": str(tmp_path), "run_name": "r"}))
    clock = itertools.count(1_700_000_000).__next__  # shards named in writing order
    writer = ShardWriter(store, actor_id="actor-0000", max_episodes=4, clock=clock)
    for v in range(9):
        writer.add(_talk(v, version=v, reward=v / 8, answer=str(v + 7 if v > 4 else 0)))
    writer.add(make_episode(np.random.default_rng(0), length=30, policy_version=8, reward=0.5))
    writer.close()
    return store


def test_inspect_prints_the_best_conversations_with_the_runs_tokenizer_without_jax(run):
    code = (
        "import json, sys\n"
        "from tunix_tasks.frontdoor.cli import main\n"
        f"rc = main(['inspect', {run.uri + '/shards'!r}, '--conversations', '2', "
        "'--order', 'best'])\n"
        "print(json.dumps([rc, sorted(m for m in sys.modules if m.startswith('jax'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text, result = out.stdout.rsplit("\n", 2)[0], json.loads(out.stdout.splitlines()[-1])
    assert result == [0, []]  # decoded without JAX
    blocks = text.split("\n\n")
    assert len(blocks) == 2
    assert blocks[0].startswith("reward 1.000   version 8   status ok   turns 2")
    assert "  [model (tool call)]\n    <|tool|>8+7<|end|>" in blocks[0]
    assert "  [env reply]\n    <|user|>15<|assistant|>" in blocks[0]
    assert "  [model]\n    <|answer|>15<|end|>" in blocks[0]
    assert blocks[1].startswith("reward 0.875   version 7")


def test_inspect_conversations_errors_are_one_line(run, tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "inspect", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    zero = cli(run.uri + "/shards", "--conversations", "0")
    assert zero.returncode == 2 and "expected a count >= 1" in zero.stderr
    (tmp_path / "loose").mkdir()
    no_run = cli(str(tmp_path / "loose"), "--conversations", "1")
    assert no_run.returncode == 2 and "has no config.json" in no_run.stderr
    assert "Traceback" not in zero.stderr + no_run.stderr


def test_inspect_shows_another_incarnations_shards_as_the_learner_sees_them(tmp_path):
    """A shard an actor of a deleted run wrote under the run created again there is
    `other_run` in `inspect` as in the learner (quarantined, never trained); one naming
    no run, or this one, is valid. Its episodes are not shown as conversations."""
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    store = write_config(cfg)
    rng = np.random.default_rng(0)
    for name, writer in (("old", "f" * 32), ("ours", run_id(store)), ("plain", "")):
        w = ShardWriter(store, actor_id=name, metadata={RUN_ID_KEY: writer} if writer else None)
        w.add(make_episode(rng, length=20, policy_version=0))
        w.close()
    summary = inspect_uri(f"{cfg.run_uri}/shards")
    assert (summary["shards"], summary["valid_shards"]) == (3, 2)
    [bad] = summary["invalid"]
    assert bad["reason"] == "other_run" and "/shards/old/" in bad["shard"]
    assert len(read_episodes(f"{cfg.run_uri}/shards")) == 2


def test_run_of_a_shard_uri():
    assert run_of("file:///r/demo/shards") == "file:///r/demo"
    assert run_of("file:///r/demo/shards/actor-0000/1.parquet") == "file:///r/demo"
    assert run_of("gs://b/runs/demo/demos/000001.parquet") == "gs://b/runs/demo"
    assert run_of("file:///r/demo") == "file:///r/demo"


def test_answer_phases_split_by_version_with_best_worst_recent(run):
    episodes = read_episodes(run.uri + "/shards", max_shards=2)  # first and last of 3
    assert sorted(e.policy_version for e in episodes) == [0, 1, 2, 3, 8, 8]
    episodes = read_episodes(run.uri + "/shards")
    phases = answer_phases(episodes, CHAT)
    assert [(p["phase"], p["versions"], p["episodes"]) for p in phases] == [
        ("early", [0, 2], 3),
        ("middle", [3, 5], 3),
        ("late", [6, 8], 4),
    ]
    late = phases[-1]
    assert late["samples"]["best"]["episode"].episode_id == "ep-8"
    assert late["samples"]["worst"]["episode"].reward == 0.5  # the random-token episode
    assert late["samples"]["recent"]["episode"].episode_id == "ep-7"  # the latest not shown
    assert late["reward_mean"] == pytest.approx((6 / 8 + 7 / 8 + 1 + 0.5) / 4)
    assert phases[0]["tool_calls_per_episode"] == 1.0
    assert pick_episodes(episodes, 1, "recent")[0].policy_version == 8
    with pytest.raises(ValueError, match="expected one of"):
        pick_episodes(episodes, 1, "random")  # type: ignore[arg-type]


def test_report_shows_what_the_model_wrote_per_phase(run):
    from tunix_tasks.frontdoor.report import write_report
    from tunix_tasks.storage.layout import RunLayout

    write_report(run.uri)
    page = run.read_bytes(RunLayout.REPORT).decode()
    section = page[page.index("<h2>What the model wrote</h2>") :]
    for phase in ("early (versions 0-2)", "middle (versions 3-5)", "late (versions 6-8)"):
        assert phase in section
    assert section.count("<details>") == 9  # best, worst, recent of each phase
    assert "best: reward 1.000, version 8" in section
    assert '<span class="model call">[model (tool call)]</span>\n&lt;|tool|&gt;8+7' in section
    summary = json.loads(run.read_bytes(RunLayout.SUMMARY))
    assert [p["episodes"] for p in summary["answers_by_phase"]] == [3, 3, 4]
    assert "samples" not in summary["answers_by_phase"][0]

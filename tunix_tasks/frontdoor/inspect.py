"""`tunix-tasks inspect URI`: what is in a shard, or in every shard under a prefix; and
what the model wrote, episode by episode, as conversations.

Reads through the same store and validation as the learner, so an invalid shard is
reported with the reason the learner would quarantine it for (`other_run` too, for
shards under a run's `shards/`: checked against the run's `run_id`). A URI with nothing
there raises `NotFound` (the CLI exits 2); an existing empty folder is zero shards.

    summary = inspect_uri("file:///tmp/runs/demo/shards")
    print(format_summary(summary))

A conversation is an episode's tokens cut where its loss mask changes and decoded with
the run's tokenizer (`policy.preflight.build_chat`, no JAX): the prompt, then model turns
(loss mask 1; a tool call marked) and the environment's replies (loss mask 0):

    chat = build_chat(read_config(run_uri)[0].model)
    for ep in pick_episodes(read_episodes("file:///tmp/runs/demo/shards"), 3, "best"):
        print(format_conversation(ep, conversation(ep, chat)))

`answer_phases` splits a run's episodes into early / middle / late training by weights
version, with each phase's figures and its best, worst and most recent episode: the
report's "What the model wrote".
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from tunix_tasks.config import ConfigError
from tunix_tasks.episode import Episode
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import run_id
from tunix_tasks.storage.shards import length_histogram, table_episodes
from tunix_tasks.storage.store import NotFound, open_store
from tunix_tasks.storage.uri import join_uri, normalize_uri
from tunix_tasks.storage.validation import ShardValidationError, read_shard, read_shard_columns

log = logging.getLogger(__name__)


def _split(uri: str) -> tuple[str, list[str]]:
    """(store root, keys): a single .parquet object, or every .parquet under a prefix.
    Raises `NotFound` if there is nothing at `uri`: no such object, and no folder (local)
    or no object under the prefix (gs://, where folders do not exist by themselves)."""
    uri = normalize_uri(uri)
    if uri.endswith(".parquet"):
        root, _, name = uri.rpartition("/")
        if not open_store(root).exists(name):
            raise NotFound(f"{uri} does not exist")
        return root, [name]
    store = open_store(uri)
    infos = store.list("")
    local = store.local_path()
    if not infos and not (local and local.is_dir()):
        exists = local is not None and local.exists()
        raise NotFound(
            f"{uri} {'is not a .parquet file or a folder' if exists else 'does not exist'}"
        )
    return uri, [i.key for i in infos if i.key.endswith(".parquet")]


def _run_id_of(uri: str) -> str:
    """The `run_id` of the run holding `uri` ("" outside a run, or for a run without one,
    or one whose id is corrupt: then the shards are shown unchecked, with a warning)."""
    try:
        return run_id(open_store(run_of(uri)))
    except ConfigError as err:
        log.warning("not checking which run wrote each shard: %s", err)
        return ""


def inspect_uri(uri: str, *, vocab_size: int = 1 << 31) -> dict[str, Any]:
    root, keys = _split(uri)
    store = open_store(root)
    owner = _run_id_of(uri)
    tables: list[pa.Table] = []
    invalid: list[dict[str, str]] = []
    schema = None
    for key in keys:
        try:
            table = read_shard(store, key, vocab_size=vocab_size, run_id=owner)
        except ShardValidationError as err:
            invalid.append(
                {"shard": join_uri(root, key), "reason": err.reason, "detail": err.detail}
            )
            continue
        schema = schema or table.schema
        tables.append(
            table.select(["length", "policy_version", "reward", "status", "env", "num_turns"])
        )
    summary: dict[str, Any] = {
        "uri": normalize_uri(uri),
        "shards": len(keys),
        "valid_shards": len(tables),
        "invalid": invalid,
        "rows": 0,
    }
    if schema is not None:
        summary["schema"] = [f"{f.name}: {f.type}" for f in schema]
        meta = schema.metadata or {}
        summary["schema_version"] = meta.get(b"tunix.schema_version", b"?").decode()
    if not tables:
        return summary
    t = pa.concat_tables(tables)
    lengths = t.column("length").to_numpy()
    rewards = t.column("reward").to_numpy().astype(np.float64)
    summary.update(
        rows=t.num_rows,
        tokens=int(lengths.sum()),
        length={
            "min": int(lengths.min()),
            "mean": float(lengths.mean()),
            "max": int(lengths.max()),
        },
        length_histogram=length_histogram(lengths),
        policy_versions=dict(
            sorted(collections.Counter(t.column("policy_version").to_pylist()).items())
        ),
        reward={
            "mean": float(rewards.mean()),
            "std": float(rewards.std()),
            "min": float(rewards.min()),
            "max": float(rewards.max()),
        },
        status=dict(collections.Counter(t.column("status").to_pylist())),
        env=dict(collections.Counter(t.column("env").to_pylist())),
        turns_mean=float(t.column("num_turns").to_numpy().mean()),
    )
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['uri']}",
        f"  shards: {s['shards']} ({s['valid_shards']} valid)   rows: {s['rows']}",
    ]
    if "schema" in s:
        lines.append(f"  schema v{s['schema_version']}:")
        lines += [f"    {f}" for f in s["schema"]]
    if s["rows"]:
        ln = s["length"]
        lines.append(
            f"  tokens: {s['tokens']}   length min/mean/max: {ln['min']}/{ln['mean']:.1f}/{ln['max']}"
        )
        h = s["length_histogram"]
        peak = max(h["counts"]) or 1
        lines.append("  length histogram:")
        for lo, hi, c in zip(h["edges"][:-1], h["edges"][1:], h["counts"], strict=True):
            if c:
                lines.append(
                    f"    [{lo:>5}, {hi:>5})  {c:>7}  {'#' * max(1, round(30 * c / peak))}"
                )
        r = s["reward"]
        lines.append(
            f"  reward mean {r['mean']:.3f} std {r['std']:.3f} min {r['min']:.3f} max {r['max']:.3f}"
        )
        lines.append(f"  policy versions: {json.dumps(s['policy_versions'])}")
        lines.append(f"  status: {json.dumps(s['status'])}   env: {json.dumps(s['env'])}")
    for bad in s["invalid"]:
        lines.append(f"  INVALID {bad['shard']}: {bad['reason']}: {bad['detail']}")
    return "\n".join(lines)


# -- conversations ----------------------------------------------------------------------

Order = Literal["best", "worst", "recent"]
ORDERS: tuple[str, ...] = ("best", "worst", "recent")
PHASES: tuple[str, ...] = ("early", "middle", "late")
# `CharChat.parse` reads a call as one of the first tool offered: a stand-in tool lets it
# recognise a call without building the run's environment (templates name their own).
_ANY_TOOL = (
    {
        "type": "function",
        "function": {
            "name": "tool",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
        },
    },
)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One stretch of an episode: `prompt` (before the first model turn), `model`
    (sampled tokens, loss mask 1), `env` (the environment's reply and the template's
    tokens around it, loss mask 0) or `end` (the tokens that close the episode)."""

    role: Literal["prompt", "model", "env", "end"]
    text: str
    tool_call: bool = False


def run_of(uri: str) -> str:
    """The run a shard URI belongs to: the part before its `shards/` or `demos/` folder
    (a URI without one is taken as the run itself)."""
    uri = normalize_uri(uri).rstrip("/")
    for folder in (RunLayout.SHARDS, RunLayout.DEMOS):
        cut = (uri + "/").rfind("/" + folder)
        if cut >= 0:
            return uri[:cut]
    return uri


def read_episodes(uri: str, *, max_shards: int | None = None) -> list[Episode]:
    """The episodes of the valid shards at `uri` (invalid ones are skipped: `inspect_uri`
    reports them). `max_shards`: read at most that many, spread evenly over the run's
    time (shard names start with their creation time), so a long run's start, middle and
    end are all there."""
    root, keys = _split(uri)
    keys = sorted(keys, key=lambda k: k.rsplit("/", 1)[-1])
    if max_shards is not None and len(keys) > max_shards:
        keys = [keys[i] for i in np.linspace(0, len(keys) - 1, max_shards).round().astype(int)]
    store = open_store(root)
    owner = _run_id_of(uri)
    episodes: list[Episode] = []
    for key in dict.fromkeys(keys):  # once each (rounded positions may repeat)
        try:
            columns = read_shard_columns(store, key, vocab_size=1 << 31, run_id=owner)
            episodes += table_episodes(columns)
        except ShardValidationError:
            continue
    return episodes


def pick_episodes(episodes: Sequence[Episode], n: int, order: Order) -> list[Episode]:
    """`n` episodes: the highest rewards, the lowest, or the latest written; ties go to
    the latest."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: expected one of {list(ORDERS)}")
    by_time = sorted(episodes, key=lambda e: e.created_at, reverse=True)
    if order == "best":
        by_time.sort(key=lambda e: -e.reward)
    elif order == "worst":
        by_time.sort(key=lambda e: e.reward)
    return by_time[:n]


def conversation(episode: Episode, chat: ChatFormat) -> list[Turn]:
    """The episode's turns, decoded with `chat`'s tokenizer (special tokens as their text)."""
    mask = episode.loss_mask
    cuts = np.flatnonzero(np.diff(mask)) + 1
    turns: list[Turn] = []
    for ids, m in zip(np.split(episode.tokens, cuts), np.split(mask, cuts), strict=True):
        token_ids = ids.tolist()
        text = chat.tokenizer.decode(token_ids)
        if m[0]:
            call = bool(chat.parse(token_ids, _ANY_TOOL).tool_calls)
            turns.append(Turn("model", text, tool_call=call))
        else:
            turns.append(Turn("env" if turns else "prompt", text))
    if len(turns) > 1 and turns[-1].role == "env":  # no reply: what closes the episode
        turns[-1] = Turn("end", turns[-1].text)
    return turns


def episode_header(ep: Episode) -> str:
    return (
        f"reward {ep.reward:.3f}   version {ep.policy_version}   status {ep.status}   "
        f"turns {ep.num_turns}   env {ep.env}   seed {ep.seed}   actor {ep.actor_id}   "
        f"episode {ep.episode_id}"
    )


def turn_label(turn: Turn) -> str:
    if turn.role == "model":
        return "model (tool call)" if turn.tool_call else "model"
    return {"env": "env reply"}.get(turn.role, turn.role)


def format_conversation(ep: Episode, turns: Sequence[Turn]) -> str:
    """The episode's header line, then one block per turn: its label, its text indented."""
    lines = [episode_header(ep)]
    for turn in turns:
        lines.append(f"  [{turn_label(turn)}]")
        lines += [f"    {line}" for line in turn.text.splitlines() or [""]]
    return "\n".join(lines)


def answer_phases(
    episodes: Sequence[Episode], chat: ChatFormat, *, phases: int = 3
) -> list[dict[str, Any]]:
    """The episodes cut by weights version into `phases` equal version ranges (early,
    middle, late for 3). Each phase: its version range, episode count, reward mean, share
    of episodes that ended `ok`, model tokens and tool calls per episode, and its best,
    worst and most recent episode as conversations (each chosen among those not shown
    yet, so equal rewards still show three episodes)."""
    if not episodes:
        return []
    versions = np.array([e.policy_version for e in episodes])
    edges = np.linspace(versions.min(), versions.max() + 1, phases + 1)
    names = PHASES if phases == len(PHASES) else tuple(f"phase {i + 1}" for i in range(phases))
    out = []
    for name, lo, hi in zip(names, edges[:-1], edges[1:], strict=True):
        members = [e for e, v in zip(episodes, versions, strict=True) if lo <= v < hi]
        if not members:
            continue
        talks = {id(e): conversation(e, chat) for e in members}
        model_turns = [[t for t in talks[id(e)] if t.role == "model"] for e in members]
        samples: dict[str, Episode] = {}
        for order in ORDERS:  # three different episodes where the phase has them
            rest = [e for e in members if all(e is not x for x in samples.values())]
            samples[order] = pick_episodes(rest or members, 1, order)[0]
        out.append(
            {
                "phase": name,
                "versions": [
                    min(e.policy_version for e in members),
                    max(e.policy_version for e in members),
                ],
                "episodes": len(members),
                "reward_mean": float(np.mean([e.reward for e in members])),
                "ok_share": float(np.mean([e.status == "ok" for e in members])),
                "model_tokens_per_episode": float(
                    np.mean([int(e.loss_mask.sum()) for e in members])
                ),
                "tool_calls_per_episode": float(
                    np.mean([sum(t.tool_call for t in turns) for turns in model_turns])
                ),
                "samples": {
                    order: {"episode": ep, "turns": talks[id(ep)]} for order, ep in samples.items()
                },
            }
        )
    return out

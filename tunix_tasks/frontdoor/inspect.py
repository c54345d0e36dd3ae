"""`tunix-tasks inspect URI`: what is in a shard, or in every shard under a prefix.

Reads through the same store and validation as the learner, so an invalid shard is
reported with the reason the learner would quarantine it for. A URI with nothing there
raises `NotFound` (the CLI exits 2); an existing empty folder is zero shards.

    summary = inspect_uri("file:///tmp/runs/demo/shards")
    print(format_summary(summary))
"""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np
import pyarrow as pa

from tunix_tasks.storage.shards import length_histogram
from tunix_tasks.storage.store import NotFound, open_store
from tunix_tasks.storage.uri import join_uri, normalize_uri
from tunix_tasks.storage.validation import ShardValidationError, read_shard


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


def inspect_uri(uri: str, *, vocab_size: int = 1 << 31) -> dict[str, Any]:
    root, keys = _split(uri)
    store = open_store(root)
    tables: list[pa.Table] = []
    invalid: list[dict[str, str]] = []
    schema = None
    for key in keys:
        try:
            table = read_shard(store, key, vocab_size=vocab_size)
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

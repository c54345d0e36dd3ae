"""A run's root: its frozen config, the DONE marker, and quarantine records.

Layout under the run root (see docs/architecture.md for the full table):

    config.json                  the RunConfig, written once by `prepare`
    control/DONE                 {"reason": ..., "time": ...}: actors stop when it appears
    quarantine/<shard key>       a shard that failed validation (moved here) ...
    quarantine/<shard key>.reason.json   ... and why
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from tunix_tasks.config import ConfigError, RunConfig, config_from_dict
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import NotFound, ObjectStore, open_store


def write_config(cfg: RunConfig) -> ObjectStore:
    """Write config.json under the run root (idempotent) and clear an old DONE marker."""
    store = open_store(cfg.run_uri)
    store.write_bytes(RunLayout.CONFIG, cfg.to_json().encode())
    store.delete(RunLayout.DONE)
    return store


def read_config(run_uri: str) -> tuple[RunConfig, ObjectStore]:
    store = open_store(run_uri)
    try:
        raw = json.loads(store.read_bytes(RunLayout.CONFIG))
    except NotFound:
        raise ConfigError(
            f"{run_uri} has no {RunLayout.CONFIG}; create the run first (tunix-tasks train / prepare)"
        ) from None
    return config_from_dict(raw), store


def mark_done(store: ObjectStore, reason: str) -> None:
    store.write_bytes(RunLayout.DONE, json.dumps({"reason": reason, "time": time.time()}).encode())


def is_done(store: ObjectStore) -> dict[str, Any] | None:
    try:
        return json.loads(store.read_bytes(RunLayout.DONE))
    except NotFound:
        return None


def quarantine(store: ObjectStore, key: str, *, reason: str, detail: str) -> str:
    """Move a bad shard under quarantine/ with a reason record; returns the new key."""
    dest = RunLayout.quarantined(key)
    with contextlib.suppress(NotFound):  # already moved by an earlier attempt
        store.write_bytes(dest, store.read_bytes(key))
    store.write_bytes(
        RunLayout.quarantine_reason(key),
        json.dumps(
            {"shard": key, "reason": reason, "detail": detail, "time": time.time()}
        ).encode(),
    )
    store.delete(key)
    return dest

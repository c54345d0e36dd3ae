"""Process entry points: what the CLI, the local launcher and the Airflow DAGs call.

Each function takes plain values (a run URI, ids, numbers) so any orchestrator can call
it in a fresh process; nothing here imports Airflow.

    run_uri = prepare_run({"store": "file:///tmp/runs", "learner": {"max_steps": 20}}, run_name="r1")
    run_actor(run_uri, 0)            # in N processes
    run_learner(run_uri)             # in one process
    write_report(run_uri)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from tunix_tasks.config import ConfigError, RunConfig, config_from_dict
from tunix_tasks.storage.runs import is_done, read_config, write_config
from tunix_tasks.storage.runs import mark_done as _mark_done
from tunix_tasks.storage.store import open_store

log = logging.getLogger(__name__)


def actor_name(actor_id: int | str) -> str:
    return actor_id if isinstance(actor_id, str) else f"actor-{actor_id:04d}"


def prepare_run(params: Mapping[str, Any] | RunConfig, *, run_name: str | None = None) -> str:
    """Validate the config, write `<run_uri>/config.json` (idempotent), clear DONE."""
    if isinstance(params, RunConfig):
        cfg = params
    else:
        data = dict(params)
        if run_name is not None:
            data["run_name"] = run_name
        cfg = config_from_dict(data)
    write_config(cfg)
    log.info("prepared run %s", cfg.run_uri)
    return cfg.run_uri


def run_actor(
    run_uri: str,
    actor_id: int | str,
    *,
    deadline_s: float | None = None,
    handle_signals: bool = True,
) -> dict[str, Any]:
    from tunix_tasks.actor.actor import Actor

    cfg, store = read_config(run_uri)
    actor = Actor(
        cfg, store, actor_id=actor_name(actor_id), deadline_s=deadline_s or cfg.deadline_s or None
    )
    if handle_signals:
        actor.install_signal_handlers()
    return actor.run()


def run_learner(
    run_uri: str,
    *,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    on_publish: Callable[[int, str], None] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    handle_signals: bool = True,
) -> dict[str, Any]:
    """Train until `max_steps` (total steps of the run) or the deadline; resumes from the
    latest checkpoint; marks the run DONE when finished."""
    import signal

    from tunix_tasks.learner.learner import Learner

    cfg, store = read_config(run_uri)
    learner = Learner(
        cfg,
        store,
        max_steps=max_steps,
        deadline_s=deadline_s or cfg.deadline_s or None,
        on_publish=on_publish,
        progress=progress,
    )
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: learner.request_stop(signal.Signals(s).name))
    return learner.run()


def learner_progress(run_uri: str) -> dict[str, Any]:
    """Step and version of the latest checkpoint (0 / -1 before the first one)."""
    from tunix_tasks.learner.checkpoint import Checkpointer
    from tunix_tasks.storage.weights import read_latest

    _, store = read_config(run_uri)
    ckpt = Checkpointer(store)
    try:
        step = ckpt.latest_step() or 0
    finally:
        ckpt.close()
    latest = read_latest(store)
    return {"step": int(step), "version": latest[0] if latest else -1}


def mark_done(run_uri: str, reason: str) -> None:
    _mark_done(open_store(run_uri), reason)


def run_is_done(run_uri: str) -> bool:
    return is_done(open_store(run_uri)) is not None


def write_report(run_uri: str) -> str:
    from tunix_tasks.frontdoor.report import write_report as _write

    return _write(run_uri)


def evaluate_snapshot(
    run_uri: str, version: int | None = None, *, seeds: list[int] | None = None
) -> dict[str, Any]:
    from tunix_tasks.frontdoor.evaluate import evaluate_snapshot as _eval

    return _eval(run_uri, version, seeds=seeds)


def wait_for_file(run_uri: str, key: str, timeout_s: float) -> None:
    store = open_store(run_uri)
    deadline = time.monotonic() + timeout_s
    while not store.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_uri}/{key} did not appear within {timeout_s:.0f}s")
        time.sleep(0.2)


__all__ = [
    "ConfigError",
    "evaluate_snapshot",
    "learner_progress",
    "mark_done",
    "prepare_run",
    "run_actor",
    "run_is_done",
    "run_learner",
    "write_report",
]

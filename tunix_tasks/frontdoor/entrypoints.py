"""Process entry points: what the CLI, the local launcher and the Airflow DAGs call.

Each function takes plain values (a run URI, ids, numbers) so any orchestrator can call
it in a fresh process; nothing here imports Airflow.

    run_uri = prepare_run({"store": "file:///tmp/runs", "learner": {"max_steps": 20}}, run_name="r1")
    run_actor(run_uri, 0)            # in N processes
    run_learner(run_uri)             # in one process
    write_report(run_uri)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tunix_tasks.config import ConfigError, RunConfig, check_resume, config_from_dict
from tunix_tasks.frontdoor.compile_cache import enable_compile_cache
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.outage import first_contact
from tunix_tasks.storage.runs import (
    RunReplaced,
    finished_step,
    join_run,
    read_config,
    replaced_if_known,
    replaced_since,
    stored_config,
    write_config,
)
from tunix_tasks.storage.runs import mark_done as _mark_done
from tunix_tasks.storage.runs import run_id as read_run_id
from tunix_tasks.storage.store import ObjectStore, StoreError, open_store

log = logging.getLogger(__name__)


# `actor.kind` -> its `ActorRuntime` subclass, imported only by the process that runs it
# (each kind pulls in its own engine); a new kind adds a line here and to `actor.kind`.
ACTOR_KINDS: dict[str, str] = {
    "async": "tunix_tasks.actor.asynchronous.actor:Actor",
    "vectorized": "tunix_tasks.actor.vectorized.actor:VectorizedActor",
    "agent": "tunix_tasks.actor.endpoint.actor:AgentActor",
}


def actor_name(actor_id: int | str) -> str:
    return actor_id if isinstance(actor_id, str) else RunLayout.actor_name(actor_id)


def _env_calls_tools(cfg: RunConfig) -> bool:
    """Whether the run's environment has tools: an async actor's (an agent program brings
    its own; a vectorized env renders no chat). Built only when a template cannot render
    a tool turn (rare), for the env's own `tools`."""
    if cfg.actor.kind != "async":
        return False
    from tunix_tasks.envs import make_env

    try:
        return bool(make_env(cfg.env.name, **cfg.env.kwargs).tools)
    except Exception as err:  # its actors, maybe on other machines, say why they cannot
        log.warning("env %s not built to check its tools: %s", cfg.env.name, err)
        return False


def _check_chat_template(cfg: RunConfig) -> None:
    """A checkpoint's template must carry the tool turns the run will have: `ConfigError`
    when an env with tools meets one that cannot render a call and its result; a warning
    when an agent program (tools unknown) does, or when a run with tools meets one that
    takes a single call a turn."""
    from tunix_tasks.policy.preflight import (
        PolicyError,
        check_policy,
        several_calls_error,
        tool_turn_error,
    )

    try:
        chat = check_policy(cfg.model)
    except PolicyError as err:
        raise ConfigError(f"model.checkpoint: {err}") from None
    cannot = tool_turn_error(chat)
    why = f"its chat template cannot carry a tool call and its result ({cannot})"
    tools = _env_calls_tools(cfg)
    if cannot is not None and tools:
        raise ConfigError(
            f"model.checkpoint: {why}; env {cfg.env.name} calls tools: choose an "
            "environment without tools, a checkpoint whose template writes tool calls "
            "and results, or the model.tool_format its calls are written in"
        )
    agent = cfg.actor.kind == "agent"  # its program's tools: unknown until it runs
    if cannot is not None and agent:
        log.warning(
            "model.checkpoint: %s: an agent program that passes tools gets none called", why
        )
    elif (tools or agent) and (one := several_calls_error(chat)):
        log.warning(
            "model.checkpoint: its chat template takes one tool call a turn (%s): an "
            "episode whose model writes several calls in one turn ends 'truncated'",
            one,
        )


def prepare_run(params: Mapping[str, Any] | RunConfig, *, run_name: str | None = None) -> str:
    """Validate the config, write `<run_uri>/config.json` (idempotent), clear DONE, and
    (with `warm_start_steps`) write the demonstration shards the learner imitates first.
    An existing run's config may change only in the fields a resume may change
    (`config.RESUMABLE`); another change raises `ConfigError` and writes nothing."""
    if isinstance(params, RunConfig):
        cfg = params
    else:
        data = dict(params)
        if run_name is not None:
            data["run_name"] = run_name
        cfg = config_from_dict(data)
    if cfg.model.checkpoint:  # a bad checkpoint fails here, not in every process
        _check_chat_template(cfg)
    store = write_config(cfg)
    if cfg.warm_start_steps:
        from tunix_tasks.actor.demonstrations import write_demonstrations

        write_demonstrations(cfg, store)
    log.info("prepared run %s (run_id %s)", cfg.run_uri, read_run_id(store) or "none")
    return cfg.run_uri


def resume_note(cfg: RunConfig) -> str | None:
    """What starting run `cfg` (again) would do, checked before anything is written.

    Raises `ConfigError` (one line naming each field) if the run exists and `cfg` changes a
    field a resume may not change, `StoreUnavailable` if the store does not answer within
    TUNIX_STORE_CONNECT_DEADLINE_S (`storage.outage.first_contact`). Returns a one-line note if the run is finished (DONE
    with `learner.max_steps` reached: nothing to train); None for a new run or one with
    steps to go."""
    store = open_store(cfg.run_uri)
    stored = first_contact(cfg.run_uri, stored_config, store)  # unreachable: bounded
    if stored is None:
        return None
    check_resume(stored, cfg)
    step = finished_step(store, cfg.learner.max_steps)
    if step is None:
        return None
    return (
        f"run {cfg.run_uri} is finished (step {step} of {cfg.learner.max_steps}); "
        "raise learner.max_steps to continue or use --run-name"
    )


def run_actor(
    run_uri: str,
    actor_id: int | str,
    *,
    deadline_s: float | None = None,
    handle_signals: bool = True,
    kind: str | None = None,
    leave_when_parked: bool = False,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Run actor `actor_id` of a prepared run until DONE, the deadline or a signal.
    `kind` (async / vectorized) overrides the run's `actor.kind` for this actor: one
    run's fleet can mix both, the learner reads their shards alike. `leave_when_parked`:
    also return once the autopilot parks it (`run_actor_shifts` starts it again).
    `run_id`: the run's id when the caller prepared it (`prepared_run_id`). An actor whose
    run is deleted or created again, before it starts or while it runs, raises `Fenced`."""
    enable_compile_cache()
    cfg, store, joined = _join(run_uri, run_id)
    if kind is not None and kind != cfg.actor.kind:
        cfg = config_from_dict(
            {**cfg.model_dump(), "actor": {**cfg.actor.model_dump(), "kind": kind}}
        )
    module, name = ACTOR_KINDS[cfg.actor.kind].split(":")
    actor_cls = getattr(importlib.import_module(module), name)
    actor = actor_cls(
        cfg,
        store,
        actor_id=actor_name(actor_id),
        deadline_s=deadline_s or cfg.deadline_s or None,
        leave_when_parked=leave_when_parked,
        run_id=joined,
    )
    if handle_signals:
        actor.install_signal_handlers()
    with _fenced_if_replaced():  # a leftover of a deleted run
        return actor.run()


@contextlib.contextmanager
def _fenced_if_replaced() -> Iterator[None]:
    """`storage.runs.RunReplaced` as `Fenced` (exit 3), logged once."""
    try:
        yield
    except RunReplaced as err:
        log.error("%s: stopping", err)
        raise Fenced(str(err)) from None


def _join(run_uri: str, run_id: str | None) -> tuple[RunConfig, ObjectStore, str]:
    """`storage.runs.join_run`, a run replaced since `run_id` as `Fenced`."""
    with _fenced_if_replaced():
        return join_run(run_uri, run_id)


def launched_actors(cfg: RunConfig, requested: int | None = None) -> int:
    """How many actors a launcher that cannot start more during a run (the mapped Airflow
    fleet) starts: `requested` (default `actor.num_actors`), or with the autopilot its
    `max_actors` when set, parking those it does not need (`frontdoor/fleet.py`
    `ParkedFleet`)."""
    fleet = cfg.actor.num_actors if requested is None else requested
    if cfg.autopilot_on:
        return cfg.actor.autopilot.with_ceiling(fleet).max_actors
    return fleet


def fleet_autopilot(run_uri: str, *, launched: int | None = None, run_id: str | None = None):
    """The run's `FleetAutopilot` over the `launched` actors (default: what
    `launched_actors` gives the run's config); a context manager: a thread while the
    learner runs, nothing when the autopilot is off. `Fenced` (nothing written) when the
    run was deleted or created again since it was prepared (`run_id`)."""
    from tunix_tasks.frontdoor.fleet import FleetAutopilot

    with _fenced_if_replaced():
        return FleetAutopilot(run_uri, launched=launched, run_id=run_id)


def run_actor_shifts(
    run_uri: str,
    actor_id: int,
    launch: Callable[[float | None], dict[str, Any]],
    *,
    deadline_s: float | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Actor `actor_id`'s slot in a fleet whose parked actors give their resources back:
    `launch(seconds_left)` runs the actor (with `leave_when_parked`) while the
    autopilot's fleet holds it, nothing while it is parked (`frontdoor/fleet.py`).
    `Fenced` when the run is deleted or created again since it was prepared (`run_id`)."""
    from tunix_tasks.frontdoor.fleet import run_actor_shifts as shifts

    with _fenced_if_replaced():
        return shifts(run_uri, int(actor_id), launch, deadline_s=deadline_s, run_id=run_id)


FENCED_EXIT_CODE = 3
"""Exit status of a process fenced off its run (no traceback, one logged line): a
learner when another learner published over its `weights/LATEST` or took its lease over;
an actor or learner whose run was deleted, or created again under its URI, since it (or
the DAG run, or `train`, that started it) joined (`storage.runs.RunReplaced`). Retrying
does not help: the run belongs to another learner, or is another run. Launchers do not
restart it; the DAGs fail its task without a retry."""


class Fenced(SystemExit):
    """Raised by `run_learner` and `run_actor` instead of `PublishConflict`, `LeaseLost`
    or `RunReplaced`: a SystemExit whose `code` is `FENCED_EXIT_CODE`, so the process
    exits with that status and the one line logged before (`str()` of this exception),
    whatever command called it."""

    def __init__(self, message: str) -> None:
        super().__init__(FENCED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def run_learner(
    run_uri: str,
    *,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    handle_signals: bool = True,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Train until `max_steps` (total steps of the run) or the deadline; resumes from the
    latest checkpoint; marks the run DONE when finished. Progress is in the run's metrics
    (`MetricsTail(store, "learner")`); new weights appear as `weights/LATEST`.

    A learner that lost the `weights/LATEST` race (another learner published over it)
    or its lease (another learner took the run over) logs one line and raises
    `Fenced` (SystemExit, status 3), as does one whose run was replaced since `run_id`
    (the id the caller prepared it with, `prepared_run_id`), at its start or at its
    first write after (its metrics, snapshots, flow report and checkpoints check it).

    Multi-host (`TUNIX_NUM_PROCESSES` > 1, with `TUNIX_COORDINATOR_ADDRESS` and
    `TUNIX_PROCESS_ID`): every process calls this; process 0 is the learner above and
    the others follow it (`learner/multihost.py`), returning `{"process", "steps"}`."""
    import signal

    from tunix_tasks.learner.multihost import follow, initialize, process_group

    group = process_group()
    if group is not None:
        initialize(group)  # before anything else touches JAX
    enable_compile_cache()

    from tunix_tasks.learner.learner import Learner
    from tunix_tasks.storage.lease import LeaseLost
    from tunix_tasks.storage.weights import PublishConflict

    cfg, store, joined = _join(run_uri, run_id)
    if group is not None and not group.leader:
        if handle_signals:  # the leader stops the group (at a checkpoint); keep following
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda s, _f: log.info("%s: left to the leader", s))
        return follow(cfg, store)
    learner = Learner(
        cfg,
        store,
        max_steps=max_steps,
        deadline_s=deadline_s or cfg.deadline_s or None,
        run_id=joined,
    )
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: learner.request_stop(signal.Signals(s).name))
    try:
        summary = learner.run()
        if summary["stop_reason"] == "lease lost":  # taken over while it had nothing to save
            learner.parts.lease.ensure()  # raises the LeaseLost that names the new owner's lease
        return summary
    except (PublishConflict, LeaseLost, RunReplaced, StoreError, OSError) as err:
        # A lease or publish lost, or a save cut off as the run's folder went, may be the
        # run's replacement met first from another side (the lease's renewal thread):
        # that is the cause to name. Otherwise the first three fence off; the rest fail.
        fenced = isinstance(err, (PublishConflict, LeaseLost, RunReplaced))
        why = None if isinstance(err, RunReplaced) else replaced_if_known(store, joined)
        if why:
            log.error("%s (the learner's last error: %s)", why, err)
            raise Fenced(why) from None
        if not fenced:
            raise
        log.error("%s", err)
        raise Fenced(str(err)) from None


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


def mark_done(run_uri: str, reason: str, *, run_id: str | None = None) -> str | None:
    """Mark the run DONE (its actors stop). With `run_id` (the id it was prepared with,
    `prepared_run_id`), only while the run is still that one: the teardown of a DAG run
    whose run was deleted and created again must not stop the other run's actors.
    Returns why it did not mark the run (None: marked)."""
    store = open_store(run_uri)
    if run_id is not None and (why := replaced_since(store, run_id)):
        log.warning("%s: not marking it DONE", why)
        return why
    _mark_done(store, reason)
    return None


def prepared_run_id(run_uri: str) -> str:
    """The id of the run just prepared at `run_uri` ("" for a run from before ids), for
    the processes a DAG run or `train` starts on it: `run_actor`, `run_learner` and
    `mark_done` given it never act on another run created there later."""
    return read_run_id(open_store(run_uri))


def write_report(run_uri: str) -> str:
    """Write `report/index.html` + `summary.json` of a run (also a crashed one); its URI."""
    from tunix_tasks.frontdoor.report import write_report as _write

    return _write(run_uri)


def evaluate_snapshot(
    run_uri: str,
    version: int | None = None,
    *,
    seeds: list[int] | None = None,
    harness: str | None = None,
) -> dict[str, Any]:
    """Score snapshot `version` (default: the latest) on held-out seeds, played by
    `harness` (`env` or `program`; default: the run's `actor.kind`'s); writes eval/."""
    from tunix_tasks.frontdoor.evaluate import evaluate_snapshot as _eval

    return _eval(run_uri, version, seeds=seeds, harness=harness)


def report_after_eval(run_uri: str, version: int) -> str | None:
    """Rewrite the report of a finished run once its last snapshot (`version`) is scored.

    The fleet's `report` task runs when the learner stops, before the evaluation that the
    last snapshot triggers has written `eval/`; this call brings that result into the
    report. Returns the report's URI, or None when the run is still going or `version`
    is not its last snapshot (a later evaluation will do it)."""
    from tunix_tasks.frontdoor.report import latest_version
    from tunix_tasks.storage.runs import is_done

    store = open_store(run_uri)
    if is_done(store) is None or latest_version(store) != version:
        return None
    return write_report(run_uri)


__all__ = [
    "FENCED_EXIT_CODE",
    "ConfigError",
    "Fenced",
    "evaluate_snapshot",
    "learner_progress",
    "mark_done",
    "prepare_run",
    "prepared_run_id",
    "report_after_eval",
    "resume_note",
    "run_actor",
    "run_learner",
    "write_report",
]

"""Learner checkpoints (orbax-checkpoint) and the exactly-once ledger beside them.

A checkpoint at step S holds the params + optimizer state (a pytree, restored with its
sharding) and a JSON `meta` item: step, weights version, the shard stream's position, the
learner's counters. Orbax commits a step atomically (temp dir + rename on disk, a commit
marker on GCS), so a crash mid-save leaves the previous checkpoint as the latest.

The ledger records which episodes were trained or dropped: `learner/ledger/<S>.json`
lists those accounted for in steps (previous checkpoint, S]. It is written just before
the checkpoint S; on restart from checkpoint R, ledger files after R describe work that
is about to be redone and are deleted. The union of the remaining files is therefore the
exact, duplicate-free account of every episode, across any number of crashes
(`accounting.read_ledger` reads it back, without orbax or JAX: the report's reader).

    ckpt = Checkpointer(store)
    restored = ckpt.restore(abstract_state)     # None on a fresh run
    ckpt.save(step, state, meta, ledger_entry)   # returns once the state is off the device
    ckpt.wait()                                   # committed (raises if the write failed)

Saves are asynchronous: `save` blocks only while the state is copied to host memory, then
orbax writes it in the background while training goes on. A save first waits for the
previous one, so at most one is in flight; what depends on a checkpoint being durable (the
deletion of consumed shards) waits for `wait()`. A save or restore that fails in orbax (a
store outage past its retries) raises `CheckpointError`, a `StoreError` that names the step
and the checkpoint still the latest: the learner stops with one line, and the same command
resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from tunix_tasks.config import ConfigError
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore, StoreError
from tunix_tasks.storage.uri import join_uri

log = logging.getLogger(__name__)


class CheckpointError(StoreError):
    """Orbax could not write or read a checkpoint (its own error is the `__cause__`)."""


class _NoTraceback(logging.Filter):
    """gcsfs (orbax's gs:// file system) logs each request it gave up on with a traceback;
    the `CheckpointError` that follows says what failed, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("gcsfs").addFilter(_NoTraceback())


class Checkpointer:
    def __init__(self, store: ObjectStore, *, max_to_keep: int = 3) -> None:
        self._store = store
        self._uri = join_uri(store.uri, RunLayout.CHECKPOINTS)
        self._on_durable: Callable[[], None] | None = None
        self._in_flight: int | None = None  # the step of the save not waited for yet
        self._manager = ocp.CheckpointManager(
            store.orbax_path(RunLayout.CHECKPOINTS),  # a path or URI, per backend
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                enable_async_checkpointing=True,
                # A save cut off by a crash or a store outage leaves an uncommitted step
                # behind; saving that step again on resume must not trip over it.
                cleanup_tmp_directories=True,
            ),
            # Handlers up front (not just names): reading a step's metadata needs them.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        state: nnx.State | dict,
        meta: dict[str, Any],
        ledger: dict[str, Any] | None,
        *,
        on_durable: Callable[[], None] | None = None,
        wait: bool = False,
    ) -> None:
        """Start saving `step`; `on_durable()` runs in `wait()` once it is committed
        (with `wait`, before returning). `ledger` None: a follower process's save
        (multihost.py), which writes its own shards of `state` and nothing else."""
        self.wait()
        if ledger is not None:
            self._store.write_bytes(RunLayout.ledger(step), json.dumps(ledger).encode())
        if jax.process_index() == 0:  # one process cleans up; orbax syncs the others
            self._clear_uncommitted(step)
        pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else _pure(state)
        try:
            self._write(step, pure, meta)
        except Exception as err:
            raise self._failure("written", step, err) from err
        self._in_flight, self._on_durable = step, on_durable
        if wait:
            self.wait()

    def _write(self, step: int, pure: Any, meta: dict[str, Any]) -> None:
        """Orbax's save: on several processes every one calls it (collectives inside);
        the primary process writes `meta` and commits."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(pure), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def wait(self) -> None:
        """Until the last save is committed (then its `on_durable`); raises what its
        background write raised (as a `CheckpointError`)."""
        step, self._in_flight = self._in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._failure("written", step, err) from err
        callback, self._on_durable = self._on_durable, None
        if callback is not None:
            callback()

    def _failure(self, what: str, step: int | None, err: Exception) -> CheckpointError:
        latest = None
        with contextlib.suppress(Exception):  # from orbax's memory: no store access
            latest = self._manager.latest_step()
        return CheckpointError(
            f"checkpoint {step} could not be {what} ({self._uri}): {type(err).__name__}: "
            f"{err}; the latest checkpoint is {latest}, and the same command resumes from it"
        )

    def _clear_uncommitted(self, step: int) -> None:
        """Delete what an earlier save of `step`, cut off by a crash or a store outage,
        left behind. On GCS orbax writes the step's folder in place (OCDBT files and all)
        and saving into such a leftover fails; locally it uses temp folders, which
        `cleanup_tmp_directories` removes."""
        if step in self._manager.all_steps():
            return
        for info in self._store.list(f"{RunLayout.CHECKPOINTS}/{step}/"):
            self._store.delete(info.key)

    def restore(
        self, template: dict, step: int | None = None
    ) -> tuple[dict, dict[str, Any]] | None:
        """(state pytree shaped and sharded like `template`, meta) of `step` (default:
        the latest); None without one. Only the top-level parts of `template` the
        checkpoint holds come back: `template` may offer more (a KL reference the run
        saved or not, as its `kl_coef` was), but must cover every part saved."""
        self.wait()  # a save still in flight: its metadata exists once it is committed
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        pure = _pure(template)
        try:
            on_disk = self._manager.item_metadata(step)["state"]  # names and shapes, no data
        except Exception as err:
            raise self._failure("read", step, err) from err
        saved = set(on_disk)
        if unknown := saved - set(pure):
            raise ValueError(f"checkpoint {step} holds parts {sorted(unknown)} not in template")
        _check_layout(step, dict(on_disk.tree), {n: p for n, p in pure.items() if n in saved})
        abstract = {
            name: jax.tree.map(ocp.utils.to_shape_dtype_struct, part)
            for name, part in pure.items()
            if name in saved
        }
        try:
            got = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as err:
            raise self._failure("read", step, err) from err
        return got["state"], dict(got["meta"])

    def read_meta(self, step: int | None = None) -> dict[str, Any] | None:
        """The `meta` item of `step` (default: the latest) without its state: step,
        version, counters and the stream's position; None without a checkpoint."""
        self.wait()
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as err:
            raise self._failure("read", step, err) from err
        return dict(got["meta"])

    def prune_ledger_after(self, step: int) -> int:
        """Delete ledger files of steps > `step` (work lost with the crash)."""
        removed = 0
        for info in self._store.list(RunLayout.LEDGER):
            name = info.key.rsplit("/", 1)[-1].removesuffix(".json")
            if name.isdigit() and int(name) > step:
                self._store.delete(info.key)
                removed += 1
        return removed

    def close(self) -> None:
        self._manager.close()


def _pure(tree: Any) -> Any:
    """nnx.State leaves -> plain dicts of arrays (what orbax serialises)."""
    if isinstance(tree, nnx.State):
        return nnx.to_pure_dict(tree)
    if isinstance(tree, dict):
        return {k: _pure(v) for k, v in tree.items()}
    return tree


def _paths(tree: Any) -> set[str]:
    def name(key: Any) -> str:
        return str(getattr(key, "key", getattr(key, "idx", key)))

    return {"/".join(map(name, path)) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_layout(step: int, on_disk: dict, template: dict) -> None:
    """A checkpoint whose arrays are not the run's (saved under another
    `learner.param_dtype`, whose optimizer state holds a float32 master copy or not):
    one line naming the difference, not orbax's tree dump."""
    saved, wanted = _paths(on_disk), _paths(template)
    if saved == wanted:
        return
    extra, missing = sorted(saved - wanted), sorted(wanted - saved)
    raise ConfigError(
        f"checkpoint {step} holds another state layout than this run: {len(extra)} arrays "
        f"only in the checkpoint{f' (e.g. {extra[0]})' if extra else ''}, {len(missing)} "
        f"only in this run{f' (e.g. {missing[0]})' if missing else ''}; it was saved under "
        "another learner.param_dtype or optimizer: resume with the run's own config.json, "
        "or give the new run its own name (--run-name NEW)"
    )

"""The multi-host learner: P processes (one per host) train one policy over one global mesh.

Process 0 leads: it alone holds the lease, reads shards, packs batches, accounts (the
ledger), writes metrics, publishes weights and decides when to step, publish, checkpoint
and stop. The other processes follow: they hold the model, the optimizer and their
orbax checkpointer, nothing else, and run what the leader announces. Every collective
(the update's all-gathers and reductions, gathering params to publish, orbax's barriers)
must be entered by all processes in the same order or they deadlock, so the leader
announces each one over `Channel` just before running it itself:

    STEP(supervised)   the packed batch, broadcast whole; each process keeps its rows
    GATHER             all-gather the trained params (the leader publishes them)
    FREEZE_REFERENCE   RESTORE(step)   SAVE(step)   STOP(failed)

`LeaderTrainer` / `LeaderCheckpointer` are the `Trainer` / `Checkpointer` that announce;
`follow` is a follower's whole life. A single process uses neither (nothing changes).

    group = process_group()          # TUNIX_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID
    if group: initialize(group)      # before any other JAX use
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from tunix_tasks.config import RunConfig
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.packing import PackedBatch
from tunix_tasks.learner.train_step import Pending, Trainer, make_mesh
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.model import Transformer
from tunix_tasks.storage.store import ObjectStore

log = logging.getLogger(__name__)

ENV_COORDINATOR = "TUNIX_COORDINATOR_ADDRESS"  # host:port of process 0
ENV_NUM_PROCESSES = "TUNIX_NUM_PROCESSES"
ENV_PROCESS_ID = "TUNIX_PROCESS_ID"
ENV_HEARTBEAT = "TUNIX_HEARTBEAT_TIMEOUT_S"
#: A process whose peer stopped sending heartbeats this long is terminated by the JAX
#: coordination service (JAX's default, 100 s, leaves a dead host's peers idle longer).
HEARTBEAT_TIMEOUT_S = 30


@dataclass(frozen=True)
class ProcessGroup:
    coordinator: str
    num_processes: int
    process_id: int

    @property
    def leader(self) -> bool:
        return self.process_id == 0


def process_group(env: Mapping[str, str] = os.environ) -> ProcessGroup | None:
    """The process wiring from the environment (dags/tunix_k8s.py sets it); None for a
    single process (`TUNIX_NUM_PROCESSES` unset or 1)."""
    n = int(env.get(ENV_NUM_PROCESSES) or 1)
    if n <= 1:
        return None
    missing = [k for k in (ENV_COORDINATOR, ENV_PROCESS_ID) if not env.get(k)]
    if missing:
        raise ValueError(f"{ENV_NUM_PROCESSES}={n} needs {' and '.join(missing)} as well")
    pid = int(env[ENV_PROCESS_ID])
    if not 0 <= pid < n:
        raise ValueError(f"{ENV_PROCESS_ID}={pid} is not in [0, {n})")
    return ProcessGroup(env[ENV_COORDINATOR], n, pid)


def initialize(group: ProcessGroup, env: Mapping[str, str] = os.environ) -> None:
    """Join the group: call before any other JAX use (it fixes the device list)."""
    # CPU processes exchange collectives over TCP (gloo); accelerators ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = int(float(env.get(ENV_HEARTBEAT) or HEARTBEAT_TIMEOUT_S))
    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        heartbeat_timeout_seconds=heartbeat,
    )
    log.info(
        "learner process %d of %d (coordinator %s, heartbeat timeout %ds)",
        group.process_id,
        group.num_processes,
        group.coordinator,
        heartbeat,
    )


class Op(enum.IntEnum):
    STEP = 1
    GATHER = 2
    FREEZE_REFERENCE = 3
    RESTORE = 4
    SAVE = 5
    STOP = 6


#: A STEP's arrays on the wire (`Trainer.host_batch`): every process must expect the
#: same shapes and dtypes.
WIRE_DTYPES: dict[str, Any] = {
    **dict.fromkeys(("tokens", "positions", "segment_ids", "targets", "lag"), np.int32),
    **dict.fromkeys(("loss_mask", "behavior_logprobs", "advantages"), np.float32),
}
_HEADER = 4  # op and up to 3 integer arguments


class LeaderFailed(RuntimeError):
    """The leader stopped with an error; a follower exits with one too."""


class Channel:
    """Announcements from process 0 to all: a fixed-size header, then a STEP's batch.
    Each call is a broadcast (a collective), so the leader's `send`s and the followers'
    `receive`s pair up one to one, in order."""

    def send(self, op: Op, *args: int) -> None:
        header = np.zeros(_HEADER, np.int32)
        header[0], header[1 : 1 + len(args)] = op, args
        multihost_utils.broadcast_one_to_all(header)

    def send_batch(self, arrays: dict[str, np.ndarray], *, supervised: bool) -> dict[str, Any]:
        """Broadcast a `host_batch`; returns it as every process now holds it."""
        rows, cols = arrays["tokens"].shape
        self.send(Op.STEP, int(supervised), rows, cols)
        wire = {name: np.asarray(arrays[name], dtype) for name, dtype in WIRE_DTYPES.items()}
        return multihost_utils.broadcast_one_to_all(wire)

    def receive(self) -> tuple[Op, list[int], dict[str, Any] | None]:
        header = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32))
        op, args = Op(int(header[0])), [int(a) for a in header[1:]]
        batch = None
        if op is Op.STEP:
            zeros = {name: np.zeros(args[1:3], dtype) for name, dtype in WIRE_DTYPES.items()}
            batch = multihost_utils.broadcast_one_to_all(zeros)
        return op, args, batch


def _identity(x: jax.Array) -> jax.Array:
    return x  # module level: jit caches its compilations by function


def gather_flat_params(trainer: Trainer) -> dict[str, np.ndarray]:
    """`Trainer.flat_params` of a model sharded over several processes: every process
    replicates each tensor in turn (an all-gather), so at most one full tensor per device
    exists at a time; the order is the same everywhere."""
    replicated = NamedSharding(trainer.mesh, P())
    flat = {}
    for path, var in nnx.to_flat_state(nnx.state(trainer.model, trainer.trained)):
        full = jax.jit(_identity, out_shardings=replicated)(var[...])
        flat["/".join(str(p) for p in path)] = np.asarray(full.addressable_data(0), np.float32)
    return dict(sorted(flat.items()))


class LeaderTrainer(Trainer):
    """Process 0's `Trainer`: each collective operation is announced to the followers."""

    def __init__(self, cfg: RunConfig, model: Transformer, *, mesh: Mesh, channel: Channel) -> None:
        super().__init__(cfg, model, mesh=mesh)
        self.channel = channel

    def dispatch(
        self, batch: PackedBatch, *, supervised: bool = False, lag: ArrayLike | None = None
    ) -> Pending:
        t0 = time.perf_counter()
        arrays = self.channel.send_batch(self.host_batch(batch, lag), supervised=supervised)
        return self.dispatch_arrays(arrays, supervised=supervised, t0=t0)

    def flat_params(self) -> dict[str, np.ndarray]:
        self.channel.send(Op.GATHER)
        return gather_flat_params(self)

    def snapshot_params(self) -> dict[str, np.ndarray]:
        return self.flat_params()  # a collective gather: every process takes part at once

    def freeze_reference(self) -> None:
        self.channel.send(Op.FREEZE_REFERENCE)
        super().freeze_reference()


class LeaderCheckpointer(Checkpointer):
    """Process 0's `Checkpointer`: restores and saves are announced (every process reads
    and writes its own shards; this one also writes the ledger and the meta)."""

    def __init__(self, store: ObjectStore, channel: Channel) -> None:
        super().__init__(store)
        self.channel = channel

    def restore(
        self, template: dict, step: int | None = None
    ) -> tuple[dict, dict[str, Any]] | None:
        step = self.latest_step() if step is None else step
        self.channel.send(Op.RESTORE, -1 if step is None else step)
        return super().restore(template, step)

    def _write(self, step: int, pure: Any, meta: dict[str, Any]) -> None:
        # Announced after the ledger is written: a failure before this point leaves the
        # followers waiting for the next announcement, not inside orbax's barriers.
        self.channel.send(Op.SAVE, step)
        super()._write(step, pure, meta)


def make_trainer(cfg: RunConfig, channel: Channel | None = None) -> Trainer:
    """The policy on the (global) device mesh and its `Trainer`; the leader's with a
    `channel`. Every process builds it the same way from the same seed."""
    mesh = make_mesh(cfg.learner.mesh)
    # A checkpoint's tensors go straight into their shards on this mesh (policy/hf_checkpoint).
    _, model = build_policy(
        cfg.model, seed=cfg.seed, compute_dtype=cfg.learner.compute_dtype, mesh=mesh
    )
    if channel is None:
        return Trainer(cfg, model, mesh=mesh)
    return LeaderTrainer(cfg, model, mesh=mesh, channel=channel)


def follow(cfg: RunConfig, store: ObjectStore) -> dict[str, Any]:
    """A follower's life: the same trainer and checkpointer as the leader (built in the
    same order: orbax's constructor is a collective too), then the leader's
    announcements until STOP. It reads no shards and writes only its checkpoint shards."""
    trainer = make_trainer(cfg)
    ckpt = Checkpointer(store)
    channel = Channel()
    steps = 0
    try:
        while True:
            op, args, batch = channel.receive()
            if op is Op.STEP:
                trainer.dispatch_arrays(batch, supervised=bool(args[0]))
                steps += 1
            elif op is Op.GATHER:
                gather_flat_params(trainer)
            elif op is Op.FREEZE_REFERENCE:
                trainer.freeze_reference()
            elif op is Op.RESTORE and args[0] >= 0:
                trainer.load_state(ckpt.restore(trainer.checkpoint_template(), args[0])[0])
            elif op is Op.SAVE:
                ckpt.save(args[0], trainer.state(), {}, None)
            elif op is Op.STOP:
                if args[0]:
                    raise LeaderFailed("the leader (process 0) stopped with an error")
                return {"process": jax.process_index(), "steps": steps}
    finally:
        ckpt.close()

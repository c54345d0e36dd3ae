"""The learner's compute: device mesh, sharded policy + optimizer, one jitted update.

`Trainer` owns the model and the Optax optimizer, laid out over a ("data", "fsdp") mesh:
parameters are sharded along "fsdp" (their annotations in model.py), batches along both
axes. `step(batch)` runs one update on a `PackedBatch`; the jitted function is traced once
per bucket shape (and per loss kind), and `compile_count` says how often that happened.

    trainer = Trainer(cfg, model)
    metrics = trainer.step(packed_batch, supervised=False)
    flat = trainer.flat_params()          # for a weight snapshot
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_tasks.config import LearnerConfig, MeshConfig, RunConfig
from tunix_tasks.learner.packing import PackedBatch
from tunix_tasks.learner.rl_math import policy_loss, truncated_importance_weights
from tunix_tasks.policy.distribution import chunked_target_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params

log = logging.getLogger(__name__)

BATCH_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "targets",
    "loss_mask",
    "behavior_logprobs",
    "advantages",
)


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh; -1 on one axis takes the remaining devices."""
    devices = devices if devices is not None else jax.devices()
    n = len(devices)
    data, fsdp = cfg.data, cfg.fsdp
    if data == -1:
        data = n // fsdp if fsdp > 0 and n % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = n // data if data > 0 and n % data == 0 else 0
    if data <= 0 or fsdp <= 0 or data * fsdp != n:
        raise ValueError(
            f"mesh data={cfg.data} x fsdp={cfg.fsdp} does not fit {n} devices; "
            "use -1 on one axis or sizes whose product is the device count"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def make_optimizer(
    cfg: LearnerConfig, *, warm_start_steps: int = 0
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping. The first `warm_start_steps` (supervised) use
    `warm_start_learning_rate`; RL then uses `learning_rate` (with optional linear warm-up)."""
    rl_lr: Any = cfg.learning_rate
    if cfg.warmup_steps:
        rl_lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    lr: Any = rl_lr
    if warm_start_steps and cfg.warm_start_learning_rate is not None:
        lr = optax.join_schedules(
            [
                optax.constant_schedule(cfg.warm_start_learning_rate),
                rl_lr if callable(rl_lr) else optax.constant_schedule(rl_lr),
            ],
            boundaries=[warm_start_steps],
        )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay),
    )


def _loss(model: Transformer, batch: dict[str, jax.Array], hp: dict[str, Any], supervised: bool):
    hidden = model.final_hidden(
        batch["tokens"], batch["positions"], batch["segment_ids"], remat=hp["remat"]
    )
    # The distribution the actors sampled from (same temperature AND top-k), a chunk of
    # positions at a time: [rows, T, V] logits never exist at once.
    logp = chunked_target_logprobs(
        hidden,
        model.output_matrix(),
        batch["targets"],
        hp["temperature"],
        hp["top_k"],
        chunk=hp["logits_chunk"],
    )
    mask = batch["loss_mask"]
    if supervised:
        # Demonstrations: maximum likelihood on the policy tokens (REINFORCE with A=1, w=1).
        w = mask
        adv = mask
        stats = {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_frac": 0.0}
        loss, m = policy_loss(logp, logp, adv, mask, w, ppo_clip=0.0)
    else:
        w, stats = truncated_importance_weights(
            logp,
            batch["behavior_logprobs"],
            mask,
            rho_max=hp["rho_max"],
            level=hp["is_level"],
            segment_ids=batch["segment_ids"] if hp["is_level"] == "sequence" else None,
        )
        loss, m = policy_loss(
            logp, batch["behavior_logprobs"], batch["advantages"], mask, w, ppo_clip=hp["ppo_clip"]
        )
    nll = -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {**m, **stats, "nll": nll}


class Trainer:
    """Sharded model + optimizer + the jitted update step (one compile per bucket)."""

    def __init__(self, cfg: RunConfig, model: Transformer, *, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh or make_mesh(cfg.learner.mesh)
        n_batch_shards = self.mesh.size
        if cfg.learner.batch_rows % n_batch_shards:
            raise ValueError(
                f"learner.batch_rows={cfg.learner.batch_rows} must be divisible by the "
                f"{n_batch_shards} devices of the mesh"
            )
        self._hp = {
            "temperature": float(cfg.actor.temperature),
            "top_k": int(cfg.actor.top_k),
            "remat": bool(cfg.learner.remat),
            "logits_chunk": int(cfg.learner.logits_chunk),
            "rho_max": float(cfg.learner.rho_max),
            "is_level": cfg.learner.is_level,
            "ppo_clip": float(cfg.learner.ppo_clip),
        }
        self.model = model
        # With LoRA only the adapters train: gradients, optimizer state and snapshots are
        # theirs alone, and the base stays as loaded.
        self.trained = nnx.LoRAParam if model.lora is not None else nnx.Param
        self.optimizer = nnx.Optimizer(
            self.model,
            make_optimizer(cfg.learner, warm_start_steps=cfg.warm_start_steps),
            wrt=self.trained,
        )
        # Lay out params and optimizer state once, as the jitted step returns them: inputs
        # whose sharding differs from the outputs would force a second compilation.
        self._shard(self.model)
        self._shard(self.optimizer)
        self._batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp"), None))
        self.traces: dict[str, int] = {}
        self._step_fns = {
            kind: nnx.jit(self._make_step(kind == "supervised", kind), donate_argnums=(0, 1))
            for kind in ("rl", "supervised")
        }
        self.steps = 0

    def _shard(self, node: nnx.Module | nnx.Optimizer) -> None:
        state = nnx.state(node)
        specs = nnx.get_partition_spec(state)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        nnx.update(node, jax.device_put(state, shardings))

    def _make_step(self, supervised: bool, kind: str):
        hp = self._hp

        def step(model: Transformer, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]):
            self.traces[kind] = self.traces.get(kind, 0) + 1  # runs only while tracing
            grad_fn = nnx.value_and_grad(
                lambda m: _loss(m, batch, hp, supervised),
                argnums=nnx.DiffState(0, self.trained),
                has_aux=True,
            )
            (loss, metrics), grads = grad_fn(model)
            optimizer.update(model, grads)
            metrics["grad_norm"] = optax.global_norm(grads)
            metrics["loss"] = loss
            return metrics

        return step

    @property
    def compile_count(self) -> int:
        """XLA compilations of the RL update (bounded by the number of buckets)."""
        return self.traces.get("rl", 0)

    @property
    def total_compiles(self) -> int:
        return sum(self.traces.values())

    def device_batch(self, batch: PackedBatch) -> dict[str, jax.Array]:
        return {
            name: jax.device_put(np.asarray(getattr(batch, name)), self._batch_sharding)
            for name in BATCH_FIELDS
        }

    def dispatch(
        self, batch: PackedBatch, *, supervised: bool = False
    ) -> tuple[dict[str, jax.Array], float]:
        """Start one optimizer update and return at once (JAX dispatch is asynchronous),
        so the host can prepare the next batch while the device computes."""
        t0 = time.perf_counter()
        arrays = self.device_batch(batch)
        with jax.set_mesh(self.mesh):
            metrics = self._step_fns["supervised" if supervised else "rl"](
                self.model, self.optimizer, arrays
            )
        return metrics, t0

    def collect(self, pending: tuple[dict[str, jax.Array], float]) -> dict[str, float]:
        """Wait for a dispatched update; returns float metrics, `step_s` from dispatch."""
        metrics, t0 = pending
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.steps += 1
        out["step_s"] = time.perf_counter() - t0
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"non-finite loss {out['loss']} at trainer step {self.steps}")
        return out

    def step(self, batch: PackedBatch, *, supervised: bool = False) -> dict[str, float]:
        """One optimizer update; blocks until done; returns float metrics."""
        return self.collect(self.dispatch(batch, supervised=supervised))

    def flat_params(self) -> dict[str, np.ndarray]:
        """What a snapshot holds: the trained params (with LoRA, the adapters alone)."""
        return flat_params(self.model, self.trained)

    # -- checkpoint state ---------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Pytree of everything the optimizer needs to resume (params + opt state)."""
        return {"model": nnx.state(self.model, nnx.Param), "opt": nnx.state(self.optimizer)}

    def restore_state(self, state: dict[str, Any]) -> None:
        nnx.update(self.model, state["model"])
        nnx.update(self.optimizer, state["opt"])

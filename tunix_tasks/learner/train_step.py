"""The learner's compute: device mesh, sharded policy + optimizer, one jitted update.

`Trainer` owns the model and the Optax optimizer, laid out over a ("data", "fsdp") mesh:
parameters are sharded along "fsdp" (their annotations in model.py), batches along both
axes. `step(batch)` runs one batch's updates (`learner.updates_per_batch`, default 1) on a
`PackedBatch`; the jitted function is traced once per bucket shape (and per loss kind), and
`compile_count` says how often that happened. The loss is the configured correction's
(`tunix_tasks.learner.objective`), plus `rl_math`'s stability terms. Params are held in
`learner.param_dtype` (bfloat16: with a float32 master copy in the optimizer state).

    trainer = Trainer(cfg, model)
    metrics = trainer.step(packed_batch, supervised=False)
    flat = trainer.flat_params()          # the trained params, as float32 numpy
    host = trainer.snapshot_params()      # for a weight snapshot: host copies, not waited for
    trainer.lower_step(packed_batch).compile().memory_analysis()   # XLA's accounting
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from tunix_tasks.config import LearnerConfig, MeshConfig, RunConfig
from tunix_tasks.learner.master_copy import with_master_copy
from tunix_tasks.learner.objective import (
    Correction,
    CorrectionParams,
    get_correction,
    policy_loss,
)
from tunix_tasks.learner.packing import PackedBatch
from tunix_tasks.learner.rl_math import finite_logprobs, regularized_loss, staleness_stats
from tunix_tasks.policy.distribution import chunked_target_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params, host_params
from tunix_tasks.policy.precision import cast_params

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
    `warm_start_learning_rate`; RL then uses `learning_rate` (with optional linear warm-up).
    `param_dtype` bfloat16: all of it on a float32 master copy (`learner/master_copy.py`)."""
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
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay),
    )
    # bf16 params: AdamW (and the clipping) run on a float32 master copy of them.
    return with_master_copy(tx) if cfg.param_dtype != "float32" else tx


@dataclasses.dataclass(frozen=True)
class StepParams:
    """What the jitted update reads from the config, resolved once (the correction too:
    an unknown or unimportable `learner.correction` fails when the trainer is built)."""

    temperature: float  # the actors' sampling distribution: temperature and top-k
    top_k: int
    remat: bool
    logits_chunk: int
    attention_block: int
    scan_layers: bool
    correction: Correction
    correction_params: CorrectionParams
    updates: int  # updates_per_batch
    kl_coef: float
    entropy_coef: float

    @classmethod
    def from_config(cls, cfg: RunConfig) -> StepParams:
        lc = cfg.learner
        return cls(
            temperature=float(cfg.actor.temperature),
            top_k=int(cfg.actor.top_k),
            remat=bool(lc.remat),
            logits_chunk=int(lc.logits_chunk),
            attention_block=int(lc.attention_block),
            scan_layers=bool(lc.scan_layers),
            correction=get_correction(lc.correction),
            correction_params=CorrectionParams.from_config(lc),
            updates=int(lc.updates_per_batch),
            kl_coef=float(lc.kl_coef),
            entropy_coef=float(lc.entropy_coef),
        )


def _target_logprobs(
    model: Transformer, batch: dict[str, jax.Array], hp: StepParams, *, with_entropy: bool
) -> tuple[jax.Array, jax.Array | None]:
    hidden = model.final_hidden(
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
        remat=hp.remat,
        attention_block=hp.attention_block,
        scan_layers=hp.scan_layers,
    )
    # The distribution the actors sampled from (same temperature AND top-k), a chunk of
    # positions at a time: [rows, T, V] logits never exist at once.
    out = chunked_target_logprobs(
        hidden,
        model.output_matrix(),
        batch["targets"],
        hp.temperature,
        hp.top_k,
        chunk=hp.logits_chunk,
        with_entropy=with_entropy,
    )
    return out if isinstance(out, tuple) else (out, None)


def _loss(
    model: Transformer,
    batch: dict[str, jax.Array],
    hp: StepParams,
    supervised: bool,
    logp_prox: jax.Array | None = None,
    logp_ref: jax.Array | None = None,
):
    with_entropy = hp.entropy_coef > 0 and not supervised
    logp, entropy = _target_logprobs(model, batch, hp, with_entropy=with_entropy)
    mask = batch["loss_mask"]
    if supervised:
        # Demonstrations: maximum likelihood on the policy tokens (REINFORCE with A=1, w=1).
        loss, m = policy_loss(logp, logp, mask, mask, correction="none")
    else:
        blp = batch["behavior_logprobs"]
        loss, m = policy_loss(
            logp,
            blp,
            batch["advantages"],
            mask,
            correction=hp.correction.name,
            params=hp.correction_params,
            logp_prox=logp_prox,
            segment_ids=batch["segment_ids"],
        )
        loss, extra = regularized_loss(
            loss,
            logp,
            mask,
            logp_ref=logp_ref,
            entropy=entropy,
            kl_coef=hp.kl_coef,
            entropy_coef=hp.entropy_coef,
            logp_behavior=blp,  # the KL term's tokens came from mu: importance-weighted
            rho_max=hp.correction_params.rho_max,
        )
        m.update(extra)
        rho_max = hp.correction_params.rho_max
        m.update(staleness_stats(logp, blp, mask, batch["lag"], rho_max=rho_max))
    nll = -jnp.sum(finite_logprobs(logp, mask)) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {**m, "nll": nll, "logp": jax.lax.stop_gradient(logp)}


#: Step metrics averaged over the batch's updates (`updates_per_batch`); every other
#: metric is the first update's: the policy as it received the batch.
_PER_UPDATE = ("loss", "pg_loss", "grad_norm", "ppo_clip_frac")


class _ReadyClock:
    """When a dispatched step's results become ready: a thread blocks on them (the GIL is
    released while it waits), so the host can pack the next batch meanwhile. Device time
    is then launch -> ready, not the host work the step's clock overlaps."""

    def __init__(self, arrays: Any) -> None:
        self._at = 0.0
        self._thread = threading.Thread(target=self._wait, args=(arrays,), daemon=True)
        self._thread.start()

    def _wait(self, arrays: Any) -> None:
        jax.block_until_ready(arrays)
        self._at = time.perf_counter()

    def wait(self) -> float:
        self._thread.join()
        return self._at


@dataclasses.dataclass(frozen=True)
class Pending:
    """A dispatched step (`Trainer.dispatch`), for `Trainer.collect`."""

    metrics: dict[str, jax.Array]
    t0: float  # the step's clock started (before host packing)
    launched: float  # the computation was handed to the device
    ready: _ReadyClock


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
        self.step_params = StepParams.from_config(cfg)
        self.model = model
        # With LoRA only the adapters train: gradients, optimizer state and snapshots are
        # theirs alone, and the base stays as loaded.
        self.trained = nnx.LoRAParam if model.lora is not None else nnx.Param
        # `learner.param_dtype`: the params (a LoRA base too) held in it before the
        # optimizer takes its float32 master copy of the trained ones.
        cast_params(self.model, cfg.learner.param_dtype)
        self.optimizer = nnx.Optimizer(
            self.model,
            make_optimizer(cfg.learner, warm_start_steps=cfg.warm_start_steps),
            wrt=self.trained,
        )
        # Lay out params and optimizer state once, as the jitted step returns them: inputs
        # whose sharding differs from the outputs would force a second compilation.
        self._shard(self.model)
        self._shard(self.optimizer)
        # The KL penalty's frozen reference: the trained params as RL starts (with LoRA
        # the adapters alone, the base being frozen anyway). Re-taken after a warm start.
        self.reference = self._trained_copy() if cfg.learner.kl_coef > 0 else None
        self._batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp"), None))
        self.traces: dict[str, int] = {}
        self._step_fns = {
            kind: nnx.jit(self._make_step(kind == "supervised", kind), donate_argnums=(0, 1))
            for kind in ("rl", "supervised")
        }
        self.steps = 0
        self._last_ready = 0.0  # when the last collected step's result was ready

    def _shard(self, node: nnx.Module | nnx.Optimizer) -> None:
        state = nnx.state(node)
        specs = nnx.get_partition_spec(state)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        nnx.update(node, jax.device_put(state, shardings))

    def _trained_copy(self) -> nnx.State:
        return jax.tree.map(jnp.copy, nnx.state(self.model, self.trained))

    def freeze_reference(self) -> None:
        """Take the KL reference from the current params (RL starts now)."""
        if self.reference is not None:
            self.reference = self._trained_copy()

    def _make_step(self, supervised: bool, kind: str):
        hp = self.step_params
        updates = 1 if supervised else hp.updates

        def step(model, optimizer, batch, reference):
            self.traces[kind] = self.traces.get(kind, 0) + 1  # runs only while tracing
            logp_ref = None
            if reference is not None and not supervised:
                graph, _, rest = nnx.split(model, self.trained, ...)
                ref_model = nnx.merge(graph, reference, rest)
                logp_ref = jax.lax.stop_gradient(
                    _target_logprobs(ref_model, batch, hp, with_entropy=False)[0]
                )
            prox = None  # needs_proximal: log-probs of the params before this batch
            runs = []
            for _ in range(updates):  # unrolled: updates_per_batch is small and static
                grad_fn = nnx.value_and_grad(
                    lambda m, prox=prox: _loss(m, batch, hp, supervised, prox, logp_ref),
                    argnums=nnx.DiffState(0, self.trained),
                    has_aux=True,
                )
                (loss, metrics), grads = grad_fn(model)
                optimizer.update(model, grads)
                logp = metrics.pop("logp")
                prox = logp if prox is None and hp.correction.needs_proximal else prox
                runs.append({**metrics, "grad_norm": optax.global_norm(grads), "loss": loss})
            out = runs[0]
            for key in _PER_UPDATE:
                out[key] = jnp.mean(jnp.stack([r[key] for r in runs]))
            return out

        return step

    @property
    def compile_count(self) -> int:
        """XLA compilations of the RL update (bounded by the number of buckets)."""
        return self.traces.get("rl", 0)

    @property
    def total_compiles(self) -> int:
        return sum(self.traces.values())

    def host_batch(self, batch: PackedBatch, lag: ArrayLike | None = None) -> dict[str, np.ndarray]:
        """The batch's arrays in host memory, with each token's `lag`: the learner steps
        since its episode's behaviour weights (one value per episode,
        `staleness.updates_since`; None: 0), which bucket the mismatch metrics."""
        arrays = {name: np.asarray(getattr(batch, name)) for name in BATCH_FIELDS}
        arrays["lag"] = batch.per_token(lag)
        return arrays

    def device_batch(
        self, batch: PackedBatch, lag: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        """The batch's arrays on the mesh (`host_batch`, placed)."""
        return self._place(self.host_batch(batch, lag))

    def _place(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        # On several processes every one passes the whole batch and keeps its own rows.
        return {name: jax.device_put(value, self._batch_sharding) for name, value in arrays.items()}

    def dispatch(
        self, batch: PackedBatch, *, supervised: bool = False, lag: ArrayLike | None = None
    ) -> Pending:
        """Start one batch's updates and return at once (JAX dispatch is asynchronous),
        so the host can prepare the next batch while the device computes. `lag`: per
        episode, the learner steps since its behaviour weights (`host_batch`)."""
        t0 = time.perf_counter()
        return self.dispatch_arrays(self.host_batch(batch, lag), supervised=supervised, t0=t0)

    def dispatch_arrays(
        self, arrays: dict[str, np.ndarray], *, supervised: bool = False, t0: float | None = None
    ) -> Pending:
        """`dispatch` of a `host_batch` (`t0`: when the step's clock started)."""
        t0 = time.perf_counter() if t0 is None else t0
        placed = self._place(arrays)
        launched = time.perf_counter()
        with jax.set_mesh(self.mesh):
            metrics = self._step_fns["supervised" if supervised else "rl"](
                self.model, self.optimizer, placed, self.reference
            )
        return Pending(metrics, t0, launched, _ReadyClock(metrics))

    def lower_step(
        self, batch: PackedBatch, *, supervised: bool = False, lag: ArrayLike | None = None
    ) -> jax.stages.Lowered:
        """The update `step` runs on `batch`'s shape, lowered but neither compiled nor run:
        `.compile().memory_analysis()` / `.cost_analysis()` are XLA's accounting of it
        (temp, argument and output bytes; FLOPs). Lowering traces the step once more,
        which `traces` counts."""
        placed = self.device_batch(batch, lag)
        with jax.set_mesh(self.mesh):
            return self._step_fns["supervised" if supervised else "rl"].lower(
                self.model, self.optimizer, placed, self.reference
            )

    def collect(self, pending: Pending) -> dict[str, float]:
        """Wait for a dispatched update; returns float metrics, `step_s` from dispatch
        (host packing included) and `device_s`: from launch to the result being ready,
        less any part of it the previous step's computation still held the device."""
        out = {k: float(v) for k, v in jax.device_get(pending.metrics).items()}
        self.steps += 1
        fetched = time.perf_counter()
        out["step_s"] = fetched - pending.t0
        # The waiter thread stamps the time only once it gets the GIL back, which can be
        # after this thread already fetched the results: they were ready by `fetched`.
        ready = min(pending.ready.wait(), fetched)
        out["device_s"] = max(0.0, ready - max(pending.launched, self._last_ready))
        self._last_ready = ready
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"non-finite loss {out['loss']} at trainer step {self.steps}")
        return out

    def step(
        self, batch: PackedBatch, *, supervised: bool = False, lag: ArrayLike | None = None
    ) -> dict[str, float]:
        """One batch's updates; blocks until done; returns float metrics."""
        return self.collect(self.dispatch(batch, supervised=supervised, lag=lag))

    def flat_params(self) -> dict[str, np.ndarray]:
        """What a snapshot holds: the trained params (with LoRA, the adapters alone)."""
        return flat_params(self.model, self.trained)

    def snapshot_params(self) -> dict[str, ArrayLike]:
        """`flat_params` for a snapshot, without waiting on the step's path: the copies to
        host memory are queued, and the publisher's thread waits for them
        (`policy.params.host_params`)."""
        return host_params(self.model, self.trained)

    # -- checkpoint state ---------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Pytree of everything the optimizer needs to resume (params + opt state, and
        the KL reference when there is one)."""
        state = {"model": nnx.state(self.model, nnx.Param), "opt": nnx.state(self.optimizer)}
        if self.reference is not None:
            state["reference"] = self.reference
        return state

    def checkpoint_template(self) -> dict[str, Any]:
        """What to restore a checkpoint into: `state()`, with a KL reference slot (the
        trained params' shapes and shardings) even without `kl_coef`, since a checkpoint
        saved under another `kl_coef` may hold one (`Checkpointer.restore` takes only the
        parts saved)."""
        template = self.state()
        template.setdefault("reference", nnx.state(self.model, self.trained))
        return template

    def load_state(self, pure: dict[str, Any]) -> None:
        """Take the state a checkpoint restored (`state()`'s layout, as plain dicts).
        `kl_coef` changed since the save: a reference this run does not use is ignored;
        one it needs and the checkpoint lacks is taken from the restored params."""
        target = self.state()  # {"model": State, "opt": State, ...}: fill each in turn
        fresh_reference = "reference" in target and "reference" not in pure
        if fresh_reference:
            del target["reference"]
        elif "reference" in pure and "reference" not in target:
            log.info("checkpoint has a KL reference; learner.kl_coef is 0: not using it")
        for name, part in target.items():
            nnx.replace_by_pure_dict(part, pure[name])
        self.restore_state(target)
        if fresh_reference:
            log.info(
                "checkpoint saved with learner.kl_coef 0 has no KL reference: "
                "taking it from the restored params"
            )
            self.reference = self._trained_copy()

    def restore_state(self, state: dict[str, Any]) -> None:
        nnx.update(self.model, state["model"])
        nnx.update(self.optimizer, state["opt"])
        if self.reference is not None and "reference" in state:
            self.reference = state["reference"]

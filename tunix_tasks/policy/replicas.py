"""`SamplerReplicas`: one `Sampler` per local device, serving episodes side by side.

Data-parallel sampling. Each replica is a whole `Sampler` (its own copy of the weights,
slot cache and decode working set) on its own device, and they step at the same time, one
thread each (JAX releases the GIL while a program runs). A session (an episode) stays on
the replica that served its first turn, where its KV cache is; a new one goes to the
replica with the fewest requests. On a CPU this is how a sampler uses more than one core:
XLA:CPU runs a program's ops one after another, so a decode step alternates a memory-bound
read of the KV cache with compute-bound matmuls on one core, while two programs on two CPU
devices overlap one's matmuls with the other's cache read (`sampler_devices` asks JAX for
CPU devices before it starts). On accelerators it spreads the rows over the host's chips.

    samplers = SamplerReplicas([Sampler(model, device=d, ...) for d in sampler_devices(2)])
    samplers.submit(context, max_new_tokens=16, session="ep-7", on_done=callback)
    while samplers.busy:
        samplers.step()                      # every busy replica decodes a segment at once
    samplers.update_params(flat, version=3)  # loaded once, adopted by every replica

Randomness is per row (`decoding` module docstring), so a request's sample does not depend
on the replica that serves it. `on_done` callbacks run on the replicas' threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.requests import BlockingSample, Sample, SamplerStats
from tunix_tasks.policy.sampling import Sampler

__all__ = ["SamplerReplicas", "replicate", "sampler_devices"]


def sampler_devices(n: int) -> list[jax.Device]:
    """The first `n` local devices. In a process where JAX has not started yet, a CPU
    backend is asked for `n` devices first (on an accelerator host they are the chips),
    unless XLA_FLAGS already sets the count."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Once JAX has started this raises, and the process keeps the devices it has.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", n)
    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(
            f"{n} sampler replicas need {n} local devices; this process has {len(devices)} "
            f"({devices[0].platform}) and JAX started before they could be added: ask "
            f"before the first JAX call, or set XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return devices[:n]


def replicate(
    make: Callable[[jax.Device | None, int], Sampler], max_sequences: int, replicas: int = 1
) -> Sampler | SamplerReplicas:
    """A sampler with `max_sequences` slots built by `make(device, slots)`: one on the
    default device, or with `replicas` > 1 one per local device (`sampler_devices`), the
    slots split among them (rounded up)."""
    if replicas == 1:
        return make(None, max_sequences)
    slots = -(-max_sequences // replicas)
    return SamplerReplicas([make(device, slots) for device in sampler_devices(replicas)])


class SamplerReplicas(BlockingSample):
    """`Sampler`'s interface over replicas that share one model object (module docstring)."""

    def __init__(self, replicas: Sequence[Sampler]) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        if any(r.model is not replicas[0].model for r in replicas):
            raise ValueError("replicas must share one model object (weights load into it once)")
        self.replicas = tuple(replicas)
        first = self.replicas[0]
        self.max_seq_len = first.max_seq_len
        self.batch_buckets, self.prompt_buckets = first.batch_buckets, first.prompt_buckets
        self.segment_steps, self.pad_id = first.segment_steps, first.pad_id
        self.max_sequences = sum(r.max_sequences for r in self.replicas)
        # A session's replica, least recently used first; bounded like the slots (a
        # session forgotten here has lost its cache slot too, and only re-prefills).
        self._home: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(self.replicas), thread_name_prefix="sampler-replica"
        )

    @property
    def model(self) -> Transformer:
        return self.replicas[0].model

    @property
    def version(self) -> int:
        return self.replicas[0].version

    @property
    def stats(self) -> SamplerStats:
        return sum((r.stats for r in self.replicas), SamplerStats())

    @property
    def compile_count(self) -> int:
        return sum(r.compile_count for r in self.replicas)

    @property
    def busy(self) -> bool:
        return any(r.busy for r in self.replicas)

    @property
    def active_rows(self) -> int:
        return sum(r.active_rows for r in self.replicas)

    @property
    def load(self) -> int:
        return sum(r.load for r in self.replicas)

    def seed(self, rng: jax.Array) -> None:
        for r in self.replicas:
            r.seed(rng)

    def update_params(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        version: int = -1,
        only: type[nnx.Variable] = nnx.Param,
        digest: str = "",
        created_at: float = 0.0,
    ) -> None:
        """`Sampler.update_params` for every replica: checked and loaded into the shared
        model once (a bad snapshot leaves them all on the old weights), then adopted."""
        self.replicas[0].update_params(flat, version=version, only=only)
        for r in self.replicas[1:]:
            r.adopt_params(version)

    def submit(
        self,
        context: Sequence[int],
        *,
        on_done: Callable[[Sample], None],
        session: Hashable | None = None,
        **settings,
    ) -> None:
        """`Sampler.submit` on the session's replica (a new session: the least loaded)."""
        home = self._home.get(session) if session is not None else None
        if home is None:
            home = min(range(len(self.replicas)), key=lambda i: self.replicas[i].load)
        if session is not None:
            self._home[session] = home
            self._home.move_to_end(session)
            while len(self._home) > self.max_sequences:
                self._home.popitem(last=False)
        self.replicas[home].submit(context, on_done=on_done, session=session, **settings)

    def step(self) -> int:
        """One `Sampler.step` of every busy replica, at the same time; rows computed."""
        busy = [r for r in self.replicas if r.busy]
        if len(busy) <= 1:
            return sum(r.step() for r in busy)
        return sum(self._pool.map(Sampler.step, busy))

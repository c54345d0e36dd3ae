"""`RolloutEngine`: what an actor's runtime asks of the engine that makes its tokens.

`ActorRuntime` (runtime.py) builds the engine once (its kind's `_build_engine`) and keeps
it as `self.engine`. The runtime itself only ever calls three things on it; everything
else is the kind's serve loop:

    engine = self._build_engine()                      # once, in ActorRuntime.__init__
    # runtime, on each new verified snapshot (WeightsClient.poll -> ActorRuntime._load):
    engine.update_params(flat, version=v, digest=d, created_at=t)  # full weights (d, t:
    #   the manifest's sha256 and created_at)
    engine.update_params(flat, version=v, only=nnx.LoRAParam, digest=d, created_at=t)  # adapters
    #   a ValueError (names, shapes, dtypes) keeps the old weights; the client refuses v
    # runtime, in every metrics record and the run's summary:
    engine.compile_count                               # XLA compilations so far
    # the kind's own figures go into metrics through ActorRuntime._engine_metrics

    # asynchronous/ (Sampler, SamplerReplicas): `BatchingPolicy` steps the engine from
    # its engine thread, `submit(...)` then `step()` while `busy`, and calls the runtime's
    # `_maybe_reload` between steps, so weights change between decode segments.
    # vectorized/ (OnDeviceRollout): the serve loop `launch(steps)`es a segment, reloads
    # (`_maybe_reload`), `fetch`es the previous segment's `Finished` and commits groups.

`policy.sampling.Sampler`, `policy.replicas.SamplerReplicas`,
`vectorized.ondevice.OnDeviceRollout` and `remote.engine.RemoteEngine` (a completions
server's: no model in the actor) satisfy it structurally: policy/ never imports actor/.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np
from flax import nnx

__all__ = ["RolloutEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """The engine behind an actor (module docstring)."""

    @property
    def compile_count(self) -> int:
        """Programs traced so far (== XLA compilations): bounded for a healthy run."""
        ...

    def update_params(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        version: int,
        only: type[nnx.Variable] = nnx.Param,
        digest: str = "",
        created_at: float = 0.0,
    ) -> None:
        """Check, then swap in, a snapshot's tensors of kind `only` as weights `version`;
        a ValueError (names, shapes, dtypes) leaves the current weights. `digest` and
        `created_at`: the snapshot's content id (its manifest's sha256) and when the
        learner published it, which an engine that hands the weights on (remote: a folder
        a fleet shares, a server it shares) names them by and orders them by."""
        ...

"""The cases of benchmarks/real_model.py: compile time by program kind, time to first
token, steady decode and the train step of a real checkpoint (what each measures: the
script's docstring).

    clock = CompileClock()                           # JAX's compile events, by program kind
    rows = sampler_rows(model, args, lim, clock, scan_layers=False)
    rows = train_rows(checkpoint, 4, 512, lora=0, scans=[False, True], args, lim, clock)

Every case warms its programs first (the compile figures; what compiles while a case is
set up is "other") and checks that no compile happened while it was timed.
"""

from __future__ import annotations

import collections
import gc
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from tunix_tasks.config import config_from_dict
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.model import Transformer

from _machine import med
from _rooflines import Roofline
from _sampler_cases import DecodeCase, context, make_sampler, run_decode
from _train_cases import full_batch

#: JAX's compile events (trace, lowering to MLIR, XLA's compile): seconds each.
_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")


class CompileClock:
    """Seconds JAX spent compiling (its monitoring events), by program kind.

    `watch(counts)` names the programs: `counts()` is a {kind: traces} mapping (e.g.
    `Sampler.compiles`, `Trainer.traces`) that grows when a program of that kind is traced,
    before its compile events fire; each event is charged to the kind that grew last (a
    small helper program compiled meanwhile is charged to it too: milliseconds).
    """

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.compiles: collections.Counter[str] = collections.Counter()
        self._counts: Callable[[], Mapping[str, int]] = dict
        self._last: dict[str, int] = {}
        self._kind = "other"
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def watch(self, counts: Callable[[], Mapping[str, int]], prefix: str) -> None:
        self._counts, self._prefix, self._kind = counts, prefix, "other"
        self._last = dict(counts())

    def pause(self) -> None:
        """Charge what compiles from now on (set-up: params, optimizer) to "other"."""
        self.watch(dict, "")

    def _event(self, name: str, seconds: float, **_: Any) -> None:
        event = name.rsplit("/", 1)[-1]
        if event not in _EVENTS:
            return
        now = dict(self._counts())
        for kind, n in now.items():
            if n > self._last.get(kind, 0):
                self._kind = f"{self._prefix}{kind}"
                self.compiles[self._kind] += n - self._last.get(kind, 0)
        self._last = now
        self.seconds[self._kind] += seconds


def ttft(sampler, vocab: int, prompt: int, rng: np.random.Generator) -> float:
    """Seconds from submitting one fresh request (no session) to its first token."""
    done: list[Any] = []
    fed = sampler.stats.prefill_tokens
    sampler.submit(context(rng, vocab, prompt), max_new_tokens=1, stop_ids=(), on_done=done.append)
    t0 = time.perf_counter()
    sampler.admit()  # its prefill draws the first token; max_new_tokens=1 ends the row
    dt = time.perf_counter() - t0
    assert done and not sampler.busy and sampler.stats.prefill_tokens - fed == prompt
    return dt


def sampler_rows(
    model: Transformer, args, lim: dict, clock: CompileClock, *, scan_layers: bool
) -> dict[str, Any]:
    """One sampler (layers unrolled or scanned): time to first token of a fresh request
    (cold: its prefill compiles; warm: median of `--repeats`), then decode at each of
    `--batches` over window `--window` (`_sampler_cases.run_decode`: warm, then timed)."""
    mode = "scan" if scan_layers else "loop"
    clock.pause()
    sampler = make_sampler(model, args.window, max(args.batches), args, scan_layers=scan_layers)
    clock.watch(lambda: sampler.compiles, f"{mode} ")
    rng = np.random.default_rng(0)
    cold = ttft(sampler, model.vocab_size, args.prompt, rng)
    warm = med([ttft(sampler, model.vocab_size, args.prompt, rng) for _ in range(args.repeats)])
    cases = [DecodeCase.plan(sampler, b, args.window, args.segments) for b in args.batches]
    compiles = run_decode(cases, args.repeats, seed=1)
    roof = Roofline(model.spec, np.dtype(args.compute_dtype).itemsize)
    decode = []
    for c in cases:
        r = c.result(roof, lim)
        r["of_dram"] = r["tokens_per_s"] / r["limit_dram"]
        decode.append(r)
    return {
        "mode": mode,
        "ttft_cold_s": cold,
        "ttft_warm_s": warm,
        "decode": decode,
        "compiles_during_timing": compiles,
    }


def train_rows(
    checkpoint: str,
    rows: int,
    length: int,
    *,
    lora: int,
    scans: list[bool],
    args,
    lim: dict,
    clock: CompileClock,
) -> list[dict[str, Any]]:
    """`Trainer.step` cases on the checkpoint, one per entry of `scans` (layers scanned or
    not), on a fully packed [rows, length] batch with LoRA of rank `lora` (0: full
    fine-tuning): each one's first step (compile included), then `--repeats` rounds of
    timed steps, interleaved; tokens/s against the FLOP roofline."""
    cases = []
    for scan in scans:
        clock.pause()
        cfg = config_from_dict(
            {
                "model": {"checkpoint": checkpoint, "max_seq_len": length, "lora_rank": lora},
                "actor": {"max_episode_tokens": min(length, 192)},
                "learner": {
                    "buckets": [length],
                    "batch_rows": rows,
                    "scan_layers": scan,
                    "compute_dtype": args.compute_dtype,
                },
            }
        )
        trainer = Trainer(cfg, build_policy(cfg.model)[1])
        batch = full_batch(trainer.model.vocab_size, rows, length)
        kind = f"{'scan' if scan else 'loop'} train {'lora' if lora else 'full'} {rows}x{length}"
        clock.watch(lambda traces=trainer.traces: traces, f"{kind} ")  # updated in place
        t0 = time.perf_counter()
        trainer.step(batch)
        first = time.perf_counter() - t0
        clock.pause()
        cases.append((kind, scan, trainer, batch, first, trainer.total_compiles, []))
    for _ in range(args.repeats):
        for _, _, trainer, batch, _, _, times in cases:
            t0 = time.perf_counter()
            trainer.step(batch)
            times.append(time.perf_counter() - t0)
    out = []
    for kind, scan, trainer, _, first, compiles, times in cases:
        step = med(times)
        r = {
            "kind": kind,
            "rows": rows,
            "length": length,
            "lora": lora,
            "scan": scan,
            "first_step_s": first,
            "compile_s": clock.seconds[f"{kind} rl"],
            "step_s": step,
            "tokens_per_s": rows * length / step,
            "compiles_during_timing": trainer.total_compiles - compiles,
            **Roofline(trainer.model.spec, 4).train(rows, length, lim),
        }
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
        out.append(r)
    del cases
    gc.collect()
    return out

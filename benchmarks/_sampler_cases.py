"""The sampler cases of benchmarks/sampler.py: the model, the samplers, and the timed
decode, prefill and multi-turn reuse runs (what each measures: the script's docstring).

    spec = make_spec(args, max_seq_len)
    cases = decode_cases(model, args)     # {"decode_batch": [...], "decode_window": [...]}
    compiles = run_decode(cases["decode_batch"], args.repeats, seed=1)
    rows = [c.result(roof, lim) for c in cases["decode_batch"]]
    sampler, times, compiles = run_prefill(model, args, seed=4)
    out, compiles = run_reuse(model, args, seed=3)

Every run warms its cases first (compiles) and returns the compiles that happened while it
timed (must be 0); samples of one table are interleaved.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy import decoding
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.replicas import SamplerReplicas, replicate
from tunix_tasks.policy.sampling import DEFAULT_PROMPT_BUCKETS, Sampler
from tunix_tasks.policy.spec import DecoderSpec, spec_from_preset
from tunix_tasks.policy.tokenizer import CharTokenizer

from _machine import iqr, med
from _rooflines import Roofline

SHAPES: dict[str, dict[str, int]] = {
    "mid": {"d_model": 512, "n_layers": 8, "n_heads": 8, "d_ff": 2048, "vocab": 32768},
}


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of `buckets` holding `n` (as the sampler picks its shapes)."""
    return next(b for b in buckets if b >= n)


def make_spec(args, max_seq_len: int) -> DecoderSpec:
    """The `--shape` model (the small preset or a `SHAPES` entry), `--vocab` if given."""
    if args.shape == "small":
        vocab = args.vocab or CharTokenizer().vocab_size
        spec = spec_from_preset(ModelConfig(preset="small"), vocab_size=vocab)
        return dataclasses.replace(spec, max_seq_len=max_seq_len)
    s = SHAPES[args.shape]
    return DecoderSpec(
        family="char",
        vocab_size=args.vocab or s["vocab"],
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_heads"],
        head_dim=s["d_model"] // s["n_heads"],
        d_ff=s["d_ff"],
        max_seq_len=max_seq_len,
    )


def make_sampler(
    model: Transformer,
    max_seq_len: int,
    max_batch: int,
    args,
    replicas: int = 1,
    *,
    scan_layers: bool = False,
) -> Sampler | SamplerReplicas:
    """A sampler for `max_batch` rows; with `replicas` > 1, one per CPU device, the rows
    split evenly among them (`replicate`, as `build_sampler` does for
    `actor.sampler_replicas`). `scan_layers`: the sampler's."""

    def make(device: jax.Device | None, rows: int) -> Sampler:
        return Sampler(
            model,
            pad_id=0,
            stop_ids=[model.vocab_size - 1],
            max_seq_len=max_seq_len,
            max_sequences=rows,
            prompt_buckets=DEFAULT_PROMPT_BUCKETS,
            segment_steps=args.segment_steps,
            kv_dtype=jnp.dtype(args.compute_dtype),
            device=device,
            scan_layers=scan_layers,
        )

    return replicate(make, max_batch, replicas)


def context(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    """`n` random tokens, none of them the pad or special ids below 8."""
    return rng.integers(8, vocab, n).tolist()


def measure_draw(batch: int, vocab: int, steps: int, repeats: int) -> float:
    """Seconds per decode step of `decoding.draw` alone over [batch, vocab] logits (the
    log-softmax and the categorical draw each step does besides the model), as a decode
    segment runs it: `steps` draws in one program (temperature 1, no top-k)."""
    rows = decoding.RowParams(
        jnp.arange(batch, dtype=jnp.int32),
        jnp.ones(batch, jnp.float32),
        jnp.zeros(batch, jnp.int32),
        jnp.full(batch, 1 << 20, jnp.int32),
        jnp.full((batch, 8), -1, jnp.int32),
    )
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab), np.float32))

    @jax.jit
    def draws(logits, key, rows):
        def body(i, acc):  # acc feeds back so no draw can be hoisted out of the loop
            tok, lp, _, _ = decoding.draw(
                logits + 1e-9 * acc[:, None], key, rows, rows.seed * 0 + i
            )
            return acc + lp + tok.astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, body, jnp.zeros(batch, jnp.float32))

    key = jax.random.key(0)
    jax.block_until_ready(draws(logits, key, rows))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(draws(logits, key, rows))
        times.append(time.perf_counter() - t0)
    return med(times) / steps


@dataclasses.dataclass
class DecodeCase:
    """B rows decoding with every timed segment attending over window W."""

    sampler: Sampler
    batch: int
    window: int
    segments: int  # timed segments per sample (K)
    prompt: int  # P
    times: list[float] = dataclasses.field(default_factory=list)
    draw_s: float = 0.0  # `measure_draw` at this batch (per step)
    lane_copies: int = 0  # rows copied into the decode working set by timed segments
    warm_s: float = 0.0  # the untimed first sample (`run_decode`): compiles included

    @classmethod
    def plan(cls, sampler: Sampler, batch: int, window: int, segments: int) -> DecodeCase:
        buckets = sampler.prompt_buckets
        if window not in buckets:
            raise SystemExit(f"window {window} is not a prompt bucket of the sampler {buckets}")
        s = sampler.segment_steps
        below = max((b for b in buckets if b < window), default=0)
        # The first segment (untimed) must already reach W: P + S + 1 > the bucket below.
        prompt = max(1, below - s + 1)
        k = min(segments, (window - 1 - prompt) // s - 1)
        if k < 1:
            raise SystemExit(f"window {window} is too small for segment_steps={s}")
        return cls(sampler, batch, window, k, prompt)

    def run(self, rng: np.random.Generator, timed: bool = True) -> None:
        """One sample: submit, one untimed `step()`, then the K timed ones (untimed: check
        the plan, every segment at window W)."""
        sp = self.sampler
        s = sp.segment_steps
        vocab = sp.model.vocab_size
        done: list[Any] = []
        for i in range(self.batch):
            sp.submit(
                context(rng, vocab, self.prompt),
                max_new_tokens=1 + (self.segments + 1) * s,  # ends after the timed segments
                stop_ids=(),
                seed=i,
                on_done=done.append,
            )
        sp.step()  # admission prefill + the first segment: untimed
        assert sp.active_rows == self.batch, (sp.active_rows, self.batch)
        used = [r for r in replicas(sp) if r.active_rows]
        steps0, copies0 = [r.stats.decode_steps for r in used], sp.stats.lane_copies
        t0 = time.perf_counter()
        for k in range(self.segments):
            if not timed:  # check the plan: every timed segment attends over this window
                windows = [one.decode_window for one in used]
                assert windows == [self.window] * len(used), (windows, self.window, k)
            sp.step()
        dt = time.perf_counter() - t0
        assert not sp.busy and len(done) == self.batch
        assert all(
            r.stats.decode_steps - n == self.segments * s for r, n in zip(used, steps0, strict=True)
        )
        if timed:
            self.times.append(dt)
            self.lane_copies += sp.stats.lane_copies - copies0

    @property
    def tokens(self) -> int:
        return self.batch * self.segments * self.sampler.segment_steps

    def result(self, roof: Roofline, lim: dict) -> dict[str, Any]:
        tps = [self.tokens / t for t in self.times]
        r = {
            "batch": self.batch,
            "replicas": len(replicas(self.sampler)),
            "window": self.window,
            "prompt": self.prompt,
            "timed_steps": self.segments * self.sampler.segment_steps,
            "tokens_per_s": med(tps),
            "iqr": iqr(tps),
            "ms_per_step": 1e3 * med(self.times) / (self.segments * self.sampler.segment_steps),
            "samples_tokens_per_s": tps,
            "draw_ms": 1e3 * self.draw_s,
            "lane_copies": self.lane_copies,
            "warm_s": self.warm_s,
            **roof.decode(self.batch, self.window, lim),
        }
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
        r["draw_share"] = r["draw_ms"] / r["ms_per_step"]
        # The program reads the whole padded window W; the rows hold fewer live positions
        # (their mean over the timed steps): the roofline of only those bytes is higher.
        s = self.sampler.segment_steps
        r["live_positions"] = self.prompt + 1 + s + self.segments * s / 2
        live = roof.decode(self.batch, round(r["live_positions"]), lim)
        r["of_dram_live"] = r["tokens_per_s"] / min(live["limit_dram"], live["limit_flops"])
        return r


def replicas(sampler: Sampler | SamplerReplicas) -> list[Sampler]:
    """The samplers behind `sampler` (itself alone when it is not replicated)."""
    return list(getattr(sampler, "replicas", [sampler]))


def run_decode(cases: list[DecodeCase], repeats: int, seed: int) -> int:
    """Warm every case (compiles; its wall time: `warm_s`), then `repeats` interleaved
    rounds; returns the compiles that happened during the timed rounds (must be 0)."""
    rng = np.random.default_rng(seed)
    for c in cases:
        t0 = time.perf_counter()
        c.run(rng, timed=False)
        c.warm_s = time.perf_counter() - t0
    before = sum(s.compile_count for s in {id(c.sampler): c.sampler for c in cases}.values())
    for _ in range(repeats):
        for c in cases:
            c.run(rng)
    after = sum(s.compile_count for s in {id(c.sampler): c.sampler for c in cases}.values())
    for c in cases:
        c.draw_s = measure_draw(
            c.batch, c.sampler.model.vocab_size, c.sampler.segment_steps, repeats
        )
    return after - before


def decode_cases(model: Transformer, args) -> dict[str, list[DecodeCase]]:
    """The decode tables' cases: batch against a fixed window (`--batches` at `--window`,
    once per `--replicas` count) and window against a fixed batch (`--windows`)."""
    out: dict[str, list[DecodeCase]] = {}
    if args.batches:
        out["decode_batch"] = []
        for n in sorted(set(args.replicas)):
            sp = make_sampler(model, args.window, max(args.batches), args, replicas=n)
            out["decode_batch"] += [
                DecodeCase.plan(sp, b, args.window, args.segments) for b in sorted(args.batches)
            ]
    if args.windows:
        windows = sorted(args.windows)
        sp = make_sampler(model, windows[-1], args.window_batch, args)
        out["decode_window"] = [
            DecodeCase.plan(sp, args.window_batch, w, args.segments) for w in windows
        ]
    return out


def run_prefill(
    model: Transformer, args, seed: int
) -> tuple[Sampler, dict[tuple[int, int], list[float]], int]:
    """Seconds of each (`--prefill-batches`, `--prefill-lens`) admission prefill,
    interleaved, on a sampler sized for them; (the sampler, the times, compiles in timing)."""
    batches, lens = sorted(args.prefill_batches), sorted(args.prefill_lens)
    longest = bucket(2 * lens[-1], (*DEFAULT_PROMPT_BUCKETS, 1 << 30))
    sampler = make_sampler(model, longest, batches[-1], args)
    rng = np.random.default_rng(seed)
    vocab = sampler.model.vocab_size
    cases = [(b, n) for n in lens for b in batches]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}

    def once(b: int, n: int) -> float:
        fed = sampler.stats.prefill_tokens
        for i in range(b):
            sampler.submit(
                context(rng, vocab, n), max_new_tokens=1, stop_ids=(), seed=i, on_done=id
            )
        t0 = time.perf_counter()
        sampler.admit()  # every row is done at its prefill: nothing is left to decode
        dt = time.perf_counter() - t0
        assert not sampler.busy and sampler.stats.prefill_tokens - fed == b * n
        return dt

    for c in cases:
        once(*c)
    compiles = sampler.compile_count
    for _ in range(args.repeats):
        for c in cases:
            times[c].append(once(*c))
    return sampler, times, sampler.compile_count - compiles


def prefill_results(sampler: Sampler, times: dict, roof: Roofline, lim: dict) -> list[dict]:
    """The prefill table's rows from `run_prefill`'s times and the run's final limits."""
    rows = []
    for (b, n), ts in times.items():
        window = bucket(n, sampler.prompt_buckets)
        tps = [b * n / t for t in ts]
        r = {
            "batch": b,
            "length": n,
            "window": window,
            "tokens_per_s": med(tps),
            "iqr": iqr(tps),
            "ms_per_call": 1e3 * med(ts),
            "samples_tokens_per_s": tps,
            **roof.prefill(b, n, window, lim),
        }
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
        rows.append(r)
    return rows


def run_reuse(model: Transformer, args, seed: int) -> tuple[dict[str, Any], int]:
    """`--turns`-turn episodes with and without a session, interleaved, on a sampler with a
    slot for each episode of both; per-turn figures and the compiles in timing."""
    turns_len = args.reuse_context + args.turns * (args.reuse_new + args.reuse_reply)
    longest = bucket(turns_len + 1, (*DEFAULT_PROMPT_BUCKETS, 1 << 30))
    sampler = make_sampler(model, longest, 2 * args.reuse_episodes, args)
    rng = np.random.default_rng(seed)
    vocab = sampler.model.vocab_size
    n, turns, modes = args.reuse_episodes, args.turns, ("reuse", "full")
    fields = ("prefill_tokens", "prefill_s", "turn_s")
    out: dict[str, Any] = {m: {f: [[] for _ in range(turns)] for f in fields} for m in modes}

    def episode(mode: str, tag: str, record: bool) -> None:
        ctxs = [context(rng, vocab, args.reuse_context) for _ in range(n)]
        for t in range(turns):
            done: dict[int, Any] = {}
            for i, ctx in enumerate(ctxs):
                sampler.submit(
                    ctx,
                    max_new_tokens=args.reuse_new,
                    stop_ids=(),
                    seed=i,
                    session=f"{tag}-{i}" if mode == "reuse" else None,
                    on_done=lambda s, i=i, done=done: done.__setitem__(i, s),
                )
            fed = sampler.stats.prefill_tokens
            t0 = time.perf_counter()
            sampler.admit()  # the admission prefill alone (step() = this + a segment)
            t1 = time.perf_counter()
            while sampler.busy:
                sampler.step()
            t2 = time.perf_counter()
            assert len(done) == n and all(len(s.tokens) == args.reuse_new for s in done.values())
            if record:
                r = out[mode]
                r["prefill_tokens"][t].append((sampler.stats.prefill_tokens - fed) / n)
                r["prefill_s"][t].append(t1 - t0)
                r["turn_s"][t].append(t2 - t0)
            reply = context(rng, vocab, args.reuse_reply)
            ctxs = [c + done[i].tokens + reply for i, c in enumerate(ctxs)]

    for mode in modes:
        episode(mode, f"warm-{mode}", record=False)
    compiles = sampler.compile_count
    for k in range(args.repeats):
        for mode in modes:
            episode(mode, f"r{k}", record=True)
    return out, sampler.compile_count - compiles

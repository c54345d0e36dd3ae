"""What the machine can do, for the benchmarks' rooflines, and how much memory a process holds.

Limits are measured in the benchmark's own run (a figure is a ratio against them): matmul
FLOP/s, DRAM read bandwidth (of one program, and of one program per local device at
once) and, on a CPU, read bandwidth from the last-level cache. The best sample of each is
the limit (`machine_limits`): on a shared machine a slower sample is contention. Memory:
the resident set, its high-water mark (reset before the part to measure, Linux >= 4.0),
and a trim that hands freed heap back so a later peak is not hidden in it.

    samples = measure_limits("float32", repeats=8, llc=llc_bytes())
    lim = machine_limits(samples, llc)      # {"matmul_flops", "mem_bw", "cache_bw", ...}
    trim(); reset_peak(); before = rss(); work(); growth = peak() - before
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "iqr", "llc_bytes", "machine_limits", "measure_limits", "med", "peak", "reset_peak",
    "rss", "trim",
]  # fmt: skip


def med(xs: list[float]) -> float:
    return float(np.median(xs))


def iqr(xs: list[float]) -> float:
    """Interquartile range / median (0.05 = 5%)."""
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return float((q3 - q1) / q2) if q2 else 0.0


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    """Collect and hand freed heap back to the OS, so a later peak is not hidden in it."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak() -> int:
    """The resident set's high-water mark (since `reset_peak`)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def llc_bytes() -> int:
    """The CPU's last-level cache (0 on an accelerator or when unknown)."""
    if jax.devices()[0].platform != "cpu":
        return 0
    best = (0, 0)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            level = int((d / "level").read_text())
            size = (d / "size").read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
            best = max(best, (level, int(size.rstrip("KM")) * mult))
    return best[1]


def _sums(x: jax.Array, reps: int) -> jax.Array:
    """`reps` full reads of x in one program (no per-call dispatch in the timing)."""
    body = lambda i, acc: acc + jnp.sum(x + i.astype(x.dtype))  # noqa: E731
    return jax.lax.fori_loop(0, reps, body, jnp.float32(0))


def measure_limits(dtype: str, repeats: int, llc: int) -> dict[str, list[float]]:
    """Matmul FLOP/s, DRAM read bandwidth of one program ("mem_bw") and, with several local
    devices, of one program per device at once ("mem_bw_devices": what replicas can draw
    together), and (on a CPU) read bandwidth from the last-level cache (an array of a
    quarter of it, read 32 times in one program); interleaved."""
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    reads = jax.jit(_sums, static_argnums=1)
    big = [  # 256 MB per device: beyond any cache
        jax.device_put(jnp.ones((64 << 20,), jnp.float32), d) for d in jax.local_devices()
    ]
    arrays = {"mem_bw": ([big[0]], 1)}
    if len(big) > 1:
        arrays["mem_bw_devices"] = (big, 1)
    if llc:
        arrays["cache_bw"] = ([jnp.ones((llc // 16,), jnp.float32)], 32)
    jax.block_until_ready((mm(a, a), *(reads(xs[0], k) for xs, k in arrays.values())))
    out: dict[str, list[float]] = {"matmul_flops": [], **{k: [] for k in arrays}}
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, a))
        out["matmul_flops"].append(2 * n**3 / (time.perf_counter() - t0))
        for name, (xs, k) in arrays.items():
            t0 = time.perf_counter()
            jax.block_until_ready([reads(x, k) for x in xs])  # dispatched at once: concurrent
            out[name].append(k * sum(x.nbytes for x in xs) / (time.perf_counter() - t0))
    return out


def machine_limits(samples: dict[str, list[float]], llc: int) -> dict[str, float]:
    """The best sample of each figure (a slower one is contention); the DRAM limit is the
    better of one program and one per device at once: the machine's, not one core's."""
    lim = {k: max(v) for k, v in samples.items()} | {"llc_bytes": llc}
    lim["mem_bw"] = max(lim["mem_bw"], lim.get("mem_bw_devices", 0.0))
    return lim

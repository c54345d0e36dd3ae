"""The rooflines of benchmarks/sampler.py: what decode, prefill and the train step could
reach on this machine's measured limits (`_machine.measure_limits`).

Counts: `tunix_tasks.policy.costs`; L layers, d d_model, H / KV heads of size hd, f d_ff,
V vocab, B rows, W the attended window; P_mm = L*(2*d*H*hd + 2*d*KV*hd + 3*d*f) + d*V the
matmul params per token:
  decode step   bytes = params read once (in the compute dtype, as the sampler holds them;
                        of an untied embedding table only the B gathered rows)
                        + K/V read 2*L*KV*hd*W*B*itemsize
                        + logits written and read 2*4*B*V
                FLOPs = B*(2*P_mm + 4*L*H*hd*W)  (attention over the whole window: the
                        program computes it, masked)
                limit tokens/s = B / max(bytes / bandwidth, FLOPs / FLOP/s), where the
                bandwidth is the LLC's when bytes fit in half the LLC (weights and cache
                then stay resident between steps: "bound LLC"), else DRAM's ("of DRAM lim"
                is the ratio against the DRAM roofline whatever the working set)
  prefill       FLOPs = 2*(P_mm - d*V)*B*P + 2*d*V*B (logits only at each row's last
                token) + 4*L*H*hd*B*P*W; bytes = params + K/V written; limit = B*P / max
  train step    FLOPs = 3 x forward = B*T*(6*P_mm + 12*L*H*hd*T) (dense T x T attention;
                blockwise attention skips the tiles no query needs, so does fewer)

    roof = Roofline(spec, itemsize=4)
    roof.decode(rows, window, lim)   # {"limit": tokens/s, "bound": "LLC" | "DRAM" | "FLOPs", ...}
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tunix_tasks.policy import costs
from tunix_tasks.policy.spec import DecoderSpec


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The limits of one spec on this machine's measured rates (module docstring)."""

    spec: DecoderSpec
    itemsize: int  # bytes per param and K/V element: the compute dtype, as the sampler holds them

    @staticmethod
    def bandwidth(nbytes: float, lim: dict) -> tuple[float, str]:
        """The read bandwidth for a working set of `nbytes`: the last-level cache's when it
        fits in half of it (it stays resident between steps), else DRAM's."""
        if lim.get("cache_bw") and nbytes <= lim.get("llc_bytes", 0) / 2:
            return lim["cache_bw"], "LLC"
        return lim["mem_bw"], "DRAM"

    def decode(self, rows: int, window: int, lim: dict) -> dict[str, Any]:
        s = self.spec
        nbytes = (
            costs.weight_read_bytes(s, rows, self.itemsize)
            + costs.kv_bytes(s, rows * window, self.itemsize)
            + 8.0 * rows * s.vocab_size
        )
        flops = rows * costs.forward_flops_per_token(s, window)
        bw, where = self.bandwidth(nbytes, lim)
        t_bw, t_fl = nbytes / bw, flops / lim["matmul_flops"]
        return {
            "bytes_per_step": nbytes,
            "flops_per_step": flops,
            "limit_bw": rows / t_bw,
            "limit_dram": rows * lim["mem_bw"] / nbytes,
            "limit_flops": rows / t_fl,
            "limit": rows / max(t_bw, t_fl),
            "bound": where if t_bw >= t_fl else "FLOPs",
        }

    def prefill(self, rows: int, length: int, window: int, lim: dict) -> dict[str, float]:
        s = self.spec
        flops = costs.prefill_flops(s, rows * length, window, logits=rows)
        nbytes = costs.weight_read_bytes(s, rows * length, self.itemsize) + costs.kv_bytes(
            s, rows * length, self.itemsize
        )
        t = max(nbytes / self.bandwidth(nbytes, lim)[0], flops / lim["matmul_flops"])
        return {"flops": flops, "limit": rows * length / t}

    def train(self, rows: int, length: int, lim: dict) -> dict[str, float]:
        flops = costs.train_flops(self.spec, rows * length, length)
        return {"flops": flops, "limit": rows * length * lim["matmul_flops"] / flops}

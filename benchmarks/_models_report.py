"""The tables of benchmarks/models.py: the machine and the run, then one table per family
of (figure, value, unit, reference, reference value, ratio) rows.

    print_tables(results, lim, args)
"""

from __future__ import annotations

import os
from typing import Any

import jax

from _models_timing import MB


def rows(r: dict[str, Any]) -> list[tuple]:
    """(figure, value, unit, reference, reference value, ratio) rows of one family."""
    ours, naive = r["import_ours"], r["import_naive"]
    out: list[tuple] = [
        ("checkpoint write", r["write_s"], "s", "", None, None),
        (
            "import load_model file://",
            ours["load_s"],
            "s",
            "naive load_file",
            naive["load_s"],
            ours["load_s"] / naive["load_s"],
        ),
        (
            "import throughput",
            r["import_ours_MBps"],
            "MB/s",
            "open().read()",
            r["read_ref"],
            r["import_ours_MBps"] / r["read_ref"],
        ),
        (
            "import peak RSS",
            r["import_ours_peak_ratio"],
            "x model",
            "naive load_file",
            r["import_naive_peak_ratio"],
            r["import_ours_peak_ratio"] / r["import_naive_peak_ratio"],
        ),
        (
            "import peak RSS",
            r["import_ours_peak_ratio"],
            "x model",
            "model + largest tensor",
            r["import_ideal_ratio"],
            r["import_ours_peak_ratio"] / r["import_ideal_ratio"],
        ),
        (
            "import RSS after",
            r["import_ours_resident_ratio"],
            "x model",
            "naive load_file",
            r["import_naive_resident_ratio"],
            None,
        ),
    ]
    out.append(
        (
            "  import: read + convert, tensor by tensor",
            r["import_read_convert_s"],
            "s",
            "whole load_model",
            r["import_parent_s"],
            r["import_read_convert_s"] / r["import_parent_s"],
        )
    )
    if "import_gcs" in r:
        out.append(
            (
                "import gs:// throughput",
                r["import_gcs_MBps"],
                "MB/s",
                "gs:// read_bytes",
                r["gcs_read_MBps"],
                r["import_gcs_MBps"] / r["gcs_read_MBps"],
            )
        )
    f = r["forward"]
    out.append(
        (
            f"forward {f['batch']}x{f['seq']} packed",
            f["tokens_per_s"],
            "tokens/s",
            "FLOP roofline",
            f["limit_tokens_per_s"],
            f["tokens_per_s"] / f["limit_tokens_per_s"],
        )
    )
    achieved = f["tokens_per_s"] * f["xla_flops_per_token"]  # a ratio above 1: a wrong count
    out.append(
        (
            "  forward FLOP/s (XLA count)",
            achieved / 1e9,
            "GFLOP/s",
            "matmul 2048^3",
            f["matmul_flops"] / 1e9,
            achieved / f["matmul_flops"],
        )
    )
    for s in r["sampling"]:
        out.append(
            (
                f"sample b={s['batch']} {s['prompt']}+{s['new_tokens']} tok",
                s["tokens_per_s"],
                "tokens/s",
                "roofline",
                s["limit_tokens_per_s"],
                s["tokens_per_s"] / s["limit_tokens_per_s"],
            )
        )
    for s in r["sampling"]:
        out.append(
            (
                f"  b={s['batch']}: vocab sort share",
                s["logprobs_share"],
                "of call",
                "sampling_log_probs ms",
                1000 * s["logprobs_step_s"],
                None,
            )
        )
    for where in ("file", "gcs"):
        if f"reload_{where}" not in r:
            continue
        rl = r[f"reload_{where}"]
        snap = rl["snapshot_bytes"] / MB
        w_ref, r_ref = rl["plain_write_MBps"], r["read_ref"] if where == "file" else None
        out += [
            (f"snapshot {where}", snap, "MB", "", None, None),
            (f"publish {where} time", rl["publish_s"], "s", "", None, None),
            (
                f"publish {where}",
                snap / rl["publish_s"],
                "MB/s",
                "open().write()+fsync" if w_ref else "",
                w_ref,
                snap / rl["publish_s"] / w_ref if w_ref else None,
            ),
            (f"reload {where} time (load+update)", rl["reload_s"], "s", "", None, None),
            (
                f"reload {where}",
                snap / rl["reload_s"],
                "MB/s",
                "open().read()" if r_ref else "",
                r_ref,
                snap / rl["reload_s"] / r_ref if r_ref else None,
            ),
        ]
        if where == "file" and "reload_peak_ratio" in r:
            out.append(
                (
                    "reload file peak RSS (fresh process)",
                    r["reload_peak_ratio"],
                    "x model",
                    "new weights + 1 tensor",
                    r["import_ideal_ratio"],
                    r["reload_peak_ratio"] / r["import_ideal_ratio"],
                )
            )
        out += [(f"  {k}", v, "s", "", None, None) for k, v in rl["breakdown_s"].items()]
    return out


def print_tables(results: list[dict], lim: dict[str, float], args) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"\nMachine: {jax.default_backend()} ({jax.devices()[0].device_kind}, {cores} cores): "
        f"matmul {lim['matmul_flops'] / 1e9:.1f} GFLOP/s ({args.compute_dtype}, 2048^3), "
        f"memory read {lim['mem_bw'] / 1e9:.1f} GB/s (jitted sum over 256 MB), page-cache "
        f"read {lim['read_MBps']:.0f} MB/s (open().read() of the checkpoints); best of the "
        f"measurements at the start, before each family and at the end; load average "
        f"{args.load[0][0]:.1f} at the start, {args.load[1][0]:.1f} at the end"
    )
    print(
        f"Run: --shape {args.shape}, forward {args.fwd_batch}x{args.seq}, sampling batches "
        f"{args.sample_batches} x {args.prompt}-token prompts + {args.new_tokens} new tokens, "
        f"median of {args.repeats}" + (f"; {args.note}" if args.note else "")
    )
    for r in results:
        s = r["spec"]
        print(
            f"\n{r['family']} @ {r['shape']}: d_model {s['d_model']}, {s['n_layers']} layers, "
            f"{s['n_heads']}/{s['n_kv_heads']} heads x {s['head_dim']}, d_ff {s['d_ff']}, vocab "
            f"{s['vocab_size']}, {'tied' if s['tie_embeddings'] else 'untied'}: "
            f"{r['params'] / 1e6:.1f}M params = {r['model_bytes_fp32'] / MB:.1f} MB fp32; "
            f"checkpoint {args.ckpt_dtype} {r['ckpt_bytes'] / MB:.1f} MB in {len(r['files'])} "
            f"file(s); compute {args.compute_dtype}"
        )
        print(
            f"{'figure':<40}{'value':>11} {'unit':<9}{'reference':<23}{'ref value':>11}{'ratio':>8}"
        )
        above = []
        for name, value, unit, ref, ref_value, ratio in rows(r):
            rv = f"{ref_value:>11.2f}" if ref_value is not None else " " * 11
            ra = f"{ratio:>8.3f}" if ratio is not None else ""
            print(f"{name:<40}{value:>11.3f} {unit:<9}{ref:<23}{rv}{ra}".rstrip())
            if ("roofline" in ref or "matmul" in ref) and ratio > 1:
                above.append(name.strip())
        if above:  # no program beats the limits it is held against: a count or limit is off
            print(f"WARNING: above the roofline (a FLOP/byte count or a limit is wrong): {above}")
        timed = sum(x["compiles_in_measurement"] for x in r["sampling"])
        print(
            f"(sampling compiles after a reload: {r['recompiles_after_reload']}; during the "
            f"timed sampling calls, after their warm-up: {timed})"
        )

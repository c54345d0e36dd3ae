"""The tables of benchmarks/sampler.py: the machine's limits, decode against batch and
window, prefill, multi-turn reuse and the train step, from the results `main` gathers
(their columns: the script's docstring).

    print_tables(res, args)
"""

from __future__ import annotations

from typing import Any

from _machine import med

GB = 1e9


def _fmt(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB" if x >= 1e6 else f"{x / 1e3:.0f} kB"


def print_decode(title: str, rows: list[dict], base_label: str) -> None:
    """One decode table; "ideal" = the ratio of the rooflines (what a constant fraction of
    the limit would give), next to the achieved ratio against the first row. "of DRAM
    lim" counts the bytes the program reads (the padded window); "live" only the rows'
    live positions (mean over the timed steps), which is what the work needs."""
    print(f"\n{title}")
    head = (
        f"{'batch':>6}{'rep':>4}{'window':>7}{'tok/s':>9}{'iqr':>6}{'ms/step':>9}{base_label:>9}"
        f"{'ideal':>8}{'MB/step':>9}{'lim tok/s':>11}{'bound':>7}{'of limit':>10}"
        f"{'of DRAM lim':>13}{'live':>7}{'draw ms':>9}{'draw %':>8}"
    )
    print(head)
    print("-" * len(head))
    base = rows[0]
    for r in rows:
        print(
            f"{r['batch']:>6}{r['replicas']:>4}{r['window']:>7}{_fmt(r['tokens_per_s']):>9}{r['iqr']:>6.0%}"
            f"{r['ms_per_step']:>9.2f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x"
            f"{r['limit'] / base['limit']:>7.2f}x{r['bytes_per_step'] / 1e6:>9.1f}"
            f"{_fmt(r['limit']):>11}{r['bound']:>7}{r['of_limit']:>10.3f}"
            f"{r['tokens_per_s'] / min(r['limit_dram'], r['limit_flops']):>13.3f}"
            f"{r['of_dram_live']:>7.3f}{r['draw_ms']:>9.3f}{r['draw_share']:>8.0%}"
        )


def print_tables(res: dict[str, Any], args) -> None:
    lim, spec = res["limits"], res["spec"]
    med_, iqr_ = res["limit_median"], res["limit_iqr"]
    n = len(res["limit_samples"]["mem_bw"])
    print(
        f"\nModel {args.shape}: d_model {spec['d_model']}, {spec['n_layers']} layers, "
        f"{spec['n_heads']} heads (kv {spec['n_kv_heads']}) x {spec['head_dim']}, d_ff "
        f"{spec['d_ff']}, vocab {spec['vocab_size']}; {res['params'] / 1e6:.2f}M params "
        f"({_mb(4 * res['params'])} float32); compute {args.compute_dtype}; "
        f"segment_steps {args.segment_steps}; {res['device']}, {res['cores']} cores"
    )

    def fig(k: str, unit: str) -> str:
        best = max(res["limit_samples"][k])
        return f"{best / GB:.1f} {unit} (median {med_[k] / GB:.1f}, iqr {iqr_[k]:.0%})"

    parts = [f"DRAM read {lim['mem_bw'] / GB:.1f} GB/s: one program {fig('mem_bw', 'GB/s')}"]
    if "mem_bw_devices" in med_:
        parts[0] += f", one per device at once {fig('mem_bw_devices', 'GB/s')}"
    if "cache_bw" in lim:
        parts.append(f"LLC ({_mb(lim['llc_bytes'])}) read {fig('cache_bw', 'GB/s')}")
    parts.append(f"matmul {fig('matmul_flops', 'GFLOP/s')}")
    print(f"Machine, best of {n} samples: " + "; ".join(parts))
    if res.get("decode_batch"):
        print_decode(
            f"Decode vs batch (window {args.window}; tok/s = rows x steps / wall of step() "
            "calls; bound LLC: the working set fits the last-level cache)",
            res["decode_batch"],
            "vs B=1",
        )
    if res.get("decode_window"):
        w0 = res["decode_window"][0]["window"]
        print_decode(
            f"Decode vs window (batch {args.window_batch}; the window is the cache bucket "
            f"attended; vs W={w0})",
            res["decode_window"],
            f"vs W={w0}",
        )
    decoded = res.get("decode_batch", []) + res.get("decode_window", [])
    if decoded:
        copies = sum(r["lane_copies"] for r in decoded)
        print(f"lane copies during timed decode (0: every row kept its lane): {copies}")
    if res.get("prefill"):
        rows = res["prefill"]
        print(
            "\nPrefill (B prompts of P tokens in one admission call; logits only at each "
            "row's last token)"
        )
        head = (
            f"{'batch':>6}{'P':>6}{'tok/s':>9}{'iqr':>6}{'ms/call':>9}{'vs first':>10}"
            f"{'GFLOP':>8}{'lim tok/s':>11}{'of limit':>10}"
        )
        print(head)
        print("-" * len(head))
        for r in rows:
            print(
                f"{r['batch']:>6}{r['length']:>6}{_fmt(r['tokens_per_s']):>9}{r['iqr']:>6.0%}"
                f"{r['ms_per_call']:>9.1f}{r['tokens_per_s'] / rows[0]['tokens_per_s']:>9.2f}x"
                f"{r['flops'] / 1e9:>8.2f}{_fmt(r['limit']):>11}{r['of_limit']:>10.3f}"
            )
    if res.get("reuse"):
        ru, fu = res["reuse"]["reuse"], res["reuse"]["full"]
        print(
            f"\nMulti-turn prefix reuse ({args.reuse_episodes} episodes at once; context "
            f"{args.reuse_context}, {args.reuse_new} new tokens per turn, {args.reuse_reply}-token"
            f" reply; per episode; reuse = session, full = re-prefill every turn)"
        )
        head = (
            f"{'turn':>5}{'prefill tok':>13}{'full tok':>10}{'ideal':>7}{'prefill ms':>12}"
            f"{'full ms':>9}{'speed-up':>10}{'turn ms':>9}{'full ms':>9}{'speed-up':>10}"
        )
        print(head)
        print("-" * len(head))
        for t in range(args.turns):
            ideal = args.reuse_context if t == 0 else args.reuse_reply + 1
            pr, pf = med(ru["prefill_s"][t]), med(fu["prefill_s"][t])
            tr, tf = med(ru["turn_s"][t]), med(fu["turn_s"][t])
            print(
                f"{t + 1:>5}{med(ru['prefill_tokens'][t]):>13.0f}"
                f"{med(fu['prefill_tokens'][t]):>10.0f}{ideal:>7}{1e3 * pr:>12.1f}"
                f"{1e3 * pf:>9.1f}{pf / pr:>9.2f}x{1e3 * tr:>9.1f}{1e3 * tf:>9.1f}{tf / tr:>9.2f}x"
            )
        er = sum(med(x) for x in ru["turn_s"])
        ef = sum(med(x) for x in fu["turn_s"])
        print(
            f"whole episode: {1e3 * er:.0f} ms with reuse, {1e3 * ef:.0f} ms without: {ef / er:.2f}x"
        )
    if res.get("train"):
        print_train(res["train"], spec["vocab_size"])
    print(f"\ncompiles during timing (must be 0): {res['compiles_during_timing']}")


def print_train(rows: list[dict], vocab: int) -> None:
    """The train step: one line of speed and one of memory per attention block."""
    r = rows[0]
    print(
        f"\nTrain step (Trainer.step, RL loss, {r['layers']} layers, [{r['rows']}, {r['length']}] "
        f"packed batch, density {r['density']:.2f}, vocab {vocab}; remat {r['remat']}, logits_chunk "
        f"{r['logits_chunk']}, scan_layers {r['scan_layers']}); FLOP limit {_fmt(r['limit'])} "
        f"tok/s ({r['flops'] / 1e9:.1f} GFLOP/step, dense attention)"
    )
    for r in rows:
        block = r["attention_block"]
        print(
            f"  attention_block {block}{' (dense)' if block == 0 else ''}: "
            f"{_fmt(r['tokens_per_s'])} tok/s (iqr {r['iqr']:.0%}, {1e3 * r['step_s']:.0f} "
            f"ms/step, {r['of_limit']:.3f} of limit); first step (trace + compile) "
            f"{r['first_step_s']:.1f} s; compiles during timing {r['compiles_during_timing']}"
        )
        mem = [f"params {_mb(r['param_bytes'])}"]
        if "xla_temp_bytes" in r:
            mem.append(
                f"XLA temp {_mb(r['xla_temp_bytes'])} + arguments {_mb(r['xla_argument_bytes'])}"
            )
        else:
            mem.append(f"XLA memory analysis unavailable ({r.get('xla_error')})")
        rss = r.get("rss")
        if rss and "peak_growth" in rss:
            mem.append(f"peak RSS growth of a step {_mb(rss['peak_growth'])}")
        elif rss:
            mem.append(f"RSS child failed: {rss.get('error')}")
        print("    memory: " + "; ".join(mem))
    print(
        f"  for scale: a full [rows, T, V] float32 logits tensor {_mb(r['logits_bytes'])}; one "
        f"layer's [rows, H, T, T] float32 attention scores {_mb(r['scores_bytes'])}"
    )

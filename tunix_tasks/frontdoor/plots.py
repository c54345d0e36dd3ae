"""The run report's figures: reward, duty cycle, backlog, sampler/learner mismatch,
staleness, drops, the length of stale drops vs trained episodes, env latency, and
weight sync (the version each actor samples with, publish -> reload latency).

    for title, png_base64 in report_plots(records, summary): ...
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from tunix_tasks.frontdoor.audit import busy_s
from tunix_tasks.learner import drop_bias

__all__ = ["report_plots"]


def _figure_png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def report_plots(
    records: list[dict[str, Any]], steps: list[dict[str, Any]], summary: dict[str, Any]
) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every figure the report shows; `steps`: one learner record
    per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actors = [r for r in records if str(r.get("process", "")).startswith("actor/")]
    t0 = min((r["time"] for r in records), default=0.0)
    out: list[tuple[str, str]] = []

    def panel(title: str, draw: Any, ylabel: str, xlabel: str = "seconds since start") -> None:
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        draw(ax)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)  # every plot says what it shows
        ax.grid(alpha=0.3)
        out.append((title, _figure_png(fig)))
        plt.close(fig)

    if steps:
        x_step = [r["step"] for r in steps]
        x_time = [r["time"] - t0 for r in steps]
        reward = np.asarray([r["reward_mean"] for r in steps])
        win = max(1, len(reward) // 20)
        smooth = np.convolve(reward, np.ones(win) / win, mode="valid")

        def reward_panel(ax: Any) -> None:
            ax.plot(x_step, reward, alpha=0.3, label="trained batch")
            ax.plot(x_step[win - 1 :], smooth, label=f"moving mean ({win})")
            evals = summary.get("evaluations") or []
            if evals:
                by_version = {r["version"]: r["step"] for r in steps}
                pts = [(by_version.get(e["version"]), e["reward_mean"]) for e in evals]
                pts = [(s, r) for s, r in pts if s is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o", label="held-out eval")
            ax.legend(fontsize=8)

        panel("Reward over learner steps", reward_panel, "mean reward", "learner step")
        panel("Reward over time", lambda ax: ax.plot(x_time, reward, alpha=0.5), "mean reward")

        def duty_panel(ax: Any) -> None:
            t = np.asarray(x_time)
            busy = np.asarray([busy_s(r) for r in steps])
            if len(t) > 1:
                dt = np.diff(t)
                ax.plot(
                    t[1:],
                    np.clip(busy[1:] / np.maximum(dt, 1e-9), 0, 1),
                    alpha=0.4,
                    label="per step",
                )
            ax.plot(t, [r["duty_cycle"] for r in steps], label="cumulative")
            ax.set_ylim(0, 1.05)
            ax.legend(fontsize=8)

        duty = "Learner duty cycle (time in train step / wall time)"
        panel(duty, duty_panel, "duty cycle (fraction)")
        panel(
            "Buffer backlog",
            lambda ax: (
                ax.plot(x_time, [r["buffer"] for r in steps], label="buffered episodes"),
                ax.plot(x_time, [r["backlog_shards"] for r in steps], label="unread shards"),
                ax.legend(fontsize=8),
            ),
            "episodes / shards",
        )
        if any("approx_kl" in r for r in steps):

            def mismatch_panel(ax: Any) -> None:
                # 0 learner steps since the behaviour weights: sampler vs learner numerics
                # alone; later: plus the policy's drift.
                for suffix, label in (("_s0", "0 steps"), ("_s1_2", "1-2"), ("_s3p", "3+")):
                    pts = [
                        (r["step"], r[f"approx_kl{suffix}"])
                        for r in steps
                        if f"approx_kl{suffix}" in r
                    ]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), ".-", label=label, alpha=0.7)
                ax.set_yscale("symlog", linthresh=1e-6)
                ax.legend(fontsize=8)

            panel(
                "Behaviour vs learner policy: k3 KL(mu || pi) by learner steps since mu",
                mismatch_panel,
                "approx KL per loss token",
                "learner step",
            )
    hist = summary.get("staleness_histogram") or {}
    if hist:
        panel(
            "Staleness of trained episodes (versions)",
            lambda ax: ax.bar([int(k) for k in hist], list(hist.values())),
            "trained episodes",
            "learner version - policy version",
        )
    dropped = dict(summary.get("dropped_ledger") or summary.get("dropped_total") or {})
    dropped["quarantined shards"] = summary.get("quarantined_shards", 0)
    panel("Dropped", lambda ax: ax.bar(list(dropped), list(dropped.values())), "count", "")
    bias = steps[-1].get("drop_bias") if steps else None
    if bias and bias["stale"]["n"]:

        def drop_bias_panel(ax: Any) -> None:
            # Shares per fixed length bin (drop_bias.EDGES), bins either side holds.
            edges = drop_bias.EDGES["length"]
            counts = {side: np.asarray(bias[side]["bins"]["length"]) for side in drop_bias.SIDES}
            used = np.flatnonzero(sum(counts.values()))
            x = np.arange(len(used))
            for i, (side, c) in enumerate(counts.items()):
                ax.bar(x + 0.4 * i - 0.2, c[used] / max(1, c.sum()), 0.4, label=side)
            labels = [f"{edges[j]:.0f}-{edges[j + 1]:.0f}".replace("-inf", "+") for j in used]
            ax.set_xticks(x, labels, fontsize=7)
            ax.legend(fontsize=8)

        panel(
            "Length of trained vs stale-dropped episodes",
            drop_bias_panel,
            "share of the side's episodes",
            "episode length (tokens)",
        )
    if actors:

        def latency_panel(ax: Any) -> None:
            for name in sorted({r["process"] for r in actors})[:8]:
                rs = [
                    r
                    for r in actors
                    if r["process"] == name and r.get("env_step_p50_s") is not None
                ]
                ax.plot(
                    [r["time"] - t0 for r in rs],
                    [r["env_step_p50_s"] for r in rs],
                    label=f"{name} p50",
                )
                ax.plot(
                    [r["time"] - t0 for r in rs],
                    [r["env_step_p99_s"] for r in rs],
                    "--",
                    label=f"{name} p99",
                )
            ax.legend(fontsize=6)

        panel("Environment step latency", latency_panel, "env step latency (s)")

        def sync_panel(ax: Any) -> None:
            for name in sorted({r["process"] for r in actors})[:8]:
                rs = [r for r in actors if r["process"] == name and r.get("weights_version")]
                ax.step(
                    [r["time"] - t0 for r in rs],
                    [r["weights_version"] for r in rs],
                    where="post",
                    label=f"{name} samples with",
                )
            if steps:
                ax.step(
                    x_time,
                    [r.get("version", 0) for r in steps],
                    where="post",
                    color="black",
                    alpha=0.5,
                    label="learner published",
                )
            ax.legend(fontsize=6)

        panel("Weights version in use", sync_panel, "weights version")

        def reload_panel(ax: Any) -> None:
            for name in sorted({r["process"] for r in actors})[:8]:
                rs = [r for r in actors if r["process"] == name and r.get("publish_to_reload_s")]
                ax.plot(
                    [r["time"] - t0 for r in rs],
                    [r["publish_to_reload_s"] for r in rs],
                    ".-",
                    label=name,
                )
            ax.legend(fontsize=6)

        panel("Publish -> actor reload latency", reload_panel, "seconds")
    return out

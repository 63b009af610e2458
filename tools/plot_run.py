"""Draws a run's curves and pipeline timeline to PNG.

  python tools/plot_run.py --workdir=/tmp/quickstart [--workdir=/tmp/other ...] --out=docs/img/run

Writes `<out>_curves.png` (train reward and accuracy per step, held-out
accuracy per policy version, response length, and for an episodes run the tool-call
rate, truncation and turns per episode; one line per workdir) and
`<out>_timeline.png` (the trace.json spans of the first workdir: one row per
track — generation instances, reward, trainer micro-batches, optimizer,
weight sync — so the overlap and the bubbles are visible) and `<out>_breakdown.png` (the
first workdir's step-time breakdown, the metrics' `time/*`: per step, the trainer's
training, waiting for samples, weight sync, compiling and the rest stacked to the step's
wall time, and the generation's busy seconds beside them).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib  # noqa: E402
import matplotlib.ticker  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from streamrl_jax.metrics import read_jsonl, read_trace  # noqa: E402

_WORKDIRS = flags.DEFINE_multi_string("workdir", None, "Run directories (metrics.jsonl).")
_LABELS = flags.DEFINE_multi_string("label", None, "Legend labels, one per --workdir.")
_OUT = flags.DEFINE_string("out", "run", "Output path prefix for the PNG files.")
_MAX_SECONDS = flags.DEFINE_float("timeline_seconds", 0.0, "Only draw the first N s (0 = all).")


def plot_curves(workdirs: list[str], labels: list[str], path: str) -> None:
    runs = [read_jsonl(os.path.join(w, "metrics.jsonl")) for w in workdirs]
    episodes = any("episode_turns" in r for rows in runs for r in rows)
    fig, axes = plt.subplots(1, 4 if episodes else 3, figsize=(20 if episodes else 15, 4))
    for rows, label in zip(runs, labels, strict=True):
        train = [r for r in rows if "reward" in r]
        evals = [r for r in rows if "eval/accuracy" in r]
        steps = [r["step"] for r in train]
        axes[0].plot(steps, [r["reward"] for r in train], label=f"{label} reward")
        axes[0].plot(steps, [r["accuracy"] for r in train], "--", label=f"{label} accuracy")
        axes[1].plot(
            [r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label=label
        )
        axes[2].plot(steps, [r["response_len"] for r in train], label=label)
        if episodes:  # an episodes run: how its episodes went (docs/episodes.md)
            ep = [r for r in train if "episode_turns" in r]
            x = [r["step"] for r in ep]
            axes[3].plot(x, [r["episode_tool_call_rate"] for r in ep], label=f"{label} tool calls")
            axes[3].plot(x, [r["episode_truncated"] for r in ep], ":", label=f"{label} truncated")
            axes[3].plot(x, [r["episode_turns"] / 4 for r in ep], "--", label=f"{label} turns / 4")
    if episodes:
        axes[3].set(title="episodes (rates; turns / 4)", xlabel="step", ylim=(0, 1.05))
    axes[0].set(title="training batch", xlabel="step")
    axes[1].set(title="held-out accuracy (greedy)", xlabel="policy version", ylim=(0, 1))
    axes[2].set(title="mean response length", xlabel="step", ylabel="tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BREAKDOWN = ("train", "wait", "sync", "compile", "other")


def plot_breakdown(workdir: str, path: str) -> bool:
    """The step-time breakdown of `workdir`'s steps (False: its metrics have none)."""
    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "time/train_s" in r]
    if not rows:
        return False
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(14, 4.5))
    bottom = [0.0] * len(rows)
    for part in BREAKDOWN:
        values = [r[f"time/{part}_s"] for r in rows]
        ax.bar(steps, values, bottom=bottom, width=0.9, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    generate = [r["time/generate_s"] for r in rows]
    ax.plot(steps, generate, color="black", marker=".", lw=1, label="generation busy")
    ax.set(title="where each step's time went", xlabel="step", ylabel="seconds")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(trace_path: str, path: str, max_seconds: float = 0.0) -> None:
    spans = read_trace(trace_path)
    # One row per track, grouped like the trace's processes: groups in the order first
    # recorded, then their tracks; one colour per group (pid order, as before).
    group = {s.track: s.group for s in spans}
    rank = {g: i for i, g in enumerate(dict.fromkeys(group.values()))}
    first = {t: i for i, t in enumerate(group)}
    if max_seconds > 0:
        spans = [s for s in spans if s.start < max_seconds]
    tracks = sorted({s.track for s in spans}, key=lambda t: (rank[group[t]], first[t]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(tracks) + 1.5))
    for row, track in enumerate(tracks):
        bars = [(s.start, s.dur) for s in spans if s.track == track]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[(rank[group[track]] + 1) % len(colors)])
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels(tracks)
    ax.set_xlabel("seconds since start")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    workdirs = _WORKDIRS.value
    if not workdirs:
        raise app.UsageError("give at least one --workdir")
    labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in workdirs]
    if len(labels) != len(workdirs):
        raise app.UsageError("one --label per --workdir")
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    plot_curves(workdirs, labels, f"{_OUT.value}_curves.png")
    trace = os.path.join(workdirs[0], "trace.json")
    if os.path.exists(trace):
        plot_timeline(trace, f"{_OUT.value}_timeline.png", _MAX_SECONDS.value)
    out = {"curves": f"{_OUT.value}_curves.png", "timeline": f"{_OUT.value}_timeline.png"}
    if plot_breakdown(workdirs[0], f"{_OUT.value}_breakdown.png"):
        out["breakdown"] = f"{_OUT.value}_breakdown.png"
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)

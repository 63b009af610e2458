"""Simulator figures for docs/podplan.md (PNG, matplotlib).

    python -m streamrl_podplan.figures --out_dir=docs/img

Writes
* sim_calibration.png: predicted vs paper stream_sync/colocated and stream_async/colocated
  for the 9 settings of PAPER.md Fig. 8, with the +-15% band;
* sim_modes.png: samples/s of the four modes for the 9 settings, with bubbles by cause;
* sim_scaling.png: samples/s vs device count (Qwen2.5-7B, 20K trace, H800) per mode.

Also prints the calibration table (markdown) and, last, a JSON line with its summary.
"""

from __future__ import annotations

import dataclasses
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from streamrl_jax.scheduling import lengths  # noqa: E402
from streamrl_podplan.simulation import calibrate, hardware, simulator  # noqa: E402
from streamrl_podplan.simulation.cost_model import CostParams  # noqa: E402
from streamrl_podplan.simulation.scenario import MODES, Scenario  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "docs/img", "Where the PNGs go.")
_SCALING = flags.DEFINE_list("scaling_devices", ["16", "32", "64", "128", "256"], "Pod sizes.")


def _label(r: calibrate.Row) -> str:
    return f"{r.max_len // 1000}K\n{r.model.split('-')[1].upper()}/{r.devices}"


def plot_calibration(rows: list[calibrate.Row], path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    x = np.arange(len(rows))
    for ax, key in zip(axes, ("sync", "async"), strict=True):
        pred = np.array([r.ratios[key][0] for r in rows])
        ref = np.array([r.ratios[key][1] for r in rows])
        ax.bar(x - 0.2, ref, 0.4, label="paper (Fig. 8)", color="#999999")
        ax.bar(x + 0.2, pred, 0.4, label="simulated", color="#1f77b4")
        ax.errorbar(x - 0.2, ref, yerr=0.15 * ref, fmt="none", ecolor="k", capsize=3, lw=0.8)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(x, [_label(r) for r in rows], fontsize=8)
        ax.set_title(f"stream_{key} / colocated (bars: +-15% of paper)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("throughput ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_modes(rows: list[calibrate.Row], path: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 4.2))
    x = np.arange(len(rows))
    width = 0.2
    for i, mode in enumerate(MODES):
        ax.bar(x + (i - 1.5) * width, [r.sim[mode] for r in rows], width, label=mode)
    ax.set_yscale("log")
    ax.set_xticks(x, [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("samples/s (simulated, log)")
    ax.set_title("Mode comparison, PAPER.md Fig. 8 settings (H800, PPO, batch 1024)")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(devices: list[int], path: str) -> dict:
    base = Scenario(
        mode="colocated",
        model=hardware.get_model("qwen2.5-7b"),
        hw=hardware.get_hardware("h800"),
        devices=devices[0],
        trace=lengths.paper_trace(20_000),
        params=CostParams(),
    )
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for n in devices:
        res = simulator.simulate_modes(dataclasses.replace(base, devices=n))
        for m in MODES:
            rates[m].append(res[m].samples_per_s)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for m in MODES:
        ax.plot(devices, rates[m], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.set_xlabel("H800 devices")
    ax.set_ylabel("samples/s (simulated)")
    ax.set_title("Scaling: Qwen2.5-7B, 20K trace, batch 1024")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return rates


def main(argv: list[str]) -> None:
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    rows = calibrate.run()
    plot_calibration(rows, os.path.join(_OUT.value, "sim_calibration.png"))
    plot_modes(rows, os.path.join(_OUT.value, "sim_modes.png"))
    devices = [int(d) for d in _SCALING.value]
    rates = plot_scaling(devices, os.path.join(_OUT.value, "sim_scaling.png"))
    print(calibrate.table(rows))
    for m in MODES:
        print(
            f"scaling {m:20s} "
            + " ".join(f"{d}:{r:.2f}" for d, r in zip(devices, rates[m], strict=True))
        )
    summary = calibrate.summary(rows)
    print(
        json.dumps(
            {k: (round(v, 4) if isinstance(v, float) else int(v)) for k, v in summary.items()}
        )
    )


if __name__ == "__main__":
    app.run(main)

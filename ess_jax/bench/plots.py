"""The PNG plots (``write_plots``): hit rate per layer, throughput vs pool ratio, locality heatmap (one panel per
context), simulated hit rate vs pool size; one function per figure, each drawing on a new figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def hit_rate_per_layer(plt, ess: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ess:
        rates = [c["hit_rate"] for c in r["per_layer"]]
        ax.plot(range(len(rates)), rates, marker="o", linestyle="-" if r["fetch"] == "inline" else "--",
                label=f"ratio {r['pool_ratio']:g}, {r['fetch']}")
    ax.set(xlabel="layer", ylabel="pool hit rate", ylim=(0, 1.02), title="ESS pool hit rate per layer")
    ax.set_xticks(range(len(ess[0]["per_layer"])))
    ax.legend(fontsize=8)
    return fig


def throughput_vs_ratio(plt, ess: list[dict], runs: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for fetch in sorted({r["fetch"] for r in ess}):
        by_ratio = sorted((r for r in ess if r["fetch"] == fetch), key=lambda r: r["pool_ratio"])
        x = [r["pool_ratio"] for r in by_ratio]
        y = [r["decode_tokens_per_s"] for r in by_ratio]
        lo = [y_ - min(r["decode_tokens_per_s_runs"]) for y_, r in zip(y, by_ratio)]
        hi = [max(r["decode_tokens_per_s_runs"]) - y_ for y_, r in zip(y, by_ratio)]
        ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=f"ess {fetch}")
    for r in runs:
        if r["offload"] == "none":
            ax.axhline(r["decode_tokens_per_s"], color="k", linestyle=":", label="resident")
    ax.set(xlabel="pool ratio", ylabel="decode tokens/s (median, min-max)", title="decode throughput vs pool ratio")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig


def locality_heatmap(plt, loc: dict):
    contexts, layers = loc["contexts"], loc["layers"]
    fig, axes = plt.subplots(len(contexts), 1, squeeze=False, sharex=True,
                             figsize=(7, len(contexts) * (0.4 * len(layers) + 1.2) + 0.6))
    for ax, c in zip(axes[:, 0], contexts):
        image = ax.imshow(np.asarray(c["raw_overlap"]), aspect="auto", vmin=0, vmax=1, cmap="viridis",
                          interpolation="nearest")
        ax.set(ylabel="layer", title=f"raw top-k overlap with the previous step, {c['context']}-token prompt")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        fig.colorbar(image, ax=ax)
    axes[-1, 0].set_xlabel("decode step")
    return fig


def hit_rate_vs_pool(plt, loc: dict):
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, c in enumerate(loc["contexts"]):
        color = f"C{i}"
        slots = [r["slots"] for r in c["lru"]]
        order = np.argsort(slots, kind="stable")
        ax.plot(np.asarray(slots)[order], np.asarray([r["hit_rate"] for r in c["lru"]])[order], marker="o",
                color=color, label=f"{c['context']} tokens, all layers")
        for j, layer in enumerate(loc["layers"]):
            ax.plot(np.asarray(slots)[order], np.asarray([r["per_layer"][j]["hit_rate"] for r in c["lru"]])[order],
                    color=color, alpha=0.35, linewidth=0.8, label=f"{c['context']}: per layer" if j == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="pool slots per (layer, request)", ylabel="simulated LRU hit rate", ylim=(0, 1.02),
           title=f"hit rate vs pool size ({loc['steps']} decode steps, top-k {loc['top_k']})")
    ax.legend(fontsize=8)
    return fig


def write_plots(result: dict, out: Path) -> list[str]:
    """The PNG plots into ``out`` (those with data: the first two need ESS runs, the last two the locality
    pass); the names of the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ess = [r for r in result["runs"] if r["offload"] == "ess"]
    loc = result["locality"]
    figures = []
    if ess:
        figures += [("hit_rate_per_layer.png", lambda: hit_rate_per_layer(plt, ess)),
                    ("throughput_vs_ratio.png", lambda: throughput_vs_ratio(plt, ess, result["runs"]))]
    if loc:
        figures += [("locality_heatmap.png", lambda: locality_heatmap(plt, loc)),
                    ("hit_rate_vs_pool.png", lambda: hit_rate_vs_pool(plt, loc))]
    for name, draw in figures:
        fig = draw()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    return [name for name, _ in figures]

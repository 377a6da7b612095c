"""Figures written by the stages (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from emad.io import atomic_write_bytes  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Render ``fig`` to PNG atomically and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def profile_figure(profile, title: str = ""):
    """Raw vs smoothed τ per stratum, argmax agreement per probe, and the oracle-depth distribution."""
    layers = profile.probe_layers
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for i, name in enumerate(profile.strata.names()):
        color = f"C{i % 10}"
        ax.plot(layers, profile.raw[name], "o--", color=color, alpha=0.5, label=f"{name} raw")
        ax.plot(layers, profile.tau[name], "-", color=color, label=f"{name} τ")
    ax.set(xlabel="probe layer", ylabel="entropy (nats)", title="target profile τ (raw vs smoothed)")
    ax.legend(fontsize=7)
    axes[1].plot(layers, profile.agreement, "o-")
    axes[1].set(xlabel="probe layer", ylabel="share of tokens", ylim=(0, 1.02),
                title="argmax equals final argmax")
    axes[2].bar([str(x) for x in layers], profile.oracle)
    axes[2].set(xlabel="oracle depth (probe layer)", ylabel="share of tokens", title="oracle depth distribution")
    if title:
        fig.suptitle(title, y=1.03)
    return fig


def depth_histogram_figure(histogram: dict[int, int], n_layers: int, title: str = ""):
    """Tokens per exit depth (1..L)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    depths = sorted(histogram)
    ax.bar(depths, [histogram[d] for d in depths], color="C0")
    ax.set_xlim(0.5, n_layers + 0.5)
    ax.set_xlabel("exit depth (layers run)")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    return fig


def readouts_figure(held_out: dict[str, dict[int, dict[str, float]]], title: str = ""):
    """Per layer, ``logit`` vs ``tuned``: top-1 agreement with the final layer, KL to it, next-token perplexity."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, ax, label, log in (("agreement", axes[0], "top-1 agreement with layer L", False),
                                ("kl", axes[1], "KL(final ‖ readout), nats", False),
                                ("perplexity", axes[2], "next-token perplexity", True)):
        for i, (readout, metrics) in enumerate(sorted(held_out.items())):
            layers = sorted(metrics)
            ax.plot(layers, [metrics[layer][key] for layer in layers], "o-", color=f"C{i}", label=readout)
        ax.set(xlabel="layer", ylabel=label)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, y=1.03)
    return fig

"""Figures written by the stages (matplotlib, Agg backend, PNG).

matplotlib is imported by the first figure drawn, not with this module: a stage imports these functions at its
top and pays for matplotlib (about 0.4 s) only when it draws.
"""

from __future__ import annotations

import io
from pathlib import Path

from emad.io import atomic_write_bytes


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def __getattr__(name: str):
    """``plt`` (``from emad.report.plots import plt``): pyplot, imported on that first use."""
    if name == "plt":
        return pyplot()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_figure(fig, path: str | Path, tight: bool = True) -> Path:
    """Render ``fig`` to PNG atomically and close it (``tight``: cropped to what is drawn; a figure laid out
    by hand renders faster without)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight" if tight else None)
    pyplot().close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def _global_curve(per_stratum: dict[str, list[float]], counts: dict[str, list[float]]) -> list[float]:
    """The token-weighted mean over strata per probe layer (plain mean where no counts are known)."""
    names = list(per_stratum)
    n = len(per_stratum[names[0]])
    out = []
    for i in range(n):
        w = [counts.get(k, [1.0] * n)[i] if counts else 1.0 for k in names]
        total = sum(w) or 1.0
        out.append(sum(wi * per_stratum[k][i] for wi, k in zip(w, names)) / total)
    return out


def profile_figure(profile, title: str = ""):
    """Target profile τ (global prominent, strata faint), argmax agreement per probe, and oracle-depth shares.

    The global profile is the only stratum when unstratified, else the token-weighted mean over strata; the legend
    sits below the first panel with a handful of entries.
    """
    layers = profile.probe_layers
    names = profile.strata.names()
    counts = getattr(profile, "count", {}) or {}
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    ax = axes[0]
    if len(names) > 1:
        for name in names:
            if name in profile.raw:
                ax.plot(layers, profile.raw[name], ls=":", lw=0.8, color="C0", alpha=0.3, zorder=1)
            ax.plot(layers, profile.tau[name], ls="-", lw=0.9, color="C0", alpha=0.3, zorder=1)
    raw = {k: v for k, v in profile.raw.items() if k in names}
    if raw:
        ax.plot(layers, _global_curve(raw, counts), "o--", color="black", lw=1.4, ms=4, label="global raw",
                zorder=4)
    ax.plot(layers, _global_curve({k: profile.tau[k] for k in names}, counts), "-", color="C3", lw=2.6, zorder=3,
            label="global τ (smoothed)" if len(names) == 1 else "global τ (token-weighted mean of strata)")
    if len(names) > 1:
        ax.plot([], [], color="C0", alpha=0.5, lw=0.9, label=f"{len(names)} strata: τ (solid), raw (dotted)")
    ax.set(xlabel="probe layer", ylabel="entropy (nats)", title="target profile τ")
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    axes[1].plot(layers, profile.agreement, "o-")
    axes[1].set(xlabel="probe layer", ylabel="share of tokens", ylim=(0, 1.02),
                title="argmax equals final argmax")
    axes[1].grid(alpha=0.25)
    axes[2].bar([str(x) for x in layers], profile.oracle)
    axes[2].set(xlabel="oracle depth (probe layer)", ylabel="share of tokens", title="oracle depth distribution")
    if len(layers) > 12:
        axes[2].tick_params(axis="x", labelrotation=90, labelsize=7)
    if title:
        fig.suptitle(title)
    return fig


def depth_histogram_figure(histogram: dict[int, int], n_layers: int, title: str = ""):
    """Tokens per exit depth (1..L), laid out by hand (one per run: save it with ``tight=False``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.9)
    ax = fig.add_subplot()
    depths = sorted(histogram)
    ax.bar(depths, [histogram[d] for d in depths], color="C0")
    ax.set_xlim(0.5, n_layers + 0.5)
    ax.set_xlabel("exit depth (layers run)")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    return fig


def readouts_figure(held_out: dict[str, dict[int, dict[str, float]]], title: str = ""):
    """Per layer, ``logit`` vs ``tuned``: top-1 agreement with the final layer, KL to it, next-token perplexity."""
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4.2))
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

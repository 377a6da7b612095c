"""Token-depth heat map: generated texts as HTML, each token shaded by the layer it exited at."""

from __future__ import annotations

import html
from collections.abc import Sequence


def _shade(depth: int, n_layers: int) -> str:
    """Light yellow (shallow exit) → dark red (full depth)."""
    x = (depth - 1) / max(n_layers - 1, 1)
    hue, light = 55 - 55 * x, 92 - 52 * x
    return f"hsl({hue:.0f}, 90%, {light:.0f}%)"


def heatmap_html(texts: Sequence[Sequence[tuple[str, int]]], n_layers: int, title: str = "") -> str:
    """A standalone HTML page.

    Args:
        texts: per text, its tokens as ``(token text, exit depth)``.
        n_layers: L (the colour scale spans 1..L).
        title: page heading (e.g. the run id).
    """
    legend = "".join(f'<span class="t" style="background:{_shade(d, n_layers)}">{d}</span>'
                     for d in sorted({1, *range(max(n_layers // 6, 1), n_layers, max(n_layers // 6, 1)), n_layers}))
    blocks = []
    for tokens in texts:
        spans = "".join(
            f'<span class="t" title="layer {d}" style="background:{_shade(d, n_layers)}">{html.escape(tok)}</span>'
            for tok, d in tokens)
        blocks.append(f"<pre>{spans}</pre>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:60em}}"
        "pre{white-space:pre-wrap;border:1px solid #ccc;padding:.5em;line-height:1.6}"
        ".t{border-radius:2px}</style></head><body>"
        f"<h3>{html.escape(title)}</h3><p>Each token is shaded by its exit layer (hover for the number); "
        f"scale: {legend}</p>{''.join(blocks)}</body></html>"
    )

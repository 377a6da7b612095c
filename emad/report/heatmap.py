"""Token-depth heat map: generated texts as HTML, each token shaded by the layer it exited at.

Prompt tokens (given apart, or as tokens whose depth is ``None`` or 0) are shown in grey before the generated
ones, set apart by a label; a full-depth continuation of the same prompt can be shown beside the adaptive one.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

Tokens = Sequence[tuple[str, int | None]]


def _shade(depth: int, n_layers: int) -> str:
    """Light yellow (shallow exit) → dark red (full depth); dark enough ends still carry black text."""
    x = min(max((depth - 1) / max(n_layers - 1, 1), 0.0), 1.0)
    hue, light = 55 - 55 * x, 92 - 40 * x
    return f"hsl({hue:.0f}, 90%, {light:.0f}%)"


def _scale_html(n_layers: int) -> str:
    """The colour scale: a continuous bar with a few depths written under it, well apart."""
    stops = ", ".join(_shade(d, n_layers) for d in range(1, n_layers + 1))
    step = max(n_layers // 5, 1)
    ticks = sorted({1, *range(step, n_layers, step), n_layers})
    marks = "".join(f'<span style="left:{100 * (d - 1) / max(n_layers - 1, 1):.1f}%">{d}</span>' for d in ticks)
    return (f'<div class="scale"><div class="bar" style="background:linear-gradient(to right, {stops})"></div>'
            f'<div class="ticks">{marks}</div><div class="cap">exit layer (1 = shallowest, {n_layers} = full '
            "depth); hover a token for its layer</div></div>")


def _token_spans(tokens: Tokens, n_layers: int) -> tuple[str, str]:
    """(prompt spans, generated spans): tokens without a depth (None or 0) are prompt tokens."""
    prompt, gen = [], []
    for tok, d in tokens:
        if not d:
            prompt.append(f'<span class="p">{html.escape(tok)}</span>')
        else:
            gen.append(f'<span class="t" title="layer {d}" style="background:{_shade(d, n_layers)}">'
                       f"{html.escape(tok)}</span>")
    return "".join(prompt), "".join(gen)


def _plain(text: str | Sequence[str] | None) -> str:
    if text is None:
        return ""
    return html.escape(text if isinstance(text, str) else "".join(text))


def _block(tokens: Tokens, n_layers: int, prompt: str | Sequence[str] | None,
           full: str | Sequence[str] | None, show_full: bool) -> str:
    inline_prompt, gen = _token_spans(tokens, n_layers)
    given = _plain(prompt)
    head = given + inline_prompt
    prompt_html = f'<div class="prompt"><b>prompt</b><pre>{head}</pre></div>' if head else ""
    adaptive = f'<div class="col"><b>adaptive depth</b><pre>{gen}</pre></div>'
    if not show_full:
        return f'<div class="item">{prompt_html}<pre>{gen}</pre></div>' if head else f"<pre>{gen}</pre>"
    beside = f'<div class="col"><b>full depth</b><pre class="full">{_plain(full)}</pre></div>'
    return f'<div class="item">{prompt_html}<div class="pair">{adaptive}{beside}</div></div>'


CSS = ("body{font-family:sans-serif;max-width:72em;margin:1em auto;padding:0 1em}"
       "pre{white-space:pre-wrap;border:1px solid #ccc;padding:.5em;line-height:1.7;margin:.2em 0}"
       ".t{border-radius:2px}.p{color:#666}.item{margin:1.2em 0;padding-bottom:.6em;border-bottom:2px solid #eee}"
       ".prompt pre{background:#f4f4f4;color:#555;border-style:dashed}.pair{display:flex;gap:1em}"
       ".col{flex:1;min-width:0}pre.full{background:#fafafa}b{font-size:.85em;color:#444}"
       ".scale{max-width:32em;margin:.5em 0 1.5em}.bar{height:14px;border:1px solid #999}"
       ".ticks{position:relative;height:1.3em;font-size:.8em}"
       ".ticks span{position:absolute;transform:translateX(-50%);top:2px}.cap{font-size:.8em;color:#555}")


def heatmap_html(texts: Sequence[Tokens], n_layers: int, title: str = "", *,
                 prompts: Sequence[str | Sequence[str] | None] | None = None,
                 full_depth: Sequence[str | Sequence[str] | None] | None = None) -> str:
    """A standalone HTML page.

    Args:
        texts: per text, its tokens as ``(token text, exit depth)``; a depth of ``None`` or 0 marks a prompt
            token (shown in grey, apart from the generated ones).
        n_layers: L (the colour scale spans 1..L).
        title: page heading (e.g. the run id).
        prompts: per text, its prompt (a string or token strings), shown above the generated text.
        full_depth: per text, the full-depth continuation of the same prompt (a string or token strings), shown
            beside the adaptive one.
    """
    blocks = []
    for i, tokens in enumerate(texts):
        prompt = prompts[i] if prompts is not None and i < len(prompts) else None
        full = full_depth[i] if full_depth is not None and i < len(full_depth) else None
        blocks.append(_block(tokens, n_layers, prompt, full, full_depth is not None))
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"
        f"<h3>{html.escape(title)}</h3><p>Each generated token is shaded by the layer it exited at.</p>"
        f"{_scale_html(n_layers)}{''.join(blocks)}</body></html>"
    )

"""An interactive head view: point at a token and see where each head looks.

:func:`head_view` draws one panel per head (a row of panels per layer): the
queries on the left, the keys on the right, and a line from query i to key j
whose opacity is the weight ``w[i, j]`` (weights below ``SMALLEST`` are
not drawn). Pointing at a query (or focusing it
with the keyboard, or tapping it) keeps only that query's lines and shades
each key by its weight, in every panel at once, so the heads can be compared
token by token. Pointing at a key does the same for the queries that read it.

The view is one self-contained piece of HTML: inline SVG and a short
stylesheet written here, scoped to the view, no script and nothing loaded
from another host. It works wherever HTML output is shown with its styles:
the built book, and JupyterLab once the notebook is trusted (a cell run in
the session is; ``jupyter trust`` trusts stored outputs, and ``make lab``
does that for the chapters). Its text form says what it shows, for print.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["HeadView", "head_view"]

# matplotlib's tab10, so a head has the colour it has in the static figures
COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)

# Layout of one panel, in CSS pixels.
ROW = 18  # height of one token's row
GAP = 64  # horizontal room for the lines
CHAR = 7.3  # width of one character of the labels (12 px monospace)
TOP = 4  # space above the first token
# Weights below this are not drawn: a line of opacity 0.02 is not seen.
SMALLEST = 0.02


class HeadView:
    """The HTML of a head view; Jupyter shows it through ``_repr_html_``."""

    def __init__(self, html_text: str, summary: str) -> None:
        self.html = html_text
        self.summary = summary

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.summary


def head_view(
    weights: ArrayLike,
    tokens: Sequence[str],
    *,
    keys: Sequence[str] | None = None,
    layer_names: Sequence[str] | None = None,
    head_names: Sequence[str] | None = None,
    show_weights: bool = False,
) -> HeadView:
    """An interactive view of attention weights, one panel per head.

    Args:
        weights: ``(H, T_q, T_k)`` for one layer or ``(L, H, T_q, T_k)``;
            each row non-negative, summing to at most 1 (a row of zeros is a
            query that attends to nothing).
        tokens: the ``T_q`` query labels; also the key labels unless
            ``keys`` is given.
        keys: the ``T_k`` key labels (cross-attention).
        layer_names: one title per layer (default "layer 0", "layer 1", ...).
        head_names: one title per head (default "head 0", "head 1", ...).
        show_weights: also print each weight, to two decimals, beside its
            key while its query is pointed at (for small examples).

    Returns:
        a :class:`HeadView`; its ``html`` is the view.
    """
    weights, queries, keys = _check(weights, tokens, keys)
    n_layers, n_heads, t_q, t_k = weights.shape
    layer_names = _names("layer", layer_names, n_layers)
    head_names = _names("head", head_names, n_heads)
    # the weights as drawn: 2 decimals of opacity are all an eye can tell
    drawn = np.round(weights, 2)
    uid = (
        "mha-hv-"
        + hashlib.sha1(
            repr(
                (
                    drawn.tolist(),
                    queries,
                    keys,
                    list(layer_names),
                    show_weights,
                )
            ).encode()
        ).hexdigest()[:10]
    )
    rows = []
    for layer in range(n_layers):
        panels = "".join(
            _panel(
                drawn[layer, head],
                queries,
                keys,
                head,
                head_names[head],
                show_weights,
            )
            for head in range(n_heads)
        )
        title = (
            f'<div class="mha-hv-layer">{html.escape(layer_names[layer])}'
            "</div>"
            if n_layers > 1
            else ""
        )
        rows.append(f'{title}<div class="mha-hv-row">{panels}</div>')
    style = _style(
        uid, t_q, t_k, _geometry(queries, keys, show_weights), n_heads
    )
    body = (
        f'<div class="mha-hv" id="{uid}">'
        f"<style>{style}</style>"
        '<p class="mha-hv-note">This view draws with its own stylesheet: '
        "run the cell (or trust the notebook) to see it.</p>"
        + "".join(rows)
        + "</div>"
    )
    layers = f"{n_layers} layers x " if n_layers > 1 else ""
    summary = (
        f"head view: {layers}{n_heads} heads, {t_q} queries x {t_k} keys "
        "(interactive in HTML)"
    )
    return HeadView(body, summary)


def _geometry(
    queries: list[str], keys: list[str], show_weights: bool
) -> dict[str, int]:
    """Where a panel puts things: the same for every panel of a view."""
    left = round(CHAR * max(map(len, queries)) + 8)  # where the lines start
    right = left + GAP  # where the keys' labels start
    # room for the key labels, and for a weight such as ".45" after them
    width = right + round(CHAR * (max(map(len, keys)) + 6 * show_weights)) + 8
    height = TOP + ROW * max(len(queries), len(keys))
    return {"left": left, "right": right, "width": width, "height": height}


def _y(row: int) -> int:
    return TOP + ROW * row + ROW // 2


def _panel(
    weights: np.ndarray,
    queries: list[str],
    keys: list[str],
    head: int,
    title: str,
    show_weights: bool,
) -> str:
    """One head: queries left, keys right, a line per weight drawn."""
    size = _geometry(queries, keys, show_weights)
    left, width, height = size["left"], size["width"], size["height"]
    t_q, t_k = weights.shape
    parts = [f'<g transform="translate({left} 0)">']
    for i, j in zip(*np.nonzero(weights >= SMALLEST)):
        parts.append(
            f'<path class="q{i} k{j}" d="M0 {_y(i)}L{GAP} {_y(j)}" '
            f'stroke-opacity="{_opacity(weights[i, j])}"/>'
        )
    parts.append("</g>")
    for i, label in enumerate(queries):  # a query: its box and its label
        parts.append(
            f'<g class="mha-hv-q q{i}" tabindex="0">'
            f'<rect y="{_y(i) - ROW // 2}"/>'
            f'<text x="{left - 6}" y="{_y(i)}">{html.escape(label)}</text>'
            "</g>"
        )
    for j, label in enumerate(keys):  # a key: its shades, one per query
        top = _y(j) - ROW // 2
        shades = "".join(
            f'<rect class="s q{i}" y="{top}" '
            f'fill-opacity="{_opacity(weights[i, j])}"/>'
            for i in np.nonzero(weights[:, j] >= SMALLEST)[0]
        )
        if show_weights:  # the weight of every query, shown for one
            shades += "".join(
                f'<text class="w q{i}" x="{width - 4}" y="{_y(j)}">'
                f"{weights[i, j]:.2f}</text>"
                for i in range(t_q)
            )
        parts.append(
            f'<g class="mha-hv-k k{j}" tabindex="0">{shades}'
            f'<rect y="{top}"/>'
            f'<text x="{size["right"] + 6}" y="{_y(j)}">'
            f"{html.escape(label)}</text></g>"
        )
    colour = COLOURS[head % len(COLOURS)]
    return (
        f'<div class="mha-hv-panel" style="--head: {colour}">'
        f'<div class="mha-hv-title">{html.escape(title)}</div>'
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{html.escape(title)}: lines from queries to keys">'
        + "".join(parts)
        + "</svg></div>"
    )


def _opacity(weight: float) -> str:
    """0.5 -> ".5": the shortest text of a weight rounded to 2 decimals."""
    return f"{weight:.2f}".rstrip("0").rstrip(".").lstrip("0") or "0"


def _style(
    uid: str, t_q: int, t_k: int, size: dict[str, float], n_heads: int
) -> str:
    """The stylesheet, scoped to the view ``uid``.

    One rule per query (and per key) says: while it is pointed at or
    focused, hide every line that is not its own, and show its shades.
    Where the view is narrower than one layer's panels side by side (a
    phone), the panels shrink to fit one layer in a row, so that every
    panel that changes when a token is pointed at stays on the screen.
    """
    scope = f"#{uid}"
    key_box = (
        f"x:{size['right'] + 2}px;width:{size['width'] - size['right']}px"
    )
    rules = [
        f"{scope}{{font-family:var(--pst-font-family-monospace,monospace);"
        "font-size:12px;margin:0.5em 0;max-width:100%}",
        f"{scope} .mha-hv-note{{display:none}}",
        f"{scope} .mha-hv-row{{display:flex;flex-wrap:wrap;gap:8px 18px}}",
        f"{scope} .mha-hv-layer{{font-weight:600;margin:6px 0 2px}}",
        f"{scope} .mha-hv-title{{color:var(--head);font-weight:600;"
        "text-align:center}",
        f"{scope} svg{{display:block}}",
        f"{scope} path{{stroke:var(--head);stroke-width:2;fill:none}}",
        f"{scope} text{{fill:currentColor;dominant-baseline:central;"
        "cursor:default;font-size:12px}",
        f"{scope} .mha-hv-q text{{text-anchor:end}}",
        f"{scope} rect{{height:{ROW}px;fill:transparent}}",
        f"{scope} .mha-hv-q rect{{width:{size['left'] - 2}px}}",
        f"{scope} .mha-hv-k rect{{{key_box}}}",
        f"{scope} rect.s{{fill:var(--head);visibility:hidden}}",
        f"{scope} text.w{{text-anchor:end;visibility:hidden}}",
        f"{scope} g:focus{{outline:none}}",
        f"{scope} g:focus text,{scope} g:hover text{{font-weight:700}}",
    ]
    one_layer = n_heads * size["width"] + (n_heads - 1) * 18  # in one row
    rules += [
        f"{scope}{{container-type:inline-size}}",
        f"@container (max-width:{one_layer}px){{"
        f"{scope} .mha-hv-row{{flex-wrap:nowrap;gap:4px 6px}}"
        f"{scope} .mha-hv-panel{{flex:1 1 0;min-width:0}}"
        f"{scope} svg{{width:100%;height:auto}}}}",
    ]
    for i in range(t_q):
        on = f"{scope}:has(.q{i}:is(:hover,:focus))"
        rules.append(f"{on} path:not(.q{i}){{visibility:hidden}}")
        rules.append(f"{on} :is(.s,.w).q{i}{{visibility:visible}}")
    for j in range(t_k):
        on = f"{scope}:has(.mha-hv-k.k{j}:is(:hover,:focus))"
        rules.append(f"{on} path:not(.k{j}){{visibility:hidden}}")
    return "".join(rules)


def _names(what: str, names: Sequence[str] | None, count: int) -> list[str]:
    if names is None:
        return [f"{what} {number}" for number in range(count)]
    if len(names) != count:
        raise ValueError(
            f"{what}_names must have one name per {what} ({count}), "
            f"got {len(names)}"
        )
    return [str(name) for name in names]


def _check(
    weights: ArrayLike, tokens: Sequence[str], keys: Sequence[str] | None
) -> tuple[np.ndarray, list[str], list[str]]:
    array = np.asarray(weights, dtype=float)
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise ValueError(
            "weights must have shape (H, T_q, T_k) or (L, H, T_q, T_k), "
            f"got shape {np.shape(weights)}"
        )
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("weights must be finite and non-negative")
    if (array.sum(axis=-1) > 1 + 1e-6).any():
        raise ValueError(
            "weights must be attention weights: each row sums to at most 1, "
            f"got a row summing to {array.sum(axis=-1).max():.4g}"
        )
    queries = [str(token) for token in tokens]
    keys = queries if keys is None else [str(key) for key in keys]
    t_q, t_k = array.shape[-2:]
    for name, labels, count, symbol in (
        ("tokens", queries, t_q, "T_q"),
        ("keys", keys, t_k, "T_k"),
    ):
        if len(labels) != count:
            raise ValueError(
                f"{name} must have one label per {symbol} = {count}, "
                f"got {len(labels)}"
            )
    return array, queries, keys

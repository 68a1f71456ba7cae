"""Pictures for the book.

Attention maps, head grids, shape diagrams and benchmark plots. Every function
draws from real arrays and returns the matplotlib objects it made, so a chapter
can adjust or save them. Nothing here computes attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

__all__ = [
    "book_style",
    "plot_attention",
    "plot_head_grid",
    "plot_mask",
    "plot_head_flow",
    "plot_split_heads",
    "plot_merge_heads",
    "plot_benchmark",
    "plot_parallel_split",
    "plot_ring_steps",
]


#: The smallest font size any figure of the book uses, in points: at 100 dpi
#: and the figure's own width, 7 points are 9.7 pixels on the page.
MIN_FONT_SIZE = 7

#: The widest figure, in inches: a captioned figure's box in the book's column
#: at 1280 px is 672 px wide, 6.7 inches at 100 dpi.
MAX_WIDTH = 6.7


def book_style() -> None:
    """Figures as the book shows them.

    Text is at least 7 points and sharp on dense screens. Figures are at most
    6.7 inches wide (a figure in the book's column at 100 dpi), so they are
    shown at their own size, not shrunk; in a notebook they are sent at twice
    the resolution ("retina"), with their size in CSS pixels attached.
    """
    plt.rcParams.update(
        {
            "figure.dpi": 100,
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.labelsize": 9,
            "xtick.labelsize": 8,
            "ytick.labelsize": 8,
            "legend.fontsize": 8,
        }
    )
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:  # not in IPython: nothing to configure
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


def plot_attention(
    weights: ArrayLike,
    ax: Axes | None = None,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    title: str | None = None,
    annotate: bool | None = None,
    vmax: float = 1.0,
    cmap: str = "Blues",
) -> Axes:
    """Draw one (T_q, T_k) attention map.

    Row i is query i, column j is key j, colour = weight. ``annotate`` writes
    each weight in its cell (default: when the map has at most 12 x 12 cells).
    """
    weights = _check_map(weights)
    if ax is None:
        t_q, t_k = weights.shape
        _, ax = plt.subplots(figsize=(0.5 + 0.45 * t_k, 0.5 + 0.45 * t_q))
    image = _draw_map(
        ax, weights, queries, keys, annotate, vmax=vmax, cmap=cmap
    )
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return ax


def plot_head_grid(
    weights: ArrayLike,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    row_label: str = "layer",
    suptitle: str | None = None,
    annotate: bool = False,
) -> Figure:
    """Draw a grid of attention maps from weights of shape (L, H, T_q, T_k).

    Weights of shape (H, T_q, T_k) give one row. Rows are layers (or whatever
    ``row_label`` names), columns are heads.
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim == 3:
        weights = weights[None]
    if weights.ndim != 4:
        raise ValueError(
            "weights must have shape (L, H, T_q, T_k) or (H, T_q, T_k), "
            f"got shape {weights.shape}"
        )
    n_rows, n_heads = weights.shape[:2]
    panel = min(2.6, (MAX_WIDTH - 0.5) / n_heads)  # inches per map
    fig, axes = plt.subplots(
        n_rows,
        n_heads,
        figsize=(panel * n_heads + 0.5, panel * n_rows + 0.4),
        squeeze=False,
    )
    for r in range(n_rows):
        for h in range(n_heads):
            ax = axes[r, h]
            _draw_map(ax, weights[r, h], queries, keys, annotate, fontsize=7)
            ax.set_title(
                f"{row_label} {r}, head {h}" if n_rows > 1 else f"head {h}",
                fontsize=9,
            )
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def _check_map(weights: ArrayLike) -> np.ndarray:
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2:
        raise ValueError(
            f"weights must have shape (T_q, T_k), got shape {weights.shape}"
        )
    return weights


def _draw_map(
    ax: Axes,
    weights: np.ndarray,
    queries: Sequence[str] | None,
    keys: Sequence[str] | None,
    annotate: bool | None,
    *,
    vmax: float = 1.0,
    cmap: str = "Blues",
    fontsize: float | None = None,
):
    """One (T_q, T_k) map on ``ax``.

    The image, tick labels, and the weights written in the cells.
    """
    t_q, t_k = weights.shape
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=vmax, aspect="equal")
    ax.set_xticks(
        range(t_k), keys if keys is not None else range(t_k), fontsize=fontsize
    )
    ax.set_yticks(
        range(t_q),
        queries if queries is not None else range(t_q),
        fontsize=fontsize,
    )
    if annotate is None:
        annotate = t_q <= 12 and t_k <= 12
    if annotate:
        for i in range(t_q):
            for j in range(t_k):
                value = weights[i, j]
                ax.text(
                    j,
                    i,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=max(MIN_FONT_SIZE, (fontsize or 9) - 1),
                    color="white" if value > 0.6 * vmax else "black",
                )
    return image


def plot_mask(
    mask: ArrayLike,
    ax: Axes | None = None,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    title: str | None = None,
    true_means: str = "may attend",
    false_means: str = "blocked",
) -> Axes:
    """Draw one boolean (T_q, T_k) mask: dark cell = True, light cell = False.

    ``true_means`` / ``false_means`` label the two colours in a legend, because
    the meaning of True depends on the library (True = may attend in the NumPy
    reference and in ``F.scaled_dot_product_attention``; True = blocked in
    ``torch.nn.MultiheadAttention``). A (T_k,) mask (one row of key padding) is
    drawn as a single row.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(
            f"mask must be a boolean array, got dtype {mask.dtype}"
        )
    if mask.ndim == 1:
        mask = mask[None, :]
    if mask.ndim != 2:
        raise ValueError(
            "mask must have shape (T_q, T_k) or (T_k,), "
            f"got shape {mask.shape}"
        )
    t_q, t_k = mask.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(0.8 + 0.4 * t_k, 1.2 + 0.4 * t_q))
    colours = ["#eeeeee", "#2b5c8a"]  # False, True
    ax.imshow(
        mask.astype(int),
        cmap=ListedColormap(colours),
        vmin=0,
        vmax=1,
        aspect="equal",
    )
    ax.set_xticks(range(t_k), keys if keys is not None else range(t_k))
    ax.set_yticks(range(t_q), queries if queries is not None else range(t_q))
    ax.set_xticks(np.arange(-0.5, t_k, 1.0), minor=True)
    ax.set_yticks(np.arange(-0.5, t_q, 1.0), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    handles = [
        Patch(facecolor=colours[1], label=f"True = {true_means}"),
        Patch(
            facecolor=colours[0],
            edgecolor="#999999",
            label=f"False = {false_means}",
        ),
    ]
    # below the "key" label, whatever the height of the axes: 30 points
    # under the axes clear the tick labels and the label
    below_label = offset_copy(
        ax.transAxes, fig=ax.figure, y=-30, units="points"
    )
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        bbox_transform=below_label,
        ncol=1,
        fontsize=7,
        frameon=False,
    )
    return ax


_FLOW_HEAD_CMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "YlOrBr")


def _flow_box(
    ax: Axes,
    values: np.ndarray,
    x0: float,
    y0: float,
    cmap: str,
    edge: str,
    vmin: float | None = None,
    vmax: float | None = None,
) -> None:
    """Draw ``values`` (rows, cols) as a heatmap filling a box.

    The box is [x0, x0 + cols] x [y0, y0 + rows].
    """
    rows, cols = values.shape
    if vmin is None or vmax is None:
        bound = float(np.max(np.abs(values))) or 1.0
        vmin, vmax = -bound, bound
    ax.imshow(
        values,
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        alpha=0.85,
        extent=(x0, x0 + cols, y0, y0 + rows),
        origin="upper",
        interpolation="nearest",
        zorder=1,
    )
    ax.add_patch(
        plt.Rectangle(
            (x0, y0),
            cols,
            rows,
            fill=False,
            edgecolor=edge,
            linewidth=1.5,
            zorder=2,
        )
    )


def _flow_label(
    ax: Axes,
    name: str,
    shape: tuple[int, ...],
    x: float,
    y: float,
    color: str = "black",
) -> None:
    """Write ``name`` and its shape in two lines, centred under a box.

    The box's bottom edge is at ``y``.
    """
    ax.text(
        x,
        y - 0.3,
        f"{name}\n{shape[0]}×{shape[1]}",
        ha="center",
        va="top",
        fontsize=7,
        color=color,
        linespacing=1.1,
    )


def _flow_arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    text: str = "",
    color: str = "0.3",
    *,
    below: bool = False,
) -> None:
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={
            "arrowstyle": "->",
            "color": color,
            "linewidth": 1.2,
            "shrinkA": 2,
            "shrinkB": 2,
        },
    )
    if text:
        ax.text(
            (start[0] + end[0]) / 2,
            (start[1] + end[1]) / 2 + (-0.4 if below else 0.4),
            text,
            ha="center",
            va="top" if below else "bottom",
            fontsize=7,
            color=color,
        )


def plot_head_flow(
    x: ArrayLike,
    queries: Sequence[ArrayLike],
    keys: Sequence[ArrayLike],
    values: Sequence[ArrayLike],
    weights: Sequence[ArrayLike],
    heads: Sequence[ArrayLike],
    concat: ArrayLike,
    output: ArrayLike,
    *,
    title: str | None = None,
) -> Figure:
    """Draw multi-head self-attention, head by head, from real arrays.

    The arrays are those of one forward pass. Every matrix is a box whose width
    and height are its number of columns and rows (one cell per entry, coloured
    by value), so the picture shows the shapes exactly: ``x`` (T, D) -> per
    head ``queries[i]`` and ``keys[i]`` (T, d_k) -> softmax(Q K^T / sqrt(d_k))
    = ``weights[i]`` (T, T) -> ``weights[i] @ values[i]`` = ``heads[i]``
    (T, d_v) -> ``concat`` (T, H * d_v) -> ``output`` (T, D_out). The values
    stand after the weights, where they enter. Each head has its own colour,
    also in its slice of ``concat``; ``output`` is grey because ``W_O`` mixes
    the heads.
    """
    x = np.asarray(x, dtype=float)
    concat = np.asarray(concat, dtype=float)
    output = np.asarray(output, dtype=float)
    per_head = {
        name: [np.asarray(a, dtype=float) for a in arrays]
        for name, arrays in (
            ("queries", queries),
            ("keys", keys),
            ("values", values),
            ("weights", weights),
            ("heads", heads),
        )
    }
    n_heads = len(per_head["queries"])
    if n_heads == 0 or any(
        len(arrays) != n_heads for arrays in per_head.values()
    ):
        raise ValueError(
            "queries, keys, values, weights and heads must be non-empty and "
            "of the same length, got "
            + ", ".join(
                f"{name} {len(arrays)}" for name, arrays in per_head.items()
            )
        )
    if x.ndim != 2:
        raise ValueError(f"x must have shape (T, D), got shape {x.shape}")
    t, d_model = x.shape
    for name, arrays in per_head.items():
        for i, array in enumerate(arrays):
            cols_ok = array.shape[1] == t if name == "weights" else True
            if array.ndim != 2 or array.shape[0] != t or not cols_ok:
                expected = f"({t}, {t})" if name == "weights" else f"({t}, d)"
                raise ValueError(
                    f"{name}[{i}] must have shape {expected}, "
                    f"got shape {array.shape}"
                )
    widths = [h.shape[1] for h in per_head["heads"]]
    if concat.shape != (t, sum(widths)):
        raise ValueError(
            f"concat must have shape ({t}, {sum(widths)}), "
            f"got shape {concat.shape}"
        )
    if output.ndim != 2 or output.shape[0] != t:
        raise ValueError(
            f"output must have shape ({t}, D_out), got shape {output.shape}"
        )

    gap = 3.0  # empty cells between boxes
    band = t + gap + 2.0  # height of one head's band, two-line labels included
    total_height = n_heads * band - gap
    # y of the boxes that are shared by all heads
    mid_y = total_height / 2 - t / 2

    qk_x = d_model + 2 * gap
    qk_width = (
        max(
            q.shape[1] + k.shape[1]
            for q, k in zip(per_head["queries"], per_head["keys"])
        )
        + 1
    )
    weights_x = qk_x + qk_width + 3 * gap  # room for softmax(Q K^T / ...)
    values_x = weights_x + t + 2.0  # weights @ V: the "@" between them
    values_width = max(v.shape[1] for v in per_head["values"])
    heads_x = values_x + values_width + 2 * gap
    concat_x = heads_x + max(widths) + 2 * gap
    output_x = concat_x + concat.shape[1] + 2 * gap
    width_units, height_units = (
        output_x + output.shape[1] + 1.0,
        total_height + 5.0,
    )
    fig, ax = plt.subplots(
        figsize=(
            MAX_WIDTH,
            round(0.6 + MAX_WIDTH * height_units / width_units, 1),
        )
    )
    _flow_box(ax, x, 0, mid_y, "Greys", "0.2")
    _flow_label(ax, "X", x.shape, d_model / 2, mid_y)

    offset = 0
    for i in range(n_heads):
        cmap = _FLOW_HEAD_CMAPS[i % len(_FLOW_HEAD_CMAPS)]
        color = plt.get_cmap(cmap)(0.8)
        y0 = (n_heads - 1 - i) * band
        q, k, v = (
            per_head["queries"][i],
            per_head["keys"][i],
            per_head["values"][i],
        )
        cursor = qk_x
        for name, array in (("Q", q), ("K", k)):
            _flow_box(ax, array, cursor, y0, cmap, color)
            _flow_label(
                ax,
                f"{name}_{i}",
                array.shape,
                cursor + array.shape[1] / 2,
                y0,
                color,
            )
            cursor += array.shape[1] + 1
        ax.text(
            (qk_x + cursor - 1) / 2,
            y0 + t + 0.3,
            f"X @ W_Q[{i}], X @ W_K[{i}]",
            ha="center",
            va="bottom",
            fontsize=7,
            color=color,
        )
        _flow_arrow(
            ax, (d_model, mid_y + t / 2), (qk_x, y0 + t / 2), "", color
        )
        _flow_box(
            ax,
            per_head["weights"][i],
            weights_x,
            y0,
            cmap,
            color,
            vmin=0.0,
            vmax=1.0,
        )
        _flow_label(ax, f"weights_{i}", (t, t), weights_x + t / 2, y0, color)
        _flow_arrow(
            ax,
            (cursor - 1, y0 + t / 2),
            (weights_x, y0 + t / 2),
            "softmax\n" + r"$(Q K^\top / \sqrt{d_k})$",
            color,
            below=True,
        )
        _flow_box(ax, v, values_x, y0, cmap, color)
        _flow_label(
            ax, f"V_{i}", v.shape, values_x + v.shape[1] / 2, y0, color
        )
        ax.text(
            values_x + v.shape[1] / 2,
            y0 + t + 0.3,
            f"X @ W_V[{i}]",
            ha="center",
            va="bottom",
            fontsize=7,
            color=color,
        )
        ax.text(
            weights_x + t + 1.0,
            y0 + t / 2,
            "@",
            ha="center",
            va="center",
            fontsize=8,
            color=color,
        )
        head = per_head["heads"][i]
        _flow_box(ax, head, heads_x, y0, cmap, color)
        _flow_label(
            ax, f"head_{i}", head.shape, heads_x + head.shape[1] / 2, y0, color
        )
        _flow_arrow(
            ax,
            (values_x + v.shape[1], y0 + t / 2),
            (heads_x, y0 + t / 2),
            "=",
            color,
        )
        _flow_box(
            ax,
            concat[:, offset : offset + widths[i]],
            concat_x + offset,
            mid_y,
            cmap,
            color,
        )
        head_mid = y0 + t / 2
        if head_mid > mid_y + t:
            # band above the concat box: arrive at the top of this head's slice
            target = (concat_x + offset + widths[i] / 2, mid_y + t)
        elif head_mid < mid_y:  # band below: arrive at the bottom of the slice
            target = (concat_x + offset + widths[i] / 2, mid_y)
        else:
            target = (concat_x, head_mid)
        _flow_arrow(ax, (heads_x + head.shape[1], head_mid), target, "", color)
        offset += widths[i]
    _flow_label(
        ax, "concat", concat.shape, concat_x + concat.shape[1] / 2, mid_y
    )
    _flow_box(ax, output, output_x, mid_y, "Greys", "0.2")
    _flow_label(
        ax, "output", output.shape, output_x + output.shape[1] / 2, mid_y
    )
    _flow_arrow(
        ax,
        (concat_x + concat.shape[1], mid_y + t / 2),
        (output_x, mid_y + t / 2),
        "@ W_O",
    )

    ax.set_xlim(-0.5, output_x + output.shape[1] + 0.5)
    ax.set_ylim(-2.6, total_height + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        title
        or f"Multi-head attention, {n_heads} heads: every box is drawn to its "
        "shape (one cell per entry)"
    )
    fig.tight_layout()
    return fig


def _trace_entries(
    source: np.ndarray, name: str
) -> dict[float, tuple[int, ...]]:
    """Map each value of ``source`` to its index.

    A moved entry can then be traced back to where it came from.
    """
    flat = source.ravel().tolist()
    if len(set(flat)) != len(flat):
        raise ValueError(
            f"{name} must hold distinct values so that each entry can be "
            "traced (np.arange works), "
            f"got {len(flat) - len(set(flat))} repeated values"
        )
    return {
        value: tuple(int(i) for i in np.unravel_index(k, source.shape))
        for k, value in enumerate(flat)
    }


def _draw_cells(
    ax: Axes,
    values: np.ndarray,
    fills: np.ndarray,
    misplaced: np.ndarray,
    title: str,
) -> None:
    """Draw a (rows, cols) grid of cells.

    A cell's fill comes from ``fills`` (RGBA), its value is written in it, and
    its edge is red if it is misplaced.
    """
    from matplotlib.patches import Rectangle

    whole = bool(np.all(np.equal(np.mod(values, 1), 0)))
    rows, cols = values.shape
    for i in range(rows):
        for j in range(cols):
            bad = bool(misplaced[i, j])
            ax.add_patch(
                Rectangle(
                    (j - 0.5, i - 0.5),
                    1,
                    1,
                    facecolor=fills[i, j],
                    edgecolor="red" if bad else "white",
                    linewidth=2.5 if bad else 1.0,
                )
            )
            text = f"{values[i, j]:.0f}" if whole else f"{values[i, j]:.2f}"
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=8,
                fontweight="bold" if bad else "normal",
                color="darkred" if bad else "black",
            )
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_aspect("equal")
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.tick_params(labelsize=7, length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=9)


def _head_colour(
    head: int, alpha: float = 0.45
) -> tuple[float, float, float, float]:
    red, green, blue, _ = plt.get_cmap("tab10")(head % 10)
    return (red, green, blue, alpha)


def plot_split_heads(
    x: ArrayLike, heads: ArrayLike, *, title: str | None = None
) -> Figure:
    """Draw a (T, D) matrix next to the (H, T, d_k) stack made from it.

    The matrix's columns are coloured by head. ``x`` must hold distinct values
    (``np.arange(T * D).reshape(T, D)`` is ideal) so that every entry of
    ``heads`` can be traced back to the row (token) and column (feature) it
    came from. In the stack, a cell takes the colour of the head whose columns
    it came from; a cell that came from another token's row or another head's
    columns is outlined in red. With the correct split (reshape to (T, H, d_k),
    then move H forward) no cell is red.
    """
    x = np.asarray(x, dtype=float)
    heads = np.asarray(heads, dtype=float)
    if x.ndim != 2:
        raise ValueError(f"x must have shape (T, D), got shape {x.shape}")
    if (
        heads.ndim != 3
        or heads.shape[0] * heads.shape[2] != x.shape[1]
        or heads.shape[1] != x.shape[0]
    ):
        raise ValueError(
            f"heads must have shape (H, T, d_k) with T = {x.shape[0]} "
            f"and H * d_k = {x.shape[1]}, "
            f"got shape {heads.shape}"
        )
    t, d = x.shape
    n_heads, _, d_k = heads.shape
    origin = _trace_entries(x, "x")
    cell = min(0.42, (MAX_WIDTH - 1.0) / (d + n_heads * (d_k + 1)))  # inches
    fig, axes = plt.subplots(
        1,
        n_heads + 1,
        figsize=(cell * (d + n_heads * (d_k + 1)) + 1.0, cell * t + 1.6),
        gridspec_kw={"width_ratios": [d] + [d_k] * n_heads},
    )
    column_fills = np.array(
        [[_head_colour(j // d_k) for j in range(d)] for _ in range(t)]
    )
    _draw_cells(
        axes[0],
        x,
        column_fills,
        np.zeros((t, d), dtype=bool),
        f"x: (T, D) = ({t}, {d})",
    )
    axes[0].set_xlabel("feature (column of x)", fontsize=8)
    axes[0].set_ylabel("token", fontsize=8)
    for h in range(n_heads):
        if any(value not in origin for value in heads[h].ravel().tolist()):
            raise ValueError(
                f"heads[{h}] holds values that are not in x: "
                "draw arrays made from x"
            )
        sources = [
            [origin[value] for value in row] for row in heads[h].tolist()
        ]  # (T, d_k) of (t, d)
        fills = np.array(
            [
                [_head_colour(src_d // d_k) for _, src_d in row]
                for row in sources
            ]
        )
        misplaced = np.array(
            [
                [src_t != i or src_d // d_k != h for src_t, src_d in row]
                for i, row in enumerate(sources)
            ]
        )
        _draw_cells(
            axes[1 + h], heads[h], fills, misplaced, f"head {h}: (T, d_k)"
        )
        axes[1 + h].set_xlabel("feature in head", fontsize=8)
    fig.suptitle(
        title
        or f"split: (T, D) = ({t}, {d})  ->  "
        f"(H, T, d_k) = ({n_heads}, {t}, {d_k})",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_merge_heads(
    heads: ArrayLike, merged: ArrayLike, *, title: str | None = None
) -> Figure:
    """Draw an (H, T, d_k) stack next to the (T, D) matrix merged from it.

    This is the split read backwards. ``heads`` must hold distinct values. A
    cell of ``merged`` takes the colour of the head it came from; it is
    outlined in red when it came from another token, another head, or another
    position in the head than the (T, H, d_k) order puts there.
    """
    heads = np.asarray(heads, dtype=float)
    merged = np.asarray(merged, dtype=float)
    if heads.ndim != 3:
        raise ValueError(
            f"heads must have shape (H, T, d_k), got shape {heads.shape}"
        )
    n_heads, t, d_k = heads.shape
    if merged.shape != (t, n_heads * d_k):
        raise ValueError(
            f"merged must have shape (T, H * d_k) = ({t}, {n_heads * d_k}), "
            f"got shape {merged.shape}"
        )
    d = n_heads * d_k
    origin = _trace_entries(heads, "heads")
    cell = min(0.42, (MAX_WIDTH - 1.0) / (d + n_heads * (d_k + 1)))  # inches
    fig, axes = plt.subplots(
        1,
        n_heads + 1,
        figsize=(cell * (d + n_heads * (d_k + 1)) + 1.0, cell * t + 1.6),
        gridspec_kw={"width_ratios": [d_k] * n_heads + [d]},
    )
    for h in range(n_heads):
        fills = np.array(
            [[_head_colour(h) for _ in range(d_k)] for _ in range(t)]
        )
        _draw_cells(
            axes[h],
            heads[h],
            fills,
            np.zeros((t, d_k), dtype=bool),
            f"head {h}: (T, d_k)",
        )
        axes[h].set_xlabel("feature in head", fontsize=8)
    axes[0].set_ylabel("token", fontsize=8)
    if any(value not in origin for value in merged.ravel().tolist()):
        raise ValueError(
            "merged holds values that are not in heads: "
            "draw arrays made from heads"
        )
    sources = [
        [origin[value] for value in row] for row in merged.tolist()
    ]  # (T, D) of (h, t, j)
    fills = np.array(
        [[_head_colour(src_h) for src_h, _, _ in row] for row in sources]
    )
    misplaced = np.array(
        [
            [
                (src_h, src_t, src_j) != (j // d_k, i, j % d_k)
                for j, (src_h, src_t, src_j) in enumerate(row)
            ]
            for i, row in enumerate(sources)
        ]
    )
    _draw_cells(
        axes[-1], merged, fills, misplaced, f"merged: (T, D) = ({t}, {d})"
    )
    axes[-1].set_xlabel("feature (column)", fontsize=8)
    fig.suptitle(
        title
        or f"merge: (H, T, d_k) = ({n_heads}, {t}, {d_k})  ->  "
        f"(T, D) = ({t}, {d})",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_benchmark(
    report: dict,
    series: dict[str, str],
    field: str = "median_s",
    ax: Axes | None = None,
    *,
    scale: float = 1.0,
    ylabel: str = "median time per call (s)",
    title: str | None = None,
    styles: dict[str, str] | None = None,
    log_y: bool = True,
) -> Axes:
    """Plot ``field`` of a benchmark report against T.

    One line per implementation.

    Args:
        report: a report of ``python -m mha.bench``
            (:func:`mha.bench.load_results`).
        series: implementation name -> label in the legend, in drawing order.
        field: the row field to draw (``median_s``, ``flop_per_s``,
            ``peak_memory_bytes``, ...).
        scale: divide the values by this (``1e-3`` shows seconds as ms,
            ``2**20`` bytes as MiB).
        styles: implementation name -> matplotlib format string (default
            ``"o-"``).
        log_y: a logarithmic y axis with ticks at 1, 2, 5 times powers of
            ten.

    T is on a base-2 logarithmic axis labelled with the measured lengths.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    from .bench.report import series as measured

    lengths: set[int] = set()
    for impl, label in series.items():
        seq_lens, values = measured(report, impl, field)
        if len(seq_lens) == 0:
            continue
        lengths.update(seq_lens.tolist())
        style = (styles or {}).get(impl, "o-")
        ax.plot(seq_lens, values / scale, style, label=label)
    ticks = sorted(lengths)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(
            FuncFormatter(lambda value, _: f"{value:g}")
        )
        ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return ax


def plot_parallel_split(
    w_q_parts: Sequence[ArrayLike],
    w_o_parts: Sequence[ArrayLike],
    *,
    head_dim: int,
) -> Figure:
    """Draw W_Q and W_O (``x @ W`` layout) as the processes hold them.

    ``w_q_parts[r]``: process r's columns of W_Q, (D, H/N d_k) each;
    ``w_o_parts[r]``: its rows of W_O, (H/N d_k, D). W_Q is drawn cut into
    columns (column-parallel), W_O into rows (row-parallel), a gap between
    processes, a thin line between heads, each process's block framed in its
    colour.
    """
    q_parts = [np.asarray(w, dtype=float) for w in w_q_parts]
    o_parts = [np.asarray(w, dtype=float) for w in w_o_parts]
    if len(q_parts) != len(o_parts) or not q_parts:
        raise ValueError(
            "w_q_parts and w_o_parts must hold one array per process, got "
            f"{len(q_parts)} and {len(o_parts)}"
        )
    limit = max(np.abs(w).max() for w in q_parts + o_parts)
    fig, (ax_q, ax_o) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 3.6))
    for ax, parts, axis in ((ax_q, q_parts, 1), (ax_o, o_parts, 0)):
        offset = 0.0
        for rank, part in enumerate(parts):
            rows, cols = part.shape
            x0, y0 = (offset, 0.0) if axis == 1 else (0.0, offset)
            ax.imshow(
                part,
                cmap="RdBu_r",
                vmin=-limit,
                vmax=limit,
                extent=(x0, x0 + cols, y0 + rows, y0),
            )
            colour = plt.get_cmap("tab10")(rank)
            ax.add_patch(
                plt.Rectangle(
                    (x0, y0), cols, rows, fill=False, lw=2.5, ec=colour
                )
            )
            first_head = rank * part.shape[axis] // head_dim
            for start in range(0, part.shape[axis], head_dim):
                name = f"head {first_head + start // head_dim}"
                if axis == 1:
                    ax.plot([x0 + start] * 2, [y0, y0 + rows], "k-", lw=0.6)
                    ax.text(
                        x0 + start + head_dim / 2,
                        y0 - 0.3,
                        name,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
                else:
                    ax.plot([x0, x0 + cols], [y0 + start] * 2, "k-", lw=0.6)
                    ax.text(
                        -0.6,
                        y0 + start + head_dim / 2,
                        name,
                        ha="right",
                        va="center",
                        fontsize=7,
                    )
            label = f"process {rank}"
            if axis == 1:
                ax.text(x0 + cols / 2, -1.8, label, ha="center", color=colour)
            else:
                ax.text(
                    cols + 0.6,
                    y0 + rows / 2,
                    label,
                    va="center",
                    rotation=270,
                    color=colour,
                )
            offset += part.shape[axis] + 1.0  # a gap between processes
        ax.set_xlim(-0.5, ax.get_xlim()[1] + 0.5)
        ax.set_ylim(ax.get_ylim()[0] + 0.5, -2.8)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
    ax_q.set_title("W_Q: columns split (column-parallel)")
    ax_q.set_xlabel("output feature (head by head)")
    ax_q.set_ylabel("input feature")
    ax_o.set_title("W_O: rows split (row-parallel)")
    ax_o.set_xlabel("output feature")
    ax_o.set_ylabel("input feature (head by head)", labelpad=34)
    fig.tight_layout()
    return fig


def plot_ring_steps(held: ArrayLike) -> Figure:
    """Draw a ring of P processes at each step of ring attention.

    ``held[s][r]``: the process whose keys and values process r has in hand
    at step s, an (S, P) array of ints in 0 .. P - 1. One panel per step:
    the processes on a circle, each with its own queries (``Q_r``, in its
    colour) beside the key/value part in hand (``KV_j``, in process j's
    colour); arrows from each process to the next where a step passes its
    part on (every step but the last).
    """
    held = np.asarray(held)
    if (
        held.ndim != 2
        or held.size == 0
        or not np.issubdtype(held.dtype, np.integer)
        or held.min() < 0
        or held.max() >= held.shape[1]
    ):
        raise ValueError(
            "held must be an (S, P) array of ints in 0 .. P - 1 (the owner "
            "of the part each process holds at each step), got shape "
            f"{held.shape} and dtype {held.dtype}"
        )
    steps, world = held.shape
    cols = min(steps, 4)
    rows = -(-steps // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(MAX_WIDTH, 1.8 * rows), squeeze=False
    )
    colour = plt.get_cmap("tab10")
    angles = np.pi / 2 - 2 * np.pi * np.arange(world) / world  # clockwise
    centres = 0.95 * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    width, height = 0.46, 0.34  # one half of a process's box
    for step, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if step >= steps:
            continue
        ax.set_aspect("equal")
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.2, 1.2)
        for rank, (x, y) in enumerate(centres):
            owner = int(held[step, rank])
            for dx, who, text in (
                (-width, rank, f"Q$_{rank}$"),
                (0.0, owner, f"KV$_{owner}$"),
            ):
                ax.add_patch(
                    plt.Rectangle(
                        (x + dx, y - height / 2),
                        width,
                        height,
                        facecolor=colour(who),
                        edgecolor="white",
                    )
                )
                ax.text(
                    x + dx + width / 2,
                    y,
                    text,
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=7,
                )
        if step < steps - 1:  # the part in hand goes on to the next
            for rank in range(world):
                ax.annotate(
                    "",
                    xy=centres[(rank + 1) % world],
                    xytext=centres[rank],
                    arrowprops={
                        "arrowstyle": "-|>",
                        "color": "0.45",
                        "lw": 1.0,
                        "shrinkA": 15,
                        "shrinkB": 15,
                        "connectionstyle": "arc3,rad=-0.3",
                    },
                )
        ax.set_title(f"step {step}", fontsize=9, pad=2)
    fig.tight_layout(w_pad=0.2)
    return fig

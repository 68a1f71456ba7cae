"""Pictures for the book: attention maps, head grids, shape diagrams, benchmark plots.

Every function draws from real arrays and returns the matplotlib objects it made,
so a chapter can adjust or save them. Nothing here computes attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

__all__ = ["plot_attention", "plot_head_grid"]


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
    """Draw one (T_q, T_k) attention map: row i is query i, column j is key j, colour = weight.

    ``annotate`` writes each weight in its cell (default: when the map has at most 12 x 12 cells).
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2:
        raise ValueError(f"weights must have shape (T_q, T_k), got shape {weights.shape}")
    if ax is None:
        _, ax = plt.subplots(figsize=(0.5 + 0.45 * weights.shape[1], 0.5 + 0.45 * weights.shape[0]))
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=vmax, aspect="equal")
    t_q, t_k = weights.shape
    ax.set_xticks(range(t_k), keys if keys is not None else range(t_k))
    ax.set_yticks(range(t_q), queries if queries is not None else range(t_q))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    if annotate is None:
        annotate = t_q <= 12 and t_k <= 12
    if annotate:
        for i in range(t_q):
            for j in range(t_k):
                value = weights[i, j]
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if value > 0.6 * vmax else "black")
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
    """Draw a grid of attention maps from weights of shape (L, H, T_q, T_k) (or (H, T_q, T_k)).

    Rows are layers (or whatever ``row_label`` names), columns are heads.
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim == 3:
        weights = weights[None]
    if weights.ndim != 4:
        raise ValueError(f"weights must have shape (L, H, T_q, T_k) or (H, T_q, T_k), got shape {weights.shape}")
    n_rows, n_heads, t_q, t_k = weights.shape
    fig, axes = plt.subplots(n_rows, n_heads, figsize=(2.6 * n_heads + 0.5, 2.6 * n_rows + 0.4), squeeze=False)
    for r in range(n_rows):
        for h in range(n_heads):
            ax = axes[r, h]
            ax.imshow(weights[r, h], cmap="Blues", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(t_k), keys if keys is not None else range(t_k), fontsize=7)
            ax.set_yticks(range(t_q), queries if queries is not None else range(t_q), fontsize=7)
            ax.set_title(f"{row_label} {r}, head {h}" if n_rows > 1 else f"head {h}", fontsize=9)
            if annotate:
                for i in range(t_q):
                    for j in range(t_k):
                        ax.text(j, i, f"{weights[r, h, i, j]:.2f}", ha="center", va="center", fontsize=6)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig

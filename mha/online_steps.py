"""The online softmax, one key tile at a time: a step-through for one query.

:func:`online_softmax_steps` follows one query through the loop of
:func:`mha.flash.online_softmax` and records, after each key tile, the
running maximum ``m``, sum ``ell``, the factor ``alpha = exp(m_old -
m_new)`` that rescaled what was summed before, and the accumulator ``acc``:
the state of :mod:`mha.flash` itself, read by running its loop over the
first tiles. With ``causal``, the tiles after the query's own position are
skipped (:func:`mha.flash.key_blocks`); a last step divides, ``acc /
ell``, as :func:`mha.flash.finish` does.

:func:`step_through` draws the steps as one piece of HTML: a row of frames
chosen with radio buttons and a stylesheet (``:checked``), no script and
nothing loaded from another host. It shows the numbers in natural units
(``exp``, as :mod:`mha.flash`), or with ``units="exp2"`` in base 2, as
chapter 13's Triton exercise and Triton's tutorial compute: the scores and
``m`` multiplied by log2(e), ``alpha = 2 ** (m_old - m_new)``; ``alpha``,
``ell``, ``acc`` and the output are the same numbers in both.
"""

from __future__ import annotations

import hashlib
import html
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import flash

__all__ = ["Step", "online_softmax_steps", "step_through", "StepThrough"]

# What the step-through can show: natural units, or base 2 (scores and m
# times log2(e), as a kernel that calls exp2 holds them).
UNITS = ("natural", "exp2")
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Step:
    """The state after one step of the loop (or the start, or the end)."""

    title: str  # the label of its button
    kind: str  # "start", "tile", "skipped" or "finish"
    keys: tuple[int, int]  # the keys of this tile, start..stop-1
    scores: NDArray[np.floating]  # the tile's scores, -inf where masked
    m: float  # running maximum after the step
    ell: float  # running sum of exp(score - m)
    alpha: float  # exp(m_old - m_new): what the old ell and acc were scaled by
    acc: NDArray[np.floating]  # (d_v,) running sum of exp(score - m) v
    out: NDArray[np.floating] | None = None  # acc / ell, at the finish


def online_softmax_steps(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    query: int,
    block_q: int,
    block_k: int,
    causal: bool = True,
) -> list[Step]:
    """The steps of the online softmax for query ``query`` of ``q``.

    Args:
        q: (T_q, d_k); k: (T_k, d_k); v: (T_k, d_v).
        query: which query row to follow.
        block_q, block_k: queries and keys per tile; the query is followed
            inside its tile of ``block_q`` queries, as the tiled pass runs.
        causal: bottom-right aligned; the key tiles past the query tile's
            last key are skipped (one more step shows them).

    Returns:
        a start step, one step per computed tile, a step for the skipped
        tiles (when any are) and a finish step.
    """
    q, k, v = (np.asarray(a, dtype=float) for a in (q, k, v))
    t_q, t_k = q.shape[0], k.shape[0]
    if not 0 <= query < t_q:
        raise ValueError(f"query must be in 0..{t_q - 1}, got {query}")
    start = query // block_q * block_q
    rows = slice(start, min(start + block_q, t_q))  # the query's tile
    row = query - start
    offset, scale = t_k - t_q, q.shape[-1] ** -0.5
    tiles = list(flash.key_blocks(rows, t_q, t_k, block_k, causal))
    empty = np.zeros(0)
    steps = [
        Step(
            "start",
            "start",
            (0, 0),
            empty,
            -math.inf,
            0.0,
            0.0,
            np.zeros(v.shape[-1]),
        )
    ]
    for number, cols in enumerate(tiles):
        # mha.flash's own loop, over the first number + 1 tiles
        m, ell, acc = flash.online_softmax(
            q[rows], k, v, rows, tiles[: number + 1], offset, causal, scale
        )
        scores = q[query] @ k[cols].T * scale  # (B_k,)
        if causal:
            keep = flash.causal_keep(rows, cols, offset)[row]
            scores = np.where(keep, scores, -np.inf)
        m_old = steps[-1].m
        alpha = 0.0 if math.isinf(m_old) else math.exp(m_old - m[row])
        steps.append(
            Step(
                f"tile {number}",
                "tile",
                (cols.start, cols.stop),
                scores,
                float(m[row]),
                float(ell[row]),
                alpha,
                acc[row],
            )
        )
    last = steps[-1]
    stop = tiles[-1].stop if tiles else 0
    if stop < t_k:
        steps.append(
            Step(
                "skipped",
                "skipped",
                (stop, t_k),
                empty,
                last.m,
                last.ell,
                1.0,
                last.acc,
            )
        )
    out, _ = flash.finish(
        np.array([last.m]), np.array([last.ell]), last.acc[None]
    )
    steps.append(
        Step(
            "result",
            "finish",
            (0, 0),
            empty,
            last.m,
            last.ell,
            1.0,
            last.acc,
            out[0],
        )
    )
    return steps


class StepThrough:
    """The HTML of a step-through; Jupyter shows it through
    ``_repr_html_``, and its text form lists the steps."""

    def __init__(self, html_text: str, summary: str) -> None:
        self.html = html_text
        self.summary = summary

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.summary


def _number(x: float) -> str:
    if math.isinf(x):
        return "−∞" if x < 0 else "∞"
    return f"{x:.3f}".replace("-", "−")


def _plain(x: float) -> str:
    """A number as it is shown, in ASCII (for data attributes)."""
    return "-inf" if x == -math.inf else f"{x:.3f}"


def _vector(values) -> str:
    return "[" + ", ".join(_number(float(x)) for x in values) + "]"


def step_through(
    steps: list[Step],
    t_k: int,
    block_k: int,
    query: int,
    *,
    units: str = "natural",
) -> StepThrough:
    """Draw ``steps`` (from :func:`online_softmax_steps` for ``query``) over
    ``t_k`` keys in tiles of ``block_k``: one frame per step, chosen by its
    button.

    ``units``: "natural" shows the scores and ``m`` as :mod:`mha.flash`
    holds them, ``alpha = exp(m_old - m_new)``; "exp2" shows them in base 2,
    multiplied by log2(e), as a kernel that calls ``exp2`` holds them,
    ``alpha = 2 ** (m_old - m_new)`` (the same number). ``ell``, ``acc`` and
    the output are the same in both.
    """
    if units not in UNITS:
        raise ValueError(f"units must be 'natural' or 'exp2', got {units!r}")
    view = _View(steps, units)
    # named by what it shows, to the digits shown, so the same on every CPU
    shown = [
        (s.title, view.m(s), _number(s.ell), _vector(s.acc)) for s in steps
    ]
    shown.append(units)
    uid = "mha-os-" + hashlib.sha1(repr(shown).encode()).hexdigest()[:10]
    inputs, labels, frames = [], [], []
    for number, step in enumerate(steps):
        box = f"{uid}-{number}"
        checked = " checked" if number == 0 else ""
        inputs.append(
            f'<input type="radio" name="{uid}" id="{box}" class="mha-os-i"'
            f"{checked}>"
        )
        labels.append(f'<label for="{box}">{html.escape(step.title)}</label>')
        frames.append(
            f'<div class="mha-os-frame mha-os-f{number}" '
            f'data-step="{number}" data-m="{_plain(step.m)}" '
            f'data-ell="{_plain(step.ell)}">'
            + f'<div class="mha-os-what">query {query}, keys 0 to {t_k - 1} '
            f"in tiles of {block_k}</div>"
            + _keys(steps, number, t_k, block_k)
            + _table(view, number)
            + f'<p class="mha-os-say">{_say(view, number)}</p></div>'
        )
    body = (
        f'<div class="mha-os" id="{uid}"><style>{_style(uid, len(steps))}'
        "</style>"
        '<p class="mha-os-note">This step-through draws with its own '
        "stylesheet: run the cell (or trust the notebook) to see it.</p>"
        + "".join(inputs)
        + f'<div class="mha-os-tabs">{"".join(labels)}</div>'
        + f'<p class="mha-os-units">{_units_note(units)}</p>'
        + f'<div class="mha-os-frames">{"".join(frames)}</div></div>'
    )
    base = " in base 2 (exp2)" if units == "exp2" else ""
    summary = (
        f"online softmax step-through: {len(steps)} steps over {t_k} keys in "
        f"tiles of {block_k}{base} (interactive in HTML)"
    )
    return StepThrough(body, summary)


class _View:
    """The steps as shown: m and the scores in the units chosen."""

    def __init__(self, steps: list[Step], units: str) -> None:
        self.steps = steps
        self.base2 = units == "exp2"
        self.factor = LOG2E if self.base2 else 1.0
        self.m_name = "m₂" if self.base2 else "m"
        self.s_name = "s₂" if self.base2 else "s"

    def m(self, step: Step) -> str:
        return _number(step.m * self.factor)

    def scores(self, step: Step) -> str:
        return _vector(step.scores * self.factor)

    def alpha(self, old: str, new: str) -> str:
        """alpha's formula, with the two maxima as shown."""
        if self.base2:
            return f"2^({old} − {new})"
        return f"exp({old} − {new})"


def _units_note(units: str) -> str:
    if units == "exp2":
        return (
            "Base 2, as chapter 13's Triton exercise computes: the scores "
            "and the running maximum are multiplied by log₂e = 1.443 (s₂ = "
            "s·log₂e, m₂ = m·log₂e), and α = 2^(m₂ before − m₂ after), which "
            "equals exp(m before − m after): α, ℓ, acc and the output are "
            "the same numbers as in natural units."
        )
    return (
        "Natural units, as mha.flash computes: scores s = q·k/√d_k, α = "
        "exp(m before − m after). Chapter 13's Triton exercise works in "
        "base 2 (exp2 of the scores times log₂e): the same α, ℓ, acc and "
        "output, with s and m multiplied by log₂e = 1.443; "
        'step_through(..., units="exp2") shows it.'
    )


def _keys(steps: list[Step], number: int, t_k: int, block_k: int) -> str:
    """The row of keys, each coloured by what the loop has done with it."""
    step = steps[number]
    tiles = [s for s in steps[: number + 1] if s.kind == "tile"]
    done = max((s.keys[1] for s in tiles), default=0)
    # a masked key is never seen: it stays masked in every later frame
    masked = {
        s.keys[0] + int(i)
        for s in tiles
        for i in np.flatnonzero(np.isneginf(s.scores))
    }
    skipped = next((s.keys for s in steps if s.kind == "skipped"), (t_k, t_k))
    cells = []
    for j in range(t_k):
        if j in masked:
            kind = "masked"
        elif step.kind == "tile" and step.keys[0] <= j < step.keys[1]:
            kind = "now"
        elif j >= skipped[0] and step.kind in ("skipped", "finish"):
            kind = "skipped"
        elif j < done:
            kind = "seen"
        else:
            kind = "ahead"
        edge = " edge" if j % block_k == 0 and j else ""
        cells.append(f'<span class="k {kind}{edge}" title="key {j}"></span>')
    return (
        '<div class="mha-os-keys" role="img" aria-label="keys 0 to '
        f'{t_k - 1}, coloured by step">{"".join(cells)}</div>'
        '<div class="mha-os-legend"><span class="k ahead"></span>not read '
        'yet <span class="k now"></span>this tile '
        '<span class="k seen"></span>seen '
        '<span class="k masked"></span>masked '
        '<span class="k skipped"></span>skipped</div>'
    )


def _table(view: _View, number: int) -> str:
    step = view.steps[number]
    before = view.steps[number - 1] if number else step
    cells = (
        f"<tr><th>{view.m_name}</th><td>{view.m(before)}</td>"
        f"<td>{view.m(step)}</td></tr>"
        f"<tr><th>ℓ</th><td>{_number(before.ell)}</td>"
        f"<td>{_number(step.ell)}</td></tr>"
        f"<tr><th>acc</th><td>{_vector(before.acc)}</td>"
        f"<td>{_vector(step.acc)}</td></tr>"
    )
    extra = ""
    if step.kind == "tile":
        extra = (
            f"<tr><th>α</th><td></td><td>{_number(step.alpha)}</td></tr>"
            f"<tr><th>scores {view.s_name}</th><td></td>"
            f"<td>{view.scores(step)}</td></tr>"
        )
    if step.out is not None:
        extra = f"<tr><th>out</th><td></td><td>{_vector(step.out)}</td></tr>"
    return (
        '<table class="mha-os-state"><tr><th></th><th>before</th>'
        f"<th>after</th></tr>{cells}{extra}</table>"
    )


def _say(view: _View, number: int) -> str:
    steps, m = view.steps, view.m_name
    step = steps[number]
    before = steps[number - 1] if number else step
    first, stop = step.keys
    if step.kind == "start":
        return (
            f"Nothing seen yet: {m} = −∞, ℓ = 0, acc = 0. Each step reads "
            "one tile of keys and values and updates these three."
        )
    if step.kind == "skipped":
        return (
            f"Keys {first} to {stop - 1} come after the last position of "
            "this query's tile: causal attention skips their tiles, never "
            "loads them, and the state stays as it was."
        )
    if step.kind == "finish":
        lse = step.m + math.log(step.ell)
        kept = (
            f"the logsumexp in base 2, m₂ + log₂ ℓ = {_number(lse * LOG2E)}, "
            f"divided by log₂e is the natural one, {_number(lse)}, which is "
            "kept for the backward pass."
            if view.base2
            else f"the logsumexp m + log ℓ = {_number(lse)} is kept for the "
            "backward pass."
        )
        return (
            "After the last tile, one division gives the output, out = acc "
            f"/ ℓ, and {kept}"
        )
    top = float(np.max(step.scores))
    masked = int(np.isinf(step.scores).sum())
    old, new = view.m(before), view.m(step)
    text = f"Keys {first} to {stop - 1}"
    if masked:
        text += f" ({masked} masked: after the query's position)"
    if math.isinf(before.m):
        text += (
            f": the first tile. {m} = {new}, its largest score, and α = "
            f"{view.alpha('−∞', new)} = 0: before it {m} was −∞ and nothing "
            "had been summed (ℓ = 0, acc = 0), so α has only zeros to "
            "rescale."
        )
    elif top > before.m:
        text += (
            f": the largest score, {_number(top * view.factor)}, is above "
            f"{m} = {old}, so {m} rises and the old ℓ and acc are multiplied "
            "by α = "
            f"{view.alpha(old, new)} = {_number(step.alpha)} before the "
            "tile's terms are added."
        )
    else:
        exp = "2^(s₂ − m₂)" if view.base2 else "exp(s − m)"
        text += (
            f": no score is above {m} = {old}, so {m} stays, α = 1, and the "
            f"tile's terms {exp} are added."
        )
    return text


def _style(uid: str, count: int) -> str:
    scope = f"#{uid}"
    rules = [
        f"{scope}{{font-size:0.9em;margin:0.5em 0;max-width:100%}}",
        f"{scope} .mha-os-note{{display:none}}",
        f"{scope} .mha-os-i{{position:absolute;opacity:0;width:1px;"
        "height:1px}",
        f"{scope} .mha-os-tabs{{display:flex;flex-wrap:wrap;gap:4px;"
        "margin-bottom:6px}",
        f"{scope} label{{border:1px solid #888;border-radius:4px;"
        "padding:1px 7px;cursor:pointer;white-space:nowrap}",
        f"{scope} .mha-os-frame{{display:none}}",
        f"{scope} .mha-os-keys{{display:flex;gap:1px;margin:4px 0}}",
        f"{scope} .k{{display:inline-block;height:18px;flex:1 1 0;"
        "min-width:4px;background:#eee}",
        f"{scope} .k.edge{{margin-left:4px}}",
        f"{scope} .k.ahead{{box-shadow:inset 0 0 0 1px #bbb}}",
        f"{scope} .k.seen{{background:#4c72b0}}",
        f"{scope} .k.now{{background:#dd8452}}",
        f"{scope} .k.masked{{background:#c44e52}}",
        f"{scope} .k.skipped{{background:#bbb;background-image:"
        "repeating-linear-gradient(45deg,#fff 0 2px,#bbb 2px 5px)}",
        f"{scope} .mha-os-legend,{scope} .mha-os-what,"
        f"{scope} .mha-os-units{{font-size:0.85em}}",
        f"{scope} .mha-os-legend .k{{width:12px;height:12px;flex:none;"
        "vertical-align:middle;margin:0 3px 0 8px}",
        f"{scope} table{{font-family:var(--pst-font-family-monospace,"
        "monospace);font-size:0.85em;margin:6px 0;display:block;"
        "overflow-x:auto;max-width:100%}",
        f"{scope} th,{scope} td{{padding:1px 8px;text-align:left}}",
        f"{scope} th{{font-family:var(--pst-font-family-base,sans-serif)}}",
    ]
    for number in range(count):
        on = f"{scope} #{uid}-{number}:checked"
        rules.append(f"{on}~.mha-os-frames .mha-os-f{number}{{display:block}}")
        rules.append(
            f"{on}~.mha-os-tabs label[for={uid}-{number}]"
            "{background:#4c72b0;color:#fff;border-color:#4c72b0}"
        )
        rules.append(
            f"{scope} #{uid}-{number}:focus-visible~.mha-os-tabs "
            f"label[for={uid}-{number}]{{outline:2px solid #dd8452}}"
        )
    return "".join(rules)

"""mha.plotting.plot_ring_steps: one panel per step, the parts each process holds, the arrows."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402
from mha.plotting import MAX_WIDTH, plot_ring_steps  # noqa: E402


def ring(P: int) -> list[list[int]]:
    """At step s process r holds the keys and values of process r - s."""
    return [[(r - s) % P for r in range(P)] for s in range(P)]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_one_panel_per_step_with_the_parts_each_process_holds(P):
    fig = plot_ring_steps(ring(P))
    try:
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert [ax.get_title() for ax in panels] == [f"step {s}" for s in range(P)]
        assert fig.get_figwidth() <= MAX_WIDTH
        for s, ax in enumerate(panels):
            labels = [t.get_text() for t in ax.texts if not isinstance(t, Annotation)]
            # each process: its queries, then the part in hand
            expected = []
            for r in range(P):
                expected += [f"Q$_{r}$", f"KV$_{(r - s) % P}$"]
            assert labels == expected
            arrows = [t for t in ax.texts if isinstance(t, Annotation)]
            assert len(arrows) == (P if s < P - 1 else 0)  # the last step sends nothing
    finally:
        plt.close(fig)


def test_the_colour_of_a_part_is_its_owners():
    fig = plot_ring_steps(ring(4))
    try:
        step_1 = [ax for ax in fig.axes if ax.get_title() == "step 1"][0]
        boxes = step_1.patches  # per process: its queries' box, then the part in hand's
        for r in range(4):
            queries, part = boxes[2 * r], boxes[2 * r + 1]
            owner = 2 * ((r - 1) % 4)  # the box of the owner's own queries
            assert part.get_facecolor() == boxes[owner].get_facecolor()
            assert part.get_facecolor() != queries.get_facecolor()  # not its own
        assert len({boxes[2 * r].get_facecolor() for r in range(4)}) == 4  # one per process
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    "held",
    [[0, 1, 2], [[0, 3], [1, 0]], [[0.0, 1.0], [1.0, 0.0]], [[-1, 0], [0, 1]], [[]]],
    ids=["1-d", "owner too large", "floats", "negative", "empty"],
)
def test_bad_input_is_refused_naming_the_argument(held):
    with pytest.raises(ValueError, match=r"held must be an \(S, P\) array of ints"):
        plot_ring_steps(held)

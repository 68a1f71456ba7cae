"""The head view in the built book responds to the pointer.

Headless Chromium moves the pointer over a query token: only that query's lines stay visible, in
every head, and its weights appear beside the keys; over a key, only the lines into that key stay;
away from the view, every line is back. The view stays inside the column at 1280 px and at 390 px.
"""

from __future__ import annotations

import pytest
from browser import browser, require_chromium

PAGES = ["chapters/04_worked_example.html", "chapters/10_what_heads_learn.html"]

# Per view: the visible lines (by their classes), the visible shades and weights, and the
# centres of the first panel's query and key boxes.
STATE = r"""
(() => {
  const view = document.querySelector('.mha-hv');
  if (!view) return null;
  const shown = (el) => getComputedStyle(el).visibility === 'visible'
    && el.getBoundingClientRect().width + el.getBoundingClientRect().height > 0;
  const centre = (el) => {
    const r = el.getBoundingClientRect();
    return [r.x + r.width / 2, r.y + r.height / 2];
  };
  const panel = view.querySelector('.mha-hv-panel');
  const article = document.querySelector('article.bd-article').getBoundingClientRect();
  const box = view.getBoundingClientRect();
  return {
    lines: [...view.querySelectorAll('path')].filter(shown).map((p) => p.getAttribute('class')),
    all_lines: [...view.querySelectorAll('path')].map((p) => p.getAttribute('class')),
    shades: [...view.querySelectorAll('rect.s')].filter(shown).map((r) => r.getAttribute('class')),
    weights: [...view.querySelectorAll('text.w')].filter(shown).map((t) => t.textContent),
    queries: [...panel.querySelectorAll('.mha-hv-q')].map(centre),
    keys: [...panel.querySelectorAll('.mha-hv-k')].map(centre),
    panels: view.querySelectorAll('.mha-hv-panel').length,
    inside: box.left >= article.left - 1 && box.right <= article.right + 1,
  };
})()
"""


@pytest.fixture(scope="module")
def page():
    with browser(require_chromium()) as tab:
        yield tab


def _point(page, x: float, y: float) -> dict:
    page.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    return page.evaluate(STATE)


def _scroll_to_view(page) -> None:
    page.evaluate("document.querySelector('.mha-hv').scrollIntoView({block: 'center'})")


@pytest.mark.parametrize("name", PAGES)
def test_pointing_at_a_query_keeps_its_lines_only(page, html_dir, name):
    page.open((html_dir / name).as_uri(), 1280, height=900)
    _scroll_to_view(page)
    before = page.evaluate(STATE)
    assert before is not None, f"{name} has no head view"
    assert before["lines"] == before["all_lines"] != []  # every line, nothing pointed at
    assert before["shades"] == [] and before["weights"] == []
    for i, (x, y) in enumerate(before["queries"]):
        after = _point(page, x, y)
        # query i's lines, in every head, and no other
        own = [c for c in before["all_lines"] if c.split()[0] == f"q{i}"]
        assert after["lines"] == own != [], (i, after["lines"])
        assert after["shades"] and all(f"q{i}" in c.split() for c in after["shades"])
    _point(page, 1, 1)  # away from the view
    assert page.evaluate(STATE)["lines"] == before["all_lines"]


@pytest.mark.parametrize("name", PAGES)
def test_pointing_at_a_key_keeps_the_lines_into_it(page, html_dir, name):
    page.open((html_dir / name).as_uri(), 1280, height=900)
    _scroll_to_view(page)
    state = page.evaluate(STATE)
    for j, (x, y) in enumerate(state["keys"]):
        after = _point(page, x, y)
        into = [c for c in state["all_lines"] if c.split()[1] == f"k{j}"]
        assert after["lines"] == into != [], (j, after["lines"])
        assert after["weights"] == []


def test_worked_example_prints_the_weights_of_the_query(page, html_dir):
    page.open((html_dir / "chapters/04_worked_example.html").as_uri(), 1280, height=900)
    _scroll_to_view(page)
    state = page.evaluate(STATE)
    after = _point(page, *state["queries"][0])
    # head 1's row 0 is (1, a, a) / (1 + 2a) with a = e^(1/sqrt 2): 0.1978 0.4011 0.4011;
    # head 2's row 0 is 0.2483 0.5035 0.2483 (chapter 4 derives both by hand)
    assert after["weights"] == ["0.20", "0.40", "0.40", "0.25", "0.50", "0.25"]


@pytest.mark.parametrize("name", PAGES)
@pytest.mark.parametrize("width", [1280, 390])
def test_the_view_fits_the_column(page, html_dir, name, width):
    page.open((html_dir / name).as_uri(), width)
    assert page.evaluate(STATE)["inside"], f"{name}: the head view leaves the column at {width}px"


# A phone's screen in CSS pixels (390 x 844), less the browser's bars.
PHONE_WIDTH, PHONE_VIEW_HEIGHT = 390, 700

PANELS = r"""
(() => {
  const view = document.querySelector('.mha-hv');
  const box = view.getBoundingClientRect();
  const panels = [...view.querySelectorAll('.mha-hv-panel')].map((p) => p.getBoundingClientRect());
  return {
    height: box.height,
    inside: panels.every((p) => p.left >= box.left - 1 && p.right <= box.right + 1),
  };
})()
"""


@pytest.mark.parametrize("name", PAGES)
def test_on_a_phone_every_panel_that_changes_is_on_the_screen_at_once(page, html_dir, name):
    # Pointing at a token changes every panel of the view: on a phone they must all be on the
    # screen together, so the view is no taller than the screen and no panel is cut off.
    page.open((html_dir / name).as_uri(), PHONE_WIDTH, height=844)
    state = page.evaluate(PANELS)
    assert state["height"] <= PHONE_VIEW_HEIGHT, (
        f"{name}: the head view is {state['height']:.0f}px tall"
    )
    assert state["inside"], f"{name}: a panel is cut off at {PHONE_WIDTH}px"

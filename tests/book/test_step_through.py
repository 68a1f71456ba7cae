"""The online-softmax step-through of chapter 13, clicked through in the built book.

Headless Chromium clicks each step's button, at 1280 px and at 390 px: exactly that step's frame
is shown, its numbers are the ones the chapter glued (the frame's m and ell, from mha.flash), and
the buttons and the frame stay inside the column.
"""

from __future__ import annotations

import pytest
from browser import browser, require_chromium

PAGE = "chapters/13_flash_attention.html"

STATE = r"""
(() => {
  const view = document.querySelector('.mha-os');
  if (!view) return null;
  const article = document.querySelector('article.bd-article').getBoundingClientRect();
  const inside = (el) => {
    const r = el.getBoundingClientRect();
    return r.left >= article.left - 1 && r.right <= article.right + 1;
  };
  const shown = [...view.querySelectorAll('.mha-os-frame')]
    .filter((f) => getComputedStyle(f).display !== 'none');
  const checked = [...view.querySelectorAll('input')].findIndex((i) => i.checked);
  return {
    labels: [...view.querySelectorAll('label')].map((l) => {
      const r = l.getBoundingClientRect();
      return [r.x + r.width / 2, r.y + r.height / 2, inside(l)];
    }),
    shown: shown.map((f) => Number(f.dataset.step)),
    m: shown.map((f) => f.dataset.m),
    text: shown.map((f) => f.innerText),
    frame_inside: shown.every(inside),
    checked: checked,
  };
})()
"""


@pytest.fixture(scope="module")
def page():
    with browser(require_chromium()) as tab:
        yield tab


def _click(page, x: float, y: float) -> dict:
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    return page.evaluate(STATE)


@pytest.mark.parametrize("width", [1280, 390])
def test_every_frame_is_reached_by_its_button(page, html_dir, width):
    page.open((html_dir / PAGE).as_uri(), width, height=900)
    page.evaluate("document.querySelector('.mha-os').scrollIntoView({block: 'center'})")
    before = page.evaluate(STATE)
    assert before is not None, "chapter 13 has no step-through"
    assert len(before["labels"]) >= 8
    assert before["shown"] == [0] and before["checked"] == 0  # the start, as the page opens
    seen = []
    for number in range(len(before["labels"])):
        state = page.evaluate(STATE)
        x, y, inside = state["labels"][number]
        assert inside, f"button {number} leaves the column at {width}px"
        after = _click(page, x, y)
        assert after["shown"] == [number] and after["checked"] == number, (number, after)
        assert after["frame_inside"], f"frame {number} leaves the column at {width}px"
        seen.append((after["m"][0], after["text"][0]))
    assert seen[0][0] == "-inf" and "Nothing seen yet" in seen[0][1]
    assert "skips their tiles" in seen[-2][1] and "out = acc / ℓ" in seen[-1][1]
    assert len({text for _, text in seen}) == len(seen)  # every frame says something else

"""What a reader sees: every chapter page rendered in headless Chromium and measured.

At 1280 px: no table, output or code box wider than the column (nothing scrolls sideways inside
the article), no heading or display equation cut off, figures shown at their own size (not
shrunk, so their text stays legible) with a caption and a descriptive alt text, glued numbers in
the weight of the text around them, the page's contents column not cut off. At 390 px (a phone):
the page itself never scrolls sideways.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from browser import browser, require_chromium

ROOT = Path(__file__).resolve().parents[2]

WIDE, PHONE = 1280, 390

# Collects what a reader would see as broken, as a list of strings.
MEASURE = r"""
(() => {
  const problems = [];
  const article = document.querySelector('article.bd-article');
  if (!article) { return ['no article element']; }
  const right = article.getBoundingClientRect().right;
  const label = (el) => {
    const text = (el.innerText || el.getAttribute('alt') || '').trim().split('\n')[0];
    const first = el.className ? '.' + String(el.className).split(' ')[0] : '';
    return `${el.tagName.toLowerCase()}${first} "${text.slice(0, 60)}"`;
  };
  const boxes = article.querySelectorAll(
    'pre, table, div.cell_output, div.output, div.highlight, div.math,'
    + ' mjx-container[display="true"], h1, h2, h3, h4, figure, div.admonition,'
    + ' div.exercise, div.solution, blockquote');
  for (const el of boxes) {
    if (el.closest('.toggle-hidden, details:not([open])')) continue;
    if (el.scrollWidth > el.clientWidth + 1) {
      problems.push(`${label(el)} is ${el.scrollWidth - el.clientWidth}px wider than its box`);
    } else if (el.getBoundingClientRect().right > right + 1) {
      const past = Math.round(el.getBoundingClientRect().right - right);
      problems.push(`${label(el)} reaches ${past}px past the column`);
    }
  }
  // Anything else that does not fit: content cut off by a box that hides its overflow (inline math
  // in a heading), a box that scrolls, or an element that sticks out of the column.
  const overflow = (el) => getComputedStyle(el).overflowX;
  const seen = new Set();
  for (const el of article.querySelectorAll('*')) {
    const mode = overflow(el);
    if (mode !== 'hidden' && mode !== 'clip') continue;
    // What its laid-out children need (scrollWidth also counts hidden helpers, such as
    // MathJax's assistive MathML, which a reader never sees).
    const kids = [...el.children].filter((c) => getComputedStyle(c).position !== 'absolute');
    const need = Math.max(0, ...kids.map((c) => c.getBoundingClientRect().right));
    const cut = need - el.getBoundingClientRect().right;
    if (cut > 2) {
      problems.push(`${label(el)}: ${Math.round(cut)}px of it are cut off`);
      seen.add(el);
    }
  }
  for (const el of article.querySelectorAll('*')) {
    const box = el.getBoundingClientRect();
    if (box.right <= right + 1 || box.width === 0) continue;
    let parent = el.parentElement, handled = false;
    while (parent && parent !== article) {
      if (seen.has(parent) || overflow(parent) !== 'visible') { handled = true; break; }
      if (parent.getBoundingClientRect().right > right + 1) { handled = true; break; }
      parent = parent.parentElement;
    }
    if (!handled && !seen.has(el)) {
      problems.push(`${label(el)} reaches ${Math.round(box.right - right)}px past the column`);
    }
  }
  // A table squeezed so narrow that a cell shows a word or two per line.
  for (const cell of article.querySelectorAll('td, th')) {
    const words = cell.innerText.trim().split(/\s+/).filter(Boolean).length;
    const style = getComputedStyle(cell);
    const lineHeight = parseFloat(style.lineHeight) || 1.5 * parseFloat(style.fontSize);
    const inner = cell.getBoundingClientRect().height
      - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
    const lines = Math.max(1, Math.round(inner / lineHeight));
    if (words >= 6 && words / lines < 2.5) {
      problems.push(`table cell "${cell.innerText.trim().slice(0, 40)}" is crushed to`
        + ` ${lines} lines for ${words} words`);
      break;
    }
  }
  for (const img of article.querySelectorAll('img')) {
    const alt = (img.getAttribute('alt') || '').trim();
    // A file name or path (MyST-NB's default alt text) is no description.
    if (alt.length < 20 || !/\s/.test(alt) || /_images\/|\.(png|jpe?g|svg|gif)$/i.test(alt)) {
      problems.push(`image without a descriptive alt text: "${alt.slice(0, 60)}"`);
    }
    // A figure sent at twice its resolution ("retina") carries its size in CSS pixels.
    const styled = img.style.width.endsWith('px') ? parseFloat(img.style.width) : 0;
    const intended = img.getAttribute('width') ? parseFloat(img.getAttribute('width'))
      : styled || img.naturalWidth;
    const shown = img.getBoundingClientRect().width;
    if (intended && shown < 0.95 * intended) {
      problems.push(`image "${alt.slice(0, 40)}" shrunk to ${Math.round(100 * shown / intended)}%`
        + ' of its size: its text is smaller than drawn');
    }
    const figure = img.closest('figure');
    if (!figure || !figure.querySelector('figcaption .caption-number')) {
      problems.push(`image "${alt.slice(0, 40)}" has no numbered caption`);
    }
  }
  for (const span of article.querySelectorAll('span.pasted-text')) {
    const weight = parseInt(getComputedStyle(span).fontWeight, 10);
    const around = parseInt(getComputedStyle(span.parentElement).fontWeight, 10);
    if (weight > around) { problems.push(`glued number "${span.innerText}" is bold`); break; }
  }
  const toc = document.querySelector('.bd-sidebar-secondary');
  if (toc && getComputedStyle(toc).display !== 'none') {
    const edge = Math.min(toc.getBoundingClientRect().right, document.documentElement.clientWidth);
    for (const el of toc.querySelectorAll('a, li, ul, nav')) {
      if (el.getBoundingClientRect().right > edge + 1 || el.scrollWidth > el.clientWidth + 1) {
        problems.push(`contents column: "${el.innerText.trim().slice(0, 40)}" is cut off`);
        break;
      }
    }
  }
  return problems;
})()
"""

# The widest element that makes the page scroll sideways on a phone, if any.
PHONE_SCROLL = r"""
(() => {
  const width = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth <= width + 1) return null;
  let widest = null;
  for (const el of document.querySelectorAll('body *')) {
    const r = el.getBoundingClientRect();
    if (r.right > width + 1 && (!widest || r.right > widest.right)) {
      widest = {right: r.right, name: el.tagName + ' ' + (el.innerText || '').trim().slice(0, 50)};
    }
  }
  return `page is ${document.documentElement.scrollWidth}px wide at ${width}px`
    + (widest ? `; widest: ${widest.name}` : '');
})()
"""


def _pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [entry["file"] for entry in part.get("chapters", [])]
    return [f"{name}.html" for name in files]


PAGES = _pages()


@pytest.fixture(scope="module")
def page():
    with browser(require_chromium()) as tab:
        yield tab


@pytest.mark.parametrize("name", PAGES)
def test_page_fits_the_column_at_1280px(page, html_dir, name):
    page.open((html_dir / name).as_uri(), WIDE)
    problems = page.evaluate(MEASURE)
    assert not problems, f"{name} at {WIDE}px:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("name", PAGES)
def test_page_does_not_scroll_sideways_at_390px(page, html_dir, name):
    page.open((html_dir / name).as_uri(), PHONE)
    problem = page.evaluate(PHONE_SCROLL)
    assert problem is None, f"{name} at {PHONE}px: {problem}"

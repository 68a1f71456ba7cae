"""The head view's HTML: what it draws is the weights, it is self-contained, bad input is named.

How it responds to the pointer is checked in a browser (tests/book/test_head_view.py).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import mha
import numpy as np
import pytest
from mha.head_view import SMALLEST, head_view


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


def _parse(html_text: str) -> _Elements:
    parser = _Elements()
    parser.feed(html_text)
    return parser


def _weights(seed: int = 0, shape=(2, 3, 5, 5)) -> np.ndarray:
    scores = np.random.default_rng(seed).normal(size=shape) * 3
    return mha.softmax(scores)


def test_one_line_per_drawn_weight_with_its_weight_as_opacity():
    weights = _weights()  # (L, H, T, T)
    view = head_view(weights, list("abcde"))
    panels = view.html.split('<div class="mha-hv-panel"')[1:]
    assert len(panels) == weights.shape[0] * weights.shape[1]
    for number, panel in enumerate(panels):
        layer, head = divmod(number, weights.shape[1])
        drawn = np.round(weights[layer, head], 2)
        paths = [a for tag, a in _parse(panel).elements if tag == "path"]
        assert len(paths) == int((drawn >= SMALLEST).sum()) > 0
        for attrs in paths:
            i, j = (int(n) for n in re.fullmatch(r"q(\d+) k(\d+)", attrs["class"]).groups())
            assert float(attrs["stroke-opacity"]) == pytest.approx(drawn[i, j])
            assert drawn[i, j] >= SMALLEST


def test_a_sharp_head_draws_one_line_per_query():
    one_hot = np.eye(4)[[1, 2, 3, 0]][None]  # (H=1, T, T): query i reads key i + 1
    paths = [a for t, a in _parse(head_view(one_hot, list("wxyz")).html).elements if t == "path"]
    assert [p["class"] for p in paths] == ["q0 k1", "q1 k2", "q2 k3", "q3 k0"]
    assert {p["stroke-opacity"] for p in paths} == {"1"}
    # y of query i and key j: the line from query 3 ends at key 0, the top row
    assert paths[3]["d"] == "M0 67L64 13"


def test_every_query_and_key_can_be_pointed_at_and_focused():
    view = head_view(_weights(shape=(2, 4, 6)), list("abcd"), keys=list("uvwxyz"))
    elements = _parse(view.html).elements
    queries = [a for t, a in elements if t == "g" and "mha-hv-q" in a.get("class", "")]
    keys = [a for t, a in elements if t == "g" and "mha-hv-k" in a.get("class", "")]
    assert len(queries) == 2 * 4 and len(keys) == 2 * 6
    assert all(a.get("tabindex") == "0" for a in queries + keys)
    style = "".join(_parse(view.html).styles)
    for i in range(4):
        assert f":has(.q{i}:is(:hover,:focus)) path:not(.q{i}){{visibility:hidden}}" in style
    for j in range(6):
        assert f":has(.mha-hv-k.k{j}:is(:hover,:focus)) path:not(.k{j})" in style


def test_the_view_is_self_contained_and_scoped():
    view = head_view(_weights(), [f"t{i}" for i in range(5)], show_weights=True)
    text = view.html
    assert "<script" not in text and "http" not in text and "url(" not in text
    assert "@import" not in text
    uid = re.match(r'<div class="mha-hv" id="(mha-hv-[0-9a-f]{10})">', text).group(1)
    style = "".join(_parse(text).styles)
    rules = [r for r in re.split(r"}", style) if r.strip()]
    # a container query only wraps scoped rules (the narrow layout)
    rules = [re.sub(r"^@container \([^)]*\)\{", "", rule) for rule in rules]
    assert all(rule.startswith(f"#{uid}") for rule in rules), rules[:3]


def test_the_same_weights_give_the_same_html_and_other_weights_another_id():
    a = head_view(_weights(0), list("abcde"))
    assert a.html == head_view(_weights(0), list("abcde")).html  # stored outputs stay stable
    b = head_view(_weights(1), list("abcde"))
    uid = re.compile(r'id="(mha-hv-\w+)"')
    assert uid.search(a.html).group(1) != uid.search(b.html).group(1)


def test_show_weights_prints_each_weight_for_its_query():
    weights = np.array([[[0.25, 0.75], [1.0, 0.0]]])  # (H, T, T)
    view = head_view(weights, ["a", "b"], show_weights=True)
    texts = re.findall(r'<text class="w q(\d)" [^>]*>([0-9.]+)</text>', view.html)
    assert sorted(texts) == sorted([("0", "0.25"), ("1", "1.00"), ("0", "0.75"), ("1", "0.00")])


def test_text_form_and_layer_titles():
    view = head_view(_weights(), list("abcde"), layer_names=["first", "second"])
    assert repr(view) == "head view: 2 layers x 3 heads, 5 queries x 5 keys (interactive in HTML)"
    assert view._repr_html_() == view.html
    assert ">first</div>" in view.html and ">second</div>" in view.html
    one = head_view(_weights()[0], list("abcde"))
    assert repr(one) == "head view: 3 heads, 5 queries x 5 keys (interactive in HTML)"
    assert 'class="mha-hv-layer"' not in one.html
    named = head_view(_weights()[0], list("abcde"), head_names=["h1", "h2", "h3"])
    titles = re.findall(r'<div class="mha-hv-title">([^<]*)</div>', named.html)
    assert titles == ["h1", "h2", "h3"]


def test_labels_are_escaped():
    view = head_view(np.eye(2)[None], ["<b>", "a&b"])
    assert "&lt;b&gt;" in view.html and "a&amp;b" in view.html and "<b>" not in view.html


@pytest.mark.parametrize(
    ("weights", "tokens", "kwargs", "message"),
    [
        (np.ones((3, 3)) / 3, "abc", {}, r"weights must have shape \(H, T_q, T_k\)"),
        (-np.eye(3)[None], "abc", {}, "finite and non-negative"),
        (np.full((1, 3, 3), np.nan), "abc", {}, "finite and non-negative"),
        (np.ones((1, 3, 3)), "abc", {}, "each row sums to at most 1, got a row summing to 3"),
        (np.eye(3)[None], "ab", {}, r"tokens must have one label per T_q = 3, got 2"),
        (np.eye(3)[None], "abc", {"keys": "ab"}, r"keys must have one label per T_k = 3"),
        (np.eye(3)[None, None], "abc", {"layer_names": ["a", "b"]}, "one name per layer"),
        (
            np.eye(3)[None],
            "abc",
            {"head_names": ["a", "b"]},
            r"head_names must have one name per head \(1\), got 2",
        ),
    ],
)
def test_bad_input_is_named(weights, tokens, kwargs, message):
    with pytest.raises(ValueError, match=message):
        head_view(weights, list(tokens), **kwargs)

"""A bibliography labelled as the text cites: "Vaswani et al., 2017", sorted by author and year.

sphinxcontrib-bibtex formats the reference list with a pybtex style; the built-in ones label
entries [1], [2], ... while the text cites author and year. This style keeps pybtex's ``plain``
formatting (sorted by author, year, title) and gives each entry an author-year label.
"""

from __future__ import annotations

from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle


def _surname(person) -> str:
    return " ".join(person.prelast_names + person.last_names) or " ".join(person.first_names)


class AuthorYearLabels(BaseLabelStyle):
    """"Rush, 2018", "Milakov and Gimelshein, 2018", "Vaswani et al., 2017"."""

    def format_labels(self, sorted_entries):
        labels = list(self._labels(sorted_entries))
        # The same authors in the same year: 2023a, 2023b, in the list's order.
        for label in set(labels):
            places = [i for i, other in enumerate(labels) if other == label]
            if len(places) > 1:
                for letter, i in zip("abcdefghijklmnopqrstuvwxyz", places):
                    labels[i] = f"{label}{letter}"
        yield from labels

    def _labels(self, sorted_entries):
        for entry in sorted_entries:
            people = entry.persons.get("author") or entry.persons.get("editor") or []
            names = [_surname(p).replace("{", "").replace("}", "") for p in people]
            if not names:
                who = entry.fields.get("title", entry.key)
            elif len(names) == 1:
                who = names[0]
            elif len(names) == 2:
                who = f"{names[0]} and {names[1]}"
            else:
                who = f"{names[0]} et al."
            yield f"{who}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearStyle(PlainStyle):
    default_label_style = "authoryear"


def setup(app):
    register_plugin("pybtex.style.labels", "authoryear", AuthorYearLabels)
    register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

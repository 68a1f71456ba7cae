"""The package's one error policy, in one place.

* A value of the wrong *type* raises ``TypeError``:
  ``num_heads must be an int, got float 2.0``.
* A value of the right type but a bad *value* raises ``ValueError``:
  ``num_heads must be a positive int, got 0``.
* Every message names the argument, what was expected and what came.

Checks return the value they accept, so a caller can write
``n = check_int("n", n)``.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "check_int",
    "check_divisible",
    "check_probability",
    "check_choice",
    "check_positive",
    "shape_text",
]


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int``, at least ``minimum``.

    NumPy integers are accepted too, ``bool`` never.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return int(value)


def check_divisible(name: str, value: int, by_name: str, by: int) -> int:
    """``value // by``, after checking that ``by`` divides ``value``.

    For example D by H.
    """
    if value % by != 0:
        raise ValueError(
            f"{name} ({value}) must be divisible by {by_name} ({by})"
        )
    return value // by


def check_probability(name: str, value: object) -> float:
    """A float in ``[0, 1)``: a dropout probability."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a float, got {type(value).__name__} {value!r}"
        )
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must lie in [0, 1), got {value}")
    return float(value)


def check_choice(
    name: str, value: object, choices: tuple[object, ...]
) -> object:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r}"
        )
    return value


def check_positive(name: str, value: object) -> float:
    """``value`` as a ``float``: a real number, finite and above zero."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a float, got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive finite float, got {value}"
        )
    return float(value)


def shape_text(expected: dict[str, tuple[int, ...]]) -> str:
    """``{"(B, T_k)": (2, 5)}`` -> ``"(B, T_k) = (2, 5)"``.

    Several shapes are joined by ``or``.
    """
    return " or ".join(
        f"{symbol} = {shape}" for symbol, shape in expected.items()
    )

"""The checker machinery: a checklist run over a learner's function, the
comparisons with the package's results, and the messages."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validate import check_choice

Array = NDArray[Any]
# Two results agree when they differ by rounding only.
RTOL, ATOL = 1e-6, 1e-9


class Failed(Exception):
    """One checklist item failed; the message says how."""


class Checker:
    """Runs a learner's function through a checklist; one per ``check_*``."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        framework: str,
        error_hints: dict[str, str] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"fn must be a function, got {type(fn).__name__} {fn!r}"
            )
        check_choice("framework", framework, ("numpy", "torch"))
        self.name, self.fn, self.framework = name, fn, framework
        # words of an error message -> what usually causes it
        self.error_hints = error_hints or {}
        self.items: list[tuple[str, Callable[[], None]]] = []

    def item(self, title: str) -> Callable:
        """Decorator: add the decorated function as the next item."""

        def add(run: Callable[[], None]) -> Callable[[], None]:
            self.items.append((title, run))
            return run

        return add

    def call(self, *args: Any, copy: bool = True, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with arrays in the chosen framework.

        The arrays are copies unless ``copy=False``, so that a function that
        changes its inputs cannot change what it is compared with.
        """
        args = tuple(to_framework(a, self.framework, copy) for a in args)
        kwargs = {
            k: to_framework(a, self.framework, copy) for k, a in kwargs.items()
        }
        try:
            # the checklist reports overflow and NaN; NumPy's warnings would
            # only repeat it
            with np.errstate(all="ignore"):
                return self.fn(*args, **kwargs)
        except Exception as error:  # the learner's error, reported as such
            shapes = ", ".join(describe(a) for a in args)
            hints = [
                hint
                for words, hint in self.error_hints.items()
                if words in str(error)
            ]
            raise Failed(
                f"calling it with ({shapes}) raised "
                f"{type(error).__name__}: {error}"
                + "".join(f"\n{hint}" for hint in hints)
            ) from None

    def run(self, verbose: bool) -> None:
        total = len(self.items)
        for number, (title, run) in enumerate(self.items, 1):
            try:
                run()
            except Failed as failed:
                raise AssertionError(
                    wrap(
                        f"{self.name}: item {number} of {total} failed: "
                        f"{title}.",
                        str(failed),
                    )
                ) from None
        if verbose:
            print(f"{self.name}: all {total} items pass")
            for number, (title, _) in enumerate(self.items, 1):
                print(f"  {number}. {title}")


def failure(check: Callable, fn: Callable, **kwargs: Any) -> str | None:
    """The message ``check(fn, **kwargs)`` fails with, or None if it passes."""
    try:
        check(fn, verbose=False, **kwargs)
    except AssertionError as error:
        return str(error)
    return None


# Arrays in and out, comparisons, messages


def to_framework(value: Any, framework: str, copy: bool) -> Any:
    if not isinstance(value, np.ndarray):
        return value
    if copy:
        value = value.copy()
    if framework == "torch":
        import torch

        return torch.from_numpy(value)  # shares memory, float64 stays
    return value


def as_array(value: Any) -> Array:
    """A learner's result as a NumPy array (torch tensors are converted)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as error:
        raise Failed(
            f"the result is {type(value).__name__}, not an array ({error})"
        ) from None


def shares_memory(part: Any, buffer: Any) -> bool:
    if hasattr(part, "untyped_storage"):  # torch
        return part.untyped_storage().data_ptr() == (
            buffer.untyped_storage().data_ptr()
        )
    return isinstance(part, np.ndarray) and np.shares_memory(part, buffer)


def output_and_weights(result: Any) -> tuple[Array, Array | None]:
    """``output`` or ``(output, weights)``, as arrays."""
    if isinstance(result, tuple | list):
        if len(result) != 2:
            raise Failed(
                f"it returned {len(result)} values: return the output, or "
                "(output, weights)"
            )
        return as_array(result[0]), as_array(result[1])
    return as_array(result), None


def normal_arrays(
    rng: np.random.Generator, *shapes: tuple
) -> tuple[Array, ...]:
    return tuple(rng.normal(size=shape) for shape in shapes)


def expect_shape(
    got: Array,
    shape: tuple,
    what: str,
    known: dict[tuple, str] | None = None,
) -> None:
    if got.shape == tuple(shape):
        return
    hint = (known or {}).get(got.shape, "")
    raise Failed(
        f"{what} has shape {got.shape}, expected {tuple(shape)}"
        + (f": {hint}" if hint else "")
    )


def compare(
    got: Any,
    expected: Array,
    what: str,
    mistakes: dict[str, Array | tuple[Array, ...]] | None = None,
) -> None:
    """Pass if ``got`` equals ``expected`` up to rounding; otherwise fail,
    naming the mistake whose result (one of them) ``got`` equals, if any."""
    got = as_array(got)
    expect_shape(got, expected.shape, what)
    if not np.issubdtype(got.dtype, np.number) and got.dtype != bool:
        raise Failed(f"{what} has dtype {got.dtype}, expected numbers")
    if np.allclose(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
        return
    # NaN where a mistake gives 0 is a second mistake (an empty row): name
    # the first
    for hint, twins in (mistakes or {}).items():
        for twin in twins if isinstance(twins, tuple) else (twins,):
            if twin.shape == got.shape and np.allclose(
                np.nan_to_num(got), np.nan_to_num(twin), rtol=RTOL, atol=ATOL
            ):
                raise Failed(hint)
    if np.isnan(got).any() and not np.isnan(expected).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(got))[0])
        raise Failed(f"{what} holds NaN (first at index {where})")
    with np.errstate(invalid="ignore"):
        error = np.abs(got.astype(float) - expected)
    where = np.unravel_index(np.nanargmax(error), error.shape)
    raise Failed(
        f"{what} differs from the package's result by up to "
        f"{error[where]:.3g}: at index {tuple(int(i) for i in where)} it is "
        f"{got[where]:.4g}, expected {expected[where]:.4g}"
    )


def compare_mask(got: Array, expected: Array, mistakes: dict) -> None:
    if np.array_equal(got, expected):
        return
    for hint, twin in mistakes.items():
        if np.array_equal(got, twin):
            raise Failed(hint)
    raise Failed(
        f"got\n{got.astype(int)}\nexpected\n{expected.astype(int)} "
        "(1 = may attend)"
    )


def short(values: Array) -> str:
    return np.array2string(np.asarray(values), precision=4, separator=", ")


def describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"array {tuple(shape)}"
    return repr(value)


# A message fits a code cell's output box even inside a solution's dropdown.
WIDTH = 74


def wrap(title: str, detail: str) -> str:
    """The message, in lines of at most ``WIDTH`` characters."""
    lines = textwrap.wrap(title, WIDTH)
    for paragraph in detail.split("\n"):
        lines += textwrap.wrap(
            paragraph, WIDTH, initial_indent="  ", subsequent_indent="  "
        ) or [""]
    return "\n".join(lines)

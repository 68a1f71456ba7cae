"""The checker machinery: a checklist run over a learner's function, the
comparisons with the package's results, and the messages."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import numpy as np
from numpy.typing import NDArray

from .._validate import check_choice
from . import guard

Array = NDArray[Any]
# Two results agree when they differ by rounding only: float64 results to
# RTOL and ATOL; results in float32 (or narrower) to float32's rounding:
# a right float32 version is off by up to 1e-4 where a score near 800
# (float32's steps there are 6e-5 apart) went through exp, and RTOL_32
# leaves three times that. ATOL is relative to the largest
# expected value: rounding follows the size of the terms summed, and a
# small result of large terms carries their error.
RTOL, ATOL = 1e-6, 1e-9
RTOL_32, ATOL_32 = 3e-4, 3e-6


def tolerance(dtype: Any) -> tuple[float, float]:
    """``(rtol, atol)`` for a result of ``dtype``."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating) and dtype.itemsize < 8:
        return RTOL_32, ATOL_32
    return RTOL, ATOL


class Failed(Exception):
    """One checklist item failed; the message says how.

    ``learner_frames`` is the traceback inside the learner's function when
    it raised, so that the report can show the learner's own line.
    """

    def __init__(
        self, message: str, learner_frames: TracebackType | None = None
    ) -> None:
        super().__init__(message)
        self.learner_frames = learner_frames


class OutOfBounds(Failed):
    """A learner's kernel read or wrote outside a tensor it was given."""


class Checker:
    """Runs a learner's function through a checklist; one per ``check_*``."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        framework: str,
        error_hints: dict[str, str] | None = None,
        device: Any = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"fn must be a function, got {type(fn).__name__} {fn!r}"
            )
        check_choice("framework", framework, ("numpy", "torch"))
        self.name, self.fn, self.framework = name, fn, framework
        # where the torch tensors handed to fn live ("cpu" for NumPy)
        self.device = checker_device(framework, device)
        # words of an error message -> what usually causes it
        self.error_hints = error_hints or {}
        self.items: list[tuple[str, Callable[[], None]]] = []
        # (ndim, axis from the end, size) -> (what it is, the mask that
        # keeps an index below it): the messages of a kernel out of bounds
        self.bounds: guard.Bounds = {}

    def item(self, title: str) -> Callable:
        """Decorator: add the decorated function as the next item."""

        def add(run: Callable[[], None]) -> Callable[[], None]:
            self.items.append((title, run))
            return run

        return add

    def call(self, *args: Any, copy: bool = True, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with arrays in the chosen framework, torch
        tensors on :attr:`device`.

        The arrays are copies unless ``copy=False``, so that a function that
        changes its inputs cannot change what it is compared with. With
        ``copy=False`` a change ``fn`` makes to its inputs reaches the
        caller's arrays, on any device (from a GPU, copied back after the
        call). A tensor ``fn`` returns must be on the device of the tensors
        it got: :class:`Failed` says so otherwise.

        With torch, every Triton kernel ``fn`` launches runs inside guard
        bands (:mod:`.guard`): a load or store outside a tensor raises
        :class:`OutOfBounds`, naming the tensor, the places and the mask.
        """
        moved: list[tuple[Array, Any]] = []  # (array, its tensor elsewhere)

        def convert(value: Any) -> Any:
            converted = to_framework(value, self.framework, copy, self.device)
            if not copy and converted is not value and _elsewhere(converted):
                moved.append((value, converted))
            return converted

        args = tuple(convert(a) for a in args)
        kwargs = {k: convert(a) for k, a in kwargs.items()}
        __tracebackhide__ = True  # IPython and pytest skip this frame
        with self.guarded() as launches:
            result = self._call(launches, args, kwargs)
        for array, tensor in moved:  # in place, as from_numpy's memory is
            array[...] = tensor.detach().cpu().numpy()
        inputs = _tensor_device((*args, *kwargs.values()))
        if inputs is not None:
            _check_result_device(result, inputs)
        return result

    @contextmanager
    def guarded(self) -> Iterator[Any]:
        """Guard bands around the Triton launches inside (torch only); on
        leaving, :class:`OutOfBounds` if a kernel went outside a tensor."""
        __tracebackhide__ = True
        if self.framework != "torch":
            yield None
            return
        with guard.guarded(self.bounds) as launches:
            try:
                yield launches
            except Failed:
                raise
            except Exception:  # out of bounds first: it may be the cause
                if launches:
                    raise OutOfBounds(launches.message()) from None
                raise
        message = launches.message()
        if message:
            raise OutOfBounds(message)

    def _call(self, launches: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True
        try:
            # the checklist reports overflow and NaN; NumPy's warnings would
            # only repeat it
            with np.errstate(all="ignore"):
                return self.fn(*args, **kwargs)
        except Exception as error:  # the learner's error, reported as such
            if launches:  # out of bounds first: it may have caused the error
                raise OutOfBounds(launches.message()) from None
            shapes = ", ".join(describe(a) for a in args)
            hints = [
                hint
                for words, hint in self.error_hints.items()
                if words in str(error)
            ]
            inputs = _tensor_device((*args, *kwargs.values()))
            if inputs is not None and any(
                words in str(error) for words in DEVICE_ERRORS
            ):
                hints.append(
                    f"Its inputs are on {inputs}, and a tensor it used is "
                    "not: make new tensors where the inputs are "
                    "(torch.empty_like(x), or torch.empty(..., "
                    "device=x.device))."
                )
            if self.framework == "torch" and (
                problem := _interpreter_problem()
            ):
                hints.append(problem + ".")
            raise Failed(
                f"calling it with ({shapes}) raised "
                f"{type(error).__name__}: {error}"
                + "".join(f"\n{hint}" for hint in hints),
                # from the learner's function inwards
                learner_frames=error.__traceback__.tb_next
                if error.__traceback__
                else None,
            ) from None

    def run(self, verbose: bool) -> None:
        """Run the items in order; the first that fails raises.

        Where a learner's Triton kernel runs in an interpreter whose memory
        accesses cannot be checked (:func:`.guard.needs_child`), the items
        run first in a forked child: a kernel that crashes its process is
        named, and the learner's process lives on (then they run here).
        """
        __tracebackhide__ = True
        total = len(self.items)
        if self.framework == "torch" and guard.needs_child(self.device):
            outcome = guard.in_child([run for _, run in self.items])
            if outcome.signal:
                title = self.items[outcome.item - 1][0]
                message = wrap(
                    f"{self.name}: item {outcome.item} of {total} failed: "
                    f"{title}.",
                    guard.crash_message(outcome.signal),
                )
                report(CheckFailed(message), None)
        for number, (title, run) in enumerate(self.items, 1):
            try:
                run()
            except Failed as failed:
                message = wrap(
                    f"{self.name}: item {number} of {total} failed: {title}.",
                    str(failed),
                )
                report(CheckFailed(message), failed.learner_frames)
        if verbose:
            print(f"{self.name}: all {total} items pass")
            for number, (title, _) in enumerate(self.items, 1):
                print(f"  {number}. {title}")


class CheckFailed(AssertionError):
    """A checklist item failed: the message names it and what came.

    Its traceback, as IPython (a notebook) prints it, holds the learner's
    frames only: the line that called the checker and, when the learner's
    function raised, the lines inside it; the checker's frames are left out.
    pytest leaves them out too (they set ``__tracebackhide__``).
    """

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:  # IPython falls back to its plain traceback
            raise RuntimeError("no IPython shell")
        return shell.InteractiveTB.structured_traceback(
            AssertionError, self, _learners_frames(self.__traceback__)
        )


HERE = Path(__file__).resolve().parent


def _learners_frames(frames: TracebackType | None) -> TracebackType | None:
    """The traceback ``frames`` without the frames of this package."""
    kept = []
    while frames is not None:
        code = frames.tb_frame.f_code
        if Path(code.co_filename).resolve().parent != HERE:
            kept.append(frames)
        frames = frames.tb_next
    chain = None
    for frame in reversed(kept):
        chain = TracebackType(
            chain, frame.tb_frame, frame.tb_lasti, frame.tb_lineno
        )
    return chain


def report(error: CheckFailed, frames: TracebackType | None) -> NoReturn:
    """Raise a checker's verdict, with the learner's ``frames`` (if their
    function raised) below the checker's."""
    __tracebackhide__ = True
    raise error.with_traceback(frames) from None


def failure(check: Callable, fn: Callable, **kwargs: Any) -> str | None:
    """The message ``check(fn, **kwargs)`` fails with, or None if it passes."""
    try:
        check(fn, verbose=False, **kwargs)
    except AssertionError as error:
        return str(error)
    return None


# Devices: where the tensors handed to a learner's function live

#: Words of the errors a tensor on the wrong device raises: Triton's, handed
#: a CPU tensor by a kernel compiled for the GPU, and torch's.
DEVICE_ERRORS = ("cpu tensor?", "on the same device")


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter, if it is the one in use, cannot run a
    learner's kernel here (:func:`mha.environment.interpreter_problem`)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    from ..environment import interpreter_problem

    return interpreter_problem()


def kernel_device() -> str:
    """Where the Triton kernels run: ``"cuda"`` where Triton compiles them
    for the GPU, ``"cpu"`` in Triton's interpreter (the CPU tensors it
    takes) and where Triton or a GPU is missing.

    The torch checkers hand a learner's function its tensors there, so that
    a Triton kernel it launches gets tensors it can read. Imports
    :mod:`mha.kernels` (and so Triton) only where torch sees a GPU.
    """
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    from .. import kernels  # decides compiled or interpreted, once

    compiled = kernels.TRITON_AVAILABLE and not kernels.INTERPRETED
    return "cuda" if compiled else "cpu"


def checker_device(framework: str, device: Any = None) -> str:
    """The device of the tensors a checker hands a learner's function:
    ``device``, or :func:`kernel_device` for None; always ``"cpu"`` with
    NumPy arrays."""
    if framework == "numpy":
        if device is not None and str(device) != "cpu":
            raise ValueError(
                f"device={str(device)!r} needs framework='torch': NumPy "
                "arrays live on the CPU"
            )
        return "cpu"
    if device is None:
        return kernel_device()
    import torch

    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch device such as 'cpu' or 'cuda', got "
            f"{device!r}"
        ) from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(chosen)!r} was asked for, but torch sees no GPU "
            "here (torch.cuda.is_available() is False)"
        )
    return str(chosen)


def _elsewhere(value: Any) -> bool:
    """Whether ``value`` is a tensor off the CPU (a copy of an array)."""
    device = getattr(value, "device", None)
    return device is not None and device.type != "cpu"


def _tensor_device(values: tuple) -> Any:
    """The device of the first torch tensor among ``values``, or None."""
    for value in values:
        if hasattr(value, "untyped_storage") and hasattr(value, "device"):
            return value.device
    return None


def _check_result_device(result: Any, inputs: Any) -> None:
    """Fail, naming the device, where a tensor of ``result`` (or of the
    tuple or list it is) is not on ``inputs``, the inputs' device."""
    parts = result if isinstance(result, tuple | list) else (result,)
    for number, part in enumerate(parts):
        device = getattr(part, "device", None)
        if not hasattr(part, "untyped_storage") or device is None:
            continue
        same = device.type == inputs.type and (
            inputs.index is None or device.index == inputs.index
        )
        if same:
            continue
        what = (
            f"part {number} of its result"
            if isinstance(result, tuple | list)
            else "its result"
        )
        raise Failed(
            f"{what} is a tensor on {device}, but its inputs are on "
            f"{inputs}: make the result where the inputs are "
            "(torch.empty_like(x), or torch.empty(..., device=x.device))"
        )


# Arrays in and out, comparisons, messages


def to_framework(
    value: Any, framework: str, copy: bool, device: str = "cpu"
) -> Any:
    """``value``, an array, in ``framework`` (torch: on ``device``); any
    other value as it is."""
    if not isinstance(value, np.ndarray):
        return value
    if copy:
        value = value.copy()
    if framework == "torch":
        import torch

        tensor = torch.from_numpy(value)  # shares memory, float64 stays
        return tensor if device == "cpu" else tensor.to(device)
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
    rtol, atol = tolerance(got.dtype)
    atol *= scale_of(expected)
    if np.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
        return
    # NaN where a mistake gives 0 is a second mistake (an empty row): name
    # the first
    for hint, twins in (mistakes or {}).items():
        for twin in twins if isinstance(twins, tuple) else (twins,):
            if twin.shape == got.shape and np.allclose(
                np.nan_to_num(got), np.nan_to_num(twin), rtol=rtol, atol=atol
            ):
                raise Failed(hint)
    if np.isnan(got).any() and not np.isnan(expected).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(got))[0])
        raise Failed(f"{what} holds NaN (first at index {where})")
    raise Failed(difference(got, expected, what, rtol, atol))


def scale_of(expected: Array) -> float:
    """The largest finite magnitude of ``expected``, at least 1."""
    finite = np.abs(expected[np.isfinite(expected)])
    return max(1.0, float(finite.max())) if finite.size else 1.0


def difference(
    got: Array, expected: Array, what: str, rtol: float, atol: float
) -> str:
    """Where ``got`` is farthest outside the tolerance, in enough digits."""
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(got.astype(np.float64) - expected)
        outside = np.nan_to_num(
            error / (atol + rtol * np.abs(expected)), nan=np.inf
        )
    where = np.unravel_index(np.argmax(outside), outside.shape)
    index = tuple(int(i) for i in where)
    it, then = distinct(float(got[where]), float(expected[where]))
    count = int((outside > 1).sum())
    return (
        f"{what} differs from the package's result at {count} of "
        f"{got.size} places; the farthest, at index {index}: it is {it}, "
        f"expected {then} (a {got.dtype} result may be off by "
        f"{atol + rtol * abs(float(expected[where])):.1g} there)"
    )


def distinct(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` printed with as few digits as tell them apart."""
    for digits in range(4, 18):
        first, second = f"{a:#.{digits}g}", f"{b:#.{digits}g}"
        if first != second:
            break
    return first, second


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


# A message fits a phone's code cell (about 60 characters), and the first
# line leaves room for the "AssertionError: " a traceback prints before it.
WIDTH = 60
PREFIX = len("AssertionError: ")


def wrap(title: str, detail: str) -> str:
    """The message, in lines of at most ``WIDTH`` characters."""
    lines = textwrap.wrap(title, WIDTH, initial_indent=" " * PREFIX)
    lines[0] = lines[0][PREFIX:]
    for paragraph in detail.split("\n"):
        lines += textwrap.wrap(
            paragraph, WIDTH, initial_indent="  ", subsequent_indent="  "
        ) or [""]
    return "\n".join(lines)

"""mha: multi-head attention from one head to the GPU.

The package behind the book. Each module has one purpose; the chapters that
read it and the tests that pin it are listed with it (README.md has the table).

=========================  =====================  ========  ===================
module                     what it holds          chapters  tests
=========================  =====================  ========  ===================
:mod:`mha.reference`       the math, in NumPy     01-07     test_reference
:mod:`mha._validate`       the one error policy   all       (every error test)
:mod:`mha.functional`      torch building blocks  08, 09    test_functional
:mod:`mha.worked_example`  2-head worked example  04        test_worked_example
:mod:`mha.fitting`         heads fit to patterns  02        test_fitting
:mod:`mha.counting`        counts and configs     06, 09    test_counting
:mod:`mha.module`          MultiHeadAttention     08-10     test_module_*
:mod:`mha.plotting`        maps, grids, timings   all       (drawn in chapters)
:mod:`mha.bench`           the benchmark          09        test_bench
:mod:`mha.tiny`            tiny induction model   10        test_tiny
=========================  =====================  ========  ===================

The order inside a topic: the NumPy reference first, then the torch or fast
version, tests that pin one to the other, a benchmark entry, the chapter.
New code writes boolean masks as ``True`` = may attend, and raises errors
through :mod:`mha._validate`.

``import mha`` needs only NumPy; the PyTorch parts load when first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import reference
from .reference import *  # noqa: F403  the NumPy reference: mha.softmax, ...

__version__ = "0.1.0"

# Names that live in modules importing torch, loaded on first access.
_LAZY = {
    "MultiHeadAttention": "mha.module",
}

__all__ = [*reference.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")

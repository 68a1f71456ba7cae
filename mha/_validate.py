"""The package's one error policy, in one place.

* A value of the wrong *type* raises ``TypeError``:
  ``num_heads must be an int, got float 2.0``.
* A value of the right type but a bad *value* raises ``ValueError``:
  ``num_heads must be a positive int, got 0``.
* Every message names the argument, what was expected and what came.

Checks return the value they accept, so a caller can write
``n = check_int("n", n)``. The tensor checks import torch when first called:
``import mha`` needs only NumPy.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

__all__ = [
    "dtype_or_type",
    "check_int",
    "check_divisible",
    "check_probability",
    "check_float",
    "check_scale",
    "check_choice",
    "check_tensor",
    "check_same",
    "check_positions",
    "check_key_start",
    "check_window",
    "check_bool",
    "check_positive",
    "shape_text",
]


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int``, at least ``minimum``.

    NumPy integers are accepted too, ``bool`` never; so is a symbolic
    ``torch.SymInt`` (a length while ``torch.export`` traces with dynamic
    shapes), returned as it is.
    """
    torch = sys.modules.get("torch")
    symbolic = torch is not None and isinstance(value, torch.SymInt)
    if isinstance(value, bool) or not (
        symbolic or isinstance(value, numbers.Integral)
    ):
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value if symbolic else int(value)


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


def check_float(name: str, value: object, *, above: float = 0.0) -> float:
    """A finite real number greater than ``above``: a scale, a RoPE base."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a float, got {type(value).__name__} {value!r}"
        )
    if above == 0 and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive finite float, got {value}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value}")
    if not value > above:
        raise ValueError(f"{name} must be a float > {above:g}, got {value}")
    return float(value)


def check_scale(scale: object, head_dim: int) -> float:
    """The scores' scale: ``1 / sqrt(d_k)`` for None, else a positive float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_float("scale", scale)


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
    return check_float(name, value)


def shape_text(expected: dict[str, tuple[int, ...]]) -> str:
    """``{"(B, T_k)": (2, 5)}`` -> ``"(B, T_k) = (2, 5)"``.

    Several shapes are joined by ``or``.
    """
    return " or ".join(
        f"{symbol} = {shape}" for symbol, shape in expected.items()
    )


_KINDS = {"floating": "a floating-point", "integer": "an integer"}


def check_tensor(
    name: str,
    value: object,
    *,
    kind: str | None = "floating",
    ndim: int | None = None,
    min_ndim: int = 0,
    shape: str = "",
) -> Any:
    """A ``torch.Tensor`` of ``kind`` (floating, integer, or None: any dtype)
    with ``ndim`` dimensions (or at least ``min_ndim``), ``shape`` in words.
    """
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}"
        )
    floating = value.is_floating_point()
    integer = not (floating or value.is_complex() or value.dtype == torch.bool)
    if (kind == "floating" and not floating) or (
        kind == "integer" and not integer
    ):
        raise TypeError(
            f"{name} must be {_KINDS[kind]} tensor, got dtype {value.dtype}"
        )
    if (ndim is not None and value.dim() != ndim) or value.dim() < min_ndim:
        raise ValueError(
            f"{name} must have shape {shape}, got shape {tuple(value.shape)}"
        )
    return value


def check_same(names: str, tensors: tuple[Any, ...]) -> None:
    """Tensors that go into one computation: one dtype, one device."""
    dtypes = [t.dtype for t in tensors]
    if len(set(dtypes)) > 1:
        raise TypeError(
            f"{names} must have one dtype, got {', '.join(map(str, dtypes))}"
        )
    devices = [t.device for t in tensors]
    if len(set(devices)) > 1:
        raise ValueError(
            f"{names} must be on one device, got "
            f"{', '.join(map(str, devices))}"
        )


def check_positions(positions: object, batch: int, length: int) -> Any:
    """Integer positions for ``length`` tokens: (T,) or (1, T) for every row
    alike, or (B, T), one row each."""
    check_tensor("positions", positions, kind="integer")
    if tuple(positions.shape) not in ((length,), (1, length), (batch, length)):
        raise ValueError(
            f"positions must have shape (T,) = ({length},), (1, T) or (B, T) "
            f"= ({batch}, {length}), got shape {tuple(positions.shape)}"
        )
    return positions


def check_key_start(key_start: object, q: Any) -> Any:
    """Per-row key starts of a left-padded batch, for attention kernels.

    None, or a (B,) integer tensor on ``q``'s device, ``q`` being (B, H,
    T_q, d_k); returned as int32 (values below 0 as 0: both hide nothing).
    """
    if key_start is None:
        return None
    import torch

    check_tensor("key_start", key_start, kind="integer")
    if q.dim() != 4:
        raise ValueError(
            "key_start needs q of shape (B, H, T_q, d_k), got shape "
            f"{tuple(q.shape)}"
        )
    if tuple(key_start.shape) != (q.shape[0],):
        raise ValueError(
            f"key_start must have shape (B,) = ({q.shape[0]},), got "
            f"{tuple(key_start.shape)}"
        )
    if key_start.device != q.device:
        raise ValueError(
            f"key_start must be on q's device ({q.device}), got "
            f"{key_start.device}"
        )
    # a copy, whatever came (int8 to int64): later writes to the caller's
    # tensor change nothing here (a backward reads it after the forward)
    key_start = key_start.to(torch.int64).clamp(0, 2**31 - 1)
    return key_start.to(torch.int32).contiguous()


#: The widest window a kernel is given: one of 2**31 - 1 keys or more hides
#: no key of any sequence a kernel can index (int32 positions).
WIDEST_WINDOW = 2**31 - 1


def check_window(window: object) -> int | None:
    """A sliding window: None, or a positive int (a query's newest keys),
    at most :data:`WIDEST_WINDOW` (a wider one is the same window)."""
    if window is None:
        return None
    return min(check_int("window", window), WIDEST_WINDOW)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (NumPy's too), else TypeError naming it."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be True or False, got {type(value).__name__} "
            f"{value!r}"
        )
    return bool(value)


def dtype_or_type(value: object) -> object:
    """What an error says came: a tensor's dtype, or the type's name."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.dtype
    return type(value).__name__

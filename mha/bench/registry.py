"""The registry: one implementation of the attention layer is one entry.

An entry is a *builder*: given the benchmark's weights (a seeded
``torch.nn.MultiheadAttention``), the input ``x`` (B, T, D) and whether
attention is causal, it prepares everything outside the timing and returns a
function of no arguments that runs the implementation once. Adding an
implementation to ``python -m mha.bench`` is one decorated function::

    @register("my_attention", scope="layer")
    def my_attention(layer, x, causal):
        weights = ...                  # prepared once, not timed
        return lambda: ...             # (B, T, D), timed

Every entry is then timed by the harness, listed by ``--impl``, and checked by
``tests/test_bench.py`` against the NumPy reference, with nothing else to edit.

Decode-step entries (``python -m mha.bench --decode``) live in a registry of
their own, :data:`DECODE_IMPLEMENTATIONS`, filled by the same decorator with
``scope="decode", registry=DECODE_IMPLEMENTATIONS``. Their builder gets the
layer (a :class:`mha.GroupedQueryAttention`), the context ``(B, T, D)`` and
the new token ``(B, 1, D)``, and returns a function that computes the new
token's output once, the same step every call::

    @register("my_step", scope="decode", registry=DECODE_IMPLEMENTATIONS)
    def my_step(layer, context, x_new):
        cache = ...                    # filled with the context, not timed
        return lambda: ...             # (B, 1, D), timed
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "SCOPES",
    "Unsupported",
    "Runner",
    "Builder",
    "Implementation",
    "IMPLEMENTATIONS",
    "DECODE_IMPLEMENTATIONS",
    "DecodeBuilder",
    "register",
    "build_runner",
    "build_decode_runner",
    "default_impls",
    "implementation_table",
]

#: What a row times: the whole layer, the attention core on projected
#: heads, or the projections; or one decoding step of the layer
#: (``--decode``).
SCOPES = ("layer", "core", "projections", "decode")

Runner = Callable[[], object]
Builder = Callable[[nn.MultiheadAttention, Tensor, bool], Runner]
#: A decode-step builder: (layer, context (B, T, D), new token (B, 1, D)).
DecodeBuilder = Callable[[nn.Module, Tensor, Tensor], Runner]


class Unsupported(Exception):
    """An implementation cannot run for this device, dtype or configuration.

    The message says why.
    """


@dataclass(frozen=True)
class Implementation:
    """One registry entry.

    Attributes:
        name: the name ``--impl`` takes and the tables print.
        scope: ``"layer"`` (returns (B, T, D)), ``"core"`` (returns the
            attention output (B, H, T, d_k)) or ``"projections"`` (returns
            (B, T, D)).
        build: the builder (see the module docstring).
        devices: device types it runs on.
        dtypes: dtypes it runs in; None for every dtype.
        default_on: device types on which it is part of the default run.
        summary: one line for the table of implementations.
    """

    name: str
    scope: str
    build: Builder | DecodeBuilder
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    default_on: tuple[str, ...]
    summary: str

    def check_supported(
        self, device: torch.device, dtype: torch.dtype
    ) -> None:
        """Raise :class:`Unsupported` (saying why) if the entry cannot run."""
        if device.type not in self.devices:
            raise Unsupported(
                f"{self.name} runs on {' and '.join(self.devices)} only"
            )
        if self.dtypes is not None and dtype not in self.dtypes:
            dtype_name = str(dtype).removeprefix("torch.")
            raise Unsupported(f"{self.name} has no {dtype_name} version")


#: Every implementation, in registration (table) order.
IMPLEMENTATIONS: dict[str, Implementation] = {}

#: Every decode-step implementation (``--decode``), in registration order.
DECODE_IMPLEMENTATIONS: dict[str, Implementation] = {}


def register(
    name: str,
    *,
    scope: str,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes: tuple[torch.dtype, ...] | None = None,
    default_on: tuple[str, ...] | None = None,
    summary: str = "",
    registry: dict[str, Implementation] | None = None,
) -> Callable[[Builder], Builder]:
    """Decorator: add the builder it decorates to ``registry`` under ``name``.

    ``registry`` is :data:`IMPLEMENTATIONS` unless another is given
    (:data:`DECODE_IMPLEMENTATIONS` for decode steps).
    """
    registry = IMPLEMENTATIONS if registry is None else registry
    if scope not in SCOPES:
        raise ValueError(
            f"scope must be one of {', '.join(SCOPES)}, got {scope!r}"
        )
    if name in registry:
        raise ValueError(
            f"an implementation named {name!r} is registered already"
        )

    def add(build: Builder) -> Builder:
        text = summary or (build.__doc__ or "").strip().splitlines()[0]
        on = devices if default_on is None else default_on
        registry[name] = Implementation(
            name, scope, build, devices, dtypes, on, text
        )
        return build

    return add


def build_runner(
    impl: str, layer: nn.MultiheadAttention, x: Tensor, causal: bool = False
) -> Runner:
    """A function of no arguments that runs ``impl`` once on ``x`` (B, T, D).

    Raises:
        Unsupported: ``impl`` cannot run on this device or dtype (the message
            says why).
        ValueError: unknown ``impl``.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"impl must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}"
        )
    entry = IMPLEMENTATIONS[impl]
    entry.check_supported(x.device, x.dtype)
    return entry.build(layer, x, causal)


def build_decode_runner(
    impl: str, layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    """A function of no arguments that runs one decode step of ``impl``.

    ``layer``: a :class:`mha.GroupedQueryAttention`; ``context`` (B, T, D)
    fills the cache (untimed, without autograd); the runner returns the
    output (B, 1, D) of the new token ``x_new`` (B, 1, D), the same step each
    call.

    Raises:
        Unsupported: ``impl`` cannot run here (the message says why).
        ValueError: unknown ``impl``.
    """
    if impl not in DECODE_IMPLEMENTATIONS:
        raise ValueError(
            f"impl must be one of {', '.join(DECODE_IMPLEMENTATIONS)}, "
            f"got {impl!r}"
        )
    entry = DECODE_IMPLEMENTATIONS[impl]
    entry.check_supported(x_new.device, x_new.dtype)
    with torch.no_grad():
        return entry.build(layer, context, x_new)


def default_impls(device: torch.device | str) -> list[str]:
    """The implementations of a run that names none.

    They are those whose ``default_on`` has ``device``. Others can still be
    asked for by name; where they cannot run they are reported as skipped.
    """
    device_type = torch.device(device).type
    return [
        name
        for name, entry in IMPLEMENTATIONS.items()
        if device_type in entry.default_on
    ]


def implementation_table(
    registry: dict[str, Implementation] | None = None,
) -> str:
    """Every registered implementation: name, scope, devices, what it times."""
    registry = IMPLEMENTATIONS if registry is None else registry
    width = max(len(name) for name in registry)
    lines = [f"{'name':<{width}}  {'scope':<11} {'devices':<9} what is timed"]
    for entry in registry.values():
        devices = ",".join(entry.devices)
        summary = (
            re.sub(r":\w+:`~?([^`]+)`", r"\1", entry.summary)
            .replace("``", "")
            .rstrip(".")
        )
        lines.append(
            f"{entry.name:<{width}}  {entry.scope:<11} {devices:<9} {summary}"
        )
    return "\n".join(lines)

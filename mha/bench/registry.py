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
    "register",
    "build_runner",
    "default_impls",
    "implementation_table",
]

#: What a row times: the whole layer, the attention core on projected
#: heads, or the projections.
SCOPES = ("layer", "core", "projections")

Runner = Callable[[], object]
Builder = Callable[[nn.MultiheadAttention, Tensor, bool], Runner]


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
    build: Builder
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


def register(
    name: str,
    *,
    scope: str,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes: tuple[torch.dtype, ...] | None = None,
    default_on: tuple[str, ...] | None = None,
    summary: str = "",
) -> Callable[[Builder], Builder]:
    """Decorator: add the builder it decorates to :data:`IMPLEMENTATIONS`.

    The entry is stored under ``name``. Without ``summary``, the table of
    implementations shows the first line of the builder's docstring.
    """
    if scope not in SCOPES:
        raise ValueError(
            f"scope must be one of {', '.join(SCOPES)}, got {scope!r}"
        )
    if name in IMPLEMENTATIONS:
        raise ValueError(
            f"an implementation named {name!r} is registered already"
        )

    def add(build: Builder) -> Builder:
        text = summary or (build.__doc__ or "").strip().splitlines()[0]
        on = devices if default_on is None else default_on
        IMPLEMENTATIONS[name] = Implementation(
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


def implementation_table() -> str:
    """Every registered implementation: name, scope, devices, what it times."""
    width = max(len(name) for name in IMPLEMENTATIONS)
    lines = [f"{'name':<{width}}  {'scope':<11} {'devices':<9} what is timed"]
    for entry in IMPLEMENTATIONS.values():
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

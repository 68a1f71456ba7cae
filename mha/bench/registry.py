"""The registries: one implementation is one entry, a decorated builder.

A *builder* prepares everything outside the timing (weights, caches,
projected inputs) and returns a *runner*, a function of no arguments that
runs the implementation once. Each benchmark (a subcommand of ``python -m
mha.bench``) has its own registry, a dict whose builders take the same
inputs: :data:`IMPLEMENTATIONS` (``layer``, :mod:`mha.bench.implementations`)
``build(layer, x, causal)`` with a seeded ``torch.nn.MultiheadAttention`` and
``x`` (B, T, D); :data:`DECODE_IMPLEMENTATIONS` (``decode``,
:mod:`mha.bench.decode_steps`) ``build(layer, context, x_new)`` with a
:class:`mha.GroupedQueryAttention`, the context (B, T, D) and the new token
(B, 1, D). Adding an entry is one decorated function::

    @register(IMPLEMENTATIONS, "my_attention", scope="layer")
    def my_attention(layer, x, causal):
        \"\"\"One line for the table of implementations.\"\"\"
        weights = ...                  # prepared once, not timed
        return lambda: ...             # (B, T, D), timed

A builder that cannot run in the configuration it is given raises
:class:`Unsupported` with the reason; the run lists the entry as skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import check_choice

__all__ = ["SCOPES", "LIBRARIES", "Unsupported", "Runner", "Implementation"]
__all__ += ["IMPLEMENTATIONS", "DECODE_IMPLEMENTATIONS", "register"]
__all__ += ["build_runner", "select", "implementation_table"]

#: What a runner computes: the whole layer (B, T, D), the attention core on
#: projected heads (B, H, T, d_k), the four projections (B, T, D), one
#: decoding step (B, 1, D), or a whole model's generate.
SCOPES = ("layer", "core", "projections", "decode", "model", "serve")

#: The library whose threads do the work. Entries of different libraries are
#: timed in rounds of their own: interleaved, one library's idle worker
#: threads would still be spinning when the other's call starts.
LIBRARIES = ("torch", "numpy")

Runner = Callable[[], object]


class Unsupported(Exception):
    """An implementation cannot run on this device, dtype or configuration.

    The message says why.
    """


@dataclass(frozen=True)
class Implementation:
    """One registry entry: its ``name`` (for ``--impl`` and the tables),
    ``scope`` (:data:`SCOPES`), builder, the ``devices`` and ``dtypes``
    (None: all) it runs in, the devices whose default run has it
    (``default_on``), a one-line ``summary`` and its :data:`LIBRARIES` entry.
    """

    name: str
    scope: str
    build: Callable[..., Runner]
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    default_on: tuple[str, ...]
    summary: str
    library: str

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


#: The layer benchmark's entries, in registration (table) order.
IMPLEMENTATIONS: dict[str, Implementation] = {}

#: The decode benchmark's entries, in registration (table) order.
DECODE_IMPLEMENTATIONS: dict[str, Implementation] = {}


def register(
    registry: dict[str, Implementation],
    name: str,
    *,
    scope: str,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes: tuple[torch.dtype, ...] | None = None,
    default_on: tuple[str, ...] | None = None,
    summary: str = "",
    library: str = "torch",
) -> Callable[[Callable[..., Runner]], Callable[..., Runner]]:
    """Decorator: add the builder it decorates to ``registry`` as ``name``.

    ``summary`` defaults to the first line of the builder's docstring;
    ``default_on`` to ``devices``.
    """
    check_choice("scope", scope, SCOPES)
    check_choice("library", library, LIBRARIES)
    if name in registry:
        raise ValueError(
            f"an implementation named {name!r} is registered already"
        )

    def add(build: Callable[..., Runner]) -> Callable[..., Runner]:
        text = summary or (build.__doc__ or name).strip().splitlines()[0]
        on = devices if default_on is None else default_on
        registry[name] = Implementation(
            name, scope, build, devices, dtypes, on, text, library
        )
        return build

    return add


def build_runner(
    registry: dict[str, Implementation], impl: str, *inputs: object
) -> Runner:
    """The runner of entry ``impl`` of ``registry``, built on ``inputs``.

    The device and dtype are those of the first tensor among ``inputs``. The
    builder runs without autograd.

    Raises:
        Unsupported: ``impl`` cannot run here (the message says why).
        ValueError: ``impl`` is not in ``registry``.
    """
    if impl not in registry:
        raise ValueError(
            f"impl must be one of {', '.join(registry)}, got {impl!r}"
        )
    tensor = next(arg for arg in inputs if isinstance(arg, Tensor))
    registry[impl].check_supported(tensor.device, tensor.dtype)
    with torch.no_grad():
        return registry[impl].build(*inputs)


def select(
    registry: dict[str, Implementation],
    impls: Sequence[str] | None,
    device: torch.device | str,
) -> list[str]:
    """``impls``, each checked to be in ``registry``.

    None means the entries whose ``default_on`` has ``device``; others run
    only when named (where they cannot run, they are reported as skipped).
    """
    if impls is None:
        device_type = torch.device(device).type
        return [n for n, e in registry.items() if device_type in e.default_on]
    unknown = [name for name in impls if name not in registry]
    if unknown:
        raise ValueError(
            f"impls must be among {', '.join(registry)}, got unknown {unknown}"
        )
    return list(impls)


def implementation_table(registry: dict[str, Implementation]) -> str:
    """Every entry of ``registry``: name, scope, devices, what is timed."""
    width = max(len(name) for name in registry)
    lines = [f"{'name':<{width}}  {'scope':<11} {'devices':<9} what is timed"]
    for entry in registry.values():
        summary = re.sub(r":\w+:`~?([^`]+)`", r"\1", entry.summary)
        summary = summary.replace("``", "").rstrip(".")
        devices = ",".join(entry.devices)
        lines.append(
            f"{entry.name:<{width}}  {entry.scope:<11} {devices:<9} {summary}"
        )
    return "\n".join(lines)

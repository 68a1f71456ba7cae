"""Counting collectives and the memory a process holds, to check a split layer.

:class:`CollectiveCounter` sees every collective that reaches PyTorch's
dispatcher, whoever calls it: ``torch.distributed.all_reduce`` (the
``c10d`` operators) as well as the functional collectives that DTensor issues
(``_c10d_functional``). :func:`saved_tensor_bytes` adds up what autograd keeps
for the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Collective", "CollectiveCounter", "saved_tensor_bytes"]

#: The collectives' operator names in PyTorch's dispatcher, c10d (what
#: ``torch.distributed`` calls) and functional (what DTensor calls), by name.
_COLLECTIVES = {
    "all_reduce": ("allreduce_", "allreduce_coalesced_", "all_reduce"),
    "all_gather": (
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
    ),
    "reduce_scatter": (
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    ),
    "all_to_all": ("alltoall_", "alltoall_base_", "all_to_all_single"),
    "broadcast": ("broadcast_", "broadcast"),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "reduce": ("reduce_",),
}
_NAME = {op: name for name, ops in _COLLECTIVES.items() for op in ops}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True)
class Collective:
    """One collective call: its name (``all_reduce`` ...) and its bytes."""

    name: str
    bytes: int


class CollectiveCounter(TorchDispatchMode):
    """A context manager that records every collective run inside it.

    ``counter.calls`` lists them in order; ``counter.count("all_reduce")`` and
    ``counter.bytes("all_reduce")`` sum them by name. The bytes of a call are
    those of the tensors in its first argument (the tensor it reduces, or a
    process's part of what it gathers).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(_is_dtensor(t) for t in types):
            return NotImplemented  # DTensor first turns into plain collectives
        out = func(*args, **(kwargs or {}))
        if func.namespace in _NAMESPACES and func._opname in _NAME:
            name = _NAME[func._opname]
            self.calls.append(Collective(name, _bytes(args[:1])))
        return out

    def count(self, name: str) -> int:
        """Number of calls of the collective ``name`` (``"all_reduce"``)."""
        return sum(call.name == name for call in self.calls)

    def bytes(self, name: str) -> int:
        """Bytes sent into the collective ``name``, over all its calls."""
        return sum(call.bytes for call in self.calls if call.name == name)


def saved_tensor_bytes(
    run: Callable[[], object], exclude: Iterable[Tensor] = ()
) -> int:
    """Bytes autograd keeps for the backward of ``run()``: distinct storages.

    Storages of the tensors in ``exclude`` (a layer's parameters, say) are not
    counted.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def _is_dtensor(cls: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(cls, DTensor)


def _bytes(args) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in tree_leaves(args)
        if isinstance(t, Tensor)
    )

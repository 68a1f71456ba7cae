"""Attention split by heads: each process owns whole heads (Megatron-LM).

The layer is cut where its heads are independent: the rows of ``W_Q``,
``W_K`` and ``W_V`` that produce a head's queries, keys and values
(column-parallel, an ``nn.Linear`` split by output features) and the columns
of ``W_O`` that read that head's output (row-parallel, split by input
features). Each process computes its heads' share of the output; one
all-reduce (a sum over processes) joins the shares. The backward pass needs
the mirror image: the gradient of the layer's input is a sum over processes
too.

Two ways to the same layer:

* by hand: :func:`shard_heads` builds one process's :class:`HeadShard`, whose
  forward calls ``torch.distributed.all_reduce`` through two small
  ``autograd.Function``\\ s, :func:`copy_to_ranks` and :func:`sum_over_ranks`;
* with DTensor: :func:`parallelize_heads` hands the same plan to
  ``torch.distributed.tensor.parallel.parallelize_module``.

Both start from :class:`SelfAttention`, multi-head self-attention with
separate ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (``nn.Linear``, the
names of ``transformers``' Llama). :func:`unfuse` turns a
:class:`mha.MultiHeadAttention`, whose ``in_proj_weight`` holds ``W_Q``,
``W_K``, ``W_V`` stacked as one ``(3D, D)`` matrix, into one: a fused matrix
cannot be cut by rows into heads without cutting each of its three blocks, so
the three blocks become three ``nn.Linear`` first.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .._validate import check_divisible, check_int
from ..functional import attention, causal_mask, merge_heads, split_heads
from ..module import MultiHeadAttention

__all__ = [
    "SelfAttention",
    "HeadShard",
    "unfuse",
    "shard_heads",
    "head_slice",
    "copy_to_ranks",
    "sum_over_ranks",
    "parallelize_heads",
]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v and output projections.

    ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` are ``nn.Linear``.

    The number of heads is read from the width of ``q_proj`` (``-1`` in the
    view of :func:`mha.functional.split_heads`), so one forward serves the
    whole layer, one process's shard of it, and a layer whose projections
    DTensor has sharded. No attention dropout; masks: ``is_causal`` only.
    """

    def __init__(
        self,
        q_proj: nn.Linear,
        k_proj: nn.Linear,
        v_proj: nn.Linear,
        o_proj: nn.Linear,
        head_dim: int,
    ) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.o_proj = o_proj
        self.head_dim = check_int("head_dim", head_dim)
        self.num_heads = check_divisible(
            "q_proj.out_features", q_proj.out_features, "head_dim", head_dim
        )

    def merged_heads(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """(B, T, D) -> every head's output, side by side: (B, T, H * d_k)."""
        q, k, v = (
            split_heads(proj(x), self.head_dim)  # (B, H, T, d_k)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        mask = _causal_mask_like(q) if is_causal else None  # (T, T)
        heads, _ = attention(q, k, v, mask)  # (B, H, T, d_k)
        return merge_heads(heads)  # (B, T, H * d_k)

    def forward(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.o_proj(self.merged_heads(x, is_causal))


class HeadShard(SelfAttention):
    """One process's heads of a layer; the forward sums all processes' shares.

    ``q_proj``, ``k_proj``, ``v_proj``: this process's rows, ``(H/N * d_k,
    D)``; ``o_proj.weight``: its columns, ``(D, H/N * d_k)``; ``o_proj.bias``
    (all of it, on every process) is added once, after the sum.
    """

    def __init__(self, *projections: nn.Linear, head_dim: int, group=None):
        super().__init__(*projections, head_dim=head_dim)
        self.group = group  # None: every process (torch.distributed's WORLD)

    def partial_output(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """This process's heads' share of the output, no bias: (B, T, D)."""
        merged = self.merged_heads(x, is_causal)  # (B, T, H/N * d_k)
        return F.linear(merged, self.o_proj.weight)  # (B, T, D)

    def forward(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """(B, T, D) -> (B, T, D); input and output equal on every process."""
        x = copy_to_ranks(x, self.group)  # backward: all-reduce of dL/dx
        partial = self.partial_output(x, is_causal)  # (B, T, D)
        output = sum_over_ranks(partial, self.group)  # the one all-reduce
        bias = self.o_proj.bias
        return output if bias is None else output + bias


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity (all ranks hold dL/dy)."""

    @staticmethod
    def forward(ctx, partial: Tensor, group) -> Tensor:
        total = partial.clone()  # all_reduce works in place
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.clone()  # each rank's heads gave a part of dL/dx
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


def sum_over_ranks(partial: Tensor, group=None) -> Tensor:
    """Sum of ``partial`` over the processes of ``group`` (Megatron's g)."""
    return _SumOverRanks.apply(partial, group)


def copy_to_ranks(x: Tensor, group=None) -> Tensor:
    """``x`` itself; its gradient is summed over processes (Megatron's f)."""
    return _CopyToRanks.apply(x, group)


def unfuse(layer: MultiHeadAttention) -> SelfAttention:
    """A copy of ``layer``, ``in_proj_weight`` (3D, D) cut into 3 Linear."""
    _check_unfusable(layer)
    D, bias = layer.embed_dim, layer.in_proj_bias is not None
    factory = {
        "device": layer.in_proj_weight.device,
        "dtype": layer.in_proj_weight.dtype,
    }
    q, k, v = (nn.Linear(D, D, bias=bias, **factory) for _ in range(3))
    with torch.no_grad():
        for proj, weight in zip((q, k, v), layer.in_proj_weight.split(D)):
            proj.weight.copy_(weight)  # (D, D): W_Q, W_K, W_V in turn
        if bias:
            for proj, b in zip((q, k, v), layer.in_proj_bias.split(D)):
                proj.bias.copy_(b)  # (D,)
    o = copy.deepcopy(layer.out_proj)
    return SelfAttention(q, k, v, o, head_dim=layer.head_dim)


def head_slice(num_heads: int, head_dim: int, rank: int, world_size: int):
    """The features of ``rank``'s heads when ``world_size`` share them."""
    per_rank = _check_split(num_heads, rank, world_size) * head_dim
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard_heads(
    layer: SelfAttention | MultiHeadAttention,
    rank: int,
    world_size: int,
    group=None,
) -> HeadShard:
    """Process ``rank``'s heads of ``layer``: copies of its weight slices."""
    if isinstance(layer, MultiHeadAttention):
        layer = unfuse(layer)
    own = head_slice(layer.num_heads, layer.head_dim, rank, world_size)
    columns = [_rows(getattr(layer, name), own) for name in _PROJECTIONS]
    rows = _columns(layer.o_proj, own)
    return HeadShard(*columns, rows, head_dim=layer.head_dim, group=group)


def parallelize_heads(layer: SelfAttention, mesh) -> SelfAttention:
    """``layer``'s heads spread over ``mesh`` by DTensor (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _check_split(layer.num_heads, 0, mesh.size())
    plan = {
        name: ColwiseParallel(use_local_output=False) for name in _PROJECTIONS
    }  # q, k, v stay DTensors, sharded by heads: Shard(1) of (B, H, T, d_k)
    plan["o_proj"] = RowwiseParallel()  # input Shard(-1), output summed
    return parallelize_module(layer, mesh, plan)


def _causal_mask_like(q: Tensor) -> Tensor:
    """The (T, T) causal mask for q; for a DTensor q, a replicated DTensor."""
    mask = causal_mask(q.shape[-2], device=q.device)  # True = may attend
    mesh = getattr(q, "device_mesh", None)
    if mesh is None:
        return mask
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim)


def _rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A copy of ``linear`` that computes only the output features ``rows``."""
    return _linear(linear.weight[rows], _cut(linear.bias, rows))


def _columns(linear: nn.Linear, columns: slice) -> nn.Linear:
    """A copy of ``linear`` that reads only the input features ``columns``."""
    return _linear(linear.weight[:, columns], linear.bias)


def _cut(bias: Tensor | None, rows: slice) -> Tensor | None:
    return None if bias is None else bias[rows]


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` (out, in) and ``bias``."""
    out_features, in_features = weight.shape
    linear = nn.Linear(
        in_features,
        out_features,
        bias=bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _check_split(num_heads: int, rank: int, world_size: int) -> int:
    """Heads per process, after checking that the processes can share them."""
    check_int("world_size", world_size)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be below world_size ({world_size}), got {rank}"
        )
    return check_divisible("num_heads", num_heads, "world_size", world_size)


def _check_unfusable(layer: MultiHeadAttention) -> None:
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(
            "layer must be an mha.MultiHeadAttention, got "
            f"{type(layer).__name__}"
        )
    if layer.in_proj_weight is None:
        raise ValueError(
            "layer must be a self-attention layer (kdim = vdim = embed_dim = "
            f"{layer.embed_dim}), got kdim={layer.kdim}, vdim={layer.vdim}"
        )

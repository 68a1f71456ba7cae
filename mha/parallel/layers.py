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

Both start from :class:`SelfAttention`: self-attention with separate
``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (``nn.Linear``, the names of
``transformers``' Llama and of :class:`mha.GroupedQueryAttention`).
:func:`unfuse` makes one from a :class:`mha.MultiHeadAttention`, whose
``in_proj_weight`` holds ``W_Q``, ``W_K``, ``W_V`` stacked as one ``(3D, D)``
matrix: the heads of a fused matrix are three separate row blocks, so the
three are made separate ``nn.Linear`` first, each then cut by heads.

Grouped-query layers (``H_kv`` key/value heads, each read by ``G = H / H_kv``
query heads) are split with their groups: a process owning query heads
``h`` also owns key/value heads ``h // G``. With fewer key/value heads than
processes (``H_kv < N``, ``N`` a multiple of ``H_kv``), each key/value head
is *replicated* on the ``N / H_kv`` processes whose query heads read it.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .._validate import check_divisible, check_int
from ..decoding import GroupedQueryAttention, grouped_attention
from ..functional import causal_mask, merge_heads, split_heads
from ..module import MultiHeadAttention
from ..positions import Rope, apply_rope, as_rope

__all__ = [
    "SelfAttention",
    "HeadShard",
    "unfuse",
    "shard_heads",
    "query_heads",
    "kv_heads",
    "copy_to_ranks",
    "sum_over_ranks",
    "parallelize_heads",
]


class SelfAttention(nn.Module):
    """Self-attention with separate q, k, v and output projections (nn.Linear).

    ``q_proj`` (H d_k, D), ``k_proj`` and ``v_proj`` (H_kv d_k, D), ``o_proj``
    (D, H d_k). The head counts are read from the projections' widths (and
    ``-1`` in :func:`mha.functional.split_heads`), so the same code runs the
    whole layer and any process's share of it. ``rope_base``: rotary
    positions 0 .. T-1, a base or a :class:`mha.Rope` (None: none). No
    dropout; masks: ``is_causal`` only.
    """

    def __init__(
        self,
        q_proj: nn.Linear,
        k_proj: nn.Linear,
        v_proj: nn.Linear,
        o_proj: nn.Linear,
        head_dim: int,
        rope_base: float | Rope | None = None,
    ) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.o_proj = o_proj
        self.head_dim = check_int("head_dim", head_dim)
        self.rope = None if rope_base is None else as_rope(rope_base)
        self.num_heads, self.num_kv_heads = _check_widths(self)

    @property
    def rope_base(self) -> float | None:
        """RoPE's base, or None without rotary positions."""
        return None if self.rope is None else self.rope.base

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool
    ) -> Tensor:
        """q (B, H, T, d_k), k and v (B, H_kv, T, d_k) -> (B, H, T, d_k)."""
        T = q.shape[2]
        if self.rope is not None:  # turn q and k by their positions
            positions = torch.arange(T, device=q.device)
            q = apply_rope(q, positions, self.rope)
            k = apply_rope(k, positions, self.rope)
        keep = causal_mask(T, device=q.device) if is_causal else None
        return grouped_attention(q, k, v, keep)  # (B, H, T, d_k)

    def merged_heads(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """(B, T, D) -> every head's output, side by side: (B, T, H d_k)."""
        q = split_heads(self.q_proj(x), self.head_dim)  # (B, H, T, d_k)
        k = split_heads(self.k_proj(x), self.head_dim)  # (B, H_kv, T, d_k)
        v = split_heads(self.v_proj(x), self.head_dim)  # (B, H_kv, T, d_k)
        return merge_heads(self.attend(q, k, v, is_causal))  # (B, T, H d_k)

    def forward(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.o_proj(self.merged_heads(x, is_causal))


class HeadShard(SelfAttention):
    """One process's heads of a layer; the forward sums all processes' shares.

    ``q_proj``: this process's rows, (H/N d_k, D); ``k_proj``, ``v_proj``:
    the rows of the key/value heads its query heads read; ``o_proj.weight``:
    its columns, (D, H/N d_k); ``o_proj.bias`` (all of it, on every process)
    is added once, after the sum. ``kv_replicas``: how many processes hold
    the same key/value heads (1 unless H_kv < N); their ``k_proj`` and
    ``v_proj`` gradients are each a share, to be summed over those processes.
    """

    def __init__(self, *projections, head_dim, rope_base, kv_replicas, group):
        super().__init__(*projections, head_dim, rope_base)
        self.kv_replicas = kv_replicas
        self.group = group  # None: every process (torch.distributed's WORLD)

    def partial_output(self, x: Tensor, is_causal: bool = False) -> Tensor:
        """This process's heads' share of the output, no bias: (B, T, D)."""
        merged = self.merged_heads(x, is_causal)  # (B, T, H/N d_k)
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


def unfuse(layer: MultiHeadAttention | GroupedQueryAttention) -> SelfAttention:
    """A copy of ``layer`` as a :class:`SelfAttention`.

    A :class:`mha.MultiHeadAttention`'s ``in_proj_weight`` (3D, D) is cut
    into ``q_proj``, ``k_proj``, ``v_proj``, (D, D) each, its ``out_proj``
    becomes ``o_proj``. A :class:`mha.GroupedQueryAttention` has them already,
    and keeps its rotary positions.
    """
    _check_layer(layer)
    if isinstance(layer, GroupedQueryAttention):
        projections = [
            copy.deepcopy(getattr(layer, name))
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        return SelfAttention(*projections, layer.head_dim, layer.rope)
    D = layer.embed_dim
    weights = layer.in_proj_weight.split(D)  # W_Q, W_K, W_V: (D, D) each
    biases = (
        (None,) * 3
        if layer.in_proj_bias is None
        else layer.in_proj_bias.split(D)  # (D,) each
    )
    q, k, v = (_linear(w, b) for w, b in zip(weights, biases))
    o = copy.deepcopy(layer.out_proj)
    return SelfAttention(q, k, v, o, layer.head_dim)


def query_heads(num_heads: int, rank: int, world_size: int) -> range:
    """The query heads of process ``rank``: H / N consecutive heads."""
    per_rank = _check_split(num_heads, rank, world_size)
    return range(rank * per_rank, (rank + 1) * per_rank)


def kv_heads(
    num_kv_heads: int, num_heads: int, rank: int, world_size: int
) -> range:
    """The key/value heads that process ``rank``'s query heads read."""
    group = num_heads // num_kv_heads  # G query heads per key/value head
    own = query_heads(num_heads, rank, world_size)
    _check_kv_split(num_kv_heads, world_size)
    return range(own.start // group, (own.stop - 1) // group + 1)


def shard_heads(
    layer: SelfAttention | MultiHeadAttention | GroupedQueryAttention,
    rank: int,
    world_size: int,
    group=None,
) -> HeadShard:
    """Process ``rank``'s heads of ``layer``: copies of its weight slices."""
    if not isinstance(layer, SelfAttention):
        layer = unfuse(layer)
    H, H_kv, d_k = layer.num_heads, layer.num_kv_heads, layer.head_dim
    own_q = _features(query_heads(H, rank, world_size), d_k)
    own_kv = _features(kv_heads(H_kv, H, rank, world_size), d_k)
    return HeadShard(
        _rows(layer.q_proj, own_q),  # column-parallel: output features
        _rows(layer.k_proj, own_kv),
        _rows(layer.v_proj, own_kv),
        _columns(layer.o_proj, own_q),  # row-parallel: input features
        head_dim=d_k,
        rope_base=layer.rope,
        kv_replicas=max(1, world_size // H_kv),
        group=group,
    )


def parallelize_heads(
    layer: SelfAttention, mesh, *, input_once: bool = True
) -> SelfAttention:
    """``layer``'s heads spread over ``mesh`` by DTensor, in place.

    ``input_once``: make the input a replicated DTensor once, before the
    three projections (``PrepareModuleInput``), so that the backward pass
    all-reduces its gradient once; ``False`` leaves that to each
    ``ColwiseParallel``, and the backward pass all-reduces three times.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import local_map
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    _check_dtensor_split(layer, mesh.size())
    if input_once:  # x: one replicated DTensor; the partial sums of its
        # gradient from q, k and v are added locally, then all-reduced once
        parallelize_module(
            layer,
            mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            ),
        )
    plan = {
        name: ColwiseParallel(use_local_output=False)  # q, k, v: DTensors
        for name in ("q_proj", "k_proj", "v_proj")
    }
    plan["o_proj"] = RowwiseParallel()  # its input sharded: one all-reduce
    heads = [Shard(1)]  # (B, H, T, d_k), split along H
    layer.attend = local_map(  # each process attends with its own heads
        layer.attend,
        out_placements=heads,
        in_placements=(heads, heads, heads, None),
        device_mesh=mesh,
    )
    return parallelize_module(layer, mesh, plan)


def _features(heads: range, head_dim: int) -> slice:
    """The features (rows of a projection) of a run of heads."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A copy of ``linear`` that computes only the output features ``rows``."""
    bias = None if linear.bias is None else linear.bias[rows]
    return _linear(linear.weight[rows], bias)


def _columns(linear: nn.Linear, columns: slice) -> nn.Linear:
    """A copy of ``linear`` that reads only the input features ``columns``."""
    return _linear(linear.weight[:, columns], linear.bias)


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


def _check_widths(layer: SelfAttention) -> tuple[int, int]:
    """(H, H_kv) from the projections' widths, checked."""
    d_k = layer.head_dim
    H = check_divisible(
        "q_proj.out_features", layer.q_proj.out_features, "head_dim", d_k
    )
    H_kv = check_divisible(
        "k_proj.out_features", layer.k_proj.out_features, "head_dim", d_k
    )
    if layer.v_proj.out_features != layer.k_proj.out_features:
        raise ValueError(
            "v_proj.out_features must equal k_proj.out_features "
            f"({layer.k_proj.out_features}), got {layer.v_proj.out_features}"
        )
    if layer.o_proj.in_features != layer.q_proj.out_features:
        raise ValueError(
            "o_proj.in_features must equal q_proj.out_features "
            f"({layer.q_proj.out_features}), got {layer.o_proj.in_features}"
        )
    check_divisible("num_heads", H, "num_kv_heads", H_kv)
    return H, H_kv


def _check_split(num_heads: int, rank: int, world_size: int) -> int:
    """Query heads per process, after checking the processes can share them."""
    check_int("world_size", world_size)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be below world_size ({world_size}), got {rank}"
        )
    return check_divisible("num_heads", num_heads, "world_size", world_size)


def _check_kv_split(num_kv_heads: int, world_size: int) -> None:
    """H_kv split over N processes, or each head replicated on N / H_kv."""
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be divisible by world_size "
            f"({world_size}), or divide it (then each key/value head is "
            "replicated)"
        )


def _check_dtensor_split(layer: SelfAttention, world_size: int) -> None:
    _check_split(layer.num_heads, 0, world_size)
    if layer.num_kv_heads % world_size:
        raise ValueError(
            f"num_kv_heads ({layer.num_kv_heads}) must be divisible by the "
            f"mesh size ({world_size}) for DTensor's ColwiseParallel, which "
            "would cut a key/value head in pieces; shard_heads replicates "
            "key/value heads instead"
        )


def _check_layer(layer: object) -> None:
    if not isinstance(layer, MultiHeadAttention | GroupedQueryAttention):
        raise TypeError(
            "layer must be an mha.MultiHeadAttention or "
            f"mha.GroupedQueryAttention, got {type(layer).__name__}"
        )
    if isinstance(layer, MultiHeadAttention) and layer.in_proj_weight is None:
        raise ValueError(
            "layer must be a self-attention layer (kdim = vdim = embed_dim = "
            f"{layer.embed_dim}), got kdim={layer.kdim}, vdim={layer.vdim}"
        )
    # what the split layer (projections, rotary positions, causal softmax)
    # does not carry over: refused by name, never dropped
    if isinstance(layer, MultiHeadAttention):
        dropped = {
            "add_bias_kv=True": layer.bias_k is not None,
            "add_zero_attn=True": layer.add_zero_attn,
            "batch_first=False (the split layer takes (B, T, D))": (
                not layer.batch_first
            ),
        }
    else:
        dropped = {
            f"window={layer.window}": layer.window is not None,
            "sinks=True": layer.sinks is not None,
            "qk_norm_eps (RMSNorm of q and k)": layer.q_norm is not None,
        }
    dropped[f"dropout={layer.dropout}"] = layer.dropout > 0
    refused = [name for name, used in dropped.items() if used]
    if refused:
        raise ValueError(
            "layer uses what the split layer does not implement: "
            f"{', '.join(refused)}"
        )

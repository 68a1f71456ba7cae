"""One attention layer's key and value pools, read through the step's plan.

Each layer of the served model has a :class:`PagedLayer`: its pools
``k_pool``, ``v_pool`` (num_blocks, block_size, H_kv, d_k), shared by every
request through their block tables. The model's attention layer hands it
to :func:`mha.backends.attend` as its cache, which finds a serving step
there (:meth:`PagedLayer.serve`): the step's new keys and values go into
their slots, and attention is computed for each group of the step's
:class:`~mha.serving.batch.StepPlan` by the layer's backend. With a paged
kernel (``triton``) the blocks are read where they lie and the new keys are
the only bytes moved; any other backend gets each group's keys gathered
(right-aligned, the index made once per step for every layer) and computes
attention its own way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends import Backend, Masking, attend
from .batch import StepPlan

__all__ = ["PagedLayer"]


class PagedLayer:
    """One layer's key and value pools, read through block tables."""

    max_len = None  # positions live in the pool, not in a fixed row
    seen = 0  # each token's position comes with the step (position_ids)

    def __init__(
        self, num_blocks, block_size, num_kv_heads, head_dim, *, dtype, device
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.plan: StepPlan | None = None

    def check_update(
        self,
        batch,
        num_kv_heads,
        new_tokens,
        head_dim,
        dtype,
        device,
        *,
        v=None,
    ) -> None:
        """Raise unless the new keys fit the pool: (1, H_kv, N, d_k)."""
        pool = self.k_pool
        if (batch, num_kv_heads, head_dim) != (1, *pool.shape[2:]) or (
            dtype != pool.dtype
        ):
            raise ValueError(
                f"a paged step takes keys (1, H_kv, N, d_k) with (H_kv, d_k)"
                f" = {tuple(pool.shape[2:])} in {pool.dtype}, got "
                f"{(batch, num_kv_heads, new_tokens, head_dim)} in {dtype}"
            )

    def serve(
        self,
        backend: Backend,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masking: Masking,
    ) -> Tensor:
        """q (1, H, N, d_k), new k, v (1, H_kv, N, d_k) -> (1, H, N, d_k),
        by ``backend``'s paged kernel, or its attention over gathered keys;
        causal, with ``masking``'s window."""
        plan, window = self.plan, masking.window
        # token n's keys and values into its slot: (N, H_kv, d_k)
        self.k_pool[plan.blocks, plan.offsets] = k[0].transpose(0, 1)
        self.v_pool[plan.blocks, plan.offsets] = v[0].transpose(0, 1)
        parts = []
        for group, (first, end, table, lens) in enumerate(plan.groups):
            if len(lens) > 1:  # decode tokens, one per request
                rows = q[0, :, first:end].transpose(0, 1)[:, :, None]
            else:  # a chunk of one request
                rows = q[:, :, first:end]  # (1, H, T_q, d_k)
            kernel = backend.paged
            if kernel is None:  # keys gathered, then the backend's own
                blocks, slots, padding, key_start = plan.gather(group)
                k_rows = self.k_pool[blocks, slots].transpose(1, 2)
                v_rows = self.v_pool[blocks, slots].transpose(1, 2)
                masked = Masking(
                    window=window, padding=padding, key_start=key_start
                )
                out = attend(backend.name, rows, k_rows, v_rows, masked)
            else:  # a kernel that reads the blocks where they lie
                out = kernel(
                    rows.contiguous(),
                    self.k_pool,
                    self.v_pool,
                    table,
                    lens,
                    key_start=None,
                    window=window,
                    max_seq_len=plan.longest[group],  # no read back
                )
            if len(lens) > 1:
                out = out[:, :, 0].transpose(0, 1)[None]  # (1, H, B, d_k)
            parts.append(out)
        return torch.cat(parts, dim=2)  # (1, H, N, d_k)

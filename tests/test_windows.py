"""Sliding windows in the tiled attention (torch) and the Triton kernels: the key tiles before a
query tile's window are skipped, forward and backward, and the result equals the written-out
softmax under the window's mask (float64 for torch; float32 and float16 in the kernels), with
left padding, grouped heads and fewer queries than keys."""

from __future__ import annotations

import pytest
import torch
from mha import flash_attention_torch, kernels
from mha.backends import Masking, grouped_attention
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import KERNEL_DEVICE, randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (T_q, T_k, window, key starts or None): a prompt, a chunk after a cache, a window of 1, a
# window wider than every distance, padding, a decoding step.
SHAPES = [(37, 37, 5, None), (13, 40, 7, [0, 9]), (40, 40, 1, None), (20, 20, 64, [2, 0]),
          (1, 50, 8, [4, 0])]  # fmt: skip


def _expected(q, k, v, window, starts):
    t_q, t_k = q.shape[2], k.shape[2]
    padding = None
    if starts is not None:
        starts = torch.tensor(starts, device=q.device)  # q's device: a GPU's where compiled
        padding = torch.arange(t_k, device=q.device)[None] >= starts[:, None]
    keep = Masking(window=window, padding=padding).keep(t_q, t_k, q.device)
    return grouped_attention(q, k, v, keep)


def _inputs(t_q, t_k, dtype, device="cpu", seed=0):
    q = randn(2, 4, t_q, 24, seed=seed, dtype=dtype).to(device).requires_grad_()
    k = randn(2, 2, t_k, 24, seed=seed + 1, dtype=dtype).to(device).requires_grad_()
    v = randn(2, 2, t_k, 24, seed=seed + 2, dtype=dtype).to(device).requires_grad_()
    return q, k, v


def _starts(starts, device):
    return None if starts is None else torch.tensor(starts, dtype=torch.int32, device=device)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_torch_equals_the_masked_softmax(shape) -> None:
    t_q, t_k, window, starts = shape
    q, k, v = _inputs(t_q, t_k, torch.float64)
    out, _ = flash_attention_torch(q, k, v, causal=True, window=window, block_q=8, block_k=8,
                                   key_start=_starts(starts, "cpu"))  # fmt: skip
    expected = _expected(q, k, v, window, starts)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    d_out = randn(*out.shape, seed=9)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), d_out),
                         torch.autograd.grad(expected, (q, k, v), d_out)):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _Products(TorchDispatchMode):
    """Counts the matrix products computed."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_tiles_before_a_window_are_skipped() -> None:
    # T = 64 in tiles of 8, causal: 36 pairs of tiles. A window of 8 reaches back one tile from
    # the first query of each query tile: 8 + 7 = 15 pairs, two products each (scores, p v).
    q, k, v = (randn(1, 1, 64, 16, seed=s) for s in (1, 2, 3))
    counted = {}
    for window in (None, 8):
        with torch.no_grad(), _Products() as products:
            flash_attention_torch(q, k, v, causal=True, window=window, block_q=8, block_k=8)
        counted[window] = products.count
    assert counted == {None: 2 * 36, 8: 2 * 15}


@pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernels_equal_the_masked_softmax(shape, dtype) -> None:
    t_q, t_k, window, starts = shape
    q, k, v = _inputs(t_q, t_k, dtype, KERNEL_DEVICE, seed=3)
    key_start = _starts(starts, KERNEL_DEVICE)
    out = kernels.triton_attention(q, k, v, causal=True, window=window, key_start=key_start,
                                   block_q=16, block_k=16)  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _expected(*exact, window, starts)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    d_out = randn(*out.shape, seed=11).to(KERNEL_DEVICE)
    got = torch.autograd.grad(out, (q, k, v), d_out.to(dtype))
    want = torch.autograd.grad(expected, exact, d_out.double())
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, rtol=5 * tolerance, atol=5 * tolerance,
                                   msg=f"d{name}")  # fmt: skip
    with torch.no_grad():  # the split-KV kernel, the keys over three programs
        split = kernels.triton_split_kv_attention(q, k, v, causal=True, window=window,
                                                  key_start=key_start, num_splits=3)  # fmt: skip
    torch.testing.assert_close(split.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [0, -2, 1.5, True])
def test_a_bad_window_is_refused_by_name(window) -> None:
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises((TypeError, ValueError), match="window"):
        flash_attention_torch(q, q, q, window=window)

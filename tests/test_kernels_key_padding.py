"""Key padding in the Triton kernels and their torch twin: per-row key starts (left padding).

A left-padded batch (transformers' ``attention_mask`` of 0/1, shape (B, T_k), zeros first) hides
keys 0 .. key_start[b] - 1 of row b. Expected values are written out here independently of the
kernels: for each row and head, the visible keys are gathered by index and softmax is taken over
them in float64 (a query that sees no key gives zeros). The Triton kernels run in Triton's
interpreter on a CPU (compiled on a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from mha import kernels
from mha.flash import flash_attention_torch
from mha.functional import key_start_from_attention_mask

from helpers import KERNEL_DEVICE, randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRITON = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")
DEVICE = KERNEL_DEVICE
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.float64: 1e-12}


def _qkv(batch, heads, kv_heads, t_q, t_k, d, dtype=torch.float32, seed=0):
    q = randn(batch, heads, t_q, d, seed=seed)
    k = randn(batch, kv_heads, t_k, d, seed=seed + 1)
    v = randn(batch, kv_heads, t_k, d, seed=seed + 2)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def _gathered(q, k, v, key_start, causal: bool) -> torch.Tensor:
    """Float64, one (row, head, query) at a time: gather the visible keys, softmax over them."""
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    (batch, heads, t_q, _), (kv_heads, t_k) = q.shape, k.shape[1:3]
    group = heads // kv_heads
    out = torch.zeros(batch, heads, t_q, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(t_q):
                last = i + t_k - t_q if causal else t_k - 1  # bottom-right
                seen = torch.arange(0, t_k)  # visible keys, by index
                seen = seen[(seen >= int(key_start[b])) & (seen <= last)]
                if len(seen) == 0:
                    continue  # no key: zeros
                keys, values = k[b, h // group, seen], v[b, h // group, seen]
                weights = torch.softmax(keys @ q[b, h, i] / math.sqrt(q.shape[-1]), dim=0)
                out[b, h, i] = weights @ values
    return out


def _close(out, expected, dtype) -> None:
    assert torch.isfinite(out).all()
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# (B, H, H_kv, T_q, T_k, causal, key_start): a left-padded prompt (causal, T_q = T_k: the padded
# queries see no key), a decoding step (T_q = 1) after left-padded prompts, a chunk after a cache,
# and a row whose keys are all padding (key_start = T_k).
CASES = [
    (3, 4, 2, 37, 37, True, [0, 5, 20]),
    (3, 4, 1, 1, 50, True, [0, 13, 49]),
    (2, 2, 2, 5, 40, True, [3, 17]),
    (2, 4, 2, 23, 31, False, [31, 4]),
]


def _case(case, dtype, seed=0):
    batch, heads, kv_heads, t_q, t_k, causal, starts = case
    q, k, v = _qkv(batch, heads, kv_heads, t_q, t_k, 40, dtype, seed=seed)
    return q, k, v, torch.tensor(starts, dtype=torch.int32, device=DEVICE), causal


@TRITON
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_forward_equals_gathered_softmax(case, dtype) -> None:
    q, k, v, key_start, causal = _case(case, dtype)
    out = kernels.triton_attention(
        q, k, v, causal=causal, key_start=key_start, block_q=16, block_k=16
    )
    _close(out, _gathered(q, k, v, key_start, causal), dtype)


@TRITON
@pytest.mark.parametrize("case", CASES)
def test_split_kv_equals_gathered_softmax(case) -> None:
    q, k, v, key_start, causal = _case(case, torch.float32, seed=3)
    for splits in (1, 3):
        out = kernels.triton_split_kv_attention(
            q, k, v, causal=causal, key_start=key_start, num_splits=splits
        )
        _close(out, _gathered(q, k, v, key_start, causal), torch.float32)


@pytest.mark.parametrize("case", CASES)
def test_torch_twin_equals_gathered_softmax(case) -> None:
    q, k, v, key_start, causal = _case(case, torch.float64, seed=5)
    out, lse = flash_attention_torch(
        q, k, v, causal=causal, key_start=key_start, block_q=16, block_k=16
    )
    _close(out, _gathered(q, k, v, key_start, causal), torch.float64)
    assert not torch.isnan(lse).any()


def _gathered_gradients(q, k, v, key_start, causal, d_out):
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out = _gathered_differentiable(q, k, v, key_start, causal)
    return torch.autograd.grad(out, (q, k, v), d_out.double())


def _gathered_differentiable(q, k, v, key_start, causal):
    """The same gather + softmax, differentiable (rows stacked with torch.stack)."""
    (batch, heads, t_q, _), (kv_heads, t_k) = q.shape, k.shape[1:3]
    group, rows = heads // kv_heads, []
    for b in range(batch):
        for h in range(heads):
            for i in range(t_q):
                last = i + t_k - t_q if causal else t_k - 1
                seen = torch.arange(0, t_k)
                seen = seen[(seen >= int(key_start[b])) & (seen <= last)]
                if len(seen) == 0:
                    rows.append(torch.zeros(v.shape[-1], dtype=v.dtype))
                    continue
                keys, values = k[b, h // group, seen], v[b, h // group, seen]
                weights = torch.softmax(keys @ q[b, h, i] / math.sqrt(q.shape[-1]), dim=0)
                rows.append(weights @ values)
    return torch.stack(rows).reshape(batch, heads, t_q, -1)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_backward_equals_gathered_softmax(case, implementation) -> None:
    if implementation == "triton" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    dtype = torch.float32 if implementation == "triton" else torch.float64
    q, k, v, key_start, causal = _case(case, dtype, seed=7)
    d_out = randn(*q.shape, seed=11).to(dtype).to(DEVICE)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if implementation == "triton":
        out = kernels.triton_attention(
            q, k, v, causal=causal, key_start=key_start, block_q=16, block_k=16
        )
    else:
        out, _ = flash_attention_torch(
            q, k, v, causal=causal, key_start=key_start, block_q=16, block_k=16
        )
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    expected = _gathered_gradients(q, k, v, key_start.cpu(), causal, d_out.cpu())
    for got, want in zip(grads, expected, strict=True):
        assert torch.isfinite(got).all()
        tolerance = 1e-4 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance)
    # keys hidden from every query of a row get no gradient
    for b, start in enumerate(key_start.tolist()):
        assert (grads[1][b, :, :start] == 0).all() and (grads[2][b, :, :start] == 0).all()


@pytest.mark.parametrize("implementation", ["triton", "split_kv", "torch"])
def test_padding_is_never_read(implementation) -> None:
    # NaN in the padded keys and values poisons any row that reads them (0 * NaN = NaN).
    if implementation != "torch" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    dtype = torch.float64 if implementation == "torch" else torch.float32
    q, k, v = _qkv(2, 2, 1, 3, 40, 32, dtype)
    key_start = torch.tensor([7, 21], dtype=torch.int32, device=DEVICE)
    clean = _gathered(q, k, v, key_start, True)
    for b, start in enumerate(key_start.tolist()):
        k[b, :, :start], v[b, :, :start] = math.nan, math.nan
    if implementation == "triton":
        out = kernels.triton_attention(q, k, v, causal=True, key_start=key_start, block_k=16)
    elif implementation == "split_kv":
        out = kernels.triton_split_kv_attention(
            q, k, v, causal=True, key_start=key_start, num_splits=3
        )
    else:
        out, _ = flash_attention_torch(q, k, v, causal=True, key_start=key_start, block_k=16)
    _close(out, clean, dtype)


@TRITON
def test_without_key_start_nothing_changes() -> None:
    # key_start of zeros hides nothing: equal to no key_start at all, bit for bit.
    q, k, v = _qkv(2, 2, 1, 9, 30, 32)
    zeros = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    plain = kernels.triton_attention(q, k, v, causal=True)
    padded = kernels.triton_attention(q, k, v, causal=True, key_start=zeros)
    torch.testing.assert_close(plain, padded, rtol=0, atol=0)


def test_key_start_from_a_left_padded_attention_mask() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    starts = key_start_from_attention_mask(mask)
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 2, 4]
    bools = key_start_from_attention_mask(mask.bool())
    assert bools.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match=r"left-padded.*row 1"):
        key_start_from_attention_mask(torch.tensor([[1, 1, 1], [1, 1, 0]]))  # right padding
    with pytest.raises(ValueError, match=r"left-padded.*row 0"):
        key_start_from_attention_mask(torch.tensor([[0, 1, 0, 1]]))  # a hole
    with pytest.raises(ValueError, match=r"only 0 and 1.*got 2"):
        key_start_from_attention_mask(torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, T_k\)"):
        key_start_from_attention_mask(torch.ones(2, 3, 4))
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        key_start_from_attention_mask([[1, 1]])


@pytest.mark.parametrize("implementation", ["triton", "split_kv", "torch"])
def test_bad_key_start_is_refused_by_name(implementation) -> None:
    if implementation != "torch" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    run = {
        "triton": kernels.triton_attention,
        "split_kv": kernels.triton_split_kv_attention,
        "torch": flash_attention_torch,
    }[implementation]
    q = torch.zeros(2, 2, 16, 16, device=DEVICE)
    with pytest.raises(TypeError, match="key_start must be an integer tensor, got dtype"):
        run(q, q, q, key_start=torch.zeros(2, device=DEVICE))
    with pytest.raises(TypeError, match="key_start must be a torch.Tensor, got list"):
        run(q, q, q, key_start=[0, 0])
    with pytest.raises(ValueError, match=r"key_start must have shape \(B,\) = \(2,\), got \(3,\)"):
        run(q, q, q, key_start=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(
        ValueError, match=r"key_start must have shape \(B,\) = \(2,\), got \(2, 1\)"
    ):
        run(q, q, q, key_start=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    if implementation == "torch":
        with pytest.raises(ValueError, match=r"key_start needs q of shape \(B, H, T_q, d_k\)"):
            run(q[0], q[0], q[0], key_start=torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_meta_device_refused_for_key_start() -> None:
    # key_start on another device than q is refused by name (meta stands in for a GPU here).
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="key_start must be on q's device"):
        flash_attention_torch(q, q, q, key_start=torch.zeros(1, dtype=torch.int32, device="meta"))

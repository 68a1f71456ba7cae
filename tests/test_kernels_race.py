"""The kernels' race protocol: reruns bitwise equal, nothing unwritten reaches an output.

flash-attention's ``test_flash_attn_race_condition``: the same call made several times gives
bit-for-bit the same output and gradients, since no kernel here adds atomically. On a GPU the
grid of :data:`mha.bench.race.GPU_GRID` (every head size 64-256 against every ragged length,
16-bit, causal and not, T_q != T_k, GQA, key starts, sinks); in Triton's interpreter the small
grid. The error of every tensor against float64 stays within twice that of torch's own
``F.scaled_dot_product_attention`` in the same dtype on the same inputs (plus 1e-4).

Then every scratch buffer the kernels' wrappers allocate (``torch.empty``) is filled with NaN
(integers with a huge value) before the kernels run: an output that still holds one read memory
that nothing wrote.
"""

from __future__ import annotations

import pytest
import torch
from mha import kernels
from mha.bench import race

from helpers import KERNEL_DEVICE, randn

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

COMPILED = pytest.mark.skipif(  # a GPU, but TRITON_INTERPRET=1 was set by hand
    bool(kernels.INTERPRETED) and torch.cuda.is_available(),
    reason="TRITON_INTERPRET=1: the kernels are interpreted here",
)


@pytest.mark.cuda
@COMPILED
@pytest.mark.parametrize("case", race.GPU_GRID, ids=lambda case: case.name)
def test_reruns_bitwise_equal_on_the_gpu(case: race.RaceCase) -> None:
    result = race.race_case(case, "cuda", reruns=3)
    assert race.failures(result) == [], result


@pytest.mark.parametrize("case", race.CPU_GRID, ids=lambda case: case.name)
def test_reruns_bitwise_equal_where_the_kernels_run(case: race.RaceCase) -> None:
    result = race.race_case(case, KERNEL_DEVICE, reruns=2)
    assert race.failures(result) == [], result


def test_failures_names_a_rerun_that_differs_and_an_error_too_large() -> None:
    # The verdict itself, on made-up results: a protocol that could not fail would prove nothing.
    row = {"differ": 0, "unwritten": 0, "error": 3e-4, "sdpa_error": 2e-4}
    assert race.failures({"out": row}) == []
    assert race.failures({"out": {**row, "differ": 5}}) == [
        "out: 5 elements differ between reruns"
    ]
    assert race.failures({"dk": {**row, "unwritten": 2}}) == ["dk: 2 elements not finite"]
    (message,) = race.failures({"dq": {**row, "error": 6e-4}})
    assert message.startswith("dq: error 6.00e-04 against float64, above 2.0 x SDPA's 2.00e-04")


def test_the_grid_covers_every_head_size_and_length() -> None:
    cases = race.GPU_GRID
    assert {(c.head_dim, c.t_k) for c in cases} == {
        (d, t) for d in (64, 80, 96, 128, 256) for t in (97, 113, 257, 300, 799, 1023, 1024)
    }
    for feature in ("causal", "key_start", "sinks"):
        assert any(getattr(c, feature) for c in cases), feature
    assert {c.dtype for c in cases} == {"float16", "bfloat16"}
    assert any(c.t_q != c.t_k for c in cases) and any(c.kv_heads < c.heads for c in cases)


# ---------------------------------------------------------------------------------------------
# Nothing unwritten reaches an output


def _poisoned(factory):
    """``torch.empty``-like factory whose result is filled with NaN (integers: a huge value)."""

    def poisoned(*args, **kwargs):
        out = factory(*args, **kwargs)
        if out.device.type != "meta":
            out.fill_(float("nan") if out.is_floating_point() else 2**30)
        return out

    return poisoned


def _run_every_kernel(device: str) -> list[torch.Tensor]:
    q = randn(2, 4, 45, 40, seed=1, dtype=torch.float32).to(device).requires_grad_()
    k = randn(2, 2, 61, 40, seed=2, dtype=torch.float32).to(device).requires_grad_()
    v = randn(2, 2, 61, 40, seed=3, dtype=torch.float32).to(device).requires_grad_()
    starts = torch.tensor([0, 9], dtype=torch.int32, device=device)
    out = kernels.triton_attention(q, k, v, causal=True, key_start=starts)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    split = kernels.triton_attention(q, k, v, causal=True, key_start=starts,
                                     techniques=kernels.Techniques(split_group=True))  # fmt: skip
    split_grads = torch.autograd.grad(split, (q, k, v), torch.ones_like(split))
    decode = kernels.triton_split_kv_attention(q[:, :, -3:].detach(), k.detach(), v.detach(),
                                               causal=True, num_splits=3)  # fmt: skip
    pool = randn(7, 16, 2, 40, seed=4, dtype=torch.float32).to(device)
    table = torch.tensor([[3, 0, 5], [1, 6, 2]], dtype=torch.int32, device=device)
    lengths = torch.tensor([40, 19], dtype=torch.int32, device=device)
    paged = kernels.triton_paged_attention(q[:, :, -2:].detach(), pool, pool.flip(0), table,
                                           lengths)  # fmt: skip
    return [out.detach(), *grads, *split_grads[1:], decode, paged]


def test_no_scratch_buffer_reaches_an_output_unwritten(monkeypatch) -> None:
    clean = _run_every_kernel(KERNEL_DEVICE)
    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    poisoned = _run_every_kernel(KERNEL_DEVICE)
    for i, (want, got) in enumerate(zip(clean, poisoned)):
        assert torch.isfinite(got).all(), f"result {i} holds an unwritten element"
        assert torch.equal(got, want), f"result {i} changed with the scratch buffers' contents"

"""check_flash_attention: right kernels pass, each known mistake, written as a kernel, is named.

The kernels run in Triton's interpreter where there is no GPU (mha.kernels chooses it), compiled
on a GPU: their tensors are on KERNEL_DEVICE, and results are compared on the CPU. The right
kernels: the book's (mha.kernels) and tests/learner_kernels.py's (exp2, its own launcher, other
tiles; chapter 13's backward kernels and row softmax); the mistakes: those kernels with one
mistake switched on, and for the backward pass a torch autograd.Function whose backward ignores
causal, as Triton's tutorial did (issue #4541). Stores and loads outside a tensor (guard bands,
mha.exercises.guard) are named, and the test process survives them.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
import torch
from mha import kernels, reference

from helpers import KERNEL_DEVICE

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

if kernels.TRITON_AVAILABLE:
    from mha.exercises import check_softmax, failure, guard
    from mha.exercises.kernel import (
        BACKWARD_ITEMS,
        FORWARD_ITEMS,
        TOLERANCE,
        check_flash_attention,
        dense,
    )
    from mha.kernels.attention import attention_forward

    from learner_kernels import (
        BACKWARD_MISTAKES,
        MISTAKES,
        SOFTMAX_MISTAKES,
        learner_attention,
        learner_autograd,
        learner_row_softmax,
    )
else:  # collected, then skipped
    MISTAKES = BACKWARD_MISTAKES = SOFTMAX_MISTAKES = ()


def book_forward(q, k, v, causal):
    return attention_forward(q, k, v, causal=causal)


def book_autograd(q, k, v, causal):
    return kernels.triton_attention(q, k, v, causal=causal)


def _numpy_reference(q, k, v, causal):
    """Float64 attention by mha.reference, k and v repeated per query head."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.cpu().double().numpy() for t in (q, k, v))
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    mask = None
    if causal:
        mask = reference.causal_mask(q.shape[2], k.shape[2], align="bottom-right")
    return reference.scaled_dot_product_attention(q, k, v, mask)[0]


def _largest_error(fn, cases) -> float:
    worst = 0.0
    for index, case in enumerate(cases):
        q, k, v = (t.to(KERNEL_DEVICE) for t in case.inputs(index))
        out = fn(q, k, v, case.causal)[0].cpu().double().numpy()
        expected = _numpy_reference(q, k, v, case.causal)
        worst = max(worst, float(np.max(np.abs(out - expected) / (1 + np.abs(expected)))))
    return worst


ALL_CASES = [case for _, cases in FORWARD_ITEMS for case in cases] if MISTAKES else []


def test_the_reference_is_mha_reference():
    for index, case in enumerate(ALL_CASES):
        q, k, v = case.inputs(index)
        out, lse = dense(q.double(), k.double(), v.double(), causal=case.causal)
        np.testing.assert_allclose(
            out.numpy(), _numpy_reference(q, k, v, case.causal), rtol=1e-12, atol=1e-12
        )
        assert lse.shape == q.shape[:3]


def test_the_tolerance_is_set_from_the_books_kernel():
    book = _largest_error(book_forward, ALL_CASES)
    assert 0 < book and 5 * book <= TOLERANCE <= 30 * book, (book, TOLERANCE)
    float16_acc = functools.partial(learner_attention, mistake="float16_acc")
    assert _largest_error(float16_acc, ALL_CASES) > 10 * TOLERANCE


def test_the_books_kernel_passes_forward_and_backward(capsys):
    check_flash_attention(book_forward)
    printed = capsys.readouterr().out
    assert f"all {len(FORWARD_ITEMS)} items pass" in printed
    assert f"logsumexp was checked in items 1 to {len(FORWARD_ITEMS)}" in printed
    assert check_flash_attention(book_autograd, backward=True, verbose=False) is None


@pytest.mark.parametrize("tiles", [(32, 32), (16, 64)])
def test_a_right_kernel_written_another_way_passes(tiles):
    block_q, block_k = tiles
    fn = functools.partial(learner_attention, block_q=block_q, block_k=block_k)
    assert check_flash_attention(fn, verbose=False) is None


# mistake -> (the item that fails, words its message must hold)
NAMED = {
    "no_rescale": (2, "acc and ell were not rescaled"),
    "top_left": (6, "aligned top-left"),
    "tail_unmasked": (1, "key tail is not masked"),
    "gqa_modulo": (8, "h % H_kv"),
    "no_scale": (1, "not divided by sqrt(d)"),
    "exp2_no_log2e": (1, "exp2 was used without the log2(e) factor"),
    "float16_acc": (1, "kept in float16"),
    "nan_empty_row": (7, "see no key are NaN"),
    "lse_base2": (1, "logsumexp is in base 2"),
    "lse_mixed_units": (1, "logsumexp mixes log2 and natural units"),
    "normalise_in_loop": (2, "acc was divided by ell inside the loop"),
    # the last key row's padded dims: past the end of K (and of V), NaN there; named by the
    # interpreter's check of each load (on a GPU: the NaN it reads, in out)
    "kv_no_dims_mask": (
        4,
        "your kernel `learner_forward_kernel` read 24 values past the end of `K`, a (1, 1, 70, "
        "40) tensor: indices 40 to 63 of its last row (a dimension of size 40, d). Mask the "
        "load with the head-size bound (dims < HEAD_DIM); it went outside `V` too",
    ),
    "out_unmasked": (
        1,
        "wrote 256 values past the end of `Out`, a (1, 2, 16, 16) tensor: rows 16 to 31 of its "
        "last (batch, head) (a dimension of size 16, T_q = T_k). Mask the store with the row "
        "bound (rows < T_Q)",
    ),
    "lse_unmasked": (
        1,
        "wrote 16 values past the end of `Lse`, a (1, 2, 16) tensor: indices 16 to 31 of its "
        "last row (a dimension of size 16, T_q). Mask the store with the row bound (rows < T_Q)",
    ),
    "no_contiguous": (9, "ignores the strides"),
}


def test_every_mistake_has_a_test():
    assert set(NAMED) == set(MISTAKES)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_is_named(mistake):
    item, words = NAMED[mistake]
    if mistake == "kv_no_dims_mask" and KERNEL_DEVICE != "cpu":
        # a compiled kernel's loads are not checked one by one: the NaN past K's end shows
        words = "out holds NaN (first at index (0, 0, 0, 0)). The checker puts NaN around"
    message = failure(check_flash_attention, functools.partial(learner_attention, mistake=mistake))
    total = len(FORWARD_ITEMS)
    assert message is not None and message.startswith(
        f"check_flash_attention: item {item} of {total} failed"
    ), message
    assert words in " ".join(message.split()), message


def test_the_key_tail_is_named_with_tiles_smaller_than_the_keys():
    # T_k = 16 fills one tile of 16: the tail shows first at T_k = 111 (item 3)
    fn = functools.partial(learner_attention, mistake="tail_unmasked", block_q=16, block_k=16)
    message = failure(check_flash_attention, fn)
    assert message.startswith("check_flash_attention: item 3 of"), message
    assert "key tail is not masked" in " ".join(message.split())


def _tf32(x):
    """float32 rounded to TF32's 10 bits of mantissa, as tl.dot does on a GPU by default."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def tf32_products(q, k, v, causal):
    """Attention in float32 whose products round their inputs to TF32, in torch."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = _tf32(q) @ _tf32(k).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        t_q, t_k = q.shape[2], k.shape[2]
        keep = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
        scores = scores.masked_fill(~keep, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return _tf32(weights) @ _tf32(v)


def test_tf32_products_are_named():
    message = " ".join(failure(check_flash_attention, tf32_products).split())
    assert message.startswith("check_flash_attention: item 1 of"), message
    assert "TF32: pass input_precision='ieee'" in message


class _BackwardIgnoresCausal(torch.autograd.Function):
    """The book's forward kernel; a backward in torch that masks as ``backward_causal`` says,
    whatever the forward did (the bug of Triton's tutorial, issue #4541)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, backward_causal):
        out, lse = attention_forward(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_causal = backward_causal
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]
        k_all, v_all = (t.repeat_interleave(group, dim=1) for t in (k, v))
        scale = q.shape[-1] ** -0.5
        p = torch.exp(q @ k_all.transpose(-1, -2) * scale - lse[..., None])
        if ctx.backward_causal:
            t_q, t_k = q.shape[2], k.shape[2]
            keep = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
            p = p.masked_fill(~keep, 0.0)
        dv = p.transpose(-1, -2) @ d_out
        ds = p * (d_out @ v_all.transpose(-1, -2) - (d_out * out).sum(-1, keepdim=True))
        dq = ds @ k_all * scale
        dk = ds.transpose(-1, -2) @ q * scale
        fold = lambda t: t.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv), None, None


def test_the_chapters_backward_kernels_pass():
    assert check_flash_attention(learner_autograd, backward=True, verbose=False) is None


# backward mistake -> (the item that fails, words its message must hold), the items counted after
# the forward's
NAMED_BACKWARD = {
    "no_delta": (1, "dq: delta was left out"),
    "dq_no_scale": (1, "dq: dq was not multiplied by the scale"),
    "exp2_natural_lse": (1, "rebuilt with exp2 against the natural logsumexp"),
    "one_head_of_group": (3, "dk: dk and dv hold the gradient of one query head of each group"),
    "b_kv_over_h": (4, "dk is right for batch 0 and wrong for batch 2"),
    "dk_unmasked": (
        1,
        "your kernel `learner_dk_dv_kernel` wrote 1064 values past the end of `DK`, a (1, 2, "
        "70, 40) tensor: rows 70 to 95 of its last (batch, head) (a dimension of size 70, T_k), "
        "each wider than its 40 values. Mask the store with the key bound (cols < T_K) and the "
        "head-size bound (dims < HEAD_DIM)",
    ),
    "dq_rows_only": (
        1,
        "your kernel `learner_dq_kernel` wrote 24 values past the end of `DQ`, a (1, 2, 45, 40) "
        "tensor: indices 40 to 63 of its last row (a dimension of size 40, d). Mask the store "
        "with the head-size bound (dims < HEAD_DIM)",
    ),
    "no_contiguous": (5, "ignores the strides"),
}


def test_every_backward_mistake_has_a_test():
    assert set(NAMED_BACKWARD) == set(BACKWARD_MISTAKES)


@pytest.mark.parametrize("mistake", BACKWARD_MISTAKES)
def test_a_backward_mistake_is_named(mistake):
    item, words = NAMED_BACKWARD[mistake]
    fn = functools.partial(learner_autograd, mistake=mistake)
    message = failure(check_flash_attention, fn, backward=True)
    total = len(FORWARD_ITEMS) + len(BACKWARD_ITEMS)
    assert message is not None and message.startswith(
        f"check_flash_attention: item {len(FORWARD_ITEMS) + item} of {total} failed"
    ), message
    assert words in " ".join(message.split()), message


def test_the_batch_mapping_bug_hides_until_batch_exceeds_the_group():
    # b_kv // H is right while B <= H / H_kv: every backward case but one has B = 1
    (title, (case,)) = BACKWARD_ITEMS[3]
    group = case.heads // case.kv_heads
    assert case.batch > group and "more batches (3) than query heads per group (2)" in title
    assert all(c.batch <= c.heads // c.kv_heads for _, cases in BACKWARD_ITEMS[:3] for c in cases)


def test_the_grids_hold_views_and_odd_head_sizes():
    for items in (FORWARD_ITEMS, BACKWARD_ITEMS):
        cases = [case for _, cases in items for case in cases]
        views = [case for case in cases if case.layout == "views"]
        # a transposed q or k with one head is contiguous in all but name
        assert views and all(case.heads > 1 and case.kv_heads > 1 for case in views)
        q, k, v = views[0].inputs(0)
        assert not q.is_contiguous() and not k.is_contiguous() and v.is_contiguous()
        assert not views[0].d_out(0).is_contiguous()
        assert any(case.head_dim & (case.head_dim - 1) for case in cases)  # not a power of two


@pytest.mark.parametrize("always_causal", [True, False])
def test_a_backward_that_ignores_causal_is_named(always_causal):
    def fn(q, k, v, causal):
        return _BackwardIgnoresCausal.apply(q, k, v, causal, always_causal)

    assert check_flash_attention(fn, verbose=False) is None  # the forward is right
    message = failure(check_flash_attention, fn, backward=True)
    # always causal fails on the first, non-causal, gradients; never causal on the causal ones
    item = len(FORWARD_ITEMS) + (1 if always_causal else 2)
    total = len(FORWARD_ITEMS) + len(BACKWARD_ITEMS)
    assert message.startswith(f"check_flash_attention: item {item} of {total}"), message
    assert "ignores causal" in message and "#4541" in message


def test_a_forward_without_autograd_is_told_so():
    message = failure(check_flash_attention, book_forward, backward=True)
    message = " ".join(message.split())
    assert "out has no gradient" in message and "autograd.Function" in message


def test_wrong_results_and_shapes_are_described():
    def transposed(q, k, v, causal):  # (B, T_q, H, d)
        return book_forward(q, k, v, causal)[0].transpose(1, 2)

    assert "has shape" in failure(check_flash_attention, transposed)

    def off_by_one(q, k, v, causal):
        out, lse = book_forward(q, k, v, causal)
        return out + 0.5, lse

    message = failure(check_flash_attention, off_by_one)
    message = " ".join(message.split())
    assert "differs from attention in float64 by up to 0.499 (relative)" in message
    assert "at index (0, 1, 0, 8)" in message and "expected -0.00290205" in message


# ---------------------------------------------------------------------------------------------
# Devices: the kernel gets its tensors where it runs, and a device problem is named as one


def test_the_kernel_gets_its_tensors_where_the_kernels_run():
    from mha.exercises.checker import kernel_device

    seen = set()

    def spy(q, k, v, causal):
        seen.update(t.device.type for t in (q, k, v))
        return learner_attention(q, k, v, causal)

    assert check_flash_attention(spy, verbose=False) is None
    assert seen == {KERNEL_DEVICE} and kernel_device() == KERNEL_DEVICE


def test_a_result_on_another_device_is_named():
    def on_meta(q, k, v, causal):  # a device no input is on, on any machine
        out, lse = learner_attention(q, k, v, causal)
        return out.to("meta"), lse

    message = " ".join(failure(check_flash_attention, on_meta).split())
    assert message.startswith("check_flash_attention: item 1 of"), message
    assert "part 0 of its result is a tensor on meta" in message, message
    assert f"its inputs are on {KERNEL_DEVICE}" in message, message


@pytest.mark.skipif(
    KERNEL_DEVICE == "cpu", reason="in the interpreter every tensor is on the CPU, where it reads"
)
def test_a_launcher_that_makes_a_cpu_tensor_is_told_so():
    # a kernel compiled for the GPU refuses a CPU tensor: Triton's error, then the device named
    fn = functools.partial(learner_attention, lse_device="cpu")
    message = " ".join(failure(check_flash_attention, fn).split())
    assert message.startswith("check_flash_attention: item 1 of"), message
    assert "cpu tensor?" in message and "Its inputs are on cuda" in message, message
    assert "device=x.device" in message, message


def test_device_is_chosen_by_name():
    with pytest.raises(ValueError, match="device must be a torch device"):
        check_flash_attention(book_forward, device="gpu")


def test_importing_the_checkers_imports_neither_torch_nor_triton():
    code = (
        "import sys, mha.exercises\n"
        "assert not {'torch', 'triton'} & set(sys.modules), 'imported at once'\n"
        "from mha.exercises import check_flash_attention\n"
        "assert check_flash_attention.__module__ == 'mha.exercises.kernel'\n"
        "assert 'triton' not in sys.modules, 'triton imported by the checker'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be a function"):
        check_flash_attention("kernel")


# ---------------------------------------------------------------------------------------------
# Guard bands: stores and loads outside a tensor are named, and never end the process


def test_the_rows_softmax_of_the_chapter_passes():
    assert failure(check_softmax, learner_row_softmax, framework="torch") is None


SOFTMAX_NAMED = {
    "store_unmasked": "your kernel `learner_softmax_kernel` wrote 3 values past the end of `Y`, "
    "a (3, 5) tensor: indices 5 to 7 of its last row (a dimension of size 5, n_cols). Mask the "
    "store with the column bound (cols < n_cols)",
    "store_far": "your kernel `learner_softmax_kernel` wrote to 10 addresses far outside every "
    "tensor it was given (",
}


@pytest.mark.parametrize("mistake", SOFTMAX_MISTAKES)
def test_a_softmax_kernel_out_of_bounds_is_named(mistake):
    if mistake == "store_far" and KERNEL_DEVICE != "cpu":
        pytest.skip("a compiled kernel's far store is an illegal memory access: CUDA's to report")
    fn = functools.partial(learner_row_softmax, mistake=mistake)
    message = failure(check_softmax, fn, framework="torch")
    assert message is not None and message.startswith("check_softmax: item 1 of 8"), message
    assert SOFTMAX_NAMED[mistake] in " ".join(message.split()), message


def test_a_far_store_is_refused_before_it_happens():
    if KERNEL_DEVICE != "cpu":
        pytest.skip("the interpreter's loads and stores are checked; a GPU's are not")
    x = torch.randn(3, 5, dtype=torch.float64)
    with guard.guarded() as launches:
        y = learner_row_softmax(x, mistake="store_far")  # rows 1 and 2: 1 TiB away
    message = launches.message()
    assert "wrote to 10 addresses far outside every tensor" in message, message
    torch.testing.assert_close(y[0], torch.softmax(x[0], -1))  # row 0 was in place


@pytest.mark.skipif(
    KERNEL_DEVICE != "cpu", reason="the forked child stands in for the interpreter"
)
def test_where_the_interpreter_cannot_be_watched_a_crash_ends_a_child(monkeypatch):
    monkeypatch.setattr(guard, "WATCH", False)  # as on a Triton without the hooks
    fn = functools.partial(learner_row_softmax, mistake="store_far")
    message = " ".join(failure(check_softmax, fn, framework="torch").split())
    assert message.startswith("check_softmax: item 1 of 8 failed"), message
    assert "your kernel crashed the process (SIGSEGV)" in message, message
    assert "nothing of yours is lost" in message
    # the guard bands alone still name a store past the end, and a right kernel passes
    fn = functools.partial(learner_row_softmax, mistake="store_unmasked")
    message = " ".join(failure(check_softmax, fn, framework="torch").split())
    assert "wrote 3 values past the end of `Y`" in message, message
    assert failure(check_softmax, learner_row_softmax, framework="torch") is None


@pytest.mark.parametrize("mistake", ["out_unmasked", "kv_no_dims_mask"])
def test_guard_bands_alone_name_a_store_and_make_a_read_nan(monkeypatch, mistake):
    # what a GPU gets: no check of each load and store, the guard bands only
    monkeypatch.setattr(guard, "WATCH", False)
    monkeypatch.setattr(guard, "needs_child", lambda device: False)
    message = " ".join(failure(check_flash_attention, functools.partial(
        learner_attention, mistake=mistake)).split())  # fmt: skip
    if mistake == "out_unmasked":
        assert "wrote 256 values past the end of `Out`" in message, message
    else:  # the last key's padded dims are NaN, and so is every score of the last head
        assert message.startswith("check_flash_attention: item 4 of"), message
        assert "out holds NaN" in message and "a load past the end of q, k, v" in message


def test_the_guard_keeps_the_kernels_results_and_the_callers_tensors():
    x = torch.randn(4, 6, device=KERNEL_DEVICE)
    kept = x.clone()
    with guard.guarded() as launches:
        y = learner_row_softmax(x)
    assert not launches and launches.message() is None
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert torch.equal(x, kept)


def test_an_error_after_a_store_out_of_bounds_names_the_store():
    def launch_then_fail(q, k, v, causal):
        learner_attention(q, k, v, causal, mistake="lse_unmasked")
        raise RuntimeError("a later error")

    message = " ".join(failure(check_flash_attention, launch_then_fail).split())
    assert "past the end of `Lse`" in message and "a later error" not in message, message

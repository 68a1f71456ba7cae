"""compile_report: a learner's Triton kernels, captured from their launcher and compiled ahead of
time for sm_80 and sm_90 in a child process, beside the book's kernel.

The book's row is checked against the committed `python -m mha.kernels --inspect` run (another
route to the same build: its own launch of 4 x 4096 tokens, the same tiles and specialisation).

compile_report records the launches without running them, so its example tensors may be on the
CPU where Triton compiles for a GPU (chapter 13 hands it CPU tensors); a kernel the tests run
gets its tensors on KERNEL_DEVICE, where the kernels run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mha import kernels
from mha.kernels.tiles import SHARED_LIMIT

from helpers import KERNEL_DEVICE

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

if kernels.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from learner_kernels import learner_attention

    #: a global constant the kernel reads, carried to the compiling process
    ROWS_PER_PROGRAM = tl.constexpr(2)

    @triton.jit
    def _row_pointers(base, row, stride, cols):
        return base + row * stride + cols

    @triton.jit
    def row_softmax_kernel(X, Y, stride, n_cols, BLOCK: tl.constexpr):
        for i in range(ROWS_PER_PROGRAM):
            row = tl.program_id(0) * ROWS_PER_PROGRAM + i
            cols = tl.arange(0, BLOCK)
            x = tl.load(
                _row_pointers(X, row, stride, cols), mask=cols < n_cols, other=-float("inf")
            )
            e = tl.exp(x - tl.max(x, axis=0))
            tl.store(
                _row_pointers(Y, row, stride, cols), e / tl.sum(e, axis=0), mask=cols < n_cols
            )

    @triton.jit
    def wide_softmax_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
        # one row of BLOCK values held by one program: with one warp, 4096 floats are 128 per
        # thread (ptxas spills a few), 8192 are 256 (it spills most)
        cols = tl.arange(0, BLOCK)
        row = tl.program_id(0) * n_cols
        x = tl.load(X + row + cols, mask=cols < n_cols, other=-float("inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def staged_product_kernel(A, B, C, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):  # fmt: skip
        # C = A B for one (BLOCK_M, BLOCK_N) tile, the loop over K pipelined in num_stages
        rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            a = tl.load(A + rows[:, None] * K + (start + inner)[None, :])
            b = tl.load(B + (start + inner)[:, None] * BLOCK_N + cols[None, :])
            acc += tl.dot(a, b)
        tl.store(C + rows[:, None] * BLOCK_N + cols[None, :], acc)


def row_softmax(x, out=None):
    y = torch.empty_like(x) if out is None else out
    block = triton.next_power_of_2(x.shape[1])
    row_softmax_kernel[(x.shape[0] // 2,)](x, y, x.stride(0), x.shape[1], BLOCK=block, num_warps=2)
    return y


def wide_softmaxes(x):
    """Two launches with one warp: a row of 4096 values, then of 8192."""
    y = torch.empty_like(x)
    for cols in (4096, 8192):
        wide_softmax_kernel[(x.shape[0],)](x, y, cols, BLOCK=cols, num_warps=1)
    return y


def staged_product(a, b, num_stages):
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    staged_product_kernel[(1,)](
        a, b, c, a.shape[1], BLOCK_M=a.shape[0], BLOCK_N=b.shape[1], BLOCK_K=64,
        num_warps=8, num_stages=num_stages,
    )  # fmt: skip
    return c


ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {"kernel", "arch", "dtype", "head_dim", "block_q", "block_k", "num_warps", "num_stages"}
COLUMNS |= {"registers", "spill_bytes", "shared_bytes", "hmma", "hgmma", "cubin"}
COLUMNS |= {"register_limit", "warnings"}


def test_a_learners_attention_kernel_beside_the_books():
    q = torch.randn(1, 4, 64, 64).half()  # (B, H, T_q, d)
    k, v = torch.randn(2, 1, 2, 64, 64).half()  # (B, H_kv, T_k, d) each
    rows = kernels.compile_report(learner_attention, q, k, v, True)
    assert [(r["kernel"], r["arch"]) for r in rows] == [
        ("learner_forward_kernel", "sm_80"),
        ("forward (book)", "sm_80"),
        ("learner_forward_kernel", "sm_90"),
        ("forward (book)", "sm_90"),
    ]
    for row in rows:
        assert COLUMNS <= set(row), COLUMNS - set(row)
        assert row["dtype"] == "float16" and row["head_dim"] == 64 and row["causal"] is True
        assert row["registers"] > 0 and row["spill_bytes"] == 0 and row["warnings"] == []
        assert row["hmma"] + row["hgmma"] > 0  # float16 products on the tensor cores
    learner = rows[0]
    assert (learner["block_q"], learner["block_k"], learner["num_warps"]) == (32, 32, 4)
    assert learner["constexprs"] == {
        "CAUSAL": True,
        "HEAD_DIM": 64,
        "D_PAD": 64,
        "BLOCK_Q": 32,
        "BLOCK_K": 32,
        "MISTAKE": "",
    }
    assert rows[0]["hgmma"] == 0 and rows[1]["hgmma"] == 0  # no warpgroup products on sm_80

    # the book's rows are the builds `python -m mha.kernels --inspect` committed: the same tiles,
    # and, from the same Triton (its compiler and ptxas), the same registers and instructions
    committed = json.loads(sorted((ROOT / "benchmarks").glob("kernels_2*.json"))[-1].read_text())
    same_compiler = committed["environment"]["triton_version"] == triton.__version__
    for row in rows[1::2]:
        (same,) = [
            b
            for b in committed["builds"]
            if (b["kernel"], b["arch"], b["dtype"], b["head_dim"])
            == ("forward", row["arch"], "float16", 64)
            and b.get("causal", True)
        ]
        for key in ("block_q", "block_k", "num_warps", "num_stages"):
            assert row[key] == same[key], key
        if same_compiler:
            for key in ("registers", "shared_bytes", "tensor_core_instructions"):
                assert row[key] == same[key], key


def test_the_books_kernel_rebuilt_from_its_source_compiles_as_the_book_does():
    # its helpers come from its module (copied) and from triton.language (imported, renamed)
    from mha.kernels.attention import attention_forward

    # the book's launcher takes only tensors its kernels can read (CUDA ones where compiled)
    q, k, v = torch.randn(3, 1, 2, 64, 64).half().to(KERNEL_DEVICE)  # (B, H, T, d) each

    def launcher(q, k, v, causal):
        return attention_forward(q, k, v, causal=causal)

    captured, book = kernels.compile_report(launcher, q, k, v, True, archs=("sm_80",))
    assert captured["kernel"] == "_forward_kernel" and book["kernel"] == "forward (book)"
    for key in ("block_q", "block_k", "num_warps", "registers", "shared_bytes", "hmma"):
        assert captured[key] == book[key], key


def test_a_kernel_with_helpers_and_constants_compiles():
    x = torch.randn(6, 37, device=KERNEL_DEVICE)
    torch.testing.assert_close(row_softmax(x), torch.softmax(x, dim=-1))
    rows = kernels.compile_report(row_softmax, x, archs=("sm_90",))
    (row,) = rows  # x is not (q, k, v): no book row
    assert row["kernel"] == "row_softmax_kernel" and row["arch"] == "sm_90"
    assert row["num_warps"] == 2 and row["dtype"] == "float32" and row["head_dim"] is None
    assert row["hmma"] == row["hgmma"] == 0  # no product, no tensor core
    # the same report from CPU tensors, on any machine: chapter 13's example tensors are on the CPU
    assert kernels.compile_report(row_softmax, x.cpu(), archs=("sm_90",)) == rows


def test_the_launches_are_recorded_not_run():
    from mha.kernels.report import capture_launches

    x = torch.randn(4, 8, device=KERNEL_DEVICE)
    out = torch.zeros_like(x)
    with capture_launches(run=False) as launches:
        assert row_softmax(x, out) is out
    assert [launch["name"] for launch in launches] == ["row_softmax_kernel"]
    assert launches[0]["options"] == {"num_warps": 2}
    assert torch.equal(out, torch.zeros_like(x))  # nothing ran: out is as it was made
    # CPU tensors, which a kernel compiled for the GPU cannot read, are recorded alike
    with capture_launches(run=False) as from_the_cpu:
        row_softmax(x.cpu(), out.cpu())
    assert from_the_cpu == launches
    with capture_launches() as ran:  # run=True: recorded and launched, its options kept
        row_softmax(x, out)
    assert ran == launches
    torch.testing.assert_close(out, torch.softmax(x, dim=-1))


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="archs must be among sm_80"):
        kernels.compile_report(row_softmax, torch.zeros(2, 4), archs=("sm_75",))
    with pytest.raises(ValueError, match="launched no Triton kernel"):
        kernels.compile_report(torch.softmax, torch.zeros(2, 4), -1)


def test_warps_and_stages_are_the_launchers():
    a, b = torch.randn(64, 1024).half(), torch.randn(1024, 128).half()
    (row,) = kernels.compile_report(lambda a, b: staged_product(a, b, 2), a, b, archs=("sm_80",))
    assert (row["num_warps"], row["num_stages"]) == (8, 2)  # as launched, not Triton's 4 and 3
    assert (row["block_q"], row["block_k"]) == (64, 64)  # BLOCK_M, BLOCK_K: Triton's names
    assert row["shared_bytes"] <= SHARED_LIMIT["sm_80"] and row["warnings"] == []


def test_shared_memory_beyond_the_limit_is_flagged():
    # ten stages of a (64 x 64) and a (64 x 128) float16 tile: more than either GPU allows
    a, b = torch.randn(64, 1024).half(), torch.randn(1024, 128).half()
    rows = kernels.compile_report(lambda a, b: staged_product(a, b, 10), a, b)
    assert [r["arch"] for r in rows] == ["sm_80", "sm_90"]
    for row in rows:
        assert (row["num_warps"], row["num_stages"], row["spill_bytes"]) == (8, 10, 0)
        assert row["shared_bytes"] > SHARED_LIMIT[row["arch"]]
        (said,) = row["warnings"]
        limit = {
            "sm_80": "163 KiB one program may use on an A100 (sm_80)",
            "sm_90": "227 KiB one program may use on an H100 (sm_90)",
        }[row["arch"]]
        assert said == (
            f"uses {row['shared_bytes'] / 1024:.1f} KiB of shared memory, more than the {limit}: "
            "it would fail to launch; fewer stages (num_stages=10) or smaller tiles need less"
        )
    printed = kernels.format_report(rows)
    assert printed.splitlines()[2].split()[:5] == [
        "staged_product_kernel",
        "sm_90",
        "64x64",
        "8",
        "10",
    ]
    assert "  - uses " in printed and "it would fail to launch" in printed
    table, notes = printed.splitlines()[:3], printed.splitlines()[3:]
    assert {len(line) for line in table} == {len("staged_product_kernel") + 59}
    assert max(len(line) for line in notes) <= 79  # wrapped


def test_spills_are_flagged_and_the_registers_figure_explained():
    x = torch.randn(2, 8192)
    few, most = kernels.compile_report(wide_softmaxes, x, archs=("sm_80",))
    if few["spill_bytes"] == 0 and triton.__version__ != "3.9.0":
        # the ptxas of an older Triton (3.6's, seen) keeps 128 values a thread in registers
        # (232 of them): no warning; the pinned Triton's spills, as below
        assert few["warnings"] == [] and few["registers"] < 255
        few = None
    for row in (few, most) if few else (most,):
        assert row["num_warps"] == 1 and row["register_limit"] == 255
        assert row["spill_bytes"] > 0 and row["stack_bytes"] > 0
        spills, registers = row["warnings"]
        assert spills.startswith(
            f"spills {row['spill_bytes']} bytes to local memory (spill stores and loads; "
            f"{row['stack_bytes']} bytes of stack per thread)"
        )
    # 256 values per thread: ptxas keeps most in local memory and counts far fewer registers
    assert most["registers"] < 255
    assert most["warnings"][1] == (
        f"registers: {most['registers']} is not what the code needs: spilling this much, ptxas "
        "kept most values in local memory and counts only the registers it still uses, fewer "
        "than the limit (255, the most any thread may have)"
    )
    if few is None:
        return
    # 128 values per thread: ptxas uses every register a thread may have, and spills a little
    assert few["registers"] == 255 and most["spill_bytes"] > 100 * few["spill_bytes"]
    assert few["warnings"][1] == (
        "registers: 255 is the limit ptxas hit (255, the most any thread may have), not what "
        "the code needs: it needs more, and the rest spilled"
    )
    printed = kernels.format_report([few, most]).splitlines()
    assert printed[0].split() == (
        "kernel GPU tile warps stages regs spill smem KiB HMMA HGMMA".split()
    )
    assert printed[1].split()[:6] == ["wide_softmax_kernel", "sm_80", "-", "1", "3", "255"]
    assert "wide_softmax_kernel, sm_80:" in printed and "  - spills " in "\n".join(printed)


def test_the_register_limit_and_the_warnings_of_a_row():
    from mha.kernels.report import build_warnings, register_limit

    # 65,536 registers for the threads of a program, 255 for one thread at most
    assert [register_limit(w) for w in (1, 4, 8, 16, 32)] == [255, 255, 255, 128, 64]
    assert register_limit(4, maxnreg=96) == 96
    row = {"arch": "sm_90", "num_warps": 16, "num_stages": 2, "registers": 128,
           "register_limit": 128, "spill_bytes": 48, "stack_bytes": 24,
           "shared_bytes": 240 * 1024}  # fmt: skip
    spills, registers, shared = build_warnings(row)
    assert spills.startswith("spills 48 bytes to local memory")
    assert registers == (
        "registers: 128 is the limit ptxas hit (128: 65,536 shared by the 512 threads of 16 "
        "warps), not what the code needs: it needs more, and the rest spilled"
    )
    assert shared.startswith(
        "uses 240.0 KiB of shared memory, more than the 227 KiB one program may use on an H100"
    )
    assert build_warnings({**row, "spill_bytes": 0, "shared_bytes": 227 * 1024}) == []

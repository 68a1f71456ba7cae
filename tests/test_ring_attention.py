"""mha.parallel.ring: attention with the sequence split over processes.

Two kinds of test:

* in one process: which positions each process holds (values derived by hand), the work per
  process and its imbalance (hand-derived formulas), the bytes formula, the merge rule against
  mha.flash.merge_partials, the dense reference against torch's SDPA, errors;
* real processes (one launch of 4 gloo processes on CPUs, rings of 4, 3 and 2 inside it, and
  one ``python -m mha.parallel --ring``): every case equal to dense attention computed on one
  process in float64, outputs and gradients; the bytes passed to isend equal to the formula; the
  (query, key) pairs each process computed; PyTorch's own context parallel on the same inputs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mha.flash import merge_partials
from mha.parallel.launch import launch
from mha.parallel.ring import (
    chunk_ranges,
    dense_attention,
    imbalance,
    merge_parts,
    pairs_per_rank,
    ring_attention,
    ring_bytes,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 150  # seconds: no launch in this file may take longer
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---------------------------------------------------------------------------
# Who holds which positions: values derived by hand


def test_contiguous_parts_are_tensor_split_sizes():
    # T = 13 over 4: 13 = 4 * 3 + 1, the first part one longer: 4, 3, 3, 3
    runs = [chunk_ranges(13, 4, r, "contiguous") for r in range(4)]
    assert runs == [(range(0, 4),), (range(4, 7),), (range(7, 10),), (range(10, 13),)]


def test_zigzag_gives_process_r_chunks_r_and_2p_minus_1_minus_r():
    # T = 13 in 8 chunks: 13 = 8 * 1 + 5, chunks 0..4 of 2, chunks 5..7 of 1:
    # starts 0 2 4 6 8 10 11 12 13
    runs = [chunk_ranges(13, 4, r, "zigzag") for r in range(4)]
    assert runs == [
        (range(0, 2), range(12, 13)),  # chunks 0 and 7
        (range(2, 4), range(11, 12)),  # chunks 1 and 6
        (range(4, 6), range(10, 11)),  # chunks 2 and 5
        (range(6, 8), range(8, 10)),  # chunks 3 and 4
    ]
    # T = 16, P = 4: chunks of 2, each process holds 4 positions
    assert sequence_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    # T = 6 over 8 chunks: chunks 6 and 7 are empty and left out
    assert [sequence_positions(6, 4, r, "zigzag").tolist() for r in range(4)] == [
        [0],
        [1],
        [2, 5],
        [3, 4],
    ]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("T", "P"), [(1, 1), (7, 2), (13, 3), (13, 4), (5, 5), (16, 4)])
def test_every_position_is_held_once_and_unshard_inverts_shard(layout, T, P):
    held = torch.cat([sequence_positions(T, P, r, layout) for r in range(P)])
    assert sorted(held.tolist()) == list(range(T))
    x = torch.randn(2, 3, T, 4)
    parts = [shard_sequence(x, r, P, layout) for r in range(P)]
    assert all(torch.equal(p, x[:, :, sequence_positions(T, P, r, layout)]) for r, p in
               enumerate(parts))  # fmt: skip
    assert torch.equal(unshard_sequence(parts, layout), x)
    along_0 = [shard_sequence(x[0, 0], r, P, layout, dim=0) for r in range(P)]
    assert torch.equal(unshard_sequence(along_0, layout, dim=0), x[0, 0])


def test_layout_errors_name_the_argument():
    with pytest.raises(
        ValueError, match=r"layout must be one of 'contiguous', 'zigzag', got 'zig'"
    ):
        chunk_ranges(8, 2, 0, "zig")
    with pytest.raises(ValueError, match=r"seq_len must be at least world_size \(4\).*got 3"):
        chunk_ranges(3, 4, 0)
    with pytest.raises(ValueError, match=r"rank must be below world_size \(2\), got 2"):
        chunk_ranges(8, 2, 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        chunk_ranges(8, 2.0, 0)
    x = torch.randn(1, 1, 7, 2)
    parts = [shard_sequence(x, r, 2, "contiguous") for r in range(2)]  # 4 and 3 positions
    # zigzag, 4 chunks of 7: 2 2 2 1; process 0 holds chunks 0 and 3 (3), process 1: 1, 2 (4)
    with pytest.raises(ValueError, match=r"parts\[0\] must hold 3 positions.*'zigzag'"):
        unshard_sequence(parts, "zigzag")


# ---------------------------------------------------------------------------
# The work per process: hand-derived


def test_causal_pairs_per_process_by_hand():
    # T = 64, P = 4, contiguous: parts of c = 16; process r's queries r c .. (r+1) c - 1 see
    # p + 1 keys each: c^2 r + c (c + 1) / 2 = 256 r + 136
    assert pairs_per_rank(64, 4, "contiguous") == [136, 392, 648, 904]
    # zigzag, chunks of c = 8: chunk r and chunk 2P-1-r: c^2 (2P - 1) + c (c + 1) = 448 + 72
    assert pairs_per_rank(64, 4, "zigzag") == [520] * 4
    assert sum(pairs_per_rank(64, 4)) == 64 * 65 // 2  # the causal triangle
    assert pairs_per_rank(10, 3, causal=False) == [4 * 10, 3 * 10, 3 * 10]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_contiguous_imbalance_against_its_formula_and_zigzag_balanced(P):
    # contiguous, parts of c = T / P: max / mean = (c^2 (P-1) + c (c+1) / 2) / (T (T+1) / (2P))
    #                                             = (2 c P - c + 1) / (P c + 1) -> (2P - 1) / P
    T = 2 * P * 8  # zigzag's 2P chunks: 8 positions each
    c = T // P
    work = pairs_per_rank(T, P, "contiguous")
    assert Fraction(max(work) * P, sum(work)) == Fraction(2 * c * P - c + 1, P * c + 1)
    assert imbalance(work) == pytest.approx((2 * c * P - c + 1) / (P * c + 1), rel=1e-15)
    assert imbalance(pairs_per_rank(2 * P * 10**4, P)) == pytest.approx((2 * P - 1) / P, abs=1e-4)
    assert imbalance(pairs_per_rank(T, P, "zigzag")) == 1.0
    # Uneven lengths: zigzag is off balance by about a chunk's extra position, no more
    for T in (2 * P * 1000 + 1, 2 * P * 1000 + P + 1):
        assert imbalance(pairs_per_rank(T, P, "zigzag")) < 1.001
        assert imbalance(pairs_per_rank(T, P, "contiguous")) > (2 * P - 1) / P - 0.001


def test_uneven_zigzag_work_by_hand():
    # T = 35, P = 2: chunks 9 9 9 8. Process 0: positions 0..8 and 27..34, (1 + ... + 9) +
    # (28 + ... + 35) = 45 + 252; process 1: 9..26, 10 + ... + 27 = 333
    assert pairs_per_rank(35, 2, "zigzag") == [297, 333]
    assert imbalance([297, 333]) == pytest.approx(666 / 630)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("T", "P"), [(13, 4), (11, 3), (9, 2), (6, 4)])
def test_pairs_formula_counts_the_dense_mask(layout, T, P):
    keep = torch.ones(T, T, dtype=torch.bool).tril()  # key <= query
    counted = [int(keep[sequence_positions(T, P, r, layout)].sum()) for r in range(P)]
    assert pairs_per_rank(T, P, layout) == counted


# ---------------------------------------------------------------------------
# The bytes formula, the merge rule and the reference


def test_ring_bytes_by_hand():
    # B = 2, T = 16, H_kv = 2, d = 5, P = 4, float32: K and V, 3 hops of 4 positions
    forward = 2 * 3 * 4 * 2 * 2 * 5 * 4
    assert forward == 1920
    assert ring_bytes(2, 16, 2, 5, 4, bytes_per_element=4) == forward
    # backward: K and V again, and dK, dV in float32 over 4 hops of 4 positions (all 16)
    assert ring_bytes(2, 16, 2, 5, 4, bytes_per_element=4, backward=True) == 1920 + 2560
    # 2 (P - 1) / P T H_kv d b, Llama-3-8B-like: T = 128k, 8 k/v heads, d = 128, bf16, P = 8
    assert ring_bytes(1, 131072, 8, 128, 8) == 2 * 7 / 8 * 131072 * 8 * 128 * 2
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        ring_bytes(1, 8, 1, 4, 0)


def test_merge_parts_is_the_flash_merge_rule():
    rng = np.random.default_rng(0)
    outs = rng.standard_normal((2, 3, 5, 4))  # (S = 2 parts, H, T_q, d)
    lse = rng.standard_normal((2, 3, 5)) * 3
    lse[0, 0, 1] = -np.inf  # part 0 saw no key for this query
    lse[:, 1, 2] = -np.inf  # neither part did
    expected_out, expected_lse = merge_partials(outs, lse)
    t = torch.from_numpy
    out, merged = merge_parts(t(outs[0]), t(lse[0]), t(outs[1]), t(lse[1]))
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=0, atol=1e-14)
    np.testing.assert_allclose(merged.numpy(), expected_lse, rtol=0, atol=1e-14)
    assert merged[1, 2] == -math.inf and not out.isnan().any()


@pytest.mark.parametrize("causal", [False, True])
def test_dense_reference_equals_torch_sdpa(causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 9, 5, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(
        dense_attention(q, k, v, causal=causal), expected, rtol=0, atol=1e-14
    )


# ---------------------------------------------------------------------------
# Errors, in one process (checked before any message is sent)


def test_bad_inputs_raise_errors_naming_the_argument():
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"layout must be one of 'contiguous', 'zigzag'"):
        ring_attention(q, k, k, layout="ring")
    with pytest.raises(ValueError, match=r"H_kv that divides q's H, got H = 4 and H_kv = 3"):
        ring_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))
    with pytest.raises(TypeError, match=r"q, k and v must have one dtype.*float64"):
        ring_attention(q, k, k.double())
    with pytest.raises(ValueError, match=r"q, k and v must be on one device, got cpu, cpu, meta"):
        ring_attention(q, k, k.to("meta"))
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T, d_k\), got shape \(4, 6"):
        ring_attention(q[0], k, k)
    with pytest.raises(ValueError, match=r"q and k must have the same batch B, positions T"):
        ring_attention(q, k[:, :, :5], k[:, :, :5])
    with pytest.raises(
        TypeError, match="q must be a floating-point tensor, got dtype torch.int64"
    ):
        ring_attention(q.long(), k, k)


def test_no_process_group_is_a_clear_error():
    assert not torch.distributed.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="needs a torch.distributed process group.*none is"):
        ring_attention(q, q, q)


def test_one_process_ring_is_dense_attention(tmp_path):
    """P = 1: no message, the local blocks and the causal mask alone."""
    dist = torch.distributed
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(2, 4, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(2, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2)
        )
        grad_out = torch.randn(2, 4, 7, 3, generator=gen, dtype=torch.float64)
        ring_attention(q, k, v, causal=True, layout="zigzag").backward(grad_out)
        ring_grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        expected = dense_attention(q, k, v, causal=True)
        expected.backward(grad_out)
        for ours, theirs in zip(ring_grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Real processes: one launch of 4, rings of 4, 3 and 2 inside it

FOUR, THREE, TWO = None, [[0, 1, 2]], [[0, 2], [1, 3]]  # rank 3 idles in THREE


def case(name, rings=FOUR, dtype="float64", batch=2, seq_len=13, heads=4, kv_heads=2,
         head_dim=5, causal=True, layout="zigzag", **extra):  # fmt: skip
    return dict(name=name, rings=rings, dtype=dtype, batch=batch, seq_len=seq_len, heads=heads,
                kv_heads=kv_heads, head_dim=head_dim, causal=causal, layout=layout,
                seed=len(name), **extra)  # fmt: skip


PARITY = [
    # P = 4: T = 13 (8 zigzag chunks of 2 and 1), GQA, MQA, float32, bfloat16
    case("p4-f64-causal-zigzag-gqa-T13"),
    case("p4-f64-causal-contiguous-gqa-T13", layout="contiguous"),
    case("p4-f64-full-contiguous-mqa-T13", kv_heads=1, causal=False, layout="contiguous"),
    case("p4-f64-full-zigzag-T10", seq_len=10, heads=2, kv_heads=2, head_dim=3, causal=False),
    case("p4-f32-causal-zigzag-gqa-T16", dtype="float32", seq_len=16),
    case(
        "p4-f32-causal-contiguous-T14",
        dtype="float32",
        seq_len=14,
        heads=3,
        kv_heads=3,
        head_dim=7,
        layout="contiguous",
    ),  # fmt: skip
    case("p4-bf16-causal-zigzag-gqa-T16", dtype="bfloat16", seq_len=16, head_dim=8),
    case(
        "p4-f64-causal-contiguous-T64",
        batch=1,
        seq_len=64,
        heads=1,
        kv_heads=1,
        head_dim=2,
        layout="contiguous",
    ),  # fmt: skip
    case("p4-f64-causal-zigzag-T64", batch=1, seq_len=64, heads=1, kv_heads=1, head_dim=2),
    # P = 3 (ranks 0, 1, 2): T = 11, 7, 8
    case("p3-f64-causal-zigzag-gqa-T11", THREE, seq_len=11),
    case("p3-f64-causal-contiguous-gqa-T11", THREE, seq_len=11, layout="contiguous"),
    case(
        "p3-f32-full-contiguous-mqa-T7",
        THREE,
        "float32",
        seq_len=7,
        heads=3,
        kv_heads=1,
        head_dim=3,
        causal=False,
        layout="contiguous",
    ),  # fmt: skip
    case("p3-f32-causal-zigzag-gqa-T8", THREE, "float32", seq_len=8, head_dim=6),
    # P = 2 (ranks {0, 2} and {1, 3}: a group's ranks are not the global ones)
    case("p2-f64-causal-zigzag-T9", TWO, seq_len=9, heads=2, kv_heads=2),
    case("p2-f64-causal-contiguous-gqa-T9", TWO, seq_len=9, layout="contiguous"),
    case(
        "p2-f32-full-contiguous-mqa-T5",
        TWO,
        "float32",
        seq_len=5,
        heads=3,
        kv_heads=1,
        head_dim=3,
        causal=False,
        layout="contiguous",
    ),  # fmt: skip
    case("p2-f32-causal-zigzag-gqa-T12", TWO, "float32", seq_len=12, head_dim=4),
    case(
        "p2-bf16-full-contiguous-gqa-T9",
        TWO,
        "bfloat16",
        seq_len=9,
        causal=False,
        layout="contiguous",
    ),  # fmt: skip
]
TORCH_CP = [
    case(
        "p4-f32-torch-cp-T16",
        dtype="float32",
        seq_len=16,
        heads=2,
        kv_heads=2,
        head_dim=8,
        torch_cp=True,
    ),  # fmt: skip
    case(
        "p2-f32-torch-cp-T12",
        TWO,
        "float32",
        seq_len=12,
        heads=3,
        kv_heads=3,
        head_dim=4,
        torch_cp=True,
    ),  # fmt: skip
]
ERRORS = [
    case("error-kv-heads", odd_rank=1),  # rank 1's k and v: one key/value head
    case("error-layout", seq_len=6, shard_layout="contiguous"),  # 2 2 1 1, not 1 1 2 2
]
NAMES = {c["name"]: c for c in PARITY + TORCH_CP + ERRORS}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    """Each case's results: per ring, one per process in ring order."""
    cases = list(NAMES.values())
    config = {"job": "ring", "device": "cpu", "timeout": LAUNCH_TIMEOUT, "cases": cases}
    ranks, _ = launch(4, config, timeout=LAUNCH_TIMEOUT)
    return {
        spec["name"]: [
            [ranks[g]["cases"][i] for g in ring] for ring in spec["rings"] or [[0, 1, 2, 3]]
        ]
        for i, spec in enumerate(cases)
    }


def tolerance(run: dict, dtype: str) -> tuple[float, float]:
    if dtype == "bfloat16":  # within twice PyTorch's own bfloat16 SDPA's error
        return 2 * run["torch_max_abs_diff"][0], 2 * run["torch_max_abs_diff"][1]
    return {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-5)}[dtype]


@pytest.mark.parametrize("name", [c["name"] for c in PARITY + TORCH_CP])
def test_ring_equals_dense_attention_on_one_process(runs, name):
    spec = NAMES[name]
    for ring in runs[name]:
        P = len(ring)
        assert [(run["world"], run["rank"]) for run in ring] == [(P, r) for r in range(P)]
        assert sum(run["local_len"] for run in ring) == spec["seq_len"]
        out_tol, grad_tol = tolerance(ring[0], spec["dtype"])
        for run in ring:
            assert run["max_abs_diff"] <= out_tol, run
            assert run["grad_max_abs_diff"] <= grad_tol, run  # dq, dk and dv


@pytest.mark.parametrize("name", [c["name"] for c in PARITY])
def test_bytes_sent_equal_the_formula(runs, name):
    spec = NAMES[name]
    T, B, H_kv, d = spec["seq_len"], spec["batch"], spec["kv_heads"], spec["head_dim"]
    item = {"float64": 8, "float32": 4, "bfloat16": 2}[spec["dtype"]]
    grad_item = 8 if spec["dtype"] == "float64" else 4  # dK, dV accumulate in float32 or wider
    for ring in runs[name]:
        P = len(ring)
        lengths = [run["local_len"] for run in ring]
        for r, run in enumerate(ring):
            # K and V of every part but the next process's (the one it never passes on)
            forward = 2 * (T - lengths[(r + 1) % P]) * B * H_kv * d * item
            assert run["forward_bytes"] == forward
            assert run["backward_bytes"] == forward + 2 * T * B * H_kv * d * grad_item
        # the mean over processes: the sum over r of T - n_(r+1) is (P - 1) T
        formula = ring_bytes(B, T, H_kv, d, P, bytes_per_element=item)
        backward = ring_bytes(B, T, H_kv, d, P, bytes_per_element=item, backward=True,
                              grad_bytes_per_element=grad_item)  # fmt: skip
        assert sum(run["forward_bytes"] for run in ring) / P == pytest.approx(formula, rel=1e-12)
        assert sum(run["backward_bytes"] for run in ring) / P == pytest.approx(backward, rel=1e-12)
        if len(set(lengths)) == 1:  # then every process sends exactly the formula's bytes
            assert all(run["forward_bytes"] == formula for run in ring)


def test_float32_case_sends_the_hand_counted_bytes(runs):
    # B = 2, T = 16, H_kv = 2, d = 5, P = 4, float32: see test_ring_bytes_by_hand
    for run in runs["p4-f32-causal-zigzag-gqa-T16"][0]:
        assert run["forward_bytes"] == 1920 and run["backward_bytes"] == 1920 + 2560


def test_zigzag_balances_the_work_that_contiguous_does_not(runs):
    [contiguous] = runs["p4-f64-causal-contiguous-T64"]
    [zigzag] = runs["p4-f64-causal-zigzag-T64"]
    # pairs the causal mask keeps, counted while the ring ran (hand values: see above)
    assert [r["pairs_unmasked"] for r in contiguous] == [136, 392, 648, 904]
    assert [r["pairs_unmasked"] for r in zigzag] == [520] * 4
    assert imbalance([r["pairs_unmasked"] for r in contiguous]) == pytest.approx(113 / 65)
    # pairs scored: contiguous, process r scores r whole 16 x 16 blocks and its diagonal block;
    # zigzag, 3 blocks of 8 x 8 at home and 2 at each of the 3 other steps: 9 * 64
    assert [r["pairs_computed"] for r in contiguous] == [256, 512, 768, 1024]
    assert [r["pairs_computed"] for r in zigzag] == [576] * 4


@pytest.mark.parametrize("name", [c["name"] for c in PARITY if c["causal"]])
def test_pairs_counted_in_the_ring_equal_the_formula(runs, name):
    spec = NAMES[name]
    for ring in runs[name]:
        counted = [run["pairs_unmasked"] for run in ring]
        assert counted == pairs_per_rank(spec["seq_len"], len(ring), spec["layout"])


@pytest.mark.parametrize("name", [c["name"] for c in TORCH_CP])
def test_pytorch_context_parallel_gives_the_same_result(runs, name):
    """torch.distributed.tensor.experimental.context_parallel: its own split (head-tail, our
    zigzag), rotation and merge; its CPU flash kernel for the blocks."""
    for ring in runs[name]:
        for run in ring:
            assert run["torch_cp_vs_ring"] < 1e-5  # output and dq, dk, dv, float32
            assert run["torch_cp_vs_dense"] < 1e-5


def test_processes_that_disagree_raise_the_same_error_on_every_process(runs):
    [kv] = runs["error-kv-heads"]
    for run in kv:
        assert run["error"] == (
            "every process must pass q, k, v with the same H_kv: process 0 has 2, process 1 has 1"
        )
    [layout] = runs["error-layout"]
    for run in layout:
        assert run["error"].startswith(
            "process 0 must hold 1 positions for layout 'zigzag' (T = 6 over 4 processes"
        )
        assert run["error"].endswith("got T_r = 2")


# ---------------------------------------------------------------------------
# python -m mha.parallel --ring


def cli(*args: str, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mha.parallel", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_runs_ring_attention_on_cpu_processes():
    result = cli("--ring", "--nproc", "3", "--causal", "--layout", "zigzag", "--dtype",
                 "float32", "--seq-len", "13", "--heads", "4", "--kv-heads", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["ok"] is True and summary["nproc"] == 3 and summary["layout"] == "zigzag"
    assert summary["max_abs_diff"] < 1e-5 and summary["grad_max_abs_diff"] < 1e-5
    # 6 chunks of 13: 3 2 2 2 2 2; process 0 holds chunks 0 and 5 (5 positions), 1: 1 and 4
    assert summary["local_len"] == [5, 4, 4]
    # each sends T - n_(r+1) positions of K and V: 9, 9, 8; B = 2, H_kv = 2, d = 32 / 4, 4 bytes
    assert summary["forward_bytes"] == [9 * 256, 9 * 256, 8 * 256]
    assert summary["bytes_formula"] == pytest.approx(2 * 2 / 3 * 13 * 2 * 2 * 8 * 4)
    assert "nccl" in summary["on_gpus"] and "one GPU per process" in summary["on_gpus"]


def test_cli_refuses_bad_ring_arguments_before_starting_processes():
    result = cli("--ring", "--nproc", "3", "--seq-len", "2", timeout=60)
    assert result.returncode == 2
    assert "ValueError: seq_len must be at least nproc (3), got 2" in result.stderr
    result = cli("--check", "--dtype", "bfloat16", timeout=60)  # bfloat16: --ring only
    assert result.returncode == 2
    assert "dtype must be one of 'float32', 'float64', got 'bfloat16'" in result.stderr

"""Tests of ``python -m mha.kernels --inspect``: the kernels compiled ahead of time for GPUs.

No GPU is needed: Triton compiles for a named target. The expectations are derived from NVIDIA's
documentation, not from the tool's output: an sm_80 cubin's float16 products are ``HMMA.16816``
instructions (the m16n8k16 shape of ``mma.sync`` on compute capability 8.x), sm_90's are
warpgroup ``HGMMA.64xN`` instructions (``wgmma`` with M = 64); a cubin is an ELF file; a
program's shared memory is at most 163 KB (8.0) and 227 KB (9.0); a thread has at most 255
registers. The subset compiled here (two builds) is bounded in time; the committed results of
the full command (``benchmarks/kernels_*.json``) are checked against the code's default tiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mha import kernels

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "mha.kernels", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        check=False,
        cwd=ROOT,
    )


def test_help_lists_the_options() -> None:
    completed = _run("--help", timeout=120)
    assert completed.returncode == 0, completed.stderr
    for option in (
        "--inspect", "--arch", "--mask", "--key-start", "--window", "--cubin-dir", "--output"
    ):  # fmt: skip
        assert option in completed.stdout


def test_bad_arguments_are_refused_with_a_reason() -> None:
    completed = _run(timeout=120)
    assert completed.returncode == 2 and "nothing to do: pass --inspect" in completed.stderr
    completed = _run("--inspect", "--arch", "sm_70", timeout=120)
    assert completed.returncode == 2 and "arch must be among sm_80, sm_90" in completed.stderr
    completed = _run("--inspect", "--head-dim", "300", timeout=120)
    assert completed.returncode == 2 and "between 1 and 256" in completed.stderr
    completed = _run("--inspect", "--mask", "sliding", timeout=120)
    assert completed.returncode == 2 and "mask must be among causal, full" in completed.stderr


def test_forward_kernel_compiles_for_a100_and_h100(tmp_path: Path) -> None:
    # Eight builds, from a process that imported mha.kernels for the interpreter (the command
    # starts a compiling process itself): float16, d_k = 96 and 128, causal and full, sm_80 and
    # sm_90.
    start = time.perf_counter()
    completed = _run(
        "--inspect", "--arch", "sm_80,sm_90", "--dtype", "float16", "--head-dim", "96,128",
        "--kernel", "forward", "--mask", "causal,full", "--cubin-dir", str(tmp_path),
        "--output", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert time.perf_counter() - start < 240
    rows = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [(row["kernel"], row["arch"], row["head_dim"], row["causal"]) for row in rows] == [
        ("forward", arch, d_k, causal)
        for arch in ("sm_80", "sm_90")
        for d_k in (96, 128)
        for causal in (True, False)
    ]
    assert len({row["cubin"] for row in rows}) == len(rows)  # one file per build
    for row in rows:
        assert row["spill_bytes"] == 0 and row["stack_bytes"] == 0, row
        assert 0 < row["registers"] <= 255 and 0 < row["shared_bytes"] <= LIMITS[row["arch"]]
        assert row["tensor_core_instructions"] == row["hmma"] + row["hgmma"] > 0
        cubin = tmp_path / row["cubin"]
        assert cubin.read_bytes()[:4] == b"\x7fELF"
        sass = _sass(cubin)
        assert f"code for {row['arch']}" in sass  # sm_90: "sm_90a"
        # The forward's two products per key tile, Q K^T (B_q x d x B_k) and P V (B_q x B_k x
        # d), d = 128 (96 is padded to 128), B_q = 128, B_k = 64, 8 warps (the default tiles).
        d, b_q, b_k, warps = 128, row["block_q"], row["block_k"], row["num_warps"]
        assert (b_q, b_k, warps) == (128, 64, 8)
        if row["arch"] == "sm_80":
            # mma.sync m16n8k16: each warp owns b_q / warps = 16 query rows; Q K^T is
            # (b_k / 8) x (d / 16) instructions, P V (d / 8) x (b_k / 16).
            expected = (b_k // 8) * (d // 16) + (d // 8) * (b_k // 16)
            assert sass.count("HMMA.16816.F32") == row["hmma"] == expected == 128
            assert row["hgmma"] == row["hgmma_a_regs"] == row["hgmma_a_smem"] == 0
        else:
            # wgmma m64nNk16, one per k-step of 16: Q K^T (N = b_k) reads Q and K from shared
            # memory, d / 16 = 8 of them; P V (N = d) reads P from registers, b_k / 16 = 4.
            assert sass.count(f"HGMMA.64x{b_k}x16.F32") == row["hgmma_a_smem"] == d // 16
            assert sass.count(f"HGMMA.64x{d}x16.F32") == row["hgmma_a_regs"] == b_k // 16
            assert row["hgmma"] == sass.count("HGMMA.") == 12 and row["hmma"] == 0
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["builds"] == rows
    assert written["environment"]["triton_version"] == _triton_version()


def test_tensor_core_counts_read_where_hgmma_takes_a() -> None:
    # Lines of cuobjdump -sass of the sm_90 float16 forward (d_k = 128): the first two take A
    # and B from shared memory (one descriptor pair), the third takes A from registers.
    from mha.kernels.aot import tensor_core_counts

    code = """
        /*1c00*/  HGMMA.64x64x16.F32 R88, gdesc[UR12], RZ, !UPT ;   /* 0x00e000000c5879f0 */
        /*1c50*/  HGMMA.64x64x16.F32 R88, gdesc[UR12], R88 ;        /* 0x00e000000c5879f0 */
        /*3fc0*/  HGMMA.64x128x16.F32 R24, R120, gdesc[UR12].tnspB, R24 ;  /* 0x41e0000c78187df0 */
        /*0a10*/  HMMA.16816.F32 R24, R4, R8, R24 ;                 /* 0x000000080418723c */
    """
    assert tensor_core_counts(code) == {
        "tensor_core_instructions": 4,
        "hmma": 1,
        "hgmma": 3,
        "hgmma_a_regs": 1,
        "hgmma_a_smem": 2,
    }


def _sass(cubin: Path) -> str:
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return done.stdout


def _triton_version() -> str:
    import triton

    return triton.__version__


KERNEL_NAMES = ("forward", "backward_dk_dv", "backward_dq", "split_kv", "paged")


def _committed() -> dict:
    files = sorted((ROOT / "benchmarks").glob("kernels_2*.json"))
    assert files, "no committed results of python -m mha.kernels --inspect"
    return json.loads(files[-1].read_text())


def test_committed_inspection_covers_every_build_without_spills() -> None:
    result = _committed()
    rows = result["builds"]
    builds = {(r["kernel"], r["arch"], r["dtype"], r["head_dim"], r["causal"]) for r in rows}
    # kernels x GPUs x dtypes x head sizes x masks, and the paged kernel (causal by its lengths)
    assert len(builds) == len(rows) == 4 * 2 * 3 * 6 * 2 + 2 * 3 * 6
    assert {row["kernel"] for row in rows} == {
        "forward", "backward_dk_dv", "backward_dq", "split_kv", "paged"
    }  # fmt: skip
    assert {row["head_dim"] for row in rows} == {64, 80, 96, 128, 192, 256}
    assert {row["causal"] for row in rows} == {True, False}
    assert all(row["causal"] for row in rows if row["kernel"] == "paged")
    assert not any(row["key_start"] for row in rows)  # key padding: its own file, below
    for row in rows:
        assert row["spill_bytes"] == 0 and row["stack_bytes"] == 0, row
        assert row["tensor_core_instructions"] == row["hmma"] + row["hgmma"], row
        assert row["hgmma"] == row["hgmma_a_regs"] + row["hgmma_a_smem"], row
        if row["arch"] == "sm_80":  # mma.sync only: warpgroup products are sm_90's
            assert row["hgmma"] == 0, row
        assert row["shared_bytes"] <= LIMITS[row["arch"]], row
        if row["arch"] == "sm_80":  # its tiles serve sm_86 and sm_89 too: 99 KB a program
            assert row["shared_bytes"] <= 99 * 1024, row
        if row["dtype"] != "float32":  # float32 products in full float32: no tensor cores
            assert row["tensor_core_instructions"] > 0, row
        else:
            assert row["tensor_core_instructions"] == 0, row
    environment = result["environment"]
    assert environment["git_commit"] and environment["date_utc"]
    assert result["command"].startswith("python -m mha.kernels --inspect")


def test_committed_inspection_used_the_default_tiles() -> None:
    import torch
    from mha.kernels.tiles import default_tiles

    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    capability = {"sm_80": (8, 0), "sm_90": (9, 0)}
    for row in _committed()["builds"]:
        tiles = default_tiles(
            row["kernel"], row["head_dim"], dtypes[row["dtype"]], capability[row["arch"]]
        )
        assert (row["block_q"], row["block_k"], row["num_warps"], row["num_stages"]) == (
            tiles.block_q,
            tiles.block_k,
            tiles.num_warps,
            tiles.num_stages,
        ), row


def test_committed_inspection_with_key_starts_has_no_spills() -> None:
    # The same builds with per-row key starts (python -m mha.kernels --inspect --key-start), the
    # paged kernel's included: the key padding of left-padded batches must not make any build
    # spill either.
    files = sorted((ROOT / "benchmarks").glob("kernels_key_start_2*.json"))
    assert files, "no committed results of python -m mha.kernels --inspect --key-start"
    result = json.loads(files[-1].read_text())
    rows = result["builds"]
    assert len(rows) == 4 * 2 * 3 * 6 * 2 + 2 * 3 * 6 and all(row["key_start"] for row in rows)
    builds = {(r["kernel"], r["arch"], r["dtype"], r["head_dim"], r["causal"]) for r in rows}
    assert len(builds) == len(rows)
    paged = [row for row in rows if row["kernel"] == "paged"]
    assert len(paged) == 2 * 3 * 6 and all(row["causal"] for row in paged)
    for row in rows:
        assert row["spill_bytes"] == 0 and row["stack_bytes"] == 0, row
        assert row["shared_bytes"] <= LIMITS[row["arch"]], row
    assert result["command"].startswith("python -m mha.kernels --inspect --key-start")
    if "paged_builds" in result:  # the paged kernel's builds, compiled later
        assert result["paged_builds"]["command"].startswith(
            "python -m mha.kernels --inspect --key-start --kernel paged"
        )
        assert result["paged_builds"]["environment"]["git_commit"]


def test_committed_inspection_with_a_window_has_no_spills() -> None:
    # Every kernel with a sliding window (python -m mha.kernels --inspect --window), without key
    # starts (the serving engine's launch) and with them (a left-padded batch, as the model's
    # Mistral path has): 2 GPUs x 3 dtypes x 6 head sizes, causal and not (the paged kernel
    # causal by its lengths). None may spill.
    files = sorted((ROOT / "benchmarks").glob("kernels_window_2*.json"))
    assert files, "no committed results of python -m mha.kernels --inspect --window"
    result = json.loads(files[-1].read_text())
    rows = result["builds"]
    assert {row["kernel"] for row in rows} == set(KERNEL_NAMES)
    assert all(row["window"] for row in rows)
    assert all(row["causal"] for row in rows if row["kernel"] == "paged")
    builds = {(r["kernel"], r["arch"], r["dtype"], r["head_dim"], r["causal"], r["key_start"])
              for r in rows}  # fmt: skip
    assert len(builds) == len(rows) == (4 * 2 + 1) * 2 * 3 * 6 * 2
    assert sum(row["key_start"] for row in rows) == len(rows) // 2
    spilling = set()
    for row in rows:
        if row["spill_bytes"] or row["stack_bytes"]:
            spilling.add((row["kernel"], row["arch"], row["head_dim"], row["causal"],
                          row["key_start"]))  # fmt: skip
            assert row["dtype"] == "float32" and row["spill_bytes"] <= 56, row
        assert row["shared_bytes"] <= LIMITS[row["arch"]], row
    # The six float32 backward builds that spill with a window, at most 56 bytes (named in
    # benchmarks/README.md, where what would remove them is said): these, and no others.
    assert spilling == {
        ("backward_dq", "sm_80", 80, True, True),
        ("backward_dq", "sm_80", 96, True, True),
        ("backward_dk_dv", "sm_80", 128, False, False),
        ("backward_dk_dv", "sm_90", 64, True, False),
        ("backward_dq", "sm_90", 192, True, True),
        ("backward_dq", "sm_90", 256, True, True),
    }
    assert result["command"].startswith("python -m mha.kernels --inspect --window")
    assert result["environment"]["git_commit"] and not result["environment"]["git_dirty"]


def test_the_window_builds_pass_the_window() -> None:
    # No compiling: the launch's constexprs say what would be compiled in.
    import torch
    from mha.kernels.aot import EXAMPLE_WINDOW, example_launches

    for kernel in ("paged", "forward", "backward_dk_dv", "backward_dq", "split_kv"):
        for key_start in (False, True):
            (launch,) = example_launches(
                kernel, torch.float16, 64, 90, key_start=key_start, window=True
            )
            assert launch.constants["HAS_WINDOW"] is True
            assert launch.constants["window"] == EXAMPLE_WINDOW
            assert launch.constants.get("HAS_KEY_START", False) is key_start
        (launch,) = example_launches(kernel, torch.float16, 64, 90, key_start=True)
        assert "HAS_WINDOW" not in launch.constants and "window" not in launch.constants


def test_committed_ladder_shows_what_each_technique_changes() -> None:
    # python -m mha.kernels --inspect --ladder: every rung of the forward and split-KV kernels
    # (sm_90, bfloat16, d_k 64 and 128, causal and not), at the default tiles, none spilling.
    # What each rung must change follows from the technique itself, not from a former run:
    # exp2 with the scale folded makes one multiply-add of "times the scale, minus the maximum"
    # (more FFMA, fewer FMUL and FADD) and no exponential more; masks at the edges only add a
    # second copy of the loop's body (twice the exponentials and tensor-core products in the
    # code, which still runs each tile once). Warp specialisation (the forward kernel) folds
    # the loops back into one, every load through the copy engine, on 4 warps that Triton joins
    # with warps of its own, each group with its register budget (USETMAXREG): one tile's
    # exponentials and products shared by 4 warps, where the exp2 rung shares them by its own.
    # The schedule's rungs change which tiles a program computes, not how: the loop's body, its
    # exponentials and tensor-core products, as the rung below's (the persistent rung: as the
    # TMA rung's, as it cannot keep warp specialisation). Persistence keeps a loop over items
    # live around that body: its registers are reported as they come (at d_k 64 causal it
    # reaches the 255 a thread may have and spills); every other build must not spill.
    from mha.kernels.tiles import LADDER

    files = sorted((ROOT / "benchmarks").glob("kernels_ladder_2*.json"))
    assert files, "no committed results of python -m mha.kernels --inspect --ladder"
    result = json.loads(files[-1].read_text())
    assert result["command"].startswith("python -m mha.kernels --inspect --ladder")
    rows = result["builds"]
    rungs = [name for name, _ in LADDER]
    split_kv_rungs = [name for name, t in LADDER if t.runs_in("split_kv")]
    assert split_kv_rungs == rungs[:4]
    by = {(r["kernel"], r["head_dim"], r["causal"], r["rung"]): r for r in rows}
    assert len(by) == len(rows) == 2 * 2 * (len(rungs) + len(split_kv_rungs))
    for (kernel, d, causal, rung), row in by.items():
        assert row["arch"] == "sm_90" and row["dtype"] == "bfloat16", row
        assert row["registers"] <= 255, row
        if rung != "persistent, balanced" or row["registers"] < 255:
            assert row["spill_bytes"] == 0, row
        assert row["techniques"] == [
            name for name, on in vars(dict(LADDER)[rung]).items() if on
        ], row  # fmt: skip
        first, exp2, edges, tma = (by[kernel, d, causal, name] for name in rungs[:4])
        counts = ("MUFU.EX2", "tensor_core_instructions", "UTMALDG", "LDGSTS", "USETMAXREG")
        if kernel == "forward":
            specialized, costliest, persistent = (
                by[kernel, d, causal, name] for name in rungs[4:]
            )  # fmt: skip
            assert specialized["num_warps"] == 4 < specialized["compiled_warps"]
            assert specialized["USETMAXREG"] > 0 and specialized["UTMALDG"] > 0
            assert specialized["LDGSTS"] == 0
            for count in ("MUFU.EX2", "tensor_core_instructions"):
                assert specialized[count] * 4 == exp2[count] * exp2["num_warps"], count
            for count in counts:
                assert costliest[count] == specialized[count], count
                assert persistent[count] == tma[count], count
        for built in first, exp2, edges, tma:  # no group of warps of their own
            assert built["USETMAXREG"] == 0 and built["compiled_warps"] == built["num_warps"]
        assert exp2["FFMA"] > first["FFMA"] and exp2["FMUL"] < first["FMUL"], (first, exp2)
        assert exp2["FADD"] < first["FADD"] and exp2["MUFU.EX2"] == first["MUFU.EX2"]
        assert exp2["instructions"] < first["instructions"]
        # tl.exp: ex2.approx.f32 after a multiply; tl.exp2: ex2.approx.ftz.f32 (PTX ISA)
        assert first["ptx_ex2"] == first["MUFU.EX2"] and first["ptx_ex2_ftz"] == 0
        assert exp2["ptx_ex2_ftz"] == exp2["MUFU.EX2"] and exp2["ptx_ex2"] == 0
        assert edges["MUFU.EX2"] == 2 * exp2["MUFU.EX2"]
        assert edges["tensor_core_instructions"] == 2 * exp2["tensor_core_instructions"]
        # TMA: the unmasked tiles' copies made by the copy engine, not by the threads
        assert edges["UTMALDG"] == 0 < edges["LDGSTS"] and tma["UTMALDG"] > 0 == tma["LDGSTS"]
        assert tma["MUFU.EX2"] == edges["MUFU.EX2"]


def test_the_ladder_option_compiles_each_rung() -> None:
    completed = _run("--inspect", "--ladder", "--head-dim", "64", "--kernel", "split_kv",
                     "--mask", "full")  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    rows = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [row["rung"] for row in rows] == ["first kernel", "exp2, scale folded",
                                             "masks at the edges only", "TMA loads"]  # fmt: skip
    assert all(row["arch"] == "sm_90" and row["dtype"] == "bfloat16" for row in rows)
    assert [row["techniques"] for row in rows] == [
        [], ["exp2"], ["exp2", "edge_masks"], ["exp2", "edge_masks", "tma"]
    ]  # fmt: skip
    assert all(row["instructions"] > row["MUFU.EX2"] > 0 for row in rows)

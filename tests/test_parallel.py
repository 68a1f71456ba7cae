"""mha.parallel: multi-head attention split by heads across processes.

Two kinds of test:

* in one process, the split's arithmetic: process r's heads give a share of the output, and the
  shares plus the output bias are the whole layer's output (what the all-reduce sums); each
  share's weight gradients are the whole layer's gradients cut by hand into r's rows and columns;
* real processes (``python -m mha.parallel``, 2 ranks, gloo on the loopback address, every
  launch under a timeout): parity with the single-process layer in forward and gradients, one
  all-reduce of B*T*D numbers per forward, a failing or hung rank ending the run with its error,
  no process left behind, and bad splits refused before any process starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mha.parallel.launch
import pytest
import torch
from mha import MultiHeadAttention, counting
from mha.decoding import GroupedQueryAttention
from mha.parallel import (
    CollectiveCounter,
    HeadShard,
    kv_heads,
    parallelize_heads,
    query_heads,
    run_check,
    saved_tensor_bytes,
    shard_heads,
    unfuse,
)

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 120  # seconds: no launch in this file may take longer
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randomised(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights and biases (torch's zero biases would hide a bias bug), float64."""
    gen = torch.Generator().manual_seed(seed)
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return layer


def mha_layer(D=16, H=4) -> MultiHeadAttention:
    return randomised(MultiHeadAttention(D, H, batch_first=True))


def gqa_layer(D=16, H=4, H_kv=2) -> GroupedQueryAttention:
    return randomised(GroupedQueryAttention(D, H, H_kv, bias=True))


def inputs(B=2, T=5, D=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    return x, torch.randn(B, T, D, generator=gen, dtype=torch.float64)


def whole(layer, x, causal):
    if isinstance(layer, MultiHeadAttention):
        return layer(x, x, x, need_weights=False, is_causal=causal)[0]
    return layer(x, is_causal=causal)


# ---------------------------------------------------------------------------
# Which heads a process owns: values derived by hand


def test_query_heads_are_consecutive_blocks():
    assert list(query_heads(8, 0, 4)) == [0, 1]
    assert list(query_heads(8, 3, 4)) == [6, 7]
    assert list(query_heads(4, 1, 1 + 1)) == [2, 3]


@pytest.mark.parametrize(
    ("H_kv", "H", "N", "expected"),
    [
        (4, 8, 2, [[0, 1], [2, 3]]),  # G = 2: query heads 0-3 read k/v heads 0, 1
        (2, 8, 2, [[0], [1]]),  # one group per process
        (2, 8, 4, [[0], [0], [1], [1]]),  # fewer k/v heads than processes: replicated
        (1, 4, 2, [[0], [0]]),  # multi-query attention: every process holds the one head
    ],
)
def test_kv_heads_follow_their_query_groups(H_kv, H, N, expected):
    assert [list(kv_heads(H_kv, H, r, N)) for r in range(N)] == expected


# ---------------------------------------------------------------------------
# The split's arithmetic in one process


@pytest.mark.parametrize("causal", [False, True])
def test_unfused_layer_equals_multi_head_attention(causal):
    layer = mha_layer()
    x, _ = inputs()
    torch.testing.assert_close(
        unfuse(layer)(x, is_causal=causal), whole(layer, x, causal), rtol=0, atol=1e-12
    )


def test_unfused_layer_equals_grouped_query_attention_with_rope():
    layer = gqa_layer(H_kv=2)
    x, _ = inputs(T=7)
    ours = unfuse(layer)
    assert ours.rope_base == layer.rope_base == 10000.0
    torch.testing.assert_close(ours(x, is_causal=True), layer(x), rtol=0, atol=1e-12)


def expected_gradients(layer, rank, N):
    """The whole layer's gradients cut by hand: rows of W_Q, W_K, W_V, columns of W_O."""
    D, H = layer.embed_dim, layer.num_heads
    d_k = D // H
    q_rows = slice(rank * D // N, (rank + 1) * D // N)
    if isinstance(layer, MultiHeadAttention):
        w = dict(zip("qkv", layer.in_proj_weight.grad.split(D)))
        b = dict(zip("qkv", layer.in_proj_bias.grad.split(D)))
        w["o"], b["o"] = layer.out_proj.weight.grad, layer.out_proj.bias.grad
        kv_rows = q_rows
    else:
        w = {n: getattr(layer, f"{n}_proj").weight.grad for n in "qkvo"}
        b = {n: getattr(layer, f"{n}_proj").bias.grad for n in "qkvo"}
        H_kv = layer.num_kv_heads
        if H_kv >= N:
            kv_rows = slice(rank * H_kv * d_k // N, (rank + 1) * H_kv * d_k // N)
        else:  # the k/v head of this process's query group
            head = rank * H_kv // N
            kv_rows = slice(head * d_k, (head + 1) * d_k)
    out = {"o_proj.weight": w["o"][:, q_rows], "o_proj.bias": b["o"]}
    for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        out[f"{n}_proj.weight"], out[f"{n}_proj.bias"] = w[n][rows], b[n][rows]
    return out


CASES = [
    pytest.param(lambda: mha_layer(), 2, id="MHA-N2"),
    pytest.param(lambda: mha_layer(D=32, H=8), 4, id="MHA-N4"),
    pytest.param(lambda: gqa_layer(H_kv=4), 2, id="GQA-Hkv4-N2"),
    pytest.param(lambda: gqa_layer(H_kv=2), 2, id="GQA-Hkv2-N2"),
    pytest.param(lambda: gqa_layer(H_kv=1), 2, id="MQA-N2-replicated"),
    pytest.param(lambda: gqa_layer(D=32, H=8, H_kv=2), 4, id="GQA-Hkv2-N4-replicated"),
]


@pytest.mark.parametrize(("make", "N"), CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_shares_sum_to_the_whole_layer_and_its_gradients(make, N, causal):
    layer = make()
    x, grad_out = inputs(D=layer.embed_dim)
    x_whole = x.clone().requires_grad_()
    whole(layer, x_whole, causal).backward(grad_out)
    shards = [shard_heads(layer, r, N) for r in range(N)]
    x_split = x.clone().requires_grad_()
    partials = [s.partial_output(x_split, is_causal=causal) for s in shards]
    output = sum(partials) + shards[0].o_proj.bias  # what the all-reduce sums, plus the bias
    torch.testing.assert_close(output, whole(layer, x, causal), rtol=0, atol=1e-12)

    output.backward(grad_out)
    torch.testing.assert_close(x_split.grad, x_whole.grad, rtol=0, atol=1e-12)
    replicas = max(1, N // getattr(layer, "num_kv_heads", layer.num_heads))
    assert all(s.kv_replicas == replicas for s in shards)
    for r, shard in enumerate(shards):
        grads = {n: p.grad for n, p in shard.named_parameters()}
        for name, grad in expected_gradients(layer, r, N).items():
            if name == "o_proj.bias":
                continue  # added once, after the sum: its gradient is checked below
            if name.startswith(("k_proj", "v_proj")) and replicas > 1:
                first = r - r % replicas  # sum over the processes holding this k/v head
                grads[name] = sum(
                    dict(shards[q].named_parameters())[name].grad
                    for q in range(first, first + replicas)
                )
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(
        shards[0].o_proj.bias.grad, expected_gradients(layer, 0, N)["o_proj.bias"]
    )


def test_shard_holds_its_rows_and_columns():
    layer = mha_layer(D=16, H=4)
    shard = shard_heads(layer, 1, 2)
    assert isinstance(shard, HeadShard)
    assert shard.num_heads == 2 and shard.head_dim == 4
    w_q, w_k, w_v = layer.in_proj_weight.split(16)
    assert torch.equal(shard.q_proj.weight, w_q[8:16])  # heads 2 and 3: features 8..15
    assert torch.equal(shard.v_proj.weight, w_v[8:16])
    assert torch.equal(shard.o_proj.weight, layer.out_proj.weight[:, 8:16])
    assert shard.q_proj.weight.data_ptr() != w_q.data_ptr()  # copies, not views
    params = sum(p.numel() for p in shard.parameters())
    assert params == 4 * 16 * 16 // 2 + 3 * 16 // 2 + 16  # 1/N of W, 1/N of b_qkv, all of b_o


# ---------------------------------------------------------------------------
# Errors, in one process


def test_bad_splits_raise_value_errors():
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be divisible by world_size \(2\)"):
        shard_heads(randomised(MultiHeadAttention(12, 3, batch_first=True)), 0, 2)
    with pytest.raises(ValueError, match="rank must be below world_size"):
        shard_heads(mha_layer(), 2, 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        shard_heads(mha_layer(), 0, 2.0)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must be divisible by world_size"):
        shard_heads(randomised(GroupedQueryAttention(24, 6, 3, bias=True)), 0, 2)
    with pytest.raises(TypeError, match="layer must be an mha.MultiHeadAttention"):
        unfuse(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="self-attention"):
        unfuse(MultiHeadAttention(8, 2, kdim=3))


@pytest.mark.parametrize(
    "layer, refused",
    [
        (lambda: MultiHeadAttention(8, 2, batch_first=True, add_bias_kv=True), "add_bias_kv=True"),
        (lambda: MultiHeadAttention(8, 2, batch_first=True, add_zero_attn=True), "add_zero_attn"),
        (lambda: MultiHeadAttention(8, 2), "batch_first=False"),
        (lambda: MultiHeadAttention(8, 2, batch_first=True, dropout=0.5), "dropout=0.5"),
        (lambda: GroupedQueryAttention(8, 2, 1, window=3), "window=3"),
        (lambda: GroupedQueryAttention(8, 2, 1, sinks=True), "sinks=True"),
        (lambda: GroupedQueryAttention(8, 2, 1, qk_norm_eps=1e-6), "qk_norm_eps"),
        (lambda: GroupedQueryAttention(8, 2, 1, dropout=0.1), "dropout=0.1"),
    ],
)
def test_what_the_split_layer_does_not_implement_is_refused_by_name(layer, refused):
    # each of these changes the layer's output, and the split layer computes none of them
    for split in (unfuse, lambda layer: shard_heads(layer, 0, 2)):
        with pytest.raises(ValueError, match="does not implement: " + re.escape(refused)):
            split(layer())


def test_dtensor_refuses_to_cut_a_key_value_head():
    class Mesh:  # parallelize_heads checks the split before it touches the mesh
        def size(self):
            return 2

    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must be divisible by the mesh"):
        parallelize_heads(unfuse(gqa_layer(H_kv=1)), Mesh())


def test_value_error_before_any_process_starts(monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(mha.parallel.launch.subprocess, "Popen", no_process)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be divisible by nproc \(2\)"):
        run_check(2, embed_dim=12, num_heads=3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must be divisible by nproc"):
        run_check(2, embed_dim=24, num_heads=6, num_kv_heads=3)
    with pytest.raises(TypeError, match="nproc must be an int"):
        run_check("2")


def test_cli_reports_a_bad_split_without_starting_processes():
    result = cli("--nproc", "2", "--check", "--heads", "3", "--embed-dim", "12", timeout=60)
    assert result.returncode == 2
    assert "ValueError: num_heads (3) must be divisible by nproc (2)" in result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------------------
# The measuring tools, in one process


def test_saved_tensor_bytes_counts_what_autograd_keeps():
    a = torch.randn(3, 5, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)
    # a * b keeps a and b for its backward (d(ab)/da = b); the sum keeps nothing
    assert saved_tensor_bytes(lambda: (a * b).sum()) == 2 * 15 * 4
    assert saved_tensor_bytes(lambda: (a * b).sum(), exclude=[a]) == 15 * 4


def test_collective_counter_sees_no_collective_in_plain_code():
    with CollectiveCounter() as counter:
        torch.randn(4, 4) @ torch.randn(4, 4)
    assert counter.calls == [] and counter.count("all_reduce") == 0


# ---------------------------------------------------------------------------
# The formulas of mha.counting, against the real shards and by hand


def test_parameters_per_process_formula_counts_the_real_shard():
    for D, H, N in ((16, 4, 2), (32, 8, 4), (512, 8, 2)):
        shard = shard_heads(MultiHeadAttention(D, H, batch_first=True), 0, N)  # biases
        real = sum(p.numel() for p in shard.parameters())
        assert counting.tensor_parallel_parameters(D, H, N, bias=True) == real
        # The default is GroupedQueryAttention's: no biases.
        shard = shard_heads(GroupedQueryAttention(D, H, H // 2), 0, N)
        real = sum(p.numel() for p in shard.parameters())
        assert counting.tensor_parallel_parameters(D, H, N, num_kv_heads=H // 2) == real
    # by hand: 4 D^2 / N + 3 D / N + D at D = 512, N = 2
    assert counting.tensor_parallel_parameters(512, 8, 2, bias=True) == 524288 + 768 + 512
    assert counting.tensor_parallel_parameters(512, 8, 2) == 524288
    # MQA over 2 processes: W_Q, W_O halves (128 + 128), W_K, W_V one head each (64 + 64)
    gqa_shard = shard_heads(gqa_layer(H_kv=1), 0, 2)
    assert (
        counting.tensor_parallel_parameters(16, 4, 2, num_kv_heads=1, bias=True)
        == 128 * 2 + 64 * 2 + 32
    )
    assert sum(p.numel() for p in gqa_shard.parameters()) == 416


def test_saved_elements_formula_matches_what_autograd_keeps():
    B, T, D, H = 2, 16, 32, 4
    layer = MultiHeadAttention(D, H, batch_first=True)
    x = torch.randn(B, T, D)
    for N in (1, 2, 4):
        shard = shard_heads(layer, 0, N)
        measured = saved_tensor_bytes(
            lambda: shard.partial_output(x.clone().requires_grad_()), exclude=shard.parameters()
        )
        # x (B, T, D) whole; q, k, v and merged heads (B, T, D/N); weights (B, H/N, T, T)
        by_hand = B * T * D + 4 * B * T * D // N + B * (H // N) * T * T
        assert counting.tensor_parallel_saved_elements(B, T, D, H, N) == by_hand
        assert measured == 4 * by_hand


def test_all_reduce_formulas():
    assert counting.all_reduce_bytes(4, 256, 512) == 4 * 256 * 512 * 4 == 2**21
    assert counting.all_reduce_bytes(1, 2048, 12288, 2) == 50331648
    # 2 processes: each sends and receives the buffer once; 8: 2 * 7/8 of it
    assert counting.ring_all_reduce_seconds(10**9, 2, 1e9) == pytest.approx(1.0)
    assert counting.ring_all_reduce_seconds(10**9, 8, 1e9) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="bus_bytes_per_s must be positive"):
        counting.ring_all_reduce_seconds(1, 2, 0.0)
    h100 = next(g for g in counting.PUBLISHED_GPUS if g.name == "H100 SXM")
    assert h100.nvlink_bytes_per_s == 450e9 and h100.pcie_bytes_per_s == 64e9


# ---------------------------------------------------------------------------
# Real processes


def cli(*args: str, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mha.parallel", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def alive(pid: int) -> bool:
    """True if process ``pid`` exists, is not a zombie, and is an mha.parallel worker."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and b"mha.parallel" in cmdline


def worker_pids(stderr: str) -> list[int]:
    line = next(line for line in stderr.splitlines() if "worker pids" in line)
    return json.loads(line.split("worker pids ", 1)[1].split("]", 1)[0] + "]")


B, T, D, H = 2, 5, 16, 4


def check_line(*extra: str) -> dict:
    shape = ("--batch", str(B), "--seq-len", str(T), "--embed-dim", str(D), "--heads", str(H))
    result = cli("--nproc", "2", "--check", "--dtype", "float64", "--causal", *shape, *extra)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON line, nothing else
    summary = json.loads(lines[0])
    assert not any(alive(pid) for pid in summary["pids"])
    return summary


def test_two_processes_equal_one_and_all_reduce_once_per_forward():
    summary = check_line()
    assert summary["ok"] is True
    assert summary["max_abs_diff"] < 1e-12 and summary["grad_max_abs_diff"] < 1e-12
    # Forward: one all-reduce of the (B, T, D) float64 output, per process.
    assert summary["all_reduce_calls"] == 1
    assert summary["bytes_all_reduced"] == B * T * D * 8 == 1280
    for version in ("hand", "dtensor", "dtensor_per_projection"):
        assert summary[version]["forward_collectives"] == ["all_reduce"]
        assert summary[version]["bytes_all_reduced"] == 1280
        assert summary[version]["ranks_agree"] is True
        assert summary[version]["grad_max_abs_diff"] < 1e-12
    # Backward: one all-reduce of dL/dx (B, T, D), by hand and with DTensor when x is made a
    # replicated DTensor once (PrepareModuleInput); when each projection that reads x (q, k,
    # v) makes it one, its gradient is summed three times, 3 all-reduces of the same size.
    for version in ("hand", "dtensor"):
        assert summary[version]["backward_collectives"] == ["all_reduce"]
        assert summary[version]["backward_bytes_all_reduced"] == 1280
    assert summary["dtensor_per_projection"]["backward_collectives"] == ["all_reduce"] * 3


def test_grouped_query_heads_split_with_their_groups():
    summary = check_line("--kv-heads", "2")  # one k/v head and its 2 query heads per process
    assert summary["ok"] is True and summary["num_kv_heads"] == 2
    assert summary["max_abs_diff"] < 1e-12 and summary["grad_max_abs_diff"] < 1e-12
    assert summary["dtensor"]["forward_collectives"] == ["all_reduce"]


def test_fewer_key_value_heads_than_processes_are_replicated():
    summary = check_line("--kv-heads", "1")  # MQA: both processes hold the one k/v head
    assert summary["ok"] is True and summary["num_kv_heads"] == 1
    assert summary["max_abs_diff"] < 1e-12 and summary["grad_max_abs_diff"] < 1e-12
    assert summary["all_reduce_calls"] == 1
    assert summary["dtensor"] is None  # ColwiseParallel would cut the head in two
    assert summary["dtensor_per_projection"] is None


def test_a_failing_rank_ends_the_run_with_its_error():
    start = time.monotonic()
    result = cli("--nproc", "2", "--check", "--fail-rank", "1", "--timeout", "100")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "rank 1 exited with code 1" in result.stderr
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr
    assert elapsed < 60  # ended by the failure, long before the 100 s timeout
    pids = worker_pids(result.stderr)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_a_hung_rank_ends_the_run_at_the_timeout():
    start = time.monotonic()
    result = cli("--nproc", "2", "--check", "--hang-rank", "0", "--timeout", "8")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "timed out after 8 s" in result.stderr
    assert 8 <= elapsed < 8 + 30
    pids = worker_pids(result.stderr)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_workers_die_with_a_killed_launcher():
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mha.parallel", "--nproc", "2", "--check", "--hang-rank", "0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while len(children) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            children = [pid for pid in children_of(launcher.pid) if alive(pid)]
        assert len(children) == 2, "the workers did not start"
        launcher.send_signal(signal.SIGKILL)  # no chance to clean up
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in children)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def children_of(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry))
    return found

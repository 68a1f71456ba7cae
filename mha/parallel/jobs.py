"""What each process does: compare the split layer with the whole, or time it.

Every rank builds the same seeded layer and inputs, so no data has to be sent
before the comparison. :func:`worker_main` is the entry point of a process
started by :func:`mha.parallel.launch.launch`.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..decoding import GroupedQueryAttention
from ..module import MultiHeadAttention
from .collectives import CollectiveCounter, saved_tensor_bytes
from .launch import STORE, die_with_parent
from .layers import parallelize_heads, shard_heads, unfuse
from .ring import (
    RingStats,
    dense_attention,
    ring_attention,
    shard_sequence,
    torch_context_parallel,
)

__all__ = [
    "worker_main",
    "check_rank",
    "bench_rank",
    "ring_rank",
    "make_problem",
]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def worker_main(config: dict[str, Any]) -> None:
    """One rank: join the group, run the job, print its result (JSON)."""
    die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(config.get("threads", 1)))
    device = _device(config["device"], rank)
    store = os.environ.get(STORE)  # unset under torchrun: env:// instead
    # NCCL on GPUs is written but untested: the tests run gloo on CPUs only.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=None if store is None else dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config["timeout"]),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        if rank == config.get("fail_rank"):
            raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank)")
        if rank == config.get("hang_rank"):
            time.sleep(10 * config["timeout"])  # never reaches the collective
        jobs = {"check": check_rank, "bench": bench_rank, "ring": ring_rank}
        job = jobs[config["job"]]
        result = job(rank, world, device, config)
        print(json.dumps({"rank": rank, **result}), flush=True)
    finally:
        dist.destroy_process_group()


def make_problem(config: dict[str, Any], device: torch.device):
    """The seeded layer (random weights *and* biases), input, upstream grad.

    ``config["num_kv_heads"]`` None: a :class:`mha.MultiHeadAttention`;
    otherwise a :class:`mha.GroupedQueryAttention` with rotary positions.
    """
    dtype = DTYPES[config["dtype"]]
    gen = torch.Generator().manual_seed(config["seed"])
    D, H, H_kv = (
        config["embed_dim"],
        config["num_heads"],
        config["num_kv_heads"],
    )
    if H_kv is None:
        layer = MultiHeadAttention(D, H, batch_first=True, dtype=dtype)
    else:
        layer = GroupedQueryAttention(D, H, H_kv, bias=True, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():  # torch's zero biases would hide a bug
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / D**0.5)
    shape = (config["batch"], config["seq_len"], D)  # (B, T, D)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    grad_out = torch.randn(shape, generator=gen, dtype=dtype)
    return layer.to(device), x.to(device), grad_out.to(device)


def reference(layer, x: Tensor, causal: bool) -> Tensor:
    """The single-process layer's output, by its own forward."""
    if isinstance(layer, MultiHeadAttention):
        return layer(x, x, x, need_weights=False, is_causal=causal)[0]
    return layer(x, is_causal=causal)


def check_rank(rank, world, device, config) -> dict[str, Any]:
    """Both split layers against the whole: outputs, gradients, collectives."""
    layer, x, grad_out = make_problem(config, device)
    causal = config["causal"]
    x_ref = x.clone().requires_grad_()
    out_ref = reference(layer, x_ref, causal)
    out_ref.backward(grad_out)
    expected = _expected_gradients(layer, rank, world)

    shard = shard_heads(layer, rank, world)
    hand = _run(shard, x, grad_out, causal)
    if shard.kv_replicas > 1:  # replicas' k, v gradients: shares of one
        _sum_replicated(shard, world)
    result = {"hand": _compare(hand, out_ref, x_ref.grad, expected)}
    if getattr(layer, "num_kv_heads", layer.num_heads) % world:
        result["dtensor"] = None  # ColwiseParallel would cut a k/v head
        result["dtensor_per_projection"] = None
        return result
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    for name, input_once in (
        ("dtensor", True),
        ("dtensor_per_projection", False),
    ):
        full = parallelize_heads(unfuse(layer), mesh, input_once=input_once)
        run = _run(full, x, grad_out, causal)
        result[name] = _compare(run, out_ref, x_ref.grad, expected)
    return result


def bench_rank(rank, world, device, config) -> dict[str, Any]:
    """Time per forward (with communication), all-reduce alone, memory."""
    layer, x, _ = make_problem(config, device)
    shard = shard_heads(layer, rank, world).eval()
    with torch.no_grad(), CollectiveCounter() as counted:
        shard(x)
    buffer = torch.empty_like(x)  # (B, T, D): what the forward all-reduces
    calls = {
        "forward_s": lambda: shard(x),
        "all_reduce_s": lambda: dist.all_reduce(buffer),
    }
    if world == 1:  # the whole layer, without any collective
        whole = unfuse(layer).eval()
        calls["whole_layer_forward_s"] = lambda: whole(x)
    return {
        "all_reduce_calls": counted.count("all_reduce"),
        "bytes_all_reduced": counted.bytes("all_reduce"),
        **_times(calls, device, config),
        "weight_bytes": sum(
            p.numel() * p.element_size() for p in shard.parameters()
        ),
        "activation_bytes": saved_tensor_bytes(
            lambda: shard(x.detach().requires_grad_()),
            exclude=shard.parameters(),
        ),
    }


def ring_rank(rank, world, device, config) -> dict[str, Any]:
    """Ring attention against dense attention on one process, per case.

    A case names its rings (lists of ranks; default: one of every rank),
    shape, dtype, ``causal`` and ``layout``; ``torch_cp``: PyTorch's own
    ring too; ``odd_rank``: that rank passes one key/value head fewer, to
    see the error; ``shard_layout``: the inputs cut by another layout than
    the ring is told. A ``ValueError`` is the case's result, not a failure.
    """
    groups: dict[str, list] = {}
    results = []
    for case in config["cases"]:
        rings = case.get("rings") or [list(range(world))]
        key = json.dumps(rings)
        if key not in groups:  # every rank creates every group, in order
            groups[key] = [
                None if len(r) == world else dist.new_group(r) for r in rings
            ]
        mine = [i for i, ring in enumerate(rings) if rank in ring]
        if not mine:
            results.append({"name": case["name"], "idle": True})
            continue
        ring, group = rings[mine[0]], groups[key][mine[0]]
        P, r = len(ring), ring.index(rank)
        q, k, v, grad_out = _ring_inputs(case, device)
        causal, layout = case["causal"], case["layout"]
        if rank == case.get("odd_rank"):
            k, v = k[:, 1:], v[:, 1:]
        whole = [_float64_leaf(t) for t in (q, k, v)]
        expected = dense_attention(*whole, causal=causal)  # float64
        expected.backward(grad_out.double())
        expected = [expected.detach(), *(t.grad for t in whole)]

        cut = case.get("shard_layout", layout)

        def own(t):
            return shard_sequence(t, r, P, cut)

        local = [own(t).requires_grad_() for t in (q, k, v)]
        stats = RingStats()
        try:
            out = ring_attention(
                *local, causal=causal, layout=layout, group=group, stats=stats
            )
        except ValueError as error:
            results.append({"name": case["name"], "error": str(error)})
            continue
        out.backward(own(grad_out))
        got = [out.detach(), *(t.grad for t in local)]
        diffs = [_diff(a.double(), own(b)) for a, b in zip(got, expected)]
        result = {
            "name": case["name"],
            "world": P,
            "rank": r,
            "local_len": local[0].shape[2],
            "max_abs_diff": diffs[0],
            "grad_max_abs_diff": max(diffs[1:]),
            "torch_max_abs_diff": _torch_error(
                q, k, v, grad_out, causal, expected
            ),
            **vars(stats),
        }
        if case.get("torch_cp"):
            theirs = _torch_cp(q, k, v, grad_out, group, device)
            result.update(_compare_cp(theirs, got, expected, own))
        results.append(result)
    return {"cases": results}


def _float64_leaf(t: Tensor) -> Tensor:
    """A float64 copy of ``t`` that collects its own gradient."""
    return t.detach().to(torch.float64, copy=True).requires_grad_()


def _ring_inputs(case, device):
    """Whole q, k, v and upstream gradient: seeded, the same on every rank;
    drawn in float64, then rounded to the case's dtype."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    B, T, d = case["batch"], case["seq_len"], case["head_dim"]
    heads = (case["heads"], case["kv_heads"], case["kv_heads"], case["heads"])
    return [
        torch.randn(B, h, T, d, generator=gen, dtype=torch.float64)
        .to(DTYPES[case["dtype"]])
        .to(device)
        for h in heads
    ]


def _torch_error(q, k, v, grad_out, causal, expected) -> list[float]:
    """PyTorch's own SDPA in the case's dtype against the float64 result:
    its output's and gradients' largest errors, a yardstick."""
    whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *whole, is_causal=causal, enable_gqa=True
    )
    out.backward(grad_out)
    got = [out.detach(), *(t.grad for t in whole)]
    diffs = [_diff(a.double(), b) for a, b in zip(got, expected)]
    return [diffs[0], max(diffs[1:])]


def _torch_cp(q, k, v, grad_out, group, device) -> list[Tensor]:
    """PyTorch's context parallel on the same inputs: this rank's rows of
    the output, dq, dk and dv."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    out, grads = torch_context_parallel(q, k, v, mesh, grad_out)
    return [out, *grads]


def _compare_cp(theirs, got, expected, own) -> dict[str, float]:
    """PyTorch's results against ours, and against the float64 ones."""
    return {
        "torch_cp_vs_ring": max(_diff(a, b) for a, b in zip(theirs, got)),
        "torch_cp_vs_dense": max(
            _diff(a.double(), own(b)) for a, b in zip(theirs, expected)
        ),
    }


def _run(module, x: Tensor, grad_out: Tensor, causal: bool):
    """Forward and backward under collective counters."""
    x = x.clone().requires_grad_()
    with CollectiveCounter() as forward:
        out = module(x, is_causal=causal)
    with CollectiveCounter() as backward:
        out.backward(grad_out)
    return _local(out), module, x.grad, forward, backward


def _compare(run, out_ref, x_grad_ref, expected) -> dict[str, Any]:
    out, module, x_grad, forward, backward = run
    grads = {name: _local(p.grad) for name, p in module.named_parameters()}
    if set(grads) != set(expected):
        raise RuntimeError(
            f"parameters {sorted(grads)}, expected {sorted(expected)}"
        )
    grad_diffs = [_diff(grads[n], expected[n]) for n in expected]
    return {
        "max_abs_diff": _diff(out, out_ref),
        "grad_max_abs_diff": max([_diff(x_grad, x_grad_ref), *grad_diffs]),
        "all_reduce_calls": forward.count("all_reduce"),
        "bytes_all_reduced": forward.bytes("all_reduce"),
        "forward_collectives": [c.name for c in forward.calls],
        "backward_all_reduce_calls": backward.count("all_reduce"),
        "backward_bytes_all_reduced": backward.bytes("all_reduce"),
        "backward_collectives": [c.name for c in backward.calls],
    }


def _expected_gradients(layer, rank: int, world: int) -> dict[str, Tensor]:
    """The whole layer's gradients, cut by hand into rank's heads."""
    D, H = layer.embed_dim, layer.num_heads
    d_k = D // H
    width = D // world  # rank owns query heads rank*H/N ..., features ...
    own = slice(rank * width, (rank + 1) * width)
    if isinstance(layer, MultiHeadAttention):
        grads = dict(
            zip(("q", "k", "v"), layer.in_proj_weight.grad.split(D))
        )  # (D, D) each
        biases = dict(zip(("q", "k", "v"), layer.in_proj_bias.grad.split(D)))
        o_weight, o_bias = layer.out_proj.weight.grad, layer.out_proj.bias.grad
        own_kv = own
    else:
        proj = {n: getattr(layer, f"{n}_proj") for n in ("q", "k", "v", "o")}
        grads = {n: p.weight.grad for n, p in proj.items()}
        biases = {n: p.bias.grad for n, p in proj.items()}
        o_weight, o_bias = grads.pop("o"), biases.pop("o")
        H_kv = layer.num_kv_heads
        if H_kv >= world:  # H_kv / N key/value heads each
            kv_width = H_kv * d_k // world
            own_kv = slice(rank * kv_width, (rank + 1) * kv_width)
        else:  # the one key/value head that N / H_kv processes share
            head = rank * H_kv // world
            own_kv = slice(head * d_k, (head + 1) * d_k)
    expected = {}
    for name in ("q", "k", "v"):
        rows = own if name == "q" else own_kv
        expected[f"{name}_proj.weight"] = grads[name][rows]
        expected[f"{name}_proj.bias"] = biases[name][rows]
    expected["o_proj.weight"] = o_weight[:, own]  # its columns
    expected["o_proj.bias"] = o_bias
    return expected


def _sum_replicated(shard, world: int) -> None:
    """Sum the k, v gradients over the processes sharing a key/value head.

    What a training step does before the optimizer: each replica's gradient
    holds only what its own query heads contributed.
    """
    replicas = shard.kv_replicas
    ranks = [list(range(j, j + replicas)) for j in range(0, world, replicas)]
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    for proj in (shard.k_proj, shard.v_proj):
        for p in proj.parameters():
            dist.all_reduce(p.grad, group=group)


def _local(t: Tensor) -> Tensor:
    """A DTensor's local part (its shard), or the tensor itself."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().clone()  # waits for an AsyncCollectiveTensor


def _diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(
            f"shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        )
    return float((a - b).abs().max())


def _times(calls, device, config) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, interleaved, after warm-up.

    The processes start each call together (a barrier first).
    """
    times = {name: [] for name in calls}
    with torch.no_grad():
        for i in range(config["warmup"] + config["repeats"]):
            for name, call in calls.items():
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                call()
                _sync(device)
                if i >= config["warmup"]:
                    times[name].append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(name: str, rank: int) -> torch.device:
    if name == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(name)

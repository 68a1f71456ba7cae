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

from ..module import MultiHeadAttention
from .collectives import CollectiveCounter, saved_tensor_bytes
from .launch import die_with_parent
from .layers import parallelize_heads, shard_heads, unfuse

__all__ = ["worker_main", "check_rank", "bench_rank", "make_problem"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def worker_main(config: dict[str, Any]) -> None:
    """One rank: join the group, run the job, print its result (JSON)."""
    die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(config.get("threads", 1)))
    device = _device(config["device"], rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
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
        job = {"check": check_rank, "bench": bench_rank}[config["job"]]
        result = job(rank, world, device, config)
        print(json.dumps({"rank": rank, **result}), flush=True)
    finally:
        dist.destroy_process_group()


def make_problem(config: dict[str, Any], device: torch.device):
    """The seeded layer (random weights *and* biases), input, upstream grad."""
    dtype = DTYPES[config["dtype"]]
    gen = torch.Generator().manual_seed(config["seed"])
    D, H = config["embed_dim"], config["num_heads"]
    layer = MultiHeadAttention(D, H, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():  # torch's zero biases would hide a bug
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / D**0.5)
    shape = (config["batch"], config["seq_len"], D)  # (B, T, D)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    grad_out = torch.randn(shape, generator=gen, dtype=dtype)
    return layer.to(device), x.to(device), grad_out.to(device)


def check_rank(rank, world, device, config) -> dict[str, Any]:
    """Both split layers against the whole: outputs, gradients, collectives."""
    layer, x, grad_out = make_problem(config, device)
    causal = config["causal"]
    x_ref = x.clone().requires_grad_()
    out_ref, _ = layer(
        x_ref, x_ref, x_ref, need_weights=False, is_causal=causal
    )
    out_ref.backward(grad_out)
    expected = _expected_gradients(layer, rank, world)

    shard = shard_heads(layer, rank, world)
    hand = _run(shard, x, grad_out, causal)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    full = parallelize_heads(unfuse(layer), mesh)
    dtensor = _run(full, x, grad_out, causal)
    return {
        name: _compare(run, out_ref, x_ref.grad, expected)
        for name, run in (("hand", hand), ("dtensor", dtensor))
    }


def bench_rank(rank, world, device, config) -> dict[str, Any]:
    """Time per forward (with communication), all-reduce alone, memory."""
    layer, x, _ = make_problem(config, device)
    shard = shard_heads(layer, rank, world).eval()
    buffer = torch.empty_like(x)  # (B, T, D): what the forward all-reduces
    result = {
        "forward_s": _times(lambda: shard(x), device, config),
        "all_reduce_s": _times(
            lambda: dist.all_reduce(buffer), device, config
        ),
        "weight_bytes": sum(
            p.numel() * p.element_size() for p in shard.parameters()
        ),
        "activation_bytes": saved_tensor_bytes(
            lambda: shard(x.detach().requires_grad_()),
            exclude=shard.parameters(),
        ),
    }
    if world == 1:  # the whole layer, without any collective
        whole = unfuse(layer).eval()
        result["whole_layer_forward_s"] = _times(
            lambda: whole(x), device, config
        )
    return result


def _run(module, x: Tensor, grad_out: Tensor, causal: bool):
    """Forward and backward under collective counters."""
    x = x.clone().requires_grad_()
    with CollectiveCounter() as forward:
        out = module(x, is_causal=causal)
    with CollectiveCounter() as backward:
        out.backward(grad_out)
    grads = {name: _local(p.grad) for name, p in module.named_parameters()}
    return _local(out), grads, x.grad, forward, backward


def _compare(run, out_ref, x_grad_ref, expected) -> dict[str, Any]:
    out, grads, x_grad, forward, backward = run
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
    D = layer.embed_dim
    width = D // world  # rank owns heads rank*H/N ..., features rank*D/N ...
    own = slice(rank * width, (rank + 1) * width)
    w_q, w_k, w_v = layer.in_proj_weight.grad.split(D)  # (D, D) each
    b_q, b_k, b_v = layer.in_proj_bias.grad.split(D)  # (D,) each
    return {
        "q_proj.weight": w_q[own],
        "k_proj.weight": w_k[own],
        "v_proj.weight": w_v[own],
        "q_proj.bias": b_q[own],
        "k_proj.bias": b_k[own],
        "v_proj.bias": b_v[own],
        "o_proj.weight": layer.out_proj.weight.grad[:, own],
        "o_proj.bias": layer.out_proj.bias.grad,
    }


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


def _times(call, device, config) -> list[float]:
    """Seconds per call, after warm-up; the ranks start each call together."""
    times = []
    with torch.no_grad():
        for i in range(config["warmup"] + config["repeats"]):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            call()
            _sync(device)
            if i >= config["warmup"]:
                times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(name: str, rank: int) -> torch.device:
    if name == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(name)

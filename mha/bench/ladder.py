"""The ladder of kernel techniques, timed: a part of ``make gpu-check``.

For each shape of FlashAttention's grid (d 64 and 128, causal and not,
B T and H d fixed), on the same inputs in the same run:

1. SDPA's cuDNN and flash kernels, the ladder's yardsticks;
2. every rung of :data:`mha.kernels.tiles.LADDER` (the forward kernel at
   its default tiles, one technique more per rung): forward TFLOP/s, the
   ratio to cuDNN, and the error against float32 beside cuDNN's;
3. at the top rung, every tile of :data:`TILE_CANDIDATES` (tiles, warps,
   pipeline stages), so that the tiles are chosen by timing; the fastest
   per (d, causal) is named, with its ratio to the default tiles'.

Then CS336's leaderboard configuration (:data:`CS336`), forward and
backward, beside SDPA's flash kernel, and the backward's GQA switch
(``Techniques.split_group``) on :data:`GQA_BACKWARD`'s shapes. Each (rung
or tile, d, causal) is one compile, whatever T; the rungs at every shape
come before CS336's and the GQA rows, and they before the tiles, so a
short budget still measures the ladder.
Timings as in :mod:`mha.bench.gpu` (medians of
``triton.testing.do_bench``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..kernels.tiles import LADDER, Tiles

__all__ = ["TILE_CANDIDATES", "CS336", "GQA_BACKWARD", "part_ladder"]
__all__ += ["best_tiles"]

#: Tile candidates of the forward kernel in 16-bit, by head size: the
#: default (first), the 128 x 128 tiles that Triton's tutorial keeps on
#: Hopper, and smaller or shallower ones. (block_q, block_k, warps, stages).
TILE_CANDIDATES = {
    64: [
        Tiles(128, 64, 4, 3),
        Tiles(128, 128, 8, 3),
        Tiles(128, 128, 4, 3),
        Tiles(128, 64, 8, 3),
        Tiles(64, 64, 4, 3),
        Tiles(128, 64, 4, 4),
    ],
    128: [
        Tiles(128, 64, 8, 3),
        Tiles(128, 128, 8, 3),
        Tiles(128, 128, 8, 2),
        Tiles(128, 64, 4, 3),
        Tiles(64, 64, 4, 3),
        Tiles(64, 128, 4, 3),
    ],
}

#: GQA shapes for the backward's ``split_group`` switch: (B, H, H_kv, T,
#: d), causal, bfloat16; 32 query heads on 8 key/value heads of 128 (as
#: Llama 3 8B's); short batches, where one program per key tile of each
#: key/value head leaves multiprocessors idle (B 1, T 1024: 128 programs
#: on an H100's 132), and one where it does not.
GQA_BACKWARD = ((1, 32, 8, 1024, 128), (1, 32, 8, 4096, 128),
                (8, 32, 8, 2048, 128))  # fmt: skip

#: Stanford CS336 (2025)'s leaderboard shape: forward and backward, causal,
#: bfloat16.
CS336 = dict(batch=1, heads=16, t=16384, d=64, causal=True)


def _forward(q, k, v, causal, tiles, techniques):
    from ..kernels import attention

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    attention.forward_launch(
        q,
        k,
        v,
        out,
        lse,
        causal=causal,
        scale=q.shape[-1] ** -0.5,
        tiles=tiles,
        techniques=techniques,
    )()
    return out


def _sdpa(backend, **options):
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v, causal):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, **options
            )

    return run


def _timed(fn, q, exact, causal) -> dict:
    from . import gpu
    from .race import relative_error

    batch, heads, t, d = q.shape
    try:
        with torch.no_grad():
            error = relative_error(fn(), exact)
            ms = gpu._median_ms(fn)
    except Exception as error:  # noqa: BLE001 - a kernel this GPU lacks
        return {"status": f"{type(error).__name__}: {str(error)[:200]}"}
    flops = gpu.attention_flops(batch, heads, t, d, causal)
    return {
        "status": "ok",
        "error": error,
        "forward_ms": ms,
        "forward_tflops": flops / ms / 1e9,
    }


def _inputs(batch, heads, t, d, seed):
    from . import gpu

    gen = torch.Generator(device=gpu.DEVICE).manual_seed(seed)
    return [
        torch.randn(
            batch,
            heads,
            t,
            d,
            device=gpu.DEVICE,
            generator=gen,
            dtype=gpu.DTYPE,
        )  # fmt: skip
        for _ in range(4)
    ]


def part_ladder(budget: float, args) -> dict:
    """Time the ladder, then the tiles, then CS336's shape (see above)."""
    from . import gpu

    deadline = time.monotonic() + budget
    shapes = [
        (t, d, causal)
        for t in args.ladder_lengths
        for d in args.head_dims
        for causal in (False, True)
    ]
    cache: dict[tuple, list] = {}

    def inputs(t, d, causal):
        if (t, d, causal) not in cache:
            batch, heads = max(1, args.tokens // t), args.width // d
            q, k, v, _ = _inputs(batch, heads, t, d, t + d)
            with torch.no_grad():
                exact = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), is_causal=causal
                )
            cache.clear()  # one shape's tensors at a time
            cache[t, d, causal] = [q, k, v, exact]
        return cache[t, d, causal]

    rows, skipped = [], []

    def measure(entry: dict, fn) -> None:
        if time.monotonic() > deadline:
            skipped.append(entry)
            return
        rows.append({**entry, **_timed(fn, q, exact, entry["causal"])})

    for t, d, causal in shapes:  # the yardsticks and the rungs
        q, k, v, exact = inputs(t, d, causal)
        shape = {"T": t, "d": d, "causal": causal, "B": q.shape[0],
                 "H": q.shape[1]}  # fmt: skip
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            run = _sdpa(name)
            measure({**shape, "impl": f"sdpa_{name.split('_')[0].lower()}"},
                    lambda run=run: run(q, k, v, causal))  # fmt: skip
        for rung, techniques in LADDER:
            tiles = TILE_CANDIDATES[d][0] if d in TILE_CANDIDATES else None
            if tiles is None:
                break
            measure(
                {**shape, "impl": "triton", "rung": rung,
                 "tiles": list(vars(tiles).values())},
                lambda techniques=techniques, tiles=tiles: _forward(
                    q, k, v, causal, tiles, techniques
                ),
            )  # fmt: skip
    # CS336's shape and the backward's GQA switch before the tiles, whose
    # sweep takes whatever time is left
    cs336, gqa_backward = _cs336(deadline), _gqa_backward(deadline)
    for t, d, causal in shapes:  # the tiles, at the top rung that ran
        q, k, v, exact = inputs(t, d, causal)
        shape = {"T": t, "d": d, "causal": causal, "B": q.shape[0],
                 "H": q.shape[1]}  # fmt: skip
        ran = {
            row["rung"] for row in rows
            if row.get("status") == "ok" and row["impl"] == "triton"
            and (row["T"], row["d"], row["causal"]) == (t, d, causal)
        }  # fmt: skip
        top_rung, top = next(
            (rung for rung in reversed(LADDER) if rung[0] in ran), LADDER[-1]
        )
        for tiles in TILE_CANDIDATES.get(d, [])[1:]:
            measure(
                {**shape, "impl": "triton", "rung": top_rung,
                 "tiles": list(vars(tiles).values())},
                lambda tiles=tiles: _forward(q, k, v, causal, tiles, top),
            )  # fmt: skip
    cache.clear()
    gpu._free()
    return {
        "dtype": str(gpu.DTYPE)[6:],
        "rows": rows,
        "skipped": skipped,
        "ratios": ladder_ratios(rows),
        "best_tiles": best_tiles(rows),
        "cs336": cs336,
        "gqa_backward": gqa_backward,
    }


def ladder_ratios(rows: list[dict]) -> list[dict]:
    """Each rung's forward time against cuDNN's and flash's on the same
    shape, at the default tiles (the first of :data:`TILE_CANDIDATES`)."""
    by_shape: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.get("status") != "ok":
            continue
        key = (row["T"], row["d"], row["causal"])
        first = TILE_CANDIDATES.get(row["d"], [None])[0]
        if row["impl"] != "triton":
            by_shape.setdefault(key, {})[row["impl"]] = row["forward_ms"]
        elif row["tiles"] == list(vars(first).values()):
            by_shape.setdefault(key, {})[row["rung"]] = row["forward_ms"]
    out = []
    for (t, d, causal), times in by_shape.items():
        for rung, _ in LADDER:
            if rung not in times:
                continue
            ratio = {"T": t, "d": d, "causal": causal, "rung": rung}
            for other in ("sdpa_cudnn", "sdpa_flash"):
                if other in times:
                    ratio[f"vs_{other}"] = round(times[other] / times[rung], 3)
            out.append(ratio)
    return out


def best_tiles(rows: list[dict]) -> list[dict]:
    """Per (d, causal), the top rung's tiles with the least total time over
    the lengths where every candidate was timed, and its speed-up over the
    default tiles (the first candidate). The top rung: the highest that
    was timed with more than its default tiles."""
    tried = [r.get("rung") for r in rows if r.get("impl") == "triton"]
    tiled = [rung for rung, _ in LADDER if tried.count(rung) > tried.count(
        LADDER[0][0])]  # fmt: skip
    top = tiled[-1] if tiled else LADDER[-1][0]
    totals: dict[tuple, dict[tuple, float]] = {}
    lengths: dict[tuple, dict[tuple, set]] = {}
    for row in rows:
        if row.get("impl") != "triton" or row.get("rung") != top:
            continue
        if row.get("status") != "ok":
            continue
        key, tiles = (row["d"], row["causal"]), tuple(row["tiles"])
        lengths.setdefault(key, {}).setdefault(tiles, set()).add(row["T"])
    for row in rows:
        if row.get("impl") != "triton" or row.get("rung") != top:
            continue
        if row.get("status") != "ok":
            continue
        key, tiles = (row["d"], row["causal"]), tuple(row["tiles"])
        common = set.intersection(*lengths[key].values())
        if row["T"] in common:
            totals.setdefault(key, {}).setdefault(tiles, 0.0)
            totals[key][tiles] += row["forward_ms"]
    out = []
    for (d, causal), times in sorted(totals.items()):
        default = tuple(vars(TILE_CANDIDATES[d][0]).values())
        best = min(times, key=times.get)
        entry: dict[str, Any] = {"d": d, "causal": causal,
                                 "tiles": list(best)}  # fmt: skip
        if default in times:
            entry["speedup_over_default"] = round(
                times[default] / times[best], 3
            )
        out.append(entry)
    return out


def _cs336(deadline: float) -> dict:
    """CS336's shape, forward and backward: the kernels at their defaults
    beside SDPA's flash kernel."""
    from .. import kernels
    from . import gpu

    if time.monotonic() > deadline:
        return {"status": "skipped: time"}
    shape = CS336
    q, k, v, grad = _inputs(
        shape["batch"], shape["heads"], shape["t"], shape["d"], 336
    )
    flash = _sdpa("FLASH_ATTENTION")
    runs = {
        "triton": lambda a, b, c: kernels.triton_attention(
            a, b, c, causal=True
        ),
        "sdpa_flash": lambda a, b, c: flash(a, b, c, True),
    }
    result: dict[str, Any] = {"shape": dict(shape)}
    for name, fn in runs.items():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step(fn=fn, leaves=leaves):
            fn(*leaves).backward(grad)

        try:
            result[f"{name}_forward_backward_ms"] = gpu._median_ms(
                step, grad_to_none=leaves
            )
        except Exception as error:  # noqa: BLE001
            result[f"{name}_status"] = f"{type(error).__name__}: {error}"[:200]
    gpu._free()
    return result


def _gqa_backward(deadline: float) -> list[dict]:
    """Forward and backward, causal, on :data:`GQA_BACKWARD`'s shapes: the
    kernels with and without ``Techniques.split_group``, beside SDPA's
    flash kernel (``enable_gqa``); each row's gradients' largest relative
    difference from the first row's."""
    from dataclasses import replace

    from .. import kernels
    from ..kernels.tiles import capability_of, default_techniques
    from . import gpu
    from .race import relative_error

    defaults = default_techniques(capability_of(torch.device(gpu.DEVICE)))
    split = replace(defaults, split_group=True)
    flash = _sdpa("FLASH_ATTENTION", enable_gqa=True)
    rows = []
    for batch, heads, kv_heads, t, d in GQA_BACKWARD:
        shape = {"B": batch, "H": heads, "H_kv": kv_heads, "T": t, "d": d}
        if time.monotonic() > deadline:
            rows.append({**shape, "status": "skipped: time"})
            continue
        q, grad = _inputs(batch, heads, t, d, t)[:2]
        k, v = _inputs(batch, kv_heads, t, d, t + 1)[:2]
        runs = {
            "triton": lambda a, b, c: kernels.triton_attention(
                a, b, c, causal=True, techniques=defaults),
            "triton_split_group": lambda a, b, c: kernels.triton_attention(
                a, b, c, causal=True, techniques=split),
            "sdpa_flash": lambda a, b, c: flash(a, b, c, True),
        }  # fmt: skip
        first = None
        for name, fn in runs.items():
            row = {**shape, "impl": name}
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]

            def step(fn=fn, leaves=leaves):
                return torch.autograd.grad(fn(*leaves), leaves, grad)

            try:
                grads = step()
                first = grads if first is None else first
                row["grad_difference"] = max(
                    relative_error(g, f) for g, f in zip(grads, first)
                )
                row["forward_backward_ms"] = gpu._median_ms(step)
                row["status"] = "ok"
            except Exception as error:  # noqa: BLE001
                row["status"] = f"{type(error).__name__}: {error}"[:200]
            rows.append(row)
        gpu._free()
    return rows

"""``python -m mha.bench serve``: many requests, three ways to serve them.

N requests with a mix of prompt lengths and of new tokens, on the model of
``python -m mha.bench model`` (a small Llama, random weights, no
end-of-sequence token), served three ways and timed in the same interleaved
rounds (:func:`mha.bench.timing.measure`): ``engine`` (:class:`mha.Engine`:
continuous batching over a paged pool, every request in flight at once),
``one_by_one`` (``generate`` on each prompt in turn) and ``static_batch``
(one ``generate`` of the left-padded batch: every row runs until the
longest request is done). Tokens/s counts the tokens the requests asked for.
Memory: the engine's most blocks in use at once, beside the positions its
requests held then, and the positions the other two reserve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._validate import check_choice
from ..environment import describe, load_average
from ..model import CausalLM
from ..serving import Engine
from .model import MODEL_CONFIG
from .registry import Implementation, Runner, build_runner, register
from .report import find_row, number, paired_ratio, text_table
from .timing import (
    DTYPES,
    Case,
    Timing,
    check_arguments,
    log,
    measure,
    prepare,
)

__all__ = ["SERVE_IMPLEMENTATIONS", "run_serve_benchmark", "format_serve"]

#: The serve benchmark's entries, in table order.
SERVE_IMPLEMENTATIONS: dict[str, Implementation] = {}
BLOCK_SIZE = 16
#: Mixes of requests: (prompt lengths, new tokens), each drawn uniformly.
MIXES = {"chat": ((8, 128), (8, 64)), "short_prompts": ((8, 32), (32, 128))}


def _entry(name: str, summary: str) -> Callable:
    return register(
        SERVE_IMPLEMENTATIONS, name, scope="serve", summary=summary
    )


def workload(
    requests: int, mix: str = "chat", seed: int = 0
) -> list[tuple[list[int], int]]:
    """``requests`` (prompt ids, new tokens) of ``mix`` (:data:`MIXES`;
    ``chat``: prompts of 8 to 128 tokens, 8 to 64 new tokens), drawn with
    ``seed``."""
    (p_lo, p_hi), (n_lo, n_hi) = MIXES[mix]
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    work = []
    for _ in range(requests):
        prompt = torch.randint(
            0, MODEL_CONFIG["vocab_size"], (draw(p_lo, p_hi),), generator=g
        ).tolist()
        work.append((prompt, draw(n_lo, n_hi)))
    return work


def pool_blocks(work) -> int:
    """Blocks for every request at its longest at once (no preemption)."""
    return sum(-(-(len(p) + n - 1) // BLOCK_SIZE) for p, n in work)


def new_engine(model: CausalLM, work, budget: int) -> Engine:
    """An engine with every request of ``work`` added."""
    server = Engine(
        model,
        num_blocks=pool_blocks(work),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
    )
    for prompt, new in work:
        server.add_request(prompt, new)
    return server


@_entry("engine", "mha.Engine: continuous batching, paged pool")
def engine(weight: Tensor, model: CausalLM, work, budget: int) -> Runner:
    return lambda: new_engine(model, work, budget).run()


@_entry("one_by_one", "generate on each request in turn")
def one_by_one(weight: Tensor, model: CausalLM, work, budget: int) -> Runner:
    prompts = [torch.tensor([p], device=weight.device) for p, _ in work]
    return lambda: [
        model.generate(ids, new) for ids, (_, new) in zip(prompts, work)
    ]


@_entry("static_batch", "generate on the left-padded batch")
def static_batch(weight, model: CausalLM, work, budget: int) -> Runner:
    ids, mask = left_padded(work, weight.device)
    most = max(new for _, new in work)
    return lambda: model.generate(ids, most, attention_mask=mask)


def left_padded(work, device) -> tuple[Tensor, Tensor]:
    """The prompts as one (N, T_max) batch, pads first, and its mask."""
    longest = max(len(p) for p, _ in work)
    ids = torch.zeros(len(work), longest, dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(work):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def memory(model: CausalLM, work, budget: int) -> dict[str, Any]:
    """The engine's blocks step by step (an untimed run): the most in use,
    the positions its running requests held then; what the others reserve;
    whether the engine's tokens equal one-by-one generate's."""
    server = new_engine(model, work, budget)
    peak, finished = (0, 0), {}
    while server.scheduler.has_work():
        for output in server.step():
            if output.finished:
                finished[output.id] = output.generated
        held = sum(s.num_computed for s in server.scheduler.running)
        peak = max(peak, (server.scheduler.blocks_in_use, held))
    got = [finished[i] for i in sorted(finished)]  # in the order of arrival
    device = model.lm_head.weight.device
    alone = [
        model.generate(torch.tensor([p], device=device), n)[0, len(p) :]
        for p, n in work
    ]
    longest = max(len(p) for p, _ in work) + max(n for _, n in work)
    return {
        "engine_peak_blocks": server.stats.peak_blocks_in_use,
        "engine_most_blocks_after_a_step": peak[0],
        "engine_positions_held_then": peak[1],
        "block_size": BLOCK_SIZE,
        "positions_asked": sum(len(p) + n - 1 for p, n in work),
        "static_batch_positions": len(work) * longest,
        "one_by_one_positions": max(len(p) + n for p, n in work),
        "engine_steps": server.stats.steps,
        "tokens_equal_one_by_one": got == [a.tolist() for a in alone],
    }


def run_serve_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    requests: Sequence[int] = (8,),
    mix: str = "chat",
    budget: int = 256,
    impls: Sequence[str] | None = None,
    threads: int | None = None,
    quiet: bool = False,
    **timing: Any,
) -> dict[str, Any]:
    """Time every entry on N requests for each N; one row per (entry, N)."""
    from transformers import LlamaConfig

    timing = Timing(**timing)
    check_arguments(dtype, {"budget": budget}, {"requests": requests})
    check_choice("mix", mix, tuple(MIXES))
    torch_device, impls, env = prepare(
        SERVE_IMPLEMENTATIONS, impls, device, dtype, threads
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CausalLM.from_config(LlamaConfig(**MODEL_CONFIG))
    model = model.to(device=torch_device, dtype=DTYPES[dtype]).eval()
    weight = model.lm_head.weight
    log(f"mha.bench serve: {describe(env)}", quiet)
    results, memories = [], []
    for n in requests:
        work = workload(n, mix)
        tokens = sum(new for _, new in work)
        cases = {
            impl: Case(
                {"impl": impl, "requests": n, "new_tokens": tokens},
                lambda impl=impl: build_runner(
                    SERVE_IMPLEMENTATIONS, impl, weight, model, work, budget
                ),
            )
            for impl in impls
        }
        with torch.no_grad():
            measure(cases, torch_device, timing, f"N={n}", quiet)
        for case in cases.values():
            row = case.row
            if row["status"] == "ok":
                row["tokens_per_s"] = tokens / row["median_s"]
            results.append(row)
        memories.append({"requests": n, **memory(model, work, budget)})
    env["load_average_1min_end"] = load_average()
    report = {
        "environment": env,
        "config": {
            "mode": "serve",
            "model": MODEL_CONFIG,
            "budget": budget,
            "requests": list(requests),
            "impls": impls,
            "mix": mix,
            "workloads": {n: workload(n, mix) for n in requests},
            **timing.record(torch_device),
        },
        "results": results,
        "memory": memories,
    }
    report["ratios"] = [
        {
            "requests": n,
            **{
                f"engine/{impl}": paired_ratio(
                    find_row(report, impl="engine", requests=n),
                    find_row(report, impl=impl, requests=n),
                )
                for impl in impls
                if impl != "engine"
            },
        }
        for n in requests
    ]
    return report


def format_serve(report: dict[str, Any]) -> str:
    """Tokens/s per entry, the time ratios and the blocks, as text."""
    env, config = report["environment"], report["config"]
    layers = config["model"]["num_hidden_layers"]
    lines = [
        describe(env),
        f"serve: Llama {layers}"
        f" layers, D={config['model']['hidden_size']}, budget "
        f"{config['budget']} tokens per step; tokens/s from the median "
        f"of >= {config['repeats']} calls ({config['timer']})",
        "",
    ]
    rows = []
    for n in config["requests"]:
        found = [find_row(report, impl=i, requests=n) for i in config["impls"]]
        rows.append(
            [n] + [r and number(r.get("tokens_per_s"), ".0f") for r in found]
        )
    lines += text_table(["N", *config["impls"]], rows)
    lines += [
        "",
        "time ratios (< 1: the engine is faster), median of per-round ratios:",
    ]
    keys = [k for k in report["ratios"][0] if k != "requests"]
    cells = [
        [r["requests"], *(number(r[k], ".2f") for k in keys)]
        for r in report["ratios"]
    ]
    lines += text_table(["N", *keys], cells)
    lines += ["", "memory (positions of keys and values):"]
    for m in report["memory"]:
        lines.append(", ".join(f"{k} {v}" for k, v in m.items()))
    return "\n".join(lines)

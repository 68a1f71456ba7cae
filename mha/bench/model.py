"""``python -m mha.bench model``: tokens per second of a whole model.

Greedy ``generate`` of :class:`mha.CausalLM` on each attention backend and
cache, beside transformers' ``generate`` (its ``sdpa`` attention, its
default cache) on the same weights, all timed in the same interleaved
rounds (:func:`mha.bench.timing.measure`). The model is a small Llama built
from a config with random weights (nothing from a hub); every call
generates exactly ``new_tokens`` tokens (no end-of-sequence token), from a
prompt of ``T`` tokens. ``sdpa_compiled`` runs the decode steps through
``torch.compile`` (one graph for every step: the whole static cache, its
count a tensor), compiled before the timing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..environment import describe, load_average
from ..model import CausalLM
from .registry import Implementation, Runner, build_runner, register
from .report import find_row, number, paired_ratio, ratio_table, text_table
from .timing import (
    DTYPES,
    Case,
    Timing,
    check_arguments,
    log,
    measure,
    prepare,
)

__all__ = ["MODEL_IMPLEMENTATIONS", "MODEL_CONFIG", "run_model_benchmark"]
__all__ += ["format_model_table"]

#: The model benchmark's entries, in registration (table) order.
MODEL_IMPLEMENTATIONS: dict[str, Implementation] = {}

#: The Llama configuration timed (random weights; no end-of-sequence token).
MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=4,
    vocab_size=2048,
    max_position_embeddings=4096,
    eos_token_id=None,
)


def _entry(name: str, summary: str, **options) -> Callable:
    return register(
        MODEL_IMPLEMENTATIONS, name, scope="model", summary=summary, **options
    )


@_entry("transformers", "transformers' generate, sdpa attention")
def transformers_generate(weight: Tensor, theirs, ids: Tensor) -> Runner:
    new = theirs.bench_new_tokens
    return lambda: theirs.generate(
        ids, max_new_tokens=new, min_new_tokens=new, do_sample=False
    )


def _ours(backend: str, cache: str = "static") -> Callable:
    def build(weight: Tensor, theirs, ids: Tensor) -> Runner:
        model = _load(theirs, backend)
        new = theirs.bench_new_tokens
        return lambda: model.generate(ids, new, cache=cache)

    return build


for _name in ("sdpa", "eager", "tiled", "flex"):
    _entry(_name, f"mha.CausalLM.generate, {_name} backend, static cache")(
        _ours(_name)
    )
_entry("sdpa_paged", "mha.CausalLM.generate, sdpa backend, paged cache")(
    _ours("sdpa", "paged")
)
_entry(
    "triton",
    "mha.CausalLM.generate, triton backend (GPU only by default)",
    default_on=("cuda",),
)(_ours("triton"))


@_entry("sdpa_compiled", "greedy decoding, each step one compiled graph")
def sdpa_compiled(weight: Tensor, theirs, ids: Tensor) -> Runner:
    model = _load(theirs, "sdpa")
    step = torch.compile(model, fullgraph=True, dynamic=False)
    B, T = ids.shape
    new = theirs.bench_new_tokens
    mask = torch.ones(B, T + new, dtype=torch.int64, device=ids.device)
    at = [torch.full((1, 1), t, device=ids.device) for t in range(T + new)]

    @torch.no_grad()
    def run() -> Tensor:
        caches = model.new_caches(B, T + new)
        token = model(ids, caches=caches)[:, -1].argmax(-1, keepdim=True)
        tokens = [ids, token]
        for t in range(T, T + new - 1):  # every step the same graph
            token = step(token, mask, at[t], caches)[:, -1].argmax(-1)[:, None]
            tokens.append(token)
        return torch.cat(tokens, dim=1)

    for _ in range(2):  # the first calls compile
        run()
    return run


def _load(theirs, backend: str) -> CausalLM:
    model = CausalLM.from_config(theirs.config, attn_backend=backend)
    model.load_state_dict(theirs.state_dict())
    weight = theirs.lm_head.weight
    return model.to(device=weight.device, dtype=weight.dtype).eval()


def run_model_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch: int = 1,
    prompts: Sequence[int] = (32,),
    new_tokens: int = 32,
    impls: Sequence[str] | None = None,
    threads: int | None = None,
    quiet: bool = False,
    **timing: Any,
) -> dict[str, Any]:
    """Time every entry's generate; a report with one row per (entry, T)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    timing = Timing(**timing)
    check_arguments(
        dtype, {"batch": batch, "new_tokens": new_tokens}, {"prompts": prompts}
    )
    torch_device, impls, env = prepare(
        MODEL_IMPLEMENTATIONS, impls, device, dtype, threads
    )
    config = LlamaConfig(**MODEL_CONFIG)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        theirs = LlamaForCausalLM(config).eval()
    theirs = theirs.to(device=torch_device, dtype=DTYPES[dtype])
    theirs.bench_new_tokens = new_tokens
    log(f"mha.bench model: {describe(env)}", quiet)
    results = []
    for prompt in prompts:
        generator = torch.Generator().manual_seed(prompt)
        ids = torch.randint(
            0, config.vocab_size, (batch, prompt), generator=generator
        ).to(torch_device)
        cases = {
            impl: Case(
                {
                    "impl": impl,
                    "batch": batch,
                    "prompt": prompt,
                    "new_tokens": new_tokens,
                },
                lambda impl=impl, ids=ids: build_runner(
                    MODEL_IMPLEMENTATIONS,
                    impl,
                    theirs.lm_head.weight,
                    theirs,
                    ids,
                ),
            )
            for impl in impls
        }
        with torch.no_grad():
            measure(cases, torch_device, timing, f"T={prompt}", quiet)
        for case in cases.values():
            row = case.row
            if row["status"] == "ok":
                row["tokens_per_s"] = batch * new_tokens / row["median_s"]
            results.append(row)
    env["load_average_1min_end"] = load_average()
    report = {
        "environment": env,
        "config": {
            "mode": "model",
            "model": MODEL_CONFIG,
            "batch": batch,
            "prompts": list(prompts),
            "new_tokens": new_tokens,
            "impls": impls,
            **timing.record(torch_device),
        },
    }
    report["results"] = results
    report["ratios"] = [
        {
            "prompt": prompt,
            **{
                f"{impl}/transformers": paired_ratio(
                    find_row(report, impl=impl, prompt=prompt),
                    find_row(report, impl="transformers", prompt=prompt),
                )
                for impl in impls
                if impl != "transformers"
            },
        }
        for prompt in prompts
    ]
    return report


def format_model_table(report: dict[str, Any]) -> str:
    """Tokens per second per entry and the time ratios, as text."""
    env, config = report["environment"], report["config"]
    lines = [
        describe(env),
        f"generate: Llama {config['model']['num_hidden_layers']} layers, "
        f"D={config['model']['hidden_size']}, B={config['batch']}, "
        f"{config['new_tokens']} new tokens; tokens/s from the median of "
        f">= {config['repeats']} calls ({config['timer']})",
    ]
    rows = []
    for prompt in config["prompts"]:
        found = [
            find_row(report, impl=i, prompt=prompt) for i in config["impls"]
        ]
        rows.append(
            [prompt]
            + [r and number(r.get("tokens_per_s"), ".0f") for r in found]
        )
    lines += ["", *text_table(["T", *config["impls"]], rows)]
    lines += [
        "",
        "time ratios to transformers' generate (< 1: faster), median of "
        "per-round ratios:",
        *ratio_table(report["ratios"], {"prompt": "T"}),
    ]
    return "\n".join(lines)

"""mha.CausalLM against transformers' model with the same weights: the parity matrix.

transformers' model is built here from a small configuration with random weights (nothing from a
hub) and its state_dict loaded into ours, strictly, both ways. The matrix: every backend x {prompt,
cached decode, chunk after a cache, left-padded batch, paged cache, left-padded batch in a paged
cache, compiled decode step} x {float32, bfloat16} (on triton, the paged kernel reads the paged
cache in place, the window and the left padding as its own masks). The reference is transformers'
model run on the whole sequence at once: what a cache, a chunk or a page changes must change
nothing. float32: logits within 1e-4. bfloat16 (flash-attention's rule): no further from a float64
run of transformers' model than twice transformers' own bfloat16 run. A backend that does not serve
a cell must refuse it with a ValueError that names why (the Triton interpreter computes no
bfloat16; only eager and sdpa take a compiled step's whole-cache mask), never compute something
else. The configuration is Mistral's family with a sliding window of 6 (shorter than the sequence,
so it matters at every step) and grouped heads (4 query heads, 2 key/value heads). The triton
backend's cells run on KERNEL_DEVICE (a GPU where the kernels are compiled), transformers' model
beside ours; every other cell on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from mha import CausalLM, attention_backends
from mha.backends import BACKENDS, Masking, attend, register
from mha.caches import PagedKVCache
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers import KERNEL_DEVICE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=256,
)
B, T, WINDOW, PADS = 2, 12, 6, 4
CASES = ["prompt", "decode", "chunk", "padded", "paged", "paged_padded", "compiled"]
BACKEND_NAMES = ["eager", "sdpa", "tiled", "triton", "flex"]


def device_for(backend: str) -> str:
    """Where a backend's cells run: the Triton kernels' device for triton, else the CPU."""
    return KERNEL_DEVICE if backend in ("triton", "mha_triton") else "cpu"


def transformers_models(device: str = "cpu") -> dict[str, torch.nn.Module]:
    """transformers' model in float32, float64 and bfloat16, the same weights, on ``device``."""
    return _transformers_models(device)


@functools.cache
def _transformers_models(device: str) -> dict[str, torch.nn.Module]:
    config = MistralConfig(**SMALL, sliding_window=WINDOW, eos_token_id=None, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():  # weights larger than the initialisation: differences show
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2 if parameter.dim() > 1 else 1.0)
    float64 = MistralForCausalLM(config).eval().double()
    float64.load_state_dict(model.state_dict())
    bfloat16 = MistralForCausalLM(config).eval().to(torch.bfloat16)
    bfloat16.load_state_dict(model.state_dict())
    models = {"float32": model, "float64": float64, "bfloat16": bfloat16}
    return {name: each.to(device) for name, each in models.items()}


def inputs(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens (B, T), a left-padding mask (row 0: PADS pads) and its positions, on ``device``."""
    ids = torch.randint(1, 128, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :PADS] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def ours(backend: str, dtype: str) -> CausalLM:
    """Our model with transformers' weights, on the backend's device (:func:`device_for`)."""
    theirs = transformers_models()["float32"]
    model = CausalLM.from_config(theirs.config, attn_backend=backend).eval()
    model.load_state_dict(theirs.state_dict())  # strict
    return model.to(device=device_for(backend), dtype=getattr(torch, dtype))


@torch.no_grad()
def run_case(model: CausalLM, case: str) -> torch.Tensor:
    """The logits (B, T, V) of the whole sequence, computed as the case says, on the model's
    device."""
    device = model.lm_head.weight.device
    ids, mask, positions = inputs(device)
    if case == "prompt":
        return model(ids)
    if case == "chunk":  # a cache, then chunks of several tokens
        caches = model.new_caches(B, T)
        return torch.cat(
            [model(ids[:, a:b], caches=caches) for a, b in [(0, 5), (5, 9), (9, T)]], 1
        )
    if case in ("padded", "paged_padded"):  # a left-padded prompt, then one token at a time
        caches = model.new_caches(B, T) if case == "padded" else paged_caches(model)
        steps = [model(ids[:, :8], mask[:, :8], positions[:, :8], caches)]
        for t in range(8, T):
            steps.append(
                model(ids[:, t : t + 1], mask[:, : t + 1], positions[:, t : t + 1], caches)
            )
        return torch.cat(steps, dim=1)
    if case == "paged":
        caches = paged_caches(model)
    else:
        caches = model.new_caches(B, T)
    steps = [model(ids[:, :7], caches=caches)]
    step = model
    if case == "compiled":  # one graph for every step: the whole cache, the count a tensor
        step = torch.compile(model, fullgraph=True, dynamic=False)
    for t in range(7, T):
        full = torch.ones(B, T, dtype=torch.int64, device=device)
        steps.append(step(ids[:, t : t + 1], full, torch.tensor([[t]], device=device), caches))
    return torch.cat(steps, dim=1)


def paged_caches(model: CausalLM) -> list[PagedKVCache]:
    """Blocks of 4 positions (the triton backend reads them in place, the others gather)."""
    attn = model.model.layers[0].self_attn
    weight = attn.q_proj.weight
    sizes = (B, T, attn.num_kv_heads, attn.head_dim)
    return [
        PagedKVCache(*sizes, block_size=4, dtype=weight.dtype, device=weight.device)
        for _ in model.model.layers
    ]


@torch.no_grad()
def reference(dtype: str, case: str, device: str = "cpu") -> torch.Tensor:
    """transformers' model on the whole sequence, on ``device``; for "padded", each row alone,
    without its pads (transformers' float64 eager run of a padded batch gives NaN)."""
    ids, mask, _ = inputs(device)
    model = transformers_models(device)[dtype]
    if case not in ("padded", "paged_padded"):
        return model(ids).logits
    logits = torch.zeros(B, T, model.config.vocab_size, dtype=model.dtype, device=device)
    for b in range(B):  # each row alone, without its pads
        real = mask[b].bool()
        logits[b, real] = model(ids[b : b + 1, real]).logits[0]
    return logits


def compared(case: str) -> torch.Tensor:
    """(B, T) True where the logits are compared: every token but the pads."""
    _, mask, _ = inputs()
    padded = case in ("padded", "paged_padded")
    return mask.bool() if padded else torch.ones(B, T, dtype=torch.bool)


def refusal(backend: str, dtype: str, case: str) -> str | None:
    """The words of the ValueError a backend gives for a cell it does not serve."""
    if case == "compiled" and backend not in ("eager", "sdpa"):
        return "takes no \\['offset'\\] mask"
    if backend == "triton" and dtype == "bfloat16" and KERNEL_DEVICE == "cpu":  # interpreted
        return "bfloat16 runs on a GPU only"
    return None


def cell_error(backend: str, dtype: str, case: str) -> tuple[float, float]:
    """(our error, the bound) of one cell: ours and transformers' model on one device, the
    logits compared on the CPU."""
    keep, device = compared(case), device_for(backend)
    actual = run_case(ours(backend, dtype), case).double().cpu()[keep]
    if dtype == "float32":
        expected = reference("float32", case, device).double().cpu()[keep]
        return (actual - expected).abs().max().item(), 1e-4
    exact = reference("float64", case, device).cpu()[keep]
    theirs = reference("bfloat16", case, device).double().cpu()[keep]
    return (actual - exact).abs().max().item(), 2 * (theirs - exact).abs().max().item()


def test_the_backends_are_registered() -> None:
    assert set(BACKEND_NAMES) <= set(attention_backends())


def test_state_dicts_load_strictly_both_ways() -> None:
    theirs = transformers_models()["float32"]
    model = ours("sdpa", "float32")
    assert list(model.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(model.state_dict())  # strict, the other way


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_parity_matrix(backend: str, case: str, dtype: str) -> None:
    words = refusal(backend, dtype, case)
    if words is not None and case == "compiled":  # refused before any compiling
        q = torch.zeros(B, 4, 1, 16, dtype=getattr(torch, dtype))
        k = torch.zeros(B, 2, T, 16, dtype=q.dtype)  # every slot of the cache
        whole_cache = Masking(window=WINDOW, q_offset=torch.tensor(8), key_end=torch.tensor(9))
        with pytest.raises(ValueError, match=words):
            attend(backend, q, k, k, whole_cache)
        return
    if words is not None:
        with pytest.raises(ValueError, match=words):
            run_case(ours(backend, dtype), case)
        return
    error, bound = cell_error(backend, dtype, case)
    assert error <= bound, f"{backend} {case} {dtype}: {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_greedy_tokens_equal_transformers_over_32_steps(backend: str) -> None:
    ids, mask, _ = inputs(device_for(backend))
    theirs = transformers_models(device_for(backend))["float32"]
    with torch.no_grad():
        expected = theirs.generate(
            ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=32, do_sample=False
        )
    model = ours(backend, "float32")
    actual = model.generate(ids[:, :6], 32, attention_mask=mask[:, :6])
    assert torch.equal(actual, expected)
    if backend in ("sdpa", "triton"):  # triton: the paged kernel reads the blocks in place
        paged = model.generate(ids[:, :6], 32, attention_mask=mask[:, :6], cache="paged")
        assert torch.equal(paged, expected)


# ---------------------------------------------------------------------------------------------
# The mutation test: the bugs reported in the wild, as backends; each must turn a cell red.


def _causal_dropped(q, k, v, masking):  # a registration without its mask function
    return BACKENDS["eager"].function(q, k, v, Masking(causal=False, padding=masking.padding))


def _window_ignored_at_one_query(q, k, v, masking):  # the window forgotten at decode
    if q.shape[2] == 1:
        masking = Masking(padding=masking.padding)
    return BACKENDS["eager"].function(q, k, v, masking)


def _causal_flag_ignored(q, k, v, masking):  # top-left causal whatever the call asks
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )


MUTANTS = {
    "causal dropped (no mask function)": _causal_dropped,
    "window ignored at T_q = 1": _window_ignored_at_one_query,
    "causal flag ignored (top-left)": _causal_flag_ignored,
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_mutant_backend_turns_a_cell_red(mutant: str, monkeypatch) -> None:
    monkeypatch.setitem(BACKENDS, "mutant", BACKENDS["eager"])  # restored after the test
    register("mutant", masks=("causal", "window", "padding"), summary=mutant)(MUTANTS[mutant])
    red = [
        case
        for case in ["prompt", "decode", "chunk", "padded"]
        if (lambda e: e[0] > e[1])(cell_error("mutant", "float32", case))
    ]
    assert red, f"the mutant {mutant!r} passed every cell"


# ---------------------------------------------------------------------------------------------
# Every family, and what a backend refuses


@pytest.mark.parametrize(
    "config_class, model_class, extra",
    [
        (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True, "mlp_bias": True}),
        (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "head_dim": 24}),
        (
            Qwen2Config,
            Qwen2ForCausalLM,
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        ),
        (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "num_key_value_heads": 1}),
        (
            MistralConfig,
            MistralForCausalLM,
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
        ),
    ],
)
def test_every_family_equals_transformers(config_class, model_class, extra) -> None:
    config = config_class(**{**SMALL, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    theirs = model_class(config).eval()
    model = CausalLM.from_config(config.to_dict(), attn_backend="sdpa").eval()
    model.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(model.state_dict())
    ids, mask, positions = inputs()
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask, position_ids=positions).logits
        actual = model(ids, attention_mask=mask, position_ids=positions)
    keep = mask.bool()
    torch.testing.assert_close(actual[keep], expected[keep], rtol=0, atol=1e-4)


def test_a_backend_refuses_a_mask_it_does_not_take_by_name() -> None:
    q = torch.zeros(1, 2, 3, 8)
    padding = torch.tensor([[True, False, True]])  # a hole: not left padding
    with pytest.raises(ValueError, match="attention_mask must be left-padded"):
        attend("tiled", q, q, q, Masking(padding=padding))
    with pytest.raises(ValueError, match=r"'tiled' attention backend takes no \['dense'\] mask"):
        attend("tiled", q, q, q, Masking(dense=torch.ones(3, 3, dtype=torch.bool)))
    with pytest.raises(ValueError, match="attn_backend must be one of 'eager', 'sdpa'"):
        CausalLM.from_config(SMALL, attn_backend="flash")
    with pytest.raises(ValueError, match=r"k and v must have shape|q must have shape"):
        attend("eager", q, q[:, :1, :, :4], q[:, :1, :, :4], Masking())


def test_model_input_errors_name_the_argument() -> None:
    model = ours("sdpa", "float32")
    ids, mask, _ = inputs()
    with pytest.raises(TypeError, match="input_ids must be an int64 tensor, got torch.int32"):
        model(ids.int())
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size = 128\)"):
        model(ids + 128)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, T_k\)"):
        model(ids, attention_mask=mask[:, :3])
    with pytest.raises(ValueError, match="caches must hold one cache per layer"):
        model(ids, caches=model.new_caches(B, T)[:1])
    with pytest.raises(ValueError, match="1 at every row's last prompt token"):
        model.generate(ids, 2, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="top_p must lie in"):
        model.generate(ids, 2, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0, got -1"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(TypeError, match="logits_to_keep must be an int, got float"):
        model(ids, logits_to_keep=1.0)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=torch.tensor([[1]]))


@pytest.mark.parametrize("keep", [0, 1, 5, [0, 3, 11]])
def test_logits_to_keep_equals_transformers(keep) -> None:
    # transformers' own argument: an int keeps the last n positions (0: all), indices those
    # positions; the output head runs on them only, so the shape is (B, n, V).
    ids, _, _ = inputs()
    keep = torch.tensor(keep) if isinstance(keep, list) else keep
    with torch.no_grad():
        expected = transformers_models()["float32"](ids, logits_to_keep=keep).logits
        actual = ours("sdpa", "float32")(ids, logits_to_keep=keep)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Our backends inside transformers' own model


@pytest.mark.parametrize("name", ["mha_tiled", "mha_triton", "mha_flex"])
def test_transformers_model_on_our_backends_equals_its_eager_model(name: str) -> None:
    from mha import register_transformers_backends
    from transformers import AutoModelForCausalLM

    assert name in register_transformers_backends()
    device = device_for(name)
    eager = transformers_models(device)["float32"]  # Mistral's family, window 6 < T
    # a copy of the config: from_config sets the implementation on the config it is given
    theirs = AutoModelForCausalLM.from_config(
        copy.deepcopy(eager.config), attn_implementation=name
    )
    assert eager.config._attn_implementation != name  # the reference stays itself
    theirs = theirs.eval().to(device)
    theirs.load_state_dict(eager.state_dict())
    assert theirs.config._attn_implementation == name
    ids, mask, positions = inputs(device)
    keep = mask.bool()
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, position_ids=positions).logits[keep]
        actual = theirs(ids, attention_mask=mask, position_ids=positions).logits[keep]
        tokens = [
            model.generate(
                ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=6, do_sample=False
            )
            for model in (eager, theirs)
        ]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
    assert torch.equal(*tokens)


# ---------------------------------------------------------------------------------------------
# Sampling: transformers' warpers, in its order, then one seeded draw


def test_sampling_keeps_the_tokens_transformers_warpers_keep() -> None:
    from mha.model import sample
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    warped = scores.clone()
    for warper in warpers:
        warped = warper(None, warped)
    probabilities = warped.softmax(dim=-1)  # transformers' distribution
    draws = torch.stack(
        [sample(scores, 0.7, 20, 0.8, torch.Generator().manual_seed(s)) for s in range(400)]
    )  # (400, 3)
    allowed = probabilities > 0
    assert allowed[torch.arange(3), draws].all()  # never a token transformers cut
    counts = torch.zeros(3, 128).scatter_add_(1, draws.T, torch.ones(3, 400))
    assert (counts / 400 - probabilities).abs().max() < 0.08  # the same distribution
    expected = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(9))
    actual = sample(scores, 0.7, 20, 0.8, torch.Generator().manual_seed(9))
    assert torch.equal(actual, expected[:, 0])  # one draw from the same numbers


def test_generate_samples_reproducibly_and_top_k_1_is_greedy() -> None:
    model = ours("sdpa", "float32")
    ids, mask, _ = inputs()
    prompt = dict(input_ids=ids[:, :6], max_new_tokens=10, attention_mask=mask[:, :6])
    greedy = model.generate(**prompt)
    assert torch.equal(model.generate(**prompt, do_sample=True, top_k=1), greedy)
    runs = [
        model.generate(
            **prompt,
            do_sample=True,
            temperature=1.5,
            top_p=0.9,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
        for _ in range(2)
    ]
    assert torch.equal(*runs) and not torch.equal(runs[0], greedy)


def test_each_row_stops_at_eos() -> None:
    model = ours("sdpa", "float32")
    ids, mask, _ = inputs()
    free = model.generate(ids[:, :6], 10, attention_mask=mask[:, :6])
    eos = int(free[1, 8])  # row 1's third new token
    model.config = dataclasses.replace(model.config, eos_token_ids=(eos,), pad_token_id=0)
    stopped = model.generate(ids[:, :6], 10, attention_mask=mask[:, :6])
    row = stopped[1, 6:].tolist()
    first = row.index(eos)
    assert row[: first + 1] == free[1, 6 : 7 + first].tolist()
    assert set(row[first + 1 :]) <= {0}  # padded after its eos


# ---------------------------------------------------------------------------------------------
# Every field of a configuration: accepted means equal to transformers, otherwise refused by name

FIELD_CHANGES = {
    "vocab_size": 96,
    "hidden_size": 96,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_act": "gelu",
    "max_position_embeddings": 64,
    "rms_norm_eps": 0.5,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "mlp_bias": True,
    "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    "sliding_window": 4,
    "use_sliding_window": True,
    "max_window_layers": 1,
    "pretraining_tp": 2,
    "attention_dropout": 0.3,
    "eos_token_id": 5,
    "bos_token_id": 3,
    "pad_token_id": 0,
    "initializer_range": 0.5,
    "use_cache": False,
    "partial_rotary_factor": 0.5,
    "attn_logit_softcapping": 50.0,
    "query_pre_attn_scalar": 144,
    "final_logit_softcapping": 30.0,
}
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_field_is_equal_to_transformers_or_refused_by_name(family: str) -> None:
    config_class, model_class = FAMILIES[family]
    base = {**config_class(**SMALL).to_dict(), "sliding_window": None}
    ids, _, _ = inputs()
    accepted, refused = [], []
    for field, value in FIELD_CHANGES.items():
        fields = {**base, field: value}
        if field == "partial_rotary_factor":  # lives in rope_parameters
            fields = {**base, "rope_parameters": {**base["rope_parameters"], field: value}}
        try:
            ours = CausalLM.from_config(fields).eval()
        except ValueError as error:
            assert field in str(error), f"{family}: {field} refused without its name: {error}"
            refused.append(field)
            continue
        config = config_class(**{k: v for k, v in fields.items() if k != "model_type"})
        config._attn_implementation = "eager"
        torch.manual_seed(4)
        theirs = model_class(config).eval()
        ours.load_state_dict(theirs.state_dict())
        with torch.no_grad():
            expected = theirs(ids % config.vocab_size).logits
            actual = ours(ids % config.vocab_size)
        error = (actual - expected).abs().max().item()
        assert error < 1e-4, f"{family}: {field} = {value!r} accepted but off by {error:.3g}"
        accepted.append(field)
    assert {"attn_logit_softcapping", "partial_rotary_factor", "hidden_act"} <= set(refused)
    assert {"head_dim", "sliding_window", "rope_parameters"} <= set(accepted) | set(refused)


def test_every_entry_of_the_model_benchmark_generates_transformers_tokens() -> None:
    from mha.bench.model import MODEL_IMPLEMENTATIONS
    from mha.bench.registry import build_runner

    theirs = transformers_models()["float32"]
    theirs.bench_new_tokens = 6
    ids, _, _ = inputs()
    expected = build_runner(MODEL_IMPLEMENTATIONS, "transformers", ids.float(), theirs, ids)()
    assert expected.shape == (B, T + 6)
    for name in MODEL_IMPLEMENTATIONS:
        if name in ("transformers", "sdpa_compiled", "triton"):  # compiling: the matrix
            continue
        runner = build_runner(MODEL_IMPLEMENTATIONS, name, ids.float(), theirs, ids)
        assert torch.equal(runner(), expected), name


def test_a_prompt_past_max_position_embeddings_is_refused_by_name() -> None:
    # The config says 256 positions (SMALL): a prompt of 250 and 7 new tokens need 257.
    from mha import Engine

    model = ours("sdpa", "float32")
    ids = torch.ones(1, 250, dtype=torch.int64)
    words = r"max_position_embeddings = 256, got 257 positions"
    with pytest.raises(ValueError, match=words):
        model.generate(ids, 7)
    assert model.generate(ids, 6).shape == (1, 256)  # 256 fit
    engine = Engine(model, num_blocks=40, block_size=16, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match=words):
        engine.add_request([1] * 250, 7)
    assert not engine.requests  # nothing half-added


def test_a_tied_checkpoint_without_its_head_loads_strictly() -> None:
    # save_pretrained leaves out lm_head.weight when it is tied to the embeddings (Llama-3.2-1B,
    # Qwen2.5-0.5B, SmolLM2): the checkpoint loads strictly, the head being the embeddings.
    config = LlamaConfig(**SMALL, tie_word_embeddings=True)
    torch.manual_seed(5)
    theirs = LlamaForCausalLM(config).eval()
    checkpoint = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    model = CausalLM.from_config(config).eval()
    model.load_state_dict(checkpoint)  # strict
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4)
    untied = CausalLM.from_config(LlamaConfig(**SMALL))
    with pytest.raises(RuntimeError, match="lm_head.weight"):  # its own head: still required
        untied.load_state_dict(checkpoint)


def test_from_config_takes_the_configs_dtype_as_transformers() -> None:
    config = LlamaConfig(**SMALL, dtype="bfloat16")
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    assert CausalLM.from_config(config).lm_head.weight.dtype == theirs.dtype == torch.bfloat16
    assert CausalLM.from_config(config, dtype=torch.float32).lm_head.weight.dtype == torch.float32
    as_dict = {**SMALL, "torch_dtype": "bfloat16"}  # config.json's older key
    assert CausalLM.from_config(as_dict).lm_head.weight.dtype == torch.bfloat16


def test_the_models_attention_layer_is_the_chapters_layer() -> None:
    # One layer, one forward: the model's attention is GroupedQueryAttention itself (chapter 12's).
    import mha.model

    model = CausalLM.from_config(
        {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 32, "head_dim": 8}
    )  # fmt: skip
    for layer in model.model.layers:
        assert type(layer.self_attn) is mha.GroupedQueryAttention
    assert not hasattr(mha.model, "Attention")

"""generate chooses its tokens as transformers' generate does, for the same seed.

transformers applies its generation defaults when sampling (top_k 50, top_p 1.0, temperature
1.0), its logits processors (repetition penalty, min_new_tokens) to greedy and sampled decoding,
then its warpers (temperature, top-k, top-p, min-p) and one draw from torch's generator. The same
weights in both models, the same seed before each call: the same tokens. The engine takes the same
settings per request.
"""

from __future__ import annotations

import pytest
import torch
from mha import CausalLM
from mha.sampling import GENERATION_DEFAULTS, Sampling
from mha.serving import Engine
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=97, eos_token_id=5, pad_token_id=0)  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    ours = CausalLM.from_config(theirs.config).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


IDS = torch.tensor([[11, 22, 33, 44, 55, 66], [7, 8, 9, 10, 11, 12]])


def _both(pair, seed, **settings):
    ours, theirs = pair
    torch.manual_seed(seed)
    mine = ours.generate(IDS, 12, **settings)
    torch.manual_seed(seed)
    with torch.no_grad():
        config = settings.pop("generation_config", None)
        if config is not None:
            settings["generation_config"] = GenerationConfig(**config)
        theirs_tokens = theirs.generate(IDS, max_new_tokens=12, **settings)
    return mine, theirs_tokens


@pytest.mark.parametrize("seed", range(5))
def test_sampling_with_nothing_else_is_transformers_default(pair, seed) -> None:
    mine, theirs = _both(pair, seed, do_sample=True)
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=True, top_k=0),  # off
        dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.3),  # both off
        dict(do_sample=True, top_p=0.8, temperature=0.7),
        dict(do_sample=True, top_k=0, min_p=0.2),
        dict(do_sample=True, repetition_penalty=1.5),
        dict(repetition_penalty=1.3),  # greedy: the processors apply too
        dict(min_new_tokens=10, eos_token_id=[3, 4]),
        dict(do_sample=True, eos_token_id=6, pad_token_id=2, top_k=5),
        dict(generation_config=dict(do_sample=True, temperature=0.9, top_p=0.95)),
    ],
    ids=str,
)
def test_each_setting_as_transformers(pair, settings) -> None:
    for seed in (1, 2):
        mine, theirs = _both(pair, seed, **dict(settings))
        assert torch.equal(mine, theirs), (settings, seed)


def test_the_defaults_are_transformers() -> None:
    defaults = GenerationConfig._get_default_generation_params()
    for name, value in GENERATION_DEFAULTS.items():
        if name in ("min_p", "min_new_tokens"):  # unset there: no cut, no minimum
            assert defaults.get(name) is None and value in (None, 0), name
        else:
            assert defaults[name] == value, name
    resolved = Sampling.resolve(type("C", (), {"eos_token_ids": (2,), "pad_token_id": None})())
    assert (resolved.top_k, resolved.top_p, resolved.temperature) == (50, 1.0, 1.0)


def test_min_new_tokens_holds_the_stop_tokens_back(pair) -> None:
    # Greedy, one row: its first new token made the stop token ends it at once; with
    # min_new_tokens=3 the first three new tokens are other ones.
    ours, _ = pair
    first = int(ours.generate(IDS[:1], 1, eos_token_id=[])[0, -1])
    assert ours.generate(IDS[:1], 8, eos_token_id=first).shape[1] == IDS.shape[1] + 1
    held = ours.generate(IDS[:1], 8, eos_token_id=first, min_new_tokens=3)
    assert first not in held[0, IDS.shape[1] : IDS.shape[1] + 3].tolist()


def test_bad_settings_are_refused_by_name(pair) -> None:
    ours, _ = pair
    for settings, words in [
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(min_p=1.5), r"min_p must lie in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a positive"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(top_kk=3), "sampling takes"),
    ]:
        with pytest.raises((ValueError, TypeError), match=words):
            ours.generate(IDS, 2, **settings)


def test_the_engine_takes_the_same_settings(pair) -> None:
    # Per request: its own stop tokens, ignore_eos, and sampling with a repetition penalty; each
    # equal to generate on that request alone with the same settings and seed.
    ours, _ = pair
    engine = Engine(ours, num_blocks=16, block_size=4, max_num_batched_tokens=32)
    prompts = [IDS[0].tolist(), IDS[1].tolist()]
    wanted = [
        dict(eos_token_id=[40, 41], repetition_penalty=1.2),
        dict(do_sample=True, top_k=20, generator=torch.Generator().manual_seed(3)),
    ]
    ids = [engine.add_request(p, 10, **dict(w)) for p, w in zip(prompts, wanted)]
    ignored = engine.add_request(prompts[0], 10, ignore_eos=True, eos_token_id=list(range(97)))
    done = engine.run()
    for i, prompt, settings in zip(ids, prompts, wanted):
        if "generator" in settings:
            settings["generator"] = torch.Generator().manual_seed(3)
        alone = ours.generate(torch.tensor([prompt]), 10, **settings)[0, len(prompt) :]
        assert done[i] == alone.tolist()
    assert len(done[ignored]) == 10  # every token a stop token, ignored

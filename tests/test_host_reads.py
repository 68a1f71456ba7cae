"""A decoding step reads tensor values on the host a constant number of times, whatever the depth.

On a GPU every read of a tensor's value (``int(t)``, ``bool(t)``, ``t.item()``, ``t.tolist()``,
``nonzero``) waits for every kernel queued before it: a step that reads once per layer runs its
layers one synchronisation at a time. The model says once per forward what every layer hides (the
positions, the pads as each row's first key) and the caches keep their counts on the host too, so
that a step of 16 layers reads exactly as often as a step of 2, on every backend, with a static or
a paged cache, with or without padding.

The reads are counted where they happen: ``aten._local_scalar_dense`` (behind ``item``, ``int``,
``bool``, ``float``), the ops whose output size depends on values, and ``Tensor.tolist``.
FlexAttention's own internals run unwatched (torch's code, not ours: a dispatch mode disturbs its
compilation).
"""

from __future__ import annotations

import contextlib

import mha
import mha.variants
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from helpers import KERNEL_DEVICE

# ops that read a value from the device, or whose result's size depends on values
READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "unique_dim", "_unique2"}


class HostReads(TorchDispatchMode):
    """Counts the ops that bring a tensor's values to the host."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(monkeypatch):
    mode = HostReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        mode.reads.append("tolist")
        return tolist(tensor)

    flex = mha.variants.flex

    def unwatched_flex(*args, **kwargs):
        with _disable_current_modes():
            return flex(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(mha.variants, "flex", unwatched_flex)
    with mode:
        yield mode
    monkeypatch.undo()


def config(layers: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": layers,
        "vocab_size": 64,
        "max_position_embeddings": 64,
    }


def reads_in_a_decoding_step(monkeypatch, layers, backend, cache, padded) -> list[str]:
    torch.manual_seed(0)
    device = KERNEL_DEVICE if backend == "triton" else "cpu"  # compiled kernels: CUDA tensors
    model = mha.CausalLM.from_config(config(layers), attn_backend=backend, device=device)
    model.eval()
    ids = torch.randint(0, 64, (2, 6), device=device)
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    if padded:
        mask[0, :2] = 0  # row 0 left-padded
    caches = model.new_caches(2, 8, kind=cache)
    with torch.no_grad():
        model(ids, mask[:, :6] if padded else None, None, caches)  # the prompt
        model(ids[:, :1], mask[:, :7] if padded else None, None, caches)  # a first step
        with counting(monkeypatch) as mode:
            model(ids[:, :1], mask[:, :8] if padded else None, None, caches)
    return mode.reads


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("cache", ["static", "paged"])
@pytest.mark.parametrize("backend", mha.attention_backends())
def test_a_decoding_step_reads_as_often_with_16_layers_as_with_2(
    monkeypatch, backend, cache, padded
):
    if backend == "triton":
        pytest.importorskip("triton")
    shallow = reads_in_a_decoding_step(monkeypatch, 2, backend, cache, padded)
    deep = reads_in_a_decoding_step(monkeypatch, 16, backend, cache, padded)
    assert len(deep) == len(shallow), (shallow, deep)
    # the token ids' range (one read); the pads' shape (one more) when there are pads
    assert len(deep) <= 1 + padded, deep


def reads_in_an_engine_step(monkeypatch, layers, backend) -> list[str]:
    from mha.serving import Engine

    torch.manual_seed(0)
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    model = mha.CausalLM.from_config(config(layers), attn_backend=backend, device=device)
    engine = Engine(model.eval(), num_blocks=16, block_size=4)
    engine.add_request([1, 2, 3, 4, 5], 4)
    engine.add_request([6, 7, 8], 4)
    engine.step()  # the prompts
    engine.step()  # a first decoding step
    with counting(monkeypatch) as mode:
        engine.step()  # two requests decode
    return mode.reads


@pytest.mark.parametrize("backend", mha.attention_backends())
def test_an_engine_step_reads_as_often_with_16_layers_as_with_2(monkeypatch, backend):
    # the step's plan knows every length on the host: no layer reads one back from the device
    if backend == "triton":
        pytest.importorskip("triton")
    shallow = reads_in_an_engine_step(monkeypatch, 2, backend)
    deep = reads_in_an_engine_step(monkeypatch, 16, backend)
    assert len(deep) == len(shallow), (shallow, deep)


def test_the_counter_sees_the_reads_it_claims_to():
    # the counter itself: each kind of read it names is counted, and arithmetic is not
    x = torch.arange(6.0)
    with pytest.MonkeyPatch.context() as patch, counting(patch) as mode:
        int(x[2]), bool(x[1] > 0), x.max().item(), x.tolist(), x.nonzero()
        x * 2 + 1
    assert mode.reads == ["_local_scalar_dense"] * 3 + ["tolist", "nonzero"]

"""Checkers of decoding and tiled attention: a key/value cache update, one
online-softmax step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from .checker import (
    Checker,
    Failed,
    as_array,
    compare,
    expect_shape,
    normal_arrays,
    shares_memory,
    short,
)


def check_kv_cache_update(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(keys, values, k, v, length) -> (k_all, v_all)``.

    ``keys`` and ``values`` are preallocated (B, H_kv, max_len, d_k) buffers
    holding ``length`` cached tokens; ``k`` and ``v`` are (B, H_kv, T, d_k),
    the new tokens. ``fn`` writes them at positions ``length`` to
    ``length + T - 1`` in place and returns views of the ``length + T``
    positions written (as :meth:`mha.KVCache.update` does). Catches: writing
    every step at position 0; returning the whole buffer (zeros included);
    building new arrays and leaving the buffers unwritten; returning copies;
    writing past ``max_len`` without an error.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker("check_kv_cache_update", fn, framework, device=device)
    rng = np.random.default_rng(6)
    shape = (2, 3, 8, 4)  # (B, H_kv, max_len, d_k)
    # three steps of 3, 1 and 2 new tokens: (B, H_kv, T, d_k) keys, values
    steps = [normal_arrays(rng, (2, 3, t, 4), (2, 3, t, 4)) for t in (3, 1, 2)]

    def fresh():
        buffers = (np.zeros(shape), np.zeros(shape))
        if framework == "torch":
            import torch

            # on the device of the tensors fn gets
            return tuple(
                torch.from_numpy(b).to(checker.device) for b in buffers
            )
        return buffers

    def run_steps():
        keys, values = fresh()
        length, results = 0, []
        for k, v in steps:
            results.append(
                checker.call(keys, values, k, v, length, copy=False)
            )
            length += k.shape[2]
        return keys, values, results

    everything_k = np.concatenate([k for k, _ in steps], axis=2)
    everything_v = np.concatenate([v for _, v in steps], axis=2)

    @checker.item("returns (k_all, v_all), (B, H_kv, length + T, d_k) each")
    def _() -> None:
        _, _, results = run_steps()
        length = 0
        for (k, _), result in zip(steps, results):
            length += k.shape[2]
            if not isinstance(result, tuple | list) or len(result) != 2:
                raise Failed(
                    f"it returned {type(result).__name__}: return the pair "
                    "(k_all, v_all)"
                )
            for name, part in zip(("k_all", "v_all"), result):
                got = as_array(part)
                if got.shape == shape and length < shape[2]:
                    raise Failed(
                        f"{name} has all max_len = {shape[2]} positions after "
                        f"{length} tokens: the unwritten ones are zeros, and "
                        "the queries would attend to them (a key of zeros "
                        "scores 0, not -inf). Return keys[:, :, :length + T]"
                    )
                expect_shape(got, (2, 3, length, 4), name)

    @checker.item("the buffers hold every token, each after the ones before")
    def _() -> None:
        keys, values, _ = run_steps()
        n, newest = everything_k.shape[2], steps[-1][0]
        keys, values = as_array(keys), as_array(values)
        if not keys[:, :, :n].any():
            raise Failed(
                "the keys buffer is still zeros: the new keys went into a new "
                "array (np.concatenate?), and the next step will not find "
                "them. Write into keys[:, :, length:length + T]"
            )
        if np.allclose(keys[:, :, : newest.shape[2]], newest):
            raise Failed(
                "the newest keys sit at position 0: each step writes after "
                "the tokens cached before it, at keys[:, :, length:length + "
                "T]"
            )
        compare(keys[:, :, :n], everything_k, "the keys buffer")
        compare(values[:, :, :n], everything_v, "the values buffer")

    @checker.item("k_all and v_all are the tokens so far, in order")
    def _() -> None:
        _, _, results = run_steps()
        k_all, v_all = (as_array(part) for part in results[-1])
        compare(k_all, everything_k, "k_all after three steps")
        compare(v_all, everything_v, "v_all after three steps")

    @checker.item("returns views of the buffers, not copies")
    def _() -> None:
        keys, values, results = run_steps()
        for name, buffer, part in zip(
            ("k_all", "v_all"), (keys, values), results[-1]
        ):
            if not shares_memory(part, buffer):
                raise Failed(
                    f"{name} is a copy: copying every cached token at every "
                    "step is the cost a cache is there to save. Return the "
                    "slice keys[:, :, :length + T] itself"
                )

    @checker.item("writing past max_len raises an error")
    def _() -> None:
        keys, values = fresh()
        k, v = normal_arrays(rng, (2, 3, 3, 4), (2, 3, 3, 4))
        try:
            checker.call(keys, values, k, v, 6, copy=False)  # 6 + 3 > 8
        except Failed:
            return
        raise Failed(
            "3 new tokens after 6 cached ones, with max_len = 8, went "
            "through without an error: a token was dropped, or the result "
            "is longer than the buffer. Raise an error when length + T > "
            "max_len"
        )

    checker.run(verbose)


def check_online_softmax_step(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(m, ell, acc, scores, v) -> (m, ell, acc)``: one step of the
    online softmax (the inner loop of :func:`mha.flash_attention`).

    ``m`` (B_q,) is the running maximum of the scores seen so far, ``ell``
    (B_q,) the running sum of ``exp(score - m)``, ``acc`` (B_q, d_v) the
    running sum of ``exp(score - m) * value``; ``scores`` (B_q, B_k) and
    ``v`` (B_k, d_v) are the next block. After the last block, ``acc /
    ell`` is the attention output. Start from ``m = -inf``, ``ell = 0``,
    ``acc = 0``. Catches: ``acc`` or ``ell`` not rescaled when the maximum
    grows; the rescale inverted; the block's maximum in place of the running
    one; the exponentials of the raw scores (overflow).
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker(
        "check_online_softmax_step", fn, framework, device=device
    )
    rng = np.random.default_rng(7)
    # four blocks of 3 keys for 2 queries; the maxima go up, down, far up
    blocks = [
        (rng.normal(size=(2, 3)) + shift, rng.normal(size=(3, 4)))
        for shift in (0.0, 3.0, -2.0, 800.0, 1.0)
    ]

    def fold(step, blocks):
        m, ell, acc = np.full(2, -np.inf), np.zeros(2), np.zeros((2, 4))
        for scores, v in blocks:
            m, ell, acc = step(m, ell, acc, scores, v)
        return m, ell, acc

    def learner(m, ell, acc, scores, v):
        result = checker.call(m, ell, acc, scores, v)
        if not isinstance(result, tuple | list) or len(result) != 3:
            raise Failed(
                f"it returned {type(result).__name__}: return the triple "
                "(m, ell, acc)"
            )
        return tuple(as_array(part) for part in result)

    def expected(blocks):
        scores = np.concatenate([s for s, _ in blocks], axis=-1)
        values = np.concatenate([v for _, v in blocks], axis=0)
        return reference.softmax(scores) @ values, scores

    @checker.item("one block: acc / ell = softmax(scores) @ v")
    def _() -> None:
        m, ell, acc = learner(
            np.full(2, -np.inf), np.zeros(2), np.zeros((2, 4)), *blocks[0]
        )
        if not (np.isfinite(ell).all() and np.isfinite(acc).all()):
            raise Failed(
                "the first block, from m = -inf, ell = 0, acc = 0, gave "
                f"ell = {short(ell)}: the old sums' factor exp(m - m_new) "
                "is exp(-inf) = 0 there; an inverted factor, "
                "exp(m_new - m), is exp(+inf)"
            )
        compare(acc / ell[:, None], expected(blocks[:1])[0], "acc / ell")

    @checker.item("three blocks: acc / ell = the softmax over all of them")
    def _() -> None:
        m, ell, acc = fold(learner, blocks[:3])
        compare(
            acc / ell[:, None],
            expected(blocks[:3])[0],
            "acc / ell",
            {
                hint: twin[2] / twin[1][:, None]
                for hint, twin in _online_mistakes(fold, blocks[:3]).items()
            },
        )

    @checker.item("m is the running maximum, ell the sum of exp(score - m)")
    def _() -> None:
        m, ell, _ = fold(learner, blocks[:3])
        scores = expected(blocks[:3])[1]
        if np.allclose(m, blocks[2][0].max(axis=-1)):
            raise Failed(
                "m is the last block's own maximum: it is the running "
                "maximum, np.maximum(m, scores.max(axis=-1)); with the "
                "block's maximum, a block far below the ones before "
                "overflows exp(m - m_new)"
            )
        compare(m, scores.max(axis=-1), "m")
        compare(
            ell, np.exp(scores - scores.max(-1, keepdims=True)).sum(-1), "ell"
        )

    @checker.item("stable: a block of scores near 800 gives no inf or NaN")
    def _() -> None:
        m, ell, acc = fold(learner, blocks)
        if not (np.isfinite(ell).all() and np.isfinite(acc).all()):
            raise Failed(
                "ell or acc became inf or NaN after a block of scores near "
                "800: np.exp of a raw score overflows above about 709.78. "
                "Take exp(scores - m_new), with m_new the new running "
                "maximum, and rescale the old sums by exp(m - m_new)"
            )
        compare(acc / ell[:, None], expected(blocks)[0], "acc / ell")

    checker.run(verbose)


def _online_mistakes(fold: Callable, blocks: list) -> dict[str, tuple]:
    """The typical wrong online-softmax steps, folded over ``blocks``."""

    def step(
        m,
        ell,
        acc,
        scores,
        v,
        acc_scale=True,
        ell_scale=True,
        sign=1,
        raw=False,
    ):
        m_new = np.maximum(m, scores.max(-1))
        # 0 for the first block (m = -inf), in the inverted form too
        rescale = np.where(np.isfinite(m), np.exp(sign * (m - m_new)), 0.0)
        p = np.exp(scores if raw else scores - m_new[:, None])
        ell = (rescale if ell_scale else 1.0) * ell + p.sum(-1)
        acc = (rescale[:, None] if acc_scale else 1.0) * acc + p @ v
        return m_new, ell, acc

    def variant(**how):
        with np.errstate(all="ignore"):
            return fold(lambda *a: step(*a, **how), blocks)

    return {
        "acc was not rescaled when the maximum grew: the values summed "
        "before were weighted by exp(score - m_old); multiply acc by "
        "exp(m_old - m_new) before adding the new block": variant(
            acc_scale=False
        ),
        "ell was not rescaled when the maximum grew: multiply the old sum "
        "by exp(m_old - m_new) before adding the new block": variant(
            ell_scale=False
        ),
        "the rescale is inverted: the old sums are multiplied by "
        "exp(m_old - m_new), at most 1, not exp(m_new - m_old)": variant(
            sign=-1.0
        ),
        "the new block's exponentials were taken of the raw scores: they "
        "are exp(scores - m_new), on the same footing as the rescaled old "
        "sums (and safe from overflow)": variant(raw=True),
    }

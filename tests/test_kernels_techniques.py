"""The forward kernels' switches (mha.kernels.Techniques): each rung of the ladder is right.

Expected values come from a dense float64 form written here (scores, the masks as boolean
matrices, the sink as one more column, softmax), never from the kernels. In Triton's
interpreter masks at the edges only must change no bit (the same operations on the same
values), and the tiles run without a mask are counted against a brute-force list of the tiles
that every row of a query tile sees whole. On a GPU the 16-bit rungs are held to twice the error
of SDPA's own kernel on the same inputs.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import replace

import pytest
import torch
from mha import kernels
from mha.kernels import LADDER, Techniques

from helpers import KERNEL_DEVICE, randn

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

DEVICE = KERNEL_DEVICE
SWITCHES = [
    Techniques(exp2=e, edge_masks=m) for e, m in itertools.product((False, True), repeat=2)
]
SWITCHES += [
    Techniques(edge_masks=True, tma=True),
    Techniques(exp2=True, edge_masks=True, tma=True),
    Techniques(costliest_first=True),
    dict(LADDER)["warp-specialised"],
    LADDER[-1][1],  # every switch of the forward kernel, persistent included
]
SPLIT_KV_SWITCHES = [t for t in SWITCHES if t.runs_in("split_kv")]

# (B, H, H_kv, T_q, T_k, d, causal, key starts, window, sinks, block_q, block_k): ragged tails,
# T_q < T_k and T_q > T_k with causal masks, GQA, odd head sizes, left padding, windows, sinks
CASES = [
    (1, 2, 2, 64, 64, 64, True, None, None, False, 16, 16),
    (2, 4, 2, 33, 100, 80, True, (5, 37), None, False, 16, 16),
    (1, 4, 1, 100, 60, 32, True, None, None, True, 16, 32),
    (2, 2, 1, 50, 130, 59, False, (0, 70), None, False, 32, 16),
    (1, 2, 2, 65, 65, 96, True, (3,), 20, True, 16, 16),
    (2, 2, 2, 40, 129, 48, False, None, None, False, 16, 16),
    (1, 2, 1, 77, 77, 40, True, None, 33, False, 32, 16),
    # offsets T_k - T_q of 14 and 15: a tile's first row sees up to one key short of, or up
    # to the end of, a key tile (the two sides of an off-by-one in the unmasked range)
    (1, 2, 1, 50, 64, 64, True, None, None, False, 16, 16),
    (2, 2, 2, 49, 64, 32, True, (20, 0), None, False, 16, 16),
]


def dense(q, k, v, causal, key_start=None, window=None, sinks=None):
    """float64 attention written out: output and logsumexp (over the keys and the sink)."""
    q, k, v = (t.cpu().double() for t in (q, k, v))  # float64 leaves keep their graph
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t_q, t_k = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(t_q)[:, None] + t_k - t_q  # each query's position
    j = torch.arange(t_k)[None, :]
    seen = torch.ones(q.shape[0], 1, t_q, t_k, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= j > i - window
    if key_start is not None:
        seen &= j[None, None] >= torch.tensor(key_start)[:, None, None, None]
    scores = scores.masked_fill(~seen, -math.inf)
    if sinks is not None:
        column = sinks.detach().cpu().double()[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, column), dim=-1)
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row that sees nothing: 0
    return weights[..., :t_k] @ v, lse


def _case(case, dtype=torch.float32, seed=0):
    b, h, h_kv, t_q, t_k, d, causal, starts, window, sinks, bq, bk = case
    q = randn(b, h, t_q, d, seed=seed, dtype=torch.float32).to(dtype).to(DEVICE)
    k = randn(b, h_kv, t_k, d, seed=seed + 1, dtype=torch.float32).to(dtype).to(DEVICE)
    v = randn(b, h_kv, t_k, d, seed=seed + 2, dtype=torch.float32).to(dtype).to(DEVICE)
    settings = dict(causal=causal, window=window, block_q=bq, block_k=bk)
    if starts is not None:
        settings["key_start"] = torch.tensor(starts, dtype=torch.int32).to(DEVICE)
    if sinks:
        settings["sinks"] = randn(h, seed=seed + 3, dtype=torch.float32).to(DEVICE)
    return q, k, v, settings


def _dense_of(q, k, v, settings):
    starts = settings.get("key_start")
    return dense(q, k, v, settings["causal"], None if starts is None else starts.tolist(),
                 settings["window"], settings.get("sinks"))  # fmt: skip


@pytest.mark.parametrize("techniques", SWITCHES, ids=repr)
@pytest.mark.parametrize("case", CASES)
def test_every_switch_equals_the_dense_form(case, techniques) -> None:
    from mha.kernels.attention import attention_forward

    q, k, v, settings = _case(case)
    if techniques.tma and q.shape[-1] * q.element_size() % 16:  # rows a descriptor cannot load
        first = "q" if techniques.warp_specialize else "k"  # the first tensor it loads so
        with pytest.raises(ValueError, match=f"techniques.tma loads {first} through tensor"):
            attention_forward(q, k, v, techniques=techniques, **settings)
        return
    out, lse = attention_forward(q, k, v, techniques=techniques, **settings)
    want, want_lse = _dense_of(q, k, v, settings)
    assert (out.cpu().double() - want).abs().max() < 1e-5
    # the logsumexp, back in base e with exp2: -inf exactly where a row sees nothing
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu().double()[finite] - want_lse[finite]).abs().max() < 1e-5


@pytest.mark.parametrize("techniques", SPLIT_KV_SWITCHES[1:], ids=repr)
def test_every_switch_in_the_split_kv_kernel(techniques) -> None:
    from mha.kernels.attention import split_kv_forward

    for case in CASES[1], CASES[3], CASES[4]:
        q, k, v, settings = _case(case)
        settings.pop("block_q"), settings.pop("sinks", None)
        if techniques.tma and q.shape[-1] * q.element_size() % 16:
            continue  # refused, as the test above checks
        out, lse = split_kv_forward(q, k, v, techniques=techniques, num_splits=3, **settings)
        want, want_lse = _dense_of(q, k, v, settings)
        assert (out.cpu().double() - want).abs().max() < 1e-5, case


def _count_key_tiles(monkeypatch, key) -> collections.Counter:
    """Every key tile of every program from now on, counted by ``key(MASKED, TMA)``."""
    from mha.kernels import attention

    calls = collections.Counter()
    original = attention._key_tile

    class Counted:
        def __getattr__(self, name):
            return getattr(original, name)

        def __call__(self, *args):  # ..., MASKED, EXP2, TMA
            calls[key(bool(args[-3]), bool(args[-1]))] += 1
            return original(*args)

    monkeypatch.setattr(attention, "_key_tile", Counted())
    return calls


@pytest.mark.skipif(kernels.INTERPRETED is not True, reason="counts the interpreter's calls")
@pytest.mark.parametrize("case", CASES)
def test_masks_at_the_edges_change_no_bit_and_mask_only_the_edges(case, monkeypatch) -> None:
    from mha.kernels import attention

    q, k, v, settings = _case(case)
    calls = _count_key_tiles(monkeypatch, lambda masked, tma: masked)
    first, _ = attention.attention_forward(q, k, v, **settings)
    every = calls.copy()
    assert set(every) == {True}  # the first kernel masks every tile
    calls.clear()
    edges, _ = attention.attention_forward(q, k, v, techniques=Techniques(edge_masks=True),
                                           **settings)  # fmt: skip
    assert torch.equal(first, edges)
    assert calls[True] + calls[False] == every[True]  # the same tiles, cut differently
    assert calls[False] == _whole_tiles(q, k, settings)


def _whole_tiles(q, k, settings) -> int:
    """Brute force: key tiles that every (query, key) pair of a query tile keeps, summed over
    the programs; a tile is 'whole' when no key is past the end, hidden by padding, by the
    causal mask or by the window, for any row of the query tile."""
    (batch, heads, t_q, _), t_k = q.shape, k.shape[2]
    bq, bk = settings["block_q"], settings["block_k"]
    starts = settings.get("key_start")
    window, causal = settings["window"], settings["causal"]
    whole = 0
    for b in range(batch):
        start = 0 if starts is None else int(starts[b])
        for q_first in range(0, t_q, bq):
            rows = range(q_first, q_first + bq)  # rows past T_q are computed too
            for k_first in range(0, t_k, bk):
                ok = all(
                    c < t_k and c >= start
                    and (not causal or c <= r + t_k - t_q)
                    and (window is None or c > r + t_k - t_q - window)
                    for r in rows
                    for c in range(k_first, k_first + bk)
                )  # fmt: skip
                whole += ok
    return whole * heads


def test_the_ladder_climbs_one_switch_at_a_time() -> None:
    rungs = [techniques for _, techniques in LADDER]
    assert rungs[0] == Techniques()  # the book's first kernel
    for lower, upper in zip(rungs, rungs[1:]):
        changed = [name for name in vars(upper) if getattr(upper, name) != getattr(lower, name)]
        if upper.persistent:  # the one exception: it cannot keep warp specialisation
            assert changed == ["persistent", "warp_specialize"] and lower.warp_specialize
            continue
        assert len(changed) == 1 and getattr(upper, changed[0]) is True
    # every switch off compiles the first kernel: no constexpr is added
    assert Techniques().constants() == {}
    assert Techniques(exp2=True, edge_masks=True).constants() == {"EXP2": True, "EDGE_MASKS": True}
    assert Techniques(edge_masks=True, tma=True).constants() == {"EDGE_MASKS": True, "TMA": True}


def test_techniques_of_the_wrong_type_are_refused_by_name() -> None:
    q, k, v, settings = _case(CASES[0])
    with pytest.raises(
        TypeError, match=r"techniques must be a mha.kernels.Techniques or None, got dict"
    ):
        kernels.triton_attention(q, k, v, techniques={"exp2": True})
    with pytest.raises(TypeError, match="techniques must be"):
        kernels.triton_split_kv_attention(q[:, :, :1], k, v, techniques="exp2")


def test_tma_loads_change_no_bit_and_refuse_what_a_descriptor_cannot_load() -> None:
    from mha.kernels.attention import attention_forward

    q, k, v, settings = _case(CASES[1])  # d_k 80: dims past it read 0 from the descriptor
    edges, _ = attention_forward(q, k, v, techniques=Techniques(edge_masks=True), **settings)
    tma, _ = attention_forward(q, k, v, techniques=Techniques(edge_masks=True, tma=True),
                               **settings)  # fmt: skip
    if kernels.INTERPRETED:  # the same values, copied another way
        assert torch.equal(edges, tma)
    else:
        assert (edges - tma).abs().max() < 1e-6
    # d_k 59 in float32: rows of 236 bytes, not a multiple of 16
    q, k, v, settings = _case(CASES[3])
    with pytest.raises(ValueError, match=r"techniques.tma loads k through tensor descriptors"):
        attention_forward(q, k, v, techniques=Techniques(edge_masks=True, tma=True), **settings)
    with pytest.raises(ValueError, match="it needs edge_masks=True"):
        Techniques(tma=True)
    with pytest.raises(TypeError, match="Techniques.exp2 must be a bool, got int 1"):
        Techniques(exp2=1)


@pytest.mark.skipif(kernels.INTERPRETED is not True, reason="counts the interpreter's calls")
@pytest.mark.parametrize("case", CASES)
def test_warp_specialisation_changes_no_bit_masks_every_tile_and_hides_what_pads_hold(
    case, monkeypatch
) -> None:
    # One loop over every key tile, each through the descriptors and masked: the exp2 rung's
    # operations on the same values, so the same bits, whatever the padding keys hold
    from mha.kernels import attention

    q, k, v, settings = _case(case)
    specialized = dict(LADDER)["warp-specialised"]
    if q.shape[-1] * q.element_size() % 16:  # rows a descriptor cannot load: q named first
        with pytest.raises(ValueError, match="techniques.tma loads q through tensor descriptors"):
            attention.attention_forward(q, k, v, techniques=specialized, **settings)
        return
    want = attention.attention_forward(q, k, v, techniques=Techniques(exp2=True), **settings)
    calls = _count_key_tiles(monkeypatch, lambda masked, tma: (masked, tma))
    attention.attention_forward(q, k, v, techniques=Techniques(exp2=True), **settings)
    tiles = calls[True, False]
    calls.clear()
    got = attention.attention_forward(q, k, v, techniques=specialized, **settings)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert calls == {(True, True): tiles}  # the same tiles, every one masked, all by descriptor
    starts = settings.get("key_start")
    if starts is not None:  # the pads before each row's first key: NaN, hidden all the same
        k, v = k.clone(), v.clone()
        for b, start in enumerate(starts.tolist()):
            k[b, :, :start], v[b, :, :start] = math.nan, math.inf
        got = attention.attention_forward(q, k, v, techniques=specialized, **settings)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_warp_specialisation_is_refused_where_it_does_not_apply() -> None:
    from mha.kernels.attention import attention_forward, forward_launch

    with pytest.raises(ValueError, match="a loop whose loads are tensor descriptors: it needs "
                       "tma=True"):  # fmt: skip
        Techniques(exp2=True, edge_masks=True, warp_specialize=True)
    with pytest.raises(ValueError, match="cannot be inside persistent=True's loop"):
        Techniques(edge_masks=True, tma=True, costliest_first=True, persistent=True,
                   warp_specialize=True)  # fmt: skip
    specialized = dict(LADDER)["warp-specialised"]
    assert not specialized.runs_in("split_kv") and specialized.not_in("split_kv") == [
        "warp_specialize"
    ]
    q, k, v, settings = _case(CASES[0])
    with pytest.raises(ValueError, match="switches of the forward kernel and its backward only"):
        kernels.triton_split_kv_attention(q[:, :, :1], k, v, techniques=specialized)
    # q's rows through a descriptor too: a q whose rows are not 16-byte aligned is named
    q_odd = torch.empty(1, 2, 64, 66, device=DEVICE)[..., :64].copy_(q)  # rows of 264 bytes
    with pytest.raises(ValueError, match=r"techniques.tma loads q through tensor descriptors: "
                       r".*got strides \(8448, 4224, 66, 1\)"):  # fmt: skip
        attention_forward(q_odd, k, v, techniques=specialized, **settings)
    attention_forward(q_odd, k, v, techniques=dict(LADDER)["TMA loads"], **settings)  # k, v only
    # Triton (3.9, sm_90) specialises a kernel of one warp group only: the launch asks for 4
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEVICE)
    tiles = kernels.tiles.default_tiles("forward", 128, torch.bfloat16, (9, 0))
    assert tiles.num_warps == 8
    for techniques, warps in ((dict(LADDER)["TMA loads"], 8), (specialized, 4)):
        launch = forward_launch(q, k, v, out, lse, causal=True, scale=0.125, tiles=tiles,
                                techniques=techniques)  # fmt: skip
        assert launch.constants["num_warps"] == warps


def test_the_defaults_are_every_switch_off_until_measured() -> None:
    from mha.kernels.tiles import default_techniques

    for capability in ((8, 0), (8, 9), (9, 0), (10, 0)):
        assert default_techniques(capability) == Techniques()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rung", [name for name, _ in LADDER])
def test_16_bit_rungs_within_twice_sdpa_on_the_gpu(rung, dtype) -> None:
    techniques = dict(LADDER)[rung]
    for case in CASES[0], CASES[1], CASES[2]:
        q, k, v, settings = _case(case, dtype=dtype)
        settings.pop("block_q"), settings.pop("block_k")
        want, _ = _dense_of(q, k, v, settings)
        ours = kernels.triton_attention(q, k, v, techniques=techniques, **settings)
        group = q.shape[1] // k.shape[1]
        t_q, t_k = q.shape[2], k.shape[2]
        seen = (
            torch.arange(t_k, device=DEVICE)[None, :]
            <= torch.arange(t_q, device=DEVICE)[:, None] + t_k - t_q
        )
        mask = seen if settings["causal"] else None
        if "key_start" in settings:
            pads = torch.arange(t_k, device=DEVICE)[None, :] >= settings["key_start"][:, None]
            mask = pads[:, None, None, :] & (True if mask is None else mask)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
        )
        if "sinks" in settings:  # SDPA has no sinks: its error without them, on the same q, k, v
            theirs_want, _ = dense(q, k, v, settings["causal"])
        else:
            theirs_want = want
        error = (ours.cpu().double() - want).abs().max()
        sdpa_error = (theirs.cpu().double().nan_to_num(0) - theirs_want).abs().max()
        ulp = torch.finfo(dtype).eps * want.abs().max()  # one unit of the output's rounding
        assert error <= 2 * sdpa_error + ulp, (case, float(error), float(sdpa_error))


# (B, H, H_kv, T_q, T_k, d, causal, key starts, window): one query (decoding), T_q = 3 (a
# tile of 16 rows holds 5 heads' queries and runs on into the next), a group of 8 (MQA)
PACKED = [
    (2, 8, 2, 1, 150, 64, True, None, None),
    (2, 8, 2, 3, 150, 40, True, (7, 64), None),
    (1, 8, 1, 3, 97, 64, True, None, 20),
    (2, 4, 4, 2, 70, 32, False, (0, 30), None),
]


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("case", PACKED)
def test_packing_a_group_in_the_split_kv_kernel(case, edges, monkeypatch) -> None:
    from mha.kernels import attention

    b, h, h_kv, t_q, t_k, d, causal, starts, window = case
    q, k, v, settings = _case((b, h, h_kv, t_q, t_k, d, causal, starts, window, False, 16, 16))
    settings.pop("block_q")
    calls = collections.Counter()
    if kernels.INTERPRETED:
        original = attention._key_tile

        class Counted:  # key tiles loaded, over every program
            def __getattr__(self, name):
                return getattr(original, name)

            def __call__(self, *args):
                calls["tiles"] += 1
                return original(*args)

        monkeypatch.setattr(attention, "_key_tile", Counted())
    want, _ = _dense_of(q, k, v, settings)
    loads = {}
    for pack in (False, True):
        calls.clear()
        switches = Techniques(edge_masks=edges, pack_group=pack)
        out, _ = attention.split_kv_forward(q, k, v, techniques=switches, num_splits=2, **settings)
        assert (out.cpu().double() - want).abs().max() < 1e-5, pack
        loads[pack] = calls["tiles"]
    if kernels.INTERPRETED:
        group = h // h_kv
        if group * t_q <= 16:  # one tile of rows: each key tile read once per group, not head
            assert loads[True] * group == loads[False], loads
        else:  # the group's rows need two tiles: each reads its own keys
            assert loads[False] / group < loads[True] < loads[False], loads


def test_packing_is_refused_by_the_forward_kernel() -> None:
    q, k, v, _ = _case(CASES[1])
    with pytest.raises(ValueError, match="pack_group is a switch of the split-KV kernel only"):
        kernels.triton_attention(q, k, v, techniques=Techniques(pack_group=True))


def _snake_deal(q_blocks: int, batch_heads: int, programs: int) -> dict[int, list]:
    """Written out: every (query tile, b * H + h) item, the last query tiles first, laid in
    rows of `programs` seats; even rows read left to right, odd rows right to left."""
    order = [(qb, bh) for qb in reversed(range(q_blocks)) for bh in range(batch_heads)]
    dealt = collections.defaultdict(list)
    for deal, first in enumerate(range(0, len(order), programs)):
        row = order[first : first + programs]
        row += [None] * (programs - len(row))  # a short last round: empty seats at its end
        for program, item in enumerate(row if deal % 2 == 0 else row[::-1]):
            if item is not None:
                dealt[program].append(item)
    return dealt


def test_persistent_items_deal_every_item_once_in_snake_order() -> None:
    from mha.kernels.tiles import persistent_items

    for q_blocks, batch_heads, programs in itertools.product((1, 3, 8), (1, 5, 16), (1, 2, 7)):
        want = _snake_deal(q_blocks, batch_heads, programs)
        got = {p: persistent_items(p, programs, q_blocks, batch_heads) for p in range(programs)}
        assert {p: items for p, items in got.items() if items} == want
    # 2 programs of 4 warps, or 1 of 8, fit one multiprocessor at 255 registers a thread
    from mha.kernels.tiles import persistent_programs

    assert [persistent_programs(132, w) for w in (2, 4, 8, 16)] == [528, 264, 132, 132]


def test_a_persistent_deal_is_balanced() -> None:
    # Key tiles each program loads in a causal pass (tiles 128 x 64; B T = 16k, 16 heads, as
    # FlashAttention's benchmark), counted here item by item: within one costliest item of the
    # mean, the bound a deal in order of cost keeps
    from mha.kernels.tiles import persistent_items, persistent_programs

    programs = persistent_programs(132, 4)
    for t in (1024, 4096, 16384):
        q_blocks, batch_heads = t // 128, 16 * (16384 // t)
        cost = [math.ceil((qb + 1) * 128 / 64) for qb in range(q_blocks)]
        loads = [sum(cost[qb] for qb, _ in persistent_items(p, programs, q_blocks, batch_heads))
                 for p in range(programs)]  # fmt: skip
        mean = sum(cost) * batch_heads / programs
        assert sum(loads) == sum(cost) * batch_heads
        assert max(loads) - min(loads) <= max(cost) and max(loads) <= mean + max(cost)


@pytest.mark.skipif(kernels.INTERPRETED is not True, reason="reads the interpreter's grid")
@pytest.mark.parametrize("case", CASES)
def test_costliest_first_and_persistent_change_no_bit_and_follow_their_schedule(
    case, monkeypatch
) -> None:
    from mha.kernels import attention
    from mha.kernels.tiles import default_tiles, persistent_programs
    from triton.runtime.interpreter import interpreter_builder

    q, k, v, settings = _case(case)
    want = attention.attention_forward(q, k, v, **settings)
    calls = []  # (program's grid index, query tile, b * H + h) of every item, in order
    tiles = collections.Counter()  # key tiles per item
    original_item, original_tile = attention._forward_tile, attention._key_tile

    def value(x):
        return int(x.handle.data.item()) if hasattr(x, "handle") else int(x)

    class Item:
        def __getattr__(self, name):
            return getattr(original_item, name)

        def __call__(self, q_block, batch_head, *args):
            calls.append((interpreter_builder.grid_idx, (value(q_block), value(batch_head))))
            return original_item(q_block, batch_head, *args)

    class Tile:
        def __getattr__(self, name):
            return getattr(original_tile, name)

        def __call__(self, *args):
            tiles[calls[-1][1]] += 1
            return original_tile(*args)

    monkeypatch.setattr(attention, "_forward_tile", Item())
    monkeypatch.setattr(attention, "_key_tile", Tile())
    monkeypatch.setattr(attention, "_multiprocessors", lambda device: 3)
    (batch, heads, t_q, _), bq = q.shape, settings["block_q"]
    q_blocks, batch_heads = -(-t_q // bq), batch * heads
    every = {(qb, bh) for qb in range(q_blocks) for bh in range(batch_heads)}

    got = attention.attention_forward(
        q, k, v, techniques=Techniques(costliest_first=True), **settings
    )
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # the grid is (b * H + h, query tile), the last tile first: the GPU starts programs in
    # the order of their linear index x + y * grid_x
    assert sorted(item for _, item in calls) == sorted(every)
    launched = sorted(calls, key=lambda c: c[0][0] + c[0][1] * batch_heads)
    assert [item for _, item in launched] == [
        (qb, bh) for qb in reversed(range(q_blocks)) for bh in range(batch_heads)
    ]
    if settings["causal"] and settings.get("key_start") is None and settings["window"] is None:
        costs = [tiles[item] for _, item in launched]
        assert costs == sorted(costs, reverse=True)  # the longest programs start first

    # the top rung (TMA loads where a descriptor can load these rows), then persistent: the
    # same bits as the rung below it
    top = LADDER[-1][1]
    if q.shape[-1] * q.element_size() % 16:
        top = replace(top, tma=False)
    want = attention.attention_forward(q, k, v, techniques=replace(top, persistent=False),
                                       **settings)  # fmt: skip
    calls.clear()
    got = attention.attention_forward(q, k, v, techniques=top, **settings)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    programs = min(len(every), persistent_programs(3, default_tiles(
        "forward", q.shape[-1], q.dtype).num_warps))  # fmt: skip
    by_program = collections.defaultdict(list)
    for (x, y, z), item in calls:
        assert y == z == 0 and x < programs
        by_program[x].append(item)
    assert by_program == _snake_deal(q_blocks, batch_heads, programs)


def test_costliest_first_and_persistent_are_refused_where_they_do_not_apply() -> None:
    q, k, v, _ = _case(CASES[1])
    with pytest.raises(ValueError, match="it needs costliest_first=True"):
        Techniques(persistent=True)
    for techniques in Techniques(costliest_first=True), LADDER[-1][1]:
        assert not techniques.runs_in("split_kv") and techniques.runs_in("forward")
        with pytest.raises(ValueError, match="switches of the forward kernel and its backward "
                           "only"):  # fmt: skip
            kernels.triton_split_kv_attention(q[:, :, :1], k, v, techniques=techniques)


# ---------------------------------------------------------------------------------------------
# The backward's switch: a GQA group's dk and dv split over programs of their own


def _dense_gradients(q, k, v, settings, d_out):
    """float64 autograd through the dense form written above."""
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    starts = settings.get("key_start")
    out, _ = dense(q64, k64, v64, settings["causal"],
                   None if starts is None else starts.tolist(), settings["window"],
                   settings.get("sinks"))  # fmt: skip
    return torch.autograd.grad(out, (q64, k64, v64), d_out.cpu().double())


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != c[2]])  # GQA: H > H_kv
def test_splitting_a_group_in_the_backward_equals_the_dense_gradients(case) -> None:
    from mha.kernels.attention import attention_backward, attention_forward, backward_launches
    from mha.kernels.tiles import default_tiles

    q, k, v, settings = _case(case)
    settings.pop("sinks", None)
    out, lse = attention_forward(q, k, v, **settings)
    d_out = randn(*out.shape, seed=9, dtype=torch.float32).to(DEVICE)
    want = _dense_gradients(q, k, v, settings, d_out)
    default = attention_backward(q, k, v, out, lse, d_out, **settings)
    split = attention_backward(q, k, v, out, lse, d_out, techniques=Techniques(split_group=True),
                               **settings)  # fmt: skip
    for name, ours, theirs, dense_grad in zip("q k v".split(), split, default, want):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        assert (ours.cpu().double() - dense_grad).abs().max() < 1e-4, name
        # dq is the same kernel; dk and dv only sum the same float32 terms in another order
        if name == "q":
            assert torch.equal(ours, theirs)
        else:
            assert (ours - theirs).abs().max() < 1e-5, name
    # the programs: one per key tile of each query head, G times the default's
    batch, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    shares = torch.empty(batch, heads, *k.shape[2:], dtype=torch.float32, device=DEVICE)
    tiles = {name: default_tiles(name, q.shape[-1], q.dtype)
             for name in ("backward_dk_dv", "backward_dq")}  # fmt: skip
    common = dict(causal=settings["causal"], scale=1.0, tiles=tiles)
    delta = lse.new_zeros(lse.shape)
    plain, _ = backward_launches(q, k, v, d_out, lse, delta, q, k, v, **common)
    shared, _ = backward_launches(q, k, v, d_out, lse, delta, q, shares, shares, **common)
    assert plain.grid[1] == batch * kv_heads and shared.grid[1] == batch * heads
    assert shared.grid[0] == plain.grid[0] and shared.constants["SPLIT_GROUP"] is True
    assert "SPLIT_GROUP" not in plain.constants


def test_splitting_a_group_goes_through_autograd_and_is_refused_by_split_kv() -> None:
    q, k, v, settings = _case(CASES[1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    settings.pop("block_q"), settings.pop("block_k")
    grads = {}
    for split in (False, True):
        out = kernels.triton_attention(*leaves, techniques=Techniques(split_group=split),
                                       **settings)  # fmt: skip
        grads[split] = torch.autograd.grad(out.square().sum(), leaves)
    assert torch.equal(grads[False][0], grads[True][0])
    for plain, split in zip(grads[False][1:], grads[True][1:]):
        assert (plain - split).abs().max() < 1e-5
    with pytest.raises(ValueError, match="techniques split_group: switches of the forward"):
        kernels.triton_split_kv_attention(q[:, :, :1], k, v,
                                          techniques=Techniques(split_group=True))  # fmt: skip


def test_every_launch_with_descriptors_gives_triton_their_scratch_memory(monkeypatch) -> None:
    # Compiled for a GPU, a program that makes tensor descriptors writes them in scratch memory
    # that Triton asks of the allocator set by triton.set_allocator, and fails without one: a
    # Launch made without attention_forward's checks (the benchmark's ladder) must set it too.
    from mha.kernels import attention

    launched, allocators = [], []

    class Kernel:  # stands in for a compiled kernel: records its launches
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.append(constants)

    monkeypatch.setattr(attention, "INTERPRETED", False)
    monkeypatch.setattr(attention.triton, "set_allocator", allocators.append)
    attention.Launch(Kernel(), (1,), (), {"TMA": True})()
    assert allocators == [attention._scratch] and launched == [{"TMA": True}]
    attention.Launch(Kernel(), (1,), (), {"EXP2": True})()  # no descriptors: no allocator
    assert allocators == [attention._scratch] and len(launched) == 2

"""Serving: ragged paged attention, the paged KV write, packed variable-length attention.

Every result against the float64 oracle on each request's own unpaged sequence, on
every backend (the pool's free slots hold NaN, its pages are shuffled); batch
invariance bit for bit across batch composition, page placement and prefill/chunk/
decode splits (under ``jax.jit`` across programs of other shapes too); gradients
against central differences; the write in place (NumPy, torch) or functional (JAX,
array-api-strict); bad input named.
"""

from __future__ import annotations

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import assert_close, randn
from portable_attn import scaled_dot_product_attention
from portable_attn._lib import _paged, _route
from portable_attn._paths import _paged as paged_driver
from portable_attn.serving import (
    paged_kv_write,
    plan_ragged,
    ragged_paged_attention,
    varlen_attention,
)
from portable_attn.testing import (
    central_differences,
    reference_attention,
    reference_lse,
    reference_max_logit,
)

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")

HQ, HKV, DK, DV = 4, 2, 8, 6


class Pool:
    """Requests' keys/values written into a shuffled pool of pages (NaN in free slots)."""

    def __init__(
        self,
        lengths,
        new_rows,
        *,
        page_size=4,
        num_pages=48,
        seed=0,
        pad=2,
        dtype=np.float64,
        fill=np.nan,
        order=None,
        heads=(HQ, HKV, DK, DV),
    ):
        rng = np.random.default_rng(seed)
        self.heads = hq, hkv, dk, dv = heads
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.page_size = page_size
        r = len(lengths)
        max_pages = max(-(-n // page_size) for n in lengths) + 1
        self.keys = [randn(n, hkv, dk, seed=seed * 100 + i) for i, n in enumerate(lengths)]
        self.values = [randn(n, hkv, dv, seed=seed * 100 + 50 + i) for i, n in enumerate(lengths)]
        free = list(rng.permutation(num_pages) if order is None else order)
        self.table = np.zeros((r, max_pages), dtype=np.int64)
        kp = np.full((num_pages, page_size, hkv, dk), fill)
        vp = np.full((num_pages, page_size, hkv, dv), fill)
        for i, n in enumerate(lengths):
            for j in range(-(-n // page_size)):
                self.table[i, j] = free.pop(0)
            for t in range(n):
                kp[self.table[i, t // page_size], t % page_size] = self.keys[i][t]
                vp[self.table[i, t // page_size], t % page_size] = self.values[i][t]
        self.key_pages, self.value_pages = kp.astype(dtype), vp.astype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(new_rows)]).astype(np.int64)
        self.query = randn(int(self.starts[-1]) + pad, hq, dk, seed=seed + 7).astype(dtype)

    def args(self, backend, dtype="float64"):
        b = backend.asarray
        return (
            b(self.query, dtype),
            b(self.key_pages, dtype),
            b(self.value_pages, dtype),
            b(self.table),
            b(self.lengths),
            b(self.starts),
        )

    def oracle(self, **kw):
        """out (T, Hq, Dv) and lse (T, Hq) in float64, request by request."""
        return self.oracle_with_max(**kw)[:2]

    def oracle_with_max(self, **kw):
        """out (T, Hq, Dv), lse (T, Hq) and max logit (T, Hq) in float64."""
        kw = {"is_causal": True, **kw}
        t = self.query.shape[0]
        hq, _, _, dv = self.heads
        out, lse = np.zeros((t, hq, dv)), np.full((t, hq), -np.inf)
        top = np.full((t, hq), -np.inf)
        for r in range(len(self.lengths)):
            a, b = self.starts[r], self.starts[r + 1]
            if a == b:
                continue
            q = self.query[a:b].astype(np.float64).transpose(1, 0, 2)[None]
            k = self.keys[r].transpose(1, 0, 2)[None]
            v = self.values[r].transpose(1, 0, 2)[None]
            out[a:b] = reference_attention(q, k, v, **kw)[0].transpose(1, 0, 2)
            lse[a:b] = reference_lse(q, k, **kw)[0].transpose(1, 0)
            logit_kw = {n: x for n, x in kw.items() if n != "sinks"}
            top[a:b] = reference_max_logit(q, k, **logit_kw)[0].transpose(1, 0)
        return out, lse, top


SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
OPTIONS = {
    "causal": {},
    "window": {"window": (6, 0)},
    "softcap+sinks": {"softcap": 2.0, "sinks": randn(HQ, seed=3), "scale": 0.4},
    "not-causal": {"is_causal": False},
    "alibi+window-right": {"alibi_slopes": SLOPES, "is_causal": False, "window": (9, 3)},
}


def _on(backend, kw):
    return {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}


def _lane(monkeypatch, backend, lane):
    """Send every request to the walk, or every request with a row to the engine.

    By default a request of ``_route.PAGED_ENGINE_ROWS`` rows or more goes to the engine
    where its library's row says so (``Library.paged_engine``), the others to the walk.
    """
    from portable_attn._lib import _route

    if lane == "engine":
        if not _route.library(backend.asarray(np.zeros(1))).paged_engine:
            pytest.skip(f"{backend.family} walks every request (Library.paged_engine)")
        monkeypatch.setattr(_route, "PAGED_ENGINE_ROWS", 1)
    elif lane == "walk":
        monkeypatch.setattr(_route, "PAGED_ENGINE_ROWS", 2**62)


@pytest.mark.parametrize("lane", ["default", "walk", "engine", "invariant"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_paged_against_oracle(backend, xp, name, lane, monkeypatch):
    # a decode row, prefill chunks longer than a tile, a request with no new row, one
    # whose window ends before its first chunk, one new row at position 0; by default
    # the requests of 20 and 17 rows go to the engine (where their library's row says)
    if lane == "walk" and backend.family == "jax":
        pytest.skip("JAX walks every request by default (the case beside this one)")
    _lane(monkeypatch, backend, lane)
    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    kw = OPTIONS[name]
    args = pool.args(backend)
    out, lse, top = ragged_paged_attention(
        *args,
        return_lse=True,
        return_max_logit=True,
        batch_invariant=lane == "invariant",
        **_on(backend, kw),
    )
    expected_out, expected_lse, expected_top = pool.oracle_with_max(**kw)
    assert_close(backend, out, expected_out)
    assert_close(backend, lse, expected_lse)
    assert_close(backend, top, expected_top)
    assert np.all(backend.to_numpy(top)[-2:] == -np.inf)  # padding rows
    assert np.all(backend.to_numpy(out)[-2:] == 0.0)  # padding rows
    # each statistic alone, and neither
    _, top_alone = ragged_paged_attention(*args, return_max_logit=True, **_on(backend, kw))
    assert_close(backend, top_alone, expected_top)
    assert_close(backend, ragged_paged_attention(*args, **_on(backend, kw)), expected_out)


def test_split_rows(backend, xp):
    # the engine's requests' rows and pages, split once: the parts are the slices, and
    # torch's come from one split (one concatenation in the backward, no zero array of
    # the whole per part)
    from portable_attn._lib._compat import split_rows

    x = backend.asarray(randn(10, 3, seed=1))
    parts = split_rows(x, [0, 2, 2, 7, 10])
    for part, (a, b) in zip(parts, [(0, 2), (2, 2), (2, 7), (7, 10)], strict=True):
        np.testing.assert_array_equal(backend.to_numpy(part), backend.to_numpy(x)[a:b])
    if backend.family == "torch":
        import torch

        leaf = torch.zeros(10, 3, requires_grad=True)
        nodes = {type(p.grad_fn).__name__ for p in split_rows(leaf * 1.0, [0, 4, 10])}
        assert nodes == {"SplitWithSizesBackward0"}


def test_requests_with_many_rows_go_to_the_engine(backend, xp):
    from portable_attn._lib import _route

    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    meta = pool.args(backend)[3:]
    engine = _plan_of(pool, backend, meta)._walk.engine
    if _route.library(meta[0]).paged_engine:  # the prefill chunks of 20 and 17 rows
        assert [(e.begin, e.end, e.length) for e in engine] == [(5, 25, 40), (27, 44, 23)]
        # and no tile holds their rows: the walk does nothing for them
        valid = backend.to_numpy(_plan_of(pool, backend, meta)._walk.tiles.valid)
        assert not valid[5:25].any()
        assert not valid[27:44].any()
        alone = Pool([40], [20])  # the one request left to the engine: nothing walked
        walk = _plan_of(alone, backend, alone.args(backend)[3:])._walk
        assert len(walk.engine) == 1
        assert walk.runs == ()
        assert not backend.to_numpy(walk.tiles.valid).any()
        assert not walk.walks  # the call's result: the engine's rows, then 2 padding rows
        assert walk.merge == ((0, 0, 20), (_paged.PADDING, 20, 22))
    else:
        assert engine == ()
    assert _plan_of(pool, backend, meta, batch_invariant=True)._walk.engine == ()


def test_window_over_tiles_of_unequal_rows_against_oracle(backend, xp):
    # the host plan sorted its tiles, then took a tile's last row from another tile's
    # row count: a chunk whose keys a window hides in part was folded as seen whole
    # (no mask) for a tile of 10 rows read as 2, 0.02 off
    lengths = [524, 649, 683, 298]
    pool = Pool(lengths, [2, 10, 10, 11], page_size=16, num_pages=142, seed=48)
    out = ragged_paged_attention(*pool.args(backend), window=(423, 0))
    assert_close(backend, out, pool.oracle(window=(423, 0))[0])


def test_no_rows_or_no_requests(backend, xp):
    pool = Pool([5, 9], [2, 1])
    q, kp, vp, table, lengths, _ = pool.args(backend)
    out, lse = ragged_paged_attention(
        q[:0, ...], kp, vp, table, lengths, backend.asarray(np.zeros(3, np.int64)), return_lse=True
    )
    assert tuple(out.shape) == (0, HQ, DV)
    assert tuple(lse.shape) == (0, HQ)
    empty = backend.asarray(np.zeros((0, 3), np.int64))
    none = backend.asarray(np.zeros(0, np.int64))
    out, lse = ragged_paged_attention(
        q, kp, vp, empty, none, backend.asarray(np.zeros(1, np.int64)), return_lse=True
    )
    assert np.all(backend.to_numpy(out) == 0.0)
    assert np.all(backend.to_numpy(lse) == -np.inf)
    # no request: every row is padding, nothing written (an IndexError before)
    new_k, new_v = q[:, :HKV, :], q[:, :HKV, :DV]
    k2, v2 = paged_kv_write(
        kp, vp, empty, none, backend.asarray(np.zeros(1, np.int64)), new_k, new_v
    )
    np.testing.assert_array_equal(backend.to_numpy(k2), pool.key_pages)
    np.testing.assert_array_equal(backend.to_numpy(v2), pool.value_pages)


@pytest.mark.parametrize("lane", ["walk", "engine"])
def test_half_precision_accumulates_in_float32(backend, xp, lane, monkeypatch):
    if not backend.supports("float16"):
        pytest.skip(f"{backend.kind} has no float16")
    _lane(monkeypatch, backend, lane)
    pool = Pool([12, 30], [3, 1])
    out, lse = ragged_paged_attention(*pool.args(backend, "float16"), return_lse=True)
    assert out.dtype == backend.dtype("float16")
    assert lse.dtype == backend.dtype("float32")
    np.testing.assert_allclose(backend.to_numpy(out), pool.oracle()[0], atol=3e-3)


@pytest.mark.parametrize("page_size", [2, 8])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_both_products_against_oracle(backend, xp, page_size, rows, monkeypatch):
    # a tile of no more rows (rows·G) than a page has slots multiplies page by page;
    # other tiles multiply the chunk's keys at once: each case takes the one it names
    new = [1, 1, 1, 1] if rows == "decode" else [3, 9, 1, 6]
    pool = Pool([7, 30, 2, 19], new, page_size=page_size, num_pages=40)
    taken = set()
    step = _paged.step

    def spy(xp_, p, *args, **kwargs):
        taken.add(p.by_page)
        return step(xp_, p, *args, **kwargs)

    monkeypatch.setattr(_paged, "step", spy)
    kw = {"window": (11, 0), "softcap": 3.0}
    out, lse = ragged_paged_attention(*pool.args(backend), return_lse=True, **kw)
    assert taken == {rows == "decode" and page_size == 8}
    expected_out, expected_lse = pool.oracle(**kw)
    assert_close(backend, out, expected_out)
    assert_close(backend, lse, expected_lse)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("name", ["causal", "window", "alibi+window-right"])
def test_traced_plan_matches_the_oracle(backend, xp, name, invariant, monkeypatch):
    # the walk over every chunk and as many tiles as the shapes allow, which jax.jit and
    # torch's tracers take, run eagerly on every backend (invariant: tiles from a
    # multiple of their rows, a request's first and last tiles in part)
    monkeypatch.setattr(paged_driver, "has_concrete_values", lambda x: False)
    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    kw = OPTIONS[name]
    results = ragged_paged_attention(
        *pool.args(backend),
        return_lse=True,
        return_max_logit=True,
        batch_invariant=invariant,
        **_on(backend, kw),
    )
    for got, expected in zip(results, pool.oracle_with_max(**kw), strict=True):
        assert_close(backend, got, expected)


@st.composite
def ragged_batches(draw):
    r = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 24)) for _ in range(r)]
    new = [draw(st.integers(0, n)) for n in lengths]
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    seed = draw(st.integers(0, 2**16))
    window = draw(st.sampled_from([None, (3, 0), (0, 2), (5, 5)]))
    causal = draw(st.booleans())
    return lengths, new, page_size, seed, window, causal


@pytest.mark.bitwise
@pytest.mark.main_kinds
@pytest.mark.skip_backends("jax", reason="compiles a program per shape: the test below")
@given(ragged_batches())
def test_property_any_ragged_batch_matches_the_oracle_and_each_request_alone(backend, xp, case):
    _ragged_batch_matches_the_oracle_and_each_request_alone(backend, case)


@pytest.mark.bitwise
@pytest.mark.backends("jax", reason="a program per shape and request: fewer examples")
@settings(max_examples=6)
@given(ragged_batches())
def test_property_any_ragged_batch_compiled_by_jax(backend, xp, case):
    _ragged_batch_matches_the_oracle_and_each_request_alone(backend, case)


def _ragged_batch_matches_the_oracle_and_each_request_alone(backend, case):
    lengths, new, page_size, seed, window, causal = case
    pages = sum(-(-n // page_size) for n in lengths) + 2
    pool = Pool(lengths, new, page_size=page_size, num_pages=pages, seed=seed, dtype=np.float32)
    kw = {"window": window, "is_causal": causal}
    out, lse = ragged_paged_attention(
        *pool.args(backend, "float32"), return_lse=True, batch_invariant=True, **kw
    )
    out, lse = backend.to_numpy(out), backend.to_numpy(lse)
    expected_out, expected_lse = pool.oracle(**kw)
    np.testing.assert_allclose(out, expected_out, atol=2e-5, rtol=1e-5)
    finite = np.isfinite(expected_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], atol=2e-5, rtol=1e-5)
    # each request alone, its pages reversed in a pool of its own: the same bits
    for r, n in enumerate(lengths):
        a, b = pool.starts[r], pool.starts[r + 1]
        if a == b:
            continue
        own = pool.table[r, : -(-n // page_size)]
        table = np.arange(len(own))[::-1][None, :]
        kp = np.zeros((len(own), page_size, HKV, DK), np.float32)
        vp = np.zeros((len(own), page_size, HKV, DV), np.float32)
        kp[table[0]], vp[table[0]] = pool.key_pages[own], pool.value_pages[own]
        arrays = (pool.query[a:b], kp, vp, table, np.array([n]), np.array([0, b - a]))
        alone = ragged_paged_attention(
            *(backend.asarray(x) for x in arrays), return_lse=True, batch_invariant=True, **kw
        )
        np.testing.assert_array_equal(backend.to_numpy(alone[0]), out[a:b])
        np.testing.assert_array_equal(backend.to_numpy(alone[1]), lse[a:b])


@pytest.mark.backends("jax", reason="jax.jit with traced metadata")
def test_paged_under_jit_matches_the_oracle(backend, xp):
    import jax

    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    kw = OPTIONS["softcap+sinks"] | {"window": (30, 0)}

    @jax.jit
    def call(*args):
        return ragged_paged_attention(*args, return_lse=True, **_on(backend, kw))

    out, lse = call(*pool.args(backend))
    expected_out, expected_lse = pool.oracle(**kw)
    assert_close(backend, out, expected_out)
    assert_close(backend, lse, expected_lse)


def _decode_rows(backend, pools, *, jit=False):
    """The last row of request 0 in each of several calls that hold it, as NumPy."""
    fn = ragged_paged_attention
    if jit:
        import jax

        fn = jax.jit(ragged_paged_attention, static_argnames=("batch_invariant", "return_lse"))
    rows = []
    for pool, row in pools:
        out, lse = fn(*pool.args(backend, "float32"), batch_invariant=True, return_lse=True)
        rows.append((backend.to_numpy(out)[row], backend.to_numpy(lse)[row]))
    return rows


def _holding(lengths, new_rows, target, row, **kw):
    """A pool whose request `target` has the keys, values and query row of ``_ALONE``."""
    pool = Pool(lengths, new_rows, **kw)
    n, ps = len(_ALONE.keys[0]), pool.page_size
    pool.keys[target][:] = _ALONE.keys[0]
    pool.values[target][:] = _ALONE.values[0]
    for t in range(n):
        page, slot = pool.table[target, t // ps], t % ps
        pool.key_pages[page, slot] = _ALONE.keys[0][t]
        pool.value_pages[page, slot] = _ALONE.values[0][t]
    pool.query[row] = _ALONE.query[0]
    return pool, row


_N = 45  # the request every call below holds: 45 keys; the row of its last token
_ALONE = Pool([_N], [1], seed=0)


@pytest.mark.bitwise
@pytest.mark.main_kinds
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_batch_invariant_rows_are_the_same_bits(backend, xp, jit):
    if jit and backend.family != "jax":
        pytest.skip("jax.jit only")
    calls = [
        (_ALONE, 0),  # alone, decoding
        _holding(
            [_N, 300, 7, 64], [1, 1, 7, 1], 0, 0, seed=1, num_pages=128, order=np.arange(128)[::-1]
        ),
        _holding([9, _N, 30], [9, 1, 20], 1, 9, seed=2),  # other pages, beside prefills
        _holding([_N, 20], [12, 3], 0, 11, seed=3),  # the last row of a 12-row chunk
        _holding([_N], [_N], 0, _N - 1, seed=4),  # the whole prompt at once
    ]
    rows = _decode_rows(backend, calls, jit=jit)
    for out, lse in rows[1:]:
        np.testing.assert_array_equal(out, rows[0][0])
        np.testing.assert_array_equal(lse, rows[0][1])
    expected = _ALONE.oracle()[0][0]
    np.testing.assert_allclose(rows[0][0], expected, atol=1e-5, rtol=1e-5)


_PROMPT, _NEW = 300, 48  # a request of 300 + 48 tokens, over three key chunks
_SPLITS = {
    "prefill": [_PROMPT + _NEW],
    "chunks": [_PROMPT, 7, 1, 17, 23],
    "decode": [_PROMPT] + [1] * _NEW,
}


def _fed(backend, splits, page_size, *, jit=False, heads=(HQ, HKV, DK, DV)):
    """The request's rows (out, lse) in float32 when fed in calls of `splits` new rows.

    Each call also holds another request, before it, of a number of rows that changes
    from call to call; the slots the request has not written yet hold NaN.
    """
    n = _PROMPT + _NEW
    num_pages = 2 * (n // page_size) + 12
    pool = Pool([n, 37], [1, 1], page_size=page_size, num_pages=num_pages, heads=heads)
    hq, _, dk, _ = heads
    query = randn(n, hq, dk, seed=11, dtype=np.float32)
    fn = ragged_paged_attention
    if jit:
        import jax

        fn = jax.jit(ragged_paged_attention, static_argnames=("batch_invariant", "return_lse"))
    outs, lses, done = [], [], 0
    for call, rows in enumerate(splits):
        done += rows
        other = call % 5  # the other request's new rows in this call
        kp, vp = pool.key_pages.copy(), pool.value_pages.copy()
        for pos in range(done, n):  # not written yet
            page, slot = pool.table[0, pos // page_size], pos % page_size
            kp[page, slot] = vp[page, slot] = np.nan
        q = np.concatenate(
            [randn(other, hq, dk, seed=call, dtype=np.float32), query[done - rows : done]]
        )
        arrays = (
            q,
            kp.astype(np.float32),
            vp.astype(np.float32),
            pool.table[::-1],
            np.array([37, done]),
            np.array([0, other, other + rows]),
        )
        out, lse = fn(*(backend.asarray(a) for a in arrays), batch_invariant=True, return_lse=True)
        outs.append(backend.to_numpy(out)[other:])
        lses.append(backend.to_numpy(lse)[other:])
    return np.concatenate(outs), np.concatenate(lses)


#: the heads of the held-out check of issue 48 (Hq = 32, Hkv = 8, D = 128), beside the
#: suite's small ones
_HELD_OUT = (32, 8, 128, 128)


@pytest.mark.bitwise
@pytest.mark.main_kinds
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("page_size", "heads"),
    [(4, None), (16, None), (16, _HELD_OUT)],  # a tile's keys at once, or page by page
    ids=["page4", "page16", "page16-hq32-d128"],
)
@pytest.mark.parametrize("split", ["chunks", "decode"])
def test_batch_invariant_chunks_and_decode_steps_equal_one_prefill(
    backend, xp, split, page_size, heads, jit
):
    # 300 + 48 tokens fed as a prompt and chunks of 7, 1, 17, 23, or as 48 decode steps:
    # the same bits as one prefill of all 348, out and lse, whatever the CPU's BLAS kernel
    # rounds by (OpenBLAS's Haswell kernel gave 2e-7 off, a row's bits by its place in
    # the product: the tiles start at multiples of their rows now)
    if jit and backend.family != "jax":
        pytest.skip("jax.jit only")
    if backend.family == "jax" and not jit and (heads, page_size, split) != (None, 16, "chunks"):
        # JAX serves under jit (the case beside this one); eager, each of the walk's
        # operations dispatches alone: 90 s of the JAX session at the held-out shape,
        # 110 s for pages of 4 slots, 24 s for 48 decode steps; the chunks over pages
        # of 16 slots still run eager
        pytest.skip("JAX runs this case under jax.jit, as it serves")
    kw = {"jit": jit, "heads": heads or (HQ, HKV, DK, DV)}
    out, lse = _fed(backend, _SPLITS[split], page_size, **kw)
    expected_out, expected_lse = _fed(backend, _SPLITS["prefill"], page_size, **kw)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(lse, expected_lse)


@pytest.mark.autodiff
@pytest.mark.parametrize("lane", ["walk", "engine"])
def test_paged_gradients_match_central_differences(backend, xp, lane, monkeypatch):
    _lane(monkeypatch, backend, lane)
    pool = Pool([5, 3], [2, 1], page_size=2, num_pages=6, fill=0.0, pad=1)
    pool.query = pool.query[:, :, :3]
    kp, vp = pool.key_pages[..., :3], pool.value_pages[..., :2]
    weights_np = randn(pool.query.shape[0], HQ, 2, seed=4)
    meta = (pool.table, pool.lengths, pool.starts)
    sinks, softcap, slopes = randn(HQ, seed=5), np.asarray(3.0), SLOPES
    kw = {"window": (3, 0)}

    def loss_np(q, k, v, sinks, softcap, slopes):
        out = ragged_paged_attention(
            q, k, v, *meta, sinks=sinks, softcap=softcap, alibi_slopes=slopes, **kw
        )
        return float(np.sum(out * weights_np))

    args = [pool.query, kp, vp, sinks, softcap, slopes]
    expected = central_differences(loss_np, args)
    weights = backend.asarray(weights_np)
    meta_b = tuple(backend.asarray(m) for m in meta)

    def loss(q, k, v, sinks, softcap, slopes):
        out = ragged_paged_attention(
            q, k, v, *meta_b, sinks=sinks, softcap=softcap, alibi_slopes=slopes, **kw
        )
        return xp.sum(out * weights)

    grads = backend.grad(loss, *(backend.asarray(a) for a in args))
    for g, e in zip(grads, expected, strict=True):
        assert_close(backend, g, e, atol=1e-7, rtol=1e-6)


@pytest.mark.autodiff
@pytest.mark.parametrize("lane", ["walk", "engine"])
def test_paged_gradients_stay_finite_over_nan_slots(backend, xp, lane, monkeypatch):
    _lane(monkeypatch, backend, lane)
    pool = Pool([6, 11], [3, 1], page_size=4, num_pages=8)  # NaN in every free slot
    q, kp, vp, *meta = pool.args(backend)

    def loss(q, k, v):
        return xp.sum(ragged_paged_attention(q, k, v, *meta, sinks=backend.asarray(randn(HQ))))

    free = np.isnan(pool.key_pages[..., 0, 0])  # (P, page_size): slots no request holds
    gq, gk, gv = (backend.to_numpy(g) for g in backend.grad(loss, q, kp, vp))
    for g in (gq, gk, gv):
        assert np.all(np.isfinite(g))
    assert np.all(gk[free] == 0.0)
    assert np.all(gv[free] == 0.0)


_CLOSE = {"rtol": 1e-10, "atol": 1e-12}  # assert_close's float64 tolerance, on NumPy copies


def _traced(monkeypatch):
    """Take the walk and the checks that metadata without values takes (jax.jit, tracers)."""
    import portable_attn.serving as serving
    from portable_attn._lib import _validation

    for module in (paged_driver, serving, _validation):
        monkeypatch.setattr(module, "has_concrete_values", lambda x: False)


@pytest.mark.autodiff
@pytest.mark.parametrize("plan", ["host", "traced"])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("nan_in", ["request", "padding"])
def test_a_nan_query_row_reaches_no_other_request(
    backend, xp, nan_in, invariant, plan, monkeypatch
):
    # request 0 (3 new rows) is packed before request 1 (5 rows) and request 2 (2 rows)
    # before 3 padding rows: their tiles have slots to spare, which held the next packed
    # rows (0 · NaN in the backward made request 0's or 2's page gradients NaN)
    if plan == "traced":
        _traced(monkeypatch)
    pool = Pool([7, 9, 6], [3, 5, 2], page_size=4, num_pages=12, pad=3)
    pool.table[1, 3] = pool.table[0, 0]  # past request 1's length: a page of request 0
    nan_row = 3 if nan_in == "request" else 11
    weights = backend.asarray(randn(pool.query.shape[0], HQ, DV, seed=4))
    meta = tuple(backend.asarray(m) for m in (pool.table, pool.lengths, pool.starts))

    def loss(q, k, v, sinks, scale):
        out = ragged_paged_attention(
            q, k, v, *meta, sinks=sinks, scale=scale, batch_invariant=invariant
        )
        return xp.sum(out * weights)

    def grads(query):
        args = (query, pool.key_pages, pool.value_pages, randn(HQ, seed=5), np.asarray(0.3))
        return [backend.to_numpy(g) for g in backend.grad(loss, *map(backend.asarray, args))]

    clean = grads(pool.query)
    query = pool.query.copy()
    query[nan_row, 1, 2] = np.nan
    dirty = grads(query)
    # pool slots of requests 0 and 2, and their query rows: the same gradients
    slots = np.zeros(pool.key_pages.shape[:2], dtype=bool)  # (P, page_size)
    for r in (0, 2):
        for t in range(pool.lengths[r]):
            slots[pool.table[r, t // 4], t % 4] = True
    rows = np.r_[0:3, 8:10]
    for g, c in ((dirty[1], clean[1]), (dirty[2], clean[2])):
        assert np.all(np.isfinite(g[slots]))
        np.testing.assert_allclose(g[slots], c[slots], **_CLOSE)
    np.testing.assert_allclose(dirty[0][rows], clean[0][rows], **_CLOSE)
    if nan_in == "padding":  # nothing reads it: every gradient as without the NaN
        for g, c in zip(dirty, clean, strict=True):
            np.testing.assert_allclose(g, c, **_CLOSE)


_WRONG_METADATA = {
    # request 1 uses logical pages 0..2: page 16 of a 16-page pool, or -1
    "page past the pool": ("table", (1, 2), 16),
    "negative page": ("table", (1, 2), -1),
    "length above the table": ("lengths", 1, 17),  # max_pages * page_size = 16
    "length below the rows": ("lengths", 1, 3),  # 5 new rows
}


def _wrong(name):
    pool = Pool([7, 9, 6], [3, 5, 2], page_size=4, num_pages=16, fill=0.0, order=range(16))
    what, at, value = _WRONG_METADATA[name]
    getattr(pool, what)[at] = value
    return pool


@pytest.mark.parametrize("name", list(_WRONG_METADATA))
def test_wrong_metadata_without_values_gives_nan_rows_of_its_request(
    backend, xp, name, monkeypatch
):
    # no error can be raised on traced metadata: the request's rows come out NaN, never
    # another page's keys (page 16 read page 15, request 2's), the others as the oracle
    _traced(monkeypatch)
    pool = _wrong(name)
    out, lse = ragged_paged_attention(*pool.args(backend), return_lse=True)
    out, lse = backend.to_numpy(out), backend.to_numpy(lse)
    assert np.all(np.isnan(out[3:8]))
    assert np.all(np.isnan(lse[3:8]))
    pool.lengths[1], pool.table[1] = 9, pool.table[0]  # any metadata that fits
    expected_out, expected_lse = pool.oracle()
    others = np.r_[0:3, 8 : pool.query.shape[0]]
    np.testing.assert_allclose(out[others], expected_out[others], **_CLOSE)
    np.testing.assert_allclose(lse[others], expected_lse[others], **_CLOSE)


@pytest.mark.backends("jax", reason="jax.jit with traced metadata")
@pytest.mark.parametrize("name", [*_WRONG_METADATA, "starts past the rows", "starts decrease"])
def test_wrong_metadata_under_jit_gives_nan_rows(backend, xp, name):
    import jax

    if name.startswith("starts"):
        pool = _wrong("page past the pool")
        pool.table[1, 2] = pool.table[0, 2]
        pool.starts[1:] = [3, 8, 30] if name == "starts past the rows" else [3, 2, 10]
        bad = np.arange(pool.query.shape[0])  # the packing itself: every row
    else:
        pool, bad = _wrong(name), np.arange(3, 8)
    call = jax.jit(lambda *a: ragged_paged_attention(*a, return_lse=True))
    out, lse = (backend.to_numpy(x) for x in call(*pool.args(backend)))
    assert np.all(np.isnan(out[bad]))
    assert np.all(np.isnan(lse[bad]))
    assert np.all(np.isfinite(np.delete(out, bad, axis=0)))
    with pytest.raises(ValueError, match=r"page_table|kv_lengths|q_starts"):
        ragged_paged_attention(*pool.args(backend))  # eager: the precise error


@pytest.mark.backends("jax", reason="jax.jit with traced metadata")
@pytest.mark.parametrize("name", ["page past the pool", "negative page", "length above the table"])
def test_write_under_jit_with_wrong_metadata_changes_no_other_page(backend, xp, name):
    import jax

    pool = _wrong(name)
    q, kp, vp, table, lengths, starts = pool.args(backend)
    new_k = backend.asarray(randn(q.shape[0], HKV, DK, seed=5))
    new_v = backend.asarray(randn(q.shape[0], HKV, DV, seed=6))
    k2, v2 = jax.jit(paged_kv_write)(kp, vp, table, lengths, starts, new_k, new_v)
    # requests 0 and 2 written as with metadata that fits, request 1 not at all
    starts_np = pool.starts.copy()
    starts_np[2:] -= 5
    keep = np.r_[0:3, 8 : q.shape[0]]
    fits = (pool.table[[0, 2]], pool.lengths[[0, 2]], starts_np[[0, 1, 3]])
    expected = paged_kv_write(
        kp, vp, *map(backend.asarray, fits), new_k[keep, ...], new_v[keep, ...]
    )
    np.testing.assert_array_equal(backend.to_numpy(k2), backend.to_numpy(expected[0]))
    np.testing.assert_array_equal(backend.to_numpy(v2), backend.to_numpy(expected[1]))


# ---------------------------------------------------------------------------
# one pool for keys and values (MLA's latent cache)


def _one_pool(value_dim):
    """A pool whose values are its keys' first `value_dim` features (NaN in free slots)."""
    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    pool.values = [k[..., :value_dim] for k in pool.keys]
    pool.heads = (HQ, HKV, DK, value_dim)
    return pool


@pytest.mark.parametrize("value_dim", [None, 5])
def test_one_pool_for_keys_and_values(backend, xp, value_dim):
    pool = _one_pool(value_dim or DK)
    q, kp, _, *meta = pool.args(backend)
    kw = {"window": (6, 0), "softcap": 2.0}
    out, lse = ragged_paged_attention(
        q, kp, None, *meta, value_dim=value_dim, return_lse=True, **kw
    )
    expected_out, expected_lse = pool.oracle(**kw)
    assert tuple(out.shape) == (q.shape[0], HQ, value_dim or DK)
    assert_close(backend, out, expected_out)
    assert_close(backend, lse, expected_lse)
    # the write: keys only, into the one pool
    if backend.kind != "numpy_readonly":
        new_k = backend.asarray(randn(q.shape[0], HKV, DK, seed=9))
        k2, v2 = paged_kv_write(kp, None, *meta, new_k, None)
        assert v2 is None
        expected = paged_kv_write(*pool.args(backend)[1:3], *meta, new_k, new_k[..., :DV])[0]
        np.testing.assert_array_equal(backend.to_numpy(k2), backend.to_numpy(expected))


@pytest.mark.autodiff
def test_one_pool_gradients_are_the_keys_and_the_values(backend, xp):
    # the pool's gradient is its keys' plus, on the first value_dim features, its values'
    pool = Pool([5, 3], [2, 1], page_size=2, num_pages=6, fill=0.0, pad=1)
    q, kp, _, *meta = pool.args(backend)
    w = backend.asarray(randn(q.shape[0], HQ, 5, seed=4))

    def one(q, kp):
        return xp.sum(ragged_paged_attention(q, kp, None, *meta, value_dim=5) * w)

    def two(q, kp, vp):
        return xp.sum(ragged_paged_attention(q, kp, vp, *meta) * w)

    gq, gk = backend.grad(one, q, kp)
    eq, ek, ev = backend.grad(two, q, kp, kp[..., :5])
    ek, ev = np.array(backend.to_numpy(ek)), backend.to_numpy(ev)  # a copy to add into
    ek[..., :5] += ev
    assert_close(backend, gq, backend.to_numpy(eq))
    assert_close(backend, gk, ek)


def test_one_pool_is_refused_where_it_cannot_be(backend, xp):
    pool = Pool([5, 9], [2, 1])
    q, kp, vp, *meta = pool.args(backend)
    with pytest.raises(ValueError, match=r"`value_dim` \(9\) must be at most .*Dk = 8"):
        ragged_paged_attention(q, kp, None, *meta, value_dim=9)
    with pytest.raises(ValueError, match=r"`value_dim` \(5\) is for `value_pages=None`"):
        ragged_paged_attention(q, kp, vp, *meta, value_dim=5)
    with pytest.raises(TypeError, match="`value_pages` and `new_values` must both be"):
        paged_kv_write(kp, None, *meta, q[:, :HKV, :], q[:, :HKV, :DV])


# ---------------------------------------------------------------------------
# a step's plan, shared by its layers


def _plan_of(pool, backend, meta, **options):
    return plan_ragged(
        *meta,
        num_tokens=pool.query.shape[0],
        num_q_heads=HQ,
        num_kv_heads=HKV,
        page_size=pool.page_size,
        num_pages=pool.key_pages.shape[0],
        **options,
    )


@pytest.mark.parametrize(
    ("name", "invariant", "traced"),
    [
        ("causal", False, False),
        ("window", True, False),
        ("alibi+window-right", False, True),
        ("window", True, True),
    ],
    ids=["causal-host", "window-invariant-host", "alibi-traced", "window-invariant-traced"],
)
def test_a_plan_serves_every_layer_of_a_step(backend, xp, name, invariant, traced, monkeypatch):
    # two layers (their own pools and queries) given one plan: each layer's rows are
    # the bits of the call that plans for itself, and the metadata is read once
    if traced:
        _traced(monkeypatch)
    kw = OPTIONS[name]
    flags = {k: v for k, v in kw.items() if k in ("is_causal", "window")}
    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    meta = tuple(backend.asarray(m) for m in (pool.table, pool.lengths, pool.starts))
    reads = []
    tiles_of = "bounded_tiles" if traced else "host_tiles"
    original = getattr(_paged, tiles_of)
    monkeypatch.setattr(_paged, tiles_of, lambda *a: reads.append(1) or original(*a))
    plan = _plan_of(pool, backend, meta, batch_invariant=invariant, **flags)
    for layer in range(2):
        q, kp, vp = (
            backend.asarray(x * (layer + 1.0))
            for x in (pool.query, pool.key_pages, pool.value_pages)
        )
        args = (q, kp, vp, *meta)
        opts = {"return_lse": True, "batch_invariant": invariant, **_on(backend, kw)}
        out, lse = ragged_paged_attention(*args, plan=plan, **opts)
        expected_out, expected_lse = ragged_paged_attention(*args, **opts)
        np.testing.assert_array_equal(backend.to_numpy(out), backend.to_numpy(expected_out))
        np.testing.assert_array_equal(backend.to_numpy(lse), backend.to_numpy(expected_lse))
    # the plan's, then each unplanned call's (one compiled program instead: the plan
    # traced in it, nothing read)
    compiled = _route.runs_compiled(_route.library(meta[0]), user_functions=False)
    assert len(reads) == (1 if compiled and not traced else 3)
    out = ragged_paged_attention(
        *pool.args(backend)[:3], *meta, plan=plan, batch_invariant=invariant, **_on(backend, kw)
    )
    assert_close(backend, out, pool.oracle(**kw)[0])


@pytest.mark.backends("jax", reason="jax.jit with traced metadata")
def test_a_plan_built_inside_jit_serves_the_layers(backend, xp):
    import jax

    pool = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
    q, kp, vp, *meta = pool.args(backend)

    def step(q, kp, vp, table, lengths, starts):
        plan = plan_ragged(
            table,
            lengths,
            starts,
            num_tokens=q.shape[0],
            num_q_heads=HQ,
            num_kv_heads=HKV,
            page_size=kp.shape[1],
            num_pages=kp.shape[0],
            window=(6, 0),
        )
        outs = [
            ragged_paged_attention(
                q * s, kp * s, vp, table, lengths, starts, window=(6, 0), plan=plan
            )
            for s in (1.0, 2.0)
        ]
        return xp.stack(outs)

    outs = jax.jit(step)(q, kp, vp, *meta)
    for i, s in enumerate((1.0, 2.0)):
        scaled = Pool([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
        scaled.query, scaled.keys = scaled.query * s, [k * s for k in scaled.keys]
        assert_close(backend, outs[i], scaled.oracle(window=(6, 0))[0])


def test_a_plan_of_another_call_is_refused_by_name(backend, xp):
    pool = Pool([5, 9], [2, 1])
    q, kp, vp, *meta = pool.args(backend)
    plan = _plan_of(pool, backend, meta, window=(3, 0))
    with pytest.raises(TypeError, match="`plan` must be a PagedPlan"):
        ragged_paged_attention(q, kp, vp, *meta, window=(3, 0), plan=object())
    other = backend.asarray(pool.lengths)
    with pytest.raises(ValueError, match=r"other metadata.*`kv_lengths`"):
        ragged_paged_attention(q, kp, vp, meta[0], other, meta[2], window=(3, 0), plan=plan)
    with pytest.raises(ValueError, match=r"window=\(3, 0\), but this call has window=None"):
        ragged_paged_attention(q, kp, vp, *meta, plan=plan)
    no_window = _plan_of(pool, backend, meta, window=(None, None))  # no window, either way
    ragged_paged_attention(q, kp, vp, *meta, plan=no_window)
    with pytest.raises(ValueError, match="batch_invariant=False, but this call has"):
        ragged_paged_attention(q, kp, vp, *meta, window=(3, 0), batch_invariant=True, plan=plan)
    with pytest.raises(ValueError, match=r"num_tokens=5, but this call has 4 \(axis 0 of `query`"):
        ragged_paged_attention(q[:-1, ...], kp, vp, *meta, window=(3, 0), plan=plan)
    with pytest.raises(
        ValueError, match=r"num_pages=48, but this call has 47 \(axis 0 of `key_pages`\)"
    ):
        ragged_paged_attention(q, kp[:-1, ...], vp[:-1, ...], *meta, window=(3, 0), plan=plan)
    with pytest.raises(ValueError, match=r"Hq=3 \(`num_q_heads`\) and Hkv=2 from `num_kv_heads`"):
        plan_ragged(*meta, num_tokens=5, num_q_heads=3, num_kv_heads=2, page_size=4, num_pages=48)
    with pytest.raises(TypeError, match="`page_size` must be a positive integer"):
        plan_ragged(
            *meta, num_tokens=5, num_q_heads=4, num_kv_heads=2, page_size=4.0, num_pages=48
        )
    bad = pool.table.copy()
    bad[1, 0] = 99
    with pytest.raises(ValueError, match=r"`page_table`\[1, 0\] = 99 is not a page of the pool"):
        plan_ragged(
            backend.asarray(bad),
            *meta[1:],
            num_tokens=5,
            num_q_heads=4,
            num_kv_heads=2,
            page_size=4,
            num_pages=48,
        )


@pytest.mark.backends("jax", reason="jax.jit with a traced page table")
def test_a_traced_page_table_alone_gives_nan_rows_for_a_page_outside_the_pool(backend, xp):
    # lengths and starts closed over (values), the table traced: the eager checks cannot
    # see the page, so the request's rows are NaN (it read another request's page before)
    import jax

    pool = Pool([5, 9], [2, 1], num_pages=8, fill=0.0)  # every page finite
    q, kp, vp, _, lengths, starts = pool.args(backend)
    bad = pool.table.copy()
    bad[1, 1] = 8  # past the pool of 8 pages; request 1 uses its second page
    out = jax.jit(lambda t: ragged_paged_attention(q, kp, vp, t, lengths, starts))(
        backend.asarray(bad)
    )
    out = backend.to_numpy(out)
    assert np.all(np.isnan(out[2]))
    assert np.all(np.isfinite(out[:2]))


# ---------------------------------------------------------------------------
# explicit query positions

#: rows at positions the bottom-right rule does not give: rows in any order and at the
#: same position (request 0), a chunk of a prompt written in full (request 1), a row
#: among keys written after it (request 3), the bottom-right rows (request 5)
_POSITIONED = ([5, 40, 1, 70, 9, 23], [5, 20, 1, 1, 0, 17])
_POSITIONS = np.concatenate(
    [[4, 0, 2, 2, 1], np.arange(10, 30), [0], [33], np.arange(6, 23), [7, 7]]
).astype(np.int64)


def _positions_oracle(
    pool, positions, *, is_causal=True, window=None, alibi_slopes=None, rule=None, **kw
):
    """out (T, Hq, Dv) and lse (T, Hq) in float64 of rows at `positions`, as masks and biases."""
    t = pool.query.shape[0]
    hq, _, _, dv = pool.heads
    out, lse = np.zeros((t, hq, dv)), np.full((t, hq), -np.inf)
    for r, m in enumerate(pool.lengths):
        a, b = pool.starts[r], pool.starts[r + 1]
        if a == b:
            continue
        pos, keys = positions[a:b, None], np.arange(m)[None, :]
        allow = np.ones((b - a, m), dtype=bool)
        if is_causal:
            allow &= keys <= pos
        left, right = window or (None, None)
        if left is not None:
            allow &= keys >= pos - left
        if right is not None:
            allow &= keys <= pos + right
        if rule is not None:
            allow &= rule(pos, keys)
        terms = {"mask": allow[None, None]}
        if alibi_slopes is not None:
            terms["bias"] = -alibi_slopes[None, :, None, None] * np.abs(pos - keys)[None, None]
        q = pool.query[a:b].astype(np.float64).transpose(1, 0, 2)[None]
        k = pool.keys[r].transpose(1, 0, 2)[None]
        v = pool.values[r].transpose(1, 0, 2)[None]
        out[a:b] = reference_attention(q, k, v, **terms, **kw)[0].transpose(1, 0, 2)
        lse[a:b] = reference_lse(q, k, **terms, **kw)[0].transpose(1, 0)
    return out, lse


@pytest.mark.parametrize("lane", ["host", "host-invariant", "traced-invariant"])
@pytest.mark.parametrize("name", ["causal", "window", "softcap+sinks", "alibi+window-right"])
def test_q_positions_against_oracle(backend, xp, name, lane, monkeypatch):
    # the band, ALiBi and the chunks a tile visits follow each row's own position; on
    # the host plan and on the traced one (jax.jit's, torch tracers'), tiles of any rows;
    # metadata of 32-bit integers (JAX's default)
    if lane.startswith("traced"):
        monkeypatch.setattr(paged_driver, "has_concrete_values", lambda x: False)
    pool = Pool(*_POSITIONED)
    kw = OPTIONS[name]
    q, kp, vp, *meta = pool.args(backend)
    meta = [backend.asarray(backend.to_numpy(x).astype(np.int32)) for x in meta]  # 32 bits
    out, lse = ragged_paged_attention(
        q,
        kp,
        vp,
        *meta,
        q_positions=backend.asarray(_POSITIONS.astype(np.int32)),
        return_lse=True,
        batch_invariant=lane.endswith("invariant"),
        **_on(backend, kw),
    )
    expected_out, expected_lse = _positions_oracle(pool, _POSITIONS, **kw)
    assert_close(backend, out, expected_out)
    assert_close(backend, lse, expected_lse)


def test_q_positions_feed_the_rules(backend, xp):
    # a mask_mod and a score_mod see each row's given position as q_pos
    pool = Pool(*_POSITIONED)

    def mask_mod(r, h, q, k):
        return (q - k) % 3 != 1

    def score_mod(s, r, h, q, k):  # ALiBi of slope 0.25, by the rule
        return s - 0.25 * xp.astype(xp.abs(q - k), s.dtype)

    out = ragged_paged_attention(
        *pool.args(backend),
        q_positions=backend.asarray(_POSITIONS),
        is_causal=False,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    expected, _ = _positions_oracle(
        pool,
        _POSITIONS,
        is_causal=False,
        alibi_slopes=np.full(HQ, 0.25),
        rule=lambda q, k: (q - k) % 3 != 1,
    )
    assert_close(backend, out, expected)


@pytest.mark.bitwise
@pytest.mark.main_kinds
def test_q_positions_at_the_bottom_right_are_the_default_bits(backend, xp):
    # the positions the call would take: the same bits (batch_invariant walks both)
    pool = Pool(*_POSITIONED)
    counts = np.diff(pool.starts)
    bottom_right = np.concatenate(
        [np.arange(m - n, m) for m, n in zip(pool.lengths, counts, strict=True)] + [[0, 0]]
    )
    args = pool.args(backend, "float32")
    given = ragged_paged_attention(
        *args, q_positions=backend.asarray(bottom_right), batch_invariant=True, return_lse=True
    )
    default = ragged_paged_attention(*args, batch_invariant=True, return_lse=True)
    for x, y in zip(given, default, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(x), backend.to_numpy(y))


@pytest.mark.bitwise
@pytest.mark.main_kinds
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_prompt_written_in_full_then_computed_in_chunks_has_the_prefill_bits(backend, xp, jit):
    # the whole prompt's keys are in the pool before its rows are computed, in chunks of
    # 7, 100, 1 and 240 rows at their positions: the bits of the prefill of all 348
    if jit and backend.family != "jax":
        pytest.skip("jax.jit only")
    if not jit and backend.family == "jax":  # each operation of the walk dispatched alone
        pytest.skip("JAX serves under jax.jit: the case beside this one")
    n = _PROMPT + _NEW
    pool = Pool([n], [n], pad=0, num_pages=96)
    fn = ragged_paged_attention
    if jit:
        import jax

        fn = jax.jit(ragged_paged_attention, static_argnames=("batch_invariant", "return_lse"))
    q, kp, vp, table, lengths, _ = pool.args(backend, "float32")
    prefill = fn(
        q,
        kp,
        vp,
        table,
        lengths,
        backend.asarray(np.array([0, n])),
        batch_invariant=True,
        return_lse=True,
    )
    outs, lses, done = [], [], 0
    for rows in (7, 100, 1, 240):
        starts = backend.asarray(np.array([0, rows]))
        positions = backend.asarray(np.arange(done, done + rows))
        out, lse = fn(
            q[done : done + rows, ...],
            kp,
            vp,
            table,
            lengths,
            starts,
            q_positions=positions,
            batch_invariant=True,
            return_lse=True,
        )
        outs.append(backend.to_numpy(out))
        lses.append(backend.to_numpy(lse))
        done += rows
    np.testing.assert_array_equal(np.concatenate(outs), backend.to_numpy(prefill[0]))
    np.testing.assert_array_equal(np.concatenate(lses), backend.to_numpy(prefill[1]))


def test_q_positions_are_checked(backend, xp):
    pool = Pool(*_POSITIONED)
    args = pool.args(backend)
    bad = _POSITIONS.copy()
    bad[20] = 40  # a row of request 1, which has 40 keys
    with pytest.raises(ValueError, match=r"`q_positions`\[20\] = 40 .* request 1: 0 <= position"):
        ragged_paged_attention(*args, q_positions=backend.asarray(bad))
    bad[20] = -1
    with pytest.raises(ValueError, match=r"`q_positions`\[20\] = -1"):
        ragged_paged_attention(*args, q_positions=backend.asarray(bad))
    with pytest.raises(ValueError, match=r"`query` axis 0 and `q_positions` axis 0 \(T\)"):
        ragged_paged_attention(*args, q_positions=backend.asarray(_POSITIONS[:-1]))
    with pytest.raises(TypeError, match="`q_positions` must be an integer array"):
        ragged_paged_attention(*args, q_positions=backend.asarray(_POSITIONS * 1.0))
    meta = args[3:]
    shape = {"num_q_heads": HQ, "num_kv_heads": HKV, "page_size": 4, "num_pages": 48}
    t = len(_POSITIONS)
    with pytest.raises(ValueError, match=r"`q_positions` must have shape \(T,\) = \(47,\)"):
        plan_ragged(*meta, q_positions=backend.asarray(_POSITIONS), num_tokens=t + 1, **shape)
    plan = plan_ragged(*meta, num_tokens=t, **shape)  # without positions
    with pytest.raises(ValueError, match="pass the `q_positions` array given to plan_ragged"):
        ragged_paged_attention(*args, q_positions=backend.asarray(_POSITIONS), plan=plan)
    positions = backend.asarray(_POSITIONS)
    plan = plan_ragged(*meta, q_positions=positions, num_tokens=t, **shape)
    expected = ragged_paged_attention(*args, q_positions=positions)
    assert_close(
        backend, ragged_paged_attention(*args, q_positions=positions, plan=plan), expected
    )


@pytest.mark.backends("jax", reason="JAX without jax_enable_x64: 32-bit integers")
def test_q_positions_with_jax_default_integers(backend, xp):
    # under jax.jit the tiles' spans took a 64-bit sentinel, which JAX's int32 refused
    import jax
    import jax.numpy as jnp

    pool = Pool(*_POSITIONED)
    arrays = [np.asarray(x) for x in pool.args(backend)]
    was = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", False)
    try:
        args = [
            jnp.asarray(x.astype(np.float32 if x.dtype.kind == "f" else np.int32)) for x in arrays
        ]
        positions = jnp.asarray(_POSITIONS.astype(np.int32))
        outs = [
            np.asarray(
                jax.jit(ragged_paged_attention, static_argnames="batch_invariant")(
                    *args, q_positions=positions, batch_invariant=inv
                )
            )
            for inv in (False, True)
        ]
    finally:
        jax.config.update("jax_enable_x64", was)
    expected = _positions_oracle(pool, _POSITIONS)[0]
    for out in outs:
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.backends("jax", reason="jax.jit with traced positions")
def test_q_positions_outside_their_request_under_jit_give_nan_rows(backend, xp):
    import jax

    pool = Pool(*_POSITIONED)
    bad = _POSITIONS.copy()
    bad[20] = 40  # a row of request 1, past its 40 keys
    out = jax.jit(lambda *a, q_positions: ragged_paged_attention(*a, q_positions=q_positions))(
        *pool.args(backend), q_positions=backend.asarray(bad)
    )
    out = backend.to_numpy(out)
    assert np.all(np.isnan(out[20]))
    rest = np.delete(out, 20, axis=0)
    expected = np.delete(_positions_oracle(pool, _POSITIONS)[0], 20, axis=0)
    np.testing.assert_allclose(rest, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mods", [False, True], ids=["plain", "mods"])
def test_varlen_without_requests_gives_padding_rows(backend, xp, mods):
    # R = 0 (starts [0]): every row is padding (an IndexError before); a mask_mod or
    # score_mod indexing per-request arrays (of no request) is never called
    q, k = randn(3, HQ, DK, seed=1), randn(5, HKV, DK, seed=2)
    none = backend.asarray(np.zeros(1, np.int64))
    kw = {}
    if mods:
        empty = backend.asarray(np.zeros(0, np.int64))
        mask_mod, score_mod = _mods(xp, empty, backend.asarray(randn(HQ, 2 * _SPAN)))
        kw = {"mask_mod": mask_mod, "score_mod": score_mod}
    out, lse, top = varlen_attention(
        backend.asarray(q),
        backend.asarray(k),
        backend.asarray(k),
        none,
        none,
        return_lse=True,
        return_max_logit=True,
        **kw,
    )
    assert np.all(backend.to_numpy(out) == 0.0)
    assert np.all(backend.to_numpy(lse) == -np.inf)
    assert np.all(backend.to_numpy(top) == -np.inf)


# ---------------------------------------------------------------------------
# the write


def test_write_then_attend_equals_the_oracle(backend, xp):
    lengths_before, new = np.array([3, 0, 9]), np.array([2, 4, 1])
    pool = Pool(list(lengths_before + new), list(new), num_pages=16, fill=0.0)
    # the pool as it was before: the new tokens' slots zero, then written
    kp, vp = pool.key_pages.copy(), pool.value_pages.copy()
    new_k = np.zeros((pool.query.shape[0], HKV, DK))
    new_v = np.zeros((pool.query.shape[0], HKV, DV))
    new_k[-2:] = np.nan  # padding rows: never written
    for r, (before, n) in enumerate(zip(lengths_before, new, strict=True)):
        for i in range(n):
            t, pos = pool.starts[r] + i, before + i
            page, slot = pool.table[r, pos // 4], pos % 4
            new_k[t], new_v[t] = kp[page, slot], vp[page, slot]
            kp[page, slot] = vp[page, slot] = 0.0
    kb, vb = backend.asarray(kp), backend.asarray(vp)
    if backend.kind == "numpy_readonly":
        with pytest.raises(ValueError, match="read-only"):
            paged_kv_write(
                kb,
                vb,
                *(backend.asarray(m) for m in (pool.table, pool.lengths, pool.starts)),
                backend.asarray(new_k),
                backend.asarray(new_v),
            )
        return
    meta = tuple(backend.asarray(m) for m in (pool.table, pool.lengths, pool.starts))
    k2, v2 = paged_kv_write(kb, vb, *meta, backend.asarray(new_k), backend.asarray(new_v))
    np.testing.assert_array_equal(backend.to_numpy(k2), pool.key_pages)
    np.testing.assert_array_equal(backend.to_numpy(v2), pool.value_pages)
    if backend.family in ("numpy", "torch", "cupy"):
        assert k2 is kb  # in place, as documented
        assert v2 is vb
    else:
        np.testing.assert_array_equal(backend.to_numpy(kb), kp)  # the given pools unchanged
    out = ragged_paged_attention(backend.asarray(pool.query), k2, v2, *meta)
    assert_close(backend, out, pool.oracle()[0])


def test_write_and_attend_with_the_step_plan(backend, xp, monkeypatch):
    # the write takes the step's plan too: the same pools as the write that plans for
    # itself, without reading the metadata again (its slots are the plan's)
    if backend.kind == "numpy_readonly":
        pytest.skip("writes into the pools")
    lengths_before, new = np.array([3, 0, 9]), np.array([2, 4, 1])
    pool = Pool(list(lengths_before + new), list(new), num_pages=16, fill=0.0)
    meta = tuple(backend.asarray(m) for m in (pool.table, pool.lengths, pool.starts))
    plan = _plan_of(pool, backend, meta)
    new_k = randn(pool.query.shape[0], HKV, DK, seed=5)
    new_v = randn(pool.query.shape[0], HKV, DV, seed=6)
    written = []
    for with_plan in (False, True):
        kp, vp = backend.asarray(pool.key_pages), backend.asarray(pool.value_pages)
        if with_plan:  # no host read of the metadata, no check of it
            import portable_attn.serving as serving

            monkeypatch.setattr(serving, "check_paged_metadata", None)
            monkeypatch.setattr(serving, "to_host", None)
        kw = {"plan": plan} if with_plan else {}
        k2, v2 = paged_kv_write(
            kp, vp, *meta, backend.asarray(new_k), backend.asarray(new_v), **kw
        )
        out = ragged_paged_attention(backend.asarray(pool.query), k2, v2, *meta, **kw)
        written.append([backend.to_numpy(x) for x in (k2, v2, out)])
    for a, b in zip(*written, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"num_kv_heads=2, but this call has 1 \(axis 2"):
        paged_kv_write(
            kp[:, :, :1, :],
            vp[:, :, :1, :],
            *meta,
            backend.asarray(new_k[:, :1, :]),
            backend.asarray(new_v[:, :1, :]),
            plan=plan,
        )


@pytest.mark.backends("torch", reason="a torch tracer (make_fx), whose metadata has no values")
def test_write_under_a_torch_tracer_leaves_padding_rows_out(backend, xp):
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    pool = Pool([4, 6], [1, 2], num_pages=8, fill=0.0)
    q, kp, vp, table, lengths, starts = pool.args(backend)
    new_k = backend.asarray(np.full((q.shape[0], HKV, DK), 9.0))  # 2 padding rows at the end
    new_v = backend.asarray(np.full((q.shape[0], HKV, DV), 9.0))

    def write(kp, vp, table, lengths, starts, new_k, new_v):
        return paged_kv_write(kp, vp, table, lengths, starts, new_k, new_v)

    traced = make_fx(write)(kp.clone(), vp.clone(), table, lengths, starts, new_k, new_v)
    k2, _ = traced(kp.clone(), vp.clone(), table, lengths, starts, new_k, new_v)
    expected, _ = write(kp.clone(), vp.clone(), table, lengths, starts, new_k, new_v)
    assert int(torch.sum(expected == 9.0)) == 3 * HKV * DK  # the 3 rows of the requests
    np.testing.assert_array_equal(backend.to_numpy(k2), backend.to_numpy(expected))


@pytest.mark.backends("jax", reason="jax.jit with donated pools")
def test_write_under_jit_with_donation(backend, xp):
    import jax

    pool = Pool([4, 6], [1, 2], num_pages=8, fill=0.0)
    q, kp, vp, table, lengths, starts = pool.args(backend)
    new_k = backend.asarray(randn(q.shape[0], HKV, DK, seed=5))
    new_v = backend.asarray(randn(q.shape[0], HKV, DV, seed=6))
    step = jax.jit(paged_kv_write, donate_argnums=(0, 1))
    k2, v2 = step(kp, vp, table, lengths, starts, new_k, new_v)
    expected = paged_kv_write(*pool.args(backend)[1:], new_k, new_v)
    np.testing.assert_array_equal(backend.to_numpy(k2), backend.to_numpy(expected[0]))
    np.testing.assert_array_equal(backend.to_numpy(v2), backend.to_numpy(expected[1]))


# ---------------------------------------------------------------------------
# packed variable-length sequences


def _varlen_oracle(q, k, v, qs, ks, *, with_max=False, **kw):
    t = q.shape[0]
    out, lse = np.zeros((t, HQ, v.shape[-1])), np.full((t, HQ), -np.inf)
    top = np.full((t, HQ), -np.inf)
    for r in range(len(qs) - 1):
        a, b, c, d = qs[r], qs[r + 1], ks[r], ks[r + 1]
        if a == b:
            continue
        qr, kr, vr = (x.transpose(1, 0, 2)[None] for x in (q[a:b], k[c:d], v[c:d]))
        out[a:b] = reference_attention(qr, kr, vr, **kw)[0].transpose(1, 0, 2)
        lse[a:b] = reference_lse(qr, kr, **kw)[0].transpose(1, 0)
        logit_kw = {n: x for n, x in kw.items() if n != "sinks"}
        top[a:b] = reference_max_logit(qr, kr, **logit_kw)[0].transpose(1, 0)
    return (out, lse, top) if with_max else (out, lse)


VARLEN = {
    "plain": {},
    "causal": {"is_causal": True},
    "window+sinks": {"is_causal": True, "window": (3, 0), "sinks": randn(HQ, seed=2)},
    "alibi+softcap": {"alibi_slopes": SLOPES, "softcap": 1.5, "window": (4, 2)},
}


@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen_against_oracle(backend, xp, name):
    qs, ks = np.array([0, 5, 6, 6, 14]), np.array([0, 9, 10, 13, 21])  # Lq != Lk per request
    q, k, v = randn(16, HQ, DK, seed=1), randn(22, HKV, DK, seed=2), randn(22, HKV, DV, seed=3)
    kw = VARLEN[name]
    out, lse, top = varlen_attention(
        *(backend.asarray(a) for a in (q, k, v, qs, ks)),
        return_lse=True,
        return_max_logit=True,
        **_on(backend, kw),
    )
    expected = _varlen_oracle(q, k, v, qs, ks, with_max=True, **kw)
    for got, want in zip((out, lse, top), expected, strict=True):
        assert_close(backend, got, want)
    assert np.all(backend.to_numpy(out)[14:] == 0.0)
    assert np.all(backend.to_numpy(top)[14:] == -np.inf)


_PACKED = {  # q_starts, kv_starts (None: the same array), T, S
    "same array": ([0, 5, 6, 6, 14], None, 16, 16),
    "equal values": ([0, 5, 6, 6, 14], [0, 5, 6, 6, 14], 16, 16),
    "equal values, S > T": ([0, 5, 6, 6, 14], [0, 5, 6, 6, 14], 16, 18),
    "one shift": ([0, 5, 6, 6, 14], [0, 7, 8, 8, 16], 16, 18),
}


@pytest.mark.parametrize("name", ["window+sinks", "alibi+softcap"])
@pytest.mark.parametrize("starts", list(_PACKED))
def test_varlen_packed_training_against_oracle(backend, xp, starts, name, monkeypatch):
    # where every request's rows sit on its keys as the packed call's rows on its keys
    # (kv_starts[r+1] - q_starts[r+1] == S - T), the band, window and ALiBi are the call's
    # own, with the segments: no mask_mod or score_mod (which the other cases take)
    import portable_attn.serving as serving
    from portable_attn._lib._compat import reads_host_values

    qs, ks, t, s = _PACKED[starts]
    q, k, v = randn(t, HQ, DK, seed=1), randn(s, HKV, DK, seed=2), randn(s, HKV, DV, seed=3)
    kw = VARLEN[name]
    qs_b = backend.asarray(np.array(qs))
    ks_b = qs_b if ks is None else backend.asarray(np.array(ks))
    if ks is not None and not reads_host_values(qs_b):
        pytest.skip("starts read on the host only where that is free: the case above")
    given = []
    call = serving.scaled_dot_product_attention

    def spy(*args, **options):
        given.append(options)
        return call(*args, **options)

    monkeypatch.setattr(serving, "scaled_dot_product_attention", spy)
    arrays = (backend.asarray(a) for a in (q, k, v))
    out, lse = varlen_attention(*arrays, qs_b, ks_b, return_lse=True, **_on(backend, kw))
    expected = _varlen_oracle(q, k, v, qs, qs if ks is None else ks, **kw)
    assert_close(backend, out, expected[0])
    assert_close(backend, lse, expected[1])
    (options,) = given
    aligned = starts != "equal values, S > T"
    assert (options.get("mask_mod") is None and options.get("score_mod") is None) == aligned


_MOD_STARTS = {  # q_starts, kv_starts (None: the same array), T, S
    "unequal": ([0, 5, 6, 6, 14], [0, 9, 10, 13, 21], 16, 22),
    "same array": ([0, 5, 6, 6, 14], None, 16, 16),
}
_PREFIX = np.array([3, 0, 2, 4])  # per request: keys below it seen both ways
_SPAN = 32  # the learned table's relative distances: -31 .. 32


def _at(xp, values, idx):
    """``values[idx]`` for an index array of any shape, by ``take``."""
    return xp.reshape(xp.take(values, xp.reshape(idx, (-1,))), idx.shape)


def _mods(xp, prefix, table):
    def prefix_mask(r, h, q, k):
        return xp.logical_or(k <= q, k < _at(xp, prefix, r))

    def relative_bias(s, r, h, q, k):
        d = xp.clip(q - k + _SPAN - 1, 0, 2 * _SPAN - 1)
        return s + xp.astype(_at(xp, xp.reshape(table, (-1,)), h * 2 * _SPAN + d), s.dtype)

    return prefix_mask, relative_bias


def _mods_oracle(q, k, v, qs, ks, table):
    """Per request: the prefix mask and the relative bias as arrays, in float64."""
    out = np.zeros((q.shape[0], HQ, v.shape[-1]))
    for r in range(len(qs) - 1):
        a, b, c, d = qs[r], qs[r + 1], ks[r], ks[r + 1]
        if a == b:
            continue
        qp = (d - c) - (b - a) + np.arange(b - a)  # bottom-right positions
        kp = np.arange(d - c)
        mask = (kp[None, :] <= qp[:, None]) | (kp[None, :] < _PREFIX[r])
        rel = np.clip(qp[:, None] - kp[None, :] + _SPAN - 1, 0, 2 * _SPAN - 1)
        bias = table[:, rel]  # (Hq, n, m)
        qr, kr, vr = (x.transpose(1, 0, 2)[None] for x in (q[a:b], k[c:d], v[c:d]))
        got = reference_attention(qr, kr, vr, mask=mask[None, None], bias=bias[None])
        out[a:b] = got[0].transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("starts", list(_MOD_STARTS))
def test_varlen_mask_and_score_mods_against_oracle(backend, xp, starts):
    # a prefix seen both ways (prefix-LM) and a learned relative bias, per request, in
    # the request's own positions, on both of varlen's paths
    qs, ks, t, s = _MOD_STARTS[starts]
    ks = qs if ks is None else ks
    q, k, v = randn(t, HQ, DK, seed=1), randn(s, HKV, DK, seed=2), randn(s, HKV, DV, seed=3)
    table = randn(HQ, 2 * _SPAN, seed=4)
    qs_b = backend.asarray(np.array(qs))
    ks_b = qs_b if starts == "same array" else backend.asarray(np.array(ks))
    mask_mod, score_mod = _mods(xp, backend.asarray(_PREFIX), backend.asarray(table))
    out = varlen_attention(
        *(backend.asarray(a) for a in (q, k, v)),
        qs_b,
        ks_b,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    assert_close(backend, out, _mods_oracle(q, k, v, qs, ks, table))
    assert np.all(backend.to_numpy(out)[14:] == 0.0)  # padding rows


@pytest.mark.autodiff
def test_varlen_learned_score_mod_gradients_match_central_differences(backend, xp):
    qs, ks = np.array([0, 2, 5]), np.array([0, 3, 5])
    q, k, v = randn(5, HQ, 3, seed=1), randn(5, HKV, 3, seed=2), randn(5, HKV, 2, seed=3)
    w = randn(5, HQ, 2, seed=4)
    table = randn(HQ, 2 * _SPAN, seed=5)

    def loss_np(table):
        _, score_mod = _mods(np, _PREFIX, table)
        out = varlen_attention(q, k, v, qs, ks, is_causal=True, score_mod=score_mod)
        return float(np.sum(out * w))

    expected = central_differences(loss_np, [table])[0]
    arrays = [backend.asarray(a) for a in (q, k, v, qs, ks, w)]

    def loss(table):
        _, score_mod = _mods(xp, backend.asarray(_PREFIX), table)
        out = varlen_attention(*arrays[:5], is_causal=True, score_mod=score_mod)
        return xp.sum(out * arrays[5])

    (grad,) = backend.grad(loss, backend.asarray(table))
    assert_close(backend, grad, expected, atol=1e-7, rtol=1e-6)


def test_varlen_mods_must_be_callable(backend, xp):
    q = backend.asarray(randn(4, HQ, DK, seed=1))
    k = backend.asarray(randn(4, HKV, DK, seed=2))
    starts = backend.asarray(np.array([0, 4]))
    with pytest.raises(TypeError, match=r"`mask_mod` must be callable as mask_mod\(request"):
        varlen_attention(q, k, k, starts, starts, mask_mod=3)
    with pytest.raises(TypeError, match="`score_mod` must be callable"):
        varlen_attention(q, k, k, starts, starts, score_mod="bias")


def _paged_mods_oracle(pool, table):
    """The prefix mask and relative bias of :func:`_mods` over a pool's requests."""
    keys, values = np.concatenate(pool.keys), np.concatenate(pool.values)
    kv_starts = np.concatenate([[0], np.cumsum(pool.lengths)])
    return _mods_oracle(pool.query, keys, values, pool.starts, kv_starts, table)


@pytest.mark.parametrize("lane", ["default", "walk", "engine", "invariant", "traced"])
def test_paged_mask_and_score_mods_against_oracle(backend, xp, lane, monkeypatch):
    # varlen's prefix-LM mask and learned relative bias, per request in its own
    # positions: on the walk's decode rows and chunks, on the engine's calls over a
    # request's gathered pages (by default the requests of 20 and 17 rows), and on the
    # walk of traced metadata (jax.jit's: every chunk, the tiles' requests traced)
    if lane == "walk" and backend.family == "jax":
        pytest.skip("JAX walks every request by default (the case beside this one)")
    if lane == "traced":
        _traced(monkeypatch)
    _lane(monkeypatch, backend, lane)
    pool = Pool([5, 40, 9, 23], [5, 20, 1, 17])
    table = randn(HQ, 2 * _SPAN, seed=4)
    mask_mod, score_mod = _mods(xp, backend.asarray(_PREFIX), backend.asarray(table))
    out = ragged_paged_attention(
        *pool.args(backend),
        is_causal=False,
        mask_mod=mask_mod,
        score_mod=score_mod,
        batch_invariant=lane == "invariant",
    )
    assert_close(backend, out, _paged_mods_oracle(pool, table))
    assert np.all(backend.to_numpy(out)[-2:] == 0.0)  # padding rows


@pytest.mark.parametrize("lane", ["default", "walk", "engine", "varlen"])
def test_ready_rules_see_each_requests_positions(backend, xp, lane, monkeypatch):
    # Llama 4's chunked local attention per request: a ready rule aligned by the call
    # (offset=None) sees the positions the batched calls give (bottom-right already)
    from portable_attn.block_mask import chunked_mask_mod

    if lane == "walk" and backend.family == "jax":
        pytest.skip("JAX walks every request by default (the case beside this one)")
    _lane(monkeypatch, backend, "default" if lane == "varlen" else lane)
    pool = Pool([5, 40, 9, 23], [5, 20, 1, 17])
    rule = chunked_mask_mod(8)
    if lane == "varlen":
        arrays = (backend.asarray(a) for a in _packed(pool, np.arange(4)))
        out = varlen_attention(*arrays, is_causal=True, mask_mod=rule)
    else:
        out = ragged_paged_attention(*pool.args(backend), mask_mod=rule)
    expected = np.zeros((pool.query.shape[0], HQ, DV))
    for r in range(4):
        a, b = pool.starts[r], pool.starts[r + 1]
        qp = pool.lengths[r] - (b - a) + np.arange(b - a)
        kp = np.arange(pool.lengths[r])
        mask = (kp[None, :] <= qp[:, None]) & (kp[None, :] // 8 == qp[:, None] // 8)
        q, k, v = (
            x.transpose(1, 0, 2)[None] for x in (pool.query[a:b], pool.keys[r], pool.values[r])
        )
        if a < b:
            expected[a:b] = reference_attention(q, k, v, mask=mask[None, None])[0].transpose(
                1, 0, 2
            )
    t = int(pool.starts[-1])
    assert_close(backend, out[:t, ...], expected[:t])


@pytest.mark.autodiff
@pytest.mark.parametrize("lane", ["walk", "engine"])
def test_paged_learned_score_mod_gradients_match_central_differences(
    backend, xp, lane, monkeypatch
):
    pool = Pool([5, 9], [3, 2], heads=(HQ, HKV, 3, 2), num_pages=8)
    w = randn(pool.query.shape[0], HQ, 2, seed=4)
    table = randn(HQ, 2 * _SPAN, seed=5)
    prefix = np.array([1, 0])

    def loss_np(table):
        _, score_mod = _mods(np, prefix, table)
        host = (pool.query, pool.key_pages, pool.value_pages, pool.table)
        out = ragged_paged_attention(*host, pool.lengths, pool.starts, score_mod=score_mod)
        return float(np.sum(out * w))

    expected = central_differences(loss_np, [table])[0]
    _lane(monkeypatch, backend, lane)
    arrays = pool.args(backend)
    w_b = backend.asarray(w)

    def loss(table):
        _, score_mod = _mods(xp, backend.asarray(prefix), table)
        return xp.sum(ragged_paged_attention(*arrays, score_mod=score_mod) * w_b)

    (grad,) = backend.grad(loss, backend.asarray(table))
    assert_close(backend, grad, expected, atol=1e-7, rtol=1e-6)


def test_paged_mods_are_checked(backend, xp):
    pool = Pool([5, 9], [3, 2])
    args = pool.args(backend)
    with pytest.raises(TypeError, match=r"`mask_mod` must be callable as mask_mod\(request"):
        ragged_paged_attention(*args, mask_mod=3)
    with pytest.raises(TypeError, match="`score_mod` must be callable"):
        ragged_paged_attention(*args, score_mod="bias")
    with pytest.raises(TypeError, match="`mask_mod` must return a boolean array"):
        ragged_paged_attention(*args, mask_mod=lambda r, h, q, k: q - k)
    with pytest.raises(ValueError, match="`score_mod` must return the shape"):
        ragged_paged_attention(*args, score_mod=lambda s, r, h, q, k: s[..., :1])


def _packed(pool, order):
    """A pool's requests packed in `order` for varlen_attention: q, k, v, q_starts, kv_starts."""
    rows = np.diff(pool.starts)
    q = np.concatenate([pool.query[pool.starts[r] : pool.starts[r + 1]] for r in order])
    k = np.concatenate([pool.keys[r] for r in order])
    v = np.concatenate([pool.values[r] for r in order])
    qs = np.concatenate([[0], np.cumsum(rows[order])])
    ks = np.concatenate([[0], np.cumsum(pool.lengths[order])])
    return q, k, v, qs, ks


@pytest.mark.bitwise
@pytest.mark.parametrize("name", ["causal", "alibi+window-right"])
def test_varlen_batch_invariant_has_the_paged_bits(backend, xp, name):
    # a request's rows: the same bits whatever is packed beside it and in what order, and
    # the bits ragged_paged_attention gives it over pools of 4 and 16 slots a page (one
    # product over the chunk and products page by page, before)
    kw = _on(backend, OPTIONS[name])
    lengths, new = [37, 5, 150, 40], [37, 1, 17, 0]
    pools = [Pool(lengths, new, page_size=ps, num_pages=60, pad=0) for ps in (4, 16)]
    pool = pools[0]

    def varlen(order):
        arrays = [backend.asarray(a, "float32") for a in _packed(pool, np.array(order))[:3]]
        starts = [backend.asarray(a) for a in _packed(pool, np.array(order))[3:]]
        got = varlen_attention(*arrays, *starts, batch_invariant=True, **{"is_causal": True, **kw})
        return backend.to_numpy(got)

    first, second = varlen([0, 1, 2, 3]), varlen([2, 3, 0])
    s = pool.starts
    assert np.array_equal(first[s[2] : s[3]], second[:17])  # request 2, packed first
    assert np.array_equal(first[s[0] : s[1]], second[17:])  # request 0, after 2 and 3
    for other in pools:
        paged = ragged_paged_attention(*other.args(backend, "float32"), batch_invariant=True, **kw)
        assert np.array_equal(backend.to_numpy(paged), first), other.page_size
    np.testing.assert_allclose(first, pool.oracle(**OPTIONS[name])[0], atol=2e-5, rtol=1e-4)


def test_varlen_batch_invariant_needs_a_key_per_row(backend, xp):
    q = backend.asarray(randn(6, HQ, DK, seed=1))
    k = backend.asarray(randn(6, HKV, DK, seed=2))
    qs, ks = backend.asarray(np.array([0, 2, 6])), backend.asarray(np.array([0, 3, 6]))
    with pytest.raises(ValueError, match=r"request 1 has 4 query rows .* but 3 keys"):
        varlen_attention(q, k, k, qs, ks, batch_invariant=True)


@pytest.mark.autodiff
def test_varlen_batch_invariant_gradients(backend, xp):
    pool = Pool([9, 5, 12], [4, 1, 12], heads=(HQ, HKV, 3, 2), pad=0)
    q, k, v, qs, ks = (backend.asarray(a) for a in _packed(pool, np.arange(3)))
    w = backend.asarray(randn(17, HQ, 2, seed=4))

    def loss(invariant):
        def f(q, k, v):
            out = varlen_attention(q, k, v, qs, ks, is_causal=True, batch_invariant=invariant)
            return xp.sum(out * w)

        return f

    for got, expected in zip(
        backend.grad(loss(True), q, k, v), backend.grad(loss(False), q, k, v), strict=True
    ):
        assert_close(backend, got, backend.to_numpy(expected))


def test_varlen_long_enough_to_tile(backend, xp):
    # 4 heads x 600 x 600 float64 scores: past NumPy's and torch's dense limit, the tiled
    # path, whose blocks across two sequences are skipped
    qs = np.array([0, 250, 251, 600])
    q, k, v = randn(600, HQ, DK, seed=1), randn(600, HKV, DK, seed=2), randn(600, HKV, DV, seed=3)
    kw = {"is_causal": True, "window": (40, 0)}
    out = varlen_attention(*(backend.asarray(a) for a in (q, k, v, qs, qs)), **kw)
    assert_close(backend, out, _varlen_oracle(q, k, v, qs, qs, **kw)[0])


@pytest.mark.backends("jax", reason="jax.jit with traced starts")
def test_varlen_under_jit(backend, xp):
    import jax

    qs, ks = np.array([0, 5, 6, 6, 14]), np.array([0, 9, 10, 13, 21])
    q, k, v = randn(16, HQ, DK, seed=1), randn(22, HKV, DK, seed=2), randn(22, HKV, DV, seed=3)
    call = jax.jit(lambda *a: varlen_attention(*a, is_causal=True, window=(3, 0)))
    out = call(*(backend.asarray(a) for a in (q, k, v, qs, ks)))
    assert_close(backend, out, _varlen_oracle(q, k, v, qs, ks, is_causal=True, window=(3, 0))[0])


@pytest.mark.autodiff
def test_varlen_gradients_match_central_differences(backend, xp):
    qs, ks = np.array([0, 2, 5]), np.array([0, 3, 5])
    q, k, v = randn(5, HQ, 3, seed=1), randn(5, HKV, 3, seed=2), randn(5, HKV, 2, seed=3)
    w = randn(5, HQ, 2, seed=4)

    def loss_np(q, k, v):
        return float(np.sum(varlen_attention(q, k, v, qs, ks, is_causal=True) * w))

    expected = central_differences(loss_np, [q, k, v])
    qs_b, ks_b, w_b = backend.asarray(qs), backend.asarray(ks), backend.asarray(w)

    def loss(q, k, v):
        return xp.sum(varlen_attention(q, k, v, qs_b, ks_b, is_causal=True) * w_b)

    grads = backend.grad(loss, *(backend.asarray(a) for a in (q, k, v)))
    for g, e in zip(grads, expected, strict=True):
        assert_close(backend, g, e, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------
# errors


@pytest.mark.main_kinds
def test_bad_input_is_named(backend, xp):
    pool = Pool([5, 9], [2, 1], num_pages=8)
    q, kp, vp, table, lengths, starts = pool.args(backend)
    cases = [
        ((q[0, ...], kp, vp, table, lengths, starts), ValueError, "`query` must have shape"),
        ((q, kp, vp[:, :, :1, :], table, lengths, starts), ValueError, "axis 2"),
        ((q, kp, vp, table, lengths[:1], starts), ValueError, "`kv_lengths` must have shape"),
        (
            (q, kp, vp, table, backend.asarray(np.array([0, 1, 1, 1])), starts),
            ValueError,
            "kv_lengths",
        ),
        (
            (q, kp, vp, backend.asarray(pool.table * 1.0), lengths, starts),
            TypeError,
            "`page_table`",
        ),
        ((q, kp, vp, table, backend.asarray(np.array([1, 9])), starts), ValueError, "at least"),
        (
            (q, kp, vp, table, lengths, backend.asarray(np.array([0, 3, 2]))),
            ValueError,
            "never decrease",
        ),
        (
            (q, kp, vp, backend.asarray(pool.table + 100), lengths, starts),
            ValueError,
            "not a page",
        ),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            ragged_paged_attention(*args)
    with pytest.raises(ValueError, match="Hkv"):
        varlen_attention(q, kp[0, ...], vp[0, :, :1, :], starts, starts)


def test_dask_is_refused_with_a_clear_error():
    da = pytest.importorskip("dask.array")
    x = da.from_array(randn(2, 5, 4, seed=1), chunks=2)
    with pytest.raises(ValueError, match="batch_invariant=True does not take Dask arrays"):
        scaled_dot_product_attention(x, x, x, batch_invariant=True)
    pool = Pool([5], [1])
    with pytest.raises(TypeError, match="Dask"):
        ragged_paged_attention(
            da.from_array(pool.query),
            pool.key_pages,
            pool.value_pages,
            pool.table,
            pool.lengths,
            pool.starts,
        )


# ---------------------------------------------------------------------------
# scaled_dot_product_attention(batch_invariant=True): the paged walk's bits

_B, _LQ, _LK = 3, 6, 40  # three sequences (the bits test below: over two key chunks)


def _sdpa_terms(xp):
    """The single call's arguments, each beside the ones it needs (NumPy, for the oracle)."""
    rng = np.random.default_rng(5)

    def linear(s, b, h, q, k):  # a score_mod: ALiBi of slope 0.05 in the call's indices
        ns = array_api_compat.array_namespace(s)
        return s - 0.05 * ns.astype(ns.abs(q - k), s.dtype)

    return {
        "plain": {},
        "causal": {"is_causal": True},
        "window": {"is_causal": True, "window": (9, 0)},
        "softcap+sinks+scale": {"softcap": 2.0, "sinks": randn(HQ, seed=3), "scale": 0.4},
        "alibi-per-head": {"alibi_slopes": SLOPES, "window": (20, 3)},
        "alibi-per-sequence": {"alibi_slopes": rng.uniform(0.01, 0.3, (_B, HQ))},
        "lengths": {"is_causal": True, "kv_lengths": np.array([40, 3, 29]),
                    "q_lengths": np.array([6, 2, 4])},
        "mask+bias": {"mask": rng.random((_B, 1, _LQ, _LK)) < 0.8,
                      "bias": randn(HQ, _LQ, _LK, seed=9) * 0.5},
        "segments": {"q_segment_ids": np.repeat(np.array([[0, 1, 1, 2, 2, 2]]), _B, 0),
                     "kv_segment_ids": rng.integers(0, 3, (_B, _LK)), "is_causal": True},
        "score_mod": {"score_mod": linear, "is_causal": True},
    }  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "causal",
        "window",
        "softcap+sinks+scale",
        "alibi-per-head",
        "alibi-per-sequence",
        "lengths",
        "mask+bias",
        "segments",
        "score_mod",
    ],
)
def test_sdpa_batch_invariant_against_oracle(backend, xp, name):
    # every argument of the single call but dropout, on the paged walk: out, lse, max
    kw = _sdpa_terms(xp)[name]
    q = randn(_B, HQ, _LQ, DK, seed=1)
    k, v = randn(_B, HKV, _LK, DK, seed=2), randn(_B, HKV, _LK, DV, seed=3)
    out, lse, top = scaled_dot_product_attention(
        *(backend.asarray(x) for x in (q, k, v)),
        batch_invariant=True,
        return_lse=True,
        return_max_logit=True,
        **_on(backend, kw),
    )
    assert_close(backend, out, reference_attention(q, k, v, **kw))
    assert_close(backend, lse, reference_lse(q, k, **kw))
    logit_kw = {n: x for n, x in kw.items() if n != "sinks"}
    assert_close(backend, top, reference_max_logit(q, k, **logit_kw))


def test_sdpa_batch_invariant_mask_mod_sees_the_calls_indices(backend, xp):
    # rows and keys as the call indexes them (a row of a shorter sequence included)
    q = randn(_B, HQ, _LQ, DK, seed=1)
    k, v = randn(_B, HKV, _LK, DK, seed=2), randn(_B, HKV, _LK, DV, seed=3)
    lengths = np.array([40, 3, 29])  # 3 keys for 6 rows: rows before the first key

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx + b) % 3 != 0

    out = scaled_dot_product_attention(
        *(backend.asarray(x) for x in (q, k, v)),
        batch_invariant=True,
        is_causal=True,
        kv_lengths=backend.asarray(lengths),
        mask_mod=mask_mod,
    )
    b, i, j = np.ogrid[:_B, :_LQ, :_LK]
    mask = ((i + j + b) % 3 != 0)[:, None]
    expected = reference_attention(q, k, v, is_causal=True, kv_lengths=lengths, mask=mask)
    assert_close(backend, out, expected)


@pytest.mark.bitwise
@pytest.mark.main_kinds
def test_sdpa_batch_invariant_has_the_paged_bits(backend, xp):
    # a sequence's rows: the same bits in a batch of three as alone, and as
    # ragged_paged_attention(batch_invariant=True) gives them over a shuffled pool
    lengths, width = [140, 37, 90], 140
    pool = Pool(lengths, [_LQ] * _B, pad=0, num_pages=70, dtype=np.float32)
    q = pool.query.reshape(_B, _LQ, HQ, DK).transpose(0, 2, 1, 3)
    k, v = (np.zeros((_B, HKV, width, d), np.float32) for d in (DK, DV))
    for r, n in enumerate(lengths):
        k[r, :, :n], v[r, :, :n] = (x[r].transpose(1, 0, 2) for x in (pool.keys, pool.values))
    kw = {"is_causal": True, "window": (50, 0), "return_lse": True}

    def sdpa(*arrays):
        out, lse = scaled_dot_product_attention(
            *(backend.asarray(x, "float32") for x in arrays[:3]),
            kv_lengths=backend.asarray(arrays[3]),
            batch_invariant=True,
            **kw,
        )
        return backend.to_numpy(out), backend.to_numpy(lse)

    batch = sdpa(q, k, v, np.array(lengths))
    out, lse = ragged_paged_attention(*pool.args(backend, "float32"), batch_invariant=True, **kw)
    paged = (
        backend.to_numpy(out).reshape(_B, _LQ, HQ, DV).transpose(0, 2, 1, 3),
        backend.to_numpy(lse).reshape(_B, _LQ, HQ).transpose(0, 2, 1),
    )
    for r in range(_B):
        alone = sdpa(q[r : r + 1], k[r : r + 1], v[r : r + 1], np.array(lengths[r : r + 1]))
        for got, expected, whole in zip(alone, paged, batch, strict=True):
            np.testing.assert_array_equal(got[0], expected[r])
            np.testing.assert_array_equal(whole[r], expected[r])
    expected = reference_attention(
        q.astype(np.float64), k, v, is_causal=True, window=(50, 0), kv_lengths=np.array(lengths)
    )
    np.testing.assert_allclose(batch[0], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.autodiff
def test_sdpa_batch_invariant_gradients_match_central_differences(backend, xp):
    # through the walk: to Q, K, V and a bias read by the walk's rules
    q = randn(2, HQ, 3, 3, seed=1)
    k, v = randn(2, HKV, 9, 3, seed=2), randn(2, HKV, 9, 2, seed=3)
    bias = randn(HQ, 3, 9, seed=4)
    w = randn(2, HQ, 3, 2, seed=5)
    lengths = np.array([9, 5])
    kw = {"is_causal": True, "softcap": 3.0}

    def loss_np(q, k, v, bias):
        out = reference_attention(q, k, v, bias=bias, kv_lengths=lengths, **kw)
        return float(np.sum(out * w))

    expected = central_differences(loss_np, [q, k, v, bias])

    def loss(q, k, v, bias):
        out = scaled_dot_product_attention(
            q, k, v, bias=bias, kv_lengths=backend.asarray(lengths), batch_invariant=True, **kw
        )
        return xp.sum(out * backend.asarray(w))

    grads = backend.grad(loss, *(backend.asarray(x) for x in (q, k, v, bias)))
    for got, want in zip(grads, expected, strict=True):
        assert_close(backend, got, want, atol=1e-7, rtol=1e-6)


def test_sdpa_batch_invariant_refuses_what_the_walk_cannot_take(backend, xp):
    q, k, v = (backend.asarray(randn(2, HQ, 3, DK, seed=s)) for s in (1, 2, 3))
    k, v = k[:, :HKV, ...], v[:, :HKV, ...]
    cases = {
        "dropout": {"dropout_p": 0.5, "dropout_mask": backend.asarray(np.ones((3, 3), bool))},
        "implementation='native'": {"implementation": "native"},
        r"block_size=\(8, 8\)": {"block_size": 8},
        "`sinks` that differ by sequence": {"sinks": backend.asarray(randn(2, HQ, seed=4))},
    }
    for match, kw in cases.items():
        with pytest.raises(ValueError, match=f"batch_invariant=True does not take {match}"):
            scaled_dot_product_attention(q, k, v, batch_invariant=True, **kw)
    with pytest.raises(TypeError, match="`batch_invariant` must be"):
        scaled_dot_product_attention(q, k, v, batch_invariant="yes")


@pytest.mark.backends("jax", reason="jax.jit")
def test_sdpa_batch_invariant_under_jit(backend, xp):
    import jax

    q = randn(_B, HQ, _LQ, DK, seed=1)
    k, v = randn(_B, HKV, _LK, DK, seed=2), randn(_B, HKV, _LK, DV, seed=3)
    lengths = np.array([40, 3, 29])

    @jax.jit
    def call(q, k, v, lengths):
        return scaled_dot_product_attention(
            q, k, v, is_causal=True, kv_lengths=lengths, batch_invariant=True
        )

    out = call(*(backend.asarray(x) for x in (q, k, v, lengths)))
    assert_close(backend, out, reference_attention(q, k, v, is_causal=True, kv_lengths=lengths))

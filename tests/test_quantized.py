"""Quantized KV pools: int8, 4 bits in uint8 and float8 pages with scales (and zero points).

Every result against the float64 oracle of the dequantized pool (``(q - zero) · scale``
per token or per group), through the paged walk, the engine and the index walk, on
every backend; free slots hold NaN scales that never reach a result; the walk
dequantizes only what it gathers; ``paged_kv_write`` quantizes on write (round half to
even, ``max|x| / 127``); gradients against central differences; ``jax.jit`` with traced
scales; bad input named.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn._lib import _quant
from portable_attn.serving import paged_kv_write, ragged_paged_attention
from portable_attn.testing import central_differences
from test_gather import _lists
from test_gather import oracle as listed_oracle
from test_serving import DK, DV, HKV, HQ, Pool, _lane

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")

LENGTHS, NEW = [20, 45, 7, 0, 30], [3, 1, 2, 0, 20]


def _quantize(x, groups, bits, zero_points, seed):
    """Integer data, scales and zero points of a float pool, by NumPy (free slots: NaN scales)."""
    rng = np.random.default_rng(seed)
    lead, d = x.shape[:-1], x.shape[-1]
    g = max(groups, 1)
    top = 2 ** (bits - 1) - 1
    free = np.isnan(x).any(axis=-1)
    x = np.nan_to_num(x).reshape(*lead, g, d // g)
    zp = rng.integers(-2, 3, size=(*lead, g)).astype(np.float64) if zero_points else None
    scale = np.abs(x).max(axis=-1) / (top - 2) + 1e-3
    q = np.clip(
        np.round(x / scale[..., None] + (0 if zp is None else zp[..., None])), -top - 1, top
    )
    data = q.astype(np.int8).reshape(*lead, d)
    scale[free] = np.nan  # a slot no request holds: garbage that must never be read
    if not groups:
        scale, zp = scale[..., 0], (None if zp is None else zp[..., 0])
    deq = (q - (0 if zp is None else (zp if groups else zp[..., None])[..., None])) * (
        scale if groups else scale[..., None]
    )[..., None]
    deq = deq.reshape(*lead, d)
    if bits == 4:
        nib = (data.astype(np.int16) & 15).astype(np.uint8).reshape(*lead, d // 2, 2)
        data = nib[..., 0] | (nib[..., 1] << 4)
    return data, scale, zp, deq


def _quantized_pool(groups, bits, zero_points, *, lengths=LENGTHS, new=NEW, seed=0, pages=48):
    """A Pool whose keys/values are the dequantized values of its quantized pages."""
    pool = Pool(lengths, new, heads=(HQ, HKV, DK, DK), num_pages=pages)
    stored = {}
    for name, pages in (("key", pool.key_pages), ("value", pool.value_pages)):
        data, scale, zp, deq = _quantize(pages, groups, bits, zero_points, seed + len(name))
        stored[name] = (data, scale, zp)
        for r, n in enumerate(pool.lengths):  # the oracle's keys: what the pages stand for
            for t in range(n):
                page, slot = pool.table[r, t // pool.page_size], t % pool.page_size
                (pool.keys if name == "key" else pool.values)[r][t] = deq[page, slot]
    return pool, stored


def _args(backend, pool, stored, bits):
    b = backend.asarray
    kw = {"kv_bits": bits}
    for name, (_, scale, zp) in stored.items():
        kw[f"{name}_scales"] = b(scale)
        if zp is not None:
            kw[f"{name}_zero_points"] = b(zp)
    keys, values = (b(stored[n][0]) for n in ("key", "value"))
    meta = (b(pool.table), b(pool.lengths), b(pool.starts))
    return (b(pool.query), keys, values, *meta), kw


CASES = {
    "int8-token": (0, 8, False),
    "int8-group-zero": (2, 8, True),
    "int4-token": (0, 4, False),
    "int4-group-zero": (4, 4, True),
}


@pytest.mark.parametrize("lane", ["walk", "engine", "invariant"])
@pytest.mark.parametrize("case", CASES)
def test_quantized_pool_against_oracle(backend, xp, case, lane, monkeypatch):
    _lane(monkeypatch, backend, lane)
    pool, stored = _quantized_pool(*CASES[case])
    args, kw = _args(backend, pool, stored, CASES[case][1])
    opts = {"window": (9, 0), "softcap": 3.0, "batch_invariant": lane == "invariant"}
    got = ragged_paged_attention(*args, return_lse=True, **kw, **opts)
    opts.pop("batch_invariant")
    for g, want in zip(got, pool.oracle(**opts), strict=True):
        assert_close(backend, g, want)


@pytest.mark.parametrize("case", ["int8-group-zero", "int4-token"])
def test_listed_keys_of_a_quantized_pool(backend, xp, case):
    pool, stored = _quantized_pool(*CASES[case])
    args, kw = _args(backend, pool, stored, CASES[case][1])
    idx = _lists(pool, 11)
    got = ragged_paged_attention(*args, kv_indices=backend.asarray(idx), **kw)
    assert_close(backend, got, listed_oracle(pool, idx)[0][..., :DK])


def test_one_quantized_pool_for_keys_and_values(backend, xp):
    pool, stored = _quantized_pool(2, 8, True)
    args, kw = _args(backend, pool, stored, 8)
    kw = {n: x for n, x in kw.items() if not n.startswith("value")}
    pool.values = [k[..., :5] for k in pool.keys]
    pool.heads = (HQ, HKV, DK, 5)
    got = ragged_paged_attention(*args[:2], None, *args[3:], value_dim=5, **kw)
    assert_close(backend, got, pool.oracle()[0])


def test_only_what_is_gathered_is_dequantized(backend, xp, monkeypatch):
    # a decode step of two short requests in a pool of 400 pages: each dequantized part
    # is a chunk's pages (32 pages of 4 slots a tile), never the pool
    pool, stored = _quantized_pool(0, 8, False, lengths=[9, 5], new=[1, 1], pages=400)
    sizes = []
    dequantized = _quant.dequantized

    def spy(xp_, part, dtype):
        sizes.append(part.data.shape[0])
        return dequantized(xp_, part, dtype)

    monkeypatch.setattr(_quant, "dequantized", spy)
    args, kw = _args(backend, pool, stored, 8)
    ragged_paged_attention(*args, **kw)
    assert sizes
    assert max(sizes) < pool.key_pages.shape[0] / 4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("groups", [0, 2])
def test_write_quantizes_then_attention_reads(backend, xp, bits, groups):
    if backend.kind == "numpy_readonly":
        pytest.skip("the write writes into the pools")
    rng = np.random.default_rng(3)
    n_pages, page, t = 6, 4, 5
    new_k, new_v = (rng.standard_normal((t, HKV, DK)) for _ in range(2))
    new_k[2, 1] = 0.0  # a zero token: scale 0, values 0
    new_k[1, 0] = [127.0, 2.5, 3.5, -2.5, 0.5, 1.5, -0.5, 0.0]  # scale 1: halves to even
    shape = (n_pages, page, HKV, DK // (2 if bits == 4 else 1))
    scales_shape = (n_pages, page, HKV, *((groups,) if groups else ()))
    dtype = "uint8" if bits == 4 else "int8"
    pools = [backend.asarray(np.zeros(shape), dtype) for _ in range(2)]
    scales = [backend.asarray(np.ones(scales_shape)) for _ in range(2)]
    table, lengths, starts = np.array([[2, 4], [1, 0]]), np.array([3, 2]), np.array([0, 3, 5])
    meta = tuple(backend.asarray(x) for x in (table, lengths, starts))
    kp, vp, ks, vs = paged_kv_write(
        *pools,
        *meta,
        backend.asarray(new_k),
        backend.asarray(new_v),
        key_scales=scales[0],
        value_scales=scales[1],
        kv_bits=bits,
    )
    top = 2 ** (bits - 1) - 1
    slots = [(2, 0), (2, 1), (2, 2), (1, 0), (1, 1)]
    deq = []
    for got_pages, got_scales, x in ((kp, ks, new_k), (vp, vs, new_v)):
        data, scale, _, d = _quantize_symmetric(x, groups, bits, top)
        deq.append(d)
        got_d, got_s = backend.to_numpy(got_pages), backend.to_numpy(got_scales)
        for row, (pg, sl) in enumerate(slots):
            np.testing.assert_array_equal(got_d[pg, sl], data[row])
            np.testing.assert_allclose(got_s[pg, sl], scale[row], rtol=1e-15)
    q = rng.standard_normal((t, HQ, DK))
    out = ragged_paged_attention(
        backend.asarray(q),
        kp,
        vp,
        *meta,
        key_scales=ks,
        value_scales=vs,
        kv_bits=bits,
        is_causal=False,
    )
    want = np.zeros((t, HQ, DK))
    for a, b in ((0, 3), (3, 5)):  # each request over its own dequantized keys
        for h in range(HQ):
            s = deq[0][a:b, h // (HQ // HKV)] @ q[a:b, h].T / np.sqrt(DK)  # (keys, rows)
            w = np.exp(s - s.max(axis=0))
            want[a:b, h] = (w / w.sum(axis=0)).T @ deq[1][a:b, h // (HQ // HKV)]
    assert_close(backend, out, want)


def _quantize_symmetric(x, groups, bits, top):
    """NumPy's symmetric quantization: scale max|x| / top, round half to even."""
    lead, d = x.shape[:-1], x.shape[-1]
    g = max(groups, 1)
    parts = x.reshape(*lead, g, d // g)
    scale = np.abs(parts).max(axis=-1) / top
    q = np.clip(np.round(parts / np.where(scale == 0, 1, scale)[..., None]), -top, top)
    data = q.astype(np.int8).reshape(*lead, d)
    deq = (q * scale[..., None]).reshape(*lead, d)
    if bits == 4:
        nib = (data.astype(np.int16) & 15).astype(np.uint8).reshape(*lead, d // 2, 2)
        data = nib[..., 0] | (nib[..., 1] << 4)
    return data, (scale if groups else scale[..., 0]), None, deq


@pytest.mark.backends("torch", "jax", reason="float8 dtypes")
def test_float8_pool_with_scales(backend, xp):
    pool = Pool([20, 9], [2, 1], heads=(HQ, HKV, DK, DV), fill=0.0)
    f8 = xp.float8_e4m3fn
    kw = {}
    pages = []
    for name, x in (("key", pool.key_pages), ("value", pool.value_pages)):
        scale = np.abs(x).max(axis=-1) / 224 + 1e-3
        stored = xp.astype(backend.asarray(x / scale[..., None], "float32"), f8)
        deq = backend.to_numpy(xp.astype(stored, xp.float64)) * scale[..., None]
        for r, n in enumerate(pool.lengths):
            for t in range(n):
                page, slot = pool.table[r, t // pool.page_size], t % pool.page_size
                (pool.keys if name == "key" else pool.values)[r][t] = deq[page, slot]
        kw[f"{name}_scales"] = backend.asarray(scale)
        pages.append(stored)
    b = backend.asarray
    got = ragged_paged_attention(
        b(pool.query), *pages, b(pool.table), b(pool.lengths), b(pool.starts), **kw
    )
    assert_close(backend, got, pool.oracle()[0])


@pytest.mark.autodiff
def test_gradients_of_query_and_scales(backend, xp):
    pool, stored = _quantized_pool(2, 8, True, lengths=[6, 3], new=[2, 1], seed=4)
    pool.query = pool.query[:3]
    args, kw = _args(backend, pool, stored, 8)
    host = [np.nan_to_num(stored["key"][1]), np.nan_to_num(stored["value"][1])]
    weights = randn(3, HQ, DK, seed=5)
    zero = {n: x for n, x in kw.items() if "zero" in n}

    def loss(q, ks, vs):
        out = ragged_paged_attention(
            q, *args[1:], key_scales=ks, value_scales=vs, **zero, window=(2, 0)
        )
        return xp.sum(out * backend.asarray(weights))

    b = backend.asarray
    grads = backend.grad(loss, b(pool.query), b(host[0]), b(host[1]))

    def loss_np(q, ks, vs):
        return float(backend.to_numpy(loss(b(q), b(ks), b(vs))))

    expected = central_differences(loss_np, [pool.query, *host])
    for g, e in zip(grads, expected, strict=True):
        assert_close(backend, g, e, atol=1e-7, rtol=1e-6)


@pytest.mark.backends("jax", reason="jax.jit with traced scales")
def test_under_jit_with_traced_scales(backend):
    import jax

    pool, stored = _quantized_pool(2, 4, True)
    args, kw = _args(backend, pool, stored, 4)
    bits = kw.pop("kv_bits")
    f = jax.jit(lambda *a, **k: ragged_paged_attention(*a, kv_bits=bits, window=(9, 0), **k))
    got = f(*args, **kw)
    np.testing.assert_allclose(np.asarray(got), pool.oracle(window=(9, 0))[0], atol=1e-12)


@pytest.mark.parametrize(
    ("change", "kind", "match"),
    [
        (
            {"key_scales": None},
            TypeError,
            r"`key_pages` is (\w+\.)?int8: a quantized pool needs `key_scales`",
        ),
        ({"key_scales": np.ones((48, 4, 2, 3))}, ValueError, r"`key_scales` must have shape"),
        ({"key_scales": np.ones((48, 4))}, ValueError, r"`key_scales` must have shape"),
        ({"key_zero_points": np.ones((48, 4, 3))}, ValueError, r"`key_zero_points` must have"),
        ({"kv_bits": 3}, ValueError, r"`kv_bits` must be 8 or 4"),
        ({"kv_bits": 4}, TypeError, r"`key_pages` with `key_scales` must be uint8"),
        ({"key_scales": np.ones((48, 4, 2), dtype=np.int64)}, TypeError, "must be a floating"),
    ],
)
def test_bad_input_is_named(backend, change, kind, match):
    pool, stored = _quantized_pool(0, 8, False)
    args, kw = _args(backend, pool, stored, 8)
    for name, x in change.items():
        if x is None:
            kw.pop(name)
        else:
            kw[name] = backend.asarray(x) if isinstance(x, np.ndarray) else x
    with pytest.raises(kind, match=match):
        ragged_paged_attention(*args, **kw)


def test_write_needs_both_scales(backend):
    if backend.kind == "numpy_readonly":
        pytest.skip("the write writes into the pools")
    b = backend.asarray
    pools = [b(np.zeros((2, 4, HKV, DK)), "int8") for _ in range(2)]
    meta = (b(np.array([[0]])), b(np.array([1])), b(np.array([0, 1])))
    new = b(np.ones((1, HKV, DK)))
    with pytest.raises(ValueError, match="`key_scales` and `value_scales` must both"):
        paged_kv_write(*pools, *meta, new, new, key_scales=b(np.ones((2, 4, HKV))))


@pytest.mark.backends("torch", reason="a float8 dtype")
def test_write_refuses_a_float8_pool_by_name(backend, xp):
    b = backend.asarray
    pools = [xp.zeros((2, 4, HKV, DK), dtype=xp.float8_e4m3fn) for _ in range(2)]
    scales = [b(np.ones((2, 4, HKV))) for _ in range(2)]
    meta = (b(np.array([[0]])), b(np.array([1])), b(np.array([0, 1])))
    new = b(np.ones((1, HKV, DK)))
    with pytest.raises(TypeError, match=r"`key_pages` is torch.float8_e4m3fn"):
        paged_kv_write(*pools, *meta, new, new, key_scales=scales[0], value_scales=scales[1])

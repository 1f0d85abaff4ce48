"""A key hidden from a row never changes that row's result, NaN and inf in it included.

Keys are hidden by the lengths (a decode cache's slots past each sequence, allocated
with ``empty`` or left from an earlier request) and by segment ids (the padding of
packed sequences, the other documents' keys). A hidden entry has weight 0, but
``0 · NaN`` and ``0 · inf`` are NaN, so such values must be kept out of ``P @ V``
and out of the gradients (``_scores.visible_product``). Each call is checked
against the float64 oracle on the same values with the hidden ones clean, on every
backend and route, values and gradients.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn.serving import varlen_attention
from portable_attn.testing import reference_attention

LENGTHS = np.array([9, 5, 2])  # keys past them: NaN in K, inf, -inf and NaN in V
problem = {"batch": (3,), "lq": 4, "lk": 9, "dk": 4, "dv": 3}  # GQA: Hq=4, Hkv=2

# packed documents: 0 and 1, then padding (queries -1, keys -2: nothing sees it)
Q_IDS = np.array([0] * 5 + [1] * 6 + [-1] * 2)
KV_IDS = np.array([0] * 5 + [1] * 6 + [-2] * 2)
SEEN = 2  # the key of document 0 whose value holds an inf (document 1 hides it)
packed = {"batch": (1,), "lq": 13, "lk": 13, "dk": 4, "dv": 3}


def poisoned_past(k, v, lengths):
    """`k`, `v` with every slot past `lengths` non-finite: what a reused cache may hold."""
    k, v = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:, 0] = np.inf
        v[b, :, n:, 1] = -np.inf
        v[b, :, n:, 2:] = np.nan
    return k, v


def poisoned_packing(k, v):
    """`k`, `v` with NaN in the padding keys and an inf in one value of document 0."""
    k, v = k.copy(), v.copy()
    k[..., KV_IDS < 0, :] = np.nan
    v[..., KV_IDS < 0, :] = np.nan
    v[..., SEEN, 0] = np.inf
    return k, v


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_keys_past_the_lengths_never_reach_a_row(backend, xp, route, causal):
    q, k, v = qkv(**problem)
    k_bad, v_bad = poisoned_past(k, v, LENGTHS)
    kw = {"kv_lengths": LENGTHS, "is_causal": causal}
    args = [backend.asarray(a) for a in (q, k_bad, v_bad)]
    kw_b = {"kv_lengths": backend.asarray(LENGTHS), "is_causal": causal, **route.kw}
    out = scaled_dot_product_attention(*args, **kw_b)
    assert_close(backend, out, reference_attention(q, k, v, **kw))
    if not backend.has_autodiff:
        return
    cot = backend.asarray(randn(3, 4, 4, 3, seed=5))

    def loss(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, **kw_b) * cot)

    grads = backend.grad(loss, *args)
    clean = backend.grad(loss, *(backend.asarray(a) for a in (q, k, v)))
    for g, expected in zip(grads, clean, strict=True):
        assert_close(backend, g, backend.to_numpy(expected), atol=1e-12)
    for g in grads[1:]:  # the hidden keys get no gradient: zeros, not NaN
        for b, n in enumerate(LENGTHS):
            assert np.all(backend.to_numpy(g)[b, :, n:] == 0.0)


def test_nan_in_keys_alone_past_the_lengths_reaches_no_gradient(backend, xp, route):
    """NaN in K alone past the lengths: no output shows it, but ``dQ = dS K`` meets it.

    A check of the output alone (JAX's program takes the plain product where its
    result is finite) would let it through; the gradients choose by K and V themselves.
    """
    q, k, v = qkv(**problem)
    k_bad, _ = poisoned_past(k, v, LENGTHS)
    kw_b = {"kv_lengths": backend.asarray(LENGTHS), **route.kw}
    out = scaled_dot_product_attention(*(backend.asarray(a) for a in (q, k_bad, v)), **kw_b)
    assert_close(backend, out, reference_attention(q, k, v, kv_lengths=LENGTHS))
    if not backend.has_autodiff:
        return
    cot = backend.asarray(randn(3, 4, 4, 3, seed=6))

    def loss(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, **kw_b) * cot)

    grads = backend.grad(loss, *(backend.asarray(a) for a in (q, k_bad, v)))
    clean = backend.grad(loss, *(backend.asarray(a) for a in (q, k, v)))
    for g, expected in zip(grads, clean, strict=True):
        assert_close(backend, g, backend.to_numpy(expected), atol=1e-12)


def test_packed_documents_never_see_each_others_values(backend, xp, route):
    q, k, v = qkv(**packed)
    k_bad, v_bad = poisoned_packing(k, v)
    ids = {"q_segment_ids": Q_IDS, "kv_segment_ids": KV_IDS}
    out = scaled_dot_product_attention(
        *(backend.asarray(a) for a in (q, k_bad, v_bad)),
        **{name: backend.asarray(a) for name, a in ids.items()},
        **route.kw,
    )
    # every row but document 0's as if the bad values were not there, padding included
    expected = reference_attention(q, k, v, **ids)
    out = backend.to_numpy(out)
    zero = Q_IDS == 0
    assert_close(backend, backend.asarray(out[..., ~zero, :]), expected[..., ~zero, :])
    assert np.all(out[..., Q_IDS < 0, :] == 0.0)
    # document 0's rows weigh the inf: non-finite in its column (NaN; plain math: inf),
    # their other columns as plain math over their own keys
    v_seen = v.copy()
    v_seen[..., SEEN, 0] = np.inf
    with np.errstate(invalid="ignore"):  # the oracle's own 0 · inf, in the other rows
        seen = reference_attention(q, k, v_seen, **ids)[..., zero, :]
    assert not np.any(np.isfinite(out[..., zero, 0]))
    np.testing.assert_allclose(out[..., zero, 1:], seen[..., 1:], rtol=1e-10, atol=1e-12)


@pytest.mark.autodiff
def test_packed_documents_gradients(backend, xp, route):
    q, k, v = qkv(**packed)
    k_bad, v_bad = poisoned_packing(k, v)
    ids = {
        name: backend.asarray(a)
        for name, a in (("q_segment_ids", Q_IDS), ("kv_segment_ids", KV_IDS))
    }
    rows = backend.asarray((Q_IDS == 1).astype(np.float64)[:, None])[None, None]  # doc 1's rows

    def loss(q, k, v):
        out = scaled_dot_product_attention(q, k, v, **ids, **route.kw)
        return xp.sum(out * rows)

    grads = backend.grad(loss, *(backend.asarray(a) for a in (q, k_bad, v_bad)))
    clean = backend.grad(loss, *(backend.asarray(a) for a in (q, k, v)))
    dq, dk, dv = (backend.to_numpy(g) for g in grads)
    dq_c, dk_c, dv_c = (backend.to_numpy(g) for g in clean)
    one = KV_IDS == 1
    np.testing.assert_allclose(dq[..., Q_IDS == 1, :], dq_c[..., Q_IDS == 1, :], atol=1e-12)
    np.testing.assert_allclose(dk[..., one, :], dk_c[..., one, :], atol=1e-12)
    np.testing.assert_allclose(dv[..., one, :], dv_c[..., one, :], atol=1e-12)
    for g in (dk, dv):  # the padding: no gradient, and no NaN
        assert np.all(g[..., KV_IDS < 0, :] == 0.0)


@pytest.mark.skip_backends("dask", reason="serving calls take the arrays of one device")
def test_varlen_attention_keeps_requests_apart(backend, xp):
    # the example of the issue: NaN in the padding past kv_starts[R] made every row
    # NaN, an inf in one request's values the next request's rows
    rng = np.random.default_rng(3)
    t, s, hq, hkv, d = 12, 14, 4, 2, 8
    q_starts, kv_starts = np.array([0, 5, 10]), np.array([0, 6, 12])
    query = rng.standard_normal((t, hq, d))
    key = rng.standard_normal((s, hkv, d))
    value = rng.standard_normal((s, hkv, d))
    key_bad, value_bad = key.copy(), value.copy()
    key_bad[12:], value_bad[12:] = np.nan, np.nan  # past kv_starts[R]
    value_bad[2, :, 0] = np.inf  # request 0's
    for is_causal in (False, True):
        out = varlen_attention(
            *(backend.asarray(a) for a in (query, key_bad, value_bad)),
            backend.asarray(q_starts),
            backend.asarray(kv_starts),
            is_causal=is_causal,
        )
        out = backend.to_numpy(out)
        # request 1, on its own keys, in the (H, L, D) layout of the oracle
        qs, ks = slice(5, 10), slice(6, 12)
        expected = reference_attention(
            *(np.swapaxes(a, 0, 1) for a in (query[qs], key[ks], value[ks])), is_causal=is_causal
        )
        np.testing.assert_allclose(np.swapaxes(out[qs], 0, 1), expected, rtol=1e-10, atol=1e-12)
        assert np.all(out[10:] == 0.0)  # padding rows


@pytest.mark.kinds("numpy", reason="tracemalloc sees NumPy's allocations")
def test_a_decode_step_copies_no_cache(backend):
    """Keys past the lengths are kept out of ``P @ V`` without a copy of the cache.

    Where the values are free to read (NumPy, torch CPU) and finite, nothing hidden
    can reach a row: the product takes the cache as it is. The select that zeroed
    the hidden slots wrote a copy of every key block of the cache on every step.
    """
    b, hq, hkv, lk, d = 4, 8, 2, 2048, 64
    q = randn(b, hq, 1, d, seed=0, dtype=np.float32)
    k, v = (randn(b, hkv, lk, d, seed=s, dtype=np.float32) for s in (1, 2))
    lengths = np.array([lk, 1500, 700, 100])

    def step():
        return scaled_dot_product_attention(q, k, v, kv_lengths=lengths, is_causal=True)

    step()  # warm: plans, workspaces
    tracemalloc.start()
    try:
        out = step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < v.nbytes // 2, (peak, v.nbytes)  # the K and V copies: twice v.nbytes
    k_bad, v_bad = poisoned_past(k, v, lengths)  # and the contract holds
    expected = reference_attention(q, k, v, kv_lengths=lengths, is_causal=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    bad = scaled_dot_product_attention(q, k_bad, v_bad, kv_lengths=lengths, is_causal=True)
    np.testing.assert_allclose(bad, expected, atol=1e-5)

"""Invariants of attention checked with hypothesis on every backend."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from portable_attn import attention_weights, scaled_dot_product_attention


@st.composite
def problems(draw):
    """Random shapes, data, mask density, causal flag and window."""
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    lq, lk, d = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    q = rng.standard_normal((hq, lq, d)) * scale
    k, v = rng.standard_normal((hkv, lk, d)), rng.standard_normal((hkv, lk, d))
    mask = rng.random((hq, lq, lk)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    is_causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (1, 1), (0, None), (None, 2)]))
    return q, k, v, mask, {"is_causal": is_causal, "window": window}


def visible(mask, kw, lq, lk):
    from portable_attn.testing import structure

    return mask & structure(lq, lk, **kw)


@given(problems())
def test_weight_rows_sum_to_one_or_are_zero(backend, problem):
    q, k, _, mask, kw = problem
    w = backend.to_numpy(
        attention_weights(backend.asarray(q), backend.asarray(k), mask=backend.asarray(mask), **kw)
    )
    sums = w.sum(-1)
    vis = visible(mask, kw, q.shape[-2], k.shape[-2]).any(-1)
    np.testing.assert_allclose(sums[vis], 1.0, atol=1e-12)
    assert np.all(w[~vis] == 0)
    assert np.all(w >= 0)


@given(problems(), st.randoms(use_true_random=False))
def test_permuting_keys_and_values_together(backend, problem, rnd):
    q, k, v, mask, _ = problem
    perm = list(range(k.shape[-2]))
    rnd.shuffle(perm)
    b = backend.asarray
    out = scaled_dot_product_attention(b(q), b(k), b(v), mask=b(mask))
    out_p = scaled_dot_product_attention(
        b(q), b(k[:, perm]), b(v[:, perm]), mask=b(mask[..., perm])
    )
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(out_p), atol=1e-12)


@given(problems(), st.floats(-50, 50))
def test_per_row_constant_bias_changes_nothing(backend, problem, shift):
    q, k, v, mask, kw = problem
    b = backend.asarray
    row_bias = np.random.default_rng(0).standard_normal((q.shape[-2], 1)) * shift
    out = scaled_dot_product_attention(b(q), b(k), b(v), mask=b(mask), **kw)
    out_b = scaled_dot_product_attention(b(q), b(k), b(v), mask=b(mask), bias=b(row_bias), **kw)
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(out_b), atol=1e-10)


@given(problems())
def test_output_in_convex_hull_of_visible_values(backend, problem):
    q, k, v, mask, kw = problem
    b = backend.asarray
    out = backend.to_numpy(scaled_dot_product_attention(b(q), b(k), b(v), mask=b(mask), **kw))
    vis = visible(mask, kw, q.shape[-2], k.shape[-2])  # (Hq, Lq, Lk)
    groups = q.shape[0] // k.shape[0]
    for h in range(q.shape[0]):
        vals = v[h // groups]  # (Lk, D)
        for i in range(q.shape[1]):
            if not vis[h, i].any():
                assert np.all(out[h, i] == 0)
                continue
            seen = vals[vis[h, i]]
            # per coordinate, a convex combination stays within [min, max]
            assert np.all(out[h, i] >= seen.min(0) - 1e-12)
            assert np.all(out[h, i] <= seen.max(0) + 1e-12)


@given(problems(), st.sampled_from([None, (2, 3)]))
def test_max_logit_bounds_the_lse(backend, problem, block_size):
    """``max <= lse <= max + log(visible keys)``, both ``-inf`` on an empty row."""
    q, k, v, mask, kw = problem
    b = backend.asarray
    _, lse, top = scaled_dot_product_attention(
        b(q),
        b(k),
        b(v),
        mask=b(mask),
        block_size=block_size,
        **kw,
        return_lse=True,
        return_max_logit=True,
    )
    lse, top = backend.to_numpy(lse), backend.to_numpy(top)
    count = visible(mask, kw, q.shape[-2], k.shape[-2]).sum(-1)
    assert np.array_equal(np.isneginf(top), count == 0)
    assert np.array_equal(np.isneginf(lse), count == 0)
    seen = count > 0
    assert np.all(top[seen] <= lse[seen] + 1e-12)
    assert np.all(lse[seen] <= top[seen] + np.log(count[seen]) + 1e-12)

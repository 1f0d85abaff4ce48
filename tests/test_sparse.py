"""Sparse attention's selection: ``topk_indices`` against a stable NumPy sort.

Ties to the lower position, a row's invalid positions (past its length, NaN scores)
never selected, ``-1`` where fewer than `k` are valid, `k` past the length; on every
backend, under ``jax.jit`` with traced lengths; bad input named.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_attn.serving import topk_indices

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")


def oracle(scores, k, lengths=None):
    """(T, H, k) positions by a stable sort of (invalid, -score, position)."""
    t, h, n = scores.shape
    out = np.full((t, h, k), -1, dtype=np.int64)
    for i in range(t):
        for j in range(h):
            limit = n if lengths is None else lengths[i]
            ok = [p for p in range(n) if p < limit and not np.isnan(scores[i, j, p])]
            ok.sort(key=lambda p: -scores[i, j, p])  # stable: ties keep the lower first
            out[i, j, : min(k, len(ok))] = ok[:k]
    return out


def test_ties_lengths_nan_and_padding(backend):
    scores = np.array(
        [
            [[0.5, 2.0, 2.0, -np.inf, 1.0, 2.0], [np.nan, 1.0, 1.0, 1.0, 0.0, -1.0]],
            [[1.0, 0.0, 3.0, 3.0, 5.0, 9.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
            [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]],
        ]
    )
    lengths = np.array([6, 4, 0])
    for k in (0, 3, 6, 8):
        got = topk_indices(backend.asarray(scores), k, backend.asarray(lengths))
        np.testing.assert_array_equal(backend.to_numpy(got), oracle(scores, k, lengths))
    got = topk_indices(backend.asarray(scores), 4)
    np.testing.assert_array_equal(backend.to_numpy(got), oracle(scores, 4))
    # a valid -inf is selected after every finite score, before nothing else
    assert backend.to_numpy(got)[0, 0].tolist() == [1, 2, 5, 4]


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(0, 11),
    st.integers(0, 2**31 - 1),
)
def test_property_any_scores(backend, t, n, k, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(-2, 3, size=(t, 2, n)).astype(np.float64)  # many ties
    lengths = rng.integers(0, n + 1, size=t)
    got = topk_indices(backend.asarray(scores), k, backend.asarray(lengths))
    np.testing.assert_array_equal(backend.to_numpy(got), oracle(scores, k, lengths))


@pytest.mark.backends("jax", reason="jax.jit with traced lengths")
def test_under_jit(backend):
    import jax

    rng = np.random.default_rng(1)
    scores, lengths = rng.standard_normal((5, 2, 40)), np.array([40, 3, 0, 17, 39])
    got = jax.jit(lambda s, n: topk_indices(s, 8, n))(
        backend.asarray(scores), backend.asarray(lengths)
    )
    np.testing.assert_array_equal(np.asarray(got), oracle(scores, 8, lengths))


@pytest.mark.parametrize(
    ("args", "kind", "match"),
    [
        ((np.zeros((2, 3)), 1), ValueError, r"`scores` must have shape \(T, Hkv, L\)"),
        ((np.zeros((2, 1, 3)), -1), ValueError, "`k`"),
        ((np.zeros((2, 1, 3)), 1.5), TypeError, "`k`"),
        ((np.zeros((2, 1, 3), dtype=np.int64), 1), TypeError, "`scores`"),
        ((np.zeros((2, 1, 3)), 1, np.zeros(3, dtype=np.int64)), ValueError, "`kv_lengths`"),
        ((np.zeros((2, 1, 3)), 1, np.zeros(2)), TypeError, "`kv_lengths`"),
    ],
)
def test_bad_input_is_named(backend, args, kind, match):
    arrays = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    with pytest.raises(kind, match=match):
        topk_indices(*arrays)

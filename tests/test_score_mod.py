"""`score_mod`: a user function of the scores and their indices, dense and tiled."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn, run
from portable_attn import get_alibi_slopes, scaled_dot_product_attention
from portable_attn.testing import reference_attention

problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)


def _rel(xp, table, q_idx, kv_idx):
    idx = q_idx - kv_idx + 16  # (bq, bk)
    flat = xp.take(table, xp.reshape(idx, (-1,)), axis=0)
    return xp.reshape(flat, idx.shape)


class TestScoreMod:
    def test_relative_position_bias(self, backend, xp, route):
        table = randn(32, seed=9)
        table_b = backend.asarray(table)

        def rel_bias(scores, b, h, q_idx, kv_idx):  # a learned table indexed by i - j
            return scores + _rel(xp, table_b, q_idx, kv_idx)

        def rel_bias_np(scores, b, h, q_idx, kv_idx):
            return scores + table[q_idx - kv_idx + 16]

        q, k, v = problem()
        out, _ = run(backend, q, k, v, route=route, score_mod=rel_bias, is_causal=True)
        expected = reference_attention(q, k, v, score_mod=rel_bias_np, is_causal=True)
        assert_close(backend, out, expected)

    def test_expresses_alibi_and_softcap(self, backend, xp, route):
        q, k, v = problem(lq=9, lk=9)
        slopes = get_alibi_slopes(4)
        s = backend.asarray(slopes)[:, None, None]

        def alibi_and_cap(scores, b, h, q_idx, kv_idx):
            dist = xp.astype(xp.abs(q_idx - kv_idx), scores.dtype)
            return 2.0 * xp.tanh((scores - s * dist) / 2.0)

        by_mod, _ = run(backend, q, k, v, route=route, score_mod=alibi_and_cap)
        # the same by hand: softcap applies before ALiBi in the built-in order, so compare
        # against the oracle with a score_mod written in NumPy
        expected = reference_attention(
            q,
            k,
            v,
            score_mod=lambda sc, b, h, i, j: 2.0 * np.tanh((sc - slopes[h] * np.abs(i - j)) / 2.0),
        )
        assert_close(backend, by_mod, expected)
        cap = lambda sc, *_: 3.0 * xp.tanh(sc / 3.0)  # noqa: E731
        softcap_mod, _ = run(backend, q, k, v, route=route, score_mod=cap)
        builtin, _ = run(backend, q, k, v, route=route, softcap=3.0)
        np.testing.assert_allclose(
            backend.to_numpy(softcap_mod), backend.to_numpy(builtin), atol=1e-13
        )
        alibi_mod, _ = run(
            backend,
            q,
            k,
            v,
            route=route,
            score_mod=lambda sc, b, h, i, j: sc - s * xp.astype(xp.abs(i - j), sc.dtype),
        )
        alibi, _ = run(backend, q, k, v, route=route, alibi_slopes=slopes)
        np.testing.assert_allclose(
            backend.to_numpy(alibi_mod), backend.to_numpy(alibi), atol=1e-13
        )

    def test_batch_index(self, backend, xp):
        q, k, v = problem()
        shift = np.array([0.0, 5.0, -5.0])
        shift_b = backend.asarray(shift)

        def per_batch(scores, b, h, q_idx, kv_idx):
            return scores + xp.take(shift_b, xp.reshape(b, (-1,)), axis=0)[:, None, None, None] * (
                xp.astype(kv_idx == 0, scores.dtype)
            )

        out, _ = run(backend, q, k, v, score_mod=per_batch)
        bias = shift[:, None, None, None] * (np.arange(9) == 0)
        assert_close(backend, out, reference_attention(q, k, v, bias=bias))

    def test_not_callable(self, backend):
        q, k, v = problem(backend=backend)
        with pytest.raises(TypeError, match="`score_mod` must be callable"):
            scaled_dot_product_attention(q, k, v, score_mod=3)

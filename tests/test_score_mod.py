"""`score_mod`: a user function of the scores and their indices, dense and tiled."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn, run
from portable_attn import get_alibi_slopes, scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention

problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)


def _rel(xp, table, q_idx, kv_idx):
    idx = q_idx - kv_idx + 16  # (1, 1, bq, bk)
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
        s = xp.reshape(backend.asarray(slopes), (1, 4, 1, 1))  # at the rank of the scores

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


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_under_jax_rank_promotion_raise(backend, xp, route):
    """With ``jax_numpy_rank_promotion="raise"`` a FlexAttention-style ``score_mod`` raised.

    Issue 46, item 11: ``score + table[q_idx - kv_idx]`` added a (bq, bk) term to the
    (B, H, bq, bk) scores, ``slopes[h]`` was (H, 1, 1). The indices now come at the
    scores' rank; values, and a learned table's gradient under ``jax.jit``, as without.
    """
    import jax

    table, shift, slopes = randn(32, seed=9), np.array([0.0, 5.0, -5.0]), get_alibi_slopes(4)

    def make(table, shift, slopes):
        def score_mod(score, b, h, q_idx, kv_idx):
            distance = abs(q_idx - kv_idx)
            return score + table[q_idx - kv_idx + 16] - slopes[h] * distance + shift[b]

        return score_mod

    q, k, v = problem()
    on = [backend.asarray(a) for a in (table, shift, slopes)]
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    cot = backend.asarray(randn(3, 4, 7, 6, seed=4))

    def loss(table):
        mod = make(table, *on[1:])
        out = scaled_dot_product_attention(qb, kb, vb, score_mod=mod, is_causal=True, **route.kw)
        return xp.sum(out * cot)

    with jax.numpy_rank_promotion("raise"):
        out, _ = run(backend, q, k, v, route=route, score_mod=make(*on), is_causal=True)
        grad = jax.jit(jax.grad(loss))(on[0])
    expected = reference_attention(q, k, v, score_mod=make(table, shift, slopes), is_causal=True)
    assert_close(backend, out, expected)
    cot_np = backend.to_numpy(cot)

    def loss_np(table):
        mod = make(table, shift, slopes)
        return float(np.sum(reference_attention(q, k, v, score_mod=mod, is_causal=True) * cot_np))

    (numeric,) = central_differences(loss_np, [table])
    np.testing.assert_allclose(backend.to_numpy(grad), numeric, atol=1e-6, rtol=1e-5)

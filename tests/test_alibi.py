"""ALiBi: `alibi_slopes` and `get_alibi_slopes`, in the dense and the tiled path."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, check, float32_error_bound, qkv, randn
from portable_attn import get_alibi_slopes, scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention

problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)


class TestAlibiSlopesArgument:
    @pytest.mark.parametrize("per_batch", [False, True])
    def test_matches_oracle(self, backend, route, per_batch):
        q, k, v = problem()
        slopes = get_alibi_slopes(4)
        if per_batch:
            slopes = np.stack([slopes, slopes * 2, slopes / 2])
        check(backend, q, k, v, route=route, alibi_slopes=slopes, is_causal=True)

    def test_with_lengths(self, backend, route):
        q, k, v = problem()
        kw = {
            "alibi_slopes": get_alibi_slopes(4),
            "kv_lengths": np.array([9, 4, 6]),
            "q_lengths": np.array([7, 2, 5]),
            "is_causal": True,
        }
        check(backend, q, k, v, route=route, **kw)

    @pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
    def test_under_jax_rank_promotion_raise(self, backend, xp, route):
        """With ``jax_numpy_rank_promotion="raise"`` every call with ALiBi raised.

        The slopes (Hq, 1, 1) times the distances (Lq, Lk), then minus the (B, Hq, Lq, Lk)
        scores: operands of three ranks. Every operand now has the logits' rank; values,
        and the gradients of Q, K, V and the slopes, as without the option.
        """
        import jax

        q, k, v = problem()
        slopes = get_alibi_slopes(4)
        lengths = np.array([9, 4, 6])
        check(backend, q, k, v, route=route, alibi_slopes=slopes, kv_lengths=lengths)
        cot = backend.asarray(randn(3, 4, 7, 6, seed=4))
        n = backend.asarray(lengths)

        def loss(q, k, v, slopes):
            out = scaled_dot_product_attention(
                q, k, v, alibi_slopes=slopes, kv_lengths=n, is_causal=True, **route.kw
            )
            return xp.sum(out * cot)

        args = [backend.asarray(a) for a in (q, k, v, slopes)]
        with jax.numpy_rank_promotion("raise"):
            check(backend, q, k, v, route=route, alibi_slopes=slopes, kv_lengths=lengths)
            grads = backend.grad(loss, *args)
        for g, expected in zip(grads, backend.grad(loss, *args), strict=True):
            assert_close(backend, g, backend.to_numpy(expected))

    def test_bad_slope_shape(self, backend):
        q, k, v = problem(backend=backend)
        with pytest.raises(ValueError, match=r"`alibi_slopes` with shape \(5,\)"):
            scaled_dot_product_attention(q, k, v, alibi_slopes=backend.asarray(np.ones(5)))


class TestLearnedTableOfAnotherDtype:
    """A learned relative-position table (ALiBi learned) wider than Q, K and V.

    A float64 table indexed by ``i - j`` in a ``score_mod``, with float32 Q, K, V: the
    scores became float64 and torch refused ``P @ V`` ("expected scalar type Float but
    found Double"), on the dense and the tiled paths. The ``score_mod``'s result is now
    cast to the compute dtype; the table keeps its dtype and gets its gradient in it.
    """

    @staticmethod
    def _mod(xp, table):
        def rel(scores, b, h, q_idx, kv_idx):
            idx = q_idx - kv_idx + 16  # (bq, bk)
            bias = xp.reshape(xp.take(table, xp.reshape(idx, (-1,)), axis=0), idx.shape)
            return scores + bias

        return rel

    def test_values_and_the_tables_gradient(self, backend, xp, route):
        q, k, v = problem()
        table = randn(32, seed=9) * 0.5
        args = [backend.asarray(a, "float32") for a in (q, k, v)]
        table_b = backend.asarray(table, "float64")
        cot = randn(3, 4, 7, 6, seed=4)

        def loss(table):
            mod = self._mod(xp, table)
            out = scaled_dot_product_attention(*args, score_mod=mod, is_causal=True, **route.kw)
            assert out.dtype == backend.dtype("float32")
            return out, xp.sum(xp.astype(out, table.dtype) * backend.asarray(cot))

        def reference(table):
            rel = self._mod(np, table)
            f32 = [a.astype(np.float32).astype(np.float64) for a in (q, k, v)]
            return reference_attention(*f32, score_mod=rel, is_causal=True)

        out, _ = loss(table_b)
        expected = reference(table)
        bound = float32_error_bound(v, 9 + 6)
        assert_close(backend, out, expected, dtype="float32", atol=bound, rtol=0.0)
        if not backend.has_autodiff:
            return
        (grad,) = backend.grad(lambda t: loss(t)[1], table_b)
        assert grad.dtype == backend.dtype("float64")
        (numeric,) = central_differences(lambda t: float(np.sum(reference(t) * cot)), [table])
        np.testing.assert_allclose(backend.to_numpy(grad), numeric, atol=1e-4, rtol=1e-4)


class TestGetAlibiSlopes:
    def test_standard_slopes(self, backend, xp):
        # the geometric sequence of the ALiBi paper: 2^(-8/n), 2^(-16/n), ...
        np.testing.assert_allclose(get_alibi_slopes(8), 2.0 ** (-np.arange(1, 9)))
        np.testing.assert_allclose(get_alibi_slopes(4), 2.0 ** (-2.0 * np.arange(1, 5)))
        # not a power of two (BLOOM): the 8 slopes of n=8, then every other slope of n=16
        twelve = get_alibi_slopes(12)
        np.testing.assert_allclose(twelve[:8], 2.0 ** (-np.arange(1, 9)))
        np.testing.assert_allclose(twelve[8:], 2.0 ** (-np.arange(1, 17) / 2)[0::2][:4])
        arr = get_alibi_slopes(6, xp=xp, device=backend.device)
        np.testing.assert_allclose(backend.to_numpy(arr), get_alibi_slopes(6))

"""The QK-norm helpers: `l2_normalize` and `rms_norm`."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn import attention_weights, l2_normalize, rms_norm


class TestL2Normalize:
    def test_last_axis_with_a_zero_row(self, backend):
        x = randn(2, 3, 5)
        x[0, 0] = 0.0
        out = l2_normalize(backend.asarray(x))
        norms = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
        assert_close(backend, out, x / norms)

    def test_other_axis(self, backend):
        x = randn(4, 3)
        assert_close(
            backend,
            l2_normalize(backend.asarray(x), axis=0),
            x / np.linalg.norm(x, axis=0, keepdims=True),
        )

    def test_cosine_logits_are_bounded(self, backend, xp):
        q, k = randn(1, 6, 64) * 10, randn(1, 8, 64, seed=1) * 10
        qn, kn = l2_normalize(backend.asarray(q)), l2_normalize(backend.asarray(k))
        # with 1/sqrt(d) the cosine logits span at most 2/8: nearly uniform weights
        w = backend.to_numpy(attention_weights(qn, kn))
        assert w.max() < 1.5 / 8
        # a learned temperature (here 20) restores a usable range
        sharp = backend.to_numpy(attention_weights(qn, kn, scale=20.0))
        assert sharp.max() > 2 * w.max()

    @pytest.mark.autodiff
    def test_a_zero_vector_has_finite_zero_gradients(self, backend, xp):
        """A zero padding token under QK-norm: sqrt is never differentiated at 0."""
        x = backend.asarray(np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]]))
        w = backend.asarray(np.array([[0.3, -0.1, 0.7], [0.2, 0.5, -0.4]]))
        (g,) = backend.grad(lambda x: xp.sum(l2_normalize(x) * w), x)
        g = backend.to_numpy(g)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g[0], np.asarray([0.3, -0.1, 0.7]) / 1e-6, rtol=1e-9)
        u = np.array([1.0, 2.0, 2.0]) / 3.0  # d(x/|x|) = (I - u u^T) / |x|
        expected = (np.eye(3) - np.outer(u, u)) @ np.array([0.2, 0.5, -0.4]) / 3.0
        np.testing.assert_allclose(g[1], expected, rtol=1e-9, atol=1e-12)


class TestRmsNorm:
    def test_matches_formula(self, backend):
        x, w = randn(2, 5, 6), randn(6, seed=1)
        out = rms_norm(backend.asarray(x), backend.asarray(w), eps=1e-5)
        expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
        assert_close(backend, out, expected)

    @pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
    def test_under_jax_rank_promotion_raise(self, backend):
        """With ``jax_numpy_rank_promotion="raise"`` a (D,) weight times (..., D) raised.

        Issue 46, item 11: the weight is now given the input's rank first.
        """
        import jax

        with jax.numpy_rank_promotion("raise"):
            self.test_matches_formula(backend)

    def test_bad_eps(self, backend):
        with pytest.raises(ValueError, match="`eps` must be > 0"):
            rms_norm(backend.asarray(np.ones(3)), eps=0.0)

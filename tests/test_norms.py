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


class TestRmsNorm:
    def test_matches_formula(self, backend):
        x, w = randn(2, 5, 6), randn(6, seed=1)
        out = rms_norm(backend.asarray(x), backend.asarray(w), eps=1e-5)
        expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
        assert_close(backend, out, expected)

    def test_bad_eps(self, backend):
        with pytest.raises(ValueError, match="`eps` must be > 0"):
            rms_norm(backend.asarray(np.ones(3)), eps=0.0)

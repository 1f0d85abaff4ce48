"""Rotary position embeddings and the QK-norm helpers."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close
from portable_attn import apply_rope, l2_normalize, rms_norm


def rope_oracle(x, positions, base=10000.0, interleaved=False):
    """Float64 RoPE by explicit 2x2 rotations of each feature pair."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    pos = np.broadcast_to(np.asarray(positions, dtype=np.float64), x.shape[:-3] + x.shape[-2:-1])
    for p in range(d // 2):
        theta = pos[..., None, :] * base ** (-2.0 * p / d)  # (..., 1, L)
        c, s = np.cos(theta), np.sin(theta)
        a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + d // 2)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


class TestRope:
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_matches_oracle(self, backend, interleaved):
        x = randn(2, 3, 5, 8)
        pos = np.arange(7, 12)  # offsets, as for tokens appended to a cache
        out = apply_rope(backend.asarray(x), backend.asarray(pos), interleaved=interleaved)
        assert_close(backend, out, rope_oracle(x, pos, interleaved=interleaved))

    def test_per_sequence_positions(self, backend):
        x = randn(2, 3, 4, 6)
        pos = np.array([[0, 1, 2, 3], [5, 6, 7, 8]])
        out = apply_rope(backend.asarray(x), backend.asarray(pos))
        assert_close(backend, out, rope_oracle(x, pos))

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_dot_product_depends_only_on_position_difference(self, backend, xp, interleaved):
        q, k = randn(1, 1, 16), randn(1, 1, 16, seed=1)
        dots = []
        for s, t in [(3, 1), (10, 8), (102, 100)]:
            rq = apply_rope(
                backend.asarray(q), backend.asarray(np.array([s])), interleaved=interleaved
            )
            rk = apply_rope(
                backend.asarray(k), backend.asarray(np.array([t])), interleaved=interleaved
            )
            dots.append(float(backend.to_numpy(xp.sum(rq * rk))))
        np.testing.assert_allclose(dots, dots[0], atol=1e-10)

    def test_linear_scaling_divides_positions(self, backend):
        x, pos = randn(1, 4, 8), np.arange(4) * 4.0
        scaled = apply_rope(
            backend.asarray(x), backend.asarray(pos), scaling={"type": "linear", "factor": 4.0}
        )
        assert_close(backend, scaled, rope_oracle(x, pos / 4.0))

    def test_ntk_scaling_raises_the_base(self, backend):
        x, pos = randn(1, 4, 8), np.arange(4)
        out = apply_rope(
            backend.asarray(x), backend.asarray(pos), scaling={"type": "ntk", "factor": 8.0}
        )
        assert_close(backend, out, rope_oracle(x, pos, base=10000.0 * 8.0 ** (8 / 6)))

    def test_keeps_half_precision_dtype(self, backend):
        if not backend.supports("float16"):
            pytest.skip(f"{backend.kind} has no float16")
        x = randn(1, 4, 8)
        out = apply_rope(backend.asarray(x, "float16"), backend.asarray(np.arange(4)))
        assert out.dtype == backend.dtype("float16")
        np.testing.assert_allclose(backend.to_numpy(out), rope_oracle(x, np.arange(4)), atol=5e-3)

    @pytest.mark.parametrize(
        ("shape", "pos", "match"),
        [
            ((1, 4, 7), 4, "even D"),
            ((1, 4, 8), 5, r"`positions` must have shape \(\.\.\., L\) with L = 4"),
        ],
    )
    def test_bad_shapes(self, backend, shape, pos, match):
        with pytest.raises(ValueError, match=match):
            apply_rope(backend.asarray(np.ones(shape)), backend.asarray(np.arange(pos)))

    def test_bad_scaling(self, backend):
        with pytest.raises(ValueError, match="`scaling`"):
            apply_rope(
                backend.asarray(np.ones((1, 4, 8))),
                backend.asarray(np.arange(4)),
                scaling={"type": "yarn", "factor": 2},
            )


class TestNorms:
    def test_l2_normalize(self, backend):
        x = randn(2, 3, 5)
        x[0, 0] = 0.0
        out = l2_normalize(backend.asarray(x))
        norms = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
        assert_close(backend, out, x / norms)

    def test_l2_normalize_other_axis(self, backend):
        x = randn(4, 3)
        assert_close(
            backend,
            l2_normalize(backend.asarray(x), axis=0),
            x / np.linalg.norm(x, axis=0, keepdims=True),
        )

    def test_rms_norm(self, backend):
        x, w = randn(2, 5, 6), randn(6, seed=1)
        out = rms_norm(backend.asarray(x), backend.asarray(w), eps=1e-5)
        expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
        assert_close(backend, out, expected)

    def test_cosine_logits_are_bounded(self, backend, xp):
        from portable_attn import attention_weights

        q, k = randn(1, 6, 64) * 10, randn(1, 8, 64, seed=1) * 10
        qn, kn = l2_normalize(backend.asarray(q)), l2_normalize(backend.asarray(k))
        # with 1/sqrt(d) the cosine logits span at most 2/8: nearly uniform weights
        w = backend.to_numpy(attention_weights(qn, kn))
        assert w.max() < 1.5 / 8
        # a learned temperature (here 20) restores a usable range
        sharp = backend.to_numpy(attention_weights(qn, kn, scale=20.0))
        assert sharp.max() > 2 * w.max()

    def test_bad_eps(self, backend):
        with pytest.raises(ValueError, match="`eps` must be > 0"):
            rms_norm(backend.asarray(np.ones(3)), eps=0.0)

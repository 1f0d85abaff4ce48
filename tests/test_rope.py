"""Rotary position embeddings: `apply_rope` against explicit 2x2 rotations."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn import apply_rope


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

    @pytest.mark.dtypes("float16")
    def test_keeps_half_precision_dtype(self, backend, dtype):
        x = randn(1, 4, 8)
        out = apply_rope(backend.asarray(x, dtype), backend.asarray(np.arange(4)))
        assert out.dtype == backend.dtype(dtype)
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

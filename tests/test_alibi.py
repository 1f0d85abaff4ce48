"""ALiBi: `alibi_slopes` and `get_alibi_slopes`, in the dense and the tiled path."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import check, qkv
from portable_attn import get_alibi_slopes, scaled_dot_product_attention

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

    def test_bad_slope_shape(self, backend):
        q, k, v = problem(backend=backend)
        with pytest.raises(ValueError, match=r"`alibi_slopes` with shape \(5,\)"):
            scaled_dot_product_attention(q, k, v, alibi_slopes=backend.asarray(np.ones(5)))


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

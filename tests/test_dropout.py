"""Dropout by a caller-given keep-mask (`dropout_p`, `dropout_mask`), dense and tiled."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import check, qkv, run
from portable_attn import scaled_dot_product_attention

problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)


class TestDropout:
    def test_matches_oracle(self, backend, route):
        q, k, v = problem()
        keep = np.random.default_rng(3).random((3, 4, 7, 9)) > 0.25
        check(
            backend,
            q,
            k,
            v,
            route=route,
            dropout_p=0.25,
            dropout_mask=keep,
            is_causal=True,
        )

    def test_expected_output_is_unchanged(self, backend):
        # averaging over many keep-masks recovers the no-dropout output
        q, k, v = problem(batch=(1,), lq=3, lk=4)
        rng = np.random.default_rng(0)
        keep = rng.random((4000, 4, 3, 4)) > 0.5
        out, _ = run(
            backend, np.broadcast_to(q, (4000, 4, 3, 6)), k, v, dropout_p=0.5, dropout_mask=keep
        )
        plain, _ = run(backend, q, k, v)
        np.testing.assert_allclose(
            backend.to_numpy(out).mean(0), backend.to_numpy(plain)[0], atol=0.06
        )

    @pytest.mark.parametrize(
        ("p", "mask", "match"),
        [
            (0.5, None, "needs a `dropout_mask`"),
            (0.0, True, "needs a `dropout_mask`"),
            (1.0, True, r"must be in \[0, 1\)"),
            (-0.1, True, r"must be in \[0, 1\)"),
        ],
    )
    def test_bad_arguments(self, backend, p, mask, match):
        q, k, v = problem(backend=backend)
        m = None if mask is None else backend.asarray(np.ones((7, 9), dtype=bool))
        with pytest.raises(ValueError, match=match):
            scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_mask=m)

"""The tiled (online-softmax) path: exact against the dense path and the oracle."""

from __future__ import annotations

import tracemalloc
from functools import partial

import numpy as np
import pytest

from _helpers import (
    assert_backend_array,
    assert_close,
    float32_error_bound,
    half_precision_bound,
    on_backend,
    qkv,
    randn,
    representable,
)
from portable_attn import scaled_dot_product_attention
from portable_attn.testing import reference_attention

problem = partial(qkv, lq=13, lk=11, dk=8, dv=5)  # lengths that no block size divides


def both_paths(backend, q, k, v, block_size, dtype="float64", **kw):
    kw = on_backend(backend, kw)
    args = [backend.asarray(a, dtype) for a in (q, k, v)]
    dense = scaled_dot_product_attention(*args, **kw)
    tiled = scaled_dot_product_attention(*args, block_size=block_size, **kw)
    return dense, tiled


FEATURES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window": {"window": (2, 3)},
    "causal+window+softcap": {"is_causal": True, "window": (3, None), "softcap": 1.5},
}


class TestExactness:
    @pytest.mark.parametrize("name", list(FEATURES))
    @pytest.mark.parametrize("block_size", [1, 4, 5, 64, (3, 7)])
    def test_matches_oracle(self, backend, name, block_size):
        q, k, v = problem()
        kw = FEATURES[name]
        _, tiled = both_paths(backend, q, k, v, block_size, **kw)
        assert_close(backend, tiled, reference_attention(q, k, v, **kw))

    @pytest.mark.parametrize(("lq", "lk"), [(13, 11), (11, 13), (1, 17), (17, 1)])
    def test_mask_bias_causal_gqa_broadcast(self, backend, lq, lk):
        q = randn(3, 1, 4, lq, 8)
        k, v = randn(1, 2, 2, lk, 8, seed=1), randn(3, 2, 2, lk, 4, seed=2)
        rng = np.random.default_rng(3)
        mask = rng.random((1, 4, lq, lk)) < 0.7
        bias = rng.standard_normal((lq, 1))  # broadcast over keys
        kw = {"mask": mask, "bias": bias, "is_causal": True}
        dense, tiled = both_paths(backend, q, k, v, 4, **kw)
        assert_close(backend, tiled, reference_attention(q, k, v, **kw))
        np.testing.assert_allclose(backend.to_numpy(tiled), backend.to_numpy(dense), atol=1e-13)

    def test_key_only_bias_and_mask(self, backend):
        q, k, v = problem()
        rng = np.random.default_rng(4)
        kw = {"mask": rng.random(11) < 0.8, "bias": rng.standard_normal(11)}
        _, tiled = both_paths(backend, q, k, v, 3, **kw)
        assert_close(backend, tiled, reference_attention(q, k, v, **kw))

    def test_float32_error_is_bounded_like_the_dense_paths(self, backend):
        """The tiles sum in another order than the dense path: both are bounded, not equal."""
        q, k, v = problem(lq=70, lk=90, dk=32, dv=32)
        dense, tiled = both_paths(backend, q, k, v, 16, dtype="float32", is_causal=True)
        assert_backend_array(backend, tiled, dtype="float32", shape=dense.shape)
        q, k, v = (representable(backend, a, "float32") for a in (q, k, v))
        expected = reference_attention(q, k, v, is_causal=True)
        bound = float32_error_bound(v, length=90 + 32)
        assert np.abs(backend.to_numpy(dense) - expected).max() <= bound
        assert np.abs(backend.to_numpy(tiled) - expected).max() <= bound

    @pytest.mark.dtypes("float16", "bfloat16")
    def test_half_precision_within_dense_error(self, backend, dtype):
        q, k, v = problem(lq=40, lk=48, dk=32, dv=32)
        q, k, v = (representable(backend, a, dtype) for a in (q, k, v))
        expected = reference_attention(q, k, v, is_causal=True)
        dense, tiled = both_paths(backend, q, k, v, 16, dtype=dtype, is_causal=True)
        assert_backend_array(backend, tiled, dtype=dtype)
        err_dense = np.abs(backend.to_numpy(dense) - expected).max()
        err_tiled = np.abs(backend.to_numpy(tiled) - expected).max()
        bound = half_precision_bound(backend, expected, dtype, baseline_error=err_dense)
        assert err_tiled <= bound, (err_tiled, err_dense, bound)


class TestMaskedBlocks:
    def test_fully_masked_rows_and_blocks_are_zero(self, backend):
        q, k, v = problem(lq=12, lk=12)
        mask = np.ones((12, 12), dtype=bool)
        mask[:, :8] = False  # the first key blocks are entirely masked
        mask[[2, 9]] = False  # and two rows see nothing at all
        _, tiled = both_paths(backend, q, k, v, 4, mask=mask)
        out = backend.to_numpy(tiled)
        assert np.all(np.isfinite(out))
        assert np.all(out[..., [2, 9], :] == 0)
        assert_close(backend, tiled, reference_attention(q, k, v, mask=mask))

    def test_neg_inf_bias_block_does_not_poison_running_max(self, backend):
        q, k, v = problem(lq=6, lk=12)
        bias = np.zeros((6, 12))
        bias[:, 4:8] = -np.inf
        _, tiled = both_paths(backend, q, k, v, 4, bias=bias)
        assert_close(backend, tiled, reference_attention(q, k, v, bias=bias))

    def test_more_queries_than_keys_causal(self, backend):
        q, k, v = problem(lq=20, lk=6)
        _, tiled = both_paths(backend, q, k, v, 4, is_causal=True)
        out = backend.to_numpy(tiled)
        assert np.all(out[..., :14, :] == 0)
        assert_close(backend, tiled, reference_attention(q, k, v, is_causal=True))

    def test_auto_is_dense_when_small(self, backend):
        q, k, v = problem()
        dense, auto = both_paths(backend, q, k, v, "auto", is_causal=True)
        np.testing.assert_array_equal(backend.to_numpy(auto), backend.to_numpy(dense))


class TestMemory:
    @pytest.mark.kinds("numpy", reason="tracemalloc sees NumPy allocations only")
    def test_numpy_tiled_never_builds_the_score_matrix(self, backend):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2, 2048, 16)).astype(np.float32) for _ in range(3))
        scores_bytes = 2 * 2048 * 2048 * 4  # 32 MiB
        tracemalloc.start()
        try:
            scaled_dot_product_attention(q, k, v, is_causal=True, block_size=128)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < scores_bytes / 8, peak


class TestErrors:
    @pytest.mark.parametrize(
        ("block_size", "error"),
        [
            (0, ValueError),
            (-4, ValueError),
            ((4, 0), ValueError),
            (2.5, TypeError),
            ("big", TypeError),
            (True, TypeError),
            ((4,), TypeError),
            ((2, 3, 4), TypeError),
        ],
    )
    def test_bad_block_size(self, backend, block_size, error):
        q, k, v = problem(backend=backend)
        with pytest.raises(error, match=r"`block_size` must be None, 'auto', 'dense', a positive"):
            scaled_dot_product_attention(q, k, v, block_size=block_size)


@pytest.mark.skip_backends("array_api_strict", "dask", reason="no exp2 (not in the standard)")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_exp2_form_of_exp_errs_by_the_rounding_of_its_argument(backend, dtype):
    """Exp2Ops (torch's walk: Library.exp2): exp(x) within |x|·log2(e)·eps of float64 exp."""
    from portable_attn._paths._ops import Exp2Ops

    x = np.concatenate([-np.geomspace(1e-6, 100.0, 2000), [0.0, -np.inf, np.nan]]).astype(dtype)
    ops = Exp2Ops(backend.xp)
    given = backend.asarray(x)
    got = backend.to_numpy(ops.exp(given))
    np.testing.assert_array_equal(backend.to_numpy(given), x)  # not owned: left as it was
    owned = backend.to_numpy(ops.exp(given * 1.0, owned=True))  # a fresh array of ours
    np.testing.assert_array_equal(owned, got)
    want = np.exp(x.astype(np.float64))
    eps = np.finfo(dtype).eps
    finite = np.isfinite(x) & (want > np.finfo(dtype).tiny)  # past that: subnormal results
    bound = (np.abs(x[finite]) * np.log2(np.e) + 2.0) * eps
    assert np.all(np.abs(got[finite] - want[finite]) <= bound * want[finite])
    assert got[-2] == 0.0
    assert np.isnan(got[-1])

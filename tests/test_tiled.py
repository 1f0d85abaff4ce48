"""The tiled (online-softmax) path: exact against the dense path and the oracle."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import assert_backend_array, assert_close
from _reference import reference_attention, structure
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._scores import AttentionPlan
from portable_attn._lib._tiled import block_ranges, block_visibility


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def problem(batch=(2,), hq=4, hkv=2, lq=13, lk=11, dk=8, dv=5, seed=0):
    return (
        randn(*batch, hq, lq, dk, seed=seed),
        randn(*batch, hkv, lk, dk, seed=seed + 1),
        randn(*batch, hkv, lk, dv, seed=seed + 2),
    )


def both_paths(backend, q, k, v, block_size, dtype="float64", **kw):
    kw = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
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

    def test_float32_within_2e_6_of_dense(self, backend):
        q, k, v = problem(lq=70, lk=90, dk=32, dv=32)
        dense, tiled = both_paths(backend, q, k, v, 16, dtype="float32", is_causal=True)
        assert_backend_array(backend, tiled, dtype="float32", shape=dense.shape)
        assert np.abs(backend.to_numpy(tiled) - backend.to_numpy(dense)).max() <= 2e-6

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_half_precision_within_dense_error(self, backend, dtype):
        if not backend.supports(dtype):
            pytest.skip(f"{backend.kind} has no {dtype}")
        q, k, v = problem(lq=40, lk=48, dk=32, dv=32)
        q, k, v = (
            backend.to_numpy(backend.asarray(a, dtype)).astype(np.float64) for a in (q, k, v)
        )
        expected = reference_attention(q, k, v, is_causal=True)
        dense, tiled = both_paths(backend, q, k, v, 16, dtype=dtype, is_causal=True)
        assert_backend_array(backend, tiled, dtype=dtype)
        err_dense = np.abs(backend.to_numpy(dense) - expected).max()
        err_tiled = np.abs(backend.to_numpy(tiled) - expected).max()
        ulp = float(np.finfo(np.float16).eps) if dtype == "float16" else 2.0**-7
        assert err_tiled <= max(err_dense, ulp * np.abs(expected).max())


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

    def test_auto_tiles_above_the_threshold(self, backend, monkeypatch):
        import portable_attn._attention as attention

        monkeypatch.setattr(attention, "AUTO_DENSE_LIMIT_BYTES", 0)
        monkeypatch.setattr(attention, "AUTO_DENSE_LIMIT_BYTES_TORCH", 0)
        seen = []
        real = attention.tiled_attention
        monkeypatch.setattr(
            attention, "tiled_attention", lambda *a: seen.append(a[-2:]) or real(*a)
        )
        q, k, v = problem()
        _, auto = both_paths(backend, q, k, v, "auto", is_causal=True)
        assert seen, "block_size='auto' above the threshold must take the tiled path"
        assert_close(backend, auto, reference_attention(q, k, v, is_causal=True))


class TestBlockSkipping:
    @given(
        lq=st.integers(1, 12),
        lk=st.integers(1, 12),
        bq=st.integers(1, 5),
        bk=st.integers(1, 5),
        causal=st.booleans(),
        window=st.sampled_from([None, (0, 0), (2, None), (None, 1), (3, 2)]),
    )
    def test_visibility_agrees_with_the_structure(self, lq, lk, bq, bk, causal, window):
        plan = AttentionPlan((), 1, 1, lq, lk, 1, 1.0, None, causal, window, None, None, None)
        allowed = structure(lq, lk, is_causal=causal, window=window)
        for qr, kr in itertools.product(block_ranges(lq, bq), block_ranges(lk, bk)):
            blk = allowed[qr[0] : qr[1], kr[0] : kr[1]]
            vis = block_visibility(plan, qr, kr)
            assert (vis == "skip") == (not blk.any())
            if vis == "full":
                assert blk.all()

    def test_causal_skips_about_half_the_blocks(self):
        plan = AttentionPlan((), 1, 1, 1024, 1024, 1, 1.0, None, True, None, None, None, None)
        blocks = list(itertools.product(block_ranges(1024, 64), repeat=2))
        computed = sum(block_visibility(plan, qr, kr) != "skip" for qr, kr in blocks)
        assert computed == 16 * 17 // 2  # the lower triangle of 16 x 16 blocks


class TestMemory:
    def test_numpy_tiled_never_builds_the_score_matrix(self, backend):
        if backend.kind != "numpy":
            pytest.skip("tracemalloc sees NumPy allocations only")
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
    @pytest.mark.parametrize("block_size", [0, -4, 2.5, "big", True, (4, 0), (4,), (2, 3, 4)])
    def test_bad_block_size(self, backend, block_size):
        q, k, v = (backend.asarray(a) for a in problem())
        with pytest.raises(ValueError, match=r"`block_size` must be None, a positive integer"):
            scaled_dot_product_attention(q, k, v, block_size=block_size)


GRAD_CASES = {
    "causal+bias": {"is_causal": True},
    "window+softcap": {"window": (2, 1), "softcap": 2.0},
    "masked rows": {"masked_rows": True},
}


class TestGradients:
    @pytest.mark.parametrize("name", list(GRAD_CASES))
    def test_match_dense_gradients(self, backend, xp, name):
        if not backend.has_autodiff:
            pytest.skip(f"{backend.kind} has no automatic differentiation")
        kw = dict(GRAD_CASES[name])
        mask = None
        if kw.pop("masked_rows", False):
            mask_np = np.ones((9, 7), dtype=bool)
            mask_np[[0, 5]] = False
            mask_np[:, :3] = False
            mask = backend.asarray(mask_np)
        q = backend.asarray(randn(3, 1, 4, 9, 6))  # broadcast batch: q (3, 1), k/v (1, 2)
        k, v = (
            backend.asarray(randn(1, 2, 2, 7, 6, seed=1)),
            backend.asarray(randn(1, 2, 2, 7, 5, seed=2)),
        )
        bias = backend.asarray(randn(1, 4, 9, 7, seed=3))
        cot = backend.asarray(randn(3, 2, 4, 9, 5, seed=4))

        def loss(block_size):
            def f(q, k, v, bias):
                out = scaled_dot_product_attention(
                    q, k, v, bias=bias, mask=mask, block_size=block_size, **kw
                )
                return xp.sum(out * cot)

            return f

        dense = backend.grad(loss(None), q, k, v, bias)
        tiled = backend.grad(loss(4), q, k, v, bias)
        for name_, d, t in zip("qkvb", dense, tiled, strict=True):
            d, t = backend.to_numpy(d), backend.to_numpy(t)
            assert np.all(np.isfinite(t)), name_
            np.testing.assert_allclose(t, d, atol=1e-12, err_msg=name_)
        if mask is not None:
            assert np.all(backend.to_numpy(tiled[0])[..., [0, 5], :] == 0)

    def test_torch_uses_the_recomputing_backward(self, backend):
        if backend.family != "torch":
            pytest.skip("torch autograd.Function only")
        q, k, v = (backend.asarray(a).requires_grad_(True) for a in problem())
        out = scaled_dot_product_attention(q, k, v, block_size=4, is_causal=True)
        assert "TiledAttention" in type(out.grad_fn).__name__
        # one node, not one per block: nothing per block is saved for backward
        assert len(out.grad_fn.next_functions) <= 6

    def test_jax_grad_under_jit(self, backend):
        if backend.family != "jax":
            pytest.skip("jax only")
        import jax

        q, k, v = (backend.asarray(a) for a in problem())

        def loss(q, k, v):
            return (scaled_dot_product_attention(q, k, v, block_size=4, is_causal=True) ** 2).sum()

        eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(eager, jitted, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-12)

    def test_torch_gradcheck(self, backend):
        if backend.family != "torch":
            pytest.skip("torch only")
        import torch

        q, k, v = (
            backend.asarray(a).requires_grad_(True) for a in problem(lq=5, lk=6, dk=3, dv=2)
        )
        bias = backend.asarray(randn(5, 6, seed=7)).requires_grad_(True)

        def f(q, k, v, bias):
            return scaled_dot_product_attention(
                q, k, v, bias=bias, is_causal=True, softcap=2.0, block_size=2
            )

        assert torch.autograd.gradcheck(f, (q, k, v, bias))

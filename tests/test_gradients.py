"""Gradients on the backends with automatic differentiation (torch, JAX).

Against central differences and ``torch.autograd.gradcheck``; the tiled path's
recomputing backward against the dense path's; the native kernels' against the
portable path's; zero, finite gradients for rows that see no key.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn
from portable_attn import (
    attention_weights,
    get_alibi_slopes,
    init_mha_params,
    multi_head_attention,
    scaled_dot_product_attention,
)
from portable_attn.testing import central_differences

pytestmark = pytest.mark.autodiff

small = partial(qkv, lq=3, lk=6, dk=5, dv=3)  # GQA: Hq=4, Hkv=2; Lq=3 < Lk=6
tiled_problem = partial(qkv, lq=13, lk=11, dk=8, dv=5)  # lengths no block size divides
model_args_problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)  # 3 lengths

FEATURES = {
    "plain": {},
    "causal_softcap": {"is_causal": True, "softcap": 2.0},
    "window_scale": {"window": (1, 1), "scale": 0.7},
}


class TestAgainstCentralDifferences:
    @pytest.mark.parametrize("name", list(FEATURES))
    def test_query_key_value_and_bias(self, backend, xp, name):
        kw = FEATURES[name]
        rng = np.random.default_rng(1)
        cot = backend.asarray(rng.standard_normal((2, 4, 3, 3)))
        bias = rng.standard_normal((3, 6))

        def loss(q, k, v, b):
            out = scaled_dot_product_attention(q, k, v, bias=b, **kw)
            return xp.sum(out * cot)

        args = [*small(backend=backend), backend.asarray(bias)]
        analytic = backend.grad(loss, *args)

        def loss_np(*arrays):
            return float(backend.to_numpy(loss(*(backend.asarray(a) for a in arrays))))

        numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
        for g, n in zip(analytic, numeric, strict=True):
            np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)


@pytest.mark.backends("torch", reason="torch.autograd.gradcheck")
class TestTorchGradcheck:
    def test_dense(self, backend):
        import torch

        q, k, v = (a.detach().requires_grad_(True) for a in small(backend=backend))
        mask = backend.asarray(np.random.default_rng(2).random((3, 6)) < 0.7)

        def f(q, k, v):
            return scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True, softcap=3.0)

        assert torch.autograd.gradcheck(f, (q, k, v))
        assert torch.autograd.gradcheck(
            lambda q, k: attention_weights(q, k, window=(1, 0)), (q, k)
        )

    def test_tiled(self, backend):
        import torch

        q, k, v = (
            a.requires_grad_(True) for a in tiled_problem(lq=5, lk=6, dk=3, dv=2, backend=backend)
        )
        bias = backend.asarray(randn(5, 6, seed=7)).requires_grad_(True)

        def f(q, k, v, bias):
            return scaled_dot_product_attention(
                q, k, v, bias=bias, is_causal=True, softcap=2.0, block_size=2
            )

        assert torch.autograd.gradcheck(f, (q, k, v, bias))


class TestRowsThatSeeNoKey:
    def test_masked_rows_have_zero_gradients(self, backend, xp):
        mask = np.ones((3, 6), dtype=bool)
        mask[1] = False
        bias = np.zeros((3, 6))
        bias[2] = -np.inf
        m, b = backend.asarray(mask), backend.asarray(bias)

        def loss(q, k, v):
            return xp.sum(scaled_dot_product_attention(q, k, v, mask=m, bias=b))

        q, k, v = small(backend=backend)
        gq, gk, gv = (backend.to_numpy(g) for g in backend.grad(loss, q, k, v))
        for g in (gq, gk, gv):
            assert np.all(np.isfinite(g))
        assert np.all(gq[..., 1:, :] == 0)  # rows 1 and 2 see nothing
        assert np.any(gq[..., 0, :] != 0)

        # the gradient of the visible row equals that of a call without the dead rows
        def loss_row0(q, k, v):
            return xp.sum(scaled_dot_product_attention(q[..., :1, :], k, v))

        gq0 = backend.to_numpy(backend.grad(loss_row0, q, k, v)[0])
        np.testing.assert_allclose(gq[..., 0, :], gq0[..., 0, :], atol=1e-12)

    def test_causal_rows_before_every_key_have_zero_gradients(self, backend, xp):
        q, k, v = qkv(batch=(), hq=2, hkv=2, lq=6, lk=3, dk=4, dv=4, seed=3, backend=backend)

        def loss(q, k, v):
            return xp.sum(attention_weights(q, k, is_causal=True) ** 2) + xp.sum(
                scaled_dot_product_attention(q, k, v, is_causal=True)
            )

        grads = [backend.to_numpy(g) for g in backend.grad(loss, q, k, v)]
        assert all(np.all(np.isfinite(g)) for g in grads)
        assert np.all(grads[0][:, :3] == 0)  # Lq > Lk: the first 3 rows are empty


TILED_CASES = {
    "causal+bias": {"is_causal": True},
    "window+softcap": {"window": (2, 1), "softcap": 2.0},
    "masked rows": {"masked_rows": True},
}


class TestTiledMatchesDense:
    @pytest.mark.parametrize("name", list(TILED_CASES))
    def test_mask_bias_and_broadcast_batch(self, backend, xp, name):
        kw = dict(TILED_CASES[name])
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

    @pytest.mark.parametrize(
        "kw",
        [
            {"alibi": True, "is_causal": True},
            {"lengths": True, "is_causal": True},
            {"dropout": True},
            {"score_mod": True},
        ],
        ids=["alibi", "lengths", "dropout", "score_mod"],
    )
    def test_model_arguments(self, backend, xp, kw):
        kw = dict(kw)
        args = {}
        if kw.pop("alibi", False):
            args["alibi_slopes"] = backend.asarray(get_alibi_slopes(4))
        if kw.pop("lengths", False):
            args["q_lengths"] = backend.asarray(np.array([7, 3, 1]))
            args["kv_lengths"] = backend.asarray(np.array([9, 5, 2]))
        if kw.pop("dropout", False):
            args["dropout_p"] = 0.3
            args["dropout_mask"] = backend.asarray(
                np.random.default_rng(1).random((3, 4, 7, 9)) > 0.3
            )
        if kw.pop("score_mod", False):
            args["score_mod"] = lambda s, b, h, i, j: s * 0.5 + xp.astype(i >= j, s.dtype)
        cot = backend.asarray(randn(3, 4, 7, 6, seed=5))

        def loss(block_size):
            def f(q, k, v):
                out = scaled_dot_product_attention(q, k, v, block_size=block_size, **args, **kw)
                return xp.sum(out * cot)

            return f

        q, k, v = model_args_problem(backend=backend)
        dense = backend.grad(loss(None), q, k, v)
        tiled = backend.grad(loss(3), q, k, v)
        for d, t in zip(dense, tiled, strict=True):
            np.testing.assert_allclose(backend.to_numpy(t), backend.to_numpy(d), atol=1e-12)

    def test_alibi_slopes(self, backend, xp):
        q, k, v = model_args_problem(backend=backend)

        def loss(block_size):
            def f(slopes):
                out = scaled_dot_product_attention(
                    q, k, v, alibi_slopes=slopes, is_causal=True, block_size=block_size
                )
                return xp.sum(out**2)

            return f

        slopes = backend.asarray(get_alibi_slopes(4))
        dense = backend.grad(loss(None), slopes)[0]
        tiled = backend.grad(loss(3), slopes)[0]
        np.testing.assert_allclose(backend.to_numpy(tiled), backend.to_numpy(dense), atol=1e-12)
        assert np.any(backend.to_numpy(dense) != 0)

    @pytest.mark.backends("torch", reason="torch autograd.Function only")
    def test_torch_uses_the_recomputing_backward(self, backend):
        q, k, v = (a.requires_grad_(True) for a in tiled_problem(backend=backend))
        out = scaled_dot_product_attention(q, k, v, block_size=4, is_causal=True)
        assert "TiledAttention" in type(out.grad_fn).__name__
        # one node, not one per block: nothing per block is saved for backward
        assert len(out.grad_fn.next_functions) <= 6


@pytest.mark.backends("jax", reason="jax.grad under jax.jit")
class TestUnderJit:
    @pytest.mark.parametrize("block_size", [None, 4], ids=["dense", "tiled"])
    def test_equals_eager(self, backend, block_size):
        import jax

        if block_size is None:
            q, k, v = small(backend=backend)
        else:
            q, k, v = tiled_problem(backend=backend)

        def loss(q, k, v):
            out = scaled_dot_product_attention(q, k, v, block_size=block_size, is_causal=True)
            return (out**2).sum()

        eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(eager, jitted, strict=True):
            assert_close(backend, b, a, atol=1e-12, rtol=0)


@pytest.mark.backends("torch", "jax", reason="native kernels: torch and JAX")
class TestNative:
    def test_match_portable_and_stay_finite_on_empty_rows(self, backend, xp):
        lq, lk = 6, 9
        args = qkv(lq=lq, lk=lk, dk=8, dv=8, backend=backend)
        m = np.ones((lq, lk), dtype=bool)
        m[[1, 4]] = False
        b = np.zeros((lq, lk))
        b[2] = -np.inf
        kw = {"mask": backend.asarray(m), "bias": backend.asarray(b)}
        cot = backend.asarray(randn(2, 4, 6, 8, seed=5))
        # jax.nn.dot_product_attention computes its softmax in float32, even for float64
        tolerance = 2e-6 if backend.family == "jax" else 1e-12

        def loss(impl):
            def f(q, k, v):
                out = scaled_dot_product_attention(q, k, v, implementation=impl, **kw)
                return xp.sum(out * cot)

            return f

        native = backend.grad(loss("native"), *args)
        portable = backend.grad(loss("portable"), *args)
        for n, p in zip(native, portable, strict=True):
            n = backend.to_numpy(n)
            assert np.all(np.isfinite(n))
            np.testing.assert_allclose(n, backend.to_numpy(p), atol=10 * tolerance)


class TestMultiHeadAttention:
    def test_gradients_flow_to_parameters(self, backend, xp):
        params = init_mha_params(xp, 8, 2, dtype=backend.dtype("float64"), device=backend.device)
        x = backend.asarray(randn(1, 4, 8))

        def loss(wq, wo):
            p = dict(params, wq=wq, wo=wo)
            return xp.sum(multi_head_attention(x, params=p, num_heads=2, is_causal=True) ** 2)

        gq, go = backend.grad(loss, params["wq"], params["wo"])
        assert np.any(backend.to_numpy(gq) != 0)
        assert np.any(backend.to_numpy(go) != 0)


@pytest.mark.backends("jax", reason="jax.jit(jax.grad) of the tiled loop with a score_mod")
def test_jit_grad_through_the_tiled_loop_stays_finite(backend):
    """Regression: GQA, 2 x 2 tiles and a position-dependent score_mod gave NaN under jit.

    The tiled loop with a score_mod is differentiated by plain autodiff; XLA's
    optimised program produced NaN for the gradient of the running max (which is
    exactly zero: the shift cancels), so the loop stops its gradient.
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (
        backend.asarray(rng.standard_normal(s)) for s in [(1, 4, 6, 3), (1, 2, 6, 3), (1, 2, 6, 3)]
    )

    def mod(s, b, h, i, j):
        return s - 0.1 * (i - j)

    def loss(block_size):
        def f(q, k, v):
            return jnp.sum(scaled_dot_product_attention(q, k, v, block_size=block_size,
                                                        score_mod=mod) ** 2)  # fmt: skip

        return f

    tiled = jax.jit(jax.grad(loss(2), argnums=(0, 1, 2)))(q, k, v)
    dense = jax.grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
    for t, d in zip(tiled, dense, strict=True):
        assert np.all(np.isfinite(backend.to_numpy(t)))
        assert_close(backend, t, d, atol=1e-12, rtol=0)

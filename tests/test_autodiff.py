"""Gradients, jax.jit / jax.vmap and torch.compile."""

from __future__ import annotations

import numpy as np
import pytest

from portable_attn import attention_weights, scaled_dot_product_attention

SHAPES = [(2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 3)]  # GQA: Hq=4, Hkv=2; Lq=3 < Lk=6


def inputs(backend, seed=0):
    rng = np.random.default_rng(seed)
    return [backend.asarray(rng.standard_normal(s)) for s in SHAPES]


def need_autodiff(backend):
    if not backend.has_autodiff:
        pytest.skip(f"{backend.kind} has no automatic differentiation")


def need(backend, family):
    if backend.family != family:
        pytest.skip(f"{family}-only transformation; backend is {backend.kind}")


KWARGS = {
    "plain": {},
    "causal_softcap": {"is_causal": True, "softcap": 2.0},
    "window_scale": {"window": (1, 1), "scale": 0.7},
}


def central_differences(fn, args, eps=1e-6):
    """d fn / d args[i] by central differences, on NumPy copies of the arguments."""
    grads = []
    for i, a in enumerate(args):
        g = np.zeros_like(a)
        it = np.nditer(a, flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            hi, lo = a.copy(), a.copy()
            hi[idx] += eps
            lo[idx] -= eps
            up = fn(*args[:i], hi, *args[i + 1 :])
            down = fn(*args[:i], lo, *args[i + 1 :])
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


class TestGradients:
    @pytest.mark.parametrize("name", list(KWARGS))
    def test_against_central_differences(self, backend, xp, name):
        need_autodiff(backend)
        kw = KWARGS[name]
        rng = np.random.default_rng(1)
        cot = backend.asarray(rng.standard_normal((2, 4, 3, 3)))
        bias = rng.standard_normal((3, 6))

        def loss(q, k, v, b):
            out = scaled_dot_product_attention(q, k, v, bias=b, **kw)
            return xp.sum(out * cot)

        args = [*inputs(backend), backend.asarray(bias)]
        analytic = backend.grad(loss, *args)

        def loss_np(*arrays):
            return float(backend.to_numpy(loss(*(backend.asarray(a) for a in arrays))))

        numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
        for g, n in zip(analytic, numeric, strict=True):
            np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)

    def test_torch_gradcheck(self, backend):
        need(backend, "torch")
        import torch

        q, k, v = (a.detach().requires_grad_(True) for a in inputs(backend))
        mask = backend.asarray(np.random.default_rng(2).random((3, 6)) < 0.7)

        def f(q, k, v):
            return scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True, softcap=3.0)

        assert torch.autograd.gradcheck(f, (q, k, v))
        assert torch.autograd.gradcheck(
            lambda q, k: attention_weights(q, k, window=(1, 0)), (q, k)
        )

    def test_fully_masked_rows_have_zero_gradients(self, backend, xp):
        need_autodiff(backend)
        mask = np.ones((3, 6), dtype=bool)
        mask[1] = False
        bias = np.zeros((3, 6))
        bias[2] = -np.inf
        m, b = backend.asarray(mask), backend.asarray(bias)

        def loss(q, k, v):
            return xp.sum(scaled_dot_product_attention(q, k, v, mask=m, bias=b))

        q, k, v = inputs(backend)
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

    def test_fully_masked_causal_rows_have_zero_gradients(self, backend, xp):
        need_autodiff(backend)
        q, k, v = (
            backend.asarray(np.random.default_rng(3).standard_normal(s))
            for s in [(2, 6, 4), (2, 3, 4), (2, 3, 4)]
        )

        def loss(q, k, v):
            return xp.sum(attention_weights(q, k, is_causal=True) ** 2) + xp.sum(
                scaled_dot_product_attention(q, k, v, is_causal=True)
            )

        grads = [backend.to_numpy(g) for g in backend.grad(loss, q, k, v)]
        assert all(np.all(np.isfinite(g)) for g in grads)
        assert np.all(grads[0][:, :3] == 0)  # Lq > Lk: the first 3 rows are empty


class TestJax:
    def test_jit_equals_eager(self, backend):
        need(backend, "jax")
        import jax

        q, k, v = inputs(backend)
        mask = backend.asarray(np.random.default_rng(4).random((3, 6)) < 0.7)

        def f(q, k, v, mask):
            return scaled_dot_product_attention(
                q, k, v, mask=mask, is_causal=True, softcap=4.0, window=(2, None)
            )

        np.testing.assert_allclose(jax.jit(f)(q, k, v, mask), f(q, k, v, mask), atol=1e-13)
        w = jax.jit(lambda q, k: attention_weights(q, k, is_causal=True))(q, k)
        np.testing.assert_allclose(w, attention_weights(q, k, is_causal=True), atol=1e-13)

    def test_vmap_equals_eager(self, backend):
        need(backend, "jax")
        import jax

        q, k, v = inputs(backend)
        vmapped = jax.vmap(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))
        np.testing.assert_allclose(
            vmapped(q, k, v), scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-13
        )

    def test_grad_under_jit(self, backend):
        need(backend, "jax")
        import jax
        import jax.numpy as jnp

        q, k, v = inputs(backend)

        def loss(q, k, v):
            return jnp.sum(scaled_dot_product_attention(q, k, v, is_causal=True) ** 2)

        eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(eager, jitted, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-12)


class TestTorch:
    def test_torch_compile(self, backend):
        need(backend, "torch")
        import torch

        q, k, v = inputs(backend)

        def f(q, k, v):
            return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0)

        # the default (inductor) backend: what a user gets from a plain torch.compile
        torch.testing.assert_close(torch.compile(f)(q, k, v), f(q, k, v))

"""Program transformations: jax.jit, jax.vmap and torch.compile give the eager result.

Gradients, also under jax.jit, are in ``test_gradients.py``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, check, qkv, randn
from portable_attn import attention_weights, get_alibi_slopes, scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention

small = partial(qkv, lq=3, lk=6, dk=5, dv=3)  # GQA: Hq=4, Hkv=2; Lq=3 < Lk=6


@pytest.mark.backends("jax", reason="jax.jit and jax.vmap")
class TestJax:
    def test_jit_equals_eager(self, backend):
        import jax

        q, k, v = small(backend=backend)
        mask = backend.asarray(np.random.default_rng(4).random((3, 6)) < 0.7)

        def f(q, k, v, mask):
            return scaled_dot_product_attention(
                q, k, v, mask=mask, is_causal=True, softcap=4.0, window=(2, None)
            )

        assert_close(backend, jax.jit(f)(q, k, v, mask), f(q, k, v, mask), atol=1e-13, rtol=0)
        w = jax.jit(lambda q, k: attention_weights(q, k, is_causal=True))(q, k)
        assert_close(backend, w, attention_weights(q, k, is_causal=True), atol=1e-13, rtol=0)

    def test_vmap_equals_eager(self, backend):
        import jax

        q, k, v = small(backend=backend)
        vmapped = jax.vmap(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))
        eager = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_close(backend, vmapped(q, k, v), eager, atol=1e-13, rtol=0)

    def test_all_model_arguments_under_jit(self, backend, route):
        import jax

        q, k, v = qkv(batch=(3,), lq=7, lk=9, dk=6, dv=6, backend=backend)
        keep = backend.asarray(np.random.default_rng(1).random((3, 4, 7, 9)) > 0.3)
        ql, kl = backend.asarray(np.array([7, 3, 1])), backend.asarray(np.array([9, 5, 2]))
        slopes = backend.asarray(get_alibi_slopes(4))

        def f(q, k, v, ql, kl, slopes, keep):
            return scaled_dot_product_attention(
                q,
                k,
                v,
                q_lengths=ql,
                kv_lengths=kl,
                alibi_slopes=slopes,
                is_causal=True,
                dropout_p=0.3,
                dropout_mask=keep,
                **route.kw,
                score_mod=lambda s, b, h, i, j: s + 0.1 * h,
            )

        eager = f(q, k, v, ql, kl, slopes, keep)
        assert_close(backend, jax.jit(f)(q, k, v, ql, kl, slopes, keep), eager, atol=1e-13, rtol=0)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_jax_rank_promotion_raise_with_sinks_and_a_mask(backend, xp, route):
    """``jax_numpy_rank_promotion="raise"`` (issue 46, item 11), the traced loop's own terms:
    the keys padding its last block joined a (B, 1, Lq, Lk) mask as (1, Lk), and the
    sinks' gradient took (Hq, 1, 1) sinks less a (B, Hq, Lq, 1) lse. Values and
    gradients as without the option.
    """
    import jax

    q, k, v = qkv(lq=5, lk=7, dk=3, dv=3)
    sinks = randn(4, seed=7)
    mask = np.random.default_rng(8).random((2, 1, 5, 7)) < 0.8
    mask[..., 0] = True  # every row sees a key
    cot = backend.asarray(randn(2, 4, 5, 3, seed=9))
    mask_b = backend.asarray(mask)

    def loss(q, k, v, sinks):
        out = scaled_dot_product_attention(q, k, v, sinks=sinks, mask=mask_b, **route.kw)
        return xp.sum(out * cot)

    args = [backend.asarray(a) for a in (q, k, v, sinks)]
    want = backend.grad(loss, *args)
    with jax.numpy_rank_promotion("raise"):
        check(backend, q, k, v, route=route, sinks=sinks, mask=mask)
        got = backend.grad(loss, *args)
    for g, w in zip(got, want, strict=True):
        assert_close(backend, g, backend.to_numpy(w), atol=1e-13, rtol=0)


@pytest.mark.backends("torch", reason="torch.compile")
class TestTorch:
    def test_torch_compile(self, backend):
        import torch

        q, k, v = small(backend=backend)

        def f(q, k, v):
            return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0)

        # the default (inductor) backend: what a user gets from a plain torch.compile
        torch.testing.assert_close(torch.compile(f)(q, k, v), f(q, k, v))

    def test_torch_compile_keeps_rows_without_keys_zero(self, backend):
        """The native route adds no guard on torch CPU: the compiled kernel zeroes them."""
        import torch

        q, k, v = (backend.asarray(a, "float32") for a in qkv(lq=24, lk=32, dv=8))
        keys = np.ones((2, 1, 1, 32), dtype=bool)
        keys[1] = False  # batch 1 sees no key
        mask = backend.asarray(keys)

        def loss(q):
            return scaled_dot_product_attention(q, k, v, mask=mask).sum()

        leaf = q.detach().clone().requires_grad_(True)
        out = torch.compile(lambda q: scaled_dot_product_attention(q, k, v, mask=mask))(q)
        (g,) = torch.autograd.grad(torch.compile(loss)(leaf), leaf)
        assert torch.all(out[1] == 0)
        assert torch.all(g[1] == 0)
        assert torch.isfinite(g).all()
        assert torch.any(g[0] != 0)


@pytest.mark.backends("torch", reason="torch.func")
class TestTorchFunc:
    """The tiled path's autograd.Function works under torch.func transforms."""

    def test_grad_jacrev_and_vmap_of_grad_match_the_dense_path(self, backend):
        import torch

        q, k, v = small(backend=backend)
        mask = backend.asarray(np.random.default_rng(4).random((3, 6)) < 0.7)

        def f(block_size):
            def attend(q):
                return scaled_dot_product_attention(
                    q, k, v, mask=mask, is_causal=True, block_size=block_size
                )

            return attend

        tiled, dense = f(2), f("dense")
        grad = torch.func.grad(lambda q: tiled(q).sum())(q)
        assert_close(
            backend, grad, torch.func.grad(lambda q: dense(q).sum())(q), atol=1e-12, rtol=0
        )
        jac = torch.func.jacrev(tiled)(q)
        assert_close(backend, jac, torch.func.jacrev(dense)(q), atol=1e-12, rtol=0)
        batch = torch.stack([q, 2 * q, -q])
        vg = torch.func.vmap(torch.func.grad(lambda q: tiled(q).sum()))(batch)
        vd = torch.func.vmap(torch.func.grad(lambda q: dense(q).sum()))(batch)
        assert_close(backend, vg, vd, atol=1e-12, rtol=0)


@pytest.mark.autodiff
def test_vmap_then_backward_equals_the_oracle(backend, xp, route):
    """``vmap`` over Q, K and V that require a gradient, then backward (issue 46, item 3).

    Inside ``torch.func.vmap`` a tensor's own ``requires_grad`` is False (a batched
    wrapper), so the tiled path took "nothing to record", and torch's autograd
    recorded the walk, whose in-place ``exp(s - m)`` then failed its backward ("modified
    by an inplace operation"). The float64 oracle's gradient, by central differences.
    """
    lq, lk = 5, 7
    arrays = qkv(batch=(3,), hq=2, hkv=1, lq=lq, lk=lk, dk=3, dv=2, seed=21)
    cot = randn(3, 2, lq, 2, seed=24)
    if backend.family == "torch":
        import torch

        vmap = torch.func.vmap
    else:
        import jax

        vmap = jax.vmap

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, **route.kw)

    def loss(q, k, v):
        return xp.sum(vmap(attend)(q, k, v) * backend.asarray(cot))

    got = backend.grad(loss, *(backend.asarray(a) for a in arrays))

    def oracle(q, k, v):
        return float(np.sum(reference_attention(q, k, v, is_causal=True) * cot))

    for g, want in zip(got, central_differences(oracle, arrays), strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), want, atol=1e-6, rtol=1e-5)


@pytest.mark.backends("jax", reason="jax.jacfwd, jax.linearize")
def test_forward_mode_on_the_tiled_path(backend):
    """``jax.jacfwd`` and ``jax.linearize`` differentiate the tiled walk itself (its custom
    VJP is reverse-only); ``jax.jacrev`` keeps that VJP. Where JAX does not linearize
    directly (jax 0.4), ``linearize`` is ``grad``'s trace and meets the VJP."""
    import jax

    q, k, v = small(backend=backend)

    def tiled(q):
        return scaled_dot_product_attention(q, k, v, block_size=2)

    jac = jax.jacfwd(tiled)(q)
    dense = jax.jacfwd(lambda q: scaled_dot_product_attention(q, k, v, block_size="dense"))(q)
    assert_close(backend, jac, dense, atol=1e-12, rtol=0)
    assert_close(backend, jac, jax.jacrev(tiled)(q), atol=1e-12, rtol=0)
    if not getattr(jax.config, "jax_use_direct_linearize", False):
        # linearize traces as grad does (jvp, then partial evaluation): JAX's own error
        with pytest.raises(TypeError, match="forward-mode"):
            jax.linearize(tiled, q)[1](q)
        return
    _, linear = jax.linearize(tiled, q)
    t = backend.asarray(np.ones(np.shape(q)))
    assert_close(backend, linear(t), jax.jvp(tiled, (q,), (t,))[1], atol=1e-12, rtol=0)

"""Forward-mode derivatives: the JVP of a call, on every route that differentiates.

torch: ``torch.func.jvp`` and ``torch.autograd.forward_ad`` (dual tensors, also of
tensors that require a gradient); JAX: ``jax.jvp`` under ``jit``. Tangents of Q, K, V,
a bias, sinks and the table a ``score_mod`` closes over, against the dense path's JVP
(float64) and central differences. torch's fused kernels have no forward-mode rule:
such a call goes to the portable path, whose walk keeps no block of scores.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import qkv, randn
from portable_attn import scaled_dot_product_attention

pytestmark = pytest.mark.autodiff

LQ, LK = 7, 9  # GQA: Hq=4, Hkv=2; no tile divides the lengths
#: the keywords of each case beside the tangents' arrays
CASES = {
    "plain": {},
    "causal, softcap, window": {"is_causal": True, "softcap": 3.0, "window": (4, 1)},
}


def arrays(backend):
    """Q, K, V, a (Hq, Lq, Lk) bias, (Hq,) sinks and a relative-position table per head."""
    q, k, v = qkv(lq=LQ, lk=LK, dk=5, dv=3)
    bias, sinks = randn(4, LQ, LK, seed=3) * 0.5, randn(4, seed=4)
    table = randn(4, LQ + LK - 1, seed=5) * 0.5
    return [backend.asarray(a) for a in (q, k, v, bias, sinks, table)]


def attend(kw):
    def f(q, k, v, bias, sinks, table):
        def mod(s, b, h, i, j):
            return s + table[h, i - j + LK - 1]

        return scaled_dot_product_attention(
            q, k, v, bias=bias, sinks=sinks, score_mod=mod, **kw
        )  # fmt: skip

    return f


def jvp(backend, fn, primals, tangents):
    """The tangent of ``fn``'s output at `primals` along `tangents`."""
    if backend.family == "torch":
        import torch

        return torch.func.jvp(fn, tuple(primals), tuple(tangents))[1]
    import jax

    return jax.jit(lambda p, t: jax.jvp(fn, p, t)[1])(tuple(primals), tuple(tangents))


def tangents_of(backend, primals):
    return [backend.asarray(randn(*np.shape(a), seed=20 + i)) for i, a in enumerate(primals)]


@pytest.mark.parametrize("case", list(CASES))
def test_jvp_equals_the_dense_path(backend, route, case):
    primals = arrays(backend)
    tangents = tangents_of(backend, primals)
    got = jvp(backend, attend({**CASES[case], **route.kw}), primals, tangents)
    want = jvp(backend, attend({**CASES[case], "block_size": "dense"}), primals, tangents)
    np.testing.assert_allclose(backend.to_numpy(got), backend.to_numpy(want), atol=1e-12)
    assert np.abs(backend.to_numpy(want)).max() > 0.1


def test_jvp_of_the_lse(backend, route):
    """The lse's tangent too; the largest logit has none (it has no gradient either)."""
    primals = arrays(backend)[:3]
    tangents = tangents_of(backend, primals)

    def f(kw):
        def attend(q, k, v):
            out = scaled_dot_product_attention(
                q, k, v, is_causal=True, return_lse=True, return_max_logit=True, **kw
            )
            return out

        return attend

    got = jvp(backend, f(route.kw), primals, tangents)
    want = jvp(backend, f({"block_size": "dense"}), primals, tangents)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), atol=1e-12)
    assert np.abs(backend.to_numpy(want[1])).max() > 0.1  # the lse's
    assert not np.abs(backend.to_numpy(want[2])).any()  # the largest logit's


def test_jvp_of_a_learned_scale_softcap_and_slopes(backend, route):
    """The 0-d scale and softcap and the ALiBi slopes as arrays with tangents of their own."""
    q, k, v = (backend.asarray(x) for x in qkv(lq=LQ, lk=LK, dk=5, dv=3))
    primals = [backend.asarray(np.asarray(x)) for x in (0.4, 4.0, [0.5, 0.25, 0.125, 0.0625])]
    tangents = [backend.asarray(np.asarray(x)) for x in (1.0, -2.0, [1.0, -1.0, 0.5, 2.0])]

    def f(kw):
        def attend(scale, softcap, slopes):
            return scaled_dot_product_attention(
                q, k, v, scale=scale, softcap=softcap, alibi_slopes=slopes, is_causal=True, **kw
            )

        return attend

    got = jvp(backend, f(route.kw), primals, tangents)
    want = jvp(backend, f({"block_size": "dense"}), primals, tangents)
    np.testing.assert_allclose(backend.to_numpy(got), backend.to_numpy(want), atol=1e-12)
    assert np.abs(backend.to_numpy(want)).max() > 0.1


@pytest.mark.backends("jax", reason="jax.vmap of jax.jvp")
def test_jax_vmap_of_jvp(backend, route):
    """A batch of tangents at once (as ``jax.jacfwd`` builds them), under ``jit``."""
    import jax

    primals = arrays(backend)
    tangents = tangents_of(backend, primals)
    batch = [backend.asarray(np.stack([np.asarray(t), -2.0 * np.asarray(t)])) for t in tangents]

    def jvps(kw):
        f = attend({**CASES["plain"], **kw})
        one = lambda *t: jax.jvp(f, tuple(primals), t)[1]  # noqa: E731
        return jax.jit(jax.vmap(one))(*batch)

    got, want = jvps(route.kw), jvps({"block_size": "dense"})
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-12)
    np.testing.assert_allclose(np.asarray(got[1]), -2.0 * np.asarray(got[0]), atol=1e-12)


@pytest.mark.backends("jax", reason="jax.linearize")
def test_jax_linearize(backend, route):
    """``jax.linearize`` once, its linear map evaluated on two tangents, equal to the
    dense path's JVPs; under ``jit`` (as a training step holds it) and eagerly."""
    import jax

    if not getattr(jax.config, "jax_use_direct_linearize", False):
        pytest.skip("JAX linearizes as grad does (jax 0.4): test_transforms checks its error")
    primals = arrays(backend)
    tangents = tangents_of(backend, primals)
    f = attend({**CASES["causal, softcap, window"], **route.kw})
    dense = attend({**CASES["causal, softcap, window"], "block_size": "dense"})
    dense_jvp = jax.jit(lambda t: jax.jvp(dense, tuple(primals), tuple(t)))
    for linearize in (jax.linearize, jax.jit(jax.linearize, static_argnums=0)):
        out, linear = linearize(f, *primals)
        for t in (tangents, [-2.0 * x for x in tangents]):
            want, want_tangent = dense_jvp(t)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-12)
            got = jax.jit(linear)(*t)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want_tangent), atol=1e-12)
        assert np.abs(np.asarray(want_tangent)).max() > 0.1


def test_jacfwd_equals_jacrev(backend, route):
    """``torch.func.jacfwd`` / ``jax.jacfwd`` (a JVP per input entry, batched) against the
    reverse-mode Jacobian through the route's own backward."""
    q, k, v = (backend.asarray(x) for x in qkv(batch=(1,), hq=2, hkv=1, lq=3, lk=5, dk=2, dv=2))

    def f(q):
        return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0, **route.kw)

    if backend.family == "torch":
        import torch

        forward, reverse = torch.func.jacfwd(f)(q), torch.func.jacrev(f)(q)
    else:
        import jax

        forward, reverse = jax.jit(jax.jacfwd(f))(q), jax.jit(jax.jacrev(f))(q)
    np.testing.assert_allclose(backend.to_numpy(forward), backend.to_numpy(reverse), atol=1e-12)
    assert np.abs(backend.to_numpy(forward)).max() > 0.01


def test_jvp_against_central_differences(backend):
    """The default call's JVP against ``(f(x + εt) - f(x - εt)) / 2ε``, every array at once."""
    primals = arrays(backend)
    tangents = tangents_of(backend, primals)
    f = attend(CASES["causal, softcap, window"])
    got = backend.to_numpy(jvp(backend, f, primals, tangents))
    eps = 1e-6
    host = [backend.to_numpy(x) for x in (*primals, *tangents)]
    point, direction = host[:6], host[6:]
    ahead, behind = (
        backend.to_numpy(f(*(backend.asarray(x + sign * eps * t) for x, t in pairs)))
        for sign in (1.0, -1.0)
        for pairs in [zip(point, direction, strict=True)]
    )
    np.testing.assert_allclose(got, (ahead - behind) / (2 * eps), atol=1e-7)


@pytest.mark.backends("torch", reason="torch.func.jvp and forward_ad's dual tensors")
@pytest.mark.parametrize("api", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("length", [16, 64])
def test_the_default_call_in_forward_mode(backend, api, requires_grad, length):
    """A call SDPA would take goes to the portable path: SDPA's CPU kernel has no forward rule.

    With inputs that require a gradient, the call's backward is recorded beside its
    forward mode (and is differentiated: a gradient of the tangent).
    """
    import torch
    import torch.autograd.forward_ad as forward_ad

    q, k, v = qkv(lq=length, lk=length, dk=8, dv=8, backend=backend)
    tangents = [backend.asarray(randn(*x.shape, seed=30 + i)) for i, x in enumerate((q, k, v))]
    dense = torch.func.jvp(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, block_size="dense"),
        (q, k, v),
        tuple(tangents),
    )[1]
    leaves = [x.detach().clone().requires_grad_(requires_grad) for x in (q, k, v)]

    def f(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    if api == "forward_ad":
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(x, t) for x, t in zip(leaves, tangents, strict=True)]
            tangent = forward_ad.unpack_dual(f(*duals)).tangent
    else:
        tangent = torch.func.jvp(f, tuple(leaves), tuple(tangents))[1]
    torch.testing.assert_close(tangent.detach(), dense, atol=1e-12, rtol=0)
    if requires_grad:  # reverse mode through the tangent
        (dq,) = torch.autograd.grad(tangent.sum(), leaves[:1])
        assert torch.isfinite(dq).all()
        assert dq.abs().max() > 0


def largest_jax(jaxpr) -> int:
    """The most entries of any value `jaxpr` computes, in the jaxprs it calls too."""
    import math

    most = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            most = max(most, math.prod(getattr(var.aval, "shape", ())))
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    most = max(most, largest_jax(inner))
    return most


def test_forward_mode_keeps_no_block_of_scores(backend, route):
    """On a tiled route, no array of a forward-mode call holds all Lq x Lk scores of a head.

    torch: every tensor a dispatch mode sees; JAX: every value of the program's jaxpr,
    of the JVP and of forward over reverse. (torch's forward over reverse records the
    walk, whose blocks together hold them.)
    """
    if route.name == "dense":
        pytest.skip("the dense path holds the scores")
    lq = lk = 48
    q, k, v = qkv(batch=(1,), hq=1, hkv=1, lq=lq, lk=lk, dk=4, dv=4, backend=backend)
    tangents = (q, k, v)

    def f(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, **route.kw)

    if backend.family == "jax":
        import jax
        import jax.numpy as jnp

        program = jax.make_jaxpr(lambda p, t: jax.jvp(f, p, t))((q, k, v), tangents)
        assert largest_jax(program.jaxpr) < lq * lk
        # forward over reverse (a Hessian-vector product): forward mode through the
        # recomputing backward keeps no block of scores either
        grad = jax.grad(lambda *x: jnp.sum(f(*x)), argnums=(0, 1, 2))
        program = jax.make_jaxpr(lambda p, t: jax.jvp(grad, p, t))((q, k, v), tangents)
        assert largest_jax(program.jaxpr) < lq * lk
        return
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for x in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(x, torch.Tensor):
                    largest.append(x.numel())
            return result

    with Sizes():
        torch.func.jvp(f, (q, k, v), tangents)
    assert largest
    assert max(largest) < lq * lk


def test_jvp_of_the_batched_calls(backend):
    """``ragged_paged_attention`` (a decode row walked, 20 rows to the engine) and
    ``varlen_attention``, against central differences along the tangents."""
    from portable_attn.serving import ragged_paged_attention, varlen_attention

    rng = np.random.default_rng(7)
    pools = [rng.standard_normal((8, 16, 2, 8)) for _ in range(2)]
    meta = [
        backend.asarray(np.array(x)) for x in ([[3, 5, 0, 0], [1, 2, 7, 4]], [20, 50], [0, 1, 21])
    ]
    packed = [rng.standard_normal(shape) for shape in ((12, 4, 8), (20, 2, 8), (20, 2, 8))]
    starts = [backend.asarray(np.array(x)) for x in ([0, 5, 12], [0, 9, 20])]

    def paged(q, keys):
        return ragged_paged_attention(q, keys, backend.asarray(pools[1]), *meta)

    def varlen(q, k, v):
        return varlen_attention(q, k, v, *starts, is_causal=True)

    cases = [
        (paged, [rng.standard_normal((21, 4, 8)), pools[0]]),
        (varlen, packed),
    ]
    for f, point in cases:
        direction = [rng.standard_normal(np.shape(x)) for x in point]
        got = jvp(
            backend,
            f,
            [backend.asarray(x) for x in point],
            [backend.asarray(t) for t in direction],
        )
        eps = 1e-6
        ahead, behind = (
            backend.to_numpy(f(*(backend.asarray(x + sign * eps * t) for x, t in pairs)))
            for sign in (1.0, -1.0)
            for pairs in [zip(point, direction, strict=True)]
        )
        np.testing.assert_allclose(backend.to_numpy(got), (ahead - behind) / (2 * eps), atol=1e-7)

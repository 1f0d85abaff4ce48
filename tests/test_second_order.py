"""Second derivatives: a gradient differentiated again, on every route that differentiates.

Hessian-vector products of a loss of every differentiable array of a call (Q, K, V, a
bias, sinks, ALiBi slopes, a learned scale and softcap, the table a ``score_mod``
closes over, and the lse as an output), reverse over reverse and forward over
reverse, against the dense path's in float64; and what torch records of a backward
that is differentiated again: the arrays each query block reads, not its scores.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import hessian_vector_product, qkv, randn
from portable_attn import scaled_dot_product_attention

pytestmark = pytest.mark.autodiff

LQ, LK = 7, 9  # GQA: Hq=4, Hkv=2; no tile divides the lengths
NAMES = ("q", "k", "v", "bias", "sinks", "slopes", "scale", "softcap", "table")


def arrays(backend):
    """Every differentiable array of a call, as :data:`NAMES` lists them."""
    q, k, v = qkv(lq=LQ, lk=LK, dk=5, dv=3)
    bias, sinks = randn(4, LQ, LK, seed=3) * 0.5, randn(4, seed=4)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    table = randn(4, LQ + LK - 1, seed=5) * 0.5
    learned = (np.asarray(0.4), np.asarray(4.0))
    return [backend.asarray(a) for a in (q, k, v, bias, sinks, slopes, *learned, table)]


def loss_of(backend, xp, kw):
    cot = backend.asarray(randn(2, 4, LQ, 3, seed=6))
    lse_cot = backend.asarray(randn(2, 4, LQ, seed=7))

    def loss(q, k, v, bias, sinks, slopes, scale, softcap, table):
        def mod(s, b, h, i, j):
            return s + table[h, i - j + LK - 1]

        out, lse = scaled_dot_product_attention(
            q, k, v, bias=bias, sinks=sinks, alibi_slopes=slopes, scale=scale,
            softcap=softcap, score_mod=mod, is_causal=True, return_lse=True, **kw,
        )  # fmt: skip
        return xp.sum(out * cot) + xp.sum(lse * lse_cot)

    return loss


@pytest.mark.default_compile  # XLA's CPU backend at optimisation level 0 gives NaN here
@pytest.mark.parametrize("order", ["reverse over reverse", "forward over reverse"])
def test_hessian_vector_products_of_every_array(backend, xp, route, order, request):
    if route.name == "loop" and order == "reverse over reverse":
        reason = "JAX refuses reverse mode through the loop's backward (traced loop bounds)"
        request.applymarker(pytest.mark.xfail(raises=ValueError, strict=True, reason=reason))
    args = arrays(backend)
    tangents = [backend.asarray(randn(*np.shape(a), seed=20 + i)) for i, a in enumerate(args)]
    got = hessian_vector_product(backend, loss_of(backend, xp, route.kw), args, tangents, order)
    dense = loss_of(backend, xp, {"block_size": "dense"})
    want = hessian_vector_product(backend, dense, args, tangents, order)
    for name, g, w in zip(NAMES, got, want, strict=True):
        w = backend.to_numpy(w)
        np.testing.assert_allclose(backend.to_numpy(g), w, atol=1e-10, err_msg=name)
        assert np.abs(w).max() > 1e-3, name  # every array's second derivative counts


@pytest.mark.backends("torch", reason="what torch's autograd records of a backward")
def test_a_recorded_backward_keeps_no_block_of_scores(backend):
    """``create_graph=True`` records each query block of the backward as one node that
    keeps the arrays the block reads; recording the walk's operations kept every block's
    probabilities (O(Lq·Lk) for the second backward)."""
    import torch

    length, block = 64, 16
    q, k, v, t = (
        torch.tensor(randn(1, 1, length, 2, seed=i), requires_grad=i < 3) for i in range(4)
    )
    table = torch.tensor(randn(1, 2 * length - 1, seed=5), requires_grad=True)

    def mod(s, b, h, i, j):
        return s + table[h, i - j + length - 1]

    out = scaled_dot_product_attention(
        q, k, v, is_causal=True, score_mod=mod, block_size=(block, block)
    )
    grads = torch.autograd.grad(torch.sum(out * t), (q, k, v, table), create_graph=True)
    kept = recorded_sizes(g.grad_fn for g in grads)
    assert kept
    assert max(kept) < block * block  # q, k, v: 128 entries; a block of scores: 256
    hvp = torch.autograd.grad(sum(torch.sum(g * g) for g in grads), (q, k, v, table))
    assert all(torch.isfinite(h).all() and h.abs().max() > 0 for h in hvp)


def recorded_sizes(nodes):
    """The sizes of the tensors kept by the autograd graph under `nodes`, node by node."""
    import torch

    sizes, seen, stack = [], set(), list(nodes)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kept = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        kept += list(getattr(node, "saved_tensors", ()))
        sizes += [x.numel() for x in kept if isinstance(x, torch.Tensor)]
        stack += [n for n, _ in node.next_functions]
    return sizes


@pytest.mark.backends("torch", reason="SDPA's fused kernels, whose backward has no derivative")
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_the_default_call_differentiated_twice(backend, mask):
    """The default call (SDPA's fused kernel) under ``create_graph=True``, then a second
    ``grad``: the backward that is recorded is the portable path's, equal to the dense
    path's; a first-order backward is the kernel's own."""
    import torch

    lq, lk = 40, 48
    args = [torch.tensor(x) for x in qkv(lq=lq, lk=lk, dk=8, dv=8)]
    keep = np.tril(np.ones((lq, lk), dtype=bool), lk - lq) | (randn(lq, lk, seed=8) > 1.0)
    kw = {}
    if mask == "bool":
        kw["mask"] = torch.tensor(keep)
    elif mask == "float":
        kw["bias"] = torch.tensor(np.where(keep, randn(lq, lk, seed=9), -np.inf))
    else:
        kw["is_causal"] = True
    cot = torch.tensor(randn(2, 4, lq, 8, seed=6))
    tangents = [torch.tensor(randn(*x.shape, seed=20 + i)) for i, x in enumerate(args)]

    def loss(block_size):
        def f(q, k, v):
            out = scaled_dot_product_attention(q, k, v, block_size=block_size, **kw)
            return torch.sum(out * cot)

        return f

    got = hessian_vector_product(backend, loss(None), args, tangents, "reverse over reverse")
    want = hessian_vector_product(backend, loss("dense"), args, tangents, "reverse over reverse")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-10)


@pytest.mark.backends("torch", reason="torch.autograd.gradgradcheck")
def test_gradgradcheck_of_the_tiled_walk(backend):
    """torch's check of second derivatives against finite differences of the first."""
    import torch

    q, k, v = (torch.tensor(x, requires_grad=True) for x in qkv(lq=5, lk=6, dk=3, dv=2))
    table = torch.tensor(randn(4, 10, seed=5) * 0.5, requires_grad=True)

    def f(q, k, v, table):
        def mod(s, b, h, i, j):
            return s + table[h, i - j + 5]

        return scaled_dot_product_attention(
            q, k, v, is_causal=True, softcap=3.0, score_mod=mod, block_size=(2, 2)
        )

    assert torch.autograd.gradgradcheck(f, (q, k, v, table))


@pytest.mark.backends("torch", reason="torch.autograd.gradgradcheck")
def test_gradgradcheck_of_the_default_call(backend):
    """The same through SDPA's fused kernel (the default call here), whose backward the
    portable one replaces where it is differentiated."""
    import torch

    q, k, v = (torch.tensor(x, requires_grad=True) for x in qkv(lq=16, lk=17, dk=2, dv=2))
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"

    def f(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    assert torch.autograd.gradgradcheck(f, (q, k, v))


@pytest.mark.backends("torch", reason="torch.func's forward over reverse")
def test_torch_forward_over_reverse_without_a_score_mod(backend, xp, route):
    """``torch.func.jvp`` of ``torch.func.grad`` keeps the tiled path's recomputing
    backward (a JVP rule of its own, a node per pair of blocks): equal to the dense
    path's HVP, and it keeps far less than recording the walk did (26x the scores of a
    head at this size; the walk's record grows with L²)."""
    args = arrays(backend)[:7]  # q, k, v, bias, sinks, slopes, scale: no score_mod
    tangents = [backend.asarray(randn(*np.shape(a), seed=20 + i)) for i, a in enumerate(args)]
    cot = backend.asarray(randn(2, 4, LQ, 3, seed=6))

    def loss_of(kw):
        def loss(q, k, v, bias, sinks, slopes, scale):
            out = scaled_dot_product_attention(
                q, k, v, bias=bias, sinks=sinks, alibi_slopes=slopes, scale=scale,
                is_causal=True, **kw,
            )  # fmt: skip
            return xp.sum(out * cot)

        return loss

    order = "forward over reverse"
    got = hessian_vector_product(backend, loss_of(route.kw), args, tangents, order)
    want = hessian_vector_product(backend, loss_of({"block_size": "dense"}), args, tangents, order)
    for name, g, w in zip(NAMES, got, want, strict=False):
        np.testing.assert_allclose(
            backend.to_numpy(g), backend.to_numpy(w), atol=1e-10, err_msg=name
        )
    if route.name != "tiled":
        return
    import torch

    length = 512
    q, k, v, t = (torch.tensor(randn(1, 1, length, 4, seed=i)) for i in range(4))
    grad = torch.func.grad(
        lambda *x: torch.sum(scaled_dot_product_attention(*x, is_causal=True, block_size=16)),
        argnums=(0, 1, 2),
    )
    with LiveBytes() as live:
        torch.func.jvp(grad, (q, k, v), (t, t, t))
    assert live.peak < 3 * length * length * 8  # one head's float64 scores, three times

    # a gradient of that HVP (a third derivative) is the walk's own autodiff's
    def third(block_size):
        def hvp(q):
            f = grad_of(block_size)
            return torch.sum(
                torch.func.jvp(f, (q, k[..., :40, :], v[..., :40, :]), (t[..., :40, :],) * 3)[1][0]
                ** 2
            )

        return torch.func.grad(hvp)(q[..., :40, :])

    want = third("dense").numpy()
    np.testing.assert_allclose(third(8).numpy(), want, atol=1e-10)
    assert np.abs(want).max() > 1e-3


def grad_of(block_size):
    """``torch.func.grad`` of a causal call's squared sum, with respect to Q, K and V."""
    import torch

    def loss(*x):
        return torch.sum(
            scaled_dot_product_attention(*x, is_causal=True, block_size=block_size) ** 2
        )

    return torch.func.grad(loss, argnums=(0, 1, 2))


class LiveBytes:
    """The peak bytes of the tensors torch operations made and that are still alive."""

    def __enter__(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for x in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(x, torch.Tensor) and x._base is None:
                        n = x.untyped_storage().nbytes()
                        counter.now += n
                        counter.peak = max(counter.peak, counter.now)
                        weakref.finalize(x, counter.free, n)
                return out

        self.now = self.peak = 0
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def free(self, n):
        self.now -= n

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

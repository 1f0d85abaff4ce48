"""A `score_mod` that closes over learned arrays, differentiated at O(L) memory.

The gradients of the arrays it closes over (a torch tensor that requires a
gradient, a JAX array traced by the function being differentiated), and of Q, K
and V, against the dense path's autodiff and central differences, on every route
that differentiates; under ``jax.jit``, ``jax.vmap`` and ``torch.func``; and what
the backward keeps for later: the inputs and the output, not a block of scores.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import hessian_vector_product, qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn.testing import central_differences

pytestmark = pytest.mark.autodiff

LQ, LK, H = 7, 9, 4  # GQA: Hq=4, Hkv=2; no tile divides the lengths
TABLE = randn(H, LQ + LK - 1, seed=5) * 0.5  # a relative-position bias per head
TEMPERATURE = np.array([1.0, 0.5, 2.0, 1.5])  # a per-head factor


def rel_bias(xp, table, temperature):
    """T5-style: ``s · t_h + table[h, i - j + Lk - 1]``, closing over both arrays."""

    def score_mod(s, b, h, i, j):
        return s * temperature[h] + table[h, i - j + LK - 1]

    return score_mod


def loss_of(backend, xp, route, cot, **kw):
    def loss(q, k, v, table, temperature):
        mod = rel_bias(xp, table, temperature)
        out = scaled_dot_product_attention(q, k, v, score_mod=mod, **route, **kw)
        return xp.sum(out * cot)

    return loss


def arrays(backend):
    q, k, v = qkv(lq=LQ, lk=LK, dk=5, dv=3)
    return [backend.asarray(a) for a in (q, k, v, TABLE, TEMPERATURE)]


@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "softcap": 3.0, "window": (4, 1)}])
def test_gradients_equal_the_dense_path(backend, xp, route, kw):
    cot = backend.asarray(randn(2, 4, LQ, 3, seed=6))
    args = arrays(backend)
    got = backend.grad(loss_of(backend, xp, route.kw, cot, **kw), *args)
    want = backend.grad(loss_of(backend, xp, {"block_size": "dense"}, cot, **kw), *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), atol=1e-12)
    assert np.abs(backend.to_numpy(got[3])).sum() > 0  # the table learns


@pytest.mark.default_compile  # XLA's CPU backend at optimisation level 0 gives NaN here
@pytest.mark.parametrize("order", ["reverse over reverse", "forward over reverse"])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "softcap": 3.0, "window": (4, 1)}])
def test_hessian_vector_products_equal_the_dense_path(backend, xp, route, kw, order, request):
    """Second derivatives through the ``score_mod`` and the arrays it closes over.

    On torch's tiled route the ``score_mod``'s per-block pullback once dropped its
    graph: a double backward returned values far off the dense path's, with no error.
    """
    if route.name == "loop" and order == "reverse over reverse":
        reason = "JAX refuses reverse mode through the loop's backward (traced loop bounds)"
        request.applymarker(pytest.mark.xfail(raises=ValueError, strict=True, reason=reason))
    cot = backend.asarray(randn(2, 4, LQ, 3, seed=6))
    args = arrays(backend)
    tangents = [backend.asarray(randn(*np.shape(a), seed=20 + i)) for i, a in enumerate(args)]
    tiled = loss_of(backend, xp, route.kw, cot, **kw)
    dense = loss_of(backend, xp, {"block_size": "dense"}, cot, **kw)
    got = hessian_vector_product(backend, tiled, args, tangents, order)
    want = hessian_vector_product(backend, dense, args, tangents, order)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), atol=1e-11)
    assert np.abs(backend.to_numpy(want[3])).sum() > 0  # the table's second derivative


def test_gradients_against_central_differences(backend, xp):
    """Q, K, V and both learned arrays, on a problem small enough to perturb each entry."""
    lq, lk = 4, 5
    q, k, v = qkv(batch=(1,), hq=2, hkv=1, lq=lq, lk=lk, dk=2, dv=2, seed=11)
    table, temperature = randn(2, lq + lk - 1, seed=12), np.array([0.7, 1.3])
    cot = backend.asarray(randn(1, 2, lq, 2, seed=13))

    def loss(q, k, v, table, temperature):
        def mod(s, b, h, i, j):
            return s * temperature[h] + table[h, i - j + lk - 1]

        out = scaled_dot_product_attention(
            q, k, v, score_mod=mod, is_causal=True, block_size=(3, 2)
        )
        return xp.sum(out * cot)

    args = [backend.asarray(a) for a in (q, k, v, table, temperature)]
    analytic = backend.grad(loss, *args)

    def loss_np(*a):
        return float(backend.to_numpy(loss(*(backend.asarray(x) for x in a))))

    numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
    for g, n in zip(analytic, numeric, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)


@pytest.mark.backends("torch", reason="an nn.Parameter reached through a module")
def test_torch_module_parameter(backend):
    import torch

    class RelBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.tensor(TABLE))

        def forward(self, s, b, h, i, j):
            return s + self.table[h, i - j + LK - 1]

    module = RelBias()
    q, k, v = (backend.asarray(a) for a in qkv(lq=LQ, lk=LK))
    out = scaled_dot_product_attention(q, k, v, score_mod=module, block_size=(3, 4))
    assert type(out.grad_fn).__name__ == "TiledAttentionBackward"  # the recomputing one
    out.square().sum().backward()
    dense = scaled_dot_product_attention(q, k, v, score_mod=module, block_size="dense")
    (want,) = torch.autograd.grad(dense.square().sum(), module.table)
    torch.testing.assert_close(module.table.grad, want, rtol=0, atol=1e-12)


@pytest.mark.backends("jax", reason="jax.jit, jax.vmap over the learned table")
def test_jax_jit_and_vmap(backend, xp, route):
    import jax

    cot = backend.asarray(randn(2, 4, LQ, 3, seed=8))
    loss = loss_of(backend, xp, route.kw, cot)
    dense = loss_of(backend, xp, {"block_size": "dense"}, cot)
    *qkv_args, table, temperature = arrays(backend)
    grad = jax.jit(jax.grad(loss, argnums=3))
    np.testing.assert_allclose(
        grad(*qkv_args, table, temperature),
        jax.grad(dense, argnums=3)(*qkv_args, table, temperature),
        atol=1e-12,
    )
    tables = xp.stack([table, 2.0 * table])
    batched = jax.vmap(grad, in_axes=(None, None, None, 0, None))(*qkv_args, tables, temperature)
    np.testing.assert_allclose(
        batched[1], jax.grad(dense, argnums=3)(*qkv_args, 2.0 * table, temperature), atol=1e-12
    )


def saved_bytes(backend, xp, route, score_mod):
    """Bytes the backward of one call keeps from the forward (autograd's saved tensors,
    the residuals of ``jax.vjp``), with a learned `score_mod` or a fixed one."""
    lq = lk = 128
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=lq, lk=lk, dk=4, dv=4, backend=backend)
    table = backend.asarray(randn(2, 2 * lk - 1, seed=9))

    def attend(q, k, v, table):
        def mod(s, b, h, i, j):
            return s + table[h, i - j + lk - 1] if score_mod else s

        return scaled_dot_product_attention(q, k, v, score_mod=mod, is_causal=True, **route)

    if backend.family == "torch":
        import torch

        total = []

        def pack(x):
            total.append(x.untyped_storage().nbytes())
            return x

        leaves = [a.detach().requires_grad_() for a in (q, k, v, table)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            attend(*leaves)
        return sum(total)
    import jax

    _, vjp = jax.vjp(attend, q, k, v, table)
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(vjp))


def test_the_backward_keeps_no_block_of_scores(backend, xp, route):
    if route.name == "dense":
        pytest.skip("the dense path keeps its scores by design")
    with_table = saved_bytes(backend, xp, route.kw, True)
    scores = 2 * 128 * 128 * 8  # one (H, Lq, Lk) float64 block of scores
    assert with_table < scores / 4  # Q, K, V, the output, the lse and the table


@pytest.mark.backends("jax", reason="traced integer arrays closed over by a score_mod")
def test_jax_integer_arrays_it_closes_over(backend, xp, route):
    """A traced bucket table (integers) is a parameter too, with no gradient of its own."""
    import jax

    q, k, v, table, _ = arrays(backend)
    buckets = xp.arange(LQ + LK - 1) % 5  # traced below: an argument of the function

    def loss_of(kw):
        def loss(q, table, buckets):
            def mod(s, b, h, i, j):
                return s + table[h, buckets[i - j + LK - 1]]

            out = scaled_dot_product_attention(q, k, v, score_mod=mod, is_causal=True, **kw)
            return xp.sum(out)

        return loss

    got = jax.jit(jax.grad(loss_of(route.kw), argnums=(0, 1)))(q, table, buckets)
    want = jax.grad(loss_of({"block_size": "dense"}), argnums=(0, 1))(q, table, buckets)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-12)


@pytest.mark.backends("jax", reason="an eager score_mod that reads concrete values")
def test_jax_eager_python_logic_on_concrete_values(backend, xp):
    q, k, v, *_ = arrays(backend)
    factor = np.float64(0.5)

    def mod(s, b, h, i, j):
        return s * factor if float(factor) > 0 else s  # Python logic: concrete here

    out = scaled_dot_product_attention(q, k, v, score_mod=mod, block_size=(3, 4))
    want = scaled_dot_product_attention(q, k, v, scale=0.5 / np.sqrt(5), block_size=(3, 4))
    np.testing.assert_allclose(out, want, atol=1e-12)


@pytest.mark.backends("torch", reason="torch.func.grad with respect to the captured table")
def test_torch_func_grad(backend, route):
    import torch

    q, k, v, table, temperature = arrays(backend)
    cot = backend.asarray(randn(2, 4, LQ, 3, seed=9))

    def loss(table, **kw):
        mod = rel_bias(torch, table, temperature)
        return (scaled_dot_product_attention(q, k, v, score_mod=mod, **kw) * cot).sum()

    got = torch.func.grad(loss)(table, **route.kw)
    want = torch.func.grad(loss)(table, block_size="dense")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    eager = table.detach().clone().requires_grad_()  # and after it, eager autograd again
    (g,) = torch.autograd.grad(loss(eager, **route.kw), eager)
    torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def test_a_parameter_read_in_some_blocks_only(backend, xp, route):
    """A learned array read under a Python condition on the indices gets its gradient.

    ``far`` is read only by blocks holding an entry below the diagonal: the torch
    tiled path found the parameters by one probe at ``q_idx = kv_idx = 0``, where the
    condition is false, and left ``far`` without a gradient (issue 46, item 19). JAX
    traces the indices, so such a function is differentiated by JAX's own autodiff.
    """
    if route.name == "loop":
        pytest.skip("the traced loop's indices are traced: no Python logic on their values")
    lq, lk = 6, 5
    q, k, v = qkv(batch=(1,), hq=2, hkv=1, lq=lq, lk=lk, dk=3, dv=2, seed=31)
    near, far = np.array([0.4, -0.8]), np.array([1.1, 0.6])
    cot = backend.asarray(randn(1, 2, lq, 2, seed=34))

    def loss_of(kw):
        def loss(q, k, v, near, far):
            def mod(s, b, h, i, j):
                if bool(xp.any(i > j)):  # skip the work where no entry is below the diagonal
                    s = s + xp.where(i > j, far[h], 0.0)
                return s + near[h]

            out = scaled_dot_product_attention(q, k, v, score_mod=mod, **kw)
            return xp.sum(out * cot)

        return loss

    args = [backend.asarray(a) for a in (q, k, v, near, far)]
    grad = backend.grad
    if backend.family == "jax":  # eager: the function's condition needs concrete indices
        import jax

        def grad(fn, *a):
            return jax.grad(fn, argnums=tuple(range(len(a))))(*a)

    got = grad(loss_of(route.kw), *args)
    want = grad(loss_of({"block_size": "dense"}), *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), atol=1e-12)
    assert np.all(np.abs(backend.to_numpy(got[4])) > 1e-3)  # `far` learns

    def loss_np(*a):
        return float(backend.to_numpy(loss_of(route.kw)(*(backend.asarray(x) for x in a))))

    numeric = central_differences(loss_np, [q, k, v, near, far])
    for g, n in zip(got, numeric, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)


@pytest.mark.backends("torch", reason="the tiled path's own gather of a torch table")
@pytest.mark.parametrize(
    "pattern",
    [
        "relative",
        "from_the_end",
        "int32",
        "python_int",
        "per_head",
        "transposed",
        "three_axes",
        "crossed",
    ],
)
def test_torch_gathers_equal_torch_indexing(backend, pattern):
    """The tiled path computes ``table[h, i - j + c]`` and its gradient itself (issue 46,
    item 6): values and gradients equal torch's own indexing (the dense path's autograd)."""
    import torch

    q, k, v = (backend.asarray(a) for a in qkv(lq=LQ, lk=LK, dk=5, dv=3))
    shape = {"per_head": (H,), "transposed": (LQ + LK - 1, H), "three_axes": (H, 2, 3)}
    table = backend.asarray(randn(*shape.get(pattern, (H, LQ + LK - 1)), seed=21))

    def mod(t):
        def score_mod(s, b, h, i, j):
            if pattern == "relative":
                return s + t[h, i - j + LK - 1]
            if pattern == "from_the_end":  # negative indices count from the end
                return s + t[h, j - i]
            if pattern == "int32":
                return s + t[h, (i - j + LK - 1).to(torch.int32)]
            if pattern == "python_int":
                return s + t[1, i - j + LK - 1]
            if pattern == "per_head":
                return s * t[h]
            if pattern == "transposed":  # a strided view, made inside
                return s + t.T[h, i - j + LK - 1]
            if pattern == "crossed":  # the row varies with the column: flat positions
                return s + t[(i + j) % H, i - j + LK - 1]
            return s + t[h, i % 2, j % 3]

        return score_mod

    def grads(block_size):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, table)]
        out = scaled_dot_product_attention(
            *leaves[:3], score_mod=mod(leaves[3]), is_causal=True, block_size=block_size
        )
        return [out, *torch.autograd.grad(out.square().sum(), leaves)]

    for got, want in zip(grads((3, 4)), grads("dense"), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.backends("torch", reason="torch's error for an index out of range")
def test_torch_gather_out_of_range_raises_torch_error(backend):
    q, k, v = (backend.asarray(a) for a in qkv(lq=LQ, lk=LK))
    table = backend.asarray(TABLE).requires_grad_()

    def mod(s, b, h, i, j):
        return s + table[h % 2, i - j + LK]  # one past the end, not the table's end

    with pytest.raises(IndexError):
        scaled_dot_product_attention(q, k, v, score_mod=mod, block_size=(3, 4))

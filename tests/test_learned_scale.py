"""A learned temperature: `scale` and `softcap` as 0-d arrays (or traced values).

The value is the same as the Python number's on every backend and path; the
gradient with respect to it matches central differences on the dense, tiled and
native paths; concrete values are checked like numbers, traced ones are not.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, qkv
from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention

problem = {"batch": (2,), "lq": 5, "lk": 7, "dk": 4, "dv": 3}  # GQA: Hq=4, Hkv=2


def scalar(backend, value, dtype="float64"):
    """A 0-d array of the backend."""
    return backend.asarray(np.asarray(value, dtype=dtype))


@pytest.mark.parametrize("with_cap", [False, True], ids=["scale", "scale+softcap"])
def test_array_equals_number(backend, xp, route, with_cap):
    q, k, v = qkv(backend=backend, **problem)
    cap = 1.5 if with_cap else None
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        scale=scalar(backend, 0.3),
        softcap=None if cap is None else scalar(backend, cap),
        is_causal=True,
        **route.kw,
    )
    q_np, k_np, v_np = (backend.to_numpy(a) for a in (q, k, v))
    expected = reference_attention(q_np, k_np, v_np, scale=0.3, softcap=cap, is_causal=True)
    assert out.shape == expected.shape
    assert out.dtype == q.dtype
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-10, atol=1e-12)


def test_weights_take_an_array_scale(backend, xp):
    q, k, _ = qkv(backend=backend, **problem)
    w = attention_weights(q, k, scale=scalar(backend, 0.3), softcap=scalar(backend, 2.0))
    ref = attention_weights(q, k, scale=0.3, softcap=2.0)
    np.testing.assert_allclose(backend.to_numpy(w), backend.to_numpy(ref), rtol=1e-12)


def test_float32_inputs_keep_their_dtype(backend, xp):
    """A float64 0-d scale computes in the inputs' float32 (NumPy 2 would promote)."""
    q, k, v = qkv(backend=backend, dtype="float32", **problem)
    out = scaled_dot_product_attention(q, k, v, scale=scalar(backend, 0.3), block_size=(2, 3))
    assert out.dtype == q.dtype


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-0.5, ValueError, r"`scale` must be a finite number > 0"),
        (float("nan"), ValueError, r"`scale` must be a finite number > 0"),
        (1e308, ValueError, r"`scale` = 1e\+308 is outside the normal range.*float32"),
    ],
)
@pytest.mark.skip_backends("dask", reason="a lazy Dask value is not read (it would compute)")
def test_concrete_array_values_are_checked(backend, xp, value, error, match):
    q, k, v = qkv(backend=backend, dtype="float32", **problem)
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, scale=scalar(backend, value))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda b: b.asarray(np.array([0.3, 0.4])), ValueError, r"0-d array.*shape \(2,\)"),
        (lambda b: b.asarray(np.array(1)), TypeError, r"`softcap` must be a floating array"),
        (lambda b: "0.3", TypeError, r"positive real number or a 0-d floating array"),
    ],
)
def test_bad_array_options(backend, xp, make, error, match):
    q, k, v = qkv(backend=backend, **problem)
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, softcap=make(backend))


@pytest.mark.backends("torch", "jax", reason="another library's scalar array")
def test_scale_from_another_library(backend, xp):
    q, k, v = qkv(backend=backend, **problem)
    with pytest.raises(TypeError, match=r"`query` and `scale` come from different"):
        scaled_dot_product_attention(q, k, v, scale=np.asarray(0.3))


@pytest.mark.autodiff
@pytest.mark.parametrize("with_cap", [False, True], ids=["scale", "scale+softcap"])
def test_gradients_reach_scale_and_softcap(backend, xp, route, with_cap):
    kw = route.kw  # the native kernels take no softcap: those routes skip it
    mask = backend.asarray(np.random.default_rng(3).random((5, 7)) < 0.8)
    q, k, v = qkv(backend=backend, **{**problem, "dv": 4})  # JAX's kernel needs Dv == Dk
    cot = backend.asarray(np.random.default_rng(4).standard_normal((2, 4, 5, 4)))

    def loss(q, scale, *cap):
        out = scaled_dot_product_attention(
            q, k, v, scale=scale, softcap=cap[0] if cap else None, mask=mask, **kw
        )
        return xp.sum(out * cot)

    args = [q, scalar(backend, 0.3), *([scalar(backend, 1.5)] if with_cap else [])]
    analytic = backend.grad(loss, *args)

    def loss_np(*arrays):
        return float(backend.to_numpy(loss(*(backend.asarray(a) for a in arrays))))

    numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
    atol = 1e-6
    if route.name == "native" and backend.family == "jax":
        # its softmax is float32 even for float64, too coarse for central differences:
        # compare with the portable path's gradients instead
        kw = {"implementation": "portable"}
        numeric = [backend.to_numpy(g) for g in backend.grad(loss, *args)]
        atol = 2e-5
    for g, n in zip(analytic, numeric, strict=True):
        assert tuple(g.shape) == n.shape
        np.testing.assert_allclose(backend.to_numpy(g), n, atol=atol, rtol=1e-5)


@pytest.mark.backends("torch", reason="torch autograd into a leaf tensor")
def test_torch_leaf_temperature(backend, route):
    import torch

    q, k, v = qkv(backend=backend, **problem)
    temperature = scalar(backend, 0.3).requires_grad_(True)  # a leaf on the backend's device
    out = scaled_dot_product_attention(q, k, v, scale=temperature, **route.kw)
    out.sum().backward()
    assert temperature.grad is not None
    assert torch.isfinite(temperature.grad)


@pytest.mark.backends("jax", reason="jax.jit makes every argument a tracer")
def test_traced_scale_under_jit(backend, route):
    import jax

    q, k, v = qkv(backend=backend, **problem)

    def f(q, scale, softcap):
        return scaled_dot_product_attention(
            q, k, v, scale=scale, softcap=softcap, is_causal=True, **route.kw
        )

    jitted = jax.jit(f)(q, 0.3, 1.5)  # plain floats become tracers
    eager = f(q, 0.3, 1.5)
    assert_close(backend, jitted, eager, rtol=1e-12, atol=0.0)
    # a traced value is not read: a bad one is the caller's to avoid, not an error here
    grads = jax.jit(jax.grad(lambda s, c: f(q, s, c).sum(), argnums=(0, 1)))(0.3, 1.5)
    eager_grads = jax.grad(lambda s, c: f(q, s, c).sum(), argnums=(0, 1))(0.3, 1.5)
    for g, e in zip(grads, eager_grads, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(e), rtol=1e-10)


@pytest.mark.backends("torch", reason="torch.compile traces the scale")
def test_torch_compile_with_a_learned_scale(backend):
    import torch

    q, k, v = qkv(backend=backend, **problem)
    temperature = scalar(backend, 0.3)

    def f(q, t):
        return scaled_dot_product_attention(q, k, v, scale=t, block_size=(2, 3))

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert_close(backend, compiled(q, temperature), f(q, temperature), rtol=1e-12, atol=0.0)


@pytest.mark.backends("torch", reason="torch.func.vmap over a learned temperature")
def test_torch_vmap_over_the_temperature(backend, route):
    import torch
    from torch.func import vmap

    q, k, v = qkv(backend=backend, **problem)
    temperatures = backend.asarray(np.array([0.3, 0.5, 0.9]))

    def f(t):
        return scaled_dot_product_attention(q, k, v, scale=t, softcap=t * 4, **route.kw)

    batched = vmap(f)(temperatures)
    for i in range(3):
        torch.testing.assert_close(batched[i], f(temperatures[i]))

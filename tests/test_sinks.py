"""Attention sinks: one extra logit per head in every row's denominator, no value.

Against the float64 oracle on every backend, on the dense and tiled paths; the
weights' rows sum to less than one; rows with no visible key are zeros; the
gradients reach the sinks (central differences); bad sinks get clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, check, qkv, randn
from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn.testing import central_differences

problem = {"batch": (2,), "lq": 5, "lk": 7, "dk": 4, "dv": 3}  # GQA: Hq=4, Hkv=2


def sinks_of(shape=(4,), seed=9):
    return randn(*shape, seed=seed)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": True, "softcap": 2.0},
        {"window": (1, 0), "scale": 0.7},
        {"kv_lengths": np.array([7, 3])},
    ],
    ids=["plain", "causal+softcap", "window", "lengths"],
)
def test_against_oracle(backend, xp, route, kw):
    q, k, v = qkv(**problem)
    _, w = check(backend, q, k, v, route=route, sinks=sinks_of(), **kw)
    row_sums = backend.to_numpy(xp.sum(w, axis=-1))
    assert np.all(row_sums < 1.0)


@pytest.mark.parametrize("shape", [(), (1,), (2, 4), (2, 1)])
def test_broadcast_shapes(backend, xp, shape):
    q, k, v = qkv(**problem)
    check(backend, q, k, v, block_size=(2, 3), sinks=sinks_of(shape))


def test_rows_with_no_visible_key_are_zero(backend, xp, route):
    q, k, v = qkv(**problem)
    mask = np.ones((5, 7), dtype=bool)
    mask[[1, 3]] = False
    out, w = check(backend, q, k, v, route=route, mask=mask, sinks=sinks_of())
    assert np.all(backend.to_numpy(out)[..., [1, 3], :] == 0.0)
    assert np.all(backend.to_numpy(w)[..., [1, 3], :] == 0.0)


def test_a_huge_sink_takes_all_the_weight(backend, xp):
    q, k, v = qkv(**problem)
    _, w = check(backend, q, k, v, sinks=np.full((4,), 50.0))
    assert np.all(np.abs(backend.to_numpy(w)) < 1e-15)


@pytest.mark.autodiff
def test_gradients_reach_the_sinks(backend, xp, route):
    q, k, v = qkv(backend=backend, **problem)
    mask = np.ones((5, 7), dtype=bool)
    mask[2] = False  # a row with no visible key
    mask_b = backend.asarray(mask)
    cot = backend.asarray(randn(2, 4, 5, 3, seed=4))

    def loss(q, k, v, sinks):
        out = scaled_dot_product_attention(
            q, k, v, sinks=sinks, mask=mask_b, is_causal=True, **route.kw
        )
        return xp.sum(out * cot)

    args = [q, k, v, backend.asarray(sinks_of((2, 4)))]
    analytic = backend.grad(loss, *args)

    def loss_np(*arrays):
        return float(backend.to_numpy(loss(*(backend.asarray(a) for a in arrays))))

    numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
    for g, n in zip(analytic, numeric, strict=True):
        assert np.all(np.isfinite(backend.to_numpy(g)))
        np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_under_jax_rank_promotion_raise(backend, xp, route):
    """With ``jax_numpy_rank_promotion="raise"`` every call with sinks raised.

    The sinks (Hq, 1, 1) joined the (B, Hq, Lq, 1) row maxima and sums. Every operand
    now has the logits' rank; values, and the gradients of Q, K, V and the sinks.
    """
    import jax

    q, k, v = qkv(**problem)
    sinks = sinks_of()
    kw = {"sinks": sinks, "is_causal": True, "kv_lengths": np.array([7, 3])}
    cot = backend.asarray(randn(2, 4, 5, 3, seed=4))
    n = backend.asarray(kw["kv_lengths"])

    def loss(q, k, v, sinks):
        out = scaled_dot_product_attention(
            q, k, v, sinks=sinks, is_causal=True, kv_lengths=n, **route.kw
        )
        return xp.sum(out * cot)

    args = [backend.asarray(a) for a in (q, k, v, sinks)]
    with jax.numpy_rank_promotion("raise"):
        check(backend, q, k, v, route=route, **kw)
        grads = backend.grad(loss, *args)
    for g, expected in zip(grads, backend.grad(loss, *args), strict=True):
        assert_close(backend, g, backend.to_numpy(expected))


@pytest.mark.backends("torch", reason="the native route refuses, the default takes the portable")
def test_native_refuses_and_default_routes_portable(backend, xp):
    q, k, v = (backend.asarray(a) for a in qkv(**problem))
    sinks = backend.asarray(sinks_of())
    with pytest.raises(ValueError, match="cannot express sinks"):
        scaled_dot_product_attention(q, k, v, sinks=sinks, implementation="native")
    out = scaled_dot_product_attention(q, k, v, sinks=sinks)
    ref = scaled_dot_product_attention(q, k, v, sinks=sinks, block_size="dense")
    assert_close(backend, out, backend.to_numpy(ref))


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (np.zeros((4,), dtype=np.int64), TypeError, r"`sinks` must have a real floating"),
        (np.zeros((3,)), ValueError, r"`sinks`.*\(3,\).*\(2, 4\)"),
        (np.zeros((3, 4)), ValueError, r"`sinks`.*\(3, 4\).*\(2, 4\)"),
    ],
)
def test_bad_sinks(backend, xp, sinks, error, match):
    q, k, v = (backend.asarray(a) for a in qkv(**problem))
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, sinks=backend.asarray(sinks))
    with pytest.raises(error, match=match):
        attention_weights(q, k, sinks=backend.asarray(sinks))


@pytest.mark.skip_backends("dask", reason="a lazy Dask value is not read (it would compute)")
def test_sinks_beyond_the_compute_dtype_are_refused(backend, xp):
    q, k, v = (backend.asarray(a, "float32") for a in qkv(**problem))
    sinks = backend.asarray(np.array([1e39, 0.0, -np.inf, 1.0]))  # float64: finite, -inf
    with pytest.raises(ValueError, match=r"`sinks` \(.*float64\) has finite values beyond"):
        scaled_dot_product_attention(q, k, v, sinks=sinks)
    ok = backend.asarray(np.array([3.0e38, 0.0, -np.inf, 1.0]))  # in range; -inf: no sink
    out = scaled_dot_product_attention(q, k, v, sinks=ok)
    assert np.all(backend.to_numpy(out)[:, 0] == 0.0)  # the huge sink takes all the weight
    assert np.all(np.isfinite(backend.to_numpy(out)))


def test_a_bool_sink_is_a_type_error_without_a_float8_hint(backend, xp):
    q, k, v = (backend.asarray(a) for a in qkv(**problem))
    with pytest.raises(TypeError, match=r"`sinks` must have a real floating") as info:
        scaled_dot_product_attention(q, k, v, sinks=backend.asarray(np.ones(4, dtype=bool)))
    assert "float8" not in str(info.value)


@pytest.mark.backends("torch", reason="torch.func.vmap over the sinks, tiled path")
def test_torch_vmap_over_sinks(backend, route):
    import torch
    from torch.func import grad, vmap

    q, k, v = qkv(backend=backend, **problem)
    many = backend.asarray(randn(3, 4, seed=2))

    def f(s):
        return scaled_dot_product_attention(q, k, v, sinks=s, **route.kw)

    batched = vmap(f)(many)
    for i in range(3):
        torch.testing.assert_close(batched[i], f(many[i]))
    grads = vmap(grad(lambda s: f(s).sum()))(many)
    for i in range(3):
        torch.testing.assert_close(grads[i], grad(lambda s: f(s).sum())(many[i]))

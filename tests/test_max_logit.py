"""`return_max_logit=True`: each row's largest final score, for QK-clip.

Against the float64 oracle's row max of the same scores (every score term and
mask, empty rows ``-inf``, the sink left out) on every backend and route; the
outputs unchanged and in order (out, lse, max); no gradient through it; half
inputs give a float32 max.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import TILE_CASES, on_backend, qkv, representable
from portable_attn import scaled_dot_product_attention
from portable_attn.testing import reference_lse, reference_max_logit


def assert_max(backend, actual, expected, *, rtol=1e-12):
    assert tuple(actual.shape) == expected.shape
    got = backend.to_numpy(actual).astype(np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("case", list(TILE_CASES))
@pytest.mark.parametrize("sizes", [(11, 7), (7, 11)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_against_oracle(backend, xp, route, case, sizes):
    if backend.family == "jax" and route.name != "loop" and sizes == (11, 7):
        # a program compiled per case (2 s each): the shared walk's alignment is checked
        # at both shapes on the other backends, and JAX's own loop at both here
        pytest.skip("JAX: one shape but on its traced loop")
    lq, lk = sizes
    q, k, v = qkv(lq=lq, lk=lk)
    kw = TILE_CASES[case](lq, lk)
    args = [backend.asarray(a) for a in (q, k, v)]
    given = on_backend(backend, kw)
    if case == "score_mod":  # the same function in the backend's namespace

        def given_mod(s, b, h, i, j):
            dist = xp.astype((h + 1) * xp.abs(i - j), s.dtype)
            return s - 0.1 * dist + 0.01 * xp.astype(b, s.dtype)

        given["score_mod"] = given_mod
    out, top = scaled_dot_product_attention(*args, **route.kw, return_max_logit=True, **given)
    plain = scaled_dot_product_attention(*args, **route.kw, **given)
    # unchanged (to the last bits: XLA may fuse a program with one more output otherwise)
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(plain), rtol=1e-13)
    assert top.dtype == backend.dtype("float64")
    assert_max(backend, top, reference_max_logit(q, k, **oracle_kw(kw, lq, lk)))


def oracle_kw(kw, lq, lk):
    """`kw` for the oracle: a `mask_mod` as the mask it gives (batch 2, 4 heads)."""
    if "mask_mod" not in kw:
        return kw
    b, h = np.arange(2).reshape(2, 1, 1, 1), np.arange(4)[:, None, None]
    allowed = kw["mask_mod"](b, h, np.arange(lq)[:, None], np.arange(lk)[None, :])
    return {"mask": np.broadcast_to(allowed, (2, 4, lq, lk))}


def test_after_the_lse_and_empty_rows(backend, xp, route):
    """Lq > Lk, causal: the first rows see no key (max and lse ``-inf``); a sink is no score."""
    q, k, v = qkv(lq=9, lk=6)
    kw = {"is_causal": True, "sinks": np.array([5.0, -1.0, 0.0, 40.0])}
    args = [backend.asarray(a) for a in (q, k, v)]
    _out, lse, top = scaled_dot_product_attention(
        *args, **route.kw, return_lse=True, return_max_logit=True, **on_backend(backend, kw)
    )
    expected = reference_max_logit(q, k, **kw)
    assert np.isneginf(expected[..., :3]).all()
    assert np.isfinite(expected[..., 3:]).all()
    assert_max(backend, top, expected)
    np.testing.assert_allclose(backend.to_numpy(lse), reference_lse(q, k, **kw), rtol=1e-12)
    assert (backend.to_numpy(top)[..., 3:] < 40.0).all()  # the sink of head 3 is not its max


def test_two_dimensional_inputs(backend, xp):
    q, k, v = (a[0, 0] for a in qkv(lq=5, lk=7, dv=8))
    _out, top = scaled_dot_product_attention(
        *(backend.asarray(a) for a in (q, k, v)), is_causal=True, return_max_logit=True
    )
    assert_max(backend, top, reference_max_logit(q, k, is_causal=True))


@pytest.mark.dtypes("float16", "bfloat16")
def test_half_inputs_give_a_float32_max(backend, xp, dtype, route):
    q, k, v = qkv(lq=6, lk=10)
    args = [backend.asarray(a, dtype) for a in (q, k, v)]
    out, top = scaled_dot_product_attention(*args, **route.kw, return_max_logit=True)
    assert out.dtype == backend.dtype(dtype)
    assert top.dtype == backend.dtype("float32")
    seen = [representable(backend, a, dtype) for a in (q, k)]
    assert_max(backend, top, reference_max_logit(*seen), rtol=1e-5)


@pytest.mark.autodiff
def test_no_gradient_flows_through_it(backend, xp, route):
    q, k, v = qkv(backend=backend, lq=6, lk=10)
    if backend.family == "torch":  # a tensor that autograd does not record
        leaves = [a.detach().requires_grad_() for a in (q, k, v)]
        out, top = scaled_dot_product_attention(*leaves, **route.kw, return_max_logit=True)
        assert out.requires_grad
        assert not top.requires_grad
        return

    def loss(q, k):
        _, top = scaled_dot_product_attention(q, k, v, **route.kw, return_max_logit=True)
        return xp.sum(top)

    for g in backend.grad(loss, q, k):  # JAX: a zero gradient
        assert not np.any(backend.to_numpy(g))


def test_flag_is_checked(backend, xp):
    q, k, v = qkv(backend=backend)
    with pytest.raises(TypeError, match="`return_max_logit` must be True or False"):
        scaled_dot_product_attention(q, k, v, return_max_logit="yes")

"""`return_lse=True` and the public `merge_attention`.

The lse against a float64 log-sum-exp (with and without sinks, ``-inf`` rows),
the output unchanged by asking for it, its cotangent flowing back; merging two
or three key parts (uneven, some rows empty in a part) equals the full call,
with the sink in one part; gradients through the merge; clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn
from portable_attn import merge_attention, scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention, reference_lse

problem = {"batch": (2,), "lq": 5, "lk": 9, "dk": 4, "dv": 3}  # GQA: Hq=4, Hkv=2
MASK = np.ones((5, 9), dtype=bool)
MASK[1] = False  # a row with no visible key
SINKS = randn(4, seed=9)


def assert_lse(backend, actual, expected, dtype="float64"):
    assert tuple(actual.shape) == expected.shape
    assert actual.dtype == backend.dtype(dtype)
    got = backend.to_numpy(actual).astype(np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sink", "sinks"])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "softcap": 2.0}], ids=["plain", "causal"])
def test_lse_against_oracle(backend, xp, route, with_sinks, kw):
    q, k, v = qkv(**problem)
    extra = {"mask": MASK, **kw, **({"sinks": SINKS} if with_sinks else {})}
    args = [backend.asarray(a) for a in (q, k, v)]
    on_b = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in extra.items()}
    out, lse = scaled_dot_product_attention(*args, **route.kw, return_lse=True, **on_b)
    assert_close(backend, out, reference_attention(q, k, v, **extra))
    expected = reference_lse(q, k, **extra)
    assert_lse(backend, lse, expected)
    empty_row = backend.to_numpy(lse)[..., 1]  # the library's, not the oracle's
    assert np.isneginf(empty_row).all() != with_sinks  # the empty row: -inf, or the sink's
    if with_sinks:
        np.testing.assert_allclose(empty_row, np.broadcast_to(SINKS, empty_row.shape), rtol=1e-12)


@pytest.mark.bitwise
def test_asking_for_the_lse_leaves_the_output_unchanged(backend, xp, route):
    args = [backend.asarray(a) for a in qkv(**problem)]
    extra = {"mask": backend.asarray(MASK), "sinks": backend.asarray(SINKS)}
    extra.update(is_causal=True, softcap=2.0)
    out, _ = scaled_dot_product_attention(*args, **route.kw, return_lse=True, **extra)
    plain = scaled_dot_product_attention(*args, **route.kw, **extra)
    assert np.array_equal(backend.to_numpy(out), backend.to_numpy(plain))


@pytest.mark.dtypes("float16", "bfloat16")
def test_lse_of_half_inputs_is_float32(backend, xp, dtype):
    q, k, v = (backend.asarray(a, dtype) for a in qkv(**problem))
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, block_size=(2, 3))
    assert out.dtype == backend.dtype(dtype)
    assert lse.dtype == backend.dtype("float32")


def test_two_d_and_empty_calls(backend, xp):
    q, k, v = (backend.asarray(a) for a in (randn(5, 4), randn(7, 4, seed=1), randn(7, 3)))
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert tuple(out.shape) == (5, 3)
    assert tuple(lse.shape) == (5,)
    out, lse = scaled_dot_product_attention(q, k[:0, ...], v[:0, ...], return_lse=True)
    assert np.all(np.isneginf(backend.to_numpy(lse)))


def test_return_lse_must_be_a_flag(backend, xp):
    q, k, v = (backend.asarray(a) for a in qkv(**problem))
    with pytest.raises(TypeError, match=r"`return_lse` must be True or False"):
        scaled_dot_product_attention(q, k, v, return_lse="yes")


@pytest.mark.autodiff
def test_lse_cotangent_flows_back(backend, xp, route):
    q, k, v = qkv(backend=backend, **problem)
    mask = backend.asarray(MASK)
    cot = backend.asarray(randn(2, 4, 5, 3, seed=4))
    lse_cot = backend.asarray(randn(2, 4, 5, seed=5))

    def loss(q, k, v, sinks):
        out, lse = scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=sinks, **route.kw, return_lse=True
        )
        return xp.sum(out * cot) + xp.sum(lse * lse_cot)

    args = [q, k, v, backend.asarray(SINKS)]
    analytic = backend.grad(loss, *args)

    def loss_np(*arrays):
        return float(backend.to_numpy(loss(*(backend.asarray(a) for a in arrays))))

    numeric = central_differences(loss_np, [backend.to_numpy(a) for a in args])
    for g, n in zip(analytic, numeric, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), n, atol=1e-6, rtol=1e-5)


def _parts(backend, q, k, v, bounds, *, mask=None, sinks=None, path="dense", **kw):
    outs, lses = [], []
    for i, (start, stop) in enumerate(bounds):
        part_kw = dict(kw)
        if mask is not None:
            part_kw["mask"] = backend.asarray(mask[..., start:stop])
        if sinks is not None and i == 0:  # the sink belongs to one part only
            part_kw["sinks"] = backend.asarray(sinks)
        out, lse = scaled_dot_product_attention(
            *(backend.asarray(a) for a in (q, k[..., start:stop, :], v[..., start:stop, :])),
            block_size={"dense": "dense", "tiled": (2, 3)}[path],
            return_lse=True,
            **part_kw,
        )
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("path", ["dense", "tiled"])
@pytest.mark.parametrize(
    "bounds", [((0, 4), (4, 9)), ((0, 2), (2, 3), (3, 9))], ids=["two", "three"]
)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sink", "sinks"])
def test_merge_equals_the_full_call(backend, xp, path, bounds, with_sinks):
    q, k, v = qkv(**problem)
    mask = MASK.copy()
    mask[3, :4] = False  # row 3 sees nothing in the first part(s)
    sinks = SINKS if with_sinks else None
    outs, lses = _parts(backend, q, k, v, bounds, mask=mask, sinks=sinks, path=path)
    out, lse = merge_attention(outs, lses)
    full = {"mask": mask, **({"sinks": sinks} if with_sinks else {})}
    assert_close(backend, out, reference_attention(q, k, v, **full))
    assert_lse(backend, lse, reference_lse(q, k, **full))
    if not with_sinks:
        assert np.all(backend.to_numpy(out)[..., 1, :] == 0.0)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_merge_under_jax_rank_promotion_raise(backend, xp):
    """With ``jax_numpy_rank_promotion="raise"`` every merge raised (issue 46, item 11).

    The parts' (P, ..., Lq, 1) lse less their (..., Lq, 1) maximum over the parts:
    operands of different ranks. The maximum is now given the parts' rank first.
    """
    import jax

    q, k, v = qkv(**problem)
    mask = MASK.copy()
    mask[3, :4] = False  # row 3 sees nothing in the first part
    outs, lses = _parts(backend, q, k, v, ((0, 4), (4, 9)), mask=mask, sinks=SINKS)
    with jax.numpy_rank_promotion("raise"):
        out, lse = merge_attention(outs, lses)
    assert_close(backend, out, reference_attention(q, k, v, mask=mask, sinks=SINKS))
    assert_lse(backend, lse, reference_lse(q, k, mask=mask, sinks=SINKS))


@pytest.mark.autodiff
def test_merge_is_differentiable(backend, xp):
    q, k, v = qkv(backend=backend, **problem)
    cot = backend.asarray(randn(2, 4, 5, 3, seed=4))
    mask = backend.asarray(MASK)

    def merged(q, k, v):
        parts = [
            scaled_dot_product_attention(
                q, k[..., s, :], v[..., s, :], mask=mask[..., s], return_lse=True
            )
            for s in (slice(0, 4), slice(4, 9))
        ]
        out, _ = merge_attention([p[0] for p in parts], [p[1] for p in parts])
        return xp.sum(out * cot)

    def full(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, mask=mask) * cot)

    for a, b in zip(backend.grad(merged, q, k, v), backend.grad(full, q, k, v), strict=True):
        assert np.all(np.isfinite(backend.to_numpy(a)))
        np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), atol=1e-12)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda o, ls: (o[0], ls), TypeError, r"`outs` must be a sequence"),
        (lambda o, ls: ([], []), ValueError, r"at least one part"),
        (lambda o, ls: (o, ls[:1]), ValueError, r"2 outputs and 1 lses"),
        (lambda o, ls: (o, [ls[0], ls[1][..., :2]]), ValueError, r"`lses\[1\]`.*\(2, 4, 2\)"),
        (lambda o, ls: ([o[0], o[1][..., :2]], ls), ValueError, r"`outs\[1\]` has shape"),
        (lambda o, ls: (o, [ls[0], "x"]), TypeError, r"`lses\[1\]` must be an array"),
    ],
)
def test_merge_errors(backend, xp, make, error, match):
    q, k, v = qkv(**problem)
    outs, lses = _parts(backend, q, k, v, ((0, 4), (4, 9)))
    with pytest.raises(error, match=match):
        merge_attention(*make(outs, lses))


@pytest.mark.backends("torch", "jax", reason="another library's part")
def test_merge_refuses_mixed_libraries(backend, xp):
    q, k, v = qkv(**problem)
    outs, lses = _parts(backend, q, k, v, ((0, 4), (4, 9)))
    with pytest.raises(TypeError, match=r"come from different array libraries"):
        merge_attention([outs[0], backend.to_numpy(outs[1])], lses)

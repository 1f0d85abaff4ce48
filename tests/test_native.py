"""implementation="native" and the default routing, against the portable path."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import (
    assert_backend_array,
    float32_error_bound,
    half_precision_bound,
    representable,
)
from _helpers import qkv as _qkv
from portable_attn import scaled_dot_product_attention
from portable_attn.testing import central_differences, reference_attention

qkv = partial(_qkv, lq=6, lk=9, dk=8, dv=8)


# every combination the native kernels are asked to express
COMBOS = {
    "plain": {},
    "causal square": {"is_causal": True, "square": True},
    "causal Lq<Lk": {"is_causal": True},
    "causal Lq>Lk": {"is_causal": True, "lq": 12, "lk": 5},
    "mask": {"mask": True},
    "bias": {"bias": True},
    "mask+bias+causal": {"mask": True, "bias": True, "is_causal": True},
    "window": {"window": (2, 1)},
    "lengths": {"lengths": True, "is_causal": True},
    "fully masked rows": {"empty_rows": True},
    "mqa": {"hkv": 1},
}


def tolerance(backend):
    # jax.nn.dot_product_attention computes its softmax in float32, even for float64 inputs
    return 2e-6 if backend.family == "jax" else 1e-12


def build(backend, name):
    spec = dict(COMBOS[name])
    lq, lk = spec.pop("lq", 6), spec.pop("lk", 9)
    if spec.pop("square", False):
        lk = lq
    q, k, v = qkv(hkv=spec.pop("hkv", 2), lq=lq, lk=lk)
    kw = {}
    rng = np.random.default_rng(7)
    if spec.pop("mask", False):
        kw["mask"] = backend.asarray(rng.random((1, 4, lq, lk)) < 0.7)
    if spec.pop("bias", False):
        kw["bias"] = backend.asarray(rng.standard_normal((lq, lk)))
    if spec.pop("lengths", False):
        kw["q_lengths"] = backend.asarray(np.array([lq, 3]))
        kw["kv_lengths"] = backend.asarray(np.array([lk, 4]))
    if spec.pop("empty_rows", False):
        m = np.ones((lq, lk), dtype=bool)
        m[[1, 4]] = False
        b = np.zeros((lq, lk))
        b[2] = -np.inf
        kw["mask"], kw["bias"] = backend.asarray(m), backend.asarray(b)
    kw.update(spec)
    return [backend.asarray(a) for a in (q, k, v)], kw


@pytest.mark.backends("torch", "jax", reason="native kernels: torch and JAX")
@pytest.mark.parametrize("name", list(COMBOS))
def test_native_matches_portable(backend, name):
    args, kw = build(backend, name)
    native = scaled_dot_product_attention(*args, implementation="native", **kw)
    portable = scaled_dot_product_attention(*args, implementation="portable", **kw)
    atol = tolerance(backend)
    np.testing.assert_allclose(backend.to_numpy(native), backend.to_numpy(portable), atol=atol)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
@pytest.mark.parametrize("name", list(COMBOS))
def test_under_jax_rank_promotion_raise(backend, xp, name):
    """With ``jax_numpy_rank_promotion="raise"`` the JAX kernel's call raised (issue 46, 11).

    The rows that see a finite score came from a (1, 1, Lq, Lk) "allowed" AND-ed with
    the finite entries of an (Lq, Lk) bias. The bias is now at the logits' rank
    first; values and gradients as the float64 oracle's.
    """
    import jax

    args, kw = build(backend, name)
    as_np = {n: backend.to_numpy(a) if hasattr(a, "shape") else a for n, a in kw.items()}
    q, k, v = (backend.to_numpy(a) for a in args)
    cot = backend.asarray(np.random.default_rng(5).standard_normal((2, 4, q.shape[-2], 8)))

    def loss(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, implementation="native", **kw) * cot)

    with jax.numpy_rank_promotion("raise"):
        out = scaled_dot_product_attention(*args, implementation="native", **kw)
        grads = backend.grad(loss, *args)
    expected = reference_attention(q, k, v, **as_np)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=tolerance(backend))
    assert all(np.all(np.isfinite(backend.to_numpy(g))) for g in grads)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"softcap": 2.0}, "softcap"),
        ({"block_size": 4}, "block_size"),
        ({"score_mod": lambda s, *_: s}, "score_mod"),
    ],
    ids=["softcap", "block_size", "score_mod"],
)
def test_native_refuses_what_it_cannot_express(backend, kw, match):
    args = [backend.asarray(a) for a in qkv()]
    expected = match if backend.family in ("torch", "jax") else "no native attention kernel"
    with pytest.raises(ValueError, match=rf"implementation='native': .*{expected}"):
        scaled_dot_product_attention(*args, implementation="native", **kw)


@pytest.mark.backends("jax", reason="jax.nn.dot_product_attention only")
def test_jax_native_needs_equal_head_dims(backend):
    args = [backend.asarray(a) for a in qkv(dv=5)]
    with pytest.raises(ValueError, match=r"`value` axis -1 \(Dv\) == `key` axis -1 \(Dk\).*Dv=5"):
        scaled_dot_product_attention(*args, implementation="native")


def test_bad_implementation(backend):
    args = [backend.asarray(a) for a in qkv()]
    with pytest.raises(ValueError, match="`implementation` must be None, 'portable' or 'native'"):
        scaled_dot_product_attention(*args, implementation="fast")


@pytest.mark.backends("torch", "jax", reason="native kernels: torch and JAX")
@pytest.mark.parametrize(
    "kw", [{"is_causal": True}, {"window": (None, 1)}, {}], ids=["causal", "right-edge", "none"]
)
def test_rows_emptied_by_a_key_only_mask_are_zero(backend, kw):
    """The first allowed key decides which rows see nothing (no any over the scores)."""
    q, k, v = qkv()
    mask = np.ones((2, 1, 1, 9), dtype=bool)
    mask[0, ..., :4] = False  # causal: the first rows of batch 0 see no key
    mask[1] = False  # batch 1 sees nothing at all
    args = [backend.asarray(a) for a in (q, k, v)]
    native = scaled_dot_product_attention(
        *args, mask=backend.asarray(mask), implementation="native", **kw
    )
    expected = reference_attention(q, k, v, mask=mask, **kw)
    np.testing.assert_allclose(backend.to_numpy(native), expected, atol=2e-6)
    assert np.all(backend.to_numpy(native)[1] == 0)


@pytest.mark.backends("torch", "jax", reason="native kernels: torch and JAX")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["mask", "bias", "causal Lq>Lk"])
def test_rows_without_keys_are_zero_with_zero_gradients(backend, xp, dtype, form):
    """Guarded around the kernel, or zeroed by it (torch CPU: the router's ZEROES_EMPTY_ROWS).

    The default call, in the kernel's own dtypes (torch's flash kernel, not the float64
    math one), with 32 keys: above the policy's NATIVE_MIN_KEYS, so on torch it is the
    native kernel (JAX's default call is its portable path).
    """
    lq, lk = (40, 32) if form == "causal Lq>Lk" else (24, 32)
    q, k, v = (backend.asarray(a, dtype) for a in qkv(lq=lq, lk=lk))
    kw: dict = {}
    if form == "mask":
        m = np.ones((2, 1, lq, lk), dtype=bool)
        m[1, :, 3:9] = False
        kw["mask"] = backend.asarray(m)
        rows = (1, slice(None), slice(3, 9))
    elif form == "bias":
        b = np.zeros((lq, lk))
        b[5:7] = -np.inf
        kw["bias"] = backend.asarray(b, dtype)
        rows = (slice(None), slice(None), slice(5, 7))
    else:  # bottom-right causal: the first Lq - Lk queries see no key
        kw["is_causal"] = True
        rows = (slice(None), slice(None), slice(0, lq - lk))

    def loss(q, k, v):
        return xp.sum(xp.astype(scaled_dot_product_attention(q, k, v, **kw), xp.float32))

    out = backend.to_numpy(scaled_dot_product_attention(q, k, v, **kw)).astype(np.float64)
    assert np.isfinite(out).all()
    assert np.all(out[rows] == 0)
    assert np.any(out != 0)
    gq, gk, gv = (backend.to_numpy(g).astype(np.float64) for g in backend.grad(loss, q, k, v))
    assert all(np.isfinite(g).all() for g in (gq, gk, gv))
    assert np.all(gq[rows] == 0)
    assert np.any(gq != 0)


@pytest.mark.backends("torch", reason="torch CPU SDPA zeroes rows without keys itself")
def test_no_guard_where_the_kernel_zeroes_empty_rows(backend, monkeypatch):
    """No pass over the mask for empty rows where torch's kernel zeroes them itself."""
    from portable_attn._lib._call import prepare
    from portable_attn._lib._route import route
    from portable_attn._paths import _native

    q, k, v = (backend.asarray(a, "float32") for a in qkv(lq=24, lk=32))
    if route(prepare(q, k, v), None, None).path.guard:
        pytest.skip(f"the kernel on {backend.device_name} is guarded")

    def guarded(*args, **kwargs):
        raise AssertionError("the empty-row guard ran")

    monkeypatch.setattr(_native, "_visible_rows", guarded)
    m = np.ones((2, 1, 1, 32), dtype=bool)
    m[1] = False
    out = backend.to_numpy(scaled_dot_product_attention(q, k, v, mask=backend.asarray(m)))
    assert np.all(out[1] == 0)
    assert np.all(np.isfinite(out))


def _float_bound(backend, dtype, expected):
    """The largest error a `dtype` result may have against the float64 oracle `expected`."""
    if dtype in ("float16", "bfloat16"):
        return half_precision_bound(backend, expected, dtype)
    if dtype == "float32":
        return float32_error_bound(expected, length=9 + 8)
    return 1e-12


@pytest.mark.dtypes("float16", "bfloat16", "float32", "float64")
def test_a_sequence_without_keys_among_others_gives_zeros_and_zero_gradients(
    backend, xp, dtype, route
):
    """A length of 0 among ragged `kv_lengths`: that sequence's rows see no key.

    The library's empty row: zeros, with zero gradients. torch's default route runs
    SDPA once per sequence over its own keys; it gave that sequence ``value[0]`` on
    every row (the length clamped to one key) and sent its gradient to ``value[0]``.
    """
    lengths = np.array([4, 0, 9])
    q, k, v = (representable(backend, a, dtype) for a in qkv(batch=(3,)))
    rng = np.random.default_rng(3)
    cot = rng.standard_normal((3, 4, 6, 8))
    kv_lengths = backend.asarray(lengths)
    expected = reference_attention(q, k, v, kv_lengths=lengths)
    assert np.all(expected[1] == 0)

    def loss(q, k, v):
        out = scaled_dot_product_attention(q, k, v, kv_lengths=kv_lengths, **route.kw)
        return xp.sum(xp.astype(out, backend.dtype("float64")) * backend.asarray(cot))

    arrays = [backend.asarray(a, dtype) for a in (q, k, v)]
    out = scaled_dot_product_attention(*arrays, kv_lengths=kv_lengths, **route.kw)
    assert_backend_array(backend, out, shape=expected.shape, dtype=dtype)
    out = backend.to_numpy(out).astype(np.float64)
    assert np.all(out[1] == 0), np.abs(out[1]).max()
    err = float(np.abs(out - expected).max())
    assert err <= _float_bound(backend, dtype, expected), err
    if not backend.has_autodiff:
        return
    grads = [backend.to_numpy(g).astype(np.float64) for g in backend.grad(loss, *arrays)]
    for g in grads:
        assert np.all(g[1] == 0), np.abs(g[1]).max()  # the empty sequence: no gradient
        assert np.isfinite(g).all()
    if dtype == "float64":  # against the oracle's own gradient

        def loss_np(q, k, v):
            return float(np.sum(reference_attention(q, k, v, kv_lengths=lengths) * cot))

        for g, n in zip(grads, central_differences(loss_np, [q, k, v]), strict=True):
            np.testing.assert_allclose(g, n, atol=1e-7, rtol=1e-6)


_RANKS = {  # batch axes of Q, K, V and the mask's shape (None: no mask)
    "rank 3": ((), None),
    "rank 3, mask (H, Lq, Lk)": ((), (4, 6, 9)),
    "rank 4, mask (B, 1, Lq, Lk)": ((2,), (2, 1, 6, 9)),
    "rank 4, mask (Lq, Lk)": ((2,), (6, 9)),
    "rank 5, mask (B1, 1, 1, Lq, Lk)": ((2, 3), (2, 1, 1, 6, 9)),
    "rank 5, mask (B2, H, Lq, Lk)": ((2, 3), (3, 4, 6, 9)),
}


@pytest.mark.backends("torch", reason="torch's SDPA: its fused kernels take rank 4 only")
@pytest.mark.parametrize("name", list(_RANKS))
def test_sdpa_is_given_rank_4_whatever_the_batch_axes(backend, monkeypatch, name):
    """Rank 3 (a (H, L, D) call) or 5 reached torch's unfused math: 2.1x the time on a CPU."""
    import torch.nn.functional as F

    batch, mask_shape = _RANKS[name]
    q, k, v = qkv(batch=batch, lq=6, lk=9)
    kw = {}
    if mask_shape is not None:
        kw["mask"] = np.random.default_rng(3).random(mask_shape) < 0.7
        kw["mask"][..., 0] = True  # every row sees a key
    expected = reference_attention(q, k, v, **kw)
    given = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **options):
        given.append((query.ndim, key.ndim, value.ndim, getattr(attn_mask, "ndim", 2)))
        return sdpa(query, key, value, attn_mask=attn_mask, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    args = [backend.asarray(a) for a in (q, k, v)]
    kw = {n: backend.asarray(m) for n, m in kw.items()}
    for _ in range(2):  # the full route, then the cache's kept kernel call
        out = scaled_dot_product_attention(*args, implementation="native", **kw)
        assert_backend_array(backend, out)
        assert tuple(out.shape) == expected.shape
        np.testing.assert_allclose(backend.to_numpy(out), expected, atol=1e-12)
    assert given
    assert all(g[:3] == (4, 4, 4) and g[3] in (2, 4) for g in given), given


@pytest.mark.backends("torch", reason="torch's forward-mode AD")
@pytest.mark.parametrize("batch", [(), (2,)])
@pytest.mark.parametrize("how", ["forward_ad", "torch.func.jvp"])
def test_forward_mode_runs_sdpa_on_its_math_backend(backend, how, batch):
    """``implementation="native"`` in forward mode: SDPA's math backend, at every rank.

    Its fused CPU kernel has no forward-mode rule (it raises), at rank 4 too.
    """
    import torch
    import torch.autograd.forward_ad as forward_ad

    q, k, v = qkv(batch=batch, lq=6, lk=9)
    t = np.random.default_rng(9).standard_normal(q.shape)
    h = 1e-6
    ahead, behind = (reference_attention(q + s * h * t, k, v) for s in (1, -1))
    expected = (ahead - behind) / (2 * h)
    qb, kb, vb, tb = (backend.asarray(a) for a in (q, k, v, t))

    def f(x):
        return scaled_dot_product_attention(x, kb, vb, implementation="native")

    if how == "forward_ad":
        with forward_ad.dual_level():
            tangent = forward_ad.unpack_dual(f(forward_ad.make_dual(qb, tb))).tangent
    else:
        tangent = torch.func.jvp(f, (qb,), (tb,))[1]
    np.testing.assert_allclose(backend.to_numpy(tangent), expected, atol=1e-7)

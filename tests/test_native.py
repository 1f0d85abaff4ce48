"""implementation="native" and the default routing, against the portable path."""

from __future__ import annotations

import numpy as np
import pytest

from _reference import reference_attention
from portable_attn import scaled_dot_product_attention


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def qkv(batch=(2,), hq=4, hkv=2, lq=6, lk=9, d=8, dv=8):
    q, k = randn(*batch, hq, lq, d), randn(*batch, hkv, lk, d, seed=1)
    return q, k, randn(*batch, hkv, lk, dv, seed=2)


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


@pytest.mark.parametrize("name", list(COMBOS))
def test_native_matches_portable(backend, name):
    if backend.family not in ("torch", "jax"):
        pytest.skip(f"no native kernel for {backend.kind}")
    args, kw = build(backend, name)
    native = scaled_dot_product_attention(*args, implementation="native", **kw)
    portable = scaled_dot_product_attention(*args, implementation="portable", **kw)
    atol = tolerance(backend)
    np.testing.assert_allclose(backend.to_numpy(native), backend.to_numpy(portable), atol=atol)


def test_native_gradients_match_and_stay_finite(backend, xp):
    if backend.family not in ("torch", "jax"):
        pytest.skip(f"no native kernel for {backend.kind}")
    args, kw = build(backend, "fully masked rows")
    cot = backend.asarray(randn(2, 4, 6, 8, seed=5))

    def loss(impl):
        def f(q, k, v):
            out = scaled_dot_product_attention(q, k, v, implementation=impl, **kw)
            return xp.sum(out * cot)

        return f

    native = backend.grad(loss("native"), *args)
    portable = backend.grad(loss("portable"), *args)
    for n, p in zip(native, portable, strict=True):
        n = backend.to_numpy(n)
        assert np.all(np.isfinite(n))
        np.testing.assert_allclose(n, backend.to_numpy(p), atol=10 * tolerance(backend))


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


def test_jax_native_needs_equal_head_dims(backend):
    if backend.family != "jax":
        pytest.skip("jax only")
    args = [backend.asarray(a) for a in qkv(dv=5)]
    with pytest.raises(ValueError, match=r"`value` axis -1 \(Dv\) == `key` axis -1 \(Dk\).*Dv=5"):
        scaled_dot_product_attention(*args, implementation="native")


def test_bad_implementation(backend):
    args = [backend.asarray(a) for a in qkv()]
    with pytest.raises(ValueError, match="`implementation` must be None, 'portable' or 'native'"):
        scaled_dot_product_attention(*args, implementation="fast")


def test_default_routing(backend, monkeypatch):
    import portable_attn._attention as attention

    calls = []
    real = attention.native_attention
    monkeypatch.setattr(attention, "native_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v = (backend.asarray(a) for a in qkv(lq=9))
    scaled_dot_product_attention(q, k, v, is_causal=True)  # square causal, nothing else
    routed_plain = bool(calls)
    calls.clear()
    scaled_dot_product_attention(q, k, v, is_causal=True, bias=backend.asarray(randn(9, 9)))
    routed_bias = bool(calls)
    assert routed_plain == (backend.family == "torch")  # torch's fused kernel is faster on CPU
    assert not routed_bias  # masks and biases stay on the portable path by default


def test_native_takes_auto_block_size(backend, monkeypatch):
    """block_size="auto" leaves the choice to the library: "native" must not refuse it."""
    if backend.family not in ("torch", "jax"):
        pytest.skip("torch and JAX have native kernels")
    import portable_attn._attention as attention

    monkeypatch.setattr(attention, "AUTO_DENSE_LIMIT_BYTES", 0)  # "auto" would tile
    monkeypatch.setattr(attention, "AUTO_DENSE_LIMIT_BYTES_TORCH", 0)
    q, k, v = qkv(dv=8)
    args = [backend.asarray(a) for a in (q, k, v)]
    out = scaled_dot_product_attention(
        *args, is_causal=True, block_size="auto", implementation="native"
    )
    expected = reference_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=2e-6, rtol=1e-6)

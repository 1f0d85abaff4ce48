"""Repeated torch calls of Q, K, V and a mask make the kernel call alone (``_direct``)."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import qkv
from portable_attn import _attention, _direct, scaled_dot_product_attention
from portable_attn._lib import _policy

pytestmark = pytest.mark.backends("torch", reason="the direct kernel call is torch SDPA's")


@pytest.fixture
def routes(monkeypatch):
    """Count the calls that take the full route (prepare); hits are not re-checked."""
    monkeypatch.setattr(_policy, "CHECK_CACHED_PATHS", False)
    prepared = []
    prepare = _attention.prepare
    monkeypatch.setattr(
        _attention, "prepare", lambda *a, **k: prepared.append(1) or prepare(*a, **k)
    )
    return prepared


def _arrays(backend, dtype="float32", lq=20, lk=24, hkv=2, seed=0):
    return [backend.asarray(a, dtype) for a in qkv(lq=lq, lk=lk, hkv=hkv, dv=8, seed=seed)]


def _padding(backend, lk=24):
    keys = np.ones((2, 1, 1, lk), dtype=bool)
    keys[0, ..., -5:] = False
    keys[1] = False  # batch 1 sees no key: the kernel zeroes it
    return backend.asarray(keys)


@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        ({}, {}),
        ({"lq": 24}, {"is_causal": True}),
        ({}, {"mask": "padding"}),
        ({"hkv": 4}, {"scale": 0.3}),
    ],
    ids=["plain", "square causal", "padding mask", "scale, no GQA"],
)
def test_a_repeated_call_is_the_kernel_call_alone(backend, routes, shape, kw):
    if kw.get("mask") and backend.device_name != "cpu":
        pytest.skip("rows without keys are guarded around the kernel off the CPU")
    kw = {n: _padding(backend) if a == "padding" else a for n, a in kw.items()}
    first = scaled_dot_product_attention(*_arrays(backend, **shape), **kw)
    assert len(routes) == 1
    args = _arrays(backend, seed=1, **shape)  # new arrays of the same signature
    again = scaled_dot_product_attention(*args, **kw)
    assert len(routes) == 1  # no prepare, no path: the kept kernel call
    routed = scaled_dot_product_attention(*args, **kw, implementation="portable")
    np.testing.assert_allclose(backend.to_numpy(again), backend.to_numpy(routed), atol=1e-6)
    assert again.shape == first.shape
    assert again.dtype == first.dtype


@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        ({"lq": 20}, {"is_causal": True}),  # bottom-right causal: a band mask is built
        ({}, {"window": (4, 0)}),
        ({}, {"bias": "zeros"}),
        ({}, {"block_size": 8}),
        ({}, {"return_lse": True}),
        ({"lk": 9}, {}),  # fewer keys than NATIVE_MIN_KEYS: portable
    ],
    ids=["causal Lq<Lk", "window", "bias", "block_size", "return_lse", "few keys"],
)
def test_calls_the_kernel_does_not_take_as_they_are_take_the_route(backend, routes, shape, kw):
    kw = {n: backend.asarray(np.zeros((20, 24))) if a == "zeros" else a for n, a in kw.items()}
    for seed in (0, 1):
        scaled_dot_product_attention(*_arrays(backend, seed=seed, **shape), **kw)
    assert len(routes) == 2


def test_another_signature_takes_the_route(backend, routes):
    q, k, v = _arrays(backend)
    scaled_dot_product_attention(q, k, v)
    scaled_dot_product_attention(q, k, v, is_causal=False)  # the same signature
    assert len(routes) == 1
    scaled_dot_product_attention(q[:, :, :10], k, v)  # another shape
    scaled_dot_product_attention(q, k, v, scale=0.5)  # another scale
    scaled_dot_product_attention(q, k, v, mask=_padding(backend))  # a mask
    scaled_dot_product_attention(*_arrays(backend, "float64"))  # another dtype
    assert len(routes) == 5


def test_an_invalid_call_after_a_kept_one_still_raises(backend, routes):
    q, k, v = _arrays(backend)
    for _ in range(2):  # kept
        scaled_dot_product_attention(q, k, v, scale=0.5, is_causal=False)
    assert len(routes) == 1
    with pytest.raises(ValueError, match="`scale`"):
        scaled_dot_product_attention(q, k, v, scale=-0.5)
    with pytest.raises(TypeError, match="is_causal"):  # 0 == False, not a flag
        scaled_dot_product_attention(q, k, v, scale=0.5, is_causal=0)
    with pytest.raises(TypeError, match="block_size"):  # True == 1
        scaled_dot_product_attention(q, k, v, scale=0.5, block_size=True)
    with pytest.raises(ValueError, match="`mask`"):
        scaled_dot_product_attention(q, k, v, mask=backend.asarray(np.ones((3, 24), bool)))


def test_two_d_key_and_value_beside_three_d_queries(backend, routes):
    """K and V given as (Lk, D) get a head axis on the route: never the kernel call alone."""
    q = backend.asarray(np.random.default_rng(0).standard_normal((4, 20, 8)), "float32")
    k, v = (
        backend.asarray(np.random.default_rng(s).standard_normal((24, 8)), "float32")
        for s in (1, 2)
    )
    first = scaled_dot_product_attention(q, k, v)
    again = scaled_dot_product_attention(q, k, v)
    assert len(routes) == 2
    np.testing.assert_array_equal(backend.to_numpy(again), backend.to_numpy(first))


def test_the_result_keeps_the_inputs_dtype_under_autocast(backend, routes):
    import torch

    if backend.device_name != "cpu":
        pytest.skip("CPU autocast")
    q, k, v = _arrays(backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = scaled_dot_product_attention(q, k, v)
        again = scaled_dot_product_attention(q, k, v)
    assert len(routes) == 1
    assert first.dtype == again.dtype == torch.float32


def test_a_policy_change_after_a_kept_call_is_caught(backend, monkeypatch):
    """With CHECK_CACHED_PATHS (the tests' setting) a kept kernel call is checked."""
    from portable_attn._lib._compat import device_kind

    q, k, v = _arrays(backend)
    scaled_dot_product_attention(q, k, v)
    monkeypatch.setattr(_policy, "NATIVE_MIN_KEYS", {("torch", device_kind(q)): 10**9})
    _policy.forget_paths()  # the route now says portable: the kept kernel call is stale
    with pytest.raises(AssertionError, match=r"forget\(\)"):
        scaled_dot_product_attention(q, k, v)
    _direct.forget()
    scaled_dot_product_attention(q, k, v)
    assert not _direct._KERNELS

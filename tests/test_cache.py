"""The one cache in front of the route (``portable_attn._lib._cache``).

A repeated call of one signature skips the static checks, the plan and the router;
a torch call whose arrays go to SDPA as they are is the kernel call alone; an eager
JAX call reuses its compiled program. Every hit in the suite is also checked against
a fresh derivation (``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _helpers import qkv, set_kernels, set_rows
from portable_attn import scaled_dot_product_attention
from portable_attn._lib import _cache, _call, _route
from portable_attn._lib._dense import DenseKernel
from portable_attn._paths._native import DirectKernel
from portable_attn.testing import reference_attention


@pytest.fixture
def derived(monkeypatch, _cache_checked):
    """Count the calls that take the full route (the static checks and the plan).

    The hits are not derived again (the suite's check, ``_cache_checked``, would).
    """
    monkeypatch.setattr(_cache, "entry_for", _cache_checked)
    seen = []
    checked = _call._checked_static
    monkeypatch.setattr(
        _call, "_checked_static", lambda *a, **k: seen.append(1) or checked(*a, **k)
    )
    return seen


@pytest.fixture
def routed(monkeypatch, _cache_checked):
    """Count the router's decisions (hits not derived again)."""
    monkeypatch.setattr(_cache, "entry_for", _cache_checked)
    seen = []
    route = _route.route
    monkeypatch.setattr(_route, "route", lambda *a, **k: seen.append(1) or route(*a, **k))
    return seen


def _arrays(backend, dtype="float32", lq=20, lk=24, hkv=2, seed=0):
    return [backend.asarray(a, dtype) for a in qkv(lq=lq, lk=lk, hkv=hkv, dv=8, seed=seed)]


def _padding(backend, lk=24):
    keys = np.ones((2, 1, 1, lk), dtype=bool)
    keys[0, ..., -5:] = False
    keys[1] = False  # batch 1 sees no key
    return backend.asarray(keys)


@pytest.mark.skip_backends("dask", reason="a graph per call: nothing to save")
@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        ({}, {}),
        ({"lq": 24}, {"is_causal": True}),
        ({}, {"mask": "padding"}),
        ({"hkv": 4}, {"scale": 0.3, "window": (3, 1)}),
    ],
    ids=["plain", "square causal", "padding mask", "scale, window"],
)
def test_a_repeated_call_replays_the_decision(backend, derived, routed, shape, kw):
    kw = {n: _padding(backend) if a == "padding" else a for n, a in kw.items()}
    first = scaled_dot_product_attention(*_arrays(backend, **shape), **kw)
    assert len(derived) == len(routed) == 1
    args = _arrays(backend, seed=1, **shape)  # new arrays of the same signature
    again = scaled_dot_product_attention(*args, **kw)
    assert len(derived) == len(routed) == 1  # no checks, no plan, no route
    portable = scaled_dot_product_attention(*args, **kw, implementation="portable")
    np.testing.assert_allclose(backend.to_numpy(again), backend.to_numpy(portable), atol=1e-6)
    assert again.shape == first.shape
    assert again.dtype == first.dtype


def test_another_signature_is_derived(backend, derived):
    q, k, v = _arrays(backend)
    scaled_dot_product_attention(q, k, v)
    scaled_dot_product_attention(q, k, v, is_causal=False)  # the same signature
    assert len(derived) == 1
    scaled_dot_product_attention(q[:, :, :10, :], k, v)  # another shape
    scaled_dot_product_attention(q, k, v, scale=0.5)  # another scale
    scaled_dot_product_attention(q, k, v, mask=_padding(backend))  # a mask
    scaled_dot_product_attention(*_arrays(backend, "float64"))  # another dtype
    assert len(derived) == 5


def test_an_invalid_call_after_a_kept_one_still_raises(backend):
    q, k, v = _arrays(backend)
    for _ in range(2):  # kept
        scaled_dot_product_attention(q, k, v, scale=0.5, is_causal=False)
    with pytest.raises(ValueError, match="`scale`"):
        scaled_dot_product_attention(q, k, v, scale=-0.5)
    with pytest.raises(TypeError, match="is_causal"):  # 0 == False, not a flag
        scaled_dot_product_attention(q, k, v, scale=0.5, is_causal=0)
    with pytest.raises(TypeError, match="block_size"):  # True == 1
        scaled_dot_product_attention(q, k, v, scale=0.5, block_size=True)
    scaled_dot_product_attention(q, k, v, window=(1, 2))
    with pytest.raises(TypeError, match="window"):  # (True, 2) == (1, 2)
        scaled_dot_product_attention(q, k, v, window=(True, 2))
    with pytest.raises(ValueError, match="`mask`"):
        scaled_dot_product_attention(q, k, v, mask=backend.asarray(np.ones((3, 24), bool)))


@pytest.mark.kinds("numpy", "torch", reason="lengths read on the host")
def test_a_route_that_reads_host_values_is_decided_per_call(backend, derived, routed):
    q, k, v = _arrays(backend, lk=40)
    lengths = (40, 30, 12)  # the keys past the largest length are cut (rule 0)
    outs = [
        scaled_dot_product_attention(q, k, v, kv_lengths=backend.asarray(np.array([n, n // 2])))
        for n in lengths
    ]
    assert len(derived) == 1  # the checks and the plan once
    assert len(routed) == 3  # the route every call
    for n, out in zip(lengths, outs, strict=True):
        want = scaled_dot_product_attention(q, k[..., :n, :], v[..., :n, :])
        np.testing.assert_allclose(
            backend.to_numpy(out)[0], backend.to_numpy(want)[0], rtol=1e-5, atol=1e-6
        )


@pytest.mark.backends("torch", reason="the kept kernel call is torch SDPA's")
def test_a_repeated_torch_call_is_the_kernel_call_alone(backend, monkeypatch):
    import torch.nn.functional as F

    if backend.device_name != "cpu":
        pytest.skip("rows without keys are guarded around the kernel off the CPU")
    args = _arrays(backend, lq=24)
    scaled_dot_product_attention(*args, is_causal=True, mask=None)
    (entry,) = _cache._ENTRIES.values()
    assert entry.kept is not None
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or sdpa(*a, **k)
    )
    monkeypatch.setattr(_call, "prepare", None)  # a hit with a kept kernel call prepares nothing
    scaled_dot_product_attention(*args, is_causal=True)
    assert calls == [
        {"attn_mask": None, "is_causal": True, "scale": entry.kept.scale, "enable_gqa": True}
    ]


@pytest.mark.backends("torch", reason="the kept kernel call is torch SDPA's")
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
def test_calls_the_kernel_does_not_take_as_they_are_keep_no_kernel_call(
    backend, monkeypatch, shape, kw
):
    kw = {n: backend.asarray(np.zeros((20, 24))) if a == "zeros" else a for n, a in kw.items()}
    arrays = _arrays(backend, **shape)
    set_kernels(monkeypatch, "torch", min_keys=_route.SDPA_CPU.min_keys)  # on every device
    scaled_dot_product_attention(*arrays, **kw)
    (entry,) = _cache._ENTRIES.values()
    assert not isinstance(entry.kept, DirectKernel)  # "few keys": the dense path's call


@pytest.mark.backends("torch", reason="the kept kernel call is torch SDPA's")
def test_two_d_key_and_value_beside_three_d_queries(backend):
    """K and V given as (Lk, D) get a head axis on the route: never the kernel call alone."""
    q = backend.asarray(np.random.default_rng(0).standard_normal((4, 20, 8)), "float32")
    k, v = (
        backend.asarray(np.random.default_rng(s).standard_normal((24, 8)), "float32")
        for s in (1, 2)
    )
    first = scaled_dot_product_attention(q, k, v)
    again = scaled_dot_product_attention(q, k, v)
    (entry,) = _cache._ENTRIES.values()
    assert entry.kept is None
    np.testing.assert_array_equal(backend.to_numpy(again), backend.to_numpy(first))


@pytest.mark.backends("torch", reason="CPU autocast")
def test_the_result_keeps_the_inputs_dtype_under_autocast(backend):
    import torch

    if backend.device_name != "cpu":
        pytest.skip("CPU autocast")
    q, k, v = _arrays(backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = scaled_dot_product_attention(q, k, v)
        again = scaled_dot_product_attention(q, k, v)
    assert first.dtype == again.dtype == torch.float32


@pytest.mark.skip_backends("dask", reason="batch_invariant takes one device's arrays")
@pytest.mark.parametrize("mask_mod", [None, lambda b, h, q, k: q >= k], ids=["plain", "rule"])
def test_the_batch_invariant_route_is_compiled_where_the_row_says(backend, derived, mask_mod):
    # the paged walk of the single call, like every route, runs as one program on a
    # library that compiles eager calls, but with a user function (the program keeps it)
    q, k, v = _arrays(backend)
    out = scaled_dot_product_attention(q, k, v, batch_invariant=True, mask_mod=mask_mod)
    (entry,) = _cache._ENTRIES.values()
    expected = _route.runs_compiled(_route.library(q), user_functions=mask_mod is not None)
    assert entry.route.compiled == expected
    assert (entry.kept is not None) == expected
    reference = reference_attention(*(backend.to_numpy(x) for x in (q, k, v)))
    if mask_mod is None:
        np.testing.assert_allclose(backend.to_numpy(out), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.backends("jax", reason="eager JAX calls run one compiled program")
def test_an_eager_jax_call_keeps_its_compiled_program(backend, derived):
    q, k, v = _arrays(backend)
    scaled_dot_product_attention(q, k, v)
    (entry,) = _cache._ENTRIES.values()
    assert entry.route.compiled
    assert entry.kept is not None
    program = entry.kept
    scaled_dot_product_attention(*_arrays(backend, seed=1))
    assert _cache._ENTRIES[next(iter(_cache._ENTRIES))].kept is program
    assert len(derived) == 1


@pytest.mark.skip_backends("dask", reason="a graph per call: nothing to save")
def test_a_router_change_without_forget_is_caught(backend, monkeypatch):
    """The suite's check (conftest) derives each hit afresh: a stale entry fails the test."""
    q, k, v = _arrays(backend)
    scaled_dot_product_attention(q, k, v)
    row = _route.library(q)  # no native kernel, no dense path: the tiled path now
    tiled = dataclasses.replace(row, dense_limit=0, kernels=())
    monkeypatch.setitem(_route.LIBRARIES, _route.row_key(q), tiled)
    with pytest.raises(AssertionError, match="cache hit"):
        scaled_dot_product_attention(q, k, v)
    _cache.forget()
    scaled_dot_product_attention(q, k, v)  # derived again under the new setting


def _dense_route(monkeypatch, backend):
    """Send every call of `backend`'s library to the portable paths (no kernel)."""
    set_rows(monkeypatch, "torch", kernels=())


@pytest.mark.skip_backends("dask", reason="a graph per call: nothing to save")
@pytest.mark.skip_backends("jax", reason="an eager JAX call keeps its compiled program")
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_a_repeated_dense_call_is_the_dense_path_alone(backend, monkeypatch, masked):
    """A call the dense path takes as it is keeps that call: a hit prepares nothing."""
    _dense_route(monkeypatch, backend)
    q, k, v = _arrays(backend, lk=24)
    keys = np.ones((2, 1, 20, 24), dtype=bool)
    keys[0, ..., -5:] = False
    keys[1, :, 3] = False  # a row that sees no key
    mask = backend.asarray(keys) if masked else None
    first = scaled_dot_product_attention(q, k, v, mask=mask)  # a miss: every check
    (entry,) = _cache._ENTRIES.values()
    assert isinstance(entry.kept, DenseKernel)
    monkeypatch.setattr(_call, "prepare", None)  # the hit gathers nothing again
    again = scaled_dot_product_attention(q, k, v, mask=mask)
    assert np.array_equal(backend.to_numpy(again), backend.to_numpy(first))
    want = reference_attention(
        *(backend.to_numpy(x) for x in (q, k, v)), mask=keys if masked else None
    )
    np.testing.assert_allclose(backend.to_numpy(again), want, rtol=1e-5, atol=1e-6)


@pytest.mark.skip_backends("dask", reason="a graph per call: nothing to save")
@pytest.mark.skip_backends("jax", reason="an eager JAX call keeps its compiled program")
@pytest.mark.parametrize(
    ("dtype", "kw"),
    [
        ("float16", {}),  # cast to float32 first, and the result back
        ("float32", {"bias": "zeros"}),
        ("float32", {"mask": "1-d"}),  # given a dimension by the call
        ("float32", {"kv_lengths": "lengths"}),
        ("float32", {"return_lse": True}),
    ],
    ids=["half", "bias", "1-d mask", "lengths", "return_lse"],
)
def test_dense_calls_the_path_does_not_take_as_they_are_keep_no_call(
    backend, monkeypatch, dtype, kw
):
    _dense_route(monkeypatch, backend)
    if dtype == "float16" and backend.family == "array_api_strict":
        pytest.skip("array-api-strict has no float16")
    given = {
        "zeros": np.zeros((20, 24), np.float32),
        "1-d": np.arange(24) < 20,
        "lengths": np.array([24, 10]),
    }
    kw = {n: backend.asarray(given[a]) if a in given else a for n, a in kw.items()}
    scaled_dot_product_attention(*_arrays(backend, dtype), **kw)
    (entry,) = _cache._ENTRIES.values()
    assert not isinstance(entry.kept, DenseKernel)

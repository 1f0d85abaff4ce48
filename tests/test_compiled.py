"""Compiled programs: eager JAX calls run their path as one, kept per call signature;
``torch.compile`` traces a call into one graph."""

from __future__ import annotations

import pytest

from _helpers import assert_close, qkv
from portable_attn import _paths, scaled_dot_product_attention
from portable_attn.testing import reference_attention

jax_only = pytest.mark.backends("jax", reason="eager JAX calls compile their path")


@pytest.fixture
def programs(monkeypatch, _cache_checked):
    """The programs compiled (hits not derived again: the suite's check would compile)."""
    from portable_attn._lib import _cache

    monkeypatch.setattr(_cache, "entry_for", _cache_checked)
    made = []
    compiled = _paths.program
    monkeypatch.setattr(_paths, "program", lambda *a: made.append(1) or compiled(*a))
    return made


@jax_only
def test_an_eager_call_compiles_once_per_signature(backend, programs):
    q, k, v = qkv(lq=6, lk=9)
    arrays = [backend.asarray(a) for a in (q, k, v)]
    for _ in range(3):
        out = scaled_dot_product_attention(*arrays, is_causal=True)
    assert len(programs) == 1
    assert_close(backend, out, reference_attention(q, k, v, is_causal=True))
    scaled_dot_product_attention(*arrays, is_causal=True, window=(2, 0))  # another signature
    scaled_dot_product_attention(*arrays[:2], arrays[2][..., :3])  # another shape
    assert len(programs) == 3


@jax_only
def test_user_functions_run_eagerly_every_call(backend, programs):
    """A score_mod may close over values that change between calls: never compiled in."""
    q, k, v = qkv(lq=6, lk=9)
    arrays = [backend.asarray(a) for a in (q, k, v)]
    shift = {"by": 0.0}

    def mod(s, b, h, i, j):
        return s - shift["by"] * abs(i - j)

    for by in (0.0, 0.5):
        shift["by"] = by
        out = scaled_dot_product_attention(*arrays, score_mod=mod)
        expected = reference_attention(
            q, k, v, score_mod=lambda s, b, h, i, j, by=by: s - by * abs(i - j)
        )
        assert_close(backend, out, expected)
    assert programs == []


@jax_only
def test_grad_and_vmap_of_eager_calls_run_the_program_too(backend, programs):
    """Under an eager ``jax.grad`` (or ``vmap``) the path is one program, not one per
    operation of its backward (378 tiny programs for one gradient, before)."""
    import jax

    q, k, v = (backend.asarray(a) for a in qkv(lq=6, lk=9))
    eager = jax.grad(lambda q: scaled_dot_product_attention(q, k, v, block_size=2).sum())(q)
    jitted = jax.jit(
        jax.grad(lambda q: scaled_dot_product_attention(q, k, v, block_size=2).sum())
    )(q)
    assert_close(backend, eager, jitted, rtol=1e-12, atol=1e-13)
    assert len(programs) >= 1


@pytest.mark.backends("torch", reason="torch.compile")
@pytest.mark.dtypes("float16", "bfloat16", "float32")
@pytest.mark.parametrize("block_size", [None, "dense"], ids=["native", "dense"])
def test_torch_compile_traces_one_graph_in_every_float_dtype(backend, dtype, block_size):
    """``fullgraph=True`` for half inputs too: a graph break is an error there.

    Half inputs broke the graph twice: the result dtype was asked of array-api-compat,
    which asks ``torch.result_type`` (an operation returning a dtype) for float16 and
    bfloat16, and float16's route read ``/proc/cpuinfo`` inside the trace. 32 keys:
    the default call is SDPA (the route that reads the CPU's flags) or the dense path.
    """
    import torch

    q, k, v = (backend.asarray(a, dtype) for a in qkv(lq=8, lk=32))

    def f(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, block_size=block_size)

    compiled = torch.compile(f, fullgraph=True, backend="eager")  # dynamo alone: no codegen
    out = compiled(q, k, v)
    assert out.dtype == backend.dtype(dtype)
    torch.testing.assert_close(out, f(q, k, v), rtol=0, atol=0)

"""JAX's tiled path as a traced loop (``_paths/_loop.py``): exact, skipping, O(1) in blocks.

Here: the loop against the Python loop that every other library runs (every
feature, values, lse and gradients), the visited key blocks against the band, the
size of the program and of its buffers against the number of blocks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from _helpers import qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._call import prepare
from portable_attn._lib._path import Route, Tiled
from portable_attn._paths import run
from portable_attn._paths._loop import _Grid, _states
from portable_attn.testing import structure

pytestmark = pytest.mark.kinds("jax", reason="the traced loop is JAX's")

FEATURES = {
    "plain": lambda lq, lk: {},
    "causal_window": lambda lq, lk: {"is_causal": True, "window": (5, 2)},
    "mask_bias": lambda lq, lk: {
        "mask": np.random.default_rng(1).random((lq, lk)) < 0.7,
        "bias": randn(4, lq, lk, seed=2),
    },
    "lengths": lambda lq, lk: {
        "q_lengths": np.array([lq, lq // 2]),
        "kv_lengths": np.array([lk - 3, 4]),
        "is_causal": True,
    },
    "alibi_softcap_sinks": lambda lq, lk: {
        "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
        "softcap": 3.0,
        "sinks": np.array([0.5, -1.0, 0.0, 2.0]),
    },
    "segments_dropout": lambda lq, lk: {
        "q_segment_ids": np.array([[0] * (lq // 2) + [1] * (lq - lq // 2)] * 2),
        "kv_segment_ids": np.array([[0] * (lk // 3) + [1] * (lk - lk // 3)] * 2),
        "dropout_p": 0.25,
        "dropout_mask": np.random.default_rng(3).random((2, 4, lq, lk)) > 0.25,
    },
}


def _jax(kw):
    import jax.numpy as jnp

    return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("tiles", [(4, 5), (13, 2)])
def test_the_loop_equals_the_python_loop(backend, name, tiles):
    """Output, lse and every gradient, bit-close to the unrolled tiled path."""
    import jax
    import jax.numpy as jnp

    q, k, v = qkv(backend=backend, lq=13, lk=19)
    kw = _jax(FEATURES[name](13, 19))
    bias = kw.pop("bias", None)

    def attend(loop):
        def f(q, k, v, bias):
            call = prepare(q, k, v, bias=bias, **kw)
            walk = "loop" if loop else "python"
            route = Route(Tiled(*tiles, walk=walk, backward="jax"))
            out, lse = run(call, route, with_lse=True)
            return out, lse

        return f

    def loss(loop):
        def f(q, k, v, bias):
            out, lse = attend(loop)(q, k, v, bias)
            return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

        return f

    got = jax.jit(attend(True))(q, k, v, bias)
    want = jax.jit(attend(False))(q, k, v, bias)  # one program each (eagerly: one per op)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-12, rtol=1e-10)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    got = jax.jit(jax.grad(loss(True), argnums=argnums))(q, k, v, bias)
    want = jax.jit(jax.grad(loss(False), argnums=argnums))(q, k, v, bias)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-11, rtol=1e-9)


def _visited(call, bq, bk):
    """(nq, nk) bool: the block pairs the traced loop visits (its pair states, not SKIP)."""
    arrays, skeleton = call.flatten()
    grid = _Grid(bq, bk, call.plan.q_len, call.plan.kv_len)
    return np.asarray(_states(skeleton, arrays, grid)) != 0


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (0, 4), (7, 7)])
@pytest.mark.parametrize(("lq", "lk"), [(13, 19), (19, 13), (16, 16)])
def test_the_loop_visits_exactly_the_pairs_the_band_shows(is_causal, window, lq, lk):
    q, k, v = qkv(lq=lq, lk=lk)
    call = prepare(q, k, v, is_causal=is_causal, window=window)
    visited = _visited(call, 4, 5)
    band = structure(lq, lk, is_causal=is_causal, window=window)
    for i, j in itertools.product(range(visited.shape[0]), range(visited.shape[1])):
        shown = band[4 * i : 4 * i + 4, 5 * j : 5 * j + 5].any()
        assert visited[i, j] == shown, (i, j)


def test_lengths_narrow_the_visited_key_blocks():
    q, k, v = qkv(lq=13, lk=19)
    call = prepare(q, k, v, kv_lengths=np.array([6, 9]), q_lengths=np.array([4, 8]))
    rows = _visited(call, 4, 5)
    assert [np.flatnonzero(r).tolist() for r in rows] == [[0, 1]] * 2 + [[]] * 2


@pytest.fixture
def always_loop(monkeypatch):
    """The traced loop for every tiled JAX call, however short."""
    from portable_attn._lib import _cache, _route

    monkeypatch.setattr(_route, "LOOP_MIN_SCORE_BYTES", 0)
    _cache.forget()
    return _route


def _forget():
    from portable_attn._lib import _cache

    _cache.forget()


def _lowered(length, block, grad):
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((1, 2, length, 8), jnp.float32)

    def f(x):
        return scaled_dot_product_attention(x, x, x, is_causal=True, block_size=block).sum()

    return jax.jit(jax.grad(f) if grad else f).lower(x)


def _program(length, block, grad):
    return _lowered(length, block, grad).compile()


def _ops(length, block, grad):
    return _lowered(length, block, grad).as_text().count("\n")  # StableHLO lines


@pytest.mark.parametrize("grad", [False, True])
def test_the_program_does_not_grow_with_the_number_of_blocks(
    backend, grad, always_loop, monkeypatch
):
    ops = [_ops(length, 16, grad) for length in (64, 256)]  # 4 and 16 blocks per axis
    assert abs(ops[1] - ops[0]) <= 2, ops  # one program (a constant's digits may differ)
    monkeypatch.setattr(always_loop, "LOOP_MIN_SCORE_BYTES", 2**62)  # the Python loop
    _forget()
    unrolled = [_ops(length, 16, grad) for length in (64, 256)]
    assert unrolled[1] > 2 * unrolled[0]  # the control: unrolled, it grows with the blocks


@pytest.mark.parametrize("grad", [False, True])
def test_the_buffers_do_not_grow_with_the_number_of_blocks(backend, grad, always_loop):
    """XLA's count of the compiled program's temporary bytes, blocks of 256 at L = 1024, 4096.

    Measured: 1.3 MiB forward and 3.6 MiB for the gradient at L = 4096, where the
    unrolled loop needed 76 and 155 MiB and the dense scores are 128 MiB.
    """
    temps = []
    for length in (1024, 4096):
        stats = _program(length, 256, grad).memory_analysis()
        if stats is None:
            pytest.skip("this JAX reports no memory analysis")
        temps.append(stats.temp_size_in_bytes)
    scores = 2 * 4096 * 4096 * 4  # the dense (H, L, L) float32 scores at L = 4096
    assert temps[1] < 2 * temps[0]  # 16 times the blocks, not twice the buffers
    assert temps[1] < scores / 16


def test_packed_documents_skip_each_others_blocks_by_value(backend):
    """Four documents of 4 in 16, ids as (traced) arrays: each query block sees its own."""
    import jax
    import jax.numpy as jnp

    ids = np.repeat(np.arange(4), 4)[None, :].repeat(2, axis=0)  # (B, 16)
    q, k, v = qkv(lq=16, lk=16)

    def states(ids):
        call = prepare(*(jnp.asarray(x) for x in (q, k, v)), q_segment_ids=ids)
        arrays, skeleton = call.flatten()
        return _states(skeleton, arrays, _Grid(4, 4, 16, 16))

    states = np.asarray(jax.jit(states)(jnp.asarray(ids)))  # the ids are traced values
    assert (states != 0).tolist() == np.eye(4, dtype=bool).tolist()  # each block with itself
    assert (states == 2).tolist() == np.eye(4, dtype=bool).tolist()  # in one document: full

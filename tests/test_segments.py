"""Packed sequences: `q_segment_ids` / `kv_segment_ids` (equal ids attend).

Equal to the same call with the explicit (B, 1, Lq, Lk) mask and to the oracle,
on every backend and path; AND-ed with causal, windows, lengths and GQA; one
array alone serves both sides; a query whose segment has no key is zeros; with
NumPy ids the tiled path skips the key blocks of other documents (and gets the
same result); bad ids get clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, check, qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._blocks import block_ranges, host_pair_states
from portable_attn._lib._call import prepare
from portable_attn.testing import reference_attention

problem = {"batch": (2,), "lq": 6, "lk": 9, "dk": 4, "dv": 3}  # GQA: Hq=4, Hkv=2
Q_IDS = np.array([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 5]])  # id 5: no key of its segment
KV_IDS = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2, 2]])


def explicit_mask(q_ids, kv_ids):
    return (q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :]  # (B, 1, Lq, Lk)


@pytest.mark.parametrize(
    "kw",
    [{}, {"is_causal": True}, {"window": (2, 0)}, {"kv_lengths": np.array([9, 5])}],
    ids=["plain", "causal", "window", "lengths"],
)
def test_equal_to_the_explicit_mask(backend, xp, route, kw):
    q, k, v = qkv(**problem)
    out, _ = check(backend, q, k, v, route=route, q_segment_ids=Q_IDS, kv_segment_ids=KV_IDS, **kw)
    masked, _ = check(backend, q, k, v, route=route, mask=explicit_mask(Q_IDS, KV_IDS), **kw)
    assert_close(backend, out, backend.to_numpy(masked))
    # the query of segment 5 sees no key: zeros
    assert np.all(backend.to_numpy(out)[1, :, 5, :] == 0.0)


@pytest.mark.parametrize("given", ["q_segment_ids", "kv_segment_ids"])
def test_one_array_serves_both_sides(backend, xp, given):
    q, k, v = qkv(batch=(2,), lq=7, lk=7, dk=4, dv=3)
    ids = np.array([[0, 0, 0, 1, 1, 2, 2], [3, 3, 3, 3, 4, 4, 4]])
    out, _ = check(backend, q, k, v, block_size=(3, 2), is_causal=True, **{given: ids})
    both, _ = check(backend, q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    assert_close(backend, out, backend.to_numpy(both))


def test_ids_without_a_batch_axis_broadcast(backend, xp):
    q, k, v = qkv(**problem)
    check(backend, q, k, v, block_size=(2, 3), q_segment_ids=Q_IDS[0], kv_segment_ids=KV_IDS[0])


@pytest.mark.backends("numpy", reason="host (NumPy) ids: block pairs skipped by value")
def test_host_ids_skip_the_blocks_of_other_documents(backend):
    ids = np.repeat(np.arange(4), 8)  # four documents of 8 tokens in a row of 32
    q, k, v = qkv(batch=(1,), lq=32, lk=32, dk=4, dv=4)
    call = prepare(q, k, v, is_causal=True, q_segment_ids=ids)
    blocks = block_ranges(32, 8)
    states = host_pair_states(call, blocks, blocks)
    visible = [
        (qr, kr) for i, qr in enumerate(blocks) for j, kr in enumerate(blocks) if states[i][j]
    ]
    assert visible == [(r, r) for r in blocks]  # only each document with itself
    check(backend, q, k, v, block_size=8, is_causal=True, q_segment_ids=ids)


@pytest.mark.backends("jax", reason="jax.jit: no skipping by value, ids traced")
def test_traced_ids_under_jit(backend):
    import jax

    q, k, v = qkv(backend=backend, **problem)
    f = jax.jit(
        lambda q, a, b: scaled_dot_product_attention(
            q, k, v, q_segment_ids=a, kv_segment_ids=b, block_size=(2, 3)
        )
    )
    out = f(q, backend.asarray(Q_IDS), backend.asarray(KV_IDS))
    eager = scaled_dot_product_attention(
        q, k, v, mask=backend.asarray(explicit_mask(Q_IDS, KV_IDS)), block_size=(2, 3)
    )
    assert_close(backend, out, eager, rtol=1e-12, atol=0)


@pytest.mark.autodiff
def test_gradients_match_the_explicit_mask(backend, xp):
    q, k, v = qkv(backend=backend, **problem)
    ids = {"q_segment_ids": backend.asarray(Q_IDS), "kv_segment_ids": backend.asarray(KV_IDS)}
    mask = backend.asarray(explicit_mask(Q_IDS, KV_IDS))

    def loss(**kw):
        def f(q, k, v):
            return xp.sum(scaled_dot_product_attention(q, k, v, block_size=(2, 3), **kw) ** 2)

        return f

    for a, b in zip(
        backend.grad(loss(**ids), q, k, v), backend.grad(loss(mask=mask), q, k, v), strict=True
    ):
        np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), atol=1e-12)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (
            {"q_segment_ids": Q_IDS.astype(np.float64)},
            TypeError,
            r"`q_segment_ids` must be an integer",
        ),
        (
            {"q_segment_ids": Q_IDS[:, :4]},
            ValueError,
            r"`q_segment_ids` must have shape \(\.\.\., Lq\) with Lq=6.*\(2, 4\)",
        ),
        ({"q_segment_ids": np.zeros((3, 6), np.int64)}, ValueError, r"`q_segment_ids`.*\(3, 6\)"),
        (
            {"kv_segment_ids": KV_IDS},
            ValueError,
            r"only `kv_segment_ids` was given.*Lq=6 and Lk=9",
        ),
    ],
    ids=["float", "length", "batch", "one-sided"],
)
def test_bad_ids(backend, xp, kw, error, match):
    q, k, v = (backend.asarray(a) for a in qkv(**problem))
    kw = {n: backend.asarray(a) for n, a in kw.items()}
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("dtypes", [("uint8", "int64"), ("int16", "int32")])
def test_ids_of_two_integer_dtypes(backend, xp, dtypes):
    q, k, v = qkv(**problem)
    a, b = (backend.asarray(x.astype(d)) for x, d in zip((Q_IDS, KV_IDS), dtypes, strict=True))
    out = scaled_dot_product_attention(
        *(backend.asarray(x) for x in (q, k, v)), q_segment_ids=a, kv_segment_ids=b, block_size=2
    )
    expected = reference_attention(q, k, v, q_segment_ids=Q_IDS, kv_segment_ids=KV_IDS)
    assert_close(backend, out, expected)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_under_jax_rank_promotion_raise(backend, xp, route):
    """With ``jax_numpy_rank_promotion="raise"`` calls with segment ids and lengths raised.

    Every part of a block's mask (the band (Lq, Lk), the ids (B, 1, Lq, Lk), the
    lengths) now has the logits' rank before they are combined; values and gradients.
    """
    import jax

    q, k, v = qkv(**problem)
    kw = {"q_segment_ids": Q_IDS, "kv_segment_ids": KV_IDS, "kv_lengths": np.array([9, 5])}
    kw_b = {name: backend.asarray(a) for name, a in kw.items()}
    cot = backend.asarray(randn(2, 4, 6, 3, seed=4))

    def loss(q, k, v):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, **kw_b, **route.kw)
        return xp.sum(out * cot)

    args = [backend.asarray(a) for a in (q, k, v)]
    with jax.numpy_rank_promotion("raise"):
        check(backend, q, k, v, route=route, is_causal=True, **kw)
        grads = backend.grad(loss, *args)
    for g, expected in zip(grads, backend.grad(loss, *args), strict=True):
        assert_close(backend, g, backend.to_numpy(expected))

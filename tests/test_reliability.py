"""Reliability regressions (issue 24): compiled gradients, integer dtypes, missing arrays.

- The dense path's row-max shift is not differentiated: under ``torch.compile``
  its backward gave NaN gradients with a mask (or lengths, or segment ids) plus a
  softcap. Checked compiled and eager, on the dense and the default path, against
  central differences of the float64 oracle; rows that see no key give zero
  values and zero gradients. JAX ``jit(grad)`` runs the same cases.
- Segment ids of two integer dtypes compare by value: ``uint64`` ``2**64 - 1`` does
  not match a signed ``-1``.
- Narrow integer lengths (int8) do not overflow ``Lk - q_len``.
- A required array given as None says "`query` must be an array, but got None" at
  every public entry point.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn import (
    apply_rope,
    attention_weights,
    init_mha_params,
    l2_normalize,
    merge_attention,
    multi_head_attention,
    rms_norm,
    scaled_dot_product_attention,
)
from portable_attn import diagnostics as diag
from portable_attn.jax_parallel import sequence_parallel_attention
from portable_attn.testing import central_differences, reference_attention

# ---------------------------------------------------------------------------
# compiled gradients of the dense path

Q = randn(2, 1, 5, 4, seed=10)  # (B, H, Lq, Dk)
K = randn(2, 1, 7, 4, seed=11)
V = randn(2, 1, 7, 3, seed=12)
COT = randn(2, 1, 5, 3, seed=13)  # the loss is sum(out * COT)
ROW_MASK = np.ones((5, 7), bool)
ROW_MASK[1] = False  # query 1 sees no key
BIAS = np.zeros((5, 7))
BIAS[2] = -np.inf  # query 2 sees no key
BIAS[3, :4] = -np.inf


def _minus_inf_row(scores, b, h, q_idx, kv_idx, *, xp):
    return xp.where(q_idx == 3, -xp.inf, scores)  # query 3 sees no key


#: name -> (keyword arguments as NumPy, compute dtype, the (batch, query) rows that see no key)
CASES = {
    "mask_softcap": ({"mask": ROW_MASK, "softcap": 2.0}, "float64", [(0, 1), (1, 1)]),
    "kv_lengths_softcap_f32": (
        {"kv_lengths": np.array([3, 0]), "softcap": 2.0},
        "float32",
        [(1, i) for i in range(5)],
    ),
    "segments_softcap": (
        {
            "q_segment_ids": np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 4]]),
            "kv_segment_ids": np.array([[0, 0, 0, 1, 1, 1, 3], [0, 0, 1, 1, 1, 1, 1]]),
            "softcap": 2.0,
        },
        "float64",
        [(0, 4), (1, 4)],
    ),
    "bias_inf_softcap": ({"bias": BIAS, "softcap": 2.0}, "float64", [(0, 2), (1, 2)]),
    "score_mod_inf": ({"score_mod": _minus_inf_row, "softcap": 2.0}, "float64", [(0, 3), (1, 3)]),
    "alibi_huge_slope": ({"alibi_slopes": np.array([1e30]), "softcap": 2.0}, "float64", []),
    "window_q_lengths": ({"window": (1, 0), "q_lengths": np.array([5, 2])}, "float64", []),
    "sinks_mask": (
        {"sinks": np.array([0.5]), "mask": ROW_MASK, "softcap": 2.0},
        "float64",
        [],  # the sink is visible to every row: query 1 gives zeros, its gradient is zero
    ),
    "dropout_mask": (
        {
            "dropout_p": 0.5,
            "dropout_mask": np.random.default_rng(14).random((2, 1, 5, 7)) < 0.5,
            "mask": ROW_MASK,
        },
        "float64",
        [(0, 1), (1, 1)],
    ),
}
TORCH_CASES = ["mask_softcap", "kv_lengths_softcap_f32", "segments_softcap"]  # compiling is slow


def _kwargs(backend, name):
    kw, dtype, empty = CASES[name]
    kw = dict(kw)
    if "score_mod" in kw:
        xp = backend.xp

        def score_mod(*a):
            return _minus_inf_row(*a, xp=xp)

        kw["score_mod"] = score_mod
    on = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    for n in ("bias", "alibi_slopes", "sinks"):
        if n in on:
            on[n] = backend.asarray(kw[n], dtype)
    ref = dict(CASES[name][0])
    if "score_mod" in ref:
        ref["score_mod"] = lambda *a: _minus_inf_row(*a, xp=np)
    return on, ref, dtype, empty


def _loss(backend, kw, block_size, dtype):
    xp = backend.xp
    k, v, cot = (backend.asarray(a, dtype) for a in (K, V, COT))

    def loss(q):
        out = scaled_dot_product_attention(q, k, v, block_size=block_size, **kw)
        return xp.sum(out * cot)

    return loss


def _compiled_grad(backend, loss, q):
    if backend.family == "torch":
        import torch

        torch._dynamo.reset()  # a fresh compile for every case
        leaf = q.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(torch.compile(loss, fullgraph=False)(leaf), leaf)
        return g
    import jax

    return jax.jit(jax.grad(loss))(q)


def _check_gradients(backend, name, block_size):
    kw, ref_kw, dtype, empty = _kwargs(backend, name)
    loss = _loss(backend, kw, block_size, dtype)
    q = backend.asarray(Q, dtype)
    (eager,) = backend.grad(loss, q)
    compiled = _compiled_grad(backend, loss, q)

    def oracle(q):
        return float(np.sum(reference_attention(q, K, V, **ref_kw) * COT))

    (numeric,) = central_differences(oracle, [Q])
    tol = {"atol": 1e-7, "rtol": 1e-6} if dtype == "float64" else {"atol": 2e-4, "rtol": 2e-4}
    for how, g in (("eager", eager), ("compiled", compiled)):
        g = backend.to_numpy(g).astype(np.float64)
        assert np.isfinite(g).all(), f"{how} gradient has NaN/inf: {g}"
        np.testing.assert_allclose(g, numeric, err_msg=how, **tol)
        for b, i in empty:  # rows that see no key: zero gradient, exactly
            assert (g[b, :, i] == 0).all(), (how, b, i, g[b, :, i])
    out = backend.to_numpy(
        scaled_dot_product_attention(
            q, *(backend.asarray(a, dtype) for a in (K, V)), block_size=block_size, **kw
        )
    )
    for b, i in empty:  # ... and zero values
        assert (out[b, :, i] == 0).all(), (b, i, out[b, :, i])


@pytest.mark.backends("torch", reason="torch.compile")
@pytest.mark.main_kinds
@pytest.mark.parametrize("block_size", ["dense", None], ids=["dense", "default"])
@pytest.mark.parametrize("name", TORCH_CASES)
def test_torch_compile_gradients_finite_and_exact(backend, name, block_size):
    _check_gradients(backend, name, block_size)


@pytest.mark.backends("jax", reason="jax.jit(jax.grad)")
@pytest.mark.main_kinds
@pytest.mark.parametrize("block_size", ["dense", None], ids=["dense", "default"])
@pytest.mark.parametrize("name", list(CASES))
def test_jax_jit_grad_finite_and_exact(backend, name, block_size):
    _check_gradients(backend, name, block_size)


# ---------------------------------------------------------------------------
# segment ids of two integer dtypes

SEG_Q = randn(1, 1, 4, 3, seed=20)
SEG_K = randn(1, 1, 5, 3, seed=21)
SEG_V = randn(1, 1, 5, 2, seed=22)

#: (q dtype, q ids, kv dtype, kv ids): unsigned maxima next to signed negatives
ID_PAIRS = [
    ("uint64", [2**64 - 1, 0, 2**63, 7], "int64", [-1, 0, -(2**63), 7, 7]),
    ("int64", [-1, 0, -(2**63), 7], "uint64", [2**64 - 1, 0, 2**63, 7, 7]),
    ("uint64", [2**64 - 1, 5, 3, 3], "int8", [-1, 5, 5, 3, -1]),
    ("uint8", [255, 0, 1, 1], "int8", [-1, 0, 1, -1, 1]),
    ("uint32", [2**32 - 1, 0, 2, 2], "int64", [-1, 2**32 - 1, 0, 2, 2]),
    ("uint16", [2**16 - 1, 0, 0, 1], "int16", [-1, -1, 0, 1, 1]),
]


def _same_ids(q_ids, kv_ids):
    """The allowed mask (Lq, Lk), compared as Python integers."""
    return np.array([[a == b for b in kv_ids] for a in q_ids])


@pytest.mark.parametrize("pair", ID_PAIRS, ids=[f"{p[0]}-{p[2]}" for p in ID_PAIRS])
def test_segment_ids_of_two_dtypes_compare_by_value(backend, pair, route):
    q_dtype, q_ids, kv_dtype, kv_ids = pair
    a = backend.asarray(np.array([q_ids], dtype=q_dtype))
    b = backend.asarray(np.array([kv_ids], dtype=kv_dtype))
    q, k, v = (backend.asarray(x) for x in (SEG_Q, SEG_K, SEG_V))
    out = scaled_dot_product_attention(q, k, v, q_segment_ids=a, kv_segment_ids=b, **route.kw)
    allowed = _same_ids(q_ids, kv_ids)
    assert_close(backend, out, reference_attention(SEG_Q, SEG_K, SEG_V, mask=allowed))
    w = attention_weights(q, k, q_segment_ids=a, kv_segment_ids=b)
    assert (backend.to_numpy(w)[0, 0][~allowed] == 0).all()


#: JAX without x64 compares in int32: uint32 ids past 2**31 - 1 wrap there
NARROW_PAIRS = [
    ("uint32", [2**32 - 1, 2**31, 0, 3], "int32", [-1, -(2**31), 0, 3]),
    ("int8", [-1, -128, 0, 3], "uint32", [2**32 - 1, 2**31, 0, 3]),
    ("uint32", [2**32 - 1, 255, 0, 3], "uint8", [255, 0, 3, 0]),
]


@pytest.mark.parametrize("pair", NARROW_PAIRS, ids=[f"{p[0]}-{p[2]}" for p in NARROW_PAIRS])
def test_ids_in_a_narrow_common_dtype_stay_exact(backend, xp, pair):
    from portable_attn._lib._compat import ids_in_one_dtype

    a_dtype, a_vals, b_dtype, b_vals = pair
    a = backend.asarray(np.array(a_vals, dtype=a_dtype))
    b = backend.asarray(np.array(b_vals, dtype=b_dtype))
    ca, cb = ids_in_one_dtype(xp, a, b, names=("a", "b"), common=xp.int32)
    assert ca.dtype == cb.dtype == xp.int32
    got = backend.to_numpy(ca[:, None] == cb[None, :])
    np.testing.assert_array_equal(got, _same_ids(a_vals, b_vals))


def test_ids_that_no_common_dtype_holds_are_refused(backend, xp):
    from portable_attn._lib._compat import ids_in_one_dtype

    a = backend.asarray(np.array([1, 2], dtype=np.int64))
    b = backend.asarray(np.array([1, 2], dtype=np.uint8))
    with pytest.raises(ValueError, match=r"`a` \(.*int64\) and `b` \(.*uint8\).*int32"):
        ids_in_one_dtype(xp, a, b, names=("a", "b"), common=xp.int32)


# ---------------------------------------------------------------------------
# lengths of a narrow integer dtype


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8"])
def test_narrow_lengths_do_not_overflow_the_offset(backend, dtype):
    # Lk - q_len = 300 - 100 does not fit in int8: the causal alignment wrapped
    lq = lk = 300
    q, k, v = randn(1, 1, lq, 2, seed=30), randn(1, 1, lk, 2, seed=31), randn(1, 1, lk, 2, seed=32)
    lengths = np.array([100], dtype=dtype)
    kw = {"is_causal": True}
    for name in ("q_lengths", "kv_lengths"):
        out = scaled_dot_product_attention(
            *(backend.asarray(a) for a in (q, k, v)), **{name: backend.asarray(lengths)}, **kw
        )
        assert_close(backend, out, reference_attention(q, k, v, **{name: lengths}, **kw))


# ---------------------------------------------------------------------------
# None where an array is required


def _none_calls(backend):
    q = backend.asarray(randn(1, 2, 3, 4, seed=40))
    k = v = backend.asarray(randn(1, 2, 3, 4, seed=41))
    params = init_mha_params(8, 2, xp=backend.xp)
    return {
        "sdpa-query": (lambda: scaled_dot_product_attention(None, k, v), "query"),
        "sdpa-key": (lambda: scaled_dot_product_attention(q, None, v), "key"),
        "sdpa-value": (lambda: scaled_dot_product_attention(q, k, None), "value"),
        "weights-query": (lambda: attention_weights(None, k), "query"),
        "weights-key": (lambda: attention_weights(q, None), "key"),
        "sequence_parallel-query": (
            lambda: sequence_parallel_attention(None, k, v, mesh=None, axis_name="x"),
            "query",
        ),
        "sequence_parallel-value": (  # host NumPy query and key: accepted there
            lambda: sequence_parallel_attention(Q, K, None, mesh=None, axis_name="x"),
            "value",
        ),
        "merge": (lambda: merge_attention([None], [None]), "outs[0]"),
        "rope": (lambda: apply_rope(None, backend.asarray(np.arange(3))), "x"),
        "rms_norm": (lambda: rms_norm(None), "x"),
        "l2_normalize": (lambda: l2_normalize(None), "x"),
        "mha": (lambda: multi_head_attention(None, params=params, num_heads=2), "query_input"),
        "entropy": (lambda: diag.attention_entropy(None), "weights"),
        "saturation": (lambda: diag.saturation(None), "weights"),
        "sensitivity": (lambda: diag.softmax_sensitivity(None), "weights"),
        "logit_stats": (lambda: diag.logit_stats(None, k), "query"),
        "scale_report": (lambda: diag.scale_report(q, None), "key"),
    }


NONE_CALLS = [
    "sdpa-query",
    "sdpa-key",
    "sdpa-value",
    "weights-query",
    "weights-key",
    "sequence_parallel-query",
    "sequence_parallel-value",
    "merge",
    "rope",
    "rms_norm",
    "l2_normalize",
    "mha",
    "entropy",
    "saturation",
    "sensitivity",
    "logit_stats",
    "scale_report",
]


@pytest.mark.main_kinds
@pytest.mark.parametrize("call", NONE_CALLS)
def test_none_for_a_required_array_is_named(backend, call):
    fn, name = _none_calls(backend)[call]
    with pytest.raises(TypeError, match=rf"^`{re.escape(name)}` must be an array, but got None$"):
        fn()

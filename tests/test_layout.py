"""``layout="blhd"``: (B, L, H, D) arrays give the transposed call's values and gradients.

The library computes in (B..., H, L, D). The shapes cannot always tell the other
common layout apart: (B, L, H, D) cross-attention whose Lq is a multiple of Lk reads as
grouped-query attention and runs (2.93 off), so the layout is an argument. Every case
runs on every backend and route, against the float64 oracle of the (B, H, L, D) call;
the gradients against those of the transposed call.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn
from portable_attn import (
    attention_weights,
    init_mha_params,
    merge_attention,
    multi_head_attention,
    scaled_dot_product_attention,
)
from portable_attn.testing import (
    reference_attention,
    reference_lse,
    reference_max_logit,
    reference_weights,
)


def swap(x: np.ndarray) -> np.ndarray:
    """(..., H, L, D) <-> (..., L, H, D)."""
    return np.swapaxes(x, -3, -2)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


#: (Lq, Lk, keyword arguments) of each case, for qkv's batch 2, Hq = 4, Hkv = 2
CASES = {
    # the silent case: read as (B, H, L, D), Hq = 8 and Hkv = 4 fit as grouped-query
    "cross_lq_multiple_of_lk": (8, 4, {}),
    "causal": (5, 7, {"is_causal": True}),
    "mask": (5, 7, {"mask": _rng(1).random((2, 1, 5, 7)) < 0.7}),
    "key_mask": (6, 6, {"mask": _rng(2).random(6) < 0.7, "window": (2, 1)}),
    "bias": (5, 7, {"bias": _rng(3).standard_normal((4, 5, 7))}),
    "lengths": (5, 7, {"q_lengths": np.array([5, 3]), "kv_lengths": np.array([4, 7])}),
    "causal_lengths": (
        5,
        7,
        {"is_causal": True, "q_lengths": np.array([5, 2]), "kv_lengths": np.array([7, 4])},
    ),
    "segments": (
        6,
        6,
        {"q_segment_ids": np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]])},
    ),
    "sinks": (5, 7, {"sinks": np.array([0.5, -1.0, 2.0, -np.inf]), "is_causal": True}),
}


def _arrays(backend, case: str):
    lq, lk, kw = CASES[case]
    q, k, v = qkv(lq=lq, lk=lk)  # (2, 4, lq, 8), (2, 2, lk, 8), (2, 2, lk, 6): (B, H, L, D)
    on = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    return (q, k, v), kw, on


class TestTheValues:
    @pytest.mark.parametrize("case", list(CASES))
    def test_output_lse_and_max_logit(self, backend, route, case):
        (q, k, v), kw, on = _arrays(backend, case)
        out, lse, row_max = scaled_dot_product_attention(
            *(backend.asarray(swap(a)) for a in (q, k, v)),
            layout="blhd",
            return_lse=True,
            return_max_logit=True,
            **route.kw,
            **on,
        )
        assert tuple(out.shape) == (2, q.shape[-2], 4, 6)  # (B, Lq, Hq, Dv)
        assert tuple(lse.shape) == tuple(row_max.shape) == (2, q.shape[-2], 4)  # (B, Lq, Hq)
        assert_close(backend, out, swap(reference_attention(q, k, v, **kw)))
        assert_close(backend, lse, np.swapaxes(reference_lse(q, k, **kw), -2, -1))
        assert_close(backend, row_max, np.swapaxes(reference_max_logit(q, k, **kw), -2, -1))

    @pytest.mark.parametrize("case", list(CASES))
    def test_output_alone(self, backend, route, case):
        (q, k, v), kw, on = _arrays(backend, case)
        blhd = [backend.asarray(swap(a)) for a in (q, k, v)]
        for _ in range(2):  # the second a cache hit (torch: SDPA called with the views)
            out = scaled_dot_product_attention(*blhd, layout="blhd", **route.kw, **on)
            assert_close(backend, out, swap(reference_attention(q, k, v, **kw)))

    @pytest.mark.parametrize("case", ["cross_lq_multiple_of_lk", "mask", "causal_lengths"])
    def test_the_weights_keep_the_logits_layout(self, backend, case):
        (q, k, _), kw, on = _arrays(backend, case)
        w = attention_weights(
            backend.asarray(swap(q)), backend.asarray(swap(k)), layout="blhd", **on
        )
        assert_close(backend, w, reference_weights(q, k, **kw))  # (B, Hq, Lq, Lk)

    def test_three_and_two_dimensional_inputs(self, backend):
        q, k, v = qkv(batch=(), lq=6, lk=3)  # (H, L, D)
        out = scaled_dot_product_attention(
            *(backend.asarray(swap(a)) for a in (q, k, v)), layout="blhd"
        )
        assert_close(backend, out, swap(reference_attention(q, k, v)))
        q2, k2, v2 = (a[0] for a in (q, k, v))  # (L, D): one head in either layout
        out = scaled_dot_product_attention(
            *(backend.asarray(a) for a in (q2, k2, v2)), layout="blhd"
        )
        assert_close(backend, out, reference_attention(q2, k2, v2))

    @pytest.mark.skip_backends("dask", reason="merge_attention of lazy parts: test_merge.py")
    def test_the_lse_merges_beside_the_output(self, backend):
        q, k, v = qkv(lq=5, lk=8)
        parts = []
        for keys in (slice(0, 3), slice(3, 8)):
            arrays = (q, k[..., keys, :], v[..., keys, :])
            parts.append(
                scaled_dot_product_attention(
                    *(backend.asarray(swap(a)) for a in arrays), layout="blhd", return_lse=True
                )
            )
        merged, lse = merge_attention([o for o, _ in parts], [s for _, s in parts])
        assert_close(backend, merged, swap(reference_attention(q, k, v)))
        assert_close(backend, lse, np.swapaxes(reference_lse(q, k), -2, -1))


@pytest.mark.autodiff
class TestTheGradients:
    @pytest.mark.parametrize("case", ["cross_lq_multiple_of_lk", "mask", "causal_lengths", "bias"])
    def test_against_the_transposed_call(self, backend, xp, route, case):
        (q, k, v), _, on = _arrays(backend, case)
        cot = randn(2, 4, q.shape[-2], 6, seed=9)  # (B, Hq, Lq, Dv)
        cot_bhld, cot_blhd = backend.asarray(cot), backend.asarray(swap(cot))

        def bhld(q, k, v):
            out = scaled_dot_product_attention(q, k, v, **route.kw, **on)
            return xp.sum(out * cot_bhld)

        def blhd(q, k, v):
            out = scaled_dot_product_attention(q, k, v, layout="blhd", **route.kw, **on)
            return xp.sum(out * cot_blhd)

        expected = backend.grad(bhld, *(backend.asarray(a) for a in (q, k, v)))
        found = backend.grad(blhd, *(backend.asarray(swap(a)) for a in (q, k, v)))
        for g, e in zip(found, expected, strict=True):
            assert_close(backend, g, swap(backend.to_numpy(e)), atol=1e-12, rtol=1e-10)


class TestTheArgument:
    @pytest.mark.parametrize("layout", ["BLHD", "bshd", "", "bhdl"])
    def test_an_unknown_name(self, backend, layout):
        q, k, v = qkv(backend=backend)
        with pytest.raises(ValueError, match=r"`layout` must be 'bhld'.*or 'blhd'.*but got"):
            scaled_dot_product_attention(q, k, v, layout=layout)
        with pytest.raises(ValueError, match=r"`layout` must be 'bhld'"):
            attention_weights(q, k, layout=layout)

    @pytest.mark.parametrize("layout", [None, 1, ("b", "l", "h", "d")])
    def test_not_a_string(self, backend, layout):
        q, k, v = qkv(backend=backend)
        with pytest.raises(TypeError, match=r"`layout` must be 'bhld'"):
            scaled_dot_product_attention(q, k, v, layout=layout)

    def test_a_layout_error_points_at_the_argument(self, backend):
        q = backend.asarray(np.zeros((1, 1, 8, 16)))  # (B, L, H, D): one query, 8 heads
        k = backend.asarray(np.zeros((1, 100, 8, 16)))  # 100 keys
        with pytest.raises(ValueError, match=r"\(B, L, H, D\).*layout='blhd'"):
            scaled_dot_product_attention(q, k, k)
        scaled_dot_product_attention(q, k, k, layout="blhd")  # runs

    def test_arrays_already_heads_first_are_named_as_swapped(self, backend):
        q, k, v = qkv(lq=1, lk=100, backend=backend)  # (B, H, L, D) given as "blhd"
        with pytest.raises(ValueError, match=r"with layout='blhd', the shapes named .* swapped"):
            scaled_dot_product_attention(q, k, v, layout="blhd")
        with pytest.raises(ValueError, match=r"with layout='blhd', the shapes named .* swapped"):
            attention_weights(q, k, layout="blhd")

    def test_multi_head_attention_splits_its_own_heads(self, backend):
        params = init_mha_params(16, 4, xp=backend.xp, dtype=backend.dtype("float64"))
        x = backend.asarray(randn(2, 5, 16))
        with pytest.raises(TypeError, match=r"multi_head_attention\(\) takes no `layout`"):
            multi_head_attention(x, params=params, num_heads=4, layout="blhd")

"""Random argument types, shapes and values: every outcome is the oracle's result or a named error.

Never another exception type, never NaN for finite inputs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_attn import scaled_dot_product_attention
from portable_attn._lib._call import ATTENTION_KEYWORDS
from portable_attn.testing import reference_attention

NAMES = ("query", "key", "value", "block_size", "implementation", "layout", *ATTENTION_KEYWORDS)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(-2.0, 4.0),
    st.sampled_from([float("nan"), float("inf"), 1e30]),
    st.sampled_from(["auto", "dense", "big", "", np.int64(2), np.float32(0.5), np.True_]),
    st.sampled_from(["bhld", "blhd", "BLHD"]),
    st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
    st.tuples(st.none(), st.integers(0, 2)),
)


def _names_an_argument(message: str) -> bool:
    return (
        any(re.search(rf"`{n}`|{n}\(\)|{n}=", message) for n in NAMES)
        or "implementation=" in message
    )


@pytest.mark.kinds("numpy", reason="argument validation is shared by every backend")
@settings(max_examples=300)
@given(
    lq=st.integers(0, 4),
    lk=st.integers(0, 4),
    heads=st.sampled_from([(2, 1), (2, 2), (3, 2), (0, 1)]),
    dk=st.integers(0, 3),
    option=st.sampled_from(
        [
            "scale",
            "softcap",
            "window",
            "is_causal",
            "block_size",
            "dropout_p",
            "implementation",
            "layout",
        ]
    ),
    value=_scalars,
    mask_shape=st.sampled_from([None, (), (1,), (4,), (1, 1), (3, 5), (2, 1, 1)]),
    mask_dtype=st.sampled_from(["bool", "bool", "int64", "float64"]),
)
def test_every_outcome_is_a_result_or_a_named_error(
    backend, lq, lk, heads, dk, option, value, mask_shape, mask_dtype
):
    hq, hkv = heads
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, lq, dk))
    k = rng.standard_normal((1, hkv, lk, dk))
    v = rng.standard_normal((1, hkv, lk, 2))
    kw = {option: value}
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.7
        kw["mask"] = mask.astype(mask_dtype)
    try:
        out = scaled_dot_product_attention(q, k, v, **kw)
    except (TypeError, ValueError) as exc:
        error = str(exc)
    else:
        error = None
    if error is not None:
        assert _names_an_argument(error), error
        return
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    ref_kw = {n: x for n, x in kw.items() if n in ("scale", "softcap", "window", "is_causal")}
    if ref_kw.get("window") is not None:
        ref_kw["window"] = tuple(None if w is None else int(w) for w in ref_kw["window"])
    if ref_kw.get("scale") is not None:
        ref_kw["scale"] = float(ref_kw["scale"])
    if "softcap" in ref_kw and ref_kw["softcap"] is None:
        del ref_kw["softcap"]
    if "is_causal" in ref_kw:
        ref_kw["is_causal"] = bool(ref_kw["is_causal"])
    if option == "dropout_p":
        return  # dropout_p without a mask only passes when it is 0: checked by the error path
    if option == "layout" and value == "blhd":  # (B, L, H, D): the call of the swapped arrays
        q, k, v = (np.swapaxes(a, -3, -2) for a in (q, k, v))
        out = np.swapaxes(out, -3, -2)
    if 0 in (q.shape[-3], q.shape[-2], k.shape[-2]):  # no query head, query or key
        assert out.size == 0 or np.all(out == 0)
        return
    expected = reference_attention(q, k, v, mask=mask, **ref_kw)
    np.testing.assert_allclose(out, expected, atol=1e-10, rtol=1e-8)

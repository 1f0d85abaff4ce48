"""Bad input fails early with a message naming the argument, the axis and the shapes."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, qkv
from portable_attn import attention_weights, causal_mask, scaled_dot_product_attention
from portable_attn.testing import reference_attention


@pytest.fixture
def arrays(backend):
    """Query (2, 4, 5, 8), key (2, 2, 7, 8), value (2, 2, 7, 6) on the backend."""
    return list(qkv(batch=(2,), hq=4, hkv=2, lq=5, lk=7, dk=8, dv=6, backend=backend))


def call(q, k, v, **kw):
    return scaled_dot_product_attention(q, k, v, **kw)


class TestShapes:
    def test_dk_mismatch_names_axis_and_shapes(self, backend):
        q, k, v = (backend.asarray(np.ones(s)) for s in [(2, 5, 8), (2, 7, 4), (2, 7, 6)])
        msg = r"`query` and `key`.*axis -1.*Dk.*\(2, 5, 8\).*\(2, 7, 4\)"
        with pytest.raises(ValueError, match=msg):
            call(q, k, v)
        with pytest.raises(ValueError, match=msg):
            attention_weights(q, k)

    def test_lk_mismatch(self, backend):
        q, k, v = (backend.asarray(np.ones(s)) for s in [(2, 5, 8), (2, 7, 8), (2, 6, 6)])
        with pytest.raises(
            ValueError, match=r"`key` and `value`.*axis -2.*\(2, 7, 8\).*\(2, 6, 6\)"
        ):
            call(q, k, v)

    def test_kv_head_mismatch(self, backend):
        q, k, v = (backend.asarray(np.ones(s)) for s in [(4, 5, 8), (2, 7, 8), (1, 7, 6)])
        with pytest.raises(ValueError, match=r"axis -3.*Hkv"):
            call(q, k, v)

    def test_heads_not_a_multiple(self, backend):
        q, k, v = (backend.asarray(np.ones(s)) for s in [(3, 5, 8), (2, 7, 8), (2, 7, 6)])
        with pytest.raises(
            ValueError, match=r"multiple.*axis -3.*Hq=3.*\(3, 5, 8\).*Hkv=2.*\(2, 7, 8\)"
        ):
            call(q, k, v)

    def test_batch_not_broadcastable(self, backend):
        q, k, v = (backend.asarray(np.ones(s)) for s in [(3, 1, 5, 8), (2, 1, 7, 8), (2, 1, 7, 6)])
        with pytest.raises(
            ValueError, match=r"batch dimensions of `query` and `key`.*\(3,\).*\(2,\)"
        ):
            call(q, k, v)

    @pytest.mark.parametrize("name", ["query", "key"])
    def test_rank_below_two(self, backend, name):
        args = {"query": np.ones((5, 8)), "key": np.ones((7, 8))}
        args[name] = np.ones(8)
        q, k = backend.asarray(args["query"]), backend.asarray(args["key"])
        with pytest.raises(ValueError, match=rf"`{name}` must have at least 2 dimensions.*\(8,\)"):
            call(q, k, backend.asarray(np.ones((7, 3))))

    def test_mask_not_broadcastable(self, backend, arrays):
        mask = backend.asarray(np.ones((5, 6), dtype=bool))
        with pytest.raises(
            ValueError, match=r"`mask` with shape \(5, 6\).*\(2, 4, 5, 7\).*axis -1"
        ):
            call(*arrays, mask=mask)

    def test_mask_that_would_grow_the_batch_is_rejected(self, backend, arrays):
        mask = backend.asarray(np.ones((3, 2, 4, 5, 7), dtype=bool))
        with pytest.raises(ValueError, match=r"`mask` with shape \(3, 2, 4, 5, 7\)"):
            call(*arrays, mask=mask)

    def test_bias_not_broadcastable(self, backend, arrays):
        bias = backend.asarray(np.ones((3, 5, 7)))
        with pytest.raises(ValueError, match=r"`bias` with shape \(3, 5, 7\).*axis -3"):
            call(*arrays, bias=bias)


class TestDtypes:
    @pytest.mark.parametrize("name", ["query", "key", "value"])
    @pytest.mark.parametrize("dtype", ["int32", "bool"])
    def test_non_floating_inputs(self, backend, arrays, name, dtype):
        args = dict(zip(["query", "key", "value"], arrays, strict=True))
        args[name] = backend.asarray(np.ones((2, 4, 5, 8)[:4], dtype=dtype))
        with pytest.raises(TypeError, match=rf"`{name}` must have a real floating dtype.*{dtype}"):
            call(args["query"], args["key"], args["value"])

    def test_mask_not_boolean(self, backend, arrays):
        with pytest.raises(TypeError, match=r"`mask` must be a boolean array.*float64"):
            call(*arrays, mask=backend.asarray(np.ones((5, 7))))

    def test_bias_not_floating(self, backend, arrays):
        with pytest.raises(TypeError, match=r"`bias` must have a real floating dtype.*int"):
            call(*arrays, bias=backend.asarray(np.ones((5, 7), dtype="int64")))


class TestAZeroOneIntegerMask:
    """A tokenizer's int64 0/1 ``attention_mask``: the message's advice gives the right call.

    It said "pass an additive floating mask as `bias` instead": the 0/1 ints added as a
    bias hide nothing (3.4 off). It now says ``mask != 0``, and an integer `bias` is
    refused with the same advice.
    """

    @staticmethod
    def padding(lk=7):
        m = np.ones((2, lk), dtype=np.int64)  # (B, Lk), 1 = a real token, as tokenizers give
        m[1, 4:] = 0
        return m

    @pytest.mark.parametrize("dtype", ["int64", "int32", "uint8"])
    def test_the_message_says_not_equal_zero(self, backend, arrays, dtype):
        mask = backend.asarray(self.padding().astype(dtype)[:, None, None, :])
        with pytest.raises(TypeError, match=rf"`mask` must be a boolean.*{dtype}.*`mask != 0`"):
            call(*arrays, mask=mask)

    def test_a_two_dimensional_one_gets_its_axes(self, backend, arrays):
        with pytest.raises(TypeError, match=r"`mask != 0`.*\[:, None, None, :\]"):
            call(*arrays, mask=backend.asarray(self.padding()))

    def test_the_advice_gives_the_masked_result(self, backend, xp, arrays):
        mask = backend.asarray(self.padding()[:, None, None, :])
        out = call(*arrays, mask=mask != 0)  # what the message says
        q, k, v = (backend.to_numpy(a) for a in arrays)
        expected = reference_attention(q, k, v, mask=self.padding()[:, None, None, :] != 0)
        assert_close(backend, out, expected)

    def test_a_floating_mask_gets_both_forms(self, backend, arrays):
        with pytest.raises(TypeError, match=r"`mask != 0`.*additive.*`bias=`"):
            call(*arrays, mask=backend.asarray(np.ones((5, 7))))

    @pytest.mark.parametrize("dtype", ["int64", "int32"])
    def test_an_integer_bias_is_refused_with_the_mask_it_is(self, backend, arrays, dtype):
        bias = backend.asarray(self.padding().astype(dtype)[:, None, None, :])
        with pytest.raises(TypeError, match=rf"`bias`.*{dtype}.*hides nothing.*`mask=bias != 0`"):
            call(*arrays, bias=bias)
        with pytest.raises(TypeError, match=r"`bias`.*hides nothing"):
            attention_weights(arrays[0], arrays[1], bias=bias)

    def test_a_boolean_bias_is_a_mask(self, backend, arrays):
        bias = backend.asarray(self.padding()[:, None, None, :] != 0)
        with pytest.raises(TypeError, match=r"`bias`.*bool.*pass it as `mask=`"):
            call(*arrays, bias=bias)

    def test_an_integer_dropout_mask(self, backend, arrays):
        keep = backend.asarray(np.ones((2, 4, 5, 7), dtype=np.int64))
        with pytest.raises(TypeError, match=r"`dropout_mask`.*True = keep.*`dropout_mask != 0`"):
            call(*arrays, dropout_p=0.5, dropout_mask=keep)


class TestScalars:
    @pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
    def test_bad_scale(self, arrays, value):
        with pytest.raises(ValueError, match=r"`scale` must be a finite number > 0"):
            call(*arrays, scale=value)

    def test_scale_wrong_type(self, arrays):
        with pytest.raises(
            TypeError, match=r"`scale` must be a positive real number.*of type str"
        ):
            call(*arrays, scale="0.1")

    @pytest.mark.parametrize("value", [0.0, -2.0])
    def test_bad_softcap(self, arrays, value):
        with pytest.raises(ValueError, match=r"`softcap` must be a finite number > 0"):
            call(*arrays, softcap=value)

    @pytest.mark.parametrize("window", [(-1, 2), (1, -3)])
    def test_negative_window(self, arrays, window):
        with pytest.raises(ValueError, match=r"`window` (left|right) entry must be >= 0"):
            call(*arrays, window=window)

    @pytest.mark.parametrize("window", [(1.5, 2), (1, "2"), (True, 1), 3, (1, 2, 3)])
    def test_window_not_integers(self, arrays, window):
        with pytest.raises(TypeError, match=r"`window`"):
            call(*arrays, window=window)

    @pytest.mark.parametrize("window", [(1.0, 2), (True, 2)])
    def test_a_valid_call_before_does_not_pass_an_equal_invalid_window(self, arrays, window):
        call(*arrays, window=(1, 2))  # 1 == 1.0 == True: a checked call's facts are cached
        with pytest.raises(TypeError, match=r"`window` left entry must be an integer"):
            call(*arrays, window=window)

    def test_is_causal_must_be_bool(self, arrays):
        with pytest.raises(TypeError, match=r"`is_causal` must be True or False"):
            call(*arrays, is_causal="yes")


class TestLibraries:
    def test_arrays_from_two_libraries(self, backend, arrays):
        if backend.family == "numpy":
            import array_api_strict as other

            other_name = "array_api_strict"
        else:
            other, other_name = np, "numpy"
        q, _, v = arrays
        k = other.asarray(np.ones((2, 2, 7, 8)))
        lib = backend.family if backend.family != "dask" else "dask"
        with pytest.raises(TypeError, match=rf"`query` and `key`.*{lib}.*{other_name}"):
            call(q, k, v)

    def test_mask_from_another_library(self, backend, arrays):
        other = np if backend.family != "numpy" else __import__("array_api_strict")
        mask = other.asarray(np.ones((5, 7), dtype=bool))
        with pytest.raises(TypeError, match=r"`query` and `mask` come from different"):
            call(*arrays, mask=mask)

    def test_not_an_array(self, arrays):
        with pytest.raises(TypeError, match=r"`key` must be an array.*'list'"):
            call(arrays[0], [[1.0]], arrays[2])


class TestCausalMaskHelper:
    def test_alignments(self, backend, xp):
        br = causal_mask(2, 4, xp=xp, device=backend.device)
        tl = causal_mask(2, 4, align="top-left", xp=xp, device=backend.device)
        np.testing.assert_array_equal(backend.to_numpy(br), [[1, 1, 1, 0], [1, 1, 1, 1]])
        np.testing.assert_array_equal(backend.to_numpy(tl), [[1, 0, 0, 0], [1, 1, 0, 0]])

    def test_top_left_mask_reproduces_torch_convention(self, backend, xp):
        rng = np.random.default_rng(0)
        q, k, v = (backend.asarray(rng.standard_normal(s)) for s in [(3, 4), (5, 4), (5, 2)])
        mask = causal_mask(3, 5, align="top-left", xp=xp, device=backend.device)
        out = backend.to_numpy(call(q, k, v, mask=mask))
        qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
        s = qn @ kn.T / 2.0
        s = np.where(np.tril(np.ones((3, 5), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out, (p / p.sum(-1, keepdims=True)) @ vn, atol=1e-12)

    def test_bad_alignment(self):
        with pytest.raises(ValueError, match="`align`"):
            causal_mask(2, 2, align="top-right")

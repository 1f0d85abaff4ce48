"""Edge-case inputs found by trying to break the library: each works, or fails clearly.

A wrong type is a TypeError, a wrong value a ValueError, and every message names
the argument; degenerate but meaningful inputs (0-d masks, no query heads, a
window longer than any sequence) simply work.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_attn as pa
from _helpers import assert_backend_array, qkv
from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn.testing import reference_attention


@pytest.fixture
def data():
    return qkv(batch=(1,), hq=2, hkv=2, lq=6, lk=3, dk=4, dv=4)


def _close(backend, actual, expected, atol=1e-12):
    np.testing.assert_allclose(backend.to_numpy(actual), expected, atol=atol, rtol=1e-10)


class TestDegenerateInputsWork:
    @pytest.mark.parametrize("argument", ["mask", "bias", "dropout_mask"])
    def test_zero_dimensional_mask_bias_and_dropout_mask_broadcast(self, backend, data, argument):
        q, k, v = (backend.asarray(a) for a in data)
        value = {"mask": True, "bias": 0.5, "dropout_mask": True}[argument]
        extra = {"dropout_p": 0.25} if argument == "dropout_mask" else {}
        out = scaled_dot_product_attention(
            q, k, v, **{argument: backend.asarray(np.asarray(value))}, **extra
        )
        expected = reference_attention(*data)
        if argument == "dropout_mask":
            expected = expected / 0.75  # every weight kept, scaled by 1 / (1 - p)
        _close(backend, out, expected)

    def test_no_query_heads_gives_an_empty_result(self, backend, data):
        _, k, v = (backend.asarray(a) for a in data)
        q = backend.asarray(np.zeros((1, 0, 6, 4)))
        assert tuple(scaled_dot_product_attention(q, k, v).shape) == (1, 0, 6, 4)
        assert tuple(attention_weights(q, k).shape) == (1, 0, 6, 3)

    @pytest.mark.autodiff
    @pytest.mark.dtypes("float16", "float32")
    @pytest.mark.parametrize("empty", ["B", "Hq", "Lq", "Lk"])
    def test_zero_size_inputs_have_zero_gradients(self, backend, xp, dtype, empty):
        """No sequence, head, query or key: zeros, and zero gradients of every input's shape.

        As the library's own operations on empty arrays give: the result depends on
        Q, K, V and the bias (torch: it has a ``grad_fn``; a fresh zeros array had none,
        and ``backward`` raised).
        """
        sizes = {"B": 2, "Hq": 2, "Lq": 3, "Lk": 4, empty: 0}
        heads = {"hq": sizes["Hq"], "hkv": 2 if sizes["Hq"] else 1}
        q, k, v = qkv(batch=(sizes["B"],), **heads, lq=sizes["Lq"], lk=sizes["Lk"], dk=4, dv=5)
        bias = np.zeros((sizes["Lq"], sizes["Lk"]))
        arrays = [backend.asarray(a, dtype) for a in (q, k, v, bias)]
        shape = (sizes["B"], sizes["Hq"], sizes["Lq"])

        def result(q, k, v, bias, column):
            out_lse = scaled_dot_product_attention(q, k, v, bias=bias, return_lse=True)
            return out_lse[column]

        out, lse = (result(*arrays, column) for column in (0, 1))
        assert_backend_array(backend, out, shape=(*shape, 5), dtype=dtype)
        assert_backend_array(backend, lse, shape=shape)
        assert np.all(backend.to_numpy(out) == 0)
        assert np.all(backend.to_numpy(lse) == -np.inf)
        for column in (0, 1):  # the output, then the lse
            grads = backend.grad(lambda *a, c=column: xp.sum(result(*a, c)), *arrays)
            for g, a in zip(grads, arrays, strict=True):
                assert_backend_array(backend, g, shape=a.shape, dtype=dtype)
                assert np.all(backend.to_numpy(g) == 0)

    @pytest.mark.autodiff
    @pytest.mark.parametrize("empty", ["B", "Lq", "Lk"])
    def test_zero_size_weights_have_zero_gradients(self, backend, xp, empty):
        """:func:`attention_weights` of empty inputs: zeros that depend on Q and K."""
        sizes = {"B": 2, "Lq": 3, "Lk": 4, empty: 0}
        q, k, _ = qkv(batch=(sizes["B"],), lq=sizes["Lq"], lk=sizes["Lk"], backend=backend)
        w = attention_weights(q, k)
        assert_backend_array(backend, w, shape=(sizes["B"], 4, sizes["Lq"], sizes["Lk"]))
        grads = backend.grad(lambda q, k: xp.sum(attention_weights(q, k)), q, k)
        for g, a in zip(grads, (q, k), strict=True):
            assert_backend_array(backend, g, shape=a.shape)
            assert np.all(backend.to_numpy(g) == 0)

    @pytest.mark.parametrize("left", [10**20, 2**31 - 1])
    def test_a_window_longer_than_any_sequence_is_unbounded(self, backend, data, left):
        q, k, v = (backend.asarray(a) for a in data)
        out = scaled_dot_product_attention(q, k, v, window=(left, 0))
        _close(backend, out, reference_attention(*data, window=(None, 0)))

    @pytest.mark.parametrize(
        "kw",
        [
            {"block_size": np.int64(2)},
            {"is_causal": np.True_},
            {"window": (np.int64(2), np.int32(0))},
            {"scale": np.float32(0.5)},
        ],
        ids=["block_size", "is_causal", "window", "scale"],
    )
    def test_numpy_scalars_are_accepted_where_python_ones_are(self, backend, data, kw):
        q, k, v = (backend.asarray(a) for a in data)
        out = scaled_dot_product_attention(q, k, v, **kw)
        plain = {n: (x.item() if isinstance(x, np.generic) else x) for n, x in kw.items()}
        if "window" in plain:
            plain["window"] = tuple(int(w) for w in kw["window"])
        plain.pop("block_size", None)
        _close(backend, out, reference_attention(*data, **plain), atol=1e-10)

    def test_numpy_dropout_probability(self, backend, data):
        q, k, v = (backend.asarray(a) for a in data)
        keep = np.random.default_rng(3).random((6, 3)) > 0.2
        out = scaled_dot_product_attention(
            q, k, v, dropout_p=np.float32(0.25), dropout_mask=backend.asarray(keep)
        )
        expected = reference_attention(*data, dropout_p=0.25, dropout_mask=keep)
        _close(backend, out, expected, atol=1e-7)

    def test_numpy_integers_for_the_helpers(self, backend):
        assert tuple(pa.causal_mask(np.int64(2), np.int32(3)).shape) == (2, 3)
        cache = pa.kv_cache_init(
            batch_shape=(np.int64(1),), num_kv_heads=1, capacity=np.int64(4), head_dim=2
        )
        assert cache.capacity == 4
        assert tuple(pa.get_alibi_slopes(np.int64(4)).shape) == (4,)


class TestClearErrors:
    def test_no_features(self, backend):
        q, k = backend.asarray(np.zeros((1, 2, 6, 0))), backend.asarray(np.zeros((1, 2, 3, 0)))
        v = backend.asarray(np.zeros((1, 2, 3, 4)))
        with pytest.raises(ValueError, match=r"at least one feature on axis -1 \(Dk\)"):
            scaled_dot_product_attention(q, k, v)

    @pytest.mark.parametrize("name", ["scale", "softcap"])
    def test_a_number_outside_the_compute_dtype(self, backend, name):
        q, k, v = qkv(batch=(1,), hq=1, hkv=1, lq=2, lk=2, dk=2, dv=2, backend=backend)
        q, k, v = (backend.xp.astype(x, backend.dtype("float32")) for x in (q, k, v))
        with pytest.raises(ValueError, match=rf"`{name}` = 1e\+308 is outside .*float32"):
            scaled_dot_product_attention(q, k, v, **{name: 1e308})

    def test_score_mod_must_keep_the_shape(self, backend, data):
        q, k, v = (backend.asarray(a) for a in data)
        with pytest.raises(
            ValueError, match=r"`score_mod` must return the shape of its `scores` argument"
        ):
            scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :1, :])

    def test_score_mod_must_return_floating_scores(self, backend, data):
        q, k, v = (backend.asarray(a) for a in data)
        with pytest.raises(TypeError, match="`score_mod` must return floating scores"):
            scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: s > 0)

    def test_score_mod_must_return_an_array(self, backend, data):
        q, k, v = (backend.asarray(a) for a in data)
        with pytest.raises(TypeError, match="`score_mod` must return an array"):
            scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: 1.0)

    @pytest.mark.parametrize(
        ("block_size", "error"),
        [("big", TypeError), (1.5, TypeError), (True, TypeError), (0, ValueError)],
    )
    def test_block_size_type_and_value(self, backend, data, block_size, error):
        q, k, v = (backend.asarray(a) for a in data)
        with pytest.raises(error, match="`block_size` must be None, 'auto', 'dense'"):
            scaled_dot_product_attention(q, k, v, block_size=block_size)

    @pytest.mark.parametrize(("value", "error"), [(2.0, TypeError), (-1, ValueError)])
    def test_counts_of_the_helpers(self, value, error):
        with pytest.raises(error, match="`num_queries` must be a non-negative integer"):
            pa.causal_mask(value, 3)
        with pytest.raises(error, match="`num_heads` must be a positive integer"):
            pa.get_alibi_slopes(value)
        with pytest.raises(error, match="`capacity` must be a positive integer"):
            pa.kv_cache_init(batch_shape=(1,), num_kv_heads=1, capacity=value, head_dim=2)

    def test_kv_cache_batch_shape_must_be_a_tuple(self):
        with pytest.raises(TypeError, match="`batch_shape` must be a tuple"):
            pa.kv_cache_init(batch_shape=2, num_kv_heads=1, capacity=4, head_dim=2)

    def test_mha_params_and_widths(self, backend, xp):
        params = pa.init_mha_params(8, 2, xp=xp)
        x = backend.asarray(np.zeros((1, 3, 8), dtype=np.float32))
        with pytest.raises(ValueError, match=r"`params` is missing \['wo'\]"):
            pa.multi_head_attention(x, params={n: p for n, p in params.items() if n != "wo"},
                                    num_heads=2)  # fmt: skip
        with pytest.raises(ValueError, match="does not split into 3 heads"):
            pa.multi_head_attention(x, params=params, num_heads=3)
        wide = backend.asarray(np.zeros((1, 3, 5), dtype=np.float32))
        with pytest.raises(ValueError, match=r"`query_input` axis -1 must match"):
            pa.multi_head_attention(wide, params=params, num_heads=2)
        with pytest.raises(ValueError, match="`num_heads` must be a positive integer"):
            pa.init_mha_params(8, 0, xp=xp)
        with pytest.raises(ValueError, match="must divide `d_model`"):
            pa.init_mha_params(8, 3, xp=xp)

    def test_rope_base_and_dims(self, backend):
        x = backend.asarray(np.ones((1, 3, 4)))
        pos = backend.asarray(np.arange(3))
        for base in (-1.0, 0.0):
            with pytest.raises(ValueError, match="`base` must be a finite number > 0"):
                pa.apply_rope(x, pos, base=base)
        with pytest.raises(ValueError, match=r"an even D >= 2"):
            pa.apply_rope(backend.asarray(np.ones((1, 3, 0))), pos)
        with pytest.raises(ValueError, match="NTK-aware `scaling` needs D > 2"):
            pa.apply_rope(
                backend.asarray(np.ones((1, 3, 2))), pos, scaling={"type": "ntk", "factor": 2.0}
            )


class TestKVCacheAppend:
    def test_appending_no_token_returns_the_cache(self, backend, xp):
        cache = pa.kv_cache_init(batch_shape=(1,), num_kv_heads=1, capacity=4, head_dim=2, xp=xp)
        empty = backend.asarray(np.zeros((1, 1, 0, 2), dtype=np.float32))
        assert pa.kv_cache_append(cache, empty, empty) is cache


@pytest.mark.backends("numpy", reason="NumPy array kinds")
class TestNumPyArrayKinds:
    def test_masked_arrays_are_refused(self, data):
        q, k, v = data
        with pytest.raises(TypeError, match="`query` is a NumPy masked array"):
            scaled_dot_product_attention(np.ma.masked_array(q), k, v)

    def test_ml_dtypes_bfloat16_names_the_fix(self, data):
        ml_dtypes = pytest.importorskip("ml_dtypes")
        q, k, v = data
        with pytest.raises(TypeError, match=r"`query` must have a real floating dtype.*astype"):
            scaled_dot_product_attention(q.astype(ml_dtypes.bfloat16), k, v)


@pytest.mark.backends("torch", reason="torch devices and layouts")
class TestTorchTensorKinds:
    def test_a_mask_on_another_device_names_both(self, backend, data):
        import torch

        q, k, v = (backend.asarray(a) for a in data)
        mask = torch.ones(6, 3, dtype=torch.bool, device="meta")
        with pytest.raises(ValueError, match=r"`mask` is on device meta but `query` is on"):
            scaled_dot_product_attention(q, k, v, mask=mask)

    def test_sparse_tensors_are_refused(self, backend, data):
        q, k, v = (backend.asarray(a) for a in data)
        with pytest.raises(TypeError, match="`query` is a sparse tensor"):
            scaled_dot_product_attention(q.to_sparse(), k, v)


@pytest.mark.backends("torch", "jax", reason="libraries with float8 dtypes")
def test_float8_inputs_are_refused(backend, xp, data):
    q, k, v = (backend.asarray(a) for a in data)
    q8 = _to_float8(backend, q)
    with pytest.raises(TypeError, match=r"`query` must have a real floating dtype.*float16 or"):
        scaled_dot_product_attention(q8, k, v)


def _to_float8(backend, x):
    if backend.family == "torch":
        import torch

        return x.to(torch.float8_e4m3fn)
    import jax.numpy as jnp

    return x.astype(jnp.float8_e4m3fn)


@pytest.mark.backends("dask", reason="Dask chunk sizes")
def test_dask_arrays_of_unknown_size_are_refused(backend, data):
    import dask.array as da

    q = da.from_array(data[0], chunks=(1, 2, 3, 4))
    q._chunks = ((1,), (2,), (np.nan, np.nan), (4,))  # as after boolean indexing
    k, v = (backend.asarray(a) for a in data[1:])
    with pytest.raises(ValueError, match=r"`query` has unknown sizes .*compute_chunk_sizes"):
        scaled_dot_product_attention(q, k, v)


@pytest.mark.backends("torch", reason="a library other than JAX")
def test_sequence_parallel_needs_jax_arrays(backend, data):
    from portable_attn.jax_parallel import sequence_parallel_attention

    q, k, v = (backend.asarray(a) for a in data)
    with pytest.raises(
        TypeError, match=r"needs JAX \(or NumPy\) arrays, but `query` is a torch array"
    ):
        sequence_parallel_attention(q, k, v, mesh=None, axis_name="seq")

"""KV cache decoding: `kv_cache_init`, `kv_cache_append`, `kv_cache_attention`."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_backend_array, randn
from portable_attn import (
    KVCache,
    apply_rope,
    init_mha_params,
    kv_cache_append,
    kv_cache_attention,
    kv_cache_init,
    scaled_dot_product_attention,
)
from portable_attn.testing import reference_attention


def empty_cache(backend, xp, capacity=12, batch=(2,), hkv=2, d=4, dv=3):
    return kv_cache_init(
        xp,
        batch_shape=batch,
        num_kv_heads=hkv,
        capacity=capacity,
        head_dim=d,
        value_dim=dv,
        dtype=backend.dtype("float64"),
        device=backend.device,
    )


class TestKVCache:
    @pytest.mark.parametrize(
        "chunks", [[1] * 9, [4, 1, 3, 1], [9]], ids=["tokens", "mixed", "prefill"]
    )
    def test_decoding_equals_full_causal_attention(self, backend, xp, chunks):
        q, k, v = randn(2, 4, 9, 4), randn(2, 2, 9, 4, seed=1), randn(2, 2, 9, 3, seed=2)
        cache = empty_cache(backend, xp)
        outs, start = [], 0
        for n in chunks:
            sl = slice(start, start + n)
            cache = kv_cache_append(
                cache, backend.asarray(k[:, :, sl]), backend.asarray(v[:, :, sl])
            )
            outs.append(backend.to_numpy(kv_cache_attention(backend.asarray(q[:, :, sl]), cache)))
            start += n
        np.testing.assert_allclose(
            np.concatenate(outs, axis=2), reference_attention(q, k, v, is_causal=True), atol=1e-12
        )
        np.testing.assert_array_equal(backend.to_numpy(cache.lengths), [9, 9])

    @pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
    def test_under_jax_rank_promotion_raise(self, backend, xp):
        """With ``jax_numpy_rank_promotion="raise"`` every append raised.

        Issue 46, item 11: the (C, 1) slots less the (B, 1, 1, 1) lengths. The slots
        are now given the lengths' rank first; values as the oracle's.
        """
        import jax

        with jax.numpy_rank_promotion("raise"):
            self.test_decoding_equals_full_causal_attention(backend, xp, [4, 1, 3, 1])

    def test_layout_is_refused(self, backend, xp):
        """``layout`` would swap the cache's (Hkv, capacity) axes too: silently wrong."""
        cache = kv_cache_append(
            empty_cache(backend, xp),
            backend.asarray(randn(2, 2, 3, 4)),
            backend.asarray(randn(2, 2, 3, 3, seed=1)),
        )
        with pytest.raises(TypeError, match="no `layout`"):
            kv_cache_attention(backend.asarray(randn(2, 3, 4, 4)), cache, layout="blhd")

    def test_ragged_batch(self, backend, xp):
        # sequence 0 has a 3-token prompt, sequence 1 a 1-token prompt (lengths differ)
        cache = empty_cache(backend, xp)
        k0, v0 = randn(2, 2, 3, 4, seed=3), randn(2, 2, 3, 3, seed=4)
        cache = kv_cache_append(cache, backend.asarray(k0), backend.asarray(v0))
        lengths = KVCache(
            cache.keys, cache.values, backend.asarray(np.array([3, 1], dtype=np.int32))
        )
        q1, k1, v1 = (
            randn(2, 4, 1, 4, seed=5),
            randn(2, 2, 1, 4, seed=6),
            randn(2, 2, 1, 3, seed=7),
        )
        cache = kv_cache_append(lengths, backend.asarray(k1), backend.asarray(v1))
        out = backend.to_numpy(kv_cache_attention(backend.asarray(q1), cache))
        for b, n in enumerate([3, 1]):
            keys = np.concatenate([k0[b, :, :n], k1[b]], axis=1)
            vals = np.concatenate([v0[b, :, :n], v1[b]], axis=1)
            np.testing.assert_allclose(out[b], reference_attention(q1[b], keys, vals), atol=1e-12)

    def test_append_does_not_modify_the_cache(self, backend, xp):
        cache = empty_cache(backend, xp)
        before = backend.to_numpy(cache.keys).copy()
        new = kv_cache_append(
            cache, backend.asarray(randn(2, 2, 2, 4)), backend.asarray(randn(2, 2, 2, 3))
        )
        np.testing.assert_array_equal(backend.to_numpy(cache.keys), before)
        assert_backend_array(backend, new.keys, shape=(2, 2, 12, 4), dtype="float64")

    @pytest.mark.skip_backends("dask", reason="a lazy Dask cache cannot check its lengths")
    def test_overflow_is_an_error(self, backend, xp):
        cache = empty_cache(backend, xp, capacity=4)
        cache = kv_cache_append(
            cache, backend.asarray(randn(2, 2, 3, 4)), backend.asarray(randn(2, 2, 3, 3))
        )
        with pytest.raises(ValueError, match=r"capacity 4 .* already holds 3"):
            kv_cache_append(
                cache, backend.asarray(randn(2, 2, 2, 4)), backend.asarray(randn(2, 2, 2, 3))
            )

    def test_shape_mismatch(self, backend, xp):
        cache = empty_cache(backend, xp)
        with pytest.raises(
            ValueError, match=r"`key` shape \(2, 3, 1, 4\) does not match the cache"
        ):
            kv_cache_append(
                cache, backend.asarray(randn(2, 3, 1, 4)), backend.asarray(randn(2, 3, 1, 3))
            )

    @pytest.mark.backends("jax", reason="jax.jit only")
    def test_one_jit_compilation_serves_every_step(self, backend, xp):
        import jax

        traces = []

        @jax.jit
        def step(cache, q, k, v):
            traces.append(1)
            cache = kv_cache_append(cache, k, v)
            return cache, kv_cache_attention(q, cache)

        q, k, v = randn(2, 4, 5, 4), randn(2, 2, 5, 4, seed=1), randn(2, 2, 5, 3, seed=2)
        cache = empty_cache(backend, xp)
        outs = []
        for t in range(5):
            cache, out = step(cache, *(backend.asarray(a[:, :, t : t + 1]) for a in (q, k, v)))
            outs.append(backend.to_numpy(out))
        assert len(traces) == 1
        np.testing.assert_allclose(
            np.concatenate(outs, 2), reference_attention(q, k, v, is_causal=True), atol=1e-12
        )


class TestRepr:
    """A cache prints as one short line: sizes, dtype and lengths, never the arrays."""

    def test_repr_names_the_sizes_and_lengths(self, backend, xp):
        cache = empty_cache(backend, xp, capacity=4096, hkv=2, d=64, dv=32)
        cache = kv_cache_append(
            cache, *(xp.ones_like(x[..., :3, :]) for x in (cache.keys, cache.values))
        )
        text = repr(cache)
        assert len(text) < 200, text
        assert text.startswith(f"KVCache({backend.family} float64")
        for part in (
            "batch_shape=(2,)",
            "num_kv_heads=2",
            "capacity=4096",
            "head_dim=64",
            "value_dim=32",
        ):
            assert part in text
        lazy = backend.family == "dask"  # reading would compute the graph
        assert text.endswith("lengths=lazy)" if lazy else "lengths=[3, 3])"), text

    @pytest.mark.kinds("numpy", reason="the summary is computed on the host")
    def test_many_sequences_show_the_range_of_lengths(self, backend, xp):
        cache = empty_cache(backend, xp, batch=(4, 5))
        assert repr(cache).endswith("lengths=0 in all 20 sequences)")
        cache = KVCache(cache.keys, cache.values, np.arange(20, dtype=np.int32).reshape(4, 5))
        assert repr(cache).endswith("lengths=0-19 over 20 sequences)")
        assert str(cache) == repr(cache)

    @pytest.mark.backends("jax", reason="jax.jit only")
    def test_traced_lengths_are_not_read(self, backend, xp):
        import jax

        seen = []

        @jax.jit
        def step(cache):
            seen.append(repr(cache))
            return cache.lengths

        step(empty_cache(backend, xp))
        assert seen[0].endswith("lengths=traced)")


class TestDecoderBlock:
    """RoPE + GQA + causal attention through a KV cache, token by token."""

    @pytest.mark.backends("numpy", "torch", "jax", reason="the walkthrough's backends")
    def test_token_by_token_equals_full_sequence(self, backend, xp):
        d_model, h, hkv, dh, length = 16, 4, 2, 4, 7
        params = init_mha_params(
            xp, d_model, h, num_kv_heads=hkv, dtype=backend.dtype("float64"), device=backend.device
        )
        x = backend.asarray(randn(2, length, d_model))

        def project(x, w, b, heads):
            bias = xp.reshape(params[b], (1, 1, -1))  # at the rank of x @ w (JAX's option)
            y = xp.reshape(x @ params[w] + bias, (2, x.shape[1], heads, dh))
            return xp.permute_dims(y, (0, 2, 1, 3))

        def attend(x, positions, cache=None):
            q = apply_rope(project(x, "wq", "bq", h), positions)
            k = apply_rope(project(x, "wk", "bk", hkv), positions)
            v = project(x, "wv", "bv", hkv)
            if cache is None:
                out = scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                cache = kv_cache_append(cache, k, v)
                out = kv_cache_attention(q, cache)
            out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (2, x.shape[1], h * dh))
            return out @ params["wo"] + xp.reshape(params["bo"], (1, 1, -1)), cache

        full, _ = attend(x, backend.asarray(np.arange(length)))
        cache = kv_cache_init(
            xp,
            batch_shape=(2,),
            num_kv_heads=hkv,
            capacity=16,
            head_dim=dh,
            dtype=backend.dtype("float64"),
            device=backend.device,
        )
        steps = []
        for t in range(length):
            out, cache = attend(x[:, t : t + 1], backend.asarray(np.array([t])), cache)
            steps.append(backend.to_numpy(out))
        np.testing.assert_allclose(
            np.concatenate(steps, axis=1), backend.to_numpy(full), atol=1e-12
        )

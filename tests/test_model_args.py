"""Sequence lengths, ALiBi, score_mod and dropout, in the dense and the tiled path."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close
from _reference import reference_attention, reference_weights
from portable_attn import attention_weights, get_alibi_slopes, scaled_dot_product_attention

PATHS = [None, 3]  # dense, tiled with blocks that divide nothing


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def qkv(b=3, hq=4, hkv=2, lq=7, lk=9, d=6, seed=0):
    return (
        randn(b, hq, lq, d, seed=seed),
        randn(b, hkv, lk, d, seed=seed + 1),
        randn(b, hkv, lk, d, seed=seed + 2),
    )


def run(backend, q, k, v, block_size=None, **kw):
    conv = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    args = [backend.asarray(a) for a in (q, k, v)]
    out = scaled_dot_product_attention(*args, block_size=block_size, **conv)
    return out, attention_weights(*args[:2], **conv)


def check(backend, q, k, v, block_size, **kw):
    out, w = run(backend, q, k, v, block_size, **kw)
    assert_close(backend, out, reference_attention(q, k, v, **kw))
    assert_close(backend, w, reference_weights(q, k, **kw))
    return out, w


class TestLengths:
    @pytest.mark.parametrize("block_size", PATHS)
    @pytest.mark.parametrize(
        "which", ["both", "q_only", "kv_only"], ids=["both", "q_lengths", "kv_lengths"]
    )
    def test_padding_and_causal_alignment(self, backend, block_size, which):
        q, k, v = qkv()
        kw = {"is_causal": True}
        if which in ("both", "q_only"):
            kw["q_lengths"] = np.array([7, 3, 1])
        if which in ("both", "kv_only"):
            kw["kv_lengths"] = np.array([9, 5, 2])
        out, _ = check(backend, q, k, v, block_size, **kw)
        if "q_lengths" in kw:
            out = backend.to_numpy(out)
            assert np.all(out[1, :, 3:] == 0)
            assert np.all(out[2, :, 1:] == 0)

    @pytest.mark.parametrize("block_size", PATHS)
    def test_window_aligned_on_valid_lengths(self, backend, block_size):
        q, k, v = qkv()
        kw = {
            "window": (2, 0),
            "q_lengths": np.array([4, 7, 2]),
            "kv_lengths": np.array([6, 9, 9]),
        }
        check(backend, q, k, v, block_size, **kw)

    def test_padded_sequence_equals_the_unpadded_one(self, backend):
        q, k, v = qkv(b=1, lq=4, lk=6)
        qp, kp, vp = (np.pad(a, ((0, 0), (0, 0), (0, 3), (0, 0))) for a in (q, k, v))
        short, _ = run(backend, q, k, v, is_causal=True)
        padded, _ = run(
            backend, qp, kp, vp, is_causal=True, q_lengths=np.array([4]), kv_lengths=np.array([6])
        )
        padded = backend.to_numpy(padded)
        np.testing.assert_allclose(padded[:, :, :4], backend.to_numpy(short), atol=1e-13)
        assert np.all(padded[:, :, 4:] == 0)

    def test_lengths_must_be_integers(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv())
        with pytest.raises(TypeError, match=r"`kv_lengths` must be an integer array.*float64"):
            scaled_dot_product_attention(q, k, v, kv_lengths=backend.asarray(np.ones(3)))

    def test_lengths_must_broadcast_to_batch(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv())
        with pytest.raises(ValueError, match=r"`q_lengths` with shape \(2,\).*batch shape \(3,\)"):
            scaled_dot_product_attention(q, k, v, q_lengths=backend.asarray(np.array([1, 2])))

    def test_against_jax_dot_product_attention(self, backend):
        if backend.family != "jax":
            pytest.skip("peer comparison with jax.nn.dot_product_attention")
        import jax
        import jax.numpy as jnp

        q, k, v = qkv(hq=2, hkv=2, lq=9, lk=9)
        ql, kl = np.array([9, 6, 3]), np.array([9, 6, 3])
        ours, _ = run(backend, q, k, v, q_lengths=ql, kv_lengths=kl)
        t = lambda a: jnp.swapaxes(jnp.asarray(a), 1, 2)  # noqa: E731  (B, L, H, D) layout
        theirs = jax.nn.dot_product_attention(
            t(q),
            t(k),
            t(v),
            query_seq_lengths=jnp.asarray(ql, dtype=jnp.int32),
            key_value_seq_lengths=jnp.asarray(kl, dtype=jnp.int32),
        )
        theirs = np.swapaxes(np.asarray(theirs), 1, 2)
        ours = backend.to_numpy(ours)
        for b, n in enumerate(ql):  # jax leaves padded query rows unspecified; compare valid rows
            np.testing.assert_allclose(ours[b, :, :n], theirs[b, :, :n], atol=1e-6)  # f32 softmax


class TestAlibi:
    @pytest.mark.parametrize("block_size", PATHS)
    @pytest.mark.parametrize("per_batch", [False, True])
    def test_matches_oracle(self, backend, block_size, per_batch):
        q, k, v = qkv()
        slopes = get_alibi_slopes(4)
        if per_batch:
            slopes = np.stack([slopes, slopes * 2, slopes / 2])
        check(backend, q, k, v, block_size, alibi_slopes=slopes, is_causal=True)

    @pytest.mark.parametrize("block_size", PATHS)
    def test_with_lengths(self, backend, block_size):
        q, k, v = qkv()
        kw = {
            "alibi_slopes": get_alibi_slopes(4),
            "kv_lengths": np.array([9, 4, 6]),
            "q_lengths": np.array([7, 2, 5]),
            "is_causal": True,
        }
        check(backend, q, k, v, block_size, **kw)

    def test_standard_slopes(self, backend, xp):
        # the geometric sequence of the ALiBi paper: 2^(-8/n), 2^(-16/n), ...
        np.testing.assert_allclose(get_alibi_slopes(8), 2.0 ** (-np.arange(1, 9)))
        np.testing.assert_allclose(get_alibi_slopes(4), 2.0 ** (-2.0 * np.arange(1, 5)))
        # not a power of two (BLOOM): the 8 slopes of n=8, then every other slope of n=16
        twelve = get_alibi_slopes(12)
        np.testing.assert_allclose(twelve[:8], 2.0 ** (-np.arange(1, 9)))
        np.testing.assert_allclose(twelve[8:], 2.0 ** (-np.arange(1, 17) / 2)[0::2][:4])
        arr = get_alibi_slopes(6, xp=xp, device=backend.device)
        np.testing.assert_allclose(backend.to_numpy(arr), get_alibi_slopes(6))

    def test_bad_slope_shape(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv())
        with pytest.raises(ValueError, match=r"`alibi_slopes` with shape \(5,\)"):
            scaled_dot_product_attention(q, k, v, alibi_slopes=backend.asarray(np.ones(5)))


class TestScoreMod:
    @pytest.mark.parametrize("block_size", PATHS)
    def test_relative_position_bias(self, backend, xp, block_size):
        table = randn(32, seed=9)
        table_b = backend.asarray(table)

        def rel_bias(scores, b, h, q_idx, kv_idx):  # a learned table indexed by i - j
            return scores + _rel(xp, table_b, q_idx, kv_idx)

        def rel_bias_np(scores, b, h, q_idx, kv_idx):
            return scores + table[q_idx - kv_idx + 16]

        q, k, v = qkv()
        out, _ = run(backend, q, k, v, block_size, score_mod=rel_bias, is_causal=True)
        expected = reference_attention(q, k, v, score_mod=rel_bias_np, is_causal=True)
        assert_close(backend, out, expected)

    @pytest.mark.parametrize("block_size", PATHS)
    def test_expresses_alibi_and_softcap(self, backend, xp, block_size):
        q, k, v = qkv(lq=9, lk=9)
        slopes = get_alibi_slopes(4)
        s = backend.asarray(slopes)[:, None, None]

        def alibi_and_cap(scores, b, h, q_idx, kv_idx):
            dist = xp.astype(xp.abs(q_idx - kv_idx), scores.dtype)
            return 2.0 * xp.tanh((scores - s * dist) / 2.0)

        by_mod, _ = run(backend, q, k, v, block_size, score_mod=alibi_and_cap)
        # the same by hand: softcap applies before ALiBi in the built-in order, so compare
        # against the oracle with a score_mod written in NumPy
        expected = reference_attention(
            q,
            k,
            v,
            score_mod=lambda sc, b, h, i, j: 2.0 * np.tanh((sc - slopes[h] * np.abs(i - j)) / 2.0),
        )
        assert_close(backend, by_mod, expected)
        softcap_mod, _ = run(
            backend, q, k, v, block_size, score_mod=lambda sc, *_: 3.0 * xp.tanh(sc / 3.0)
        )
        builtin, _ = run(backend, q, k, v, block_size, softcap=3.0)
        np.testing.assert_allclose(
            backend.to_numpy(softcap_mod), backend.to_numpy(builtin), atol=1e-13
        )
        alibi_mod, _ = run(
            backend,
            q,
            k,
            v,
            block_size,
            score_mod=lambda sc, b, h, i, j: sc - s * xp.astype(xp.abs(i - j), sc.dtype),
        )
        alibi, _ = run(backend, q, k, v, block_size, alibi_slopes=slopes)
        np.testing.assert_allclose(
            backend.to_numpy(alibi_mod), backend.to_numpy(alibi), atol=1e-13
        )

    def test_batch_index(self, backend, xp):
        q, k, v = qkv()
        shift = np.array([0.0, 5.0, -5.0])
        shift_b = backend.asarray(shift)

        def per_batch(scores, b, h, q_idx, kv_idx):
            return scores + xp.take(shift_b, xp.reshape(b, (-1,)), axis=0)[:, None, None, None] * (
                xp.astype(kv_idx == 0, scores.dtype)
            )

        out, _ = run(backend, q, k, v, score_mod=per_batch)
        bias = shift[:, None, None, None] * (np.arange(9) == 0)
        assert_close(backend, out, reference_attention(q, k, v, bias=bias))

    def test_not_callable(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv())
        with pytest.raises(TypeError, match="`score_mod` must be callable"):
            scaled_dot_product_attention(q, k, v, score_mod=3)


def _rel(xp, table, q_idx, kv_idx):
    idx = q_idx - kv_idx + 16  # (bq, bk)
    flat = xp.take(table, xp.reshape(idx, (-1,)), axis=0)
    return xp.reshape(flat, idx.shape)


class TestDropout:
    @pytest.mark.parametrize("block_size", PATHS)
    def test_matches_oracle(self, backend, block_size):
        q, k, v = qkv()
        keep = np.random.default_rng(3).random((3, 4, 7, 9)) > 0.25
        check(backend, q, k, v, block_size, dropout_p=0.25, dropout_mask=keep, is_causal=True)

    def test_expected_output_is_unchanged(self, backend):
        # averaging over many keep-masks recovers the no-dropout output
        q, k, v = qkv(b=1, lq=3, lk=4)
        rng = np.random.default_rng(0)
        keep = rng.random((4000, 4, 3, 4)) > 0.5
        out, _ = run(
            backend, np.broadcast_to(q, (4000, 4, 3, 6)), k, v, dropout_p=0.5, dropout_mask=keep
        )
        plain, _ = run(backend, q, k, v)
        np.testing.assert_allclose(
            backend.to_numpy(out).mean(0), backend.to_numpy(plain)[0], atol=0.06
        )

    @pytest.mark.parametrize(
        ("p", "mask", "match"),
        [
            (0.5, None, "needs a `dropout_mask`"),
            (0.0, True, "needs a `dropout_mask`"),
            (1.0, True, r"must be in \[0, 1\)"),
            (-0.1, True, r"must be in \[0, 1\)"),
        ],
    )
    def test_bad_arguments(self, backend, p, mask, match):
        q, k, v = (backend.asarray(a) for a in qkv())
        m = None if mask is None else backend.asarray(np.ones((7, 9), dtype=bool))
        with pytest.raises(ValueError, match=match):
            scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_mask=m)


class TestGradients:
    @pytest.mark.parametrize(
        "kw",
        [
            {"alibi": True, "is_causal": True},
            {"lengths": True, "is_causal": True},
            {"dropout": True},
            {"score_mod": True},
        ],
        ids=["alibi", "lengths", "dropout", "score_mod"],
    )
    def test_tiled_gradients_match_dense(self, backend, xp, kw):
        if not backend.has_autodiff:
            pytest.skip(f"{backend.kind} has no automatic differentiation")
        kw = dict(kw)
        args = {}
        if kw.pop("alibi", False):
            args["alibi_slopes"] = backend.asarray(get_alibi_slopes(4))
        if kw.pop("lengths", False):
            args["q_lengths"] = backend.asarray(np.array([7, 3, 1]))
            args["kv_lengths"] = backend.asarray(np.array([9, 5, 2]))
        if kw.pop("dropout", False):
            args["dropout_p"] = 0.3
            args["dropout_mask"] = backend.asarray(
                np.random.default_rng(1).random((3, 4, 7, 9)) > 0.3
            )
        if kw.pop("score_mod", False):
            args["score_mod"] = lambda s, b, h, i, j: s * 0.5 + xp.astype(i >= j, s.dtype)
        cot = backend.asarray(randn(3, 4, 7, 6, seed=5))

        def loss(block_size):
            def f(q, k, v):
                out = scaled_dot_product_attention(q, k, v, block_size=block_size, **args, **kw)
                return xp.sum(out * cot)

            return f

        q, k, v = (backend.asarray(a) for a in qkv())
        dense = backend.grad(loss(None), q, k, v)
        tiled = backend.grad(loss(3), q, k, v)
        for d, t in zip(dense, tiled, strict=True):
            np.testing.assert_allclose(backend.to_numpy(t), backend.to_numpy(d), atol=1e-12)

    def test_alibi_slope_gradients(self, backend, xp):
        if not backend.has_autodiff:
            pytest.skip(f"{backend.kind} has no automatic differentiation")
        q, k, v = (backend.asarray(a) for a in qkv())

        def loss(block_size):
            def f(slopes):
                out = scaled_dot_product_attention(
                    q, k, v, alibi_slopes=slopes, is_causal=True, block_size=block_size
                )
                return xp.sum(out**2)

            return f

        slopes = backend.asarray(get_alibi_slopes(4))
        dense = backend.grad(loss(None), slopes)[0]
        tiled = backend.grad(loss(3), slopes)[0]
        np.testing.assert_allclose(backend.to_numpy(tiled), backend.to_numpy(dense), atol=1e-12)
        assert np.any(backend.to_numpy(dense) != 0)


class TestJit:
    @pytest.mark.parametrize("block_size", PATHS)
    def test_all_arguments_under_jit(self, backend, block_size):
        if backend.family != "jax":
            pytest.skip("jax.jit only")
        import jax

        q, k, v = (backend.asarray(a) for a in qkv())
        keep = backend.asarray(np.random.default_rng(1).random((3, 4, 7, 9)) > 0.3)
        ql, kl = backend.asarray(np.array([7, 3, 1])), backend.asarray(np.array([9, 5, 2]))
        slopes = backend.asarray(get_alibi_slopes(4))

        def f(q, k, v, ql, kl, slopes, keep):
            return scaled_dot_product_attention(
                q,
                k,
                v,
                q_lengths=ql,
                kv_lengths=kl,
                alibi_slopes=slopes,
                is_causal=True,
                dropout_p=0.3,
                dropout_mask=keep,
                block_size=block_size,
                score_mod=lambda s, b, h, i, j: s + 0.1 * h,
            )

        eager = f(q, k, v, ql, kl, slopes, keep)
        np.testing.assert_allclose(jax.jit(f)(q, k, v, ql, kl, slopes, keep), eager, atol=1e-13)

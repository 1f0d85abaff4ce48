"""portable_attn as Flax's attention_fn, against Flax's default attention, under jit."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from portable_attn.integrations.flax import attention_fn  # noqa: E402

B, L, F, H = 2, 10, 32, 4
X = jax.random.normal(jax.random.key(0), (B, L, F))
PAD = jnp.array([[1] * L, [1] * 6 + [0] * (L - 6)])  # the second sequence: 6 tokens
REAL = np.asarray(PAD, dtype=bool)
PADDING = nnx.make_attention_mask(PAD, PAD)  # float 1/0, (B, 1, L, L)
MASKS = {
    "padding": PADDING,
    "padding+causal": nnx.combine_masks(PADDING, nnx.make_causal_mask(PAD)),
    "boolean": PADDING.astype(bool),
}
ATOL = 2e-6


def close_on_real(got, want):
    np.testing.assert_allclose(np.asarray(got)[REAL], np.asarray(want)[REAL], atol=ATOL)


def nnx_pair(**kwargs):
    ref = nnx.MultiHeadAttention(
        num_heads=H, in_features=F, decode=False, rngs=nnx.Rngs(0), **kwargs
    )
    ours = nnx.clone(ref)
    ours.attention_fn = attention_fn
    return ref, ours


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("mask", list(MASKS))
def test_nnx_matches_default_under_jit(mask, num_kv_heads):
    ref, ours = nnx_pair(num_kv_heads=num_kv_heads)
    run = nnx.jit(lambda m, x, mask: m(x, mask=mask, deterministic=True))
    want, got = run(ref, X, MASKS[mask]), run(ours, X, MASKS[mask])
    close_on_real(got, want)
    # padded query rows see no key: zeros before the output projection, Flax's are uniform
    assert not np.allclose(np.asarray(got)[~REAL], np.asarray(want)[~REAL], atol=1e-3)


@pytest.mark.parametrize("lk", [L, 14, 6])
def test_nnx_is_causal_is_top_left(lk):
    ref, ours = nnx_pair()
    kv = jax.random.normal(jax.random.key(1), (B, lk, F))
    run = nnx.jit(lambda m, x, kv: m(x, kv, is_causal=True, deterministic=True))
    np.testing.assert_allclose(run(ours, X, kv), run(ref, X, kv), atol=ATOL)


@pytest.mark.parametrize("lk", [L, 14, 6])
def test_nnx_is_causal_sows_weights_over_every_key(lk):
    # issue 24: with Lq < Lk the keys cut for the output were cut from the weights too
    ref, ours = nnx_pair()
    kv = jax.random.normal(jax.random.key(1), (B, lk, F))
    for layer in (ref, ours):
        layer(X, kv, is_causal=True, deterministic=True, sow_weights=True)
    (w_ref,) = ref.attention_weights.get_value()
    (w_ours,) = ours.attention_weights.get_value()
    assert w_ours.shape == w_ref.shape == (B, H, L, lk)
    np.testing.assert_allclose(w_ours, w_ref, atol=ATOL)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_nnx_dropout_drops_what_flax_drops(num_kv_heads):
    ref, ours = nnx_pair(num_kv_heads=num_kv_heads, dropout_rate=0.4)
    mask = MASKS["padding+causal"]
    run = nnx.jit(lambda m, x, key: m(x, mask=mask, deterministic=False, rngs=nnx.Rngs(key)))
    want, got = run(ref, X, jax.random.key(5)), run(ours, X, jax.random.key(5))
    close_on_real(got, want)
    other = run(ours, X, jax.random.key(6))  # another key, other drops
    assert not np.allclose(got, other, atol=1e-3)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_linen_matches_default_with_dropout_under_jit(broadcast_dropout):
    kwargs = {"num_heads": H, "qkv_features": F, "dropout_rate": 0.3}
    kwargs["broadcast_dropout"] = broadcast_dropout
    ref = nn.MultiHeadDotProductAttention(**kwargs)
    ours = nn.MultiHeadDotProductAttention(**kwargs, attention_fn=attention_fn)
    params = ref.init(jax.random.key(1), X, deterministic=True)
    mask = MASKS["padding+causal"]

    def apply(module, deterministic):
        rngs = {"dropout": jax.random.key(3)}
        return jax.jit(
            lambda p, x: module.apply(p, x, mask=mask, deterministic=deterministic, rngs=rngs)
        )(params, X)

    for deterministic in (True, False):
        close_on_real(apply(ours, deterministic), apply(ref, deterministic))


def test_linen_passes_every_argument_the_signature_names():
    # Linen filters a custom attention_fn's keywords by its signature
    names = set(inspect.signature(attention_fn).parameters)
    assert {"mask", "dropout_rng", "dropout_rate", "deterministic", "dtype"} <= names
    assert {"bias", "broadcast_dropout", "precision", "module", "is_causal"} <= names


def test_bias_dtype_and_sown_weights():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, n, 4, 8)), jnp.float32) for n in (5, 7, 7))
    bias = jnp.asarray(rng.standard_normal((2, 4, 5, 7)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 5, 7)) > 0.2)
    want = nnx.dot_product_attention(q, k, v, bias=bias, mask=mask)
    got = jax.jit(lambda *a: attention_fn(*a, bias=bias, mask=mask))(q, k, v)
    np.testing.assert_allclose(got, want, atol=ATOL)
    half = attention_fn(q, k, v, bias=bias, mask=mask, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), want, atol=0.1)

    ref, ours = nnx_pair()
    ref(X, mask=PADDING, deterministic=True, sow_weights=True)
    ours(X, mask=PADDING, deterministic=True, sow_weights=True)
    (w_ref,) = ref.attention_weights.value
    (w_ours,) = ours.attention_weights.value
    assert w_ours.shape == (B, H, L, L)
    rows = np.broadcast_to(REAL[:, None, :, None], w_ref.shape)
    np.testing.assert_allclose(np.asarray(w_ours)[rows], np.asarray(w_ref)[rows], atol=ATOL)


def test_dropout_needs_a_key():
    q = jnp.zeros((1, 3, 2, 4))
    with pytest.raises(ValueError, match="dropout_rng"):
        attention_fn(q, q, q, dropout_rate=0.5, deterministic=False)

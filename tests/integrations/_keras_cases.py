"""The Keras cases, run by test_keras.py in one subprocess per backend (KERAS_BACKEND set).

Not collected on its own (no ``test_`` prefix): Keras picks its backend once, at import.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from portable_attn.integrations.keras import MultiHeadAttention  # noqa: E402

BACKEND = os.environ["KERAS_BACKEND"]
B, T, S, F = 2, 6, 8, 16
RNG = np.random.default_rng(0)
XQ = RNG.standard_normal((B, T, F)).astype("float32")
XV = RNG.standard_normal((B, S, F)).astype("float32")
MASK = np.ones((B, T, S), dtype=bool)
MASK[1, :, 5:] = False  # the second value sequence: 5 tokens
ATOL = 2e-6


def np_(x):
    return keras.ops.convert_to_numpy(x)


def pair(**kwargs):
    """Keras's layer and ours with the same weights (and the same dropout seed)."""
    kwargs = {"num_heads": 4, "key_dim": 8, "seed": 7, **kwargs}
    ref, ours = keras.layers.MultiHeadAttention(**kwargs), MultiHeadAttention(**kwargs)
    ref(XQ, XV, return_attention_scores=True)  # Keras's fused path fails for Dv != Dk on JAX
    ours(XQ, XV)
    ours.set_weights(ref.get_weights())
    return ref, ours


def test_is_a_keras_layer():
    layer = MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.1)
    assert isinstance(layer, keras.layers.MultiHeadAttention)
    clone = MultiHeadAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


@pytest.mark.parametrize("value_dim", [None, 12])
def test_padding_mask_and_scores(value_dim):
    ref, ours = pair(value_dim=value_dim)
    # Keras's scores path (einsum) runs for value_dim != key_dim on every backend
    want, want_scores = ref(XQ, XV, attention_mask=MASK, return_attention_scores=True)
    got, got_scores = ours(XQ, XV, attention_mask=MASK, return_attention_scores=True)
    np.testing.assert_allclose(np_(got), np_(want), atol=ATOL)
    assert got_scores.shape == (B, 4, T, S)
    np.testing.assert_allclose(np_(got_scores), np_(want_scores), atol=ATOL)
    plain = ours(XQ, XV, attention_mask=MASK)
    np.testing.assert_allclose(np_(plain), np_(want), atol=ATOL)


@pytest.mark.parametrize("kv_len", [T, S])
def test_use_causal_mask(kv_len):
    ref, ours = pair()
    xv = XV[:, :kv_len]
    want = ref(XQ, xv, use_causal_mask=True, return_attention_scores=True)[0]
    np.testing.assert_allclose(np_(ours(XQ, xv, use_causal_mask=True)), np_(want), atol=ATOL)


def test_dropout_drops_what_keras_drops():
    ref, ours = pair(dropout=0.4)
    want = ref(XQ, XV, attention_mask=MASK, training=True)
    got = ours(XQ, XV, attention_mask=MASK, training=True)
    np.testing.assert_allclose(np_(got), np_(want), atol=ATOL)
    inference = ours(XQ, XV, attention_mask=MASK)
    assert not np.allclose(np_(got), np_(inference), atol=1e-3)
    np.testing.assert_allclose(np_(inference), np_(ref(XQ, XV, attention_mask=MASK)), atol=ATOL)


def test_fully_masked_query_rows_have_zero_weights():
    _, ours = pair()
    mask = MASK.copy()
    mask[0, 2] = False  # query 2 of the first sequence sees nothing
    _, scores = ours(XQ, XV, attention_mask=mask, return_attention_scores=True)
    assert np.all(np_(scores)[0, :, 2] == 0)
    assert np.isfinite(np_(scores)).all()


def test_functional_model():
    ref, ours = pair()
    inputs = keras.Input((T, F))
    model = keras.Model(inputs, ours(inputs, inputs, use_causal_mask=True))
    want = ref(XQ, XQ, use_causal_mask=True)
    np.testing.assert_allclose(model.predict(XQ, verbose=0), np_(want), atol=ATOL)


def test_other_attention_axes_are_refused():
    layer = MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2))
    x = np.zeros((1, 3, 3, 4), "float32")
    with pytest.raises(ValueError, match="attention_axes"):
        layer(x, x)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.grad")
def test_jax_gradients_match():
    import jax

    ref, ours = pair()

    def loss(layer):
        def f(weights):
            outputs, _ = layer.stateless_call(weights, [], XQ, XV, attention_mask=MASK)
            return (outputs**2).sum()

        return jax.grad(f)([v.value for v in layer.trainable_variables])

    for g_ours, g_ref in zip(loss(ours), loss(ref), strict=True):
        np.testing.assert_allclose(np_(g_ours), np_(g_ref), atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="torch autograd")
def test_torch_gradients_match():
    ref, ours = pair()
    grads = []
    for layer in (ref, ours):
        out = layer(XQ, XV, attention_mask=MASK)
        (out**2).sum().backward()
        grads.append([np_(v.value.grad) for v in layer.trainable_variables])
    for g_ours, g_ref in zip(grads[1], grads[0], strict=True):
        np.testing.assert_allclose(g_ours, g_ref, atol=1e-5)

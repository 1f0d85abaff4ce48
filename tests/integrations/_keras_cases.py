"""The Keras cases, run by test_keras.py in one subprocess per backend (KERAS_BACKEND set).

Not collected on its own (no ``test_`` prefix): Keras picks its backend once, at import.
"""

from __future__ import annotations

import os
import subprocess
import sys

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


def projected(layer):
    """The heads the layer's call hands to ``_compute_attention``: (B, T|S, N, key_dim)."""
    return layer._query_dense(XQ), layer._key_dense(XV), layer._value_dense(XV)


@pytest.mark.parametrize("training", [False, True])
def test_causal_compute_attention_scores_cover_every_key(training):
    # issue 24: use_causal_mask=True with T < S returned scores of shape (B, N, T, T)
    ref, ours = pair(dropout=0.3 if training else 0.0)
    want, want_scores = ref._compute_attention(
        *projected(ref), None, training, True, use_causal_mask=True
    )
    got, got_scores = ours._compute_attention(
        *projected(ours), None, training, True, use_causal_mask=True
    )
    assert tuple(got_scores.shape) == tuple(want_scores.shape) == (B, 4, T, S)
    np.testing.assert_allclose(np_(got_scores), np_(want_scores), atol=ATOL)
    np.testing.assert_allclose(np_(got), np_(want), atol=ATOL)  # the same keys dropped


def test_functional_model_scores_shape():
    _, ours = pair()
    query, value = keras.Input((T, F)), keras.Input((S, F))
    outputs, scores = ours(query, value, return_attention_scores=True)
    assert tuple(scores.shape) == (None, 4, T, S)  # Keras's own layer says (None, 4, T, T)
    model = keras.Model([query, value], [outputs, keras.layers.Flatten()(scores)])
    _, flat = model.predict([XQ, XV], verbose=0)
    assert flat.shape == (B, 4 * T * S)


def _model(layer, **call):
    query, value = keras.Input((T, F)), keras.Input((S, F))
    return keras.Model([query, value], layer(query, value, **call))


def test_save_and_load(tmp_path):
    # issue 24: load_model raised "Could not locate class 'MultiHeadAttention'"
    ref, ours = pair()
    model = _model(ours, use_causal_mask=True)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    (layer,) = [layer for layer in loaded.layers if isinstance(layer, MultiHeadAttention)]
    assert layer.get_config() == ours.get_config()
    want = np_(ref(XQ, XV, use_causal_mask=True))
    np.testing.assert_allclose(np_(loaded([XQ, XV])), want, atol=ATOL)
    np.testing.assert_allclose(np_(model([XQ, XV])), want, atol=ATOL)
    # in a fresh process, importing the class (the documented recipe) is enough to load it
    np.save(tmp_path / "xq.npy", XQ)
    np.save(tmp_path / "xv.npy", XV)
    code = f"""
import numpy as np, keras
from portable_attn.integrations.keras import MultiHeadAttention
loaded = keras.models.load_model({str(path)!r})
assert any(isinstance(layer, MultiHeadAttention) for layer in loaded.layers)
xq, xv = np.load({str(tmp_path / "xq.npy")!r}), np.load({str(tmp_path / "xv.npy")!r})
np.save({str(tmp_path / "out.npy")!r}, keras.ops.convert_to_numpy(loaded([xq, xv])))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, atol=ATOL)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_precision_policies(policy, causal):
    # issue 24: the NumPy backend raised for mixed_bfloat16, where Keras's layer runs
    ref, ours = pair(dtype=policy)
    ulp = 2.0**-7 if "bfloat16" in policy else 2.0**-10  # at 1: a few of them apart
    calls = {"attention_mask": MASK, "use_causal_mask": causal, "return_attention_scores": True}
    (want, want_scores), (got, got_scores) = ref(XQ, XV, **calls), ours(XQ, XV, **calls)
    for a, b in ((got, want), (got_scores, want_scores)):
        assert keras.backend.standardize_dtype(a.dtype) == ref.compute_dtype
        assert keras.backend.standardize_dtype(b.dtype) == ref.compute_dtype
        a, b = (np_(keras.ops.cast(x, "float32")) for x in (a, b))
        np.testing.assert_allclose(a, b, rtol=4 * ulp, atol=4 * ulp)

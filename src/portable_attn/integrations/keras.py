"""portable_attn inside ``keras.layers.MultiHeadAttention``, on every Keras backend.

::

    import os
    os.environ["KERAS_BACKEND"] = "jax"  # or "torch", "numpy": before `import keras`
    from portable_attn.integrations.keras import MultiHeadAttention

    layer = MultiHeadAttention(num_heads=8, key_dim=64)  # the constructor of Keras's layer

:class:`MultiHeadAttention` is a subclass of ``keras.layers.MultiHeadAttention``
(same constructor, call signature, weights and ``get_config``) whose
``_compute_attention`` -- the hook Keras documents for replacing the attention
-- calls :func:`portable_attn.scaled_dot_product_attention` on the backend's
own arrays (``jax.Array``, ``torch.Tensor`` or ``numpy.ndarray``):

- Keras hands a subclass every mask folded into one boolean ``attention_mask``
  of shape (B, T, S) or (1, T, S) (query, value and key masks, the
  ``use_causal_mask`` triangle, ``sliding_window``); a ``use_causal_mask=True``
  argument, which Keras may pass instead when causality is the only mask, is
  **top-left** aligned (see
  :func:`~portable_attn.integrations._common.top_left_causal`);
- the scale is Keras's ``1 / sqrt(key_dim)``; ``value_dim`` may differ from
  ``key_dim`` on every backend (Keras's own fused path fails on JAX there);
- dropout (``training=True``, ``dropout > 0``) draws its keep-mask with
  ``keras.random.dropout`` from the layer's own seed generator, the draw
  Keras's layer makes, so the same seed drops the same weights;
- ``return_attention_scores=True`` returns the weights before dropout, shape
  (B, N, T, S), as Keras does (with ``use_causal_mask`` and ``T < S`` too);
  while a functional model is traced, their symbolic shape is (B, N, T, S)
  as well, where Keras's own layer declares (B, N, T, T);
- dtype policies (``mixed_float16``, ``mixed_bfloat16``): the attention runs
  in the layer's compute dtype, as Keras's does; on the NumPy backend, which
  has no array-API bfloat16, bfloat16 heads are computed in float32 and the
  results cast back to bfloat16;
- saving: the class is registered with Keras as
  ``"portable_attn>MultiHeadAttention"``, so a model saved with
  ``model.save(path)`` loads with ``keras.models.load_model(path)`` once this
  class has been imported (``from portable_attn.integrations.keras import
  MultiHeadAttention``, which registers it).

Only the default ``attention_axes`` of rank-3 inputs (B, T, dim) is supported;
other ``attention_axes`` raise ValueError when the layer is built. While a
functional model is being traced with symbolic ``KerasTensor`` inputs (which
are not arrays), Keras's own computation gives the shapes.

A query row that sees no key comes out as zeros; Keras's layer gives it
uniform weights.
"""

from __future__ import annotations

from typing import Any

from .._attention import attention_weights, scaled_dot_product_attention
from ._common import require, top_left_causal

__all__ = ["MultiHeadAttention"]  # noqa: F822 (made by the module __getattr__, below)

_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # The class derives from Keras's layer, so Keras is imported when the class is first used.
    if name == "MultiHeadAttention":
        return _multi_head_attention_class()
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _multi_head_attention_class() -> type:
    """Define the subclass of ``keras.layers.MultiHeadAttention`` once, on first use."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _define(require("keras", "keras"))
    return _CLASS


def _define(keras: Any) -> type:
    from array_api_compat import array_namespace

    ops = keras.ops

    class MultiHeadAttention(keras.layers.MultiHeadAttention):
        """``keras.layers.MultiHeadAttention`` with the attention computed by portable_attn.

        Same parameters and call as ``keras.layers.MultiHeadAttention``; see the
        module docstring for what differs.

        Raises
        ------
        ValueError
            When built with ``attention_axes`` other than the sequence axis of
            rank-3 inputs (B, T, dim).
        """

        def _build_attention(self, rank: int) -> None:
            super()._build_attention(rank)
            if rank != 4 or tuple(self._attention_axes) != (1,):
                msg = (
                    "portable_attn's MultiHeadAttention supports inputs (B, T, dim) with "
                    f"the default attention_axes; got projected rank {rank} and "
                    f"attention_axes={self._attention_axes}"
                )
                raise ValueError(msg)

        def _compute_attention(
            self,
            query: Any,
            key: Any,
            value: Any,
            attention_mask: Any = None,
            training: bool | None = None,
            return_attention_scores: bool = False,
            use_causal_mask: bool = False,
        ) -> tuple[Any, Any]:
            """Attention of the projected heads.

            Parameters
            ----------
            query : array, shape (B, T, N, key_dim)
                Projected queries.
            key : array, shape (B, S, N, key_dim)
                Projected keys.
            value : array, shape (B, S, N, value_dim)
                Projected values.
            attention_mask : array of bool, shape (B, T, S) or (1, T, S), optional
                True where a query may attend to a key.
            training : bool, optional
                Dropout is applied when true (and ``dropout > 0``).
            return_attention_scores : bool, default False
                Also return the weights (before dropout).
            use_causal_mask : bool, default False
                Top-left causal mask, ANDed with `attention_mask`.

            Returns
            -------
            attention_output : array, shape (B, T, N, value_dim)
                The attention of each head.
            attention_scores : array, shape (B, N, T, S), or None
                The weights when `return_attention_scores`.
            """
            if isinstance(query, keras.KerasTensor):  # symbolic tracing: shapes only
                return super()._compute_attention(
                    query,
                    key,
                    value,
                    attention_mask,
                    training,
                    return_attention_scores,
                    use_causal_mask=use_causal_mask,
                )
            dtype = query.dtype
            if _numpy_bfloat16(keras, query):
                # NumPy has no array-API bfloat16: compute in float32, return bfloat16
                query, key, value = (ops.cast(x, "float32") for x in (query, key, value))
            q, k, v = (ops.swapaxes(x, 1, 2) for x in (query, key, value))  # (B, N, L, D)
            mask = None
            if attention_mask is not None:
                mask = ops.expand_dims(ops.cast(attention_mask, "bool"), 1)  # (B|1, 1, T, S)
            keep, rate = None, float(self._dropout)
            if training and rate > 0.0:  # drawn over every key, as Keras's layer draws it
                shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                ones = ops.ones(shape, dtype=self.compute_dtype)
                kept = keras.random.dropout(ones, rate, seed=self._dropout_layer.seed_generator)
                keep = ops.not_equal(kept, 0)
            scale = self._inverse_sqrt_key_dim
            terms: dict[str, Any] = {"mask": mask, "is_causal": False, "scale": scale}
            weight_terms = terms  # the scores cover every key: (B, N, T, S)
            k_out, v_out = k, v
            if use_causal_mask:
                xp, q_len = array_namespace(k), q.shape[-2]
                k_out, v_out, mask_out, _, causal = top_left_causal(xp, k, v, mask, None, q_len)
                terms = {"mask": mask_out, "is_causal": causal, "scale": scale}
                if return_attention_scores:
                    _, _, mask_w, _, causal_w = top_left_causal(
                        xp, k, v, mask, None, q_len, cut=False
                    )
                    weight_terms = {"mask": mask_w, "is_causal": causal_w, "scale": scale}
                if keep is not None:
                    keep = keep[..., : k_out.shape[2]]  # the keys top_left_causal may have cut
            out = scaled_dot_product_attention(
                q,
                k_out,
                v_out,
                **terms,
                dropout_p=rate if keep is not None else 0.0,
                dropout_mask=keep,
            )
            out = ops.cast(ops.swapaxes(out, 1, 2), dtype)
            scores = None
            if return_attention_scores:
                scores = ops.cast(attention_weights(q, k, **weight_terms), dtype)
            return out, scores

        def compute_output_spec(
            self,
            query: Any,
            value: Any,
            key: Any = None,
            query_mask: Any = None,
            value_mask: Any = None,
            key_mask: Any = None,
            attention_mask: Any = None,
            return_attention_scores: bool = False,
            training: bool | None = None,
            use_causal_mask: bool = False,
        ) -> Any:
            """Declare the symbolic outputs, with scores of shape (B, N, T, S).

            Keras's own layer declares scores of shape (B, N, T, T), which is
            wrong when the value's length S differs from the query's T.

            Parameters
            ----------
            query, value, key : KerasTensor
                Shapes (B, T, dim), (B, S, dim), (B, S, dim).
            query_mask, value_mask, key_mask, attention_mask, training, use_causal_mask
                Unused: they do not change the shapes.
            return_attention_scores : bool, default False
                Also declare the scores.

            Returns
            -------
            KerasTensor, or (KerasTensor, KerasTensor)
                The output, shape (B, T, output dim), and the scores (B, N, T, S).
            """
            spec = super().compute_output_spec(query, value, key)
            if not return_attention_scores:
                return spec
            shape = (query.shape[0], self.num_heads, query.shape[1], value.shape[1])
            return spec, keras.KerasTensor(shape, dtype=self.compute_dtype)

    MultiHeadAttention.__module__ = __name__
    MultiHeadAttention.__qualname__ = "MultiHeadAttention"
    # registered as "portable_attn>MultiHeadAttention": keras.models.load_model finds it
    register = keras.saving.register_keras_serializable(package="portable_attn")
    return register(MultiHeadAttention)


def _numpy_bfloat16(keras: Any, x: Any) -> bool:
    """Whether `x` is a NumPy array of bfloat16 (Keras's NumPy backend, a bfloat16 policy)."""
    import numpy as np

    return isinstance(x, np.ndarray) and keras.backend.standardize_dtype(x.dtype) == "bfloat16"

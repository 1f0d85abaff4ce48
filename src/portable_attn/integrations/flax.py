"""portable_attn as the ``attention_fn`` of Flax's multi-head attention layers.

::

    from portable_attn.integrations.flax import attention_fn

    layer = flax.nnx.MultiHeadAttention(..., attention_fn=attention_fn)
    layer = flax.linen.MultiHeadDotProductAttention(..., attention_fn=attention_fn)

:func:`attention_fn` has the signature of ``flax.nnx.dot_product_attention``
(Linen passes a custom ``attention_fn`` only the keyword arguments its
signature names, so a ``**kwargs`` wrapper would silently receive no mask and
no dropout arguments). What Flax means by its arguments, and what is passed on:

- layout ``(batch..., L, H, D)`` (BTNH), moved to our ``(batch..., H, L, D)``
  and back; grouped-query K/V (``num_kv_heads``) are not repeated;
- ``mask``: float 1/0 (``make_attention_mask``, ``make_causal_mask``) or
  boolean, nonzero = attend; ``bias``: additive;
- ``is_causal`` (NNX): **top-left** aligned, see
  :func:`~portable_attn.integrations._common.top_left_causal`;
- dropout: with ``deterministic=False`` and ``dropout_rate > 0`` the keep-mask
  is drawn from ``dropout_rng`` exactly as Flax's own ``dot_product_attention``
  draws it (``broadcast_dropout`` shares it over batch and heads), so the same
  key drops the same weights;
- ``dtype``: the inputs are cast to it (default: their promoted dtype); the
  softmax is computed in at least float32 either way;
- ``precision``: applied to the matmuls with ``jax.default_matmul_precision``;
- ``module``: with ``sow_weights=True`` the weights (after softmax, before
  dropout) are sown as ``attention_weights``, as Flax does, of shape
  ``(batch..., Hq, Lq, Lk)`` (every key, with ``is_causal`` too).

Linen's ``force_fp32_for_softmax`` (always true here) and its quantization
einsum hooks are not in the signature, so Linen does not pass them.

A query row that sees no key (a padding query) comes out as zeros; Flax's
default gives it uniform weights. Everything is shape-static: it runs under
``jax.jit`` and ``nnx.jit``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._attention import attention_weights, scaled_dot_product_attention
from ._common import require, top_left_causal

__all__ = ["attention_fn"]

Array = Any


def attention_fn(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    module: Any | None = None,
    is_causal: bool = False,
) -> Array:
    """Dot-product attention by portable_attn, with Flax's signature and conventions.

    Parameters
    ----------
    query : jax.Array, shape (batch..., Lq, Hq, Dk)
        Queries.
    key : jax.Array, shape (batch..., Lk, Hkv, Dk)
        Keys; ``Hq`` a multiple of ``Hkv``.
    value : jax.Array, shape (batch..., Lk, Hkv, Dv)
        Values.
    bias : jax.Array, broadcastable to (batch..., Hq, Lq, Lk), optional
        Added to the logits.
    mask : jax.Array, broadcastable to (batch..., Hq, Lq, Lk), optional
        Float or boolean; nonzero (True) where a query may attend to a key.
    broadcast_dropout : bool, default True
        One keep-mask of shape (Lq, Lk) for every batch entry and head.
    dropout_rng : jax.Array, optional
        PRNG key for the keep-mask; needed when dropout is applied.
    dropout_rate : float, default 0.0
        Probability of dropping a weight.
    deterministic : bool, default False
        True: no dropout.
    dtype : dtype, optional
        Cast `query`, `key` and `value` to it; default their promoted dtype.
    precision : jax.lax.Precision or str, optional
        Matmul precision (``jax.default_matmul_precision``).
    module : flax.nnx.Module or flax.linen.Module, optional
        Where Flax asks for the attention weights to be sown.
    is_causal : bool, default False
        Top-left aligned causal mask (query ``i`` sees key ``j`` iff ``j <= i``).

    Returns
    -------
    jax.Array, shape (batch..., Lq, Hq, Dv)
        In `dtype` (or the promoted dtype of the inputs).

    Raises
    ------
    ValueError
        Dropout is requested without `dropout_rng`.
    """
    jax = require("jax", "flax")
    import jax.numpy as jnp
    from array_api_compat import array_namespace

    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    q, k, v = (jnp.swapaxes(jnp.asarray(x, dtype), -3, -2) for x in (query, key, value))
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    if bias is not None:
        bias = jnp.asarray(bias, dtype)
    keep = None
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            msg = "dropout_rng is required when deterministic=False and dropout_rate > 0"
            raise ValueError(msg)
        lengths = (q.shape[-2], k.shape[-2])
        # the shape Flax's dot_product_attention_weights draws, so the same key drops the same
        shape = (1,) * (q.ndim - 2) + lengths if broadcast_dropout else (*q.shape[:-1], lengths[1])
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
    terms: dict[str, Any] = {"mask": mask, "bias": bias, "is_causal": False}
    weight_terms = terms  # the sown weights cover every key: (batch..., Hq, Lq, Lk)
    k_out, v_out = k, v
    if is_causal:
        xp, q_len = array_namespace(k), q.shape[-2]
        k_out, v_out, mask_out, bias_out, causal = top_left_causal(xp, k, v, mask, bias, q_len)
        terms = {"mask": mask_out, "bias": bias_out, "is_causal": causal}
        if module is not None:
            _, _, mask_w, bias_w, causal_w = top_left_causal(
                xp, k, v, mask, bias, q_len, cut=False
            )
            weight_terms = {"mask": mask_w, "bias": bias_w, "is_causal": causal_w}
        if keep is not None:
            keep = keep[..., : k_out.shape[-2]]  # the keys top_left_causal may have cut
    context = (
        contextlib.nullcontext()
        if precision is None
        else jax.default_matmul_precision(_precision_name(precision))
    )
    with context:
        if module is not None:
            _sow(module, attention_weights(q, k, **weight_terms))
        out: Array = scaled_dot_product_attention(
            q,
            k_out,
            v_out,
            **terms,
            dropout_p=dropout_rate if keep is not None else 0.0,
            dropout_mask=keep,
        )
    return jnp.swapaxes(out, -3, -2)


def _precision_name(precision: Any) -> str:
    """``jax.default_matmul_precision`` wants a name: "default", "high", "highest"."""
    name = getattr(precision, "name", precision)
    if not isinstance(name, str):
        msg = f"precision must be a jax.lax.Precision or its name, got {precision!r}"
        raise ValueError(msg)
    return name.lower()


def _sow(module: Any, weights: Array) -> None:
    """Sow the attention weights where Flax's own attention sows them."""
    nnx = require("flax.nnx", "flax")
    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:  # a Linen module
        module.sow("intermediates", "attention_weights", weights)

"""Multi-head attention layers built on :func:`scaled_dot_product_attention`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._attention import scaled_dot_product_attention
from ._lib._compat import array_namespace, namespace_or_numpy, on_device
from ._lib._masks import at_rank
from ._lib._validation import check_count

__all__ = ["init_mha_params", "multi_head_attention"]


def init_mha_params(
    *args: Any,
    xp: Any = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_input_dim: int | None = None,
    bias: bool = True,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initialise the projection weights of :func:`multi_head_attention`.

    Weights are drawn uniformly from ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` (as
    ``torch.nn.Linear`` does) by NumPy's ``default_rng(seed)``, then moved to the
    target namespace; biases start at zero.

    Parameters
    ----------
    d_model : int
        Width of the query input and of the output.
    num_heads : int
        Query heads ``H``.
    num_kv_heads : int, optional
        Key/value heads ``Hkv`` (grouped-query attention); default `num_heads`.
    head_dim : int, optional
        ``Dk = Dv``; default ``d_model // num_heads``.
    kv_input_dim : int, optional
        Width of the key/value input (cross-attention); default `d_model`.
    bias : bool, default True
        Whether to create ``bq, bk, bv, bo``.
    seed : int, default 0
        Seed of the NumPy generator.
    dtype, device : optional
        Of the arrays; float32 by default.
    xp : namespace, optional
        Target array namespace; NumPy when omitted. (The older form
        ``init_mha_params(xp, d_model, num_heads)`` is deprecated.)

    Returns
    -------
    dict
        ``wq (d_model, H·Dk)``, ``wk (d_kv, Hkv·Dk)``, ``wv (d_kv, Hkv·Dv)``,
        ``wo (H·Dv, d_model)`` and, with `bias`, ``bq, bk, bv, bo``.
    """
    legacy = args[0] if len(args) == 3 else None
    if len(args) not in (2, 3):
        msg = f"init_mha_params() takes d_model and num_heads, but got {len(args)} positional"
        raise TypeError(msg)
    d_model = check_count("d_model", args[-2], minimum=1)
    num_heads = check_count("num_heads", args[-1], minimum=1)
    xp = namespace_or_numpy(xp, caller="init_mha_params", positional=legacy)
    if num_kv_heads is not None:
        num_kv_heads = check_count("num_kv_heads", num_kv_heads, minimum=1)
    if head_dim is None and d_model % num_heads:
        msg = (
            f"`num_heads` ({num_heads}) must divide `d_model` ({d_model}) when `head_dim` "
            "is not given"
        )
        raise ValueError(msg)
    hkv = num_heads if num_kv_heads is None else num_kv_heads
    dh = d_model // num_heads if head_dim is None else head_dim
    d_kv = d_model if kv_input_dim is None else kv_input_dim
    rng = np.random.default_rng(seed)

    def uniform(fan_in: int, fan_out: int) -> np.ndarray:
        bound = 1.0 / math.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=(fan_in, fan_out))

    params = {
        "wq": uniform(d_model, num_heads * dh),
        "wk": uniform(d_kv, hkv * dh),
        "wv": uniform(d_kv, hkv * dh),
        "wo": uniform(num_heads * dh, d_model),
    }
    if bias:
        params |= {
            "bq": np.zeros(num_heads * dh),
            "bk": np.zeros(hkv * dh),
            "bv": np.zeros(hkv * dh),
            "bo": np.zeros(d_model),
        }
    dtype = xp.float32 if dtype is None else dtype
    return {name: xp.asarray(a, dtype=dtype, **on_device(device)) for name, a in params.items()}


def _check_projection(name: str, x: Any, w_name: str, w: Any, heads: int) -> None:
    """`x` (..., L, d) fits `w` (d, heads * D), whose width splits into `heads` heads."""
    if x.ndim < 2 or x.shape[-1] != w.shape[0]:
        msg = (
            f"`{name}` axis -1 must match `params['{w_name}']` axis 0, but got {name} shape "
            f"{tuple(x.shape)} and {w_name} shape {tuple(w.shape)}"
        )
        raise ValueError(msg)
    if w.shape[-1] % heads:
        msg = (
            f"`params['{w_name}']` width {w.shape[-1]} (axis -1, shape {tuple(w.shape)}) "
            f"does not split into {heads} heads"
        )
        raise ValueError(msg)


def _project(xp: Any, x: Any, w: Any, b: Any | None, heads: int) -> Any:
    """``x @ w + b`` split into heads: (..., L, d) -> (..., L, heads, D)."""
    y = xp.matmul(x, w)  # (..., L, heads*D)
    if b is not None:
        y = y + at_rank(xp, b, y.ndim)
    return xp.reshape(y, (*y.shape[:-1], heads, y.shape[-1] // heads))


def multi_head_attention(
    query_input: Any,
    key_input: Any | None = None,
    value_input: Any | None = None,
    *,
    params: dict[str, Any],
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any | None = None,
    is_causal: bool = False,
    **attention_kwargs: Any,
) -> Any:
    """Multi-head (and grouped-query) attention with input and output projections.

    ``out = merge(attention(split(x Wq + bq), split(kv Wk + bk), split(kv Wv + bv))) Wo + bo``

    Parameters
    ----------
    query_input : array, shape (B..., Lq, d_model)
        Query sequence.
    key_input, value_input : array, shape (B..., Lk, d_kv), optional
        Key and value sequences (cross-attention); both default to `query_input`
        (self-attention), and `value_input` defaults to `key_input`.
    params : dict
        As made by :func:`init_mha_params`; biases are optional.
    num_heads : int
        Query heads ``H``.
    num_kv_heads : int, optional
        Key/value heads; fewer than `num_heads` gives grouped-query attention.
    mask : array of bool, broadcastable to (B..., H, Lq, Lk), optional
        True = may attend. For a key padding mask of shape (B, Lk) with True =
        padding (PyTorch's convention) pass ``~key_padding_mask[:, None, None, :]``.
    is_causal : bool, default False
        Bottom-right aligned causal mask.
    **attention_kwargs
        Passed to :func:`scaled_dot_product_attention` (``bias``, ``window``,
        ``softcap``, ``block_size``, ``alibi_slopes``, ``dropout_p``, ...); not
        ``layout``: the inputs are (B..., L, d_model), and the heads are split
        here, (B..., L, H, D), and handed on as ``layout="blhd"``.

    Returns
    -------
    array, shape (B..., Lq, d_model)
    """
    if "layout" in attention_kwargs:
        msg = (
            "multi_head_attention() takes no `layout`: its inputs are (B..., L, d_model) "
            "sequences, whose heads it splits itself"
        )
        raise TypeError(msg)
    key_input = query_input if key_input is None else key_input
    value_input = key_input if value_input is None else value_input
    xp = array_namespace(query_input=query_input, key_input=key_input, value_input=value_input)
    num_heads = check_count("num_heads", num_heads, minimum=1)
    hkv = (
        num_heads if num_kv_heads is None else check_count("num_kv_heads", num_kv_heads, minimum=1)
    )
    if not isinstance(params, dict):
        msg = f"`params` must be a dict of arrays (see init_mha_params), but got {type(params)}"
        raise TypeError(msg)
    missing = [n for n in ("wq", "wk", "wv", "wo") if n not in params]
    if missing:
        msg = f"`params` is missing {missing}; make it with init_mha_params"
        raise ValueError(msg)
    _check_projection("query_input", query_input, "wq", params["wq"], num_heads)
    _check_projection("key_input", key_input, "wk", params["wk"], hkv)
    _check_projection("value_input", value_input, "wv", params["wv"], hkv)
    q = _project(xp, query_input, params["wq"], params.get("bq"), num_heads)  # (..., Lq, H, Dk)
    k = _project(xp, key_input, params["wk"], params.get("bk"), hkv)  # (..., Lk, Hkv, Dk)
    v = _project(xp, value_input, params["wv"], params.get("bv"), hkv)  # (..., Lk, Hkv, Dv)
    out: Any = scaled_dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, layout="blhd", **attention_kwargs
    )  # (..., Lq, H, Dv)
    out = xp.reshape(out, (*out.shape[:-2], out.shape[-2] * out.shape[-1]))  # (..., Lq, H*Dv)
    out = xp.matmul(out, params["wo"])  # (..., Lq, d_model)
    if params.get("bo") is not None:
        out = out + at_rank(xp, params["bo"], out.ndim)
    return out

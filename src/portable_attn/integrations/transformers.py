"""portable_attn as an ``attn_implementation`` of Hugging Face transformers.

::

    from portable_attn.integrations.transformers import register

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())

:func:`register` puts two functions under one name: :func:`attention_forward` in
``transformers.AttentionInterface`` (what each attention layer calls) and
transformers' own ``sdpa_mask`` in ``transformers.AttentionMaskInterface`` (what
the model calls once to build the masks). Without the mask function a model
gets no mask at all (``masking_utils`` returns None for a name it does not
know): padding, causal structure and sliding windows would be silently lost.

``sdpa_mask`` gives a boolean mask, True = attend, of shape (B, 1, Lq, Lk) --
our convention -- with padding, causality, sliding windows and the cache
offsets in it; or None where the mask is plain causal or empty, leaving the
structure to the attention function, exactly as transformers' "sdpa" does. So
:func:`attention_forward` reads ``attention_mask=None`` as HF's "sdpa" does:

- the layer is causal (``is_causal`` argument, else ``module.is_causal``,
  default True) and ``Lq > 1``: **top-left** causal. With a static cache the
  prefill has ``Lq < Lk`` (the cache's empty slots follow); the keys are cut
  to the first ``Lq`` (see :func:`~portable_attn.integrations._common.top_left_causal`);
- ``Lq == 1`` (a decoding step with the dynamic cache) or an encoder: every
  key is visible.

A floating mask (a custom 4-D mask, 0 / large negative) is an additive bias;
``position_bias`` (T5-style) is added to it. HF's ``scaling``, ``softcap``
(Gemma2's soft-capping, which HF's "sdpa" refuses), gpt-oss's attention
sinks (``s_aux``) and training ``dropout`` are passed on. Grouped-query K/V
are not repeated. The result is what HF expects: ``(attn_output of shape
(B, Lq, Hq, Dv), None)``; attention weights are not returned (use
``attn_implementation="eager"`` for ``output_attentions``). Masked calls take
the library's default path, which on torch is SDPA for everything it can
express (not softcap, sinks or dropout).

Current families (Llama 4, Gemma 3, gpt-oss, Qwen3, Qwen2-VL, DeepSeek V3,
ModernBERT) are checked end to end against "eager" in
``tests/integrations/test_architectures.py``.

A query row that sees no key (a left-padding position) comes out as zeros, as
with torch SDPA; HF "eager" gives it uniform weights. Only padding positions
differ, and their outputs are not used.
"""

from __future__ import annotations

from typing import Any

from .._attention import scaled_dot_product_attention
from ._common import require, top_left_causal

__all__ = ["attention_forward", "register"]

Tensor = Any


def register(name: str = "portable_attn") -> str:
    """Register portable_attn with transformers under `name`, and return the name.

    Afterwards ``AutoModel*.from_pretrained(..., attn_implementation=name)``,
    ``AutoModel*.from_config(config, attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` use it. Registering again under the
    same name replaces the earlier registration.

    ``from_config`` writes ``attn_implementation`` into the config object it is
    given, and the model keeps that object: two ``from_config`` calls with one
    config (say ``"eager"`` and `name`, to compare them) silently give both
    models the last setting. Give each model its own ``copy.deepcopy(config)``.

    Parameters
    ----------
    name : str, default "portable_attn"
        The ``attn_implementation`` name. Names containing ``"sdpa"`` or
        ``"flash"`` are refused: transformers treats them as its own kernels.

    Returns
    -------
    str
        `name`.

    Raises
    ------
    ImportError
        transformers is not installed (``pip install "portable-attn[transformers]"``).
    ValueError
        `name` is empty, ``"eager"``, or contains ``"sdpa"``, ``"flash"`` or ``"flex"``.

    Examples
    --------
    >>> from portable_attn.integrations.transformers import register
    >>> register()  # doctest: +SKIP
    'portable_attn'
    """
    transformers = require("transformers", "transformers")
    if not isinstance(name, str) or not name or name == "eager":
        msg = f"`name` must be a non-empty string other than 'eager', got {name!r}"
        raise ValueError(msg)
    reserved = [word for word in ("sdpa", "flash", "flex", "paged") if word in name]
    if reserved:
        msg = (
            f"`name` {name!r} contains {reserved[0]!r}: transformers checks such names "
            "as its own kernels; choose another name"
        )
        raise ValueError(msg)
    from transformers.masking_utils import sdpa_mask

    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    position_bias: Tensor | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Compute the attention of a transformers layer (``AttentionInterface`` signature).

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer; its ``is_causal`` (default True) is read
        when `is_causal` is None.
    query : torch.Tensor, shape (B, Hq, Lq, Dk)
        Queries.
    key : torch.Tensor, shape (B, Hkv, Lk, Dk)
        Keys; ``Hq`` a multiple of ``Hkv`` (not repeated).
    value : torch.Tensor, shape (B, Hkv, Lk, Dv)
        Values; ``Dv`` may differ from ``Dk`` (DeepSeek's multi-head latent
        attention).
    attention_mask : torch.Tensor, broadcastable to (B, Hq, Lq, Lk), or None
        Boolean (True = attend) as built by ``sdpa_mask``, or floating and
        additive; None: see the module docstring (top-left causal for a causal
        layer with ``Lq > 1``, nothing otherwise).
    dropout : float, default 0.0
        Dropout probability on the weights (HF passes it only in training);
        the keep-mask is drawn with torch's global generator.
    scaling : float, optional
        Logit scale; default ``Dk ** -0.5``.
    is_causal : bool, optional
        Overrides ``module.is_causal``.
    softcap : float, optional
        Logit soft-capping ``softcap * tanh(logits / softcap)``.
    position_bias : torch.Tensor, broadcastable to (B, Hq, Lq, Lk), optional
        Additive bias (T5-style relative positions).
    s_aux : torch.Tensor, shape (Hq,), optional
        Attention sinks (gpt-oss's learned ``sinks``): passed as our `sinks`,
        one logit per head in every row's denominator (not scaled or masked,
        as in HF eager).
    **kwargs
        The rest of the model's keyword arguments, ignored: ``sliding_window``
        among them (sliding windows and Llama 4's attention chunks are already
        in the mask that the registered mask function builds).

    Returns
    -------
    attn_output : torch.Tensor, shape (B, Lq, Hq, Dv)
        Contiguous.
    attn_weights : None
        Not computed.
    """
    import torch
    from array_api_compat import array_namespace

    mask, bias = None, position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        elif not attention_mask.is_floating_point():  # as a bias, 0/1 would hide nothing
            msg = (
                f"`attention_mask` has dtype {attention_mask.dtype}: pass a boolean mask "
                "(True = attend; `attention_mask != 0` for a 0/1 padding mask) or an additive "
                "floating mask"
            )
            raise TypeError(msg)
        else:
            mask_bias = attention_mask.to(query.dtype)
            bias = mask_bias if bias is None else bias + mask_bias
    causal = False
    q_len = query.shape[-2]
    if attention_mask is None:
        layer_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if layer_causal and q_len > 1:
            xp = array_namespace(key)
            key, value, mask, bias, causal = top_left_causal(xp, key, value, None, bias, q_len)
    keep = None
    if dropout > 0.0:
        shape = (query.shape[0], query.shape[1], q_len, key.shape[-2])
        keep = torch.rand(shape, device=query.device) >= dropout
    out: Any = scaled_dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=causal,
        scale=scaling,
        softcap=softcap,
        dropout_p=dropout if keep is not None else 0.0,
        dropout_mask=keep,
        sinks=s_aux,
    )
    return out.transpose(1, 2).contiguous(), None

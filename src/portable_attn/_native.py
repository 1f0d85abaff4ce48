"""Routing to the frameworks' own fused kernels, where they agree with our contract.

This is the one module that calls framework-specific attention:
``torch.nn.functional.scaled_dot_product_attention`` and
``jax.nn.dot_product_attention``. What is routed there is exactly what the
portable path computes: every mask (user mask, bottom-right causal, window,
lengths) is folded into one boolean "allowed" array built by the portable
index arithmetic, and rows that see no key are given a harmless all-visible
mask for the kernel and zeroed afterwards (the kernels would otherwise return
NaN or uniform rows there), so their gradients are zero too.

Routing table (``implementation=``):

=================  ==============================  =====================================
call               ``"native"``                    ``None`` (default)
=================  ==============================  =====================================
torch              SDPA (``enable_gqa``; masks     SDPA when there is no mask, bias,
                   and bias as ``attn_mask``)      lengths or window and causal only
                                                   with Lq == Lk (the fused kernels);
                                                   portable otherwise
jax                ``jax.nn.dot_product_attention``  portable (on CPU the XLA kernel is
                   (needs Dv == Dk; its softmax is   slower than the portable path)
                   float32 even for float64)
numpy, cupy, ...   error: no native kernel         portable
softcap,           error: not expressible          portable
score_mod, ALiBi,
dropout, weights
=================  ==============================  =====================================
"""

from __future__ import annotations

import math
from typing import Any

from ._lib._compat import library_name
from ._lib._scores import AttentionPlan, ScoreTerms, allowed_block

__all__ = ["native_attention", "native_unsupported_reason", "prefer_native"]


def native_unsupported_reason(
    lib: str, plan: AttentionPlan, terms: ScoreTerms, tiles: Any
) -> str | None:
    """Why a call cannot go to the native kernel of `lib`, or None when it can."""
    if lib not in ("torch", "jax"):
        return f"there is no native attention kernel for {lib} arrays (torch and jax only)"
    unsupported = [
        name
        for name, used in (
            ("softcap", plan.softcap is not None),
            ("score_mod", terms.score_mod is not None),
            ("alibi_slopes", terms.alibi_slopes is not None),
            ("dropout_mask", terms.dropout_keep is not None),
            ("block_size (the portable tiled path)", tiles is not None),
        )
        if used
    ]
    if unsupported:
        return f"the native kernel cannot express {', '.join(unsupported)}"
    if lib == "jax" and plan.value_dim != plan.key_dim:
        return (
            "jax.nn.dot_product_attention needs `value` axis -1 (Dv) == `key` axis -1 "
            f"(Dk), but got Dv={plan.value_dim} and Dk={plan.key_dim}"
        )
    return None


def prefer_native(lib: str, plan: AttentionPlan, terms: ScoreTerms, bias: Any) -> bool:
    """Decide the default routing: native only where measured faster (torch's fused kernels)."""
    if lib != "torch":
        return False
    plain = terms.mask is None and bias is None and not plan.has_lengths
    return plain and plan.window is None and (not plan.is_causal or plan.q_len == plan.kv_len)


def _visibility(xp: Any, allowed: Any | None, bias: Any | None, shape: tuple[int, ...]) -> Any:
    """Rows (…, Lq, 1) that see at least one key with a finite score."""
    ok = None if allowed is None else xp.broadcast_to(allowed, shape)
    if bias is not None:
        finite = xp.broadcast_to(bias > -xp.inf, shape)
        ok = finite if ok is None else xp.logical_and(ok, finite)
    return None if ok is None else xp.any(ok, axis=-1, keepdims=True)


def native_attention(
    xp: Any, q: Any, k: Any, v: Any, bias: Any | None, terms: ScoreTerms, plan: AttentionPlan
) -> Any:
    """Attention by the framework kernel: (*batch, Hq, Lq, Dv) in the compute dtype."""
    lib = library_name(q)
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    shape = (*plan.batch, plan.num_q_heads, plan.q_len, plan.kv_len)
    # the kernels' own causal flags are top-left aligned: ours is passed as a mask,
    # unless Lq == Lk where both alignments agree and the fused causal kernel can be used
    kernel_causal = plan.is_causal and plan.q_len == plan.kv_len and plan.window is None
    structural = not kernel_causal
    allowed = allowed_block(xp, terms, plan, whole_q, whole_k, structural=structural)
    if kernel_causal and (allowed is not None or bias is not None):
        allowed = allowed_block(xp, terms, plan, whole_q, whole_k)  # fold causal in too
        kernel_causal = False
    visible = _visibility(xp, allowed, bias, shape)  # (..., Hq, Lq, 1) or None
    if visible is not None:  # give empty rows something finite to chew on, zero them later
        if allowed is not None:
            allowed = xp.logical_or(allowed, xp.logical_not(visible))
        if bias is not None:
            bias = xp.where(visible, bias, 0.0)
    if lib == "torch":
        out = _torch(xp, q, k, v, allowed, bias, plan, kernel_causal, shape)
    else:
        out = _jax(xp, q, k, v, allowed, bias, plan, kernel_causal, shape)
    return out if visible is None else xp.where(visible, out, 0.0)


def _torch(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any,
    plan: AttentionPlan,
    causal: bool,
    shape: tuple[int, ...],
) -> Any:
    import torch.nn.functional as F

    batch = plan.batch
    q = xp.broadcast_to(q, (*batch, *q.shape[-3:]))
    k = xp.broadcast_to(k, (*batch, *k.shape[-3:]))
    v = xp.broadcast_to(v, (*batch, *v.shape[-3:]))
    attn_mask = None
    if bias is not None:
        attn_mask = bias if allowed is None else xp.where(allowed, bias, -xp.inf)
        attn_mask = xp.astype(attn_mask, q.dtype)
    elif allowed is not None:
        attn_mask = allowed
    gqa = plan.num_q_heads != plan.num_kv_heads
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, scale=plan.scale, enable_gqa=gqa
    )


def _jax(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any,
    plan: AttentionPlan,
    causal: bool,
    shape: tuple[int, ...],
) -> Any:
    import jax

    n = math.prod(plan.batch)

    def btnh(x: Any) -> Any:  # (*batch, N, T, H) -> (B, T, N, H)
        x = xp.reshape(xp.broadcast_to(x, (*plan.batch, *x.shape[-3:])), (n, *x.shape[-3:]))
        return xp.permute_dims(x, (0, 2, 1, 3))

    def bnts(x: Any | None) -> Any | None:  # broadcast to (B, N|1, T, S)
        if x is None:
            return None
        heads = x.shape[-3] if x.ndim >= 3 else 1
        x = xp.broadcast_to(x, (*plan.batch, heads, plan.q_len, plan.kv_len))
        return xp.reshape(x, (n, heads, plan.q_len, plan.kv_len))

    out = jax.nn.dot_product_attention(
        btnh(q),
        btnh(k),
        btnh(v),
        bias=bnts(bias),
        mask=bnts(allowed),
        scale=plan.scale,
        is_causal=causal,
    )
    out = xp.permute_dims(out, (0, 2, 1, 3))  # (B, N, T, H)
    return xp.reshape(out, (*plan.batch, plan.num_q_heads, plan.q_len, plan.value_dim))

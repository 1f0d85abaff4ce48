"""Register the tiled attention's portable backward with torch autograd and JAX.

Plain autograd through the tiled loop would save every block's probabilities,
which brings back O(Lq·Lk) memory in the backward pass. Here the forward saves
only its inputs, the output and the row log-sum-exp; the backward
(:func:`portable_attn._lib._tiled.tiled_backward`, written once in the array
API) recomputes each block. This is the only module that names torch and JAX
autodiff machinery; both are imported lazily, only for their own arrays.
"""

from __future__ import annotations

import functools
from typing import Any

from ._lib._compat import library_name
from ._lib._scores import AttentionPlan
from ._lib._tiled import tiled_backward, tiled_forward

__all__ = ["tiled_attention"]


def tiled_attention(
    xp: Any, q: Any, k: Any, v: Any, mask: Any | None, bias: Any | None, plan: AttentionPlan,
    block_q: int, block_k: int,
) -> Any:  # fmt: skip
    """Tiled attention output (..., Hq, Lq, Dv) with an O(L)-memory backward where one exists."""
    lib = library_name(q)
    if lib == "torch":
        import torch

        inputs = (q, k, v) if bias is None else (q, k, v, bias)
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            return _torch_function().apply(q, k, v, mask, bias, (xp, plan, block_q, block_k))
    elif lib == "jax":
        return _jax_function(xp, plan, block_q, block_k, bias is not None)(q, k, v, mask, bias)
    return tiled_forward(xp, q, k, v, mask, bias, plan, block_q, block_k)[0]


@functools.cache
def _torch_function() -> Any:
    import torch

    class TiledAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, mask: Any, bias: Any, static: Any) -> Any:
            xp, plan, block_q, block_k = static
            out, lse = tiled_forward(xp, q, k, v, mask, bias, plan, block_q, block_k)
            ctx.save_for_backward(q, k, v, mask, bias, out, lse)
            ctx.static = static
            return out

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            q, k, v, mask, bias, out, lse = ctx.saved_tensors
            xp, plan, block_q, block_k = ctx.static
            need_bias = bias is not None and ctx.needs_input_grad[4]
            dq, dk, dv, dbias = tiled_backward(
                xp, q, k, v, mask, bias, out, lse, dout, plan, block_q, block_k,
                need_bias_grad=need_bias,
            )  # fmt: skip
            return dq, dk, dv, None, dbias, None

    return TiledAttention


def _jax_function(xp: Any, plan: AttentionPlan, block_q: int, block_k: int, has_bias: bool) -> Any:
    import jax

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
        return tiled_forward(xp, q, k, v, mask, bias, plan, block_q, block_k)[0]

    def forward(q: Any, k: Any, v: Any, mask: Any, bias: Any) -> tuple[Any, Any]:
        out, lse = tiled_forward(xp, q, k, v, mask, bias, plan, block_q, block_k)
        return out, (q, k, v, mask, bias, out, lse)

    def backward(residuals: Any, dout: Any) -> tuple[Any, ...]:
        q, k, v, mask, bias, out, lse = residuals
        dq, dk, dv, dbias = tiled_backward(
            xp, q, k, v, mask, bias, out, lse, dout, plan, block_q, block_k,
            need_bias_grad=has_bias,
        )  # fmt: skip
        return dq, dk, dv, None, dbias

    attend.defvjp(forward, backward)
    return attend

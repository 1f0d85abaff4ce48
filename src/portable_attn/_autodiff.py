"""Register the tiled attention's portable backward with torch autograd and JAX.

Plain autograd through the tiled loop would save every block's probabilities,
which brings back O(Lq·Lk) memory in the backward pass. Here the forward saves
only its inputs, the output and the row log-sum-exp; the backward
(:func:`portable_attn._lib._tiled.tiled_backward`, written once in the array
API) recomputes each block. This is the only module that names torch and JAX
autodiff machinery; both are imported lazily, only for their own arrays.

A ``score_mod`` callable cannot be differentiated by the portable backward, so
calls with one are differentiated by plain autograd through the tiled loop
(exact, but the backward then stores the blocks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ._lib._call import AttentionCall
from ._lib._compat import library_name
from ._lib._scores import ScoreTerms
from ._lib._tiled import Blocks, tiled_backward, tiled_forward

__all__ = ["tiled_attention"]

# ScoreTerms fields that hold arrays and travel as (non-differentiated) inputs
_ARRAY_FIELDS = ("mask", "q_lengths", "kv_lengths", "offset", "batch_index", "dropout_keep")


def tiled_attention(call: AttentionCall, block_q: Blocks, block_k: Blocks) -> Any:
    """Tiled attention output (..., Hq, Lq, Dv) with an O(L)-memory backward where one exists."""
    xp, q, k, v, bias = call.xp, call.query, call.key, call.value, call.bias
    terms, plan = call.terms, call.plan
    lib = library_name(q)
    static = (xp, plan, block_q, block_k)
    if terms.score_mod is None and lib == "torch":
        import torch

        inputs = [q, k, v, bias, terms.alibi_slopes]
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
            arrays = {f: getattr(terms, f) for f in _ARRAY_FIELDS}
            return _torch_function().apply(
                q, k, v, bias, terms.alibi_slopes, arrays, terms, static
            )[0]
    elif terms.score_mod is None and lib == "jax":
        arrays = {
            f: getattr(terms, f) for f in _ARRAY_FIELDS if not isinstance(getattr(terms, f), int)
        }
        attend = _jax_function(static, terms)
        return attend(q, k, v, bias, terms.alibi_slopes, arrays)
    stop = None  # plain autodiff through the loop (score_mod): the max shift needs none
    if lib == "jax":
        import jax

        stop = jax.lax.stop_gradient
    elif lib == "torch":
        stop = _detach
    return tiled_forward(xp, q, k, v, bias, terms, plan, block_q, block_k, stop_gradient=stop)[0]


def _detach(x: Any) -> Any:
    return x.detach()


def _backward(
    static: Any,
    terms: ScoreTerms,
    saved: tuple[Any, ...],
    dout: Any,
    need_bias: bool,
    need_slopes: bool,
) -> tuple[Any, ...]:
    xp, plan, block_q, block_k = static
    q, k, v, bias, out, lse = saved
    return tiled_backward(
        xp,
        q,
        k,
        v,
        bias,
        terms,
        out,
        lse,
        dout,
        plan,
        block_q,
        block_k,
        need_bias_grad=need_bias,
        need_slope_grad=need_slopes,
    )


@functools.cache
def _torch_function() -> Any:
    import torch

    class TiledAttention(torch.autograd.Function):
        # forward / setup_context / backward are written separately and the vmap rule
        # is generated, so torch.func.grad, jacrev and vmap can transform it too
        generate_vmap_rule = True

        @staticmethod
        def forward(
            q: Any,
            k: Any,
            v: Any,
            bias: Any,
            slopes: Any,
            arrays: Any,
            terms: Any,
            static: Any,
        ) -> Any:
            xp, plan, block_q, block_k = static
            return tiled_forward(xp, q, k, v, bias, terms, plan, block_q, block_k)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            q, k, v, bias, _, _, terms, static = inputs
            out, lse = output
            ctx.mark_non_differentiable(lse)
            ctx.save_for_backward(q, k, v, bias, out, lse)
            ctx.terms, ctx.static = terms, static

        @staticmethod
        def backward(ctx: Any, dout: Any, _dlse: Any) -> Any:
            need_bias, need_slopes = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
            dq, dk, dv, dbias, dslopes = _backward(
                ctx.static, ctx.terms, ctx.saved_tensors, dout, need_bias, need_slopes
            )
            return dq, dk, dv, dbias, dslopes, None, None, None

    return TiledAttention


def _jax_function(static: Any, terms: ScoreTerms) -> Any:
    import jax

    xp, plan, block_q, block_k = static

    def rebuild(slopes: Any, arrays: dict[str, Any]) -> ScoreTerms:
        return dataclasses.replace(terms, alibi_slopes=slopes, **arrays)

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, bias: Any, slopes: Any, arrays: Any) -> Any:
        t = rebuild(slopes, arrays)
        return tiled_forward(xp, q, k, v, bias, t, plan, block_q, block_k)[0]

    def forward(q: Any, k: Any, v: Any, bias: Any, slopes: Any, arrays: Any) -> Any:
        t = rebuild(slopes, arrays)
        out, lse = tiled_forward(xp, q, k, v, bias, t, plan, block_q, block_k)
        return out, (q, k, v, bias, out, lse, slopes, arrays)

    def backward(residuals: Any, dout: Any) -> tuple[Any, ...]:
        q, k, v, bias, out, lse, slopes, arrays = residuals
        t = rebuild(slopes, arrays)
        dq, dk, dv, dbias, dslopes = _backward(
            static, t, (q, k, v, bias, out, lse), dout, bias is not None, slopes is not None
        )
        return dq, dk, dv, dbias, dslopes, jax.tree_util.tree_map(lambda _: None, arrays)

    attend.defvjp(forward, backward)
    return attend

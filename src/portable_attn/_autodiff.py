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
from ._lib._merge import empty_rows_to_neg_inf
from ._lib._scores import AttentionPlan, ScoreTerms
from ._lib._tiled import Blocks, TiledGrads, tiled_backward, tiled_forward
from ._lib._validation import array_or_none

__all__ = ["tiled_attention"]

# ScoreTerms fields that hold arrays and travel as (non-differentiated) inputs
_ARRAY_FIELDS = (
    "mask",
    "q_lengths",
    "kv_lengths",
    "offset",
    "batch_index",
    "dropout_keep",
    "q_segments",
    "kv_segments",
)
# ScoreTerms fields that receive gradients (None when not given)
_LEARNED_TERMS = ("alibi_slopes", "sinks")
# AttentionPlan fields that may hold a learned 0-d array, differentiated like Q, K, V
_SCALAR_FIELDS = ("scale", "softcap")


def tiled_attention(
    call: AttentionCall, block_q: Blocks, block_k: Blocks, *, with_lse: bool = False
) -> Any:
    """Tiled attention output (..., Hq, Lq, Dv) with an O(L)-memory backward where one exists.

    `with_lse` returns ``(out, lse)`` with the row log-sum-exp (..., Hq, Lq, 1),
    ``-inf`` for a row with no visible key (and no sink); its cotangent flows back.
    """
    xp, q, k, v, bias = call.xp, call.query, call.key, call.value, call.bias
    terms, plan = call.terms, call.plan
    lib = library_name(q)
    static = (xp, plan, block_q, block_k)
    # a learned scale / softcap (0-d arrays of the plan) are differentiated inputs too
    scalars = {
        f: getattr(plan, f) for f in _SCALAR_FIELDS if array_or_none(getattr(plan, f)) is not None
    }
    learned = {f: getattr(terms, f) for f in _LEARNED_TERMS if getattr(terms, f) is not None}
    result = None
    if terms.score_mod is None and lib == "torch":
        import torch

        inputs = [q, k, v, bias, *learned.values(), *scalars.values()]
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
            arrays = {f: getattr(terms, f) for f in _ARRAY_FIELDS}
            extras = [getattr(terms, f) for f in _LEARNED_TERMS]
            extras += [scalars.get(f) for f in _SCALAR_FIELDS]
            result = _torch_function().apply(q, k, v, bias, *extras, arrays, terms, static)
    elif terms.score_mod is None and lib == "jax":
        arrays = {
            f: getattr(terms, f) for f in _ARRAY_FIELDS if not isinstance(getattr(terms, f), int)
        }
        attend = _jax_function(static, terms)
        result = attend(q, k, v, bias, learned, scalars, arrays)
    if result is None:
        stop = None  # plain autodiff through the loop (score_mod): the max shift needs none
        if lib == "jax":
            import jax

            stop = jax.lax.stop_gradient
        elif lib == "torch":
            stop = _detach
        result = tiled_forward(
            xp, q, k, v, bias, terms, plan, block_q, block_k, stop_gradient=stop
        )
    out, lse = result
    return (out, empty_rows_to_neg_inf(xp, lse)) if with_lse else out


def _detach(x: Any) -> Any:
    return x.detach()


def _with_scalars(plan: AttentionPlan, scale: Any, softcap: Any) -> AttentionPlan:
    """Put the learned scale / softcap given to the autodiff function (if any) in the plan."""
    given = zip(_SCALAR_FIELDS, (scale, softcap), strict=True)
    changes = {f: x for f, x in given if x is not None}
    return dataclasses.replace(plan, **changes) if changes else plan


def _backward(
    static: Any,
    terms: ScoreTerms,
    saved: tuple[Any, ...],
    grads: tuple[Any, Any],
    need: dict[str, bool],
) -> TiledGrads:
    """Run the portable backward; `grads` are the cotangents of (out, lse)."""
    xp, plan, block_q, block_k = static
    q, k, v, bias, out, lse = saved
    dout, dlse = grads
    if dout is None:  # only the lse was used
        dout = xp.zeros_like(out)
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
        need_bias_grad=need.get("bias", False),
        need_slope_grad=need.get("alibi_slopes", False),
        need_sink_grad=need.get("sinks", False),
        need_scale_grad=need.get("scale", False),
        need_softcap_grad=need.get("softcap", False),
        dlse=dlse,
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
            sinks: Any,
            scale: Any,
            softcap: Any,
            arrays: Any,
            terms: Any,
            static: Any,
        ) -> Any:
            xp, plan, block_q, block_k = static
            plan = _with_scalars(plan, scale, softcap)
            terms = dataclasses.replace(terms, alibi_slopes=slopes, sinks=sinks)
            return tiled_forward(xp, q, k, v, bias, terms, plan, block_q, block_k)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            q, k, v, bias, slopes, sinks, scale, softcap, _, terms, static = inputs
            out, lse = output
            ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
            ctx.save_for_backward(q, k, v, bias, out, lse, slopes, sinks, scale, softcap)
            ctx.terms, ctx.static = terms, static

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
            *saved, slopes, sinks, scale, softcap = ctx.saved_tensors
            xp, plan, block_q, block_k = ctx.static
            static = (xp, _with_scalars(plan, scale, softcap), block_q, block_k)
            terms = dataclasses.replace(ctx.terms, alibi_slopes=slopes, sinks=sinks)
            names = ("bias", "alibi_slopes", "sinks", "scale", "softcap")
            need = dict(zip(names, ctx.needs_input_grad[3:8], strict=True))
            if dout is None and dlse is None:
                return (None,) * 11
            g = _backward(static, terms, tuple(saved), (dout, dlse), need)
            return (
                *(g.dq, g.dk, g.dv, g.dbias, g.dslopes, g.dsinks, g.dscale, g.dsoftcap),
                *(None, None, None),
            )

    return TiledAttention


def _jax_function(static: Any, terms: ScoreTerms) -> Any:
    import jax

    xp, plan, block_q, block_k = static

    def rebuild(learned: dict[str, Any], arrays: dict[str, Any]) -> ScoreTerms:
        return dataclasses.replace(terms, **learned, **arrays)

    def plan_of(scalars: dict[str, Any]) -> AttentionPlan:
        return _with_scalars(plan, scalars.get("scale"), scalars.get("softcap"))

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, bias: Any, learned: Any, scalars: Any, arrays: Any) -> Any:
        t = rebuild(learned, arrays)
        return tiled_forward(xp, q, k, v, bias, t, plan_of(scalars), block_q, block_k)

    def forward(q: Any, k: Any, v: Any, bias: Any, learned: Any, scalars: Any, arrays: Any) -> Any:
        t = rebuild(learned, arrays)
        out, lse = tiled_forward(xp, q, k, v, bias, t, plan_of(scalars), block_q, block_k)
        return (out, lse), (q, k, v, bias, out, lse, learned, scalars, arrays)

    def backward(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        q, k, v, bias, out, lse, learned, scalars, arrays = residuals
        need = {"bias": bias is not None, **dict.fromkeys(learned, True)}
        need.update(dict.fromkeys(scalars, True))
        g = _backward(
            (xp, plan_of(scalars), block_q, block_k),
            rebuild(learned, arrays),
            (q, k, v, bias, out, lse),
            cotangents,
            need,
        )
        by_name = {
            "alibi_slopes": g.dslopes,
            "sinks": g.dsinks,
            "scale": g.dscale,
            "softcap": g.dsoftcap,
        }
        d_learned = {f: by_name[f] for f in learned}
        d_scalars = {f: by_name[f] for f in scalars}
        no_grads = jax.tree_util.tree_map(lambda _: None, arrays)
        return g.dq, g.dk, g.dv, g.dbias, d_learned, d_scalars, no_grads

    attend.defvjp(forward, backward)
    return attend

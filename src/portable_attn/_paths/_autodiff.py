"""The tiled path's recomputing backward, registered with torch autograd and JAX.

Plain autograd through the tiled walk would save every block's probabilities,
which brings back O(Lq·Lk) memory in the backward pass. Here the forward saves
only its inputs, the output and the row log-sum-exp; the backward
(:func:`portable_attn._lib._tiled.tiled_backward`, written once in the array
API) recomputes each block. This is the only module that names torch and JAX
autodiff machinery; both are imported lazily, only for their own arrays.

The arrays of the call travel through the autodiff functions as the call's
:meth:`~portable_attn._lib._call.AttentionCall.flatten` gives them, by name:
the differentiable fields (:data:`~portable_attn._lib._fields.FIELDS`) get
their gradients, the others None. No field is named here.
"""

from __future__ import annotations

import functools
from typing import Any

from .._lib._call import AttentionCall
from .._lib._fields import field
from .._lib._path import Tiled
from .._lib._tiled import tiled_backward, tiled_forward

__all__ = ["recomputing_attention"]


def recomputing_attention(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    """Tiled attention output (..., Hq, Lq, Dv) and row log-sum-exp (..., Hq, Lq, 1).

    Differentiated by the O(L)-memory backward registered with ``path.backward``'s
    library (torch autograd, ``jax.grad``); the lse's cotangent flows back too.
    """
    arrays, skeleton = call.flatten()
    if path.backward == "jax":
        return _jax_function(skeleton, path)(arrays)
    import torch

    if not (torch.is_grad_enabled() and any(x.requires_grad for x in arrays.values())):
        return _forward(call, path)  # nothing to record
    names = tuple(arrays)
    return _torch_function().apply(skeleton, path, names, *arrays.values())


def _forward(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    return tiled_forward(call, path.block_q, path.block_k, fold=path.fold)


def _backward(
    call: AttentionCall,
    path: Tiled,
    saved: tuple[Any, Any],
    grads: tuple[Any, Any],
    need: tuple[str, ...],
) -> dict[str, Any]:
    """Run the portable backward; `grads` are the cotangents of (out, lse)."""
    out, lse = saved
    dout, dlse = grads
    if dout is None:  # only the lse was used
        dout = call.xp.zeros_like(out)
    return tiled_backward(call, out, lse, dout, path.block_q, path.block_k, need=need, dlse=dlse)


def _differentiable(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if field(n).differentiable)


@functools.cache
def _torch_function() -> Any:
    import torch

    class TiledAttention(torch.autograd.Function):
        # forward / setup_context / backward are written separately and the vmap rule
        # is generated, so torch.func.grad, jacrev and vmap can transform it too
        generate_vmap_rule = True

        @staticmethod
        def forward(skeleton: Any, path: Any, names: Any, *arrays: Any) -> Any:
            call = skeleton.unflatten(dict(zip(names, arrays, strict=True)))
            return _forward(call, path)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            skeleton, path, names, *arrays = inputs
            ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
            ctx.save_for_backward(*arrays, *output)
            ctx.skeleton, ctx.path, ctx.names = skeleton, path, names

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
            *arrays, out, lse = ctx.saved_tensors
            names = ctx.names
            if dout is None and dlse is None:
                return (None,) * (3 + len(names))
            wanted = ctx.needs_input_grad[3:]
            need = _differentiable(tuple(n for n, w in zip(names, wanted, strict=True) if w))
            call = ctx.skeleton.unflatten(dict(zip(names, arrays, strict=True)))
            g = _backward(call, ctx.path, (out, lse), (dout, dlse), need)
            return (None, None, None, *(g.get(n) for n in names))

    return TiledAttention


def _jax_function(skeleton: AttentionCall, path: Tiled) -> Any:
    import jax

    @jax.custom_vjp
    def attend(arrays: dict[str, Any]) -> Any:
        return _forward(skeleton.unflatten(arrays), path)

    def forward(arrays: dict[str, Any]) -> Any:
        out, lse = _forward(skeleton.unflatten(arrays), path)
        return (out, lse), (arrays, out, lse)

    def backward(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        arrays, out, lse = residuals
        need = _differentiable(tuple(arrays))
        call = skeleton.unflatten(arrays)
        g = _backward(call, path, (out, lse), cotangents, need)
        return ({n: g.get(n) for n in arrays},)

    attend.defvjp(forward, backward)
    return attend

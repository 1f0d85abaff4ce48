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

A ``score_mod`` may close over arrays that learn (a relative-position table, a
per-head temperature). Their gradients come from the same backward: each block's
``score_mod`` is differentiated there (:data:`~portable_attn._lib._tiled.ScoreVjp`)
and the arrays' gradients are summed block by block, in the walk's fixed order.
The arrays are found by running the function, not by reading its closure:

- torch: the tensors that require a gradient and that an operation of the
  ``score_mod`` reads, other than its arguments and what it made itself, seen by a
  ``TorchFunctionMode`` on a one-entry probe (:func:`torch_params`); they become
  inputs of the autograd function, which returns their gradients;
- JAX: the traced values it closes over (under ``jit``, ``grad``, ``vmap``), which
  :class:`JaxScoreMod` finds as the tracers among the constants of its jaxpr, traced
  once per block shape; they become explicit arguments of the ``custom_vjp`` (as
  ``jax.closure_convert`` does, without its cache, which would keep the function),
  the floating ones differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

from .._lib._call import AttentionCall
from .._lib._fields import field
from .._lib._path import Tiled
from .._lib._scores import score_index
from .._lib._tiled import ScoreVjp, block_ranges, tiled_backward, tiled_forward

__all__ = ["JaxScoreMod", "recomputing_attention", "torch_params", "torch_score_vjp"]


def recomputing_attention(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    """Tiled attention output (..., Hq, Lq, Dv) and row log-sum-exp (..., Hq, Lq, 1).

    Differentiated by the O(L)-memory backward registered with ``path.backward``'s
    library (torch autograd, ``jax.grad``); the lse's cotangent flows back too, and
    so do the gradients of the arrays a ``score_mod`` closes over.
    """
    arrays, skeleton = call.flatten()
    if path.backward == "jax":
        blocks = [
            (qe - qs, ke - ks)
            for qs, qe in block_ranges(call.plan.q_len, path.block_q)
            for ks, ke in block_ranges(call.plan.kv_len, path.block_k)
        ]
        mod = JaxScoreMod.of(call, blocks)
        return _jax_function(skeleton, path, mod)(arrays, mod.params if mod else ())
    import torch

    params = torch_params(call) if torch.is_grad_enabled() else ()
    tensors = (*arrays.values(), *params)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)):
        return _forward(call, path)  # nothing to record
    names = tuple(arrays)
    return _torch_function().apply(skeleton, path, names, *tensors)


def _forward(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    return tiled_forward(call, path.block_q, path.block_k, fold=path.fold)


def _backward(
    call: AttentionCall,
    path: Tiled,
    saved: tuple[Any, Any],
    grads: tuple[Any, Any],
    need: tuple[str, ...],
    score_vjp: ScoreVjp | None = None,
) -> dict[str, Any]:
    """Run the portable backward; `grads` are the cotangents of (out, row statistics).

    Only the lse column of the statistics has a gradient (the row max has none).
    """
    out, stats = saved
    dout, dstats = grads
    lse = stats[..., :1]
    dlse = None if dstats is None else dstats[..., :1]
    if dout is None:  # only the lse was used
        dout = call.xp.zeros_like(out)
    return tiled_backward(
        call,
        out,
        lse,
        dout,
        path.block_q,
        path.block_k,
        need=need,
        dlse=dlse,
        score_vjp=score_vjp,
    )


def _differentiable(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if field(n).differentiable)


# ---------------------------------------------------------------------------
# a score_mod's learned arrays


def torch_params(call: AttentionCall) -> tuple[Any, ...]:
    """Return the tensors requiring a gradient that `call`'s ``score_mod`` reads, in order of use.

    Found by running it once on a (..., Hq, 1, 1) probe under a ``TorchFunctionMode``
    that records the tensor arguments of every operation: those that require a
    gradient and were not made inside the probe are what it closes over (a
    parameter, a table computed from one), however it reaches them (a closure, a
    module attribute, a global).
    """
    score_mod = call.terms.score_mod
    if score_mod is None:
        return ()
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    made: dict[int, Any] = {}  # kept alive, so that no id is reused during the probe
    found: dict[int, Any] = {}

    class Reads(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            for x in tree_leaves((args, kwargs)):
                if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in made:
                    found.setdefault(id(x), x)
            result = func(*args, **kwargs)
            for x in tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    made[id(x)] = x
            return result

    plan = call.plan
    probe = call.zeros(1, 1)  # (..., Hq, 1, 1)
    index = score_index(call.xp, call.terms, plan, (0, 1), (0, 1))
    made.update((id(x), x) for x in (probe, *index) if x is not None)
    with torch.enable_grad(), Reads():
        score_mod(probe, *index)
    return tuple(found.values())


def torch_score_vjp(score_mod: Callable[..., Any], params: tuple[Any, ...]) -> ScoreVjp:
    """Return a block's ``score_mod`` and its VJP by ``torch.autograd.grad`` (:data:`ScoreVjp`)."""
    import torch

    def score_vjp(scores: Any, *index: Any) -> tuple[Any, Any]:
        with torch.enable_grad():
            leaf = scores.detach().requires_grad_()
            modified = score_mod(leaf, *index)

        def pullback(d_modified: Any) -> tuple[Any, tuple[Any, ...]]:
            inputs = (leaf, *params)
            grads: tuple[Any, ...] = (None,) * len(inputs)
            if modified.requires_grad:
                grads = torch.autograd.grad(modified, inputs, d_modified, allow_unused=True)
            pairs = zip(inputs, grads, strict=True)
            full = [torch.zeros_like(x) if g is None else g for x, g in pairs]
            return full[0], tuple(full[1:])

        return modified.detach(), pullback

    return score_vjp


@dataclasses.dataclass(frozen=True)
class JaxScoreMod:
    """A JAX ``score_mod`` with the traced arrays it closes over as explicit parameters.

    Traced once per block shape (``jax.make_jaxpr``); the tracers among each jaxpr's
    constants are the parameters (`params`, the same for every shape), the other
    constants stay; the floating ones (`learned`) receive gradients. A ``score_mod``
    that closes over no traced array, or cannot be traced (Python logic on concrete
    values, in an eager call), is kept as it is (`forms` empty). :meth:`bind` gives
    the ``score_mod`` of other values of the parameters (a ``custom_vjp``'s own
    arguments), :meth:`vjp` its per-block VJP.
    """

    original: Callable[..., Any]
    #: (bq, bk) -> (jaxpr, constants, ((constant index, parameter index), ...))
    forms: dict[tuple[int, int], tuple[Any, list[Any], tuple[tuple[int, int], ...]]]
    params: tuple[Any, ...]
    learned: tuple[int, ...]

    @classmethod
    def of(cls, call: AttentionCall, blocks: Iterable[tuple[int, int]]) -> JaxScoreMod | None:
        """Trace `call`'s ``score_mod`` for each (bq, bk) of `blocks`; None without one."""
        score_mod = call.terms.score_mod
        if score_mod is None:
            return None
        import jax
        import numpy as np

        params: list[Any] = []
        where: dict[int, int] = {}
        forms = {}
        # the scores' batch is that of Q and K (V may broadcast wider)
        batch = np.broadcast_shapes(call.query.shape[:-3], call.key.shape[:-3])
        for bq, bk in dict.fromkeys(blocks):
            index = score_index(call.xp, call.terms, call.plan, (0, bq), (0, bk))
            scores = jax.ShapeDtypeStruct(
                (*batch, call.plan.num_q_heads, bq, bk), call.plan.compute_dtype
            )
            try:
                closed = jax.make_jaxpr(score_mod)(scores, *index)
            except TypeError:  # Python logic on concrete values: it runs as it is
                return cls(score_mod, {}, (), ())
            slots = []
            for i, c in enumerate(closed.consts):
                if isinstance(c, jax.core.Tracer):
                    if id(c) not in where:
                        where[id(c)] = len(params)
                        params.append(c)
                    slots.append((i, where[id(c)]))
            forms[(bq, bk)] = (closed.jaxpr, list(closed.consts), tuple(slots))
        if not params:  # nothing traced to hand over: the function as it is
            return cls(score_mod, {}, (), ())
        learned = tuple(
            i for i, p in enumerate(params) if jax.numpy.issubdtype(p.dtype, jax.numpy.inexact)
        )
        return cls(score_mod, forms, tuple(params), learned)

    def bind(self, params: tuple[Any, ...]) -> Callable[..., Any]:
        """Return the ``score_mod`` with `params` in place of the traced arrays it closes over."""
        if not self.forms:
            return self.original
        import jax

        def score_mod(scores: Any, *index: Any) -> Any:
            jaxpr, consts, slots = self.forms[tuple(scores.shape[-2:])]
            consts = list(consts)
            for i, p in slots:
                consts[i] = params[p]
            return jax.core.eval_jaxpr(jaxpr, consts, scores, *index)[0]

        return score_mod

    def vjp(self, params: tuple[Any, ...]) -> ScoreVjp:
        """Return a block's ``score_mod`` of `params` and its VJP by ``jax.vjp``.

        The pullback gives the gradients of the `learned` parameters (the floating ones).
        """
        import jax

        def score_vjp(scores: Any, *index: Any) -> tuple[Any, Any]:
            def modify(s: Any, learned: tuple[Any, ...]) -> Any:
                values = list(params)
                for i, x in zip(self.learned, learned, strict=True):
                    values[i] = x
                return self.bind(tuple(values))(s, *index)

            return jax.vjp(modify, scores, tuple(params[i] for i in self.learned))

        return score_vjp

    def cotangents(self, learned: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Return the ``custom_vjp`` cotangents of every parameter from the learned ones'.

        None for the others (integer arrays); zeros where no block was visited (None).
        """
        import jax.numpy as jnp

        if learned is None:
            learned = tuple(jnp.zeros_like(self.params[i]) for i in self.learned)
        out: list[Any] = [None] * len(self.params)
        for i, g in zip(self.learned, learned, strict=True):
            out[i] = g
        return tuple(out)

    def into(self, call: AttentionCall, params: tuple[Any, ...]) -> AttentionCall:
        """`call` with the ``score_mod`` of `params` (:meth:`bind`)."""
        terms = dataclasses.replace(call.terms, score_mod=self.bind(params))
        return dataclasses.replace(call, terms=terms)


@functools.cache
def _torch_function() -> Any:
    import torch

    class TiledAttention(torch.autograd.Function):
        # forward / setup_context / backward are written separately and the vmap rule
        # is generated, so torch.func.grad, jacrev and vmap can transform it too.
        # Inputs: the call's arrays by `names`, then the score_mod's parameters.
        generate_vmap_rule = True

        @staticmethod
        def forward(skeleton: Any, path: Any, names: Any, *tensors: Any) -> Any:
            call = skeleton.unflatten(dict(zip(names, tensors, strict=False)))
            return _forward(call, path)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            skeleton, path, names, *tensors = inputs
            ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
            ctx.save_for_backward(*tensors[: len(names)], *output)
            ctx.skeleton, ctx.path, ctx.names = skeleton, path, names
            ctx.params = tuple(tensors[len(names) :])  # read by the score_mod's own closure

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
            *arrays, out, lse = ctx.saved_tensors
            names, params = ctx.names, ctx.params
            if dout is None and dlse is None:
                return (None,) * (3 + len(names) + len(params))
            wanted = ctx.needs_input_grad[3 : 3 + len(names)]
            need = _differentiable(tuple(n for n, w in zip(names, wanted, strict=True) if w))
            call = ctx.skeleton.unflatten(dict(zip(names, arrays, strict=True)))
            score_vjp = None
            if call.terms.score_mod is not None:
                score_vjp = torch_score_vjp(call.terms.score_mod, params)
            g = _backward(call, ctx.path, (out, lse), (dout, dlse), need, score_vjp)
            d_params = g.get("score_params", (None,) * len(params))
            return (None, None, None, *(g.get(n) for n in names), *d_params)

    return TiledAttention


def _jax_function(skeleton: AttentionCall, path: Tiled, mod: JaxScoreMod | None) -> Any:
    import jax

    def call_of(arrays: dict[str, Any], params: tuple[Any, ...]) -> AttentionCall:
        call = skeleton.unflatten(arrays)
        return call if mod is None else mod.into(call, params)

    @jax.custom_vjp
    def attend(arrays: dict[str, Any], params: tuple[Any, ...]) -> Any:
        return _forward(call_of(arrays, params), path)

    def forward(arrays: dict[str, Any], params: tuple[Any, ...]) -> Any:
        out, lse = _forward(call_of(arrays, params), path)
        return (out, lse), (arrays, params, out, lse)

    def backward(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        arrays, params, out, lse = residuals
        need = _differentiable(tuple(arrays))
        score_vjp = None if mod is None else mod.vjp(params)
        g = _backward(call_of(arrays, params), path, (out, lse), cotangents, need, score_vjp)
        d_params = () if mod is None else mod.cotangents(g.get("score_params"))
        return {n: g.get(n) for n in arrays}, d_params

    attend.defvjp(forward, backward)
    return attend

"""The drivers that compute an attention call, each run as the router's :class:`Route` says.

:func:`run` dispatches on the :data:`~portable_attn._lib._path.Path` the router
(:mod:`portable_attn._lib._route`) chose; no driver decides anything again:

==========================  ===========================================================
``Empty``                   :meth:`AttentionCall.empty_result` (zeros, lse ``-inf`` or
                            the sink), tied to the inputs (:func:`tied_to_inputs`)
``Dense``                   :func:`portable_attn._lib._dense.dense_attention`
``Tiled(walk="python")``    :func:`portable_attn._lib._tiled.tiled_forward` (``_ops.walk``),
                            with the recomputing backward of ``_autodiff.py`` (torch, JAX) or
                            torch's own autograd through it (a ``score_mod`` under
                            ``torch.compile``)
``Tiled(walk="buffered")``  the same walk in NumPy's reused buffers (``_buffered.py``),
                            its query blocks in threads with ``workers > 1``
                            (``_threads.py``)
``Tiled(walk="loop")``      JAX's traced loop (``_loop.py``)
``Native``                  torch SDPA / ``jax.nn`` (``_native.py``), whole or per tile;
                            torch's ``flex_attention`` (``_flex.py``), with the lse
``DaskGrid``                one task per visible chunk pair (``_dask.py``)
``Paged``                   ``batch_invariant``: the paged walk, a sequence a request
                            (``_paged.py``)
==========================  ===========================================================
"""

from __future__ import annotations

from typing import Any

from .._lib._call import AttentionCall
from .._lib._dense import dense_attention
from .._lib._path import DaskGrid, Dense, Empty, Native, Paged, Route, Tiled
from . import _flex
from ._autodiff import recomputing_attention
from ._buffered import buffered_forward
from ._compiled import program
from ._dask import dask_attention
from ._flex import flex_attention
from ._loop import loop_attention
from ._native import native_attention, native_tiles
from ._ops import walk
from ._paged import invariant_attention
from ._threads import threaded_attention

__all__ = ["compiled", "run", "tied_to_inputs"]


def run(
    call: AttentionCall, route: Route, *, with_lse: bool = False, kept: Any = None
) -> tuple[Any, Any]:
    """Compute `call` as `route` says: ``(out, lse)``, head axis kept.

    Both are in the compute dtype, except `out` of a path that keeps half-precision
    inputs in their dtype (a native kernel's result is then in that dtype). `out` is
    (..., Hq, Lq, Dv); `lse` the row log-sum-exp (..., Hq, Lq, 1) with `with_lse`
    (``-inf`` for a row with no visible key and no sink), else None. `kept`: the
    compiled program of a ``route.compiled`` call (:func:`compiled`), kept by the cache.
    """
    if route.keys is not None:
        call = call.first_keys(route.keys)
    if route.compiled:
        arrays, skeleton = call.flatten()
        if kept is None:
            kept = compiled(skeleton, route, with_lse)
        return kept(arrays)
    return _run(call, route, with_lse=with_lse)


def compiled(skeleton: AttentionCall, route: Route, with_lse: bool) -> Any:
    """Return the compiled program of a ``route.compiled`` call, for the cache to keep."""
    return program(skeleton, route, with_lse, _run)


def tied_to_inputs(call: AttentionCall, *results: Any) -> tuple[Any, ...]:
    """`results` of a call with no query, key, head or sequence, made to depend on its inputs.

    Each floating array of `call` (Q, K, V, a bias, a learned scale, slopes, sinks)
    adds the sum of an empty slice of itself: exactly 0, whatever it holds (NaN
    and inf included), so the values stay as they are, but autodiff reaches every
    input through them. A torch result then has a ``grad_fn`` and ``backward``
    gives each input zeros of its shape, as torch's own operations on empty
    tensors do (a fresh array is cut off from autograd: ``backward`` raised).
    """
    xp = call.xp
    arrays, _ = call.flatten()
    zero = None
    for x in arrays.values():
        if not xp.isdtype(x.dtype, "real floating"):
            continue
        empty = x[(slice(0, 0),) * x.ndim] if x.ndim else xp.reshape(x, (1,))[:0]
        none = xp.sum(empty)  # 0-d, exactly 0, tied to `x` (a view: nothing is copied)
        zero = none if zero is None else zero + xp.astype(none, zero.dtype)
    if zero is None:
        return results
    return tuple(r + xp.astype(zero, r.dtype) for r in results)


def _run(call: AttentionCall, route: Route, *, with_lse: bool = False) -> tuple[Any, Any]:
    """Run the path of `route` on `call` here (half inputs cast first unless it keeps them).

    The cast happens before the path (and outside its autodiff function, so gradients
    reach the inputs in their dtype).
    """
    if not route.keeps_dtype:
        call = call.in_compute_dtype()
    path = route.path
    match path:
        case Empty():
            out, lse = tied_to_inputs(call, *call.empty_result())
        case Dense(fold=fold, flash=flash, weights_first=first):
            result = dense_attention(
                call, fold=fold, flash=flash, weights_first=first, with_lse=with_lse
            )
            out, lse = result if with_lse else (result, None)
        case Tiled(walk="loop"):
            out, lse = loop_attention(call, path)
        case Tiled(walk="buffered", workers=1):
            out, lse = buffered_forward(call, path.block_q, path.block_k, fold=path.fold)
        case Tiled(walk="buffered"):
            out, lse = threaded_attention(call, path)
        case Tiled(backward="torch" | "jax"):
            out, lse = recomputing_attention(call, path)
        case Tiled(backward="autodiff"):
            out, lse = walk(call, path, autodiff=True)
        case Tiled():
            out, lse = walk(call, path)
        case Native(kernel="flex"):
            out, lse = _flex_or_fallback(call, path, with_lse)
        case Native(tiles=None):
            out, lse = native_attention(call, path), None  # in the input dtype when kept
        case Native():
            out, lse = native_tiles(call, path), None
        case DaskGrid():
            result = dask_attention(call, path, with_lse=with_lse)
            out, lse = result if with_lse else (result, None)
        case Paged():
            out, lse = invariant_attention(call)
        case _:
            msg = f"not a path: {path!r}"
            raise TypeError(msg)
    return out, (lse if with_lse else None)


def _flex_or_fallback(call: AttentionCall, path: Native, with_lse: bool) -> tuple[Any, Any]:
    """flex_attention, or the route's portable fallback where flex cannot compute the call.

    The fallback runs for segment ids over values that are not finite, and for the
    caller's functions that flex cannot trace (remembered per function, so a later
    call goes straight to the fallback).
    """
    fallback = path.fallback
    if fallback is None:
        return flex_attention(call, path, with_stats=with_lse)
    if not _flex.traces(call) or (
        call.terms.q_segments is not None and not _flex.values_finite(call)
    ):
        return _run(call, fallback, with_lse=with_lse)
    if call.terms.score_mod is None and call.terms.mask_mod is None:
        return flex_attention(call, path, with_stats=with_lse)
    try:
        return flex_attention(call, path, with_stats=with_lse)
    except Exception:  # flex could not trace the caller's function: the portable path
        _flex.failed(call)
        return _run(call, fallback, with_lse=with_lse)

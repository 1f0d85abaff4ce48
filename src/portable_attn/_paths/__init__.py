"""The paths that compute an attention call, each run as ``run(call, path, *, with_lse)``.

One module per path; :func:`run` dispatches on the :data:`~portable_attn._lib._path.Path`
the policy (:mod:`portable_attn._lib._policy`) chose, which no path imports:

=================  =================================================================
``Empty``          :meth:`AttentionCall.empty_result` (zeros, lse ``-inf`` or the sink)
``Dense``          :func:`portable_attn._lib._dense.dense_attention`
``Tiled``          :func:`._autodiff.tiled_attention` (the tiled kernel with its O(L)
                   backward), or :func:`._threads.threaded_attention` (NumPy: the
                   kernel in reused buffers, ``_buffered.py``, its query blocks in
                   threads)
``Native``         :func:`._native.native_attention` (torch SDPA, ``jax.nn``)
``DaskGrid``       :func:`._dask.dask_attention` (one task per visible chunk pair)
=================  =================================================================
"""

from __future__ import annotations

from typing import Any

from .._lib._call import AttentionCall
from .._lib._compat import compiles_eager_calls
from .._lib._dense import dense_attention
from .._lib._path import DaskGrid, Dense, Empty, Native, Path, Tiled, keeps_input_dtype
from ._autodiff import tiled_attention
from ._compiled import compiled_run
from ._dask import dask_attention
from ._native import native_attention, native_tiles
from ._threads import threaded_attention

__all__ = ["run"]


def run(call: AttentionCall, path: Path, *, with_lse: bool = False) -> tuple[Any, Any]:
    """Compute `call` on `path`: ``(out, lse)``, head axis kept.

    An eager JAX call runs as one compiled program, cached per call signature
    (:mod:`._compiled`), unless it holds a user function (a ``score_mod`` or
    ``mask_mod``: a program would keep the values it closes over from the first
    call, and a function made anew per call would compile per call); every other
    call runs as it is (:func:`_run`).
    """
    terms = call.terms
    user_functions = terms.score_mod is not None or terms.mask_mod is not None
    if compiles_eager_calls(call.query) and not user_functions and not isinstance(path, Empty):
        return compiled_run(call, path, with_lse, _run)
    return _run(call, path, with_lse=with_lse)


def _run(call: AttentionCall, path: Path, *, with_lse: bool = False) -> tuple[Any, Any]:
    """Compute `call` on `path` here: ``(out, lse)``, head axis kept.

    Both are in the compute dtype, except `out` of a path that keeps half-precision
    inputs in their dtype (a native kernel's result is then in that dtype).

    `out` is (..., Hq, Lq, Dv). `lse` is the row log-sum-exp (..., Hq, Lq, 1) with
    `with_lse` (``-inf`` for a row with no visible key and no sink), else None.

    Half-precision Q, K, V and bias are cast to the compute dtype here, before the
    path (and outside its autodiff function, so gradients reach the inputs in their
    dtype), unless the path takes them as they are (:func:`keeps_input_dtype`).
    """
    if not keeps_input_dtype(path):
        call = call.in_compute_dtype()
    match path:
        case Empty():
            out, lse = call.empty_result()
        case Dense(fold=fold, flash=flash, weights_first=first):
            result = dense_attention(
                call, fold=fold, flash=flash, weights_first=first, with_lse=with_lse
            )
            out, lse = result if with_lse else (result, None)
        case Tiled(workers=1, buffered=False):
            out, lse = tiled_attention(call, path)
        case Tiled():  # NumPy: in reused buffers, its query blocks in threads
            out, lse = threaded_attention(call, path)
        case Native(tiles=None):
            out, lse = native_attention(call), None  # in the input dtype when kept
        case Native(tiles=int(tiles)):
            out, lse = native_tiles(call, tiles), None
        case DaskGrid():
            result = dask_attention(call, path, with_lse=with_lse)
            out, lse = result if with_lse else (result, None)
        case _:
            msg = f"not a path: {path!r}"
            raise TypeError(msg)
    return out, (lse if with_lse else None)

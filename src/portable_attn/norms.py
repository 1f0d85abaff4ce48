"""Normalisations for QK-norm and cosine attention."""

from __future__ import annotations

from typing import Any

from ._lib._compat import array_namespace, result_type
from ._lib._masks import at_rank

__all__ = ["l2_normalize", "rms_norm"]


def _check(xp: Any, x: Any, axis: int, eps: float) -> None:
    if not xp.isdtype(x.dtype, "real floating"):
        msg = f"`x` must have a real floating dtype, but got dtype {x.dtype}"
        raise TypeError(msg)
    if not -x.ndim <= axis < x.ndim:
        msg = f"`axis` {axis} is out of range for `x` with shape {tuple(x.shape)}"
        raise ValueError(msg)
    if not eps > 0:
        msg = f"`eps` must be > 0, but got {eps!r}"
        raise ValueError(msg)


def l2_normalize(x: Any, axis: int = -1, eps: float = 1e-6) -> Any:
    """Divide `x` by its Euclidean norm along `axis`: ``x / max(||x||, eps)``.

    With unit-norm queries and keys the logits are cosines in [-1, 1]: their
    spread no longer grows with ``d_k``, so ``1/√d_k`` is the wrong scale (it
    would squash them towards uniform weights). Use a learned temperature as
    `scale` instead (cosine attention, QK-norm).

    Parameters
    ----------
    x : floating array, shape (...)
        Input, e.g. queries (..., H, L, D).
    axis : int, default -1
        Axis to normalise.
    eps : float, default 1e-6
        Lower bound of the norm (all-zero vectors stay zero).

    Returns
    -------
    array, same shape and dtype as `x`
        Computed in at least float32.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import l2_normalize
    >>> l2_normalize(np.array([3.0, 4.0]))
    array([0.6, 0.8])
    """
    xp = array_namespace(x=x)
    _check(xp, x, axis, eps)
    xc = xp.astype(x, result_type(xp, x.dtype, xp.float32), copy=False)
    # max(||x||, eps) as sqrt(max(||x||², eps²)): sqrt is never differentiated at 0,
    # so an all-zero vector (a padding token) has finite, zero gradients
    squared = xp.sum(xc * xc, axis=axis, keepdims=True)
    norm = xp.sqrt(xp.maximum(squared, eps * eps))
    return xp.astype(xc / norm, x.dtype, copy=False)


def rms_norm(x: Any, weight: Any | None = None, *, axis: int = -1, eps: float = 1e-6) -> Any:
    """Root-mean-square normalisation: ``x / sqrt(mean(x²) + eps) · weight``.

    Parameters
    ----------
    x : floating array, shape (...)
        Input.
    weight : floating array, broadcastable to `x`, optional
        Learned gain (shape (D,) for the last axis).
    axis : int, default -1
        Axis to normalise.
    eps : float, default 1e-6
        Added to the mean square.

    Returns
    -------
    array, same shape and dtype as `x`
        Computed in at least float32.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import rms_norm
    >>> rms_norm(np.array([2.0, -2.0]), eps=1e-12)
    array([ 1., -1.])
    """
    xp = array_namespace(x=x, weight=weight)
    _check(xp, x, axis, eps)
    xc = xp.astype(x, result_type(xp, x.dtype, xp.float32), copy=False)
    out = xc / xp.sqrt(xp.mean(xc * xc, axis=axis, keepdims=True) + eps)
    if weight is not None:
        out = out * at_rank(xp, xp.astype(weight, out.dtype, copy=False), out.ndim)
    return xp.astype(out, x.dtype, copy=False)

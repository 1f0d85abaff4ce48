"""The float64 NumPy oracle for attention, written independently of the library.

It loops over query rows and key columns for the structural masks and repeats
K/V heads explicitly for grouped-query attention: slow and obvious on purpose.
The test suite and ``portable-attn check`` both compare against it; it is
public as part of :mod:`portable_attn.testing`, and :func:`central_differences`
is the one finite-difference gradient both use.

Every function takes NumPy data (or anything :func:`numpy.asarray` takes) and
the keyword arguments of :func:`portable_attn.scaled_dot_product_attention`
that concern values: ``mask``, ``bias``, ``is_causal``, ``scale``, ``window``,
``softcap``, ``q_lengths``, ``kv_lengths``, ``alibi_slopes``, ``score_mod``,
``dropout_p`` with ``dropout_mask``, ``sinks``, ``q_segment_ids``,
``kv_segment_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "central_differences",
    "reference_attention",
    "reference_lse",
    "reference_weights",
    "structure",
]

Float64Array = npt.NDArray[np.float64]


def structure(
    lq: int,
    lk: int,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    offset: int | None = None,
) -> npt.NDArray[np.bool_]:
    """Return the positions that causality and a window allow, bottom-right aligned.

    Parameters
    ----------
    lq, lk : int
        Query and key lengths.
    is_causal : bool, default False
        Query row ``i`` sees keys ``j <= i + offset``.
    window : (int or None, int or None), optional
        ``(left, right)``: row ``i`` sees keys ``i + offset - left`` to
        ``i + offset + right`` (None: unbounded on that side).
    offset : int, optional
        Where row ``i`` sits among the keys, ``lk - lq`` by default (the last
        query row is the last key).

    Returns
    -------
    ndarray of bool
        ``(lq, lk)``, True where the key is visible.
    """
    allowed = np.ones((lq, lk), dtype=bool)
    offset = lk - lq if offset is None else offset
    for i in range(lq):
        ii = i + offset
        for j in range(lk):
            if is_causal and j > ii:
                allowed[i, j] = False
            if window is not None:
                left, right = window
                if left is not None and j < ii - left:
                    allowed[i, j] = False
                if right is not None and j > ii + right:
                    allowed[i, j] = False
    return allowed


def reference_weights(q: npt.ArrayLike, k: npt.ArrayLike, **kwargs: Any) -> Float64Array:
    """Return the attention weights in float64, computed row by row the obvious way.

    Parameters
    ----------
    q : array_like
        Query, ``(..., Hq, Lq, D)`` or ``(Lq, D)``.
    k : array_like
        Key, ``(..., Hkv, Lk, D)`` or ``(Lk, D)``; Hq a multiple of Hkv.
    **kwargs
        The value options of ``scaled_dot_product_attention`` (module docstring).
        With lengths or ALiBi slopes the batch is one leading axis B.

    Returns
    -------
    ndarray of float64
        ``(..., Hq, Lq, Lk)`` (``(Lq, Lk)`` for 2-D inputs); a row with no
        visible key is zero. With `sinks`, the sink joins each row's
        denominator: rows sum to less than one.
    """
    masked, sink, two_d, dropout = _masked_logits(q, k, **kwargs)
    with np.errstate(invalid="ignore", over="ignore"):
        row_max = masked.max(axis=-1, keepdims=True)
        if sink is not None:
            row_max = np.maximum(row_max, sink)
        empty = np.isneginf(row_max)
        shift = np.where(empty, 0.0, row_max)
        e = np.exp(masked - shift)
        total = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - shift)
        w = np.where(empty, 0.0, e / np.where(empty | (total == 0), 1.0, total))
    dropout_p, dropout_mask = dropout
    if dropout_mask is not None:
        w = np.where(dropout_mask, w / (1.0 - dropout_p), 0.0)
    return w[0] if two_d else w


def reference_lse(q: npt.ArrayLike, k: npt.ArrayLike, **kwargs: Any) -> Float64Array:
    """Return the log-sum-exp of each row's scores in float64.

    Parameters
    ----------
    q, k : array_like
        Query and key, as in :func:`reference_weights`.
    **kwargs
        As in :func:`reference_weights`.

    Returns
    -------
    ndarray of float64
        ``log(exp(sink) + Σ_j exp(s_ij))`` over the visible keys ``j``,
        ``(..., Hq, Lq)``; ``-inf`` for a row with no visible key and no sink.
    """
    masked, sink, two_d, _ = _masked_logits(q, k, **kwargs)
    if sink is not None:
        masked = np.concatenate([masked, np.broadcast_to(sink, (*masked.shape[:-1], 1))], -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        row_max = masked.max(axis=-1, keepdims=True)
        shift = np.where(np.isneginf(row_max), 0.0, row_max)
        lse = (shift + np.log(np.exp(masked - shift).sum(axis=-1, keepdims=True)))[..., 0]
    return lse[0] if two_d else lse


def reference_max_logit(q: npt.ArrayLike, k: npt.ArrayLike, **kwargs: Any) -> Float64Array:
    """Return the largest final score of each row over its visible keys, in float64.

    Parameters
    ----------
    q, k : array_like
        Query and key, as in :func:`reference_weights`.
    **kwargs
        As in :func:`reference_weights`; the sink is not a score and is left out.

    Returns
    -------
    ndarray of float64
        ``(..., Hq, Lq)``; ``-inf`` for a row with no visible key.
    """
    masked, _, two_d, _ = _masked_logits(q, k, **kwargs)
    top = masked.max(axis=-1)
    return top[0] if two_d else top


def _masked_logits(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    *,
    mask: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_lengths: npt.ArrayLike | None = None,
    kv_lengths: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    score_mod: Callable[..., Any] | None = None,
    dropout_p: float = 0.0,
    dropout_mask: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None,
    q_segment_ids: npt.ArrayLike | None = None,
    kv_segment_ids: npt.ArrayLike | None = None,
) -> tuple[Float64Array, Float64Array | None, bool, tuple[float, Any]]:
    """Logits with hidden positions -inf, the sinks as (..., Hq, 1, 1), 2-D flag, dropout."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    two_d = q.ndim == 2 and k.ndim == 2
    if q.ndim == 2:
        q = q[None]
    if k.ndim == 2:
        k = k[None]
    groups = q.shape[-3] // k.shape[-3]
    k = np.repeat(k, groups, axis=-3)  # (..., Hq, Lk, Dk): explicit repetition
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    logits = np.einsum("...qd,...kd->...qk", q, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    lq, lk = logits.shape[-2:]
    hq = logits.shape[-3]
    if score_mod is not None:
        nb = int(np.prod(logits.shape[:-3]))
        b_idx = np.arange(nb).reshape((*logits.shape[:-3], 1, 1, 1))
        ones = (1,) * (b_idx.ndim - 3)  # every index at the logits' rank, as the library's
        logits = score_mod(
            logits,
            b_idx,
            np.arange(hq).reshape(*ones, hq, 1, 1),
            np.arange(lq).reshape(*ones, 1, lq, 1),
            np.arange(lk).reshape(*ones, 1, 1, lk),
        )
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    per_batch = q_lengths is not None or kv_lengths is not None or alibi_slopes is not None
    if not per_batch:
        allowed = np.broadcast_to(
            structure(lq, lk, is_causal=is_causal, window=window), logits.shape
        )
    else:
        nb = logits.shape[0]
        allowed = np.ones(logits.shape, dtype=bool)
        logits = logits.copy()
        for b in range(nb):
            ql = lq if q_lengths is None else int(np.broadcast_to(q_lengths, (nb,))[b])
            kl = lk if kv_lengths is None else int(np.broadcast_to(kv_lengths, (nb,))[b])
            allowed[b] &= structure(lq, lk, is_causal=is_causal, window=window, offset=kl - ql)
            allowed[b, ..., ql:, :] = False
            allowed[b, ..., :, kl:] = False
            if alibi_slopes is not None:
                slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), (nb, hq))[b]
                i_pos = np.arange(lq)[:, None] + kl - ql
                dist = np.abs(i_pos - np.arange(lk)[None, :])
                logits[b] = logits[b] - slopes[:, None, None] * dist
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    if q_segment_ids is not None or kv_segment_ids is not None:
        q_ids = np.asarray(q_segment_ids if q_segment_ids is not None else kv_segment_ids)
        kv_ids = np.asarray(kv_segment_ids if kv_segment_ids is not None else q_segment_ids)
        same = np.empty((*np.broadcast_shapes(q_ids.shape[:-1], kv_ids.shape[:-1]), lq, lk), bool)
        for i in range(lq):
            for j in range(lk):
                same[..., i, j] = q_ids[..., i] == kv_ids[..., j]
        allowed = allowed & same[..., None, :, :]  # one head axis: every head alike
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[..., None, None]  # (..., Hq, 1, 1)
    masked = np.where(allowed, logits, -np.inf)
    return masked, sink, two_d, (dropout_p, dropout_mask)


def reference_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, **kwargs: Any
) -> Float64Array:
    """Return scaled dot-product attention in float64: the weights times the values.

    Parameters
    ----------
    q, k : array_like
        Query and key, as in :func:`reference_weights`.
    v : array_like
        Value, ``(..., Hkv, Lk, Dv)`` or ``(Lk, Dv)``.
    **kwargs
        As in :func:`reference_weights`.

    Returns
    -------
    ndarray of float64
        ``(..., Hq, Lq, Dv)`` (``(Lq, Dv)`` for 2-D inputs); zero for a row
        with no visible key.
    """
    v = np.asarray(v, dtype=np.float64)
    w = reference_weights(q, k, **kwargs)
    two_d = np.ndim(q) == 2 and np.ndim(k) == 2 and v.ndim == 2
    if w.ndim == 2:
        w = w[None]
    if v.ndim == 2:
        v = v[None]
    groups = w.shape[-3] // v.shape[-3]
    v = np.repeat(v, groups, axis=-3)
    out = w @ v
    return out[0] if two_d else out


def central_differences(
    fn: Callable[..., Any], args: Sequence[npt.ArrayLike], eps: float = 1e-6
) -> list[Float64Array]:
    """``d fn / d args[i]`` by central differences, on NumPy copies of the arguments.

    Parameters
    ----------
    fn : callable
        Scalar function of NumPy float64 arrays.
    args : sequence of ndarray
        The point to differentiate at (not modified).
    eps : float, default 1e-6
        Step.

    Returns
    -------
    list of ndarray
        One gradient per argument, shaped like it.
    """
    point = [np.asarray(a, dtype=np.float64) for a in args]
    grads = []
    for i, a in enumerate(point):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            hi, lo = a.copy(), a.copy()
            hi[idx] += eps
            lo[idx] -= eps
            up = fn(*point[:i], hi, *point[i + 1 :])
            down = fn(*point[:i], lo, *point[i + 1 :])
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads

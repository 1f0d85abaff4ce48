"""Softmax over the key axis that never produces NaN for a row with no visible key.

The row maximum is subtracted before ``exp``. A row whose every entry is
``-inf`` (all keys masked, or a bias of ``-inf`` everywhere) has maximum
``-inf``; :func:`finite_shift` raises it to the dtype's lowest finite value, so
``exp`` gives exact zeros and the row sum is 0. :func:`safe_denominator` raises
that 0 to one half, which leaves the row at exactly zero. The
raised branch is a finite constant, so gradients stay finite too. NaN or ``+inf``
in the logits are not special-cased: they propagate as in plain math.

Both guards are a ``maximum`` with a constant (a ``full_like``: a Python scalar there
would make torch's array-API layer ask ``torch.result_type``, which ``torch.compile``
cannot trace), not ``where(x == -inf, 0, x)``: XLA
CPU (jax 0.10) fuses the max, ``exp``, row sum and ``P @ V`` of the dense path into
one kernel only without a compare-and-select between them. Under ``jax.jit``, on
Flax's padded batch (B=2, L=512, H=8, D=64) the ``where`` guards ran 1.9-2.0x the
time of the ``clip`` guards (benchmarks/results/xla-forms.json).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._masks import at_rank

__all__ = ["finite_shift", "masked_exp", "safe_denominator", "with_sink"]


def masked_exp(
    xp: Any,
    logits: Any,
    allowed: Any | None,
    *,
    rows_may_be_empty: bool = True,
    row_sum: bool = True,
    sink: Any | None = None,
    stop_gradient: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any | None, Any, Any]:
    """Return the unnormalised weights ``exp(logits - rowmax)``, their row sums, shift, max.

    Parameters
    ----------
    xp : namespace
        Array namespace.
    logits : array, shape (..., Lq, Lk)
        Scores in the compute dtype (float32 or float64).
    allowed : array of bool, broadcastable to `logits`, or None
        Positions that may be attended to; the others contribute exactly 0.
    rows_may_be_empty : bool, default True
        False when no row can be all ``-inf``
        (:func:`portable_attn._lib._scores.rows_may_be_empty`): the guard for
        such a row is then skipped, which only matters for non-finite inputs,
        and those propagate anyway.
    row_sum : bool, default True
        False skips the pass for the row sums (a caller that gets them from
        ``exp_logits @ [V | 1]``) and returns None for them.
    sink : array broadcastable to (..., Lq, 1), optional
        An extra logit per row (attention sinks): it takes part in the row max,
        and ``exp(sink - m)`` in the row sum; the caller adds it where the sums
        come from elsewhere.
    stop_gradient : callable, optional
        The library's stop-gradient (``_compat.stop_gradient``), applied to the
        row max. The shift cancels exactly (``exp(s - m) / sum exp(s - m)`` and
        ``m + log sum exp(s - m)`` do not depend on ``m``), so its true gradient
        is zero; differentiating through the max instead gave NaN gradients in
        compiled backwards (``torch.compile`` with a mask and a softcap). The
        tiled path stops the gradient of its running max the same way.

    Returns
    -------
    exp_logits : array, shape (..., Lq, Lk)
        ``exp(logits - m)`` with masked entries 0, where ``m`` is the row max
        over visible keys (0 for a row with no visible key).
    row_sum : array, shape (..., Lq, 1), or None
        Sum of `exp_logits` over keys (and the sink's term); 0 exactly for a row
        with no visible key and no sink.
    shift : array, shape (..., Lq, 1)
        ``m``: ``log(row_sum) + m`` is the row's log-sum-exp.
    top : array, shape (..., Lq, 1)
        The largest visible logit of each row (the sink left out), ``-inf`` where
        none is visible; its gradient stopped like the shift's.
    """
    if allowed is not None:
        logits = xp.where(at_rank(xp, allowed, logits.ndim), logits, -xp.inf)  # (..., Lq, Lk)
    row_max = xp.max(logits, axis=-1, keepdims=True)  # (..., Lq, 1)
    top = row_max if stop_gradient is None else stop_gradient(row_max)
    if sink is not None:
        sink = at_rank(xp, sink, logits.ndim)
        row_max = xp.maximum(row_max, sink)
        row_max = row_max if stop_gradient is None else stop_gradient(row_max)
    else:
        row_max = top
    if rows_may_be_empty or sink is not None:
        row_max = finite_shift(xp, row_max)  # empty rows: exp(-inf) = 0
    exp_logits = xp.exp(logits - row_max)  # (..., Lq, Lk)
    if not row_sum:
        return exp_logits, None, row_max, top
    sums = xp.sum(exp_logits, axis=-1, keepdims=True)
    if sink is not None:
        sums = sums + xp.exp(sink - row_max)
    return exp_logits, sums, row_max, top


def with_sink(xp: Any, out: Any, lse: Any, sink: Any) -> tuple[Any, Any]:
    """Add a sink logit to normalised rows: ``(out · w, log(exp(lse) + exp(sink)))``.

    `out` (..., Lq, Dv) and `lse` (..., Lq, 1) are a softmax over the visible keys
    alone (lse ``-inf`` for a row that sees none); the sink (broadcastable to `lse`)
    joins the denominator, so ``w = exp(lse) / (exp(lse) + exp(sink))``. A row with
    neither stays zero with lse ``-inf``; no NaN, in values or gradients.
    """
    sink = at_rank(xp, sink, lse.ndim)
    shift = finite_shift(xp, xp.maximum(lse, sink))
    own = xp.exp(lse - shift)
    total = own + xp.exp(sink - shift)
    denominator = safe_denominator(xp, total)
    lse_all = xp.where(total == 0.0, -xp.inf, shift + xp.log(denominator))
    return out * (own / denominator), lse_all


def finite_shift(xp: Any, row_max: Any) -> Any:
    """Return `row_max` with ``-inf`` (a row with no visible key yet) raised to finite.

    The lowest finite value of the dtype: ``exp(-inf - shift)`` is then exactly 0,
    and every finite maximum is unchanged. NaN stays NaN.
    """
    return xp.maximum(row_max, xp.full_like(row_max, float(xp.finfo(row_max.dtype).min)))


def safe_denominator(xp: Any, row_sum: Any) -> Any:
    """Return `row_sum` with zeros (rows with no visible key) raised to one half.

    A row sum is 0 (no visible key) or at least 1: the largest entry contributes
    ``exp(0) = 1`` and the others are non-negative, in every path's summation order.
    So only empty rows change, and their numerators are 0: they stay exactly 0. One
    half, not the smallest normal number: ``1 / denominator`` stays moderate, so the
    gradients of an empty row stay finite, and no sum can tie with it (a tie would
    split the gradient). NaN stays NaN.
    """
    return xp.maximum(row_sum, xp.full_like(row_sum, 0.5))

"""Exact merge of attention computed over disjoint sets of keys.

If the keys are split into parts and part ``p`` gives the normalised output
``out_p`` with row log-sum-exp ``lse_p`` (``-inf`` for a row that sees no key of
that part), the attention over all keys is::

    m   = max_p lse_p                      # any common shift works; it cancels
    w_p = exp(lse_p - m)
    out = sum_p w_p · out_p / sum_p w_p    # zero where every part is empty

This is the online-softmax update of the tiled path applied to whole parts.
The reductions over parts are passed in, so the same code merges a stacked
axis (``xp.max`` / ``xp.sum``) or devices of a mesh (``lax.pmax`` / ``lax.psum``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._masks import at_rank
from ._softmax import finite_shift, safe_denominator

__all__ = ["merge_partials"]

Reduce = Callable[[Any], Any]


def merge_partials(
    xp: Any, out: Any, lse: Any, *, max_over: Reduce, sum_over: Reduce
) -> tuple[Any, Any]:
    """Combine partial attention results; return (output, log-sum-exp).

    Parameters
    ----------
    xp : namespace
        Array namespace of `out` and `lse`.
    out : array, shape (P..., ..., Lq, Dv)
        Each part's normalised output (zeros for rows with no key in the part).
    lse : array, shape (P..., ..., Lq, 1) or (P..., ..., Lq, 2)
        Each part's row log-sum-exp, ``-inf`` for rows with no key in the part;
        or its row statistics, the lse then the row max
        (:func:`~._scores.row_stats`), whose max is taken.
    max_over, sum_over : callable
        Reductions over the parts (``P...``): they must drop the part axes.

    Returns
    -------
    out : array, shape (..., Lq, Dv)
    lse : array, shape (..., Lq, 1) or (..., Lq, 2)
        ``-inf`` for rows that see no key in any part (then the row max, if given).
    """
    row_max = None
    if lse.shape[-1] == 2:
        lse, row_max = lse[..., :1], max_over(lse[..., 1:])
    m = max_over(lse)
    m_safe = finite_shift(xp, m)  # every part empty: weights are exp(-inf) = 0
    w = xp.exp(lse - at_rank(xp, m_safe, lse.ndim))  # (P..., ..., Lq, 1)
    total = sum_over(w)  # (..., Lq, 1)
    merged = sum_over(w * out) / safe_denominator(xp, total)
    lse_all = xp.where(total == 0.0, -xp.inf, m_safe + xp.log(safe_denominator(xp, total)))
    if row_max is not None:
        lse_all = xp.concat([lse_all, row_max], axis=-1)
    return merged, lse_all

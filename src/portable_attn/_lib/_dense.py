"""The dense attention computation: one block covering every query and key."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, NamedTuple

from ._call import AttentionCall
from ._compat import matmul_float32, stop_gradient
from ._masks import at_rank
from ._path import Dense
from ._scores import (
    PLAIN_TERMS,
    AttentionPlan,
    ScoreTerms,
    allowed_block,
    heads_to_rows,
    if_finite,
    keys_hidden_from_rows,
    logits_block,
    row_stats,
    rows_may_be_empty,
    rows_to_heads,
    scaled_query_rows,
    scores_block,
    visible_product,
    with_ones_column,
    without_hidden_keys,
    zero_rows,
)
from ._softmax import masked_exp, safe_denominator

__all__ = ["DenseKernel", "dense_attention", "dense_kernel", "dense_weights"]


class _Exp(NamedTuple):
    """Unnormalised weights of the dense path and what normalises them."""

    weights: Any  # exp(scores - shift), (..., Hq, Lq, Lk), hidden entries 0
    row_sum: Any | None  # (..., Hq, Lq, 1), the sink's term included; None when folded
    shift: Any  # (..., Hq, Lq, 1)
    may_be_empty: bool
    top: Any  # (..., Hq, Lq, 1): the largest visible score, -inf for none, no gradient
    allowed: Any | None  # (..., Hq|1, Lq|1, Lk|1): the entries that may be seen, None: all


def _exp_logits(
    xp: Any,
    q: Any,
    k: Any,
    bias: Any | None,
    terms: ScoreTerms,
    plan: AttentionPlan,
    *,
    row_sum: bool = True,
    matmul: Any = None,
) -> _Exp:
    """Unnormalised weights, their row sums (None unless `row_sum`), shift, emptiness.

    `matmul`: FlashAttention's form, half `q`, `k` with float32 products.
    """
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    if matmul is None:
        capped = logits_block(xp, scaled_query_rows(xp, q, plan), k, plan)  # (..., Hq, Lq, Lk)
    else:
        q_rows = heads_to_rows(xp, q, plan.num_kv_heads)
        capped = logits_block(xp, q_rows, k, plan, matmul=matmul)  # float32
    scores = scores_block(xp, capped, bias, terms, plan, whole_q, whole_k)
    allowed = allowed_block(xp, terms, plan, whole_q, whole_k)
    # The empty-row guards also wherever a mask is applied, though the band alone may
    # leave no row empty: with the `where` guards XLA CPU compiled the guarded form
    # faster (loop.json at a2876ee); with today's clip guards both forms run alike
    # (causal, L = 1024, jax.jit: "none, weights" at 1.00x the guarded form in
    # benchmarks/results/xla-forms.json), so one rule serves every mask.
    may_be_empty = rows_may_be_empty(bias, terms, plan) or allowed is not None
    exp_logits, sums, shift, top = masked_exp(
        xp,
        scores,
        allowed,
        rows_may_be_empty=may_be_empty,
        row_sum=row_sum,
        sink=terms.sinks,
        stop_gradient=stop_gradient,  # the shift cancels: its gradient is exactly zero
    )
    return _Exp(exp_logits, sums, shift, may_be_empty or terms.sinks is not None, top, allowed)


def _rows_seeing(xp: Any, allowed: Any, plan: AttentionPlan, keys: Any) -> Any:
    """Which query rows may see one of `keys`: (..., Hkv, G*Lq, 1), the product's rows.

    `keys` (..., Hkv, Lk, 1) flags keys of each key/value head; `allowed`
    (..., Hq|1, Lq|1, Lk|1) the call's mask. A reduction over the mask, not over the
    weights, which stay the operand of the product alone.
    """
    hkv = plan.num_kv_heads
    flags = xp.matrix_transpose(keys)  # (..., Hkv, 1, Lk)
    flags = xp.broadcast_to(flags, (*flags.shape[:-2], plan.groups, flags.shape[-1]))
    flags = rows_to_heads(xp, flags, plan.num_q_heads)  # (..., Hq, 1, Lk)
    rank = max(flags.ndim, allowed.ndim)
    sees = xp.logical_and(at_rank(xp, allowed, rank), at_rank(xp, flags, rank))
    sees = xp.any(sees, axis=-1, keepdims=True)  # (..., Hq|1, Lq|1, 1)
    shape = (*plan.batch, plan.num_q_heads, plan.q_len, 1)
    return heads_to_rows(xp, xp.broadcast_to(at_rank(xp, sees, len(shape)), shape), hkv)


def _normalise(xp: Any, x: Any, row_sum: Any, may_be_empty: bool) -> Any:
    """Divide by the row sums; rows with no visible key (sum 0) stay exactly 0."""
    return x / safe_denominator(xp, row_sum) if may_be_empty else x / row_sum


def _dropout(xp: Any, weights: Any, terms: ScoreTerms) -> Any:
    """Zero the dropped weights; the caller applies ``1 / (1 - p)``."""
    if terms.dropout_keep is None:
        return weights
    return xp.where(at_rank(xp, terms.dropout_keep, weights.ndim), weights, 0.0)


def dense_attention(
    call: AttentionCall,
    *,
    fold: bool = False,
    flash: bool = False,
    weights_first: bool = False,
    with_lse: bool = False,
) -> Any:
    """Attention output, shape (*batch, Hq, Lq, Dv), in the compute dtype.

    The normalisation is applied after the second matmul: dividing the
    ``(Lq, Dv)`` output is cheaper than dividing the ``(Lq, Lk)`` weights when each
    operation runs on its own. With `weights_first` (decided by the policy: XLA,
    which compiles the softmax and ``P @ V`` into one kernel) the weights are
    divided before ``P @ V`` instead. With `fold` (decided by the path policy), the
    row sums come from the same matmul, with a column of ones appended to V
    (``[P V | P 1]``), instead of another pass over the ``(Lq, Lk)`` weights.
    `with_lse` also returns the row log-sum-exp (..., Hq, Lq, 1), ``-inf`` for rows
    with no visible key (with the plan's ``row_max``, the row statistics
    (..., Hq, Lq, 2) of :func:`~._scores.row_stats`).

    With `flash` (half-precision Q, K, V, decided by the policy), FlashAttention's
    form: ``Q Kᵀ`` and ``P V`` take half operands and accumulate in float32
    (:func:`~._compat.matmul_float32`), the scores, softmax and row sums are
    float32, and only the probabilities are rounded to the input dtype for ``P V``.
    Without it, half inputs are cast to float32 first.
    """
    xp, q, k, v, bias = call.xp, call.query, call.key, call.value, call.bias
    terms, plan = call.terms, call.plan
    # keys no query sees (past the lengths, another document's) get weight 0, but 0 · NaN
    # is NaN: where K and V hold only finite values the call is the plain one (nothing
    # to zero: no pass over a whole cache), else those keys' rows are zeroed. One choice
    # for the whole computation: under JAX one cond, whose branches output the result
    hidden = keys_hidden_from_rows(xp, terms, plan, (0, plan.q_len), (0, plan.kv_len))
    forms = {"fold": fold, "flash": flash, "weights_first": weights_first, "with_lse": with_lse}
    if hidden is None:
        return _weighted_sum(xp, q, k, v, bias, terms, plan, None, **forms)
    return if_finite(
        xp,
        (k, v),
        lambda: _weighted_sum(xp, q, k, v, bias, terms, plan, None, **forms),
        lambda: _weighted_sum(xp, q, k, v, bias, terms, plan, hidden, **forms),
    )


def _weighted_sum(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    bias: Any | None,
    terms: ScoreTerms,
    plan: AttentionPlan,
    hidden: Any | None,
    *,
    fold: bool,
    flash: bool,
    weights_first: bool,
    with_lse: bool,
) -> Any:
    """Compute the dense path, the rows of K and V of `hidden` keys zeroed where not finite.

    `hidden` (*batch, 1, Lk, 1), from :func:`~._scores.keys_hidden_from_rows`, or None:
    K is zeroed there (whatever it holds, the gradient ``dQ = dS K`` never meets it),
    V only in the product (:func:`~._scores.visible_product`). The caller gives
    `hidden` where K or V holds a value that is not finite (:func:`dense_attention`):
    both are zeroed then, without a second choice (under JAX, each would be a
    ``cond`` whose result, a copy of the whole cache, XLA reserves on every call).
    """
    matmul = matmul_float32(q) if flash else None  # else: in the compute dtype
    fold = fold and matmul is None and not weights_first  # those sum P themselves
    k = zero_rows(xp, k, hidden)
    if bias is not None and bias.dtype != plan.compute_dtype:
        bias = xp.astype(bias, plan.compute_dtype)
    e = _exp_logits(xp, q, k, bias, terms, plan, row_sum=not fold, matmul=matmul)
    row_sum = e.row_sum
    weights = e.weights
    if weights_first:
        weights = _normalise(xp, weights, row_sum, e.may_be_empty)
    exp_logits = heads_to_rows(xp, _dropout(xp, weights, terms), plan.num_kv_heads)
    # P rounded to the input dtype, P V summed in float32 (float32 P: rounded inside)
    mm = operator.matmul if matmul is None else matmul

    chosen = None if hidden is None else _exact  # the finite check, where not made yet

    def product(values: Any) -> Any:  # (..., Hkv, G*Lq, Lk) @ values, as (..., Hq, Lq, D)
        some_rows = terms.q_segments is not None  # keys hidden from some rows only
        seen = None if e.allowed is None else partial(_rows_seeing, xp, e.allowed, plan)
        out = visible_product(
            xp, mm, exp_logits, values, hidden, some_rows=some_rows, seen=seen, choose=chosen
        )
        return rows_to_heads(xp, out, plan.num_q_heads)

    if matmul is not None:
        out = product(v) * terms.dropout_scale  # (..., Hq, Lq, Dv)
    elif fold:
        out = product(with_ones_column(xp, v, plan))  # (..., Hq, Lq, Dv+1)
        out, row_sum = out[..., : plan.value_dim], out[..., plan.value_dim :]
        if terms.sinks is not None:
            row_sum = row_sum + xp.exp(at_rank(xp, terms.sinks, e.shift.ndim) - e.shift)
    else:
        out = product(v)  # (..., Hq, Lq, Dv)
        out = out if terms.dropout_keep is None else out * terms.dropout_scale
    if not weights_first:
        out = _normalise(xp, out, row_sum, e.may_be_empty)
    if not with_lse:
        return out
    lse = e.shift + xp.log(safe_denominator(xp, row_sum))
    return out, row_stats(xp, plan, xp.where(row_sum == 0.0, -xp.inf, lse), e.top)


def _exact(values: Any, as_they_are: Callable[[], Any], exact: Callable[[], Any]) -> Any:
    """Take ``exact()``: the choice of :func:`~._scores.visible_product`, made by the caller."""
    return exact()


def dense_weights(call: AttentionCall) -> Any:
    """Attention weights, shape (*batch, Hq, Lq, Lk), in the compute dtype."""
    call = call.in_compute_dtype()
    xp, terms, plan = call.xp, call.terms, call.plan
    key = without_hidden_keys(xp, call.key, terms, plan, (0, plan.kv_len))
    e = _exp_logits(xp, call.query, key, call.bias, terms, plan)
    weights = _normalise(xp, e.weights, e.row_sum, e.may_be_empty)
    if terms.dropout_keep is not None:
        weights = _dropout(xp, weights, terms) * terms.dropout_scale
    return weights


@dataclass(frozen=True)
class DenseKernel:
    """The dense path called with a call's own Q, K, V and mask, as the router decided.

    Kept by the cache (``_lib/_cache.py``) for a call signature whose arrays the path
    takes as they are (:func:`dense_kernel`), as torch's SDPA call is
    (``_paths/_native.py``): a repeated call is :func:`dense_attention` alone, without
    gathering the call again: the namespace, the plan and the path are the call's.
    """

    xp: Any
    plan: AttentionPlan
    path: Dense

    def __call__(self, query: Any, key: Any, value: Any, mask: Any) -> Any:
        """Return the output (*batch, Hq, Lq, Dv) of :func:`dense_attention` on the arrays."""
        terms = PLAIN_TERMS if mask is None else ScoreTerms(mask=mask)
        path = self.path
        return _weighted_sum(
            self.xp,
            query,
            key,
            value,
            None,
            terms,
            self.plan,
            None,  # the call holds no lengths or segment ids: no key is hidden
            fold=path.fold,
            flash=path.flash,
            weights_first=path.weights_first,
            with_lse=False,
        )


def dense_kernel(call: AttentionCall, path: Any, arguments: tuple[Any, ...]) -> DenseKernel | None:
    """Return the dense path's call of `call` where it takes the caller's arrays as they are.

    `call` is the call the route runs (after any cast to the compute dtype);
    `arguments` the caller's query, key, value and mask. None unless `path` is
    :class:`~._path.Dense`, the call holds those very objects (no head axis added, no
    cast, a mask of at least 2 dims) and nothing else, and its result needs no cast.
    """
    if not isinstance(path, Dense) or call.drop_head or call.bias is not None:
        return None
    query, key, value, mask = arguments
    terms, plan = call.terms, call.plan
    if terms.mask is not mask or not _holds_only_mask(terms):
        return None
    if not (call.query is query and call.key is key and call.value is value):
        return None
    if plan.result_dtype != plan.compute_dtype:
        return None
    return DenseKernel(call.xp, plan, path)


def _holds_only_mask(terms: ScoreTerms) -> bool:
    """Whether every score term but the mask is the plain call's (compared by identity)."""
    return all(
        getattr(terms, f.name) is getattr(PLAIN_TERMS, f.name)
        for f in fields(terms)
        if f.name != "mask"
    )

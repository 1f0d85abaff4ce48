"""Tiled attention with the online softmax: exact, O(L) memory, causal block skipping.

Forward (FlashAttention-2 / Rabe-Staats): for each query block, walk the key
blocks keeping a running row max ``m``, a running denominator ``l`` and a running
weighted sum ``acc``; when the max grows, rescale ``l`` and ``acc`` by
``exp(m_old - m_new)``; divide once at the end. No array larger than one
``(..., Hq, bq, bk)`` block of scores is ever built.

Backward (FlashAttention-2): recompute each block's probabilities from the saved
log-sum-exp ``lse = m + log(l)`` and accumulate ``dQ``, ``dK``, ``dV`` (and the
bias gradient) block by block, so training keeps O(L) memory too.

Which (query block, key block) pairs are computed, and which need a mask, is the
one answer of ``_blocks.py``: read on the host here, traced by value in JAX's loop
(``_paths/_loop.py``). The online softmax (:class:`OnlineSoftmax`) is written once
against :class:`Ops`, whose NumPy form (``_paths/_buffered.py``) writes into reused
buffers. Everything here is array-API standard; the adapters that register the
backward with torch and JAX live in ``portable_attn._paths._autodiff``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from ._blocks import FULL, block_ranges, host_pair_states
from ._call import AttentionCall
from ._compat import on_device, split_rows
from ._masks import at_rank
from ._path import Blocks
from ._scores import (
    AttentionPlan,
    ScoreTerms,
    alibi_block,
    alibi_distance,
    allowed_block,
    capped_logits,
    empty_result,
    heads_to_rows,
    hidden_rows_zeroed,
    if_finite,
    keys_hidden_from_rows,
    modified_scores,
    raw_logits_block,
    row_stats,
    rows_to_heads,
    scaled_query_rows,
    score_index,
    scores_block,
    slice_block,
    visible_product,
    with_ones_column,
)
from ._softmax import finite_shift, safe_denominator, with_sink

__all__ = [
    "Blocks",
    "Keys",
    "OnlineSoftmax",
    "Ops",
    "RowState",
    "ScoreVjp",
    "block_scores",
    "normalised",
    "online_step",
    "sum_to_shape",
    "tiled_backward",
    "tiled_forward",
    "visible_entries",
]

Range = tuple[int, int]

#: ``score_vjp(scores, batch, head, q_idx, kv_idx) -> (modified, pullback)``: a block's
#: ``score_mod`` and its VJP, ``pullback(d_modified) -> (d_scores, d_params)``, where
#: ``d_params`` are the gradients of the arrays the ``score_mod`` closes over (a tuple,
#: the same length for every block); given by ``_paths/_autodiff.py``
ScoreVjp = Callable[..., tuple[Any, Callable[[Any], tuple[Any, tuple[Any, ...]]]]]


def sum_to_shape(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """Sum `x` over the axes that broadcasting added to reach it from `shape`."""
    lead = x.ndim - len(shape)
    if lead > 0:
        x = xp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if axes:
        x = xp.sum(x, axis=axes, keepdims=True)
    return x


class Ops:
    """The operations of the online softmax that a workspace may do in its own buffers.

    This portable form returns fresh arrays; ``_paths/_buffered.py`` gives NumPy's
    form, which writes into buffers it allocated once per call (``out=``). The walk
    (:class:`OnlineSoftmax`) is written once against these.
    """

    #: runs a pair of blocks of a backward that the library's autodiff records (:meth:`recomputed`)
    recorder: Callable[[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]], Any] | None = None

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def query_rows(self, q_blk: Any, plan: AttentionPlan) -> Any:
        """``scale · Q`` of a query block as (..., Hkv, G*bq, Dk) (:func:`scaled_query_rows`)."""
        return scaled_query_rows(self.xp, q_blk, plan)

    def with_ones(self, call: AttentionCall) -> Any:
        """``[V | 1]`` of `call` (:func:`with_ones_column`)."""
        return with_ones_column(self.xp, call.value, call.plan)

    def scores(self, q_rows: Any, k_t: Any, shape: tuple[int, ...]) -> Any:
        """``q_rows @ k_t``: (..., Hkv, G*bq, Dk) x (..., Hkv, Dk, bk), as (..., Hq, bq, bk)."""
        return rows_to_heads(self.xp, q_rows @ k_t, shape[-3])

    def cap(self, s: Any, softcap: Any) -> Any:
        """``softcap · tanh(s / softcap)``."""
        return softcap * self.xp.tanh(s / softcap)

    def modified(self, s: Any, score_mod: Any, *index: Any) -> Any:
        """``score_mod(s, *index)``, in the dtype of `s` (:func:`~._scores.modified_scores`)."""
        return modified_scores(self.xp, score_mod, s, index)

    def add(self, s: Any, x: Any) -> Any:
        """``s + x``."""
        return s + x

    def hide(self, s: Any, allowed: Any) -> Any:
        """``-inf`` where not `allowed`."""
        return self.xp.where(allowed, s, -self.xp.inf)

    def row_max(self, s: Any) -> Any:
        """Return the largest score of each row of a block: (..., rows, keys) -> (..., rows, 1)."""
        return self.xp.max(s, axis=-1, keepdims=True)

    def row_sum(self, p: Any) -> Any:
        """Return each row's sum of a block's weights: (..., rows, keys) -> (..., rows, 1)."""
        return self.xp.sum(p, axis=-1, keepdims=True)

    def maximum(self, m: Any, m_blk: Any) -> Any:
        """``maximum(m, m_blk)``."""
        return self.xp.maximum(m, m_blk)

    def exp(self, x: Any, owned: bool = False) -> Any:
        """``exp(x)``; `owned`: `x` is a fresh array of ours that may be overwritten."""
        return self.xp.exp(x)

    def exp_shifted(self, s: Any, m: Any, owned: bool) -> Any:
        """``exp(s - m)``; `owned`: `s` is a fresh array of ours that may be overwritten."""
        if owned:
            s -= m  # saves a third (bq, bk) block
            return self.exp(s, owned=True)
        return self.exp(s - m, owned=True)

    def dropped(self, p: Any, keep: Any) -> Any:
        """`p` with the entries dropout drops zeroed."""
        return self.xp.where(keep, p, 0.0)

    def matmul(self, p_rows: Any, v: Any, first: bool) -> Any:
        """``p_rows @ v``; `first`: the product becomes the accumulator."""
        return p_rows @ v

    def if_finite(self, values: Any, plain: Any, exact: Any) -> Any:
        """``plain()`` where no entry of `values` is non-finite, else ``exact()``.

        The rule of :func:`~._scores.visible_product` (:func:`~._scores.if_finite`):
        the product over values as they are is exact where none of them is
        non-finite. Values are read only where that is free (NumPy, torch CPU); JAX
        chooses inside its program, by the plain product being finite
        (:func:`~._compat.branch_on_finite`); a workspace may give its own rule.
        """
        return if_finite(self.xp, values, plain, exact)

    def rescaled(self, acc: Any, alpha: Any, pv: Any) -> Any:
        """``alpha · acc + pv``."""
        return alpha * acc + pv

    def write(self, target: Any, value: Any) -> None:
        """Write `value` into `target`, a view of an output array of ours."""
        target[...] = value

    def release(self) -> None:
        """Hand back what the walk held (a workspace's thread arena)."""

    def recomputed(
        self, block: Callable[..., Any], args: tuple[Any, ...], reads: tuple[Any, ...]
    ) -> Any:
        """``block(*args, *reads)``: a pair of blocks of the backward; `reads` its arrays.

        A library whose autodiff records the backward (a second derivative) may keep
        only `reads` and run the block again for its own backward, so the record holds
        no block's scores, and its backward one block's at a time: `recorder`, where
        set, runs it.
        """
        if self.recorder is not None:
            return self.recorder(block, args, reads)
        return block(*args, *reads)


class RowState(NamedTuple):
    """The online softmax of one query block's rows, between key blocks.

    ``m`` the running max (None before the first block), ``l_sum`` the running
    denominator (None when it rides along as the accumulator's last column),
    ``acc`` the running weighted sum, ``rows_seen``: some earlier block showed every
    row a finite score (a static fact, False in a traced loop's carry).
    """

    m: Any
    l_sum: Any
    acc: Any
    rows_seen: bool = False


@dataclasses.dataclass(frozen=True)
class Keys:
    """One part of the keys a walk visits: its call, ``Kᵀ`` and the values it multiplies.

    `values` is V, or ``[V | 1]`` when the row sums are folded into ``P @ [V | 1]``.
    A call's own keys are one part; a Dask task walks the consecutive key chunks of
    one query chunk as several parts (each placed at its positions).
    """

    call: AttentionCall
    k_t: Any  # (..., Hkv, Dk, Lk_part)
    values: Any
    shows_rows: bool  # a FULL pair shows every row a finite score (nothing unstructured hides)

    @classmethod
    def of(cls, call: AttentionCall, values: Any) -> Keys:
        terms = call.terms
        hides = (
            terms.mask is not None
            or call.bias is not None
            or terms.score_mod is not None
            or terms.alibi_slopes is not None
        )
        return cls(call, call.xp.matrix_transpose(call.key), values, not hides)


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """The online softmax of one call's queries: ``start``, ``step`` per key block, ``finish``.

    The one implementation of it, run by every walk: the Python loop and NumPy's
    buffered loop of :func:`tiled_forward` (its threads and Dask's tasks), and the
    traced loop of ``_paths/_loop.py`` (which carries ``(m, l_sum, acc)`` from
    :meth:`carry_start`). `ops` does the block operations (fresh arrays, or NumPy's
    workspace buffers); `fold` takes the row sums from ``P @ [V | 1]``;
    `stop_gradient` (the library's, when plain autodiff differentiates the walk)
    stops the running max's gradient, which is exactly zero.
    """

    call: AttentionCall
    ops: Ops
    fold: bool = False
    stop_gradient: Any = None

    def start(self, bq: int) -> RowState:
        """Return the state before the first key block: nothing seen (a sink joins at the end)."""
        return RowState(None, None, None)

    def carry_start(self, bq: int) -> tuple[Any, Any, Any]:
        """Return ``(m, l_sum, acc)`` of rows that saw nothing yet: -inf, 0, 0 (a loop carry)."""
        xp, plan = self.call.xp, self.call.plan
        rows = (*plan.batch, plan.num_q_heads, bq)
        m = xp.full((*rows, 1), -xp.inf, dtype=plan.compute_dtype, **on_device(plan.device))
        width = plan.value_dim + (1 if self.fold else 0)
        acc = _zeros(xp, (*rows, width), plan)
        return m, (None if self.fold else _zeros(xp, (*rows, 1), plan)), acc

    def step(
        self, state: RowState, q_rows: Any, keys: Keys, q_range: Range, k_range: Range, full: bool
    ) -> RowState:
        """Visit key block `k_range` of `keys`: a pair the states do not skip.

        `full`: the pair needs no structured mask (:data:`~._blocks.FULL`).
        """
        ops, xp = self.ops, self.call.xp
        plan = keys.call.plan
        hkv, hq = plan.num_kv_heads, plan.num_q_heads
        ks, ke = k_range
        s = block_scores(ops, q_rows, keys, q_range, k_range, full)
        terms = keys.call.terms
        v_blk = keys.values[..., ks:ke, :]
        some_rows = not full and terms.q_segments is not None

        def product(p_blk: Any, first: bool) -> Any:  # (..., Hq, bq, bk) @ V, as (..., Hq, bq, D)
            # keys hidden from rows: their values never reach those rows
            hidden = None if full else keys_hidden_from_rows(xp, terms, plan, q_range, k_range)

            def matmul(a: Any, b: Any) -> Any:  # one more column than a buffer: a fresh array
                return xp.matmul(a, b) if some_rows else ops.matmul(a, b, first)

            p_rows = heads_to_rows(xp, p_blk, hkv)
            pv = visible_product(
                xp, matmul, p_rows, v_blk, hidden, some_rows=some_rows, choose=ops.if_finite
            )
            return rows_to_heads(xp, pv, hq)

        keep = slice_block(terms.dropout_keep, q_range, k_range)
        return online_step(
            ops,
            state,
            s,
            product,
            stop_gradient=self.stop_gradient,
            shows_rows=full and keys.shows_rows,
            owned=terms.score_mod is None and terms.sinks is None,
            fold=self.fold,
            keep=None if keep is None else at_rank(xp, keep, s.ndim),
        )

    def finish(self, state: RowState, bq: int) -> tuple[Any, Any]:
        """Return output (..., Hq, bq, Dv) and row statistics (..., Hq, bq, 1 or 2).

        The lse, ``-inf`` where nothing was seen (the sink's logit with one), then,
        with the plan's ``row_max``, the running max: the largest visible score, the
        sink left out (:func:`~._scores.row_stats`). The sink joins the denominator
        here (:func:`~._softmax.with_sink`), so the running max is the scores' own.
        """
        xp, terms, plan = self.call.xp, self.call.terms, self.call.plan
        m, l_sum, acc, rows_seen = state
        if m is None:  # every key block hidden for this query block: zero rows
            return empty_result(xp, plan, terms.sinks, rows=bq)
        if self.fold:
            dv = plan.value_dim
            acc, l_sum = acc[..., :dv], acc[..., dv:]
        if terms.dropout_keep is not None:
            acc = acc * terms.dropout_scale
        out, lse = normalised(xp, RowState(m, l_sum, acc, rows_seen), terms.sinks)
        lse = xp.broadcast_to(lse, (*plan.batch, plan.num_q_heads, bq, 1))
        return out, row_stats(xp, plan, lse, m)


def online_step(
    ops: Ops,
    state: RowState,
    s: Any,
    product: Callable[[Any, bool], Any],
    *,
    stop_gradient: Any = None,
    shows_rows: bool = False,
    owned: bool = False,
    fold: bool = False,
    keep: Any | None = None,
) -> RowState:
    """Fold one block of scores into the rows' online softmax: the one update of it.

    Parameters
    ----------
    ops : Ops
        The block operations (:class:`Ops`: fresh arrays, NumPy's workspace buffers,
        or the paged walk's, whose blocks hold several pages).
    state : RowState
        The rows' state before the block; ``m`` None before the first block.
    s : array, shape (..., rows, keys)
        The block's scores, ``-inf`` where hidden.
    product : callable
        ``product(p, first)``: the block's weights `p` times its values, shape
        (..., rows, Dv) (with the row sums as a last column where `fold`); `first`:
        the product becomes the accumulator.
    stop_gradient : callable, optional
        Stops the running max's gradient (it cancels exactly; compiled backwards turned
        it into NaN).
    shows_rows : bool
        The block shows every row a finite score: later blocks skip the empty-row guard.
    owned : bool
        `s` is a fresh array of ours that may be overwritten.
    fold : bool
        The row sums come from `product` (``P @ [V | 1]``).
    keep : array of bool, broadcastable to `s`, optional
        Dropout's kept entries (the row sums are taken before it).
    """
    xp = ops.xp
    m, l_sum, acc, rows_seen = state
    if stop_gradient is not None:  # autodiff differentiates the walk: no writes in place
        owned = False  # (forward mode copies the array first; reverse mode may refuse)
    # (..., rows, 1); its derivative is zero: cut before the max, which autodiff (forward
    # mode too) then does not differentiate
    m_blk = ops.row_max(s if stop_gradient is None else stop_gradient(s))
    m_new = m_blk if m is None else ops.maximum(m, m_blk)
    if rows_seen:  # m_new is finite in every row already
        m_safe = m_new
    else:  # a row hidden in every block so far: exp(-inf - finite) = 0
        m_safe = finite_shift(xp, m_new)
        rows_seen = shows_rows
    p = ops.exp_shifted(s, m_safe, owned)  # (..., rows, keys)
    del s  # keep at most two blocks of scores alive
    alpha = None if m is None else ops.exp(m - m_safe, owned=True)  # rescales old sums
    if fold:
        pv = product(p, alpha is None)  # [P V | rowsum]
        acc = pv if alpha is None else ops.rescaled(acc, alpha, pv)
        return RowState(m_new, None, acc, rows_seen)
    p_sum = ops.row_sum(p)  # before dropout
    if keep is not None:
        p = ops.dropped(p, keep)
    pv = product(p, alpha is None)
    if alpha is None:
        return RowState(m_new, p_sum, pv, rows_seen)
    return RowState(m_new, alpha * l_sum + p_sum, ops.rescaled(acc, alpha, pv), rows_seen)


def normalised(xp: Any, state: RowState, sinks: Any | None) -> tuple[Any, Any]:
    """Return the rows' output ``acc / l`` and lse ``m + log l`` (``-inf`` where nothing was seen).

    A row that saw no key is zero with lse ``-inf`` (no NaN, in values or gradients);
    `sinks` (broadcastable to the lse) join the denominator (:func:`~._softmax.with_sink`).
    """
    m, l_sum, acc, rows_seen = state
    denominator = safe_denominator(xp, l_sum)
    m_safe = m if rows_seen else finite_shift(xp, m)
    lse = m_safe + xp.log(denominator)
    if not rows_seen:
        lse = xp.where(l_sum == 0.0, -xp.inf, lse)
    out = acc / denominator
    if sinks is not None:
        out, lse = with_sink(xp, out, lse, sinks)
    return out, lse


def block_scores(
    ops: Ops, q_rows: Any, keys: Keys, q_range: Range, k_range: Range, full: bool
) -> Any:
    """One block's final scores (..., Hq, bq, bk), hidden entries ``-inf``.

    ``softcap(scale · Q Kᵀ)``, then ``score_mod``, bias and ALiBi, then the masks
    (:func:`visible_entries`): the score pipeline of ``_scores.py``, by `ops`.
    """
    call = keys.call
    xp, plan, terms = call.xp, call.plan, call.terms
    ks, ke = k_range
    shape = (*plan.batch, plan.num_q_heads, q_range[1] - q_range[0], ke - ks)
    s = ops.scores(q_rows, keys.k_t[..., ks:ke], shape)
    if plan.softcap is not None:
        s = ops.cap(s, plan.softcap)
    if terms.score_mod is not None:
        s = ops.modified(s, terms.score_mod, *score_index(xp, terms, plan, q_range, k_range))
    bias = slice_block(call.bias, q_range, k_range)
    if bias is not None:
        s = ops.add(s, at_rank(xp, bias, s.ndim))
    if terms.alibi_slopes is not None:
        s = ops.add(s, -alibi_block(xp, terms, plan, q_range, k_range))
    allowed = visible_entries(xp, terms, plan, q_range, k_range, full)
    return s if allowed is None else ops.hide(s, allowed)


def visible_entries(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range, full: bool
) -> Any:
    """Return the "may attend" array of a visited block, or None (everything visible).

    A `full` pair (:data:`~._blocks.FULL`) needs no structured mask: the band, the
    lengths, the segment ids and the ``mask_mod`` show all of it; the caller's
    `mask` still applies. Every walk asks this, so they mask alike.
    """
    return allowed_block(xp, terms, plan, q_range, k_range, structured=not full)


def _block_scores(
    xp: Any,
    q_rows: Any,
    k_blk: Any,
    bias: Any,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
    full: bool,
    score_vjp: ScoreVjp | None,
    some_rows: bool = False,
) -> tuple[Any, Any, Any, Any, Any, bool]:
    """Return (logits, capped logits, scores with hidden entries -inf, pullback, allowed).

    `pullback` is that of ``score_mod`` on this block (`score_vjp`), or None;
    `allowed` the block's "may attend" array, or None. With `some_rows` (keys hidden
    from some rows and seen by others: their non-finite entries are not zeroed), the
    logits of hidden entries are 0 here, not a NaN from such a key: nothing of them
    reaches the softcap's or the ``score_mod``'s derivative.
    """
    allowed = visible_entries(xp, terms, plan, q_range, k_range, full)
    raw = raw_logits_block(xp, q_rows, k_blk, plan)  # (..., Hq, bq, bk): scale · Q Kᵀ
    if some_rows and allowed is not None:
        raw = xp.where(allowed, raw, 0.0)
    capped = capped_logits(xp, raw, plan)
    pullback = None
    modified = capped
    if score_vjp is not None and terms.score_mod is not None:
        modified, pullback = score_vjp(capped, *score_index(xp, terms, plan, q_range, k_range))
        if modified.dtype != capped.dtype:  # a wider table's scores, as the forward casts them
            pullback = _cast_pullback(xp, pullback, modified.dtype, capped.dtype)
            modified = xp.astype(modified, capped.dtype)
    scores = scores_block(
        xp, modified, bias, terms, plan, q_range, k_range, modified=pullback is not None
    )
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)  # (..., Hq, bq, bk)
    # ours to overwrite: not the score_mod's own result, nor the softcap's operands
    owned = not (
        (pullback is not None and scores is modified)
        or (plan.softcap is not None and (scores is capped or scores is raw))
    )
    return raw, capped, scores, pullback, allowed, owned


def _cast_pullback(xp: Any, pullback: Any, dtype: Any, compute_dtype: Any) -> Any:
    """Wrap a ``score_mod``'s pullback whose result was `dtype` to take and give `compute_dtype`.

    The forward casts a wider ``score_mod`` result to the compute dtype
    (:func:`~._scores.modified_scores`): the cotangent goes back in the result's
    dtype (JAX's ``vjp`` wants that one), the scores' gradient comes out in the compute
    dtype, and the parameters' gradients keep their own dtype.
    """

    def cast(d_modified: Any) -> tuple[Any, Any]:
        d_scores, d_params = pullback(xp.astype(d_modified, dtype))
        return xp.astype(d_scores, compute_dtype), d_params

    return cast


def _keep(xp: Any, p: Any, terms: ScoreTerms, q_range: Range, k_range: Range) -> Any:
    """Dropout on a block of (unnormalised) weights; the 1/(1-p) factor comes later."""
    keep = slice_block(terms.dropout_keep, q_range, k_range)
    return p if keep is None else xp.where(at_rank(xp, keep, p.ndim), p, 0.0)


def _zeros(xp: Any, shape: tuple[int, ...], plan: AttentionPlan) -> Any:
    return xp.zeros(shape, dtype=plan.compute_dtype, **on_device(plan.device))


def tiled_forward(
    call: AttentionCall,
    block_q: Blocks,
    block_k: Blocks,
    *,
    fold: bool = False,
    q_ranges: list[Range] | None = None,
    parts: list[AttentionCall] | None = None,
    v_ones: Any = None,
    stop_gradient: Any | None = None,
    ops: Ops | None = None,
    out: Any = None,
    lse: Any = None,
) -> tuple[Any, Any]:
    """Attention output (..., Hq, Lq, Dv) and row log-sum-exp (..., Hq, Lq, 1): the walk.

    ``lse`` is ``-inf`` for rows with no visible key (and no sink): the one
    convention of every path (:func:`empty_result`).

    For each query block, the online softmax (:class:`OnlineSoftmax`) visits the key
    blocks that :func:`~._blocks.host_pair_states` does not skip, with the masks a
    pair needs. Per visited block: one score matmul, a row max, ``exp(s - m)`` and,
    with `fold`, one matmul with ``[V | 1]``, which gives the weighted sum and the row
    sums together; the running sum then rides along as the accumulator's last
    column, so one rescale covers both.

    Parameters
    ----------
    call : AttentionCall
        In the compute dtype, with a value.
    block_q, block_k : int or tuple of int
        The tiles (an int, or the sizes of consecutive blocks).
    fold : bool, default False
        Take the row sums from ``P @ [V | 1]`` (decided by the router).
    q_ranges : list of (int, int), optional
        Compute only these query ranges (by default the blocks of `block_q`): a
        caller can split the query blocks between threads.
    parts : list of AttentionCall, optional
        Walk the keys of each of these calls in turn instead of `call`'s: the same
        queries over consecutive key parts placed at their positions (a Dask task
        over several key chunks), one online softmax, nothing to merge. A
        ``once_per_row`` field (the sink) is counted from `call`.
    v_ones : array, optional
        ``[V | 1]`` of `call` (:func:`with_ones_column`), shared by the threads of a call.
    stop_gradient : callable, optional
        The library's stop-gradient for the running max (plain autodiff of the walk).
    ops : Ops, optional
        A workspace's operations (NumPy's buffers); by default fresh arrays.
    out, lse : arrays (..., Hq, Lq, Dv) and (..., Hq, Lq, 1), optional
        Where the rows of `q_ranges` are written (the threads of one call share them).
    """
    xp, q, plan = call.xp, call.query, call.plan
    ops = Ops(xp) if ops is None else ops
    walk = OnlineSoftmax(call, ops, fold, stop_gradient)
    if q_ranges is None:
        q_ranges = block_ranges(plan.q_len, block_q)
    try:
        sources = []
        for part in [call] if parts is None else parts:
            k_ranges = block_ranges(part.plan.kv_len, block_k)
            states = host_pair_states(part, q_ranges, k_ranges)
            values = part.value
            if fold:
                values = v_ones if v_ones is not None and part is call else ops.with_ones(part)
            sources.append((Keys.of(part, values), k_ranges, states))
        outs, lses = [], []
        for i, q_range in enumerate(q_ranges):
            qs, qe = q_range
            q_rows = ops.query_rows(q[..., qs:qe, :], plan)
            state = walk.start(qe - qs)
            for keys, k_ranges, states in sources:
                for k_range, pair in zip(k_ranges, states[i], strict=True):
                    if pair:
                        state = walk.step(state, q_rows, keys, q_range, k_range, pair == FULL)
            out_blk, lse_blk = walk.finish(state, qe - qs)
            if out is not None:
                ops.write(out[..., qs:qe, :], out_blk)
                ops.write(lse[..., qs:qe, :], lse_blk)
            else:
                outs.append(out_blk)
                lses.append(lse_blk)
    finally:
        ops.release()
    if out is not None:
        return out, lse
    return _combine(xp, outs, -2, True), _combine(xp, lses, -2, True)


def _combine(xp: Any, parts: list[Any], axis: int, concatenate: bool) -> Any:
    if len(parts) == 1:
        return parts[0]
    if concatenate:
        return xp.concat(parts, axis=axis)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def tiled_backward(
    call: AttentionCall,
    out: Any,
    lse: Any,
    dout: Any,
    block_q: Blocks,
    block_k: Blocks,
    *,
    need: Collection[str] = (),
    dlse: Any | None = None,
    states: Any = None,
    score_vjp: ScoreVjp | None = None,
    ops: Ops | None = None,
) -> dict[str, Any]:
    """Gradients of the tiled attention by field name, each shaped like its input.

    Parameters are the call of the forward (compute dtype, explicit head axis), its
    output and ``lse``, and the output cotangent `dout` (..., Hq, Lq, Dv). The
    gradients of ``query``, ``key`` and ``value`` are always computed; `need` names
    the other differentiable fields (:data:`~._fields.FIELDS`) whose gradients are
    wanted: ``bias``, ``alibi_slopes``, ``sinks`` and a learned (0-d array)
    ``scale`` or ``softcap``. `dlse` (..., Hq, Lq, 1) is the cotangent of the row
    log-sum-exp, when it is an output: ``d lse_i / d s_ij = p_ij``, so it enters as
    ``D_i - dlse_i`` below. `states` are the pair states (``states[i][j]``) when the
    caller knows them (a block of the traced loop); by default :func:`host_pair_states`.

    `score_vjp` differentiates ``score_mod`` block by block (:data:`ScoreVjp`, given
    by the library's autodiff adapter): the scores' gradient passes through it, and
    the gradients of the arrays it closes over (its parameters) are summed over the
    visited blocks in a fixed order, returned as ``"score_params"`` (a tuple).
    A call with a ``score_mod`` needs it. `ops`: the forward's operations (their
    ``exp``), by default the portable ones.
    """
    xp, q, k, v = call.xp, call.query, call.key, call.value
    ops = Ops(xp) if ops is None else ops
    bias: Any = call.bias
    terms, plan = call.terms, call.plan
    if terms.score_mod is not None and score_vjp is None:
        msg = "the backward of a call with a score_mod needs its VJP (`score_vjp`)"
        raise TypeError(msg)
    need_bias_grad = "bias" in need
    need_slope_grad = "alibi_slopes" in need
    need_sink_grad = "sinks" in need
    need_scale_grad = "scale" in need
    need_softcap_grad = "softcap" in need
    hkv, hq = plan.num_kv_heads, plan.num_q_heads
    k_blocks = block_ranges(plan.kv_len, block_k)
    # an empty row's lse is -inf; as +inf, its recomputed exp(s - lse) = exp(-inf) is 0
    lse = xp.where(lse == -xp.inf, xp.inf, lse)
    # D_i = rowsum(dO * O): the softmax Jacobian's correction term, (..., Hq, Lq, 1)
    delta = xp.sum(dout * out, axis=-1, keepdims=True)
    if dlse is not None:
        delta = delta - dlse
    dsinks = None
    if need_sink_grad:  # p_sink = exp(sink - lse), d sink = -Σ_rows p_sink · D
        sinks = at_rank(xp, terms.sinks, lse.ndim)
        p_sink = xp.exp(sinks - lse)  # (..., Hq, Lq, 1); 0 where lse = +inf
        dsinks = sum_to_shape(xp, -p_sink * delta, tuple(terms.sinks.shape))
    # running sums per key block: memory O(Lk), however many query blocks there are
    dk_sums: list[Any] = [None] * len(k_blocks)
    dv_sums: list[Any] = [None] * len(k_blocks)
    dq_parts, dbias_rows = [], []
    dslopes = dsoftcap = None
    dparams: list[Any] | None = None
    q_blocks = block_ranges(plan.q_len, block_q)
    if states is None:
        states = host_pair_states(call, q_blocks, k_blocks)

    arrays, skeleton = call.flatten()
    others = tuple(n for n in arrays if n not in ("query", "key", "value"))
    # each array split once into its blocks: a library that records the backward sums a
    # block's gradients from its pairs before the split's own backward (one concatenation)
    q_cuts, k_cuts = _cuts(q_blocks), _cuts(k_blocks)
    rows = list(zip(*(split_rows(x, q_cuts, -2) for x in (q, dout, lse, delta)), strict=True))
    columns = list(zip(split_rows(k, k_cuts, -2), split_rows(v, k_cuts, -2), strict=True))

    def pair(i: int, j: int, *reads: Any) -> tuple[Any, ...]:
        """Return the gradient parts of query block i and key block j.

        `reads`: the arrays the pair reads: its blocks of Q, K, V, the output's
        cotangent, the lse and ``delta``, then the call's other arrays (by `others`).
        The parts: dq (as rows), dk, dv, the scores' gradient for the bias, and the
        slopes', softcap's and ``score_mod`` parameters' (None where not wanted).
        """
        q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, *given = reads
        part = call  # the call's own arrays, or others in their place (a recomputation's)
        if any(x is not y for x, y in zip(given, rest, strict=True)):
            part = skeleton.unflatten(dict(zip(others, given, strict=True)))
        bias, terms, plan = part.bias, part.terms, part.plan
        q_range, k_range = q_blocks[i], k_blocks[j]
        q_rows = scaled_query_rows(xp, q_blk, plan)  # (..., Hkv, G*bq, Dk)
        do_rows = heads_to_rows(xp, do_blk, hkv)  # (..., Hkv, G*bq, Dv)
        dslopes = dsoftcap = d_params = None
        full = states[i][j] == FULL
        some_rows = not full and terms.q_segments is not None  # keys hidden from some rows
        if not full:  # keys no row of the block sees: zero, whatever they hold
            hidden = keys_hidden_from_rows(xp, terms, plan, q_range, k_range)
            k_blk = hidden_rows_zeroed(xp, k_blk, hidden)
            v_blk = hidden_rows_zeroed(xp, v_blk, hidden)
        raw, capped, s, pullback, allowed, owned = _block_scores(
            xp,
            q_rows,
            k_blk,
            bias,
            terms,
            plan,
            q_range,
            k_range,
            full,
            score_vjp,
            some_rows,
        )
        # in place but with sinks: lse varies along them and s does not (torch.func.vmap
        # over the sinks refuses to write such an lse into an unbatched s)
        owned = owned and terms.sinks is None
        p = ops.exp_shifted(s, lse_blk, owned)  # (..., Hq, bq, bk): exact probabilities
        p_kept = _keep(xp, p, terms, q_range, k_range)  # dropout, before 1/(1-p)
        p_rows = heads_to_rows(xp, p_kept, hkv)  # (..., Hkv, G*bq, bk)
        dv_blk = xp.matmul(xp.matrix_transpose(p_rows), do_rows)  # (..., Hkv, bk, Dv)
        if terms.dropout_keep is not None:
            dv_blk = dv_blk * terms.dropout_scale
        dp = rows_to_heads(xp, xp.matmul(do_rows, xp.matrix_transpose(v_blk)), hq)
        if terms.dropout_keep is not None:
            dp = _keep(xp, dp, terms, q_range, k_range) * terms.dropout_scale
        ds = dp - delta_blk  # d loss / d (logits + bias), (..., Hq, bq, bk)
        ds *= p  # ours: one block fewer (a new array where xp's are immutable)
        if some_rows and allowed is not None:  # a hidden entry's dp: another's value
            ds = xp.where(allowed, ds, 0.0)
        ds_bias = ds if need_bias_grad else None
        if need_slope_grad:  # scores -= slope * |i' - j|
            slopes = terms.alibi_slopes
            distance = alibi_distance(xp, terms, plan, q_range, k_range)
            dslopes = sum_to_shape(xp, -ds * at_rank(xp, distance, ds.ndim), tuple(slopes.shape))
        if pullback is not None:  # through score_mod: to its input and its parameters
            ds, d_params = pullback(sum_to_shape(xp, ds, tuple(capped.shape)))
        if plan.softcap is not None:  # through c·tanh(x/c): d/dx = 1 - t², t = tanh(x/c)
            t = capped / plan.softcap
            if need_softcap_grad:  # d/dc = t - (x/c)(1 - t²)
                dsoftcap = xp.sum(ds * (t - (raw / plan.softcap) * (1.0 - t * t)))
            ds = ds * (1.0 - t * t)
        ds_rows = heads_to_rows(xp, ds, hkv)  # (..., Hkv, G*bq, bk)
        # (..., Hkv, G*bq, Dk): the keys some rows do not see never reach those rows
        dq_blk = visible_product(
            xp, xp.matmul, ds_rows, k_blk, None, some_rows=some_rows, signed=True
        )
        dk_blk = xp.matmul(xp.matrix_transpose(ds_rows), q_rows)  # (..., Hkv, bk, Dk)
        return dq_blk, dk_blk, dv_blk, ds_bias, dslopes, dsoftcap, d_params

    rest = tuple(arrays[n] for n in others)
    for i, q_range in enumerate(q_blocks):
        dq_rows = None
        dbias_cols: list[Any] = []
        for j in range(len(k_blocks)):
            if not states[i][j]:
                if need_bias_grad:
                    dbias_cols.append(None)
                continue
            # a library that records this backward (it is differentiated again) may keep
            # only what the pair reads, and compute the pair again for its own backward
            q_blk, do_blk, lse_blk, delta_blk = rows[i]
            reads = (q_blk, *columns[j], do_blk, lse_blk, delta_blk, *rest)
            dq_blk, dk_blk, dv_blk, ds, d_slopes, d_softcap, d_params = ops.recomputed(
                pair, (i, j), reads
            )
            dq_rows = dq_blk if dq_rows is None else dq_rows + dq_blk
            dk_sums[j] = dk_blk if dk_sums[j] is None else dk_sums[j] + dk_blk
            dv_sums[j] = dv_blk if dv_sums[j] is None else dv_sums[j] + dv_blk
            if need_bias_grad:
                dbias_cols.append(ds)
            dslopes = _plus(dslopes, d_slopes)
            dsoftcap = _plus(dsoftcap, d_softcap)
            if d_params is not None:
                dparams = list(d_params) if dparams is None else _sums(dparams, d_params)
        qs, qe = q_range
        if dq_rows is None:  # no key visible from this query block
            dq_parts.append(_zeros(xp, (*plan.batch, hq, qe - qs, q.shape[-1]), plan))
        else:
            dq_parts.append(rows_to_heads(xp, dq_rows, hq) * plan.scale)
        if need_bias_grad:
            dbias_rows.append(_bias_row(xp, dbias_cols, bias, q_range, k_blocks, plan))
    dq = sum_to_shape(xp, _combine(xp, dq_parts, -2, True), tuple(q.shape))
    dk = _kv_grad(xp, dk_sums, k, k_blocks, plan)
    dv = _kv_grad(xp, dv_sums, v, k_blocks, plan)
    dbias = None
    if need_bias_grad:
        dbias = _combine(xp, dbias_rows, -2, bias.shape[-2] != 1)
        dbias = sum_to_shape(xp, dbias, tuple(bias.shape))
    if need_slope_grad and dslopes is None:
        dslopes = xp.zeros_like(terms.alibi_slopes)
    dscale = None
    if need_scale_grad:  # logits = scale · (q·k), and dq = scale · Σ_j dlogits_ij k_j
        dscale = xp.sum(dq * q) / plan.scale
    if need_softcap_grad and dsoftcap is None:  # no block visible
        dsoftcap = xp.zeros_like(plan.softcap)
    grads = {"query": dq, "key": dk, "value": dv, "bias": dbias, "alibi_slopes": dslopes}
    grads |= {"scale": dscale, "softcap": dsoftcap, "sinks": dsinks}
    if dparams is not None:
        grads["score_params"] = tuple(dparams)
    return {name: g for name, g in grads.items() if g is not None}


def _sums(totals: list[Any], parts: Any) -> list[Any]:
    return [t + p for t, p in zip(totals, parts, strict=True)]


def _plus(total: Any | None, part: Any | None) -> Any | None:
    """``total + part``, where None is nothing yet."""
    if part is None:
        return total
    return part if total is None else total + part


def _kv_grad(xp: Any, sums: list[Any], x: Any, k_blocks: list[Range], plan: AttentionPlan) -> Any:
    """Concatenate the per-key-block gradient sums into the gradient of `x`."""
    blocks = []
    for (ks, ke), total in zip(k_blocks, sums, strict=True):
        shape = (*x.shape[:-2], ke - ks, x.shape[-1])
        if total is None:  # no query block sees these keys
            blocks.append(_zeros(xp, shape, plan))
        else:
            blocks.append(sum_to_shape(xp, total, shape))
    return _combine(xp, blocks, -2, True)


def _bias_row(
    xp: Any,
    cols: list[Any | None],
    bias: Any,
    q_range: Range,
    k_blocks: list[Range],
    plan: AttentionPlan,
) -> Any:
    """Assemble the bias gradient of one query block, reduced to the bias's block shape."""
    bq = q_range[1] - q_range[0]
    parts = []
    for ds, k_range in zip(cols, k_blocks, strict=True):
        blk_shape = tuple(slice_block(bias, q_range, k_range).shape)
        if ds is None:
            bk = k_range[1] - k_range[0]
            full = (*plan.batch, plan.num_q_heads, bq, bk)
            ds = _zeros(xp, full, plan)
        parts.append(sum_to_shape(xp, ds, blk_shape))
    return _combine(xp, parts, -1, bias.shape[-1] != 1)


def _cuts(blocks: list[tuple[int, int]]) -> list[int]:
    """Return the boundaries of `blocks`, consecutive from 0: ``[0, end_0, end_1, ...]``."""
    return [0, *(end for _, end in blocks)]

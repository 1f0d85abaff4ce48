"""Tiled attention with the online softmax: exact, O(L) memory, causal block skipping.

Forward (FlashAttention-2 / Rabe-Staats): for each query block, walk the key
blocks keeping a running row max ``m``, a running denominator ``l`` and a running
weighted sum ``acc``; when the max grows, rescale ``l`` and ``acc`` by
``exp(m_old - m_new)``; divide once at the end. No array larger than one
``(..., Hq, bq, bk)`` block of scores is ever built.

Backward (FlashAttention-2): recompute each block's probabilities from the saved
log-sum-exp ``lse = m + log(l)`` and accumulate ``dQ``, ``dK``, ``dV`` (and the
bias gradient) block by block, so training keeps O(L) memory too.

Which (query block, key block) pairs are computed is decided from the static
shapes only (causal / window structure), never from array values, so the loops
trace under ``jax.jit``. Everything here is array-API standard; the adapters that
register the backward with torch and JAX live in ``portable_attn._paths._autodiff``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, NamedTuple

from ._call import AttentionCall
from ._compat import on_device
from ._path import Blocks
from ._scores import (
    AttentionPlan,
    ScoreTerms,
    alibi_distance,
    allowed_block,
    block_visibility,
    capped_logits,
    empty_result,
    heads_to_rows,
    hidden_by_value,
    raw_logits_block,
    rows_to_heads,
    scaled_query_rows,
    scores_block,
    slice_block,
    with_ones_column,
)
from ._softmax import finite_shift, safe_denominator

__all__ = [
    "Blocks",
    "RowState",
    "RowWalk",
    "block_ranges",
    "block_visibility",
    "pair_visibility",
    "sum_to_shape",
    "tiled_backward",
    "tiled_forward",
    "visible_entries",
]

Range = tuple[int, int]


def block_ranges(length: int, size: Blocks) -> list[Range]:
    """Half-open ranges covering ``[0, length)``.

    An int gives blocks of `size` (the last one may be shorter); a tuple gives
    consecutive blocks of those sizes, which must add up to `length`.
    """
    if isinstance(size, int):
        return [(start, min(start + size, length)) for start in range(0, length, size)]
    ends = [sum(size[: i + 1]) for i in range(len(size))]
    if not ends or ends[-1] != length:
        msg = f"block sizes {size} do not add up to the length {length}"
        raise ValueError(msg)
    return [(end - n, end) for n, end in zip(size, ends, strict=True) if n > 0]


def sum_to_shape(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """Sum `x` over the axes that broadcasting added to reach it from `shape`."""
    lead = x.ndim - len(shape)
    if lead > 0:
        x = xp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if axes:
        x = xp.sum(x, axis=axes, keepdims=True)
    return x


def _block_scores(
    xp: Any,
    q_rows: Any,
    k_blk: Any,
    bias: Any,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
    visibility: str,
) -> tuple[Any, Any, Any]:
    """Return (logits, capped logits, scores with disallowed entries -inf) for one block."""
    raw = raw_logits_block(xp, q_rows, k_blk, plan)  # (..., Hq, bq, bk): scale · Q Kᵀ
    capped = capped_logits(xp, raw, plan)
    scores = scores_block(xp, capped, bias, terms, plan, q_range, k_range)
    allowed = visible_entries(xp, terms, plan, q_range, k_range, visibility)
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)  # (..., Hq, bq, bk)
    return raw, capped, scores


def visible_entries(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range, vis: str
) -> Any:
    """Return the "may attend" array of a block a walk visits (`vis` "full", "partial"), or None.

    What :func:`pair_visibility` already shows needs no mask: a "full" block has no
    band or ``mask_mod`` part, and a pair inside one document (host segment ids) no id
    part. Every loop over blocks asks this, so they mask alike.
    """
    blocks = terms.segment_blocks  # host ids: a pair inside one document needs no id mask
    segments = blocks is None or not blocks.one_segment(q_range, k_range)
    full = vis == "full"  # the band and the block mask show every entry
    return allowed_block(
        xp,
        terms,
        plan,
        q_range,
        k_range,
        structural=not full,
        segments=segments,
        mask_mod=not full,
    )


def _keep(xp: Any, p: Any, terms: ScoreTerms, q_range: Range, k_range: Range) -> Any:
    """Dropout on a block of (unnormalised) weights; the 1/(1-p) factor comes later."""
    keep = slice_block(terms.dropout_keep, q_range, k_range)
    return p if keep is None else xp.where(keep, p, 0.0)


def _zeros(xp: Any, shape: tuple[int, ...], plan: AttentionPlan) -> Any:
    return xp.zeros(shape, dtype=plan.compute_dtype, **on_device(plan.device))


def pair_visibility(plan: AttentionPlan, terms: ScoreTerms, q_range: Range, k_range: Range) -> str:
    """Return what is visible of a block pair: the one answer every eager path asks.

    ``"skip"`` when the band (:func:`block_visibility`), host segment ids or the
    block mask's states hide every entry; ``"full"`` when the band shows every entry
    and a ``mask_mod`` (if any) is shown in full by its states (no mask work);
    ``"partial"`` otherwise.
    """
    vis = block_visibility(plan, q_range, k_range)
    blocks = terms.segment_blocks
    if vis != "skip" and blocks is not None and blocks.disjoint(q_range, k_range):
        return "skip"
    if vis == "skip" or terms.mask_mod is None:
        return vis
    host = terms.block_host
    states = "partial" if host is None else host.visibility(q_range, k_range)
    if states == "skip":
        return "skip"
    return "full" if vis == "full" and states == "full" else "partial"


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
class RowWalk:
    """The online softmax of one call: start a query block's rows, visit a key block, finish.

    One implementation for every loop over key blocks: the Python loop of
    :func:`tiled_forward` and the traced loop of ``_paths._loop`` (which carries
    ``(m, l_sum, acc)`` from :meth:`carry_start`).
    """

    call: AttentionCall
    fold: bool
    v_ones: Any
    stop_gradient: Any
    owned: bool
    hide_rows: bool

    @classmethod
    def of(
        cls,
        call: AttentionCall,
        *,
        fold: bool = False,
        v_ones: Any = None,
        stop_gradient: Any = None,
    ) -> RowWalk:
        if fold and v_ones is None:  # the row sums ride along as a last column of P V
            v_ones = with_ones_column(call.xp, call.value, call.plan)
        # Without a score_mod the block scores are always a fresh array of ours (a
        # matmul, softcap, bias, ALiBi or where result) that autodiff has not saved:
        # subtracting the max in place is safe. (JAX arrays rebind on ``-=``; the
        # torch backward is the custom one, which runs this forward without grad.)
        # With sinks the running max starts at the sinks, which a ``torch.func.vmap``
        # over them batches while the scores are not: no in-place update then.
        terms = call.terms
        owned = terms.score_mod is None and terms.sinks is None
        hide = hidden_by_value(call.bias, terms)
        return cls(call, fold, v_ones, stop_gradient, owned, hide)

    def start(self, bq: int) -> RowState:
        """Return the state before the first key block: at the sink if any, else empty."""
        xp, terms, plan = self.call.xp, self.call.terms, self.call.plan
        if terms.sinks is None:
            return RowState(None, None, None)
        # The sink is a key with logit ``sink_h`` and a zero value: the running max
        # starts at it and the denominator at ``exp(sink_h - max) = 1`` (0 for -inf).
        shape = (*plan.batch, plan.num_q_heads, bq, 1)
        m = xp.broadcast_to(terms.sinks, shape)
        if self.stop_gradient is not None:
            m = self.stop_gradient(m)
        l_sum = xp.exp(terms.sinks - finite_shift(xp, m))  # (..., Hq, bq, 1)
        acc = _zeros(xp, (*plan.batch, plan.num_q_heads, bq, plan.value_dim), plan)
        if self.fold:  # the denominator rides along as the accumulator's last column
            return RowState(m, None, xp.concat([acc, l_sum], axis=-1))
        return RowState(m, l_sum, acc)

    def carry_start(self, bq: int) -> tuple[Any, Any, Any]:
        """Return ``(m, l_sum, acc)`` of rows that saw nothing yet: -inf, 0, 0 (a loop carry)."""
        xp, plan = self.call.xp, self.call.plan
        rows = (*plan.batch, plan.num_q_heads, bq)
        m = xp.full((*rows, 1), -xp.inf, dtype=plan.compute_dtype, **on_device(plan.device))
        width = plan.value_dim + (1 if self.fold else 0)
        acc = _zeros(xp, (*rows, width), plan)
        return m, (None if self.fold else _zeros(xp, (*rows, 1), plan)), acc

    def step(
        self, state: RowState, q_rows: Any, q_range: Range, k_range: Range, vis: str
    ) -> RowState:
        """Visit key block `k_range` (not skipped: `vis` "full" or "partial")."""
        call = self.call
        xp, terms, plan = call.xp, call.terms, call.plan
        hkv, hq = plan.num_kv_heads, plan.num_q_heads
        m, l_sum, acc, rows_seen = state
        ks, ke = k_range
        _, _, s = _block_scores(
            xp, q_rows, call.key[..., ks:ke, :], call.bias, terms, plan, q_range, k_range, vis
        )
        m_blk = xp.max(s, axis=-1, keepdims=True)  # (..., Hq, bq, 1)
        m_new = m_blk if m is None else xp.maximum(m, m_blk)
        if self.stop_gradient is not None:
            m_new = self.stop_gradient(m_new)
        if rows_seen:  # m_new is finite in every row already
            m_safe = m_new
        else:  # a row hidden in every block so far: exp(-inf - finite) = 0
            m_safe = finite_shift(xp, m_new)
            rows_seen = not self.hide_rows and vis == "full"
        if self.owned:
            s -= m_safe  # saves allocating (and faulting in) a third (bq, bk) block
            p = xp.exp(s)  # (..., Hq, bq, bk)
        else:
            p = xp.exp(s - m_safe)  # (..., Hq, bq, bk)
        del s  # keep at most two (bq, bk) blocks alive
        if self.fold:
            pv = heads_to_rows(xp, p, hkv) @ self.v_ones[..., ks:ke, :]  # (..., Hkv, G*bq, Dv+1)
            pv = rows_to_heads(xp, pv, hq)  # (..., Hq, bq, Dv+1): [P V | rowsum P]
            acc = pv if m is None else xp.exp(m - m_safe) * acc + pv
            return RowState(m_new, None, acc, rows_seen)
        kept = heads_to_rows(xp, _keep(xp, p, terms, q_range, k_range), hkv)
        pv = rows_to_heads(xp, kept @ call.value[..., ks:ke, :], hq)  # (..., Hq, bq, Dv)
        p_sum = xp.sum(p, axis=-1, keepdims=True)  # (..., Hq, bq, 1)
        if m is None:
            return RowState(m_new, p_sum, pv, rows_seen)
        alpha = xp.exp(m - m_safe)  # rescale what was summed under the old max
        return RowState(m_new, alpha * l_sum + p_sum, alpha * acc + pv, rows_seen)

    def finish(self, state: RowState, bq: int) -> tuple[Any, Any]:
        """Return output (..., Hq, bq, Dv) and lse (..., Hq, bq, 1); lse ``-inf``: nothing seen."""
        xp, terms, plan = self.call.xp, self.call.terms, self.call.plan
        m, l_sum, acc, rows_seen = state
        if m is None:  # every key block hidden for this query block (no sink): zero rows
            return empty_result(xp, plan, None, rows=bq)
        if self.fold:
            dv = plan.value_dim
            acc, l_sum = acc[..., :dv], acc[..., dv:]
        if terms.dropout_keep is not None:
            acc = acc * terms.dropout_scale
        denominator = safe_denominator(xp, l_sum)
        m_safe = m if rows_seen else finite_shift(xp, m)
        lse = m_safe + xp.log(denominator)
        if not rows_seen:
            lse = xp.where(l_sum == 0.0, -xp.inf, lse)
        return acc / denominator, xp.broadcast_to(lse, (*plan.batch, plan.num_q_heads, bq, 1))


def tiled_forward(
    call: AttentionCall,
    block_q: Blocks,
    block_k: Blocks,
    *,
    fold: bool = False,
    q_ranges: list[Range] | None = None,
    v_ones: Any = None,
    stop_gradient: Any | None = None,
) -> tuple[Any, Any]:
    """Attention output (..., Hq, Lq, Dv) and row log-sum-exp (..., Hq, Lq, 1).

    ``lse`` is ``-inf`` for rows with no visible key (and no sink): the one
    convention of every path (:func:`empty_result`).

    Per visible block (:meth:`RowWalk.step`): one score matmul, a row max,
    ``exp(s - m)`` (the max subtracted in place) and, with `fold` (decided by the
    path policy), one matmul with ``[V | 1]``, which gives the weighted sum and the
    row sums of the weights together (no separate pass for the sum); the running sum
    then rides along as the last column of the accumulator, so one rescale
    ``alpha * acc`` covers both. The ``where`` that keeps an all-hidden row's max at
    0 is left out once a block has shown every row a finite score.

    `q_ranges` (keyword-only) computes only those query ranges (by default the
    blocks of `block_q`), concatenated along the query axis: a caller can split
    the query blocks between workers. `v_ones` is a precomputed
    :func:`with_ones_column` of `v` (shared by such calls). `stop_gradient`
    (the library's, given when plain autodiff differentiates this loop) is
    applied to the running max: the shift cancels exactly, so its gradient is
    zero, and leaving it out of the graph avoids a NaN that XLA's optimised
    program produced for it (GQA, 2x2 tiles, a position-dependent score_mod).
    """
    xp, q, plan = call.xp, call.query, call.plan
    walk = RowWalk.of(call, fold=fold, v_ones=v_ones, stop_gradient=stop_gradient)
    k_blocks = block_ranges(plan.kv_len, block_k)
    if q_ranges is None:
        q_ranges = block_ranges(plan.q_len, block_q)
    outs, lses = [], []
    for q_range in q_ranges:
        q_rows = scaled_query_rows(xp, q[..., q_range[0] : q_range[1], :], plan)
        bq = q_range[1] - q_range[0]
        state = walk.start(bq)
        for k_range in k_blocks:
            vis = pair_visibility(plan, call.terms, q_range, k_range)
            if vis != "skip":
                state = walk.step(state, q_rows, q_range, k_range, vis)
        out_blk, lse_blk = walk.finish(state, bq)
        outs.append(out_blk)
        lses.append(lse_blk)
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-2)
    return out, lse


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
) -> dict[str, Any]:
    """Gradients of the tiled attention by field name, each shaped like its input.

    Parameters are the call of the forward (compute dtype, explicit head axis), its
    output and ``lse``, and the output cotangent `dout` (..., Hq, Lq, Dv). The
    gradients of ``query``, ``key`` and ``value`` are always computed; `need` names
    the other differentiable fields (:data:`~._fields.FIELDS`) whose gradients are
    wanted: ``bias``, ``alibi_slopes``, ``sinks`` and a learned (0-d array)
    ``scale`` or ``softcap``. `dlse` (..., Hq, Lq, 1) is the cotangent of the row
    log-sum-exp, when it is an output: ``d lse_i / d s_ij = p_ij``, so it enters as
    ``D_i - dlse_i`` below.
    """
    xp, q, k, v = call.xp, call.query, call.key, call.value
    bias: Any = call.bias
    terms, plan = call.terms, call.plan
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
        p_sink = xp.exp(terms.sinks - lse)  # (..., Hq, Lq, 1); 0 where lse = +inf
        dsinks = sum_to_shape(xp, -p_sink * delta, tuple(terms.sinks.shape))
    # running sums per key block: memory O(Lk), however many query blocks there are
    dk_sums: list[Any] = [None] * len(k_blocks)
    dv_sums: list[Any] = [None] * len(k_blocks)
    dq_parts, dbias_rows = [], []
    dslopes = dsoftcap = None
    for q_range in block_ranges(plan.q_len, block_q):
        qs, qe = q_range
        q_blk = q[..., qs:qe, :]
        q_rows = scaled_query_rows(xp, q_blk, plan)  # (..., Hkv, G*bq, Dk)
        do_rows = heads_to_rows(xp, dout[..., qs:qe, :], hkv)  # (..., Hkv, G*bq, Dv)
        lse_blk, delta_blk = lse[..., qs:qe, :], delta[..., qs:qe, :]
        dq_rows = None
        dbias_cols: list[Any] = []
        for j, k_range in enumerate(k_blocks):
            vis = pair_visibility(plan, terms, q_range, k_range)
            ks, ke = k_range
            if vis == "skip":
                if need_bias_grad:
                    dbias_cols.append(None)
                continue
            k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
            raw, capped, s = _block_scores(
                xp, q_rows, k_blk, bias, terms, plan, q_range, k_range, vis
            )
            p = xp.exp(s - lse_blk)  # (..., Hq, bq, bk): exact probabilities
            p_kept = _keep(xp, p, terms, q_range, k_range)  # dropout, before 1/(1-p)
            p_rows = heads_to_rows(xp, p_kept, hkv)  # (..., Hkv, G*bq, bk)
            dv_blk = xp.matmul(xp.matrix_transpose(p_rows), do_rows)  # (..., Hkv, bk, Dv)
            if terms.dropout_keep is not None:
                dv_blk = dv_blk * terms.dropout_scale
            dv_sums[j] = dv_blk if dv_sums[j] is None else dv_sums[j] + dv_blk
            dp = rows_to_heads(xp, xp.matmul(do_rows, xp.matrix_transpose(v_blk)), hq)
            if terms.dropout_keep is not None:
                dp = _keep(xp, dp, terms, q_range, k_range) * terms.dropout_scale
            ds = p * (dp - delta_blk)  # d loss / d (logits + bias), (..., Hq, bq, bk)
            if need_bias_grad:
                dbias_cols.append(ds)
            if need_slope_grad:  # scores -= slope * |i' - j|
                slopes = terms.alibi_slopes
                d = sum_to_shape(
                    xp,
                    -ds * alibi_distance(xp, terms, plan, q_range, k_range),
                    tuple(slopes.shape),
                )
                dslopes = d if dslopes is None else dslopes + d
            if plan.softcap is not None:  # through c·tanh(x/c): d/dx = 1 - t², t = tanh(x/c)
                t = capped / plan.softcap
                if need_softcap_grad:  # d/dc = t - (x/c)(1 - t²)
                    d = xp.sum(ds * (t - (raw / plan.softcap) * (1.0 - t * t)))
                    dsoftcap = d if dsoftcap is None else dsoftcap + d
                ds = ds * (1.0 - t * t)
            ds_rows = heads_to_rows(xp, ds, hkv)  # (..., Hkv, G*bq, bk)
            dq_blk = xp.matmul(ds_rows, k_blk)  # (..., Hkv, G*bq, Dk)
            dq_rows = dq_blk if dq_rows is None else dq_rows + dq_blk
            dk_blk = xp.matmul(xp.matrix_transpose(ds_rows), q_rows)  # (..., Hkv, bk, Dk)
            dk_sums[j] = dk_blk if dk_sums[j] is None else dk_sums[j] + dk_blk
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
    return {name: g for name, g in grads.items() if g is not None}


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

"""The score pipeline shared by the dense and the tiled paths.

For a block of queries ``[qs, qe)`` and keys ``[ks, ke)`` (the whole range in the
dense path) it computes ``softcap(scale · Q Kᵀ) + bias`` and the "allowed" array
(user mask AND causal AND window). Grouped-query attention is computed without
repeating K/V: the query heads of one group are stacked along the row axis,
``(..., Hkv, G·L, Dk)``, which is a reshape of ``(..., Hq, L, Dk)`` because query
head ``h`` belongs to group ``h // G``. Legend: Hq query heads, Hkv key/value
heads, ``G = Hq // Hkv``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._block_states import evaluate_mask_mod
from ._compat import on_device
from ._masks import Alignment, Band, arange, padding_allowed, segment_allowed

__all__ = [
    "PLAIN_TERMS",
    "AttentionPlan",
    "ScoreTerms",
    "alibi_distance",
    "allowed_block",
    "capped_logits",
    "empty_result",
    "heads_to_rows",
    "hidden_by_value",
    "logits_block",
    "query_offset",
    "raw_logits_block",
    "rows_may_be_empty",
    "row_stats",
    "rows_to_heads",
    "scaled_query_rows",
    "score_index",
    "scores_block",
    "without_hidden_keys",
    "slice_block",
    "with_ones_column",
]

Range = tuple[int, int]
_WHOLE_CALL = Alignment()


@dataclass(frozen=True)
class AttentionPlan:
    """Static facts of one call, decided once from shapes, dtypes and arguments."""

    batch: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    value_dim: int
    #: a float, or a 0-d array in the compute dtype (a learned temperature / cap,
    #: which receives gradients); plans holding an array are not cached
    scale: float | Any
    softcap: float | Any | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    compute_dtype: Any
    result_dtype: Any
    device: Any
    has_lengths: bool = False
    key_dim: int = 0
    #: where these queries and keys sit in the whole sequences (a part of a call);
    #: None: a whole call (a None default, which torch.compile can trace)
    align: Alignment | None = None
    #: the call returns each row's largest score too (``return_max_logit``): every
    #: path's row statistics are then ``[lse | max]``, (..., Hq, Lq, 2), not (..., 1)
    row_max: bool = False

    @property
    def stats_width(self) -> int:
        """Columns of the row statistics: the lse, and the row max with :attr:`row_max`."""
        return 2 if self.row_max else 1

    @property
    def groups(self) -> int:
        """Query heads per key/value head, ``G = Hq // Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        """``i' - i`` from shapes alone (``Lk - Lq`` for a whole call): see :class:`Alignment`."""
        if self.align is None:
            return self.kv_len - self.q_len
        return self.align.static_offset(self.q_len, self.kv_len)

    @property
    def band(self) -> Band:
        """The causal / window band of the call (:meth:`Band.of` its two options)."""
        return Band.of(self.is_causal, self.window)


@dataclass(frozen=True)
class ScoreTerms:
    """The per-call arrays of the score pipeline other than Q, K, V and the bias.

    Every array already has the shape it broadcasts with: masks have at least two
    dims (..., Lq|1, Lk|1); lengths and the batch index are
    (*batch, 1, 1, 1); ALiBi slopes are (..., Hq, 1, 1). Only the ALiBi slopes
    receive a gradient (in the tiled backward and through autodiff).
    """

    mask: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    alibi_slopes: Any = None
    score_mod: Callable[..., Any] | None = None
    batch_index: Any = None
    dropout_keep: Any = None
    dropout_scale: float = 1.0
    #: one extra logit per head in every row's denominator, (..., Hq, 1, 1); no value
    sinks: Any = None
    #: packed sequences: ids (*batch, 1, Lq, 1) and (*batch, 1, 1, Lk), equal ids attend
    q_segments: Any = None
    kv_segments: Any = None
    #: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (absolute positions), AND-ed
    mask_mod: Callable[..., Any] | None = None
    #: the block states of a block mask, (*batch|1, Hq|1, nq, nk) int8 (may be traced):
    #: read by value inside the traced loop
    block_states: Any = None
    #: the query and key block sizes of `block_states`
    state_block: tuple[int, int] | None = None
    #: what the states say of a rectangle, read on the host
    #: (``_block_states.HostStates``); None while the states are traced
    block_host: Any = None
    #: the distinct values of `kv_lengths`, read on the host when that is free
    #: (:func:`~._compat.reads_host_values`: NumPy, torch CPU), for the whole call
    #: only: every part made of the call (``place_block``, ``shift_keys``) drops them
    kv_length_values: frozenset[int] | None = None

    @property
    def hides_by_value(self) -> bool:
        """Whether a user mask, lengths or segment ids can hide entries of any block."""
        return self.kv_lengths is not None or self.hides_besides_kv_lengths

    @property
    def hides_besides_kv_lengths(self) -> bool:
        """:attr:`hides_by_value` with `kv_lengths` left out."""
        return (
            self.mask is not None
            or self.q_lengths is not None
            or self.q_segments is not None
            or self.mask_mod is not None
        )


#: the terms of a call given none of the model-building arguments (``_call.prepare``)
PLAIN_TERMS = ScoreTerms()


def heads_to_rows(xp: Any, x: Any, num_kv_heads: int) -> Any:
    """Reshape (..., Hq, L, D) to (..., Hkv, G*L, D): the query heads of a group stacked.

    Done as a split then a merge, each a single even reshape, which Dask supports.
    """
    *batch, hq, rows, cols = x.shape
    g = hq // num_kv_heads
    if g == 1:  # plain multi-head attention: nothing to stack
        return x
    x = xp.reshape(x, (*batch, num_kv_heads, g, rows, cols))  # (..., Hkv, G, L, D)
    return xp.reshape(x, (*batch, num_kv_heads, g * rows, cols))  # (..., Hkv, G*L, D)


def rows_to_heads(xp: Any, x: Any, num_q_heads: int) -> Any:
    """Inverse of :func:`heads_to_rows`: (..., Hkv, G*L, D) to (..., Hq, L, D)."""
    *batch, hkv, rows, cols = x.shape
    g = num_q_heads // hkv
    if g == 1:
        return x
    x = xp.reshape(x, (*batch, hkv, g, rows // g, cols))  # (..., Hkv, G, L, D)
    return xp.reshape(x, (*batch, num_q_heads, rows // g, cols))  # (..., Hq, L, D)


def scaled_query_rows(xp: Any, q: Any, plan: AttentionPlan) -> Any:
    """``scale · Q`` as (..., Hkv, G*Lq, Dk): scaling Q costs Lq·Dk, not Lq·Lk."""
    return heads_to_rows(xp, q * plan.scale, plan.num_kv_heads)


def with_ones_column(xp: Any, v: Any, plan: AttentionPlan) -> Any:
    """``[V | 1]``, (..., Hkv, Lk, Dv + 1): ``P @ [V | 1]`` gives ``P V`` and the row sums of P."""
    ones = xp.ones((*v.shape[:-1], 1), dtype=plan.compute_dtype, **on_device(plan.device))
    return xp.concat([v, ones], axis=-1)


def logits_block(xp: Any, q_rows: Any, k: Any, plan: AttentionPlan, *, matmul: Any = None) -> Any:
    """``softcap(scale · Q Kᵀ)`` for a block: (..., Hkv, G*bq, Dk) x (..., Hkv, bk, Dk).

    `matmul`: a half-precision matmul accumulating in float32
    (:func:`~._compat.matmul_float32`); `q_rows` are then the unscaled half rows and
    the scale is applied to the float32 product (FlashAttention's form).

    Returns
    -------
    array, shape (..., Hq, bq, bk)
        Soft-capped logits, before the bias.
    """
    return capped_logits(xp, raw_logits_block(xp, q_rows, k, plan, matmul=matmul), plan)


def raw_logits_block(
    xp: Any, q_rows: Any, k: Any, plan: AttentionPlan, *, matmul: Any = None
) -> Any:
    """``scale · Q Kᵀ`` for a block, (..., Hq, bq, bk), before the softcap."""
    if matmul is None:
        logits = q_rows @ xp.matrix_transpose(k)  # (..., Hkv, G*bq, bk)
    else:  # half operands, float32 sums; scaled in float32 (not a rounded scale · Q)
        logits = matmul(q_rows, xp.matrix_transpose(k)) * plan.scale
    return rows_to_heads(xp, logits, plan.num_q_heads)  # (..., Hq, bq, bk)


def capped_logits(xp: Any, logits: Any, plan: AttentionPlan) -> Any:
    """``softcap · tanh(logits / softcap)``, or `logits` without a softcap."""
    if plan.softcap is None:
        return logits
    return plan.softcap * xp.tanh(logits / plan.softcap)  # (..., Hq, bq, bk)


def slice_block(x: Any, q_range: Range, k_range: Range) -> Any:
    """Slice a mask or bias broadcastable to (..., Lq, Lk) to one block.

    Axes of size one (broadcast) are kept as they are. `x` has at least 2 dims.
    """
    if x is None:
        return None
    qs = slice(None) if _spans(q_range, x.shape[-2]) else slice(*q_range)
    ks = slice(None) if _spans(k_range, x.shape[-1]) else slice(*k_range)
    return x if qs == ks == slice(None) else x[..., qs, ks]


def _spans(block: Range, size: int) -> bool:
    """Whether `block` takes all of an axis of length `size` (or the axis broadcasts)."""
    if size == 1:
        return True
    start, stop = block
    return type(start) is int and start == 0 and type(stop) is int and stop == size


def allowed_block(
    xp: Any,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
    *,
    structured: bool = True,
) -> Any | None:
    """Combine the user mask, causal, window, lengths, segment ids and ``mask_mod`` for a block.

    Returns None when everything is allowed. ``structured=False`` leaves out every
    structured part (the band, the lengths, the segment ids, the ``mask_mod``): for
    a block that :func:`~._blocks.host_pair_states` says they show in full.
    """
    if terms is PLAIN_TERMS and not plan.band.restricts:
        return None  # the plain call: nothing to mask
    parts = [slice_block(terms.mask, q_range, k_range)]  # (..., Hq|1, bq|1, bk|1)
    if structured:
        if plan.band.restricts:  # (bq, bk) or (*batch, 1, bq, bk)
            offset = query_offset(plan, terms)
            parts.append(plan.band.allowed(xp, q_range, k_range, offset, plan.device))
        kv_lengths = None if _lengths_show_keys(terms, plan, k_range) else terms.kv_lengths
        parts.append(
            padding_allowed(xp, q_range, k_range, terms.q_lengths, kv_lengths, plan.device)
        )
        parts.append(segment_allowed(terms.q_segments, terms.kv_segments, q_range, k_range))
        if terms.mask_mod is not None:  # (..., Hq|1, bq|1, bk|1)
            parts.append(
                evaluate_mask_mod(
                    xp,
                    terms.mask_mod,
                    terms.batch_index,
                    plan.num_q_heads,
                    q_range,
                    k_range,
                    plan.device,
                )
            )
    allowed = None
    for part in parts:
        if part is not None:
            allowed = part if allowed is None else xp.logical_and(allowed, part)
    return allowed


def without_hidden_keys(
    xp: Any, x: Any, terms: ScoreTerms, plan: AttentionPlan, k_range: Range
) -> Any:
    """Keys (or values) `x` (..., Hkv, bk, D) of `k_range` with those past `kv_lengths` zeroed.

    A key hidden by the lengths gets weight 0, but ``0 · NaN`` is NaN: whatever such
    slots hold (a cache allocated with ``empty``, a reused pool) must not reach
    ``P @ V`` or a gradient. None of them, or no lengths: `x` itself.
    """
    if terms.kv_lengths is None:
        return x
    if _lengths_show_keys(terms, plan, k_range):
        return x
    valid = arange(xp, k_range[0], k_range[1], plan.device)[:, None] < terms.kv_lengths
    return xp.where(valid, x, 0.0)  # (*batch, Hkv | 1, bk, D)


def score_index(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> tuple[Any, Any, Any, Any]:
    """Return the index arrays of ``score_mod`` for a block: batch, head, q_idx, kv_idx.

    `batch` (*batch, 1, 1, 1) the flat batch index, `head` (Hq, 1, 1), `q_idx` (bq, 1)
    and `kv_idx` (1, bk) absolute positions: a part of a call (a block of the traced
    loop, a Dask chunk pair) adds its starts (:class:`Alignment`), so ``score_mod``
    itself is never wrapped.
    """
    head = arange(xp, 0, plan.num_q_heads, plan.device)[:, None, None]  # (Hq, 1, 1)
    q_idx = arange(xp, q_range[0], q_range[1], plan.device)[:, None]  # (bq, 1)
    kv_idx = arange(xp, k_range[0], k_range[1], plan.device)[None, :]  # (1, bk)
    if plan.align is not None:
        q_idx, kv_idx = q_idx + plan.align.q_start, kv_idx + plan.align.kv_start
    return terms.batch_index, head, q_idx, kv_idx


def scores_block(
    xp: Any,
    capped: Any,
    bias: Any | None,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
    *,
    modified: bool = False,
) -> Any:
    """``score_mod(capped) + bias + ALiBi`` for one block, before masking.

    Parameters
    ----------
    capped : array, shape (..., Hq, bq, bk)
        Soft-capped logits from :func:`logits_block`.
    bias : array broadcastable to (..., Hq, Lq, Lk), or None
        The full bias; sliced to the block here.
    modified : bool, default False
        `capped` has been through ``score_mod`` already (the backward's VJP of it).
    """
    scores = capped
    if terms.score_mod is not None and not modified:
        scores = terms.score_mod(scores, *score_index(xp, terms, plan, q_range, k_range))
    bias_blk = slice_block(bias, q_range, k_range)
    if bias_blk is not None:
        scores = scores + bias_blk  # (..., Hq, bq, bk)
    if terms.alibi_slopes is not None:
        scores = scores - terms.alibi_slopes * alibi_distance(xp, terms, plan, q_range, k_range)
    return scores


def alibi_distance(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> Any:
    """``|i' - j|`` with ``i' = i + offset``, as floats: (bq, bk) or (*batch, 1, bq, bk)."""
    q_pos = arange(xp, q_range[0], q_range[1], plan.device)[:, None] + query_offset(plan, terms)
    k_pos = arange(xp, k_range[0], k_range[1], plan.device)[None, :]
    return xp.astype(xp.abs(q_pos - k_pos), plan.compute_dtype)


def query_offset(plan: AttentionPlan, terms: ScoreTerms) -> Any:
    """``i' - i`` of the call: an int, or (*batch, 1, 1, 1) with lengths (:class:`Alignment`)."""
    align = _WHOLE_CALL if plan.align is None else plan.align
    return align.offset(plan.q_len, plan.kv_len, terms.q_lengths, terms.kv_lengths)


def hidden_by_value(bias: Any | None, terms: ScoreTerms) -> bool:
    """Whether anything but the band can hide an entry or make a score ``-inf``.

    A mask, lengths or segment ids hide entries; a bias, ``score_mod`` or ALiBi (a
    huge slope) can give ``-inf`` scores. Without any of them only the band hides
    entries: a block the band shows in "full" has a finite score in every row.
    """
    return terms.kv_lengths is not None or _hidden_besides_kv_lengths(bias, terms)


def _hidden_besides_kv_lengths(bias: Any | None, terms: ScoreTerms) -> bool:
    """:func:`hidden_by_value` with `kv_lengths` left out."""
    return (
        terms.hides_besides_kv_lengths
        or bias is not None
        or terms.score_mod is not None
        or terms.alibi_slopes is not None
    )


def _lengths_show_keys(terms: ScoreTerms, plan: AttentionPlan, k_range: Range) -> bool:
    """Whether host-read `kv_lengths` of a whole call leave every key of `k_range` valid."""
    values = terms.kv_length_values
    return values is not None and plan.align is None and min(values) >= k_range[1]


def rows_may_be_empty(bias: Any | None, terms: ScoreTerms, plan: AttentionPlan) -> bool:
    """Whether some query row can end up with no visible key: the one answer to that question.

    Either something value-dependent hides entries (:func:`hidden_by_value`) or the
    band alone leaves a row without keys (``Lq > Lk`` with causal, say). Lengths
    read on the host (:func:`_lengths_show_every_row`) answer it by value.
    """
    if bias is None and terms is PLAIN_TERMS and not plan.band.restricts:
        return False  # the plain call: nothing hides anything
    if _lengths_show_every_row(bias, terms, plan):
        return False
    offset = None if plan.has_lengths else plan.offset
    return hidden_by_value(bias, terms) or plan.band.empties_rows(plan.q_len, plan.kv_len, offset)


def _lengths_show_every_row(bias: Any | None, terms: ScoreTerms, plan: AttentionPlan) -> bool:
    """Whether host-read `kv_lengths`, the only thing hiding by value, leave no row empty.

    A whole call (no part) with `kv_lengths` alone: query ``i`` of batch ``b`` sees the
    keys ``j < n_b`` of its band around ``i' = i + n_b - Lq``, so a row is empty only
    where ``n_b <= 0`` or the band misses ``[0, min(n_b, Lk))`` (decoding with every
    length positive is never empty: no guard is needed).
    """
    values = terms.kv_length_values
    if values is None or plan.align is not None or plan.q_len == 0:
        return False
    if _hidden_besides_kv_lengths(bias, terms):
        return False
    band = plan.band
    return all(
        n > 0 and not band.empties_rows(plan.q_len, min(n, plan.kv_len), n - plan.q_len)
        for n in values
    )


def empty_result(
    xp: Any, plan: AttentionPlan, sinks: Any | None, *, rows: int | None = None
) -> tuple[Any, Any]:
    """Return the result of rows that see no key: the one definition of it.

    Returns
    -------
    out : array, shape (*batch, Hq, rows, Dv)
        Zeros (``rows`` defaults to the plan's ``Lq``), in the compute dtype.
    lse : array, shape (*batch, Hq, rows, 1)
        ``-inf`` (no term in the softmax), or the sink logit with `sinks`
        (..., Hq, 1, 1): the sink is then the row's only term. With the plan's
        ``row_max``, (*batch, Hq, rows, 2): the row max ``-inf`` follows
        (:func:`row_stats`).
    """
    rows = plan.q_len if rows is None else rows
    shape = (*plan.batch, plan.num_q_heads, rows)
    kw = on_device(plan.device)
    out = xp.zeros((*shape, plan.value_dim), dtype=plan.compute_dtype, **kw)
    if sinks is not None:
        lse = xp.broadcast_to(sinks, (*shape, 1))  # already in the compute dtype
    else:
        lse = xp.full((*shape, 1), -xp.inf, dtype=plan.compute_dtype, **kw)
    return out, row_stats(xp, plan, lse, None)


def row_stats(xp: Any, plan: AttentionPlan, lse: Any, row_max: Any | None) -> Any:
    """Return a block's row statistics: `lse` (..., Hq, bq, 1), then `row_max` if the plan asks.

    `row_max` is the largest visible score of each row (..., Hq, bq, 1), ``-inf``
    where none is visible; None: no key visible in any row.
    """
    if not plan.row_max:
        return lse
    if row_max is None:
        row_max = xp.full(lse.shape, -xp.inf, dtype=lse.dtype, **on_device(plan.device))
    return xp.concat([lse, xp.broadcast_to(row_max, lse.shape)], axis=-1)

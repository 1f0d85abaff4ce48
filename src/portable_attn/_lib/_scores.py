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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._block_states import block_index, evaluate_mask_mod
from ._compat import branch_on_finite, on_device, reads_host_values
from ._masks import Alignment, Band, arange, at_rank, padding_allowed, segment_allowed

__all__ = [
    "PLAIN_TERMS",
    "AttentionPlan",
    "ScoreTerms",
    "alibi_block",
    "alibi_distance",
    "distance",
    "allowed_block",
    "capped_logits",
    "empty_result",
    "heads_to_rows",
    "hidden_by_value",
    "hidden_rows_zeroed",
    "if_finite",
    "keys_hidden_from_rows",
    "logits_block",
    "logits_rank",
    "modified_scores",
    "query_offset",
    "raw_logits_block",
    "row_stats",
    "rows_may_be_empty",
    "rows_to_heads",
    "scaled_query_rows",
    "score_index",
    "scores_block",
    "slice_block",
    "visible_product",
    "with_ones_column",
    "without_hidden_keys",
    "zero_rows",
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
        parts.append(segment_allowed(xp, terms.q_segments, terms.kv_segments, q_range, k_range))
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
    rank = logits_rank(plan)  # each part at the logits' rank: no implicit rank promotion
    for part in parts:
        if part is not None:
            part = at_rank(xp, part, rank)
            allowed = part if allowed is None else xp.logical_and(allowed, part)
    return allowed


def keys_hidden_from_rows(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> Any | None:
    """Which keys of `k_range` no query of `q_range` may see, by the lengths or the segment ids.

    Bool (*batch, 1, bk, 1), the keys' layout (..., Hkv, bk, D): a key past its
    sequence's `kv_lengths`, or a key whose segment id no query of the block has (the
    padding of packed sequences, another document's keys). None when neither can hide
    a key of the block (no lengths, or lengths read on the host that show them all).
    """
    if terms.kv_lengths is None and terms.q_segments is None:
        return None  # nothing hides a key from every row
    hidden = None
    if terms.kv_lengths is not None and not _lengths_show_keys(terms, plan, k_range):
        keys = arange(xp, k_range[0], k_range[1], plan.device)[:, None]  # (bk, 1)
        hidden = at_rank(xp, keys, terms.kv_lengths.ndim) >= terms.kv_lengths
    same = segment_allowed(xp, terms.q_segments, terms.kv_segments, q_range, k_range)
    if same is not None:  # (*batch, 1, bq, bk): seen by no row of the block
        unseen = xp.matrix_transpose(xp.logical_not(xp.any(same, axis=-2, keepdims=True)))
        if hidden is not None:
            rank = max(hidden.ndim, unseen.ndim)
            unseen = xp.logical_or(at_rank(xp, hidden, rank), at_rank(xp, unseen, rank))
        hidden = unseen
    return hidden


def without_hidden_keys(
    xp: Any,
    x: Any,
    terms: ScoreTerms,
    plan: AttentionPlan,
    k_range: Range,
    q_range: Range | None = None,
) -> Any:
    """Keys (or values) `x` (..., Hkv, bk, D) of `k_range` with those no query sees zeroed.

    The keys of :func:`keys_hidden_from_rows` for the queries of `q_range` (by default
    the whole call's): they get weight 0 in every row, but ``0 · NaN`` is NaN, so
    whatever such slots hold (a cache allocated with ``empty``, a reused pool, the
    padding of packed sequences) must not reach ``P @ V`` or a gradient. None of
    them: `x` itself.
    """
    q_range = (0, plan.q_len) if q_range is None else q_range
    return hidden_rows_zeroed(xp, x, keys_hidden_from_rows(xp, terms, plan, q_range, k_range))


def hidden_rows_zeroed(xp: Any, x: Any, hidden: Any | None) -> Any:
    """`x` (..., bk, D) with the rows of `hidden` (..., bk, 1) zeroed, where that matters.

    `x` itself where nothing is hidden, and where its values are free to read and
    all finite (:func:`if_finite`): ``0 · finite`` is 0, so a finite hidden row
    changes no product, and the copy (a pass over a whole cache) is not made.
    """
    if hidden is None:
        return x
    return if_finite(xp, x, lambda: x, lambda: zero_rows(xp, x, hidden))


def zero_rows(xp: Any, x: Any, hidden: Any | None) -> Any:
    """`x` (..., bk, D) with the rows of `hidden` (..., bk, 1) zeroed; `x` itself for None."""
    if hidden is None:
        return x
    rank = max(hidden.ndim, x.ndim)
    return xp.where(at_rank(xp, hidden, rank), 0.0, at_rank(xp, x, rank))


def visible_product(
    xp: Any,
    product: Callable[[Any, Any], Any],
    weights: Any,
    values: Any,
    hidden: Any | None,
    *,
    some_rows: bool,
    signed: bool = False,
    seen: Callable[[Any], Any] | None = None,
    choose: Callable[..., Any] | None = None,
) -> Any:
    """``weights @ values`` where a key hidden from a row never changes that row's result.

    A hidden entry has weight 0, but ``0 · NaN`` and ``0 · inf`` are NaN: a
    non-finite value of a hidden key would reach the row through the product. The
    result is exact, in values and gradients, with one product:

    - keys no row of the product sees (`hidden`, from :func:`keys_hidden_from_rows`:
      past the lengths, another document's) have their rows of `values` zeroed;
    - with `some_rows` (segment ids: a block of queries from two documents), a key
      may be hidden from some rows and seen by others, so it cannot be zeroed for
      all. Its non-finite entries are zeroed in the product (a row that gives them no
      weight is exact), and a row that does give one weight is NaN in each column
      where the block's values are not all finite (plain math gives NaN or ``±inf``
      in the columns of the values it weighs) and exact in the others. Whether a row
      sees a non-finite value is ``seen(bad)`` when given (`bad` (..., bk, 1) the
      keys holding one; the result (..., rows, 1)): the caller's mask, which leaves
      the weights to the product alone (XLA then fuses the softmax into it); else a
      matrix-vector product of nonnegative `weights` with those keys, or, for
      `signed` weights (a gradient), their entries compared with 0.

    `product` is the matmul (``@``, the float32-accumulating one, a workspace's);
    `weights` (..., Hkv, G*bq, bk) and `values` (..., Hkv, bk, D). Where nothing is
    hidden it is the product alone. `choose` (:func:`if_finite` by default, or a
    workspace's :meth:`~._tiled.Ops.if_finite`) may take the product over the values
    as they are where none of them is non-finite: nothing hidden can reach a row then.
    """
    if hidden is None and not some_rows:
        return product(weights, values)

    def as_they_are() -> Any:
        return product(weights, values)

    def exact() -> Any:
        kept = zero_rows(xp, values, hidden)  # seen by no row: zero, whatever they hold
        if not some_rows:
            return product(weights, kept)
        finite = xp.isfinite(kept)
        clean = xp.where(finite, kept, 0.0)
        bad = xp.logical_not(finite)
        bad_key = xp.any(bad, axis=-1, keepdims=True)  # (..., bk, 1)
        bad_column = xp.any(bad, axis=-2, keepdims=True)  # (..., 1, D)
        out = product(weights, clean)
        if seen is not None:
            sees = seen(bad_key)
        elif signed:
            rank = max(weights.ndim, bad_key.ndim)
            bad_row = at_rank(xp, xp.matrix_transpose(bad_key), rank)  # (..., 1, bk)
            weighed = xp.logical_and(at_rank(xp, weights, rank) != 0.0, bad_row)
            sees = xp.any(weighed, axis=-1, keepdims=True)  # (..., rows, 1)
        else:  # the weight each row gives non-finite values: a matrix-vector product
            sees = product(weights, xp.astype(bad_key, clean.dtype)) > 0.0
        rank = max(sees.ndim, bad_column.ndim, out.ndim)
        nan = xp.logical_and(at_rank(xp, sees, rank), at_rank(xp, bad_column, rank))
        return xp.where(nan, xp.nan, at_rank(xp, out, rank))

    if choose is None:
        return if_finite(xp, values, as_they_are, exact)
    return choose(values, as_they_are, exact)


def if_finite(xp: Any, values: Any, plain: Callable[[], Any], exact: Callable[[], Any]) -> Any:
    """``plain()`` where every entry of `values` is finite and free to read, else ``exact()``.

    `values`: an array or a tuple of arrays.

    The one branch on values of the score pipeline, taken only where reading them
    costs nothing (:func:`~._compat.reads_host_values`: NumPy, torch CPU eager), as
    the lengths' values are read: two reductions (``max`` and ``min``, NaN and ``±inf``
    show in them), no copy, no operation that makes a NaN (NumPy would warn of one).
    JAX (``jax.jit``, an eager call's program) chooses inside its program
    (:func:`~._compat.branch_on_finite`); elsewhere (Dask's lazy graphs, a torch CUDA
    tensor) ``exact()``, without a read.
    """
    arrays = values if isinstance(values, tuple) else (values,)
    if all(reads_host_values(x) for x in arrays):
        for x in arrays:
            if math.prod(x.shape) == 0:
                continue
            extremes = xp.stack([xp.max(x), xp.min(x)])
            if not bool(xp.all(xp.isfinite(extremes))):
                return exact()
        return plain()
    chosen = branch_on_finite(arrays, plain, exact)
    return exact() if chosen is None else chosen


def score_index(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> tuple[Any, Any, Any, Any]:
    """Return the index arrays of ``score_mod`` for a block: batch, head, q_idx, kv_idx.

    Those of :func:`~._block_states.block_index`, at the logits' rank: `batch`
    (*batch, 1, 1, 1) the flat batch index, `head` (1..., Hq, 1, 1), `q_idx`
    (1..., 1, bq, 1) and `kv_idx` (1..., 1, 1, bk) absolute positions: a part of a
    call (a block of the traced loop, a Dask chunk pair) adds its starts
    (:class:`Alignment`), so ``score_mod`` itself is never wrapped.
    """
    batch, head, q_idx, kv_idx = block_index(
        xp, terms.batch_index, plan.num_q_heads, q_range, k_range, plan.device
    )
    if plan.align is not None:
        q_idx, kv_idx = q_idx + plan.align.q_start, kv_idx + plan.align.kv_start
    return batch, head, q_idx, kv_idx


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
        index = score_index(xp, terms, plan, q_range, k_range)
        scores = modified_scores(xp, terms.score_mod, scores, index)
    bias_blk = slice_block(bias, q_range, k_range)
    if bias_blk is not None:
        scores = scores + at_rank(xp, bias_blk, scores.ndim)  # (..., Hq, bq, bk)
    if terms.alibi_slopes is not None:
        scores = scores - alibi_block(xp, terms, plan, q_range, k_range)
    return scores


def modified_scores(
    xp: Any, score_mod: Callable[..., Any], scores: Any, index: tuple[Any, ...]
) -> Any:
    """``score_mod(scores, *index)`` in the dtype of `scores`, the compute dtype.

    A ``score_mod`` may return a wider dtype than the scores (a float64 learned table
    added to float32 scores): its result is cast back, so the weights, ``P @ V`` and
    the gradients stay in the compute dtype (torch refuses a float64 product with
    float32 values) while the table's own gradient keeps the table's dtype.
    """
    result = score_mod(scores, *index)
    return result if result.dtype == scores.dtype else xp.astype(result, scores.dtype)


def alibi_block(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> Any:
    """``slope · |i' - j|`` of a block, (..., Hq, bq, bk): what ALiBi subtracts from the scores."""
    rank = logits_rank(plan)
    distance = at_rank(xp, alibi_distance(xp, terms, plan, q_range, k_range), rank)
    return at_rank(xp, terms.alibi_slopes, rank) * distance


def alibi_distance(
    xp: Any, terms: ScoreTerms, plan: AttentionPlan, q_range: Range, k_range: Range
) -> Any:
    """``|i' - j|`` with ``i' = i + offset``, as floats: (bq, bk) or (*batch, 1, bq, bk)."""
    offset = query_offset(plan, terms)
    q_pos = arange(xp, q_range[0], q_range[1], plan.device)[:, None]
    if not isinstance(offset, int):  # (*batch, 1, 1, 1): positions at its rank
        q_pos = at_rank(xp, q_pos, offset.ndim)
    q_pos = q_pos + offset
    k_pos = at_rank(xp, arange(xp, k_range[0], k_range[1], plan.device)[None, :], q_pos.ndim)
    return distance(xp, q_pos, k_pos, plan.compute_dtype)


def distance(xp: Any, q_pos: Any, k_pos: Any, dtype: Any) -> Any:
    """``|q_pos - k_pos|`` as `dtype`: the distance ALiBi's slopes multiply (broadcast).

    The one place it is written: the engine's blocks, flex's ``score_mod``, the paged
    walk and ``varlen_attention``'s closures subtract ``slope · distance``.
    """
    return xp.astype(xp.abs(q_pos - k_pos), dtype)


def logits_rank(plan: AttentionPlan) -> int:
    """Return the rank of a block of logits, (*batch, Hq, bq, bk): every term is lifted to it."""
    return len(plan.batch) + 3


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

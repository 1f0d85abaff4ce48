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

from ._compat import on_device, traces_python_loops
from ._masks import arange, padding_allowed, segment_allowed, structure_allowed

__all__ = [
    "AttentionPlan",
    "ScoreTerms",
    "alibi_distance",
    "allowed_block",
    "capped_logits",
    "heads_to_rows",
    "logits_block",
    "raw_logits_block",
    "rows_to_heads",
    "scaled_query_rows",
    "scores_block",
    "fold_row_sums",
    "slice_block",
    "with_ones_column",
]

Range = tuple[int, int]


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

    @property
    def groups(self) -> int:
        """Query heads per key/value head, ``G = Hq // Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        """``Lk - Lq``: the bottom-right alignment of queries on the key axis."""
        return self.kv_len - self.q_len


@dataclass(frozen=True)
class ScoreTerms:
    """The per-call arrays of the score pipeline other than Q, K, V and the bias.

    Every array already has the shape it broadcasts with: masks have at least two
    dims (..., Lq|1, Lk|1); lengths, offsets and the batch index are
    (*batch, 1, 1, 1); ALiBi slopes are (..., Hq, 1, 1). Only the ALiBi slopes
    receive a gradient (in the tiled backward and through autodiff).
    """

    mask: Any | None = None
    q_lengths: Any | None = None
    kv_lengths: Any | None = None
    offset: Any = 0
    alibi_slopes: Any | None = None
    score_mod: Callable[..., Any] | None = None
    batch_index: Any | None = None
    dropout_keep: Any | None = None
    dropout_scale: float = 1.0
    #: one extra logit per head in every row's denominator, (..., Hq, 1, 1); no value
    sinks: Any | None = None
    #: packed sequences: ids (*batch, 1, Lq, 1) and (*batch, 1, 1, Lk), equal ids attend
    q_segments: Any | None = None
    kv_segments: Any | None = None
    #: host ids only (NumPy): which block pairs share no segment (``_masks.SegmentBlocks``)
    segment_blocks: Any | None = None

    @property
    def hides_by_value(self) -> bool:
        """Whether a user mask, lengths or segment ids can hide entries of any block."""
        return (
            self.mask is not None
            or self.q_lengths is not None
            or self.kv_lengths is not None
            or self.q_segments is not None
        )


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


def fold_row_sums(q: Any, terms: ScoreTerms, plan: AttentionPlan) -> bool:
    """Whether to take the row sums of P from ``P @ [V | 1]`` instead of a pass over P.

    Not with dropout (it drops weights from ``P V`` but not from the sums), and
    not for traced libraries (JAX): XLA fuses the sum into the ``exp`` pass
    already, and the wider matmul measured 4-11% slower under ``jax.jit``.
    Eager libraries save one pass over every (bq, bk) block (NumPy: 3-7%), but
    building ``[V | 1]`` copies V: it pays only when each K/V head has more query
    rows (G * Lq) than V has columns (decoding, Lq = 1, copied V for nothing).
    """
    rows = plan.groups * plan.q_len
    return terms.dropout_keep is None and not traces_python_loops(q) and rows > plan.value_dim


def with_ones_column(xp: Any, v: Any, plan: AttentionPlan) -> Any:
    """``[V | 1]``, (..., Hkv, Lk, Dv + 1): ``P @ [V | 1]`` gives ``P V`` and the row sums of P."""
    ones = xp.ones((*v.shape[:-1], 1), dtype=plan.compute_dtype, **on_device(plan.device))
    return xp.concat([v, ones], axis=-1)


def logits_block(xp: Any, q_rows: Any, k: Any, plan: AttentionPlan) -> Any:
    """``softcap(scale · Q Kᵀ)`` for a block: (..., Hkv, G*bq, Dk) x (..., Hkv, bk, Dk).

    Returns
    -------
    array, shape (..., Hq, bq, bk)
        Soft-capped logits, before the bias.
    """
    return capped_logits(xp, raw_logits_block(xp, q_rows, k, plan), plan)


def raw_logits_block(xp: Any, q_rows: Any, k: Any, plan: AttentionPlan) -> Any:
    """``scale · Q Kᵀ`` for a block, (..., Hq, bq, bk), before the softcap."""
    logits = q_rows @ xp.matrix_transpose(k)  # (..., Hkv, G*bq, bk)
    return rows_to_heads(xp, logits, plan.num_q_heads)  # (..., Hq, bq, bk)


def capped_logits(xp: Any, logits: Any, plan: AttentionPlan) -> Any:
    """``softcap · tanh(logits / softcap)``, or `logits` without a softcap."""
    if plan.softcap is None:
        return logits
    return plan.softcap * xp.tanh(logits / plan.softcap)  # (..., Hq, bq, bk)


def slice_block(x: Any | None, q_range: Range, k_range: Range) -> Any | None:
    """Slice a mask or bias broadcastable to (..., Lq, Lk) to one block.

    Axes of size one (broadcast) are kept as they are. `x` has at least 2 dims.
    """
    if x is None:
        return None
    qs = slice(*q_range) if x.shape[-2] != 1 else slice(None)
    ks = slice(*k_range) if x.shape[-1] != 1 else slice(None)
    return x[..., qs, ks]


def allowed_block(
    xp: Any,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
    *,
    structural: bool = True,
    segments: bool = True,
) -> Any | None:
    """Combine the user mask, causal, window, padding and segment ids for one block.

    Returns None when everything is allowed. ``structural=False`` leaves out the
    causal/window part (for blocks known to be fully inside the band),
    ``segments=False`` the segment ids (for blocks known to lie in one segment).
    """
    parts = [slice_block(terms.mask, q_range, k_range)]  # (..., Hq|1, bq|1, bk|1)
    if structural:
        parts.append(
            structure_allowed(
                xp,
                q_range,
                k_range,
                offset=terms.offset,
                is_causal=plan.is_causal,
                window=plan.window,
                device=plan.device,
            )
        )  # (bq, bk) or (*batch, 1, bq, bk)
    parts.append(
        padding_allowed(xp, q_range, k_range, terms.q_lengths, terms.kv_lengths, plan.device)
    )
    if segments:
        parts.append(segment_allowed(terms.q_segments, terms.kv_segments, q_range, k_range))
    allowed = None
    for part in parts:
        if part is not None:
            allowed = part if allowed is None else xp.logical_and(allowed, part)
    return allowed


def scores_block(
    xp: Any,
    capped: Any,
    bias: Any | None,
    terms: ScoreTerms,
    plan: AttentionPlan,
    q_range: Range,
    k_range: Range,
) -> Any:
    """``score_mod(capped) + bias + ALiBi`` for one block, before masking.

    Parameters
    ----------
    capped : array, shape (..., Hq, bq, bk)
        Soft-capped logits from :func:`logits_block`.
    bias : array broadcastable to (..., Hq, Lq, Lk), or None
        The full bias; sliced to the block here.
    """
    scores = capped
    if terms.score_mod is not None:
        head = arange(xp, 0, plan.num_q_heads, plan.device)[:, None, None]  # (Hq, 1, 1)
        q_idx = arange(xp, q_range[0], q_range[1], plan.device)[:, None]  # (bq, 1)
        kv_idx = arange(xp, k_range[0], k_range[1], plan.device)[None, :]  # (1, bk)
        scores = terms.score_mod(scores, terms.batch_index, head, q_idx, kv_idx)
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
    q_pos = arange(xp, q_range[0], q_range[1], plan.device)[:, None] + terms.offset
    k_pos = arange(xp, k_range[0], k_range[1], plan.device)[None, :]
    return xp.astype(xp.abs(q_pos - k_pos), plan.compute_dtype)

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

from dataclasses import dataclass
from typing import Any

from ._masks import structure_allowed

__all__ = [
    "AttentionPlan",
    "allowed_block",
    "heads_to_rows",
    "logits_block",
    "rows_to_heads",
    "scaled_query_rows",
    "slice_block",
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
    scale: float
    softcap: float | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    compute_dtype: Any
    result_dtype: Any
    device: Any

    @property
    def groups(self) -> int:
        """Query heads per key/value head, ``G = Hq // Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        """``Lk - Lq``: the bottom-right alignment of queries on the key axis."""
        return self.kv_len - self.q_len


def heads_to_rows(xp: Any, x: Any, num_kv_heads: int) -> Any:
    """Reshape (..., Hq, L, D) to (..., Hkv, G*L, D): the query heads of a group stacked.

    Done as a split then a merge, each a single even reshape, which Dask supports.
    """
    *batch, hq, rows, cols = x.shape
    g = hq // num_kv_heads
    x = xp.reshape(x, (*batch, num_kv_heads, g, rows, cols))  # (..., Hkv, G, L, D)
    return xp.reshape(x, (*batch, num_kv_heads, g * rows, cols))  # (..., Hkv, G*L, D)


def rows_to_heads(xp: Any, x: Any, num_q_heads: int) -> Any:
    """Inverse of :func:`heads_to_rows`: (..., Hkv, G*L, D) to (..., Hq, L, D)."""
    *batch, hkv, rows, cols = x.shape
    g = num_q_heads // hkv
    x = xp.reshape(x, (*batch, hkv, g, rows // g, cols))  # (..., Hkv, G, L, D)
    return xp.reshape(x, (*batch, num_q_heads, rows // g, cols))  # (..., Hq, L, D)


def scaled_query_rows(xp: Any, q: Any, plan: AttentionPlan) -> Any:
    """``scale · Q`` as (..., Hkv, G*Lq, Dk): scaling Q costs Lq·Dk, not Lq·Lk."""
    return heads_to_rows(xp, q * plan.scale, plan.num_kv_heads)


def logits_block(xp: Any, q_rows: Any, k: Any, plan: AttentionPlan) -> Any:
    """``softcap(scale · Q Kᵀ)`` for a block: (..., Hkv, G*bq, Dk) x (..., Hkv, bk, Dk).

    Returns
    -------
    array, shape (..., Hq, bq, bk)
        Soft-capped logits, before the bias.
    """
    logits = xp.matmul(q_rows, xp.matrix_transpose(k))  # (..., Hkv, G*bq, bk)
    logits = rows_to_heads(xp, logits, plan.num_q_heads)  # (..., Hq, bq, bk)
    if plan.softcap is not None:
        logits = plan.softcap * xp.tanh(logits / plan.softcap)  # (..., Hq, bq, bk)
    return logits


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
    xp: Any, mask_block: Any | None, plan: AttentionPlan, q_range: Range, k_range: Range
) -> Any | None:
    """Combine the user mask, causal and window for one block; None when all is allowed."""
    structure = structure_allowed(
        xp,
        q_range,
        k_range,
        offset=plan.offset,
        is_causal=plan.is_causal,
        window=plan.window,
        device=plan.device,
    )  # (bq, bk) or None
    if mask_block is None:
        return structure
    if structure is None:
        return mask_block
    return xp.logical_and(mask_block, structure)  # broadcast to (..., Hq, bq, bk)

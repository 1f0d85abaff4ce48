"""The dense attention computation, written only with array-API standard calls.

Inputs arrive already validated and with an explicit head axis. Grouped-query
attention is computed without repeating K/V: the query heads of one group are
stacked along the row axis, ``(..., Hkv, G * Lq, Dk)``, which is a pure reshape
of ``(..., Hq, Lq, Dk)`` because query head ``h`` belongs to group
``h // G``. Legend: Hq query heads, Hkv key/value heads, ``G = Hq // Hkv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._masks import structure_allowed
from ._softmax import masked_exp, safe_denominator

__all__ = ["AttentionPlan", "dense_attention"]


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


def _logits(xp: Any, q: Any, k: Any, plan: AttentionPlan) -> Any:
    """Return ``softcap(scale * Q Kᵀ)`` with shape (*batch, Hq, Lq, Lk)."""
    q = q * plan.scale  # (..., Hq, Lq, Dk): scaling Q costs Lq*Dk, not Lq*Lk
    q = heads_to_rows(xp, q, plan.num_kv_heads)  # (..., Hkv, G*Lq, Dk)
    logits = xp.matmul(q, xp.matrix_transpose(k))  # (..., Hkv, G*Lq, Lk)
    logits = rows_to_heads(xp, logits, plan.num_q_heads)  # (..., Hq, Lq, Lk)
    if plan.softcap is not None:
        logits = plan.softcap * xp.tanh(logits / plan.softcap)  # (..., Hq, Lq, Lk)
    return logits


def _allowed(xp: Any, mask: Any | None, plan: AttentionPlan) -> Any | None:
    """Combine the user mask with causal/window structure (logical AND)."""
    structure = structure_allowed(
        xp,
        (0, plan.q_len),
        (0, plan.kv_len),
        offset=plan.kv_len - plan.q_len,
        is_causal=plan.is_causal,
        window=plan.window,
        device=plan.device,
    )  # (Lq, Lk) or None
    if mask is None:
        return structure
    if structure is None:
        return mask
    return xp.logical_and(mask, structure)  # broadcast to (..., Hq, Lq, Lk)


def _exp_logits(
    xp: Any, q: Any, k: Any, mask: Any | None, bias: Any | None, plan: AttentionPlan
) -> tuple[Any, Any]:
    logits = _logits(xp, q, k, plan)  # (..., Hq, Lq, Lk)
    if bias is not None:
        logits = logits + bias  # (..., Hq, Lq, Lk)
    return masked_exp(xp, logits, _allowed(xp, mask, plan))


def dense_attention(
    xp: Any, q: Any, k: Any, v: Any, mask: Any | None, bias: Any | None, plan: AttentionPlan
) -> Any:
    """Attention output, shape (*batch, Hq, Lq, Dv), in the compute dtype.

    The normalisation is applied after the second matmul: dividing the
    ``(Lq, Dv)`` output is cheaper than dividing the ``(Lq, Lk)`` weights.
    """
    # exp_logits (..., Hq, Lq, Lk), row_sum (..., Hq, Lq, 1)
    exp_logits, row_sum = _exp_logits(xp, q, k, mask, bias, plan)
    exp_logits = heads_to_rows(xp, exp_logits, plan.num_kv_heads)  # (..., Hkv, G*Lq, Lk)
    out = xp.matmul(exp_logits, v)  # (..., Hkv, G*Lq, Dv)
    out = rows_to_heads(xp, out, plan.num_q_heads)  # (..., Hq, Lq, Dv)
    return out / safe_denominator(xp, row_sum)


def dense_weights(
    xp: Any, q: Any, k: Any, mask: Any | None, bias: Any | None, plan: AttentionPlan
) -> Any:
    """Attention weights, shape (*batch, Hq, Lq, Lk), in the compute dtype."""
    exp_logits, row_sum = _exp_logits(xp, q, k, mask, bias, plan)
    return exp_logits / safe_denominator(xp, row_sum)

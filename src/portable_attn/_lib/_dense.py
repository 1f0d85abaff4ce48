"""The dense attention computation: one block covering every query and key."""

from __future__ import annotations

from typing import Any

from ._scores import (
    AttentionPlan,
    allowed_block,
    heads_to_rows,
    logits_block,
    rows_to_heads,
    scaled_query_rows,
)
from ._softmax import masked_exp, safe_denominator

__all__ = ["dense_attention", "dense_weights"]


def _exp_logits(
    xp: Any, q: Any, k: Any, mask: Any | None, bias: Any | None, plan: AttentionPlan
) -> tuple[Any, Any]:
    logits = logits_block(xp, scaled_query_rows(xp, q, plan), k, plan)  # (..., Hq, Lq, Lk)
    if bias is not None:
        logits = logits + bias  # (..., Hq, Lq, Lk)
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    return masked_exp(xp, logits, allowed_block(xp, mask, plan, whole_q, whole_k))


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

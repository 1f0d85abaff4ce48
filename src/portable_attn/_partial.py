"""Attention over one part of the keys, with its log-sum-exp, for exact merging.

Used where the keys of one sequence are split across places that each compute
their own part: devices of a JAX mesh (``portable_attn.jax_parallel``) or any
caller that merges with :func:`portable_attn._lib._merge.merge_partials`.
Portable: only standard ``xp`` calls, like the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._attention import _at_least_2d, _prepare, _setup, _tiles, signed_lengths
from ._lib._compat import array_namespace, device
from ._lib._merge import empty_rows_to_neg_inf
from ._lib._tiled import tiled_forward

__all__ = ["partial_attention"]

Array = Any


def partial_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    kv_start: int | Array,
    kv_total: int,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> tuple[Array, Array]:
    """Attention of every query over the keys ``[kv_start, kv_start + Lk_part)``.

    The keys, values, and the key axis of `mask`/`bias`, are one contiguous part
    of a sequence of `kv_total` keys; causal, window, ALiBi, `kv_lengths` and
    `score_mod` positions are those of the whole sequence. Other arguments as in
    :func:`portable_attn.scaled_dot_product_attention`.

    Parameters
    ----------
    query : array, shape (B..., Hq, Lq, Dk)
    key : array, shape (B..., Hkv, Lk_part, Dk)
    value : array, shape (B..., Hkv, Lk_part, Dv)
    kv_start : int or integer array of shape ()
        Position of this part's first key in the whole sequence (may be traced,
        e.g. ``lax.axis_index(...) * Lk_part``).
    kv_total : int
        Number of keys in the whole sequence.

    Returns
    -------
    out : array, shape (B..., Hq, Lq, Dv), compute dtype
        Attention normalised over this part (zeros for rows with no visible key
        in it).
    lse : array, shape (B..., Hq, Lq, 1), compute dtype
        Row log-sum-exp of this part's scores, ``-inf`` for rows with no visible
        key in it.
    """
    xp0, dev = array_namespace(query=query), device(query)
    if kv_lengths is None:
        kv_lengths = xp0.asarray(kv_total) if dev is None else xp0.asarray(kv_total, device=dev)
    # key j_part is valid iff j_part + start < length (signed: a part may lie past the end)
    local_lengths = signed_lengths(xp0, kv_lengths) - kv_start
    mod = score_mod
    if score_mod is not None:

        def mod(scores: Array, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            return score_mod(scores, batch, head, q_idx, kv_idx + kv_start)

    xp, plan, terms = _setup(
        query,
        key,
        value,
        mask,
        bias,
        {"is_causal": is_causal, "scale": scale, "window": window, "softcap": softcap},
        {
            "q_lengths": q_lengths,
            "kv_lengths": local_lengths,  # also moves the causal/window/ALiBi alignment
            "alibi_slopes": alibi_slopes,
            "score_mod": mod,
            "dropout_p": 0.0,
            "dropout_mask": None,
        },
    )
    dt = plan.compute_dtype
    q, k, v = (_prepare(xp, x, dt) for x in (query, key, value))
    b = None if bias is None else _at_least_2d(xp, xp.astype(bias, dt, copy=False))
    lse_shape = (*plan.batch, plan.num_q_heads, plan.q_len, 1)
    if plan.kv_len == 0 or plan.q_len == 0:
        on = {} if plan.device is None else {"device": plan.device}
        out = xp.zeros((*plan.batch, plan.num_q_heads, plan.q_len, plan.value_dim), dtype=dt, **on)
        return out, xp.full(lse_shape, -xp.inf, dtype=dt, **on)
    tiles = _tiles(xp, query, key, plan, block_size) or (plan.q_len, plan.kv_len)
    out, lse = tiled_forward(xp, q, k, v, b, terms, plan, *tiles)
    return out, empty_rows_to_neg_inf(xp, lse)

"""Attention over one part of the keys, with its log-sum-exp, for exact merging.

Used where the keys of one sequence are split across places that each compute
their own part: devices of a JAX mesh (``portable_attn.jax_parallel``) or any
caller that merges with :func:`portable_attn._lib._merge.merge_partials`.
Portable: only standard ``xp`` calls, like the core.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._lib._call import AttentionCall
from ._lib._compat import on_device
from ._lib._merge import empty_rows_to_neg_inf
from ._lib._tiled import tiled_forward
from ._path_policy import choose_path

__all__ = ["partial_attention", "shift_keys"]

Array = Any


def shift_keys(call: AttentionCall, kv_start: int | Array, kv_total: int) -> AttentionCall:
    """Place the keys of `call` at ``[kv_start, kv_start + Lk_part)`` of `kv_total` keys.

    Causal, window, ALiBi, `kv_lengths` and `score_mod` positions become those of
    the whole sequence: the valid length of the part is ``kv_len - kv_start``
    (signed: a part may lie past the end), which also moves the alignment
    ``i' = i + kv_len - q_len`` by ``-kv_start``; `score_mod` sees absolute key
    positions.
    """
    xp, plan, terms = call.xp, call.plan, call.terms
    kv_len = terms.kv_lengths
    if kv_len is None:
        kv_len = xp.asarray(kv_total, **on_device(plan.device))
    local = kv_len - kv_start  # key j_part is valid iff j_part + start < length
    q_len = plan.q_len if terms.q_lengths is None else terms.q_lengths
    mod = terms.score_mod
    if mod is not None:
        inner = mod

        def mod(scores: Array, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            return inner(scores, batch, head, q_idx, kv_idx + kv_start)

    new_terms = dataclasses.replace(terms, kv_lengths=local, offset=local - q_len, score_mod=mod)
    return dataclasses.replace(
        call, plan=dataclasses.replace(plan, has_lengths=True), terms=new_terms
    )


def partial_attention(
    call: AttentionCall,
    *,
    kv_start: int | Array,
    kv_total: int,
    block_size: int | tuple[int, int] | None = None,
) -> tuple[Array, Array]:
    """Attention of every query of `call` over its keys, placed at `kv_start` of `kv_total`.

    Parameters
    ----------
    call : AttentionCall
        Prepared from the query, this part's keys and values (B..., Hkv,
        Lk_part, D), and the key axis of `mask`/`bias` cut to the part.
    kv_start : int or integer array of shape ()
        Position of this part's first key in the whole sequence (may be traced,
        e.g. ``lax.axis_index(...) * Lk_part``).
    kv_total : int
        Number of keys in the whole sequence.
    block_size : int or (int, int), optional
        Tile the part; default one block.

    Returns
    -------
    out : array, shape (B..., Hq, Lq, Dv), compute dtype
        Attention normalised over this part (zeros for rows with no visible key
        in it).
    lse : array, shape (B..., Hq, Lq, 1), compute dtype
        Row log-sum-exp of this part's scores, ``-inf`` for rows with no visible
        key in it.
    """
    call = shift_keys(call, kv_start, kv_total)
    plan = call.plan
    path = choose_path(call, block_size, "portable")
    if path.kind == "empty":
        out = call.zeros(plan.q_len, plan.value_dim)
        return out, call.zeros(plan.q_len, 1) - call.xp.inf  # lse -inf: no key
    tiles = path.tiles or (plan.q_len, plan.kv_len)
    xp = call.xp
    out, lse = tiled_forward(
        xp, call.query, call.key, call.value, call.bias, call.terms, plan, *tiles
    )
    return out, empty_rows_to_neg_inf(xp, lse)

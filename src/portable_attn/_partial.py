"""Attention over one part of the keys (and queries), with its log-sum-exp, for exact merging.

Used where the keys of one sequence are split across places that each compute
their own part: devices of a JAX mesh (``portable_attn.jax_parallel``), the
(query chunk, key chunk) tasks of Dask (``portable_attn._dask``), or any caller
that merges with :func:`portable_attn._lib._merge.merge_partials`. Portable:
only standard ``xp`` calls, like the core.

Two ways to place a part at its positions in the whole sequence:
:func:`shift_keys` (a key offset that may be a traced array, as on a JAX mesh;
every block becomes "partial") and :func:`place_block` (static query and key
offsets, as for Dask chunks; causal/window block skipping keeps working inside
the part).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._lib._call import AttentionCall
from ._lib._compat import on_device
from ._lib._merge import empty_rows_to_neg_inf
from ._lib._scores import AttentionPlan
from ._lib._tiled import tiled_forward
from ._path_policy import choose_path

__all__ = ["partial_attention", "place_block", "shift_keys"]

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


@dataclasses.dataclass(frozen=True)
class _PlacedPlan(AttentionPlan):
    """A plan for a part of the queries and keys: `offset` is the whole sequence's alignment.

    ``offset`` is ``i' - i`` for local query and key indices: ``Lk - Lq`` of the
    whole sequence plus ``q_start - kv_start``, not ``kv_len - q_len`` of the part.
    """

    placed_offset: int = 0

    @property
    def offset(self) -> int:
        """``Lk_total - Lq_total + q_start - kv_start``: the part's alignment on the key axis."""
        return self.placed_offset


def place_block(
    call: AttentionCall, *, q_start: int, kv_start: int, q_total: int, kv_total: int
) -> AttentionCall:
    """Place the queries of `call` at `q_start` of `q_total`, its keys at `kv_start` of `kv_total`.

    Parameters
    ----------
    call : AttentionCall
        Prepared from one part: queries (B..., Hq, Lq_part, Dk), keys and values
        (B..., Hkv, Lk_part, D), mask/bias/dropout mask cut to the part. Its
        `q_lengths`/`kv_lengths` (if any) are those of the whole sequences.
    q_start, kv_start : int
        Position of the part's first query and first key in the whole sequence.
    q_total, kv_total : int
        Number of queries and keys of the whole sequence.

    Returns
    -------
    AttentionCall
        The same part, with causal, window, ALiBi, lengths and `score_mod` at the
        positions of the whole sequence: local query ``i`` is ``i + q_start``,
        local key ``j`` is ``j + kv_start``. Without lengths the alignment stays
        static (:func:`block_visibility` still skips and marks "full" blocks
        inside the part); with lengths the part's valid lengths are
        ``q_len - q_start`` and ``kv_len - kv_start`` (signed: a part may lie
        past the end).
    """
    plan, terms = call.plan, call.terms
    placed = kv_total - q_total + q_start - kv_start  # i' - j for local i, j
    offset: Any = placed
    q_lengths, kv_lengths = terms.q_lengths, terms.kv_lengths
    if plan.has_lengths:
        q_len = q_total if q_lengths is None else q_lengths
        kv_len = kv_total if kv_lengths is None else kv_lengths
        offset = (kv_len - kv_start) - (q_len - q_start)  # i' = i + kv_len - q_len, shifted
        q_lengths = None if q_lengths is None else q_lengths - q_start
        kv_lengths = None if kv_lengths is None else kv_lengths - kv_start
    mod = terms.score_mod
    if mod is not None and (q_start or kv_start):
        inner = mod

        def mod(scores: Array, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            return inner(scores, batch, head, q_idx + q_start, kv_idx + kv_start)

    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(AttentionPlan)}
    new_plan = _PlacedPlan(**fields, placed_offset=placed)
    new_terms = dataclasses.replace(
        terms, q_lengths=q_lengths, kv_lengths=kv_lengths, offset=offset, score_mod=mod
    )
    return dataclasses.replace(call, plan=new_plan, terms=new_terms)


def partial_attention(
    call: AttentionCall,
    *,
    kv_start: int | Array,
    kv_total: int,
    block_size: int | tuple[int, int] | str | None = None,
    q_start: int | None = None,
    q_total: int | None = None,
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
    block_size : int, (int, int) or "dense", optional
        Tile the part; default one block.
    q_start, q_total : int, optional
        The queries are a part too: placed at `q_start` of `q_total` (both
        static ints, and `kv_start` then as well; see :func:`place_block`).
        By default the queries are the whole sequence.

    Returns
    -------
    out : array, shape (B..., Hq, Lq, Dv), compute dtype
        Attention normalised over this part (zeros for rows with no visible key
        in it).
    lse : array, shape (B..., Hq, Lq, 1), compute dtype
        Row log-sum-exp of this part's scores, ``-inf`` for rows with no visible
        key in it.
    """
    if q_start is None:
        call = shift_keys(call, kv_start, kv_total)
    else:
        total = call.plan.q_len if q_total is None else q_total
        call = place_block(
            call, q_start=q_start, kv_start=int(kv_start), q_total=total, kv_total=kv_total
        )
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

"""Attention over one part of the keys (and queries), with its log-sum-exp, for exact merging.

Used where the keys of one sequence are split across places that each compute
their own part: devices of a JAX mesh (``portable_attn.jax_parallel``), the
(query chunk, key chunk) tasks of Dask (``portable_attn._paths._dask``), or any caller
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

from .._lib._call import AttentionCall
from .._lib._compat import on_device
from .._lib._masks import Alignment
from .._lib._path import DaskGrid, Dense, Empty, Path, Tiled
from .._lib._tiled import tiled_forward
from ._buffered import buffered_forward

__all__ = ["cut_call", "partial_attention", "place_block", "shift_keys"]

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
    mod = terms.score_mod
    if mod is not None:
        inner = mod

        def mod(scores: Array, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            return inner(scores, batch, head, q_idx, kv_idx + kv_start)

    new_terms = dataclasses.replace(
        terms,
        kv_lengths=local,
        kv_length_values=None,  # the part's lengths are shifted: read by nobody
        score_mod=mod,
        mask_mod=_shifted_mask_mod(terms.mask_mod, 0, kv_start),
        block_host=None,  # a traced start: its blocks are read by nobody on the host
    )
    return dataclasses.replace(
        call, plan=dataclasses.replace(plan, has_lengths=True), terms=new_terms
    )


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
    q_start, kv_start : int (or integer arrays of shape () with lengths)
        Position of the part's first query and first key in the whole sequence.
        Traced starts (a block of a traced loop) need lengths in the call: its
        alignment then comes from values, never from static block visibility.
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
    q_lengths, kv_lengths = terms.q_lengths, terms.kv_lengths
    if plan.has_lengths:  # the part's valid lengths: i' = i + kv_len - q_len, shifted
        q_lengths = None if q_lengths is None else q_lengths - q_start
        kv_lengths = None if kv_lengths is None else kv_lengths - kv_start
    align = plan.align or Alignment()
    align = Alignment(  # a part of a part (a tile of a Dask chunk) adds up the starts
        q_start=align.q_start + q_start,
        kv_start=align.kv_start + kv_start,
        q_total=q_total if align.q_total is None else align.q_total,
        kv_total=kv_total if align.kv_total is None else align.kv_total,
    )
    new_plan = dataclasses.replace(plan, align=align)
    new_terms = dataclasses.replace(
        terms,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        kv_length_values=None,  # those of the whole call, not of the part
        mask_mod=_shifted_mask_mod(terms.mask_mod, q_start, kv_start),
    )
    return dataclasses.replace(call, plan=new_plan, terms=new_terms)


def cut_call(
    call: AttentionCall, q_range: tuple[int, int], k_range: tuple[int, int]
) -> AttentionCall:
    """Return the part of `call` with queries `q_range` and keys `k_range`, placed there.

    Every array field is sliced along the axes its declaration names (size-one axes
    stay broadcast); causal, window, lengths, ALiBi, `score_mod` and `mask_mod` keep the
    positions of the whole call (:func:`place_block`).
    """
    (qs, qe), (ks, ke) = q_range, k_range
    plan = call.plan
    part = call.sliced({"lq": q_range, "lk": k_range}, q_len=qe - qs, kv_len=ke - ks)
    return place_block(part, q_start=qs, kv_start=ks, q_total=plan.q_len, kv_total=plan.kv_len)


def _shifted_mask_mod(mask_mod: Any, q_start: int | Array, kv_start: int | Array) -> Any:
    """`mask_mod` seeing the absolute positions of a part placed at these starts."""
    if mask_mod is None or (_is_zero(q_start) and _is_zero(kv_start)):
        return mask_mod

    def shifted(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        return mask_mod(batch, head, q_idx + q_start, kv_idx + kv_start)

    return shifted


def _is_zero(x: int | Array) -> bool:
    return isinstance(x, int) and x == 0


def placed_part(
    call: AttentionCall,
    *,
    kv_start: int | Array,
    kv_total: int,
    q_start: int | None = None,
    q_total: int | None = None,
) -> AttentionCall:
    """`call` in the compute dtype, placed where its part sits (see :func:`partial_attention`)."""
    call = call.in_compute_dtype()  # the tiled kernel computes in float32 (or float64)
    if q_start is None:
        return shift_keys(call, kv_start, kv_total)
    total = call.plan.q_len if q_total is None else q_total
    return place_block(
        call, q_start=q_start, kv_start=int(kv_start), q_total=total, kv_total=kv_total
    )


def partial_attention(
    call: AttentionCall,
    path: Path,
    *,
    kv_start: int | Array,
    kv_total: int,
    q_start: int | None = None,
    q_total: int | None = None,
) -> tuple[Array, Array]:
    """Attention of every query of `call` over its keys, placed at `kv_start` of `kv_total`.

    Parameters
    ----------
    call : AttentionCall
        Prepared from the query, this part's keys and values (B..., Hkv,
        Lk_part, D), and the key axis of `mask`/`bias` cut to the part.
    path : Path
        How the part is computed: :class:`Tiled` (its tiles), :class:`Dense` (one
        block), :class:`DaskGrid` (the tiled kernel over the chunks of Dask arrays)
        or :class:`Empty`; the caller's policy decided it.
    kv_start : int or integer array of shape ()
        Position of this part's first key in the whole sequence (may be traced,
        e.g. ``lax.axis_index(...) * Lk_part``).
    kv_total : int
        Number of keys in the whole sequence.
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
        key in it (the sink logit with sinks).
    """
    call = placed_part(
        call, kv_start=kv_start, kv_total=kv_total, q_start=q_start, q_total=q_total
    )
    plan = call.plan
    match path:
        case Empty():
            return call.empty_result()
        case Tiled(block_q=block_q, block_k=block_k, fold=fold, walk="buffered"):
            return buffered_forward(call, block_q, block_k, fold=fold)  # NumPy (Dask chunks)
        case Tiled(block_q=block_q, block_k=block_k, fold=fold):
            return tiled_forward(call, block_q, block_k, fold=fold)
        case Dense(fold=fold):  # one block, with its lse
            return tiled_forward(call, plan.q_len, plan.kv_len, fold=fold)
        case DaskGrid(q_chunks=q_chunks, k_chunks=k_chunks, inner=inner):
            # a part of Dask arrays: the tiled kernel over its chunks, lazily
            return tiled_forward(call, q_chunks, k_chunks, fold=inner.fold)
    msg = f"a part is computed by a Tiled, Dense, DaskGrid or Empty path, not {path!r}"
    raise TypeError(msg)

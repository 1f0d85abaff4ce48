"""The plan of a paged step and the loops over its key chunks (``_lib/_paged.py`` has the steps).

A step's plan (:func:`plan_walk`) is built once from its metadata and serves every
layer's call (:func:`paged_attention`). Two forms of one walk:

- metadata with values on the host (NumPy, torch, array-api-strict): the tiles that
  hold rows, longest walk first, and a Python loop over the chunks some tile may see;
  each chunk folds only the tiles that may see it (a contiguous range, as the tiles
  are sorted), so a decode batch of mixed lengths gathers each request's pages once
  and skips the chunks past it. The plan holds each fold's range and the chunk's page
  indices. Requests with many new rows are left to the engine
  (``_route.paged_by_engine``; ``serving`` calls it over their gathered keys): no
  tile holds their rows.
- traced metadata (``jax.jit``; an eager JAX call too, which runs as one compiled
  program, ``_route.runs_compiled``): as many tiles as the shapes allow, and a
  ``lax.fori_loop`` over every chunk of the page table whose body is a ``lax.cond``
  that skips, by value, a chunk no tile may see. Differentiable (``jax.grad``).
  Metadata that the eager checks would refuse (a page outside the pool, a length
  that does not fit) makes its request's rows NaN (:func:`~._paged.faulty_rows`).

Gradients elsewhere are the library's autodiff through the walk (torch autograd).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._lib import _paged
from .._lib._blocks import FULL
from .._lib._compat import (
    default_integer_dtype,
    device,
    has_concrete_values,
    numpy_namespace,
    on_device,
    to_host,
)
from .._lib._masks import arange, take_at
from .._lib._paged import PADDING, WALK, EngineRequest, PagedProblem, WalkPlan
from .._lib._quant import as_rows, permuted
from .._lib._route import INDEX_CHUNK_KEYS, index_rows, library, paged_by_engine, tile_rows
from .._lib._scores import distance, modified_scores
from .._lib._tiled import RowState
from .._lib._validation import per_head

if TYPE_CHECKING:
    from .._lib._call import AttentionCall

__all__ = [
    "index_attention",
    "traced_faults",
    "invariant_attention",
    "paged_attention",
    "plan_walk",
    "problem",
]


def problem(
    page_table: Any,
    *,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    batch_invariant: bool,
) -> PagedProblem:
    """Return the geometry of a paged call (its layers' own fields left to the call).

    The tiles' rows (``_route.tile_rows``) and the library's row of the router's table
    (its chunks, gathers and sums) decide the rest.
    """
    row = library(page_table)
    left, right = (None, None) if window is None else window
    return PagedProblem(
        num_tokens=num_tokens,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=page_table.shape[1],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        rows=tile_rows(
            num_tokens, page_table.shape[0], num_q_heads // num_kv_heads, batch_invariant
        ),
        aligned=batch_invariant,
        is_causal=is_causal,
        left=left,
        right=right,
        device=device(page_table),
        head_major=row.gathers_strided,
        sums_by_product=row.sums_by_program,
        keys_per_chunk=row.chunk_keys,
    )


def plan_walk(
    xp: Any,
    p: PagedProblem,
    page_table: Any,
    kv_lengths: Any,
    q_starts: Any,
    q_positions: Any = None,
) -> WalkPlan:
    """Return the plan of a step: its tiles, and on the host the folds of its walk.

    `q_positions` (T,) the packed rows' positions, or None: each request's last ones
    (:func:`~._paged.bottom_right`). Given, every request is walked.
    """
    num_requests = page_table.shape[0]
    if p.num_tokens == 0 or num_requests == 0:  # no row, or every row padding
        return WalkPlan(p, None)
    engine: tuple[EngineRequest, ...] = ()
    merge: tuple[tuple[int, int, int], ...] = ()
    metadata = (
        (q_starts, kv_lengths) if q_positions is None else (q_starts, kv_lengths, q_positions)
    )
    t = p.num_tokens
    if all(has_concrete_values(x) for x in metadata):
        starts, lengths = to_host(q_starts), to_host(kv_lengths)
        walked: Any = True
        if q_positions is None:
            p, engine, merge, walked = _leave_to_engine(xp, p, page_table, starts, lengths)
            host = numpy_namespace()
            host_positions = _paged.bottom_right(host, starts, lengths, t, None)
            positions = xp.asarray(host_positions, **on_device(p.device))
        else:
            host_positions, positions = to_host(q_positions), q_positions
        tiles, walk = _paged.host_tiles(xp, p, starts, lengths, host_positions, walked)
        runs = tuple(
            (
                a,
                b,
                state,
                past,
                _paged.chunk_index(xp, p, j, tiles.request[a:b], page_table, kv_lengths),
            )
            for j, a, b, state, past in walk.runs(p)
        )
    else:
        positions = q_positions
        if positions is None:
            positions = _paged.bottom_right(xp, q_starts, kv_lengths, t, p.device)
        tiles = _paged.bounded_tiles(xp, p, q_starts, kv_lengths, positions, num_requests)
        runs = None
    faulty = traced_faults(xp, p, page_table, kv_lengths, q_starts, q_positions)
    slots, held = _paged.query_slots(xp, p, tiles)
    pos = _paged.row_positions(xp, p, slots, positions)
    return WalkPlan(p, tiles, slots, held, pos, runs, faulty, engine, merge)


def traced_faults(
    xp: Any, p: PagedProblem, page_table: Any, kv_lengths: Any, q_starts: Any, q_positions: Any
) -> Any | None:
    """Return the rows whose metadata is wrong (T,), where it has no values; else None.

    No error can be raised on traced metadata (a traced page table included): the rows
    of requests whose metadata is wrong come out NaN (the pages they name are read
    clipped, never shown to others) (:func:`~._paged.faulty_rows`).
    """
    metadata = (page_table, kv_lengths, q_starts) + (() if q_positions is None else (q_positions,))
    if all(has_concrete_values(x) for x in metadata):
        return None
    return _paged.faulty_rows(
        xp,
        q_starts,
        kv_lengths,
        page_table,
        p.num_tokens,
        p.num_pages,
        p.page_size,
        p.device,
        q_positions,
    )


def _leave_to_engine(
    xp: Any, p: PagedProblem, page_table: Any, starts: Any, lengths: Any
) -> tuple[PagedProblem, tuple[EngineRequest, ...], tuple[tuple[int, int, int], ...], Any]:
    """Return the requests the engine computes (``_route.paged_by_engine``), and the walk's rest.

    Returns the problem with the tiles' rows of the walked requests alone
    (``_route.tile_rows``), the engine's requests, the runs of packed rows that make the
    result (:attr:`WalkPlan.merge`; none without an engine request), and which requests
    the walk computes (R,).
    """
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    counts = np.diff(starts)
    row = library(page_table)
    pairs = zip(counts.tolist(), lengths.tolist(), strict=True)
    by_engine = np.array([paged_by_engine(row, n, m, p.aligned) for n, m in pairs], dtype=bool)
    if not by_engine.any():
        return p, (), (), True
    walked = ~by_engine
    any_walked = bool(np.any(walked & (counts > 0)))
    rows = tile_rows(int(counts[walked].sum()), int(walked.sum()), p.groups, p.aligned)
    engine: list[EngineRequest] = []
    runs: list[tuple[int, int, int]] = []

    def run(source: int, a: int, b: int) -> None:
        if runs and source == WALK and runs[-1][0] == WALK and runs[-1][2] == a:
            runs[-1] = (WALK, runs[-1][1], b)  # consecutive rows of the walk: one slice
        elif b > a:
            runs.append((source, a, b))

    for r, (a, b) in enumerate(itertools.pairwise(starts.tolist())):
        if not by_engine[r]:
            run(WALK, a, b)
            continue
        n = int(lengths[r])
        run(len(engine), 0, b - a)
        pages = xp.asarray(page_table[r, : -(-n // p.page_size)], copy=True)  # as read now
        engine.append(EngineRequest(r, a, b, n, pages))
    run(WALK if any_walked else PADDING, int(starts[-1]), p.num_tokens)
    return dataclasses.replace(p, rows=rows), tuple(engine), tuple(runs), walked


def paged_attention(
    xp: Any,
    plan: WalkPlan,
    query: Any,
    pools: tuple[Any, Any, Any, Any],
    sinks: Any | None,
    alibi_slopes: Any | None,
    dtype: Any,
    **layer: Any,
) -> tuple[Any, Any, Any]:
    """Return out (T, Hq, Dv), lse (T, Hq) and max logit (T, Hq) of a layer's call.

    `layer` holds the call's own fields of :class:`~._paged.PagedProblem`
    (``value_dim``, ``scale``, ``softcap``, ``compute_dtype``).
    """
    p = dataclasses.replace(plan.problem, **layer)
    key_pages, value_pages, page_table, kv_lengths = pools
    if p.head_major:  # (P, Hkv, page_size, D) views: a gathered page is a head's keys
        key_pages = permuted(xp, key_pages, (0, 2, 1, 3))
        if value_pages is not None:
            value_pages = permuted(xp, value_pages, (0, 2, 1, 3))
    alibi = None
    if alibi_slopes is not None:
        alibi = _paged.head_rows(xp, p, xp.astype(alibi_slopes, p.compute_dtype))
    tiles = plan.tiles
    if tiles is None:  # no row, or every row padding: zeros, lse and max -inf
        kw = on_device(p.device)
        lse = xp.full((p.num_tokens, p.num_q_heads), -xp.inf, dtype=p.compute_dtype, **kw)
        return xp.zeros((p.num_tokens, p.num_q_heads, p.value_dim), dtype=dtype, **kw), lse, lse
    q = _paged.tile_queries(xp, p, query, plan.slots, plan.held)
    n = tiles.request.shape[0]
    state = _paged.start(xp, p, n)
    kv = (key_pages, value_pages)
    if plan.runs is not None:
        for a, b, seen, past, index in plan.runs:
            chunk = (index, kv, alibi, tiles.request)
            state = _fold(xp, p, state, a, b, n, q, plan.pos, chunk, (seen, past))
    else:

        def fold(j: Any, s: RowState) -> RowState:
            index = _paged.chunk_index(xp, p, j, tiles.request, page_table, kv_lengths)
            return _paged.step(xp, p, s, index, q, plan.pos, kv, alibi, tiles.request)

        if library(query).walk == "traced":
            state = _traced_walk(p, state, tiles, fold)
        else:  # traced by torch: every chunk, every tile
            for j in range(p.num_chunks):
                state = fold(j, state)
    return _paged.finish(xp, p, state, tiles, sinks, dtype, plan.faulty)


def index_attention(
    xp: Any,
    p: PagedProblem,
    query: Any,
    pools: tuple[Any, Any, Any, Any],
    metadata: tuple[Any, Any, Any],
    listing: tuple[Any, bool],
    sinks: Any | None,
    alibi_slopes: Any | None,
    dtype: Any,
    faulty: Any | None,
) -> tuple[Any, Any, Any]:
    """Return out (T, Hq, Dv), lse and max logit (T, Hq) of rows that list their keys.

    `p` the call's problem, whatever its tiles; `metadata` the query starts, the rows'
    positions (T,) and their requests' lengths; `listing` ``(kv_indices, window_union)``
    (:func:`~._paged.listed_keys`). Each row is a tile of its own; rows are folded
    ``_route.index_rows`` at a time, each over every chunk of its listed keys (a Python
    loop; a traced ``fori_loop`` on JAX), and normalised.
    """
    q_starts, positions, kv_lengths = metadata
    key_pages, value_pages, page_table, _ = pools
    p = dataclasses.replace(p, rows=1, aligned=False, head_major=False)
    tiles = _paged.index_tiles(xp, p, q_starts)
    idx, kept = _paged.listed_keys(
        xp, p, listing[0], tiles, positions, kv_lengths, window_union=listing[1]
    )
    slots, held = _paged.query_slots(xp, p, tiles)
    q = _paged.tile_queries(xp, p, query, slots, held)
    pos = _paged.row_positions(xp, p, slots, positions)
    alibi = None
    if alibi_slopes is not None:
        alibi = _paged.head_rows(xp, p, xp.astype(alibi_slopes, p.compute_dtype))
    # the pools as (P·page_size·Hkv, D): a key's row is one take
    value_rows = None if value_pages is None else as_rows(xp, value_pages)
    kv = (as_rows(xp, key_pages), value_rows, page_table)
    traced = library(query).walk == "traced"
    parts = []
    t = p.num_tokens
    block = index_rows(t, p.num_kv_heads)
    for a in range(0, t, block):
        rows = slice(a, min(a + block, t))
        listed = (idx[rows, ...], kept[rows, ...])
        fixed = (q[rows, ...], pos[rows, ...], kv, alibi, tiles.request[rows])
        state = _index_walk(xp, p, listed, fixed, traced=traced)
        out, lse, top = _paged.finish_rows(xp, p, state, sinks, dtype)
        # padding rows: zeros (whatever the slots they gathered hold), lse -inf (no sink)
        valid = tiles.valid[rows, None]
        parts.append((xp.where(valid[..., None], out, 0.0), xp.where(valid, lse, -xp.inf), top))
    out, lse, top = (
        xp.concat(x, axis=0) if len(x) > 1 else x[0] for x in zip(*parts, strict=True)
    )
    if faulty is not None:
        out = xp.where(faulty[:, None, None], xp.nan, out)
        lse, top = (xp.where(faulty[:, None], xp.nan, x) for x in (lse, top))
    return out, lse, top


def _index_walk(
    xp: Any,
    p: PagedProblem,
    listed: tuple[Any, Any],
    fixed: tuple[Any, ...],
    *,
    traced: bool,
) -> RowState:
    """Fold every chunk of some rows' listed keys into their state, from nothing seen.

    `listed` the rows' positions and kept flags (N, Hkv, W) (:func:`~._paged.listed_keys`);
    `fixed` the rows' queries, positions, the pools, ALiBi rows and requests
    (:func:`~._paged.index_step`). A Python loop over the chunks of
    ``_route.INDEX_CHUNK_KEYS``, or (`traced`, JAX) a ``fori_loop`` carrying
    ``(m, l_sum, acc)``.
    """
    state = _paged.start(xp, p, fixed[0].shape[0])
    c = INDEX_CHUNK_KEYS
    chunks = max(1, -(-listed[0].shape[-1] // c))
    if not traced:
        for j in range(chunks):
            at = _paged.listed_chunk(xp, listed, j, c)
            state = _paged.index_step(xp, p, state, at, *fixed)
        return state
    import jax

    def loop(j: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        at = _paged.listed_chunk(xp, listed, j, c)
        return tuple(_paged.index_step(xp, p, RowState(*carry), at, *fixed)[:3])

    return RowState(*jax.lax.fori_loop(0, chunks, loop, tuple(state[:3])))


def _fold(
    xp: Any,
    p: PagedProblem,
    state: RowState,
    a: int,
    b: int,
    n: int,
    q: Any,
    pos: Any,
    chunk: tuple[_paged.ChunkIndex, tuple[Any, Any], Any | None, Any],
    seen: tuple[int, bool],
) -> RowState:
    """Fold a chunk into tiles ``a:b`` of `n`, which see it as `seen`; the others stay.

    `chunk`: its index (for tiles ``a:b``), the pools, the ALiBi rows and the tiles'
    requests (all `n`). `seen`: the tiles' block state (``_blocks.FULL`` or ``PARTIAL``)
    and whether the chunk holds slots past their requests' lengths
    (:meth:`~._paged.HostWalk.states`).
    """
    index, pools, alibi, request = chunk
    flags = {"sanitize": seen[1], "masked": seen[0] != FULL}
    if (a, b) == (0, n):
        return _paged.step(xp, p, state, index, q, pos, pools, alibi, request, **flags)
    part = RowState(*(x[a:b, ...] for x in state[:3]))
    rows = (q[a:b, ...], pos[a:b, ...])
    part = _paged.step(xp, p, part, index, *rows, pools, alibi, request[a:b], **flags)
    pairs = zip(state[:3], part[:3], strict=True)
    return RowState(*(xp.concat([x[:a, ...], y, x[b:, ...]], axis=0) for x, y in pairs))


def _traced_walk(p: PagedProblem, state: RowState, tiles: _paged.Tiles, fold: Any) -> RowState:
    """``fori_loop`` over every chunk; a chunk no tile may see is skipped by value.

    The loop carries ``(m, l_sum, acc)``: a row state's static fact stays out of it.
    """
    import jax
    import jax.numpy as jnp

    lo, hi = tiles.first_chunk, tiles.last_chunk

    def body(j: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        seen = jnp.any((lo <= j) & (j <= hi))
        return jax.lax.cond(seen, lambda c: tuple(fold(j, RowState(*c))[:3]), lambda c: c, carry)

    return RowState(*jax.lax.fori_loop(0, p.num_chunks, body, tuple(state[:3])))


def invariant_attention(call: AttentionCall) -> tuple[Any, Any]:
    """Compute a whole call with ``batch_invariant``: the paged walk, a sequence a request.

    Each of the call's ``B`` sequences is a request whose keys are a pool of pages of
    one slot and whose rows sit where the call aligns them (bottom-right, by the
    lengths), so a row gets the bits ``ragged_paged_attention(batch_invariant=True)``
    gives its sequence, whatever else the batch holds. The mask, bias, segment ids,
    query lengths and the caller's rules become the walk's rules, in the call's own
    indices. Returns out (..., Hq, Lq, Dv) in the compute dtype and the row
    statistics (..., Hq, Lq, 1), or 2 columns with the row max.
    """
    xp, plan, terms = call.xp, call.plan, call.terms
    b, hq, hkv, lq, lk = (
        math.prod(plan.batch),
        plan.num_q_heads,
        plan.num_kv_heads,
        plan.q_len,
        plan.kv_len,
    )
    dv = plan.value_dim

    def packed(x: Any, heads: int, length: int) -> Any:  # (B..., H, L, D) -> (B·L, H, D)
        x = xp.broadcast_to(x, (*plan.batch, heads, length, x.shape[-1]))
        x = xp.permute_dims(xp.reshape(x, (b, heads, length, x.shape[-1])), (0, 2, 1, 3))
        return xp.reshape(x, (b * length, heads, x.shape[-1]))

    query = packed(call.query, hq, lq)
    pools = [xp.reshape(packed(x, hkv, lk), (b * lk, 1, hkv, -1)) for x in (call.key, call.value)]
    ints = {"dtype": default_integer_dtype(xp), **on_device(plan.device)}
    table = (
        xp.reshape(arange(xp, 0, b, plan.device), (b, 1)) * lk
        + arange(xp, 0, lk, plan.device)[None, :]
    )
    table = xp.astype(table, ints["dtype"])
    lengths = (
        xp.full((b,), lk, **ints)
        if terms.kv_lengths is None
        else _per_sequence(xp, terms.kv_lengths, plan.batch, ints)
    )
    rows = (
        None if terms.q_lengths is None else _per_sequence(xp, terms.q_lengths, plan.batch, ints)
    )
    offset = lengths - (lq if rows is None else rows)  # a row's position: its index + offset
    positions = xp.reshape(
        offset[:, None] + xp.astype(arange(xp, 0, lq, plan.device), offset.dtype)[None, :], (-1,)
    )
    starts = xp.astype(arange(xp, 0, b + 1, plan.device), offset.dtype) * lq
    p = problem(
        table,
        num_tokens=b * lq,
        num_pages=b * lk,
        page_size=1,
        num_q_heads=hq,
        num_kv_heads=hkv,
        is_causal=plan.is_causal,
        window=plan.window,
        batch_invariant=True,
    )
    walk = plan_walk(xp, p, table, lengths, starts, positions)
    walk = dataclasses.replace(walk, faulty=None)  # metadata of the call's own shapes
    mask_mod, score_mod = _rules(call, offset, rows)
    out, lse, top = paged_attention(
        xp,
        walk,
        query,
        (pools[0], pools[1], table, lengths),
        _per_head(xp, terms.sinks, hq),
        _per_head(xp, terms.alibi_slopes, hq),
        plan.compute_dtype,
        value_dim=dv,
        scale=plan.scale,
        softcap=plan.softcap,
        compute_dtype=plan.compute_dtype,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    out = xp.reshape(
        xp.permute_dims(xp.reshape(out, (b, lq, hq, dv)), (0, 2, 1, 3)), (*plan.batch, hq, lq, dv)
    )
    stats = [lse, top] if plan.row_max else [lse]
    stats = [
        xp.reshape(
            xp.permute_dims(xp.reshape(x, (b, lq, hq)), (0, 2, 1)), (*plan.batch, hq, lq, 1)
        )
        for x in stats
    ]
    return out, stats[0] if len(stats) == 1 else xp.concat(stats, axis=-1)


def _per_sequence(xp: Any, x: Any, batch: tuple[int, ...], ints: dict[str, Any]) -> Any:
    """Lengths (*batch|1, 1, 1, 1) as one per sequence, (B,), in the index dtype."""
    x = xp.broadcast_to(x, (*batch, 1, 1, 1))
    return xp.astype(xp.reshape(x, (math.prod(batch),)), ints["dtype"])


def _per_head(xp: Any, x: Any, hq: int) -> Any:
    """Return a term (1..., Hq|1, 1, 1) of one value per head as (Hq,); None stays None."""
    if x is None or not per_head(x):  # slopes per sequence: the walk's rules add them
        return None
    return xp.broadcast_to(xp.reshape(x, (x.shape[-3],)), (hq,))


def _gathered(xp: Any, term: Any, batch: tuple[int, ...], index: tuple[Any, ...]) -> Any:
    """Read a term broadcastable to (*batch, Hq, Lq, Lk) at ``(sequence, head, q, kv)``.

    The indices broadcast together; a size-one axis of the term is read at 0.
    """
    term = xp.reshape(term, (1,) * max(0, 3 - term.ndim) + tuple(term.shape))
    lead = term.shape[:-3]
    if math.prod(lead) > 1:
        term = xp.broadcast_to(term, (*batch, *term.shape[-3:]))
    dims = (math.prod(term.shape[:-3]), *term.shape[-3:])
    flat = 0
    for i, size in enumerate(dims):
        if size > 1:
            flat = flat + index[i] * math.prod(dims[i + 1 :])
    if isinstance(flat, int):  # one value for every index
        return xp.reshape(term, ())
    return take_at(xp, xp.reshape(term, (-1,)), flat)


def _rules(call: AttentionCall, offset: Any, rows: Any | None) -> tuple[Any, Any]:
    """Return the call's terms as the walk's rules ``(request, head, q_pos, kv_pos)``.

    A row at position ``q_pos`` of sequence ``r`` is its row ``q_pos - offset[r]``; the
    rules see the call's own indices (the engine's, as its ``mask_mod`` and ``score_mod``
    do), clipped into the call's shapes (the walk also scores slots that hold no row
    and keys past a length, which it then drops).
    """
    xp, plan, terms, bias = call.xp, call.plan, call.terms, call.bias
    segments = (terms.q_segments, terms.kv_segments)
    # the caller's rule, not its check against the engine's blocks (the walk checks it)
    user_mask = getattr(terms.mask_mod, "rule", terms.mask_mod)
    slopes = None if per_head(terms.alibi_slopes) else terms.alibi_slopes
    hides = any(x is not None for x in (terms.mask, rows, segments[0], user_mask))
    scores = any(x is not None for x in (bias, terms.score_mod, slopes))

    def index(r: Any, h: Any, q_pos: Any, kv_pos: Any) -> tuple[Any, ...]:
        q_idx = xp.clip(q_pos - take_at(xp, offset, r), 0, plan.q_len - 1)
        return r, h, q_idx, xp.clip(kv_pos, 0, plan.kv_len - 1)

    def masked(*at: Any) -> Any:
        i = index(*at)
        parts = []
        if terms.mask is not None:
            parts.append(_gathered(xp, terms.mask, plan.batch, i))
        if rows is not None:  # rows past a sequence's q_lengths see nothing
            parts.append(i[2] < take_at(xp, rows, at[0]))
        if segments[0] is not None:
            ids = [_gathered(xp, x, plan.batch, i) for x in segments]
            parts.append(ids[0] == ids[1])
        if user_mask is not None:
            parts.append(user_mask(*i))
        allowed = parts[0]
        for part in parts[1:]:
            allowed = xp.logical_and(allowed, part)
        return allowed

    def scored(s: Any, *at: Any) -> Any:
        i = index(*at)
        if terms.score_mod is not None:
            s = modified_scores(xp, terms.score_mod, s, i)
        if bias is not None:
            s = s + xp.astype(_gathered(xp, bias, plan.batch, i), s.dtype)
        if slopes is not None:  # ALiBi slopes per sequence, at the rows' positions
            slope = xp.astype(_gathered(xp, slopes, plan.batch, i), s.dtype)
            s = s - slope * distance(xp, at[2], at[3], s.dtype)
        return s

    return (masked if hides else None), (scored if scores else None)

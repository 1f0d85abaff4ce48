"""The loops over the key chunks of a paged call (``_lib/_paged.py`` has the steps).

Two forms of one walk:

- metadata with values on the host (NumPy, torch, array-api-strict, JAX outside
  ``jit``): the tiles that hold rows, longest walk first, and a Python loop over the
  chunks some tile may see; each chunk folds only the tiles that may see it (a
  contiguous range, as the tiles are sorted), so a decode batch of mixed lengths
  gathers each request's pages once and skips the chunks past it.
- traced metadata (``jax.jit``): as many tiles as the shapes allow, and a
  ``lax.fori_loop`` over every chunk of the page table whose body is a ``lax.cond``
  that skips, by value, a chunk no tile may see. Differentiable (``jax.grad``).
  Metadata that the eager checks would refuse (a page outside the pool, a length
  that does not fit) makes its request's rows NaN (:func:`~._paged.faulty_rows`).

Gradients elsewhere are the library's autodiff through the walk (torch autograd).
"""

from __future__ import annotations

import itertools
from typing import Any

from .._lib import _paged
from .._lib._compat import has_concrete_values, is_traced, library_name, to_host
from .._lib._paged import PagedProblem, PagedState

__all__ = ["paged_attention"]


def paged_attention(
    xp: Any,
    p: PagedProblem,
    query: Any,
    pools: tuple[Any, Any, Any, Any],
    q_starts: Any,
    num_requests: int,
    sinks: Any | None,
    alibi_slopes: Any | None,
    dtype: Any,
) -> tuple[Any, Any]:
    """Return (out (T, Hq, Dv), lse (T, Hq)) of a paged call; see ``ragged_paged_attention``."""
    key_pages, value_pages, page_table, kv_lengths = pools
    if p.head_major:  # (P, Hkv, page_size, D) views: a gathered page is a head's keys
        pools = (
            xp.permute_dims(key_pages, (0, 2, 1, 3)),
            xp.permute_dims(value_pages, (0, 2, 1, 3)),
            page_table,
            kv_lengths,
        )
    alibi = None
    if alibi_slopes is not None:
        alibi = _paged.head_rows(xp, p, xp.astype(alibi_slopes, p.compute_dtype))
    if has_concrete_values(q_starts) and has_concrete_values(kv_lengths):
        tiles, walk = _paged.host_tiles(xp, p, to_host(q_starts), to_host(kv_lengths))
        q, offs = _paged.tile_queries(xp, p, query, tiles)
        pos = _paged.row_positions(xp, p, tiles, q_starts, kv_lengths, offs)
        state = _host_walk(xp, p, q, pos, tiles, pools, alibi, walk)
        return _paged.finish(xp, p, state, tiles, sinks, dtype)
    tiles = _paged.bounded_tiles(xp, p, q_starts, kv_lengths, num_requests)
    q, offs = _paged.tile_queries(xp, p, query, tiles)
    pos = _paged.row_positions(xp, p, tiles, q_starts, kv_lengths, offs)
    n = tiles.request.shape[0]
    state = _paged.start(xp, p, n)

    def fold(j: Any, s: PagedState) -> PagedState:
        return _paged.step(xp, p, s, j, q, pos, tiles.request, pools, alibi)

    if library_name(query) == "jax" and is_traced(q_starts):
        state = _jax_walk(p, state, tiles, fold)
    else:  # traced by torch: every chunk, every tile
        for j in range(p.num_chunks):
            state = fold(j, state)
    # no error can be raised on traced metadata: the rows of requests whose metadata is
    # wrong come out NaN (the pages they name were read clipped, never shown to others)
    faulty = _paged.faulty_rows(
        xp, q_starts, kv_lengths, page_table, p.num_tokens, p.num_pages, p.page_size, p.device
    )
    return _paged.finish(xp, p, state, tiles, sinks, dtype, faulty)


def _host_walk(
    xp: Any,
    p: PagedProblem,
    q: Any,
    pos: Any,
    tiles: _paged.Tiles,
    pools: tuple[Any, Any, Any, Any],
    alibi: Any | None,
    walk: _paged.HostWalk,
) -> PagedState:
    """Fold every chunk some tile may see, each into the tiles that may see it.

    The tiles that may see a chunk are a range (sorted by last chunk); the range is cut
    where the tiles' kinds change (:meth:`~._paged.HostWalk.kinds`: seen whole, in part,
    past a length), so tiles that see a whole chunk build no mask and zero nothing:
    most of a prefill's chunks. More than three runs of kinds fold as one, the most
    careful kind.
    """
    import numpy as np

    lo, hi = walk.first_chunk, walk.last_chunk
    n = len(lo)
    state = _paged.start(xp, p, n)
    if n == 0 or int(hi.max()) < 0:
        return state
    for j in range(max(int(lo.min()), 0), min(int(hi.max()), p.num_chunks - 1) + 1):
        active = np.nonzero((lo <= j) & (j <= hi))[0]
        if len(active) == 0:
            continue
        a, b = int(active[0]), int(active[-1]) + 1
        kinds = walk.kinds(p, j, a, b)
        cuts = [0, *(np.nonzero(np.diff(kinds))[0] + 1).tolist(), b - a]
        runs = [(a + x, a + y, int(kinds[x])) for x, y in itertools.pairwise(cuts)]
        if len(runs) > 3:
            runs = [(a, b, int(kinds.max()))]
        for lo_t, hi_t, kind in runs:
            state = _fold(xp, p, state, j, lo_t, hi_t, n, q, pos, tiles, pools, alibi, kind)
    return state


def _fold(
    xp: Any,
    p: PagedProblem,
    state: PagedState,
    j: int,
    a: int,
    b: int,
    n: int,
    q: Any,
    pos: Any,
    tiles: _paged.Tiles,
    pools: tuple[Any, Any, Any, Any],
    alibi: Any | None,
    kind: int,
) -> PagedState:
    """Fold chunk `j` into tiles ``a:b`` of `n`, which see it as `kind`; the others stay."""
    flags = {"sanitize": kind == 2, "masked": kind > 0}
    if (a, b) == (0, n):
        return _paged.step(xp, p, state, j, q, pos, tiles.request, pools, alibi, **flags)
    part = PagedState(*(x[a:b, ...] for x in state))
    part = _paged.step(
        xp,
        p,
        part,
        j,
        q[a:b, ...],
        pos[a:b, ...],
        tiles.request[a:b],
        pools,
        alibi,
        **flags,
    )
    return PagedState(
        *(xp.concat([x[:a, ...], y, x[b:, ...]], axis=0) for x, y in zip(state, part, strict=True))
    )


def _jax_walk(p: PagedProblem, state: PagedState, tiles: _paged.Tiles, fold: Any) -> PagedState:
    """``fori_loop`` over every chunk; a chunk no tile may see is skipped by value."""
    import jax
    import jax.numpy as jnp

    lo, hi = tiles.first_chunk, tiles.last_chunk

    def body(j: Any, s: PagedState) -> PagedState:
        seen = jnp.any((lo <= j) & (j <= hi))
        return jax.lax.cond(seen, lambda c: fold(j, c), lambda c: c, s)

    return PagedState(*jax.lax.fori_loop(0, p.num_chunks, body, state))

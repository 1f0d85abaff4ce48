"""Attention of packed query rows over a paged key/value pool: the plan and the walk.

The rows of request ``r`` are ``q_starts[r] : q_starts[r+1]`` of the packed queries;
its keys live in the pool's pages ``page_table[r, :]``. The walk cuts each request's
rows into *tiles* of ``rows`` rows (a tile never holds two requests), and visits the
keys in *chunks* of ``chunk_pages`` logical pages, the same chunks for every call:
chunk ``j`` holds the key positions ``[j·bk, (j+1)·bk)`` of every request. At each
chunk the pages of every tile are gathered (``take`` over the pool, ``O(tiles · bk)``
memory, never a request's whole cache), scored against the tile's rows and folded
into the tile's online softmax. Keys past a request's length are zeroed before use,
so whatever a pool slot holds (NaN included) never reaches a result or a gradient, and
a tile's slots that hold no row of its request are zero queries, so a query row
(NaN included) reaches only its own request's results and gradients.

Why results do not depend on the batch (``batch_invariant``): a row's scores and
``P @ V`` are matrix products whose shapes are a tile's (``Hkv`` batches of ``G · rows``
by ``bk``), the same in every call with ``rows`` fixed per model (``_route.tile_rows``),
and the row's place in them is fixed too: its key chunks start at multiples of ``bk``,
and its tile at a multiple of ``rows`` among its request's positions
(``PagedProblem.aligned``), so a row at position ``p`` is always row ``p % rows`` of its
products. Same shapes are not enough: a BLAS kernel computes a product's rows in
panels, and a row's bits may depend on its panel (OpenBLAS's Haswell ``sgemm``, the one
it picks on AVX2 CPUs, rounds rows 0-5, 6-11 and 12-15 of a (16, 8) @ (8, 256) product
three ways). The other rows of a tile are zeros (never another request's rows), and a
row of a product does not depend on the values of the others. A chunk that shows a
row no key leaves its state exactly as it was (``max(m, -inf) = m``, ``exp(0) = 1``,
``+ 0``), so visiting or skipping it, which depends on the other requests, changes no
bit: a row's bits depend only on its own keys and position. Where a compiler sums a
fused reduction in an order that depends on the program (XLA), the sums are products
with ones too (``PagedProblem.sums_by_product``).

The walk's arithmetic is array-API functions only; the host plan
(:func:`host_tiles`, :class:`HostWalk`) is NumPy on small integer metadata, and the
drivers that loop over the chunks are in ``_paths/_paged.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import _validation
from ._blocks import FULL, PARTIAL
from ._compat import device, numpy_namespace, on_device, stop_gradient
from ._masks import Band, arange
from ._quant import Scaled, each_part, taken_scaled
from ._route import INVARIANT_PRODUCT_KEYS
from ._scores import distance
from ._tiled import Ops, RowState, normalised, online_step

__all__ = [
    "PADDING",
    "WALK",
    "ChunkIndex",
    "EngineRequest",
    "HostWalk",
    "PagedOps",
    "PagedProblem",
    "Tiles",
    "bottom_right",
    "bounded_tiles",
    "chunk_index",
    "finish",
    "finish_rows",
    "faulty_rows",
    "head_rows",
    "host_tiles",
    "index_step",
    "index_tiles",
    "listed_chunk",
    "listed_keys",
    "fold_keys",
    "owners",
    "query_slots",
    "row_positions",
    "start",
    "step",
    "tile_queries",
    "WalkPlan",
]


@dataclass(frozen=True)
class PagedProblem:
    """The static facts of one call (shapes, options), fixed under ``jax.jit``.

    A :class:`WalkPlan` holds the facts every layer of a step shares; a call fills in
    its layer's own (``value_dim``, ``scale``, ``softcap``, ``compute_dtype`` and the
    rules ``mask_mod`` and ``score_mod``).
    """

    num_tokens: int
    num_pages: int
    page_size: int
    max_pages: int
    num_q_heads: int
    num_kv_heads: int
    rows: int  # rows of a tile
    is_causal: bool
    left: int | None
    right: int | None
    device: Any
    keys_per_chunk: int  # the walk's chunks (Library.chunk_keys)
    aligned: bool = False  # tiles start at multiples of `rows` among a request's positions
    head_major: bool = False  # the pools given to the walk are (P, Hkv, page_size, D) views
    sums_by_product: bool = False  # sums as products with ones (Library.sums_by_program)
    # a layer's own (a plan holds the rest, the same for every layer of a step)
    value_dim: int = 0
    scale: Any = 1.0  # float or 0-d array
    softcap: Any = None  # None, float or 0-d array
    compute_dtype: Any = None
    mask_mod: Any = None  # (request, head, q_pos, kv_pos) -> bool, guarded (serving)
    score_mod: Any = None  # (score, request, head, q_pos, kv_pos) -> score, guarded

    @property
    def band(self) -> Band:
        """The causal / window band of the call (:meth:`~._masks.Band.of`)."""
        return Band.of(self.is_causal, (self.left, self.right))

    @property
    def groups(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def chunk_pages(self) -> int:
        return max(1, self.keys_per_chunk // self.page_size)

    @property
    def chunk_keys(self) -> int:
        return self.chunk_pages * self.page_size

    @property
    def num_chunks(self) -> int:
        return -(-self.max_pages // self.chunk_pages)

    @property
    def matmul_rows(self) -> int:
        return self.groups * self.rows

    @property
    def by_page(self) -> bool:
        """Multiply each page on its own: no copy of the gathered keys and values.

        Its products are (rows·G) by page_size each, summed over the chunk's pages
        afterwards; worth it while a tile has fewer rows (rows·G) than a page has slots
        (decoding), as the copy it saves is page_size / (rows·G) times what the sum adds.
        torch's decode step, 16 slots a page (benchmarks/results/serving-lanes.json):
        page by page took 0.48x the time of one product over the chunk at rows·G = 4,
        0.89x at rows·G = 16 (``batch_invariant``'s tiles).
        """
        return self.matmul_rows <= self.page_size or self.chunk_pages == 1

    @property
    def product_keys(self) -> int:
        """The keys of one product of the walk: a page, the chunk, or (aligned) 16 keys.

        With ``aligned`` (``batch_invariant``) a fixed number of keys whatever the page
        size (``_route.INVARIANT_PRODUCT_KEYS``), where the chunk holds a multiple of it:
        a row's bits do not depend on the pages. Otherwise a page (:attr:`by_page`) or
        the whole chunk.
        """
        fixed = INVARIANT_PRODUCT_KEYS
        if self.aligned and self.chunk_keys % fixed == 0:
            return fixed
        return self.page_size if self.by_page else self.chunk_keys


class Tiles(NamedTuple):
    """Which rows each tile holds, and where each packed row's result is.

    ``request`` (N,); ``first`` (N,) the packed row of the tile's slot 0, which may lie
    before its request's rows (``PagedProblem.aligned``: slot ``i`` is position
    ``p0 + i``, ``p0`` a multiple of ``rows``); ``begin``/``end`` (N,) the packed rows
    it holds (``begin == end`` for a tile that holds none); ``first_chunk``/
    ``last_chunk`` (N,) the key chunks its rows may see (empty when ``first > last``);
    and ``source`` (T,) the index of packed row ``t`` in the tiles' slots
    (``tile · rows + i``), with ``valid`` (T,) False for padding rows.
    """

    request: Any
    first: Any
    begin: Any
    end: Any
    first_chunk: Any
    last_chunk: Any
    source: Any
    valid: Any


def _chunk_range(
    xp: Any, p: PagedProblem, lo_pos: Any, hi_pos: Any, kv_len: Any
) -> tuple[Any, Any]:
    """Return the key chunks that rows at positions ``lo_pos..hi_pos`` may see."""
    first = xp.zeros_like(lo_pos)
    last = kv_len - 1
    lo, hi = p.band.key_bounds(lo_pos, hi_pos)
    if lo is not None:
        first = xp.maximum(first, lo)
    if hi is not None:
        last = xp.minimum(last, hi)
    bk = p.chunk_keys
    # floor division of possibly negative positions: a row that sees nothing gets first > last
    return xp.floor_divide(first, bk), xp.floor_divide(last, bk)


def _lead(xp: Any, p: PagedProblem, q_starts: Any, positions: Any) -> Any:
    """Slots before each request's first new row in its first tile (R,).

    Aligned (``batch_invariant``): the first row's position modulo the tile's rows, so
    that a row at position ``first + i`` sits in slot ``(first + i) % rows``. Else 0.
    """
    if not p.aligned:
        return xp.zeros_like(q_starts[1:])
    first = xp.take(positions, xp.clip(q_starts[:-1], 0, max(p.num_tokens - 1, 0)))
    return xp.astype(first, q_starts.dtype) % p.rows


def bottom_right(xp: Any, q_starts: Any, kv_lengths: Any, num_tokens: int, device: Any) -> Any:
    """Return the packed rows' positions (T,) where none are given: each request's last.

    Row ``i`` of request ``r`` (``n_r`` rows) sits at ``kv_lengths[r] - n_r + i``;
    padding rows get the last request's next positions (never read).
    """
    req, _, idx = owners(xp, q_starts[1:], num_tokens, device)
    counts = q_starts[1:] - q_starts[:-1]
    pos0 = kv_lengths - counts - q_starts[:-1]  # + a packed row: its position
    return xp.take(pos0, req) + idx


def _span(
    xp: Any, p: PagedProblem, first: Any, begin: Any, end: Any, positions: Any, device: Any
) -> tuple[Any, Any]:
    """Return the least and the largest position of each tile's rows, (N,) each.

    A tile's rows are the packed rows ``begin:end`` of its slots ``first .. first +
    rows - 1``; a tile that holds none gets an empty span (least above largest).
    """
    idx, held = _slots(xp, p, first, begin, end, device)
    pos = xp.take(positions, xp.reshape(idx, (-1,)))
    pos = xp.reshape(xp.astype(pos, first.dtype), idx.shape)
    bounds = xp.iinfo(pos.dtype)
    lo = xp.min(xp.where(held, pos, bounds.max), axis=1)
    hi = xp.max(xp.where(held, pos, bounds.min), axis=1)
    return lo, hi


def owners(xp: Any, ends: Any, length: int, device: Any) -> tuple[Any, Any, Any]:
    """Which part each of ``0 .. length-1`` falls in, parts ending at `ends` (R,).

    Returns the part (clipped to the last), whether the index is inside a part (below
    ``ends[-1]``), and the index itself, each (length,), in the dtype of `ends`. By
    comparisons, not a search: the ends may be traced (``jax.jit``).
    """
    idx = xp.astype(arange(xp, 0, length, device), ends.dtype)
    part = xp.sum(xp.astype(ends[None, :] <= idx[:, None], ends.dtype), axis=1)
    n = ends.shape[0]
    return xp.clip(part, 0, max(n - 1, 0)), part < n, idx


def bounded_tiles(
    xp: Any, p: PagedProblem, q_starts: Any, kv_lengths: Any, positions: Any, num_requests: int
) -> Tiles:
    """Return the tiles in request order, as many as any call of these shapes can need.

    A request of ``n`` rows takes ``ceil((lead + n) / rows)`` tiles (``lead < rows``
    slots before its first row when aligned, else 0): at most ``T`` tiles, and at most
    ``(T + R·(rows - 1)) // rows`` (``(T + 2·R·(rows - 1)) // rows`` aligned), by array
    operations only: the metadata may be traced (``jax.jit``).
    """
    t, rows = p.num_tokens, p.rows
    spare = num_requests * (rows - 1) * (2 if p.aligned else 1)
    n_tiles = max(1, min(t, (t + spare) // rows))
    counts = xp.clip(q_starts[1:] - q_starts[:-1], 0, None)  # (R,)
    lead = _lead(xp, p, q_starts, positions)  # (R,)
    per_request = xp.where(counts > 0, xp.floor_divide(lead + counts + (rows - 1), rows), 0)
    ends = xp.cumulative_sum(per_request)  # (R,)
    starts = ends - per_request
    req, real, i = owners(xp, ends, n_tiles, p.device)  # (N,)
    q0, q1 = xp.take(q_starts, req), xp.take(q_starts, req + 1)
    first = q0 - xp.take(lead, req) + (i - xp.take(starts, req)) * rows
    begin = xp.where(real, xp.maximum(first, q0), q0)
    end = xp.where(real, xp.maximum(xp.minimum(first + rows, q1), begin), begin)
    kv = xp.take(kv_lengths, req)
    lo, hi = _chunk_range(xp, p, *_span(xp, p, first, begin, end, positions, p.device), kv)
    hi = xp.where(end > begin, hi, -1)
    # packed row -> (tile, slot)
    row_req, valid, r_all = owners(xp, q_starts[1:], t, p.device)
    slot = r_all - xp.take(q_starts, row_req) + xp.take(lead, row_req)
    tile = xp.take(starts, row_req) + xp.floor_divide(slot, rows)
    source = xp.where(valid, tile * rows + slot % rows, 0)
    return Tiles(req, first, begin, end, lo, hi, source, valid)


class HostWalk(NamedTuple):
    """What the host knows of each tile (NumPy arrays, in the tiles' order).

    ``first_chunk``/``last_chunk`` the chunks its rows may see, ``length`` its request's
    keys, ``first_pos``/``last_pos`` the positions of its first and last rows.
    """

    first_chunk: Any
    last_chunk: Any
    length: Any
    first_pos: Any
    last_pos: Any

    def states(self, p: PagedProblem, j: int, a: int, b: int) -> tuple[Any, Any]:
        """Return how tiles ``a:b`` see chunk `j`: block states, and slots past a length.

        The states in ``_blocks``' encoding. :data:`~._blocks.FULL`: every row sees every
        key of the chunk (no mask to build);
        :data:`~._blocks.PARTIAL`: the band hides some, or the chunk holds slots past the
        request's length, which the second array (bool) marks: they are zeroed before use.
        """
        import numpy as np

        lo_key, hi_key = j * p.chunk_keys, (j + 1) * p.chunk_keys - 1
        past = self.length[a:b] <= hi_key
        _, full = p.band.blocks(self.first_pos[a:b], self.last_pos[a:b], lo_key, hi_key)
        return np.where(full & ~past, FULL, PARTIAL), past

    def runs(self, p: PagedProblem) -> list[tuple[int, int, int, int, bool]]:
        """Return the folds of the walk, ``(chunk, a, b, state, past)``, chunk by chunk.

        Every chunk some tile may see, folded into the tiles that may see it: a range
        (the tiles are sorted by last chunk), cut where their states or `past`
        (:meth:`states`) change, so tiles that see a whole chunk build no mask and zero
        nothing (most of a prefill's chunks). More than three runs fold as one, the
        most careful.
        """
        import numpy as np

        lo, hi = self.first_chunk, self.last_chunk
        if len(lo) == 0 or int(hi.max()) < 0:
            return []
        runs: list[tuple[int, int, int, int, bool]] = []
        for j in range(max(int(lo.min()), 0), min(int(hi.max()), p.num_chunks - 1) + 1):
            active = np.nonzero((lo <= j) & (j <= hi))[0]
            if len(active) == 0:
                continue
            a, b = int(active[0]), int(active[-1]) + 1
            states, past = self.states(p, j, a, b)
            change = (states[1:] != states[:-1]) | (past[1:] != past[:-1])
            cuts = [0, *(np.nonzero(change)[0] + 1).tolist(), b - a]
            parts = [
                (a + x, a + y, int(states[x]), bool(past[x])) for x, y in itertools.pairwise(cuts)
            ]
            if len(parts) > 3:
                parts = [(a, b, int(states.min()), bool(past.any()))]
            runs.extend((j, *part) for part in parts)
        return runs


def host_tiles(
    xp: Any, p: PagedProblem, q_starts: Any, kv_lengths: Any, positions: Any, walked: Any = True
) -> tuple[Tiles, HostWalk]:
    """Return the tiles that hold rows, from host (NumPy) metadata, longest walk first.

    Returns the tiles as arrays of `xp` on the problem's device, and what the driver's
    loop needs to know of them (:class:`HostWalk`). `positions` (T,) the packed rows'
    positions; `walked` (R,) bool: the requests whose rows the walk computes (the
    others' rows are left out of every tile).
    """
    import numpy as np

    q_starts = np.asarray(q_starts, dtype=np.int64)
    kv_lengths = np.asarray(kv_lengths, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    rows = p.rows
    counts = np.diff(q_starts)
    host = numpy_namespace()
    lead = _lead(host, p, q_starts, positions)
    req, first = [], []
    for r in np.nonzero((counts > 0) & walked)[0].tolist():
        for s in range(int(q_starts[r] - lead[r]), int(q_starts[r + 1]), rows):
            req.append(r)
            first.append(s)
    empty = not req
    if empty:  # one tile that holds nothing
        req, first = [0], [0]
    req_a = np.asarray(req, dtype=np.int64)
    first_a = np.asarray(first, dtype=np.int64)
    begin = np.minimum(np.maximum(first_a, q_starts[req_a]), q_starts[req_a + 1])
    end = begin if empty else np.maximum(np.minimum(first_a + rows, q_starts[req_a + 1]), begin)
    kv = kv_lengths[req_a]
    first_pos, last_pos = _span(host, p, first_a, begin, end, positions, None)
    lo, hi = _chunk_range(np, p, first_pos, last_pos, kv)
    hi = np.where(end > begin, hi, -1)
    # longest walks first (the active tiles of a chunk are then a range, mostly a prefix),
    # and among equal walks the longest requests first (those that fill the chunk)
    order = np.lexsort((-kv, -hi))
    req_a, first_a, begin, end, lo, hi, kv, first_pos, last_pos = (
        np.asarray(a)[order] for a in (req_a, first_a, begin, end, lo, hi, kv, first_pos, last_pos)
    )
    t = p.num_tokens
    source = np.zeros(t, dtype=np.int64)
    valid = np.zeros(t, dtype=bool)
    for idx in range(len(req_a)):
        b0, b1 = int(begin[idx]), int(end[idx])
        source[b0:b1] = idx * rows + np.arange(b0 - first_a[idx], b1 - first_a[idx])
        valid[b0:b1] = True
    kw = on_device(p.device)
    arrays = (req_a, first_a, begin, end, lo, hi, source, valid)
    tiles = Tiles(*(xp.asarray(a, **kw) for a in arrays))
    return tiles, HostWalk(lo, hi, kv, first_pos, last_pos)


@dataclass(frozen=True)
class WalkPlan:
    """What every layer's call of one step shares: built once from the step's metadata.

    `problem` the geometry (:class:`PagedProblem` without a layer's own fields),
    `tiles` (:class:`Tiles`), `slots`/`held` the query rows of the tiles' slots
    (:func:`query_slots`), `pos` the slots' positions (:func:`row_positions`). With
    metadata on the host, `runs` the walk's folds ``(a, b, state, past, index)`` in order
    (:meth:`HostWalk.runs`, each chunk's :class:`ChunkIndex` built once); with traced
    metadata `runs` is None (every chunk, by a traced loop) and `faulty` the rows whose
    request's metadata is wrong (:func:`faulty_rows`). No tiles: no row to compute.
    `engine` the requests whose rows the engine computes instead (no tile holds them),
    and `merge` the runs ``(source, a, b)`` whose rows, in order, are the result's: rows
    ``a:b`` of the walk's result (source :data:`WALK`), of the engine's result for
    ``engine[source]``, or ``b - a`` padding rows (:data:`PADDING`: nothing walked).
    """

    problem: PagedProblem
    tiles: Tiles | None
    slots: Any = None
    held: Any = None
    pos: Any = None
    runs: tuple[tuple[int, int, int, bool, ChunkIndex], ...] | None = None
    faulty: Any = None
    engine: tuple[EngineRequest, ...] = ()
    merge: tuple[tuple[int, int, int], ...] = ()

    @property
    def walks(self) -> bool:
        """Whether the walk computes any row (or every row is the engine's, or padding)."""
        return not self.merge or any(source == WALK for source, _, _ in self.merge)


#: :attr:`WalkPlan.merge`'s sources besides the engine's requests: the walk's result, and
#: padding rows where nothing is walked
WALK, PADDING = -1, -2


class EngineRequest(NamedTuple):
    """A request the engine computes, not the walk (``_route.paged_by_engine``).

    The `request`'s index, its packed rows ``begin:end``, its `length` keys, and the
    `pages` (ceil(length / page_size),) that hold them.
    """

    request: int
    begin: int
    end: int
    length: int
    pages: Any


class PagedOps(Ops):
    """The online softmax's block operations over a chunk: scores (N, c', Hkv, rows·G, b).

    A chunk multiplied page by page (:attr:`PagedProblem.by_page`) has its ``c'`` pages
    on axis 1: a row's max and sums run over them too. With
    :attr:`PagedProblem.sums_by_product`, sums are products with ones.
    """

    def __init__(self, xp: Any, p: PagedProblem) -> None:
        super().__init__(xp)
        self.p = p

    def row_max(self, s: Any) -> Any:
        return self.xp.max(s, axis=(1, 4), keepdims=True)

    def row_sum(self, p: Any) -> Any:
        xp = self.xp
        if self.p.sums_by_product:
            ones = xp.ones((p.shape[-1], 1), dtype=p.dtype, **on_device(self.p.device))
            return self.over_pages(p @ ones)
        return self.over_pages(xp.sum(p, axis=-1, keepdims=True))

    def over_pages(self, x: Any) -> Any:
        """Sum (N, c', Hkv, rows·G, W) over its pages c': (N, 1, Hkv, rows·G, W)."""
        xp = self.xp
        n, c2 = x.shape[0], x.shape[1]
        if c2 == 1:
            return x
        if not self.p.sums_by_product:
            return xp.sum(x, axis=1, keepdims=True)
        ones = xp.ones((1, c2), dtype=x.dtype, **on_device(self.p.device))
        summed = ones @ xp.reshape(x, (n, c2, -1))  # (N, 1, Hkv·rows·G·W)
        return xp.reshape(summed, (n, 1, *x.shape[2:]))


def start(xp: Any, p: PagedProblem, n_tiles: int) -> RowState:
    """Rows that saw nothing: max -inf, sum 0, accumulator 0, each (N, 1, Hkv, rows·G, …)."""
    kw = {"dtype": p.compute_dtype, **on_device(p.device)}
    rows = (n_tiles, 1, p.num_kv_heads, p.matmul_rows)
    return RowState(
        xp.full((*rows, 1), -xp.inf, **kw),
        xp.zeros((*rows, 1), **kw),
        xp.zeros((*rows, p.value_dim), **kw),
    )


def query_slots(xp: Any, p: PagedProblem, tiles: Tiles) -> tuple[Any, Any]:
    """Return the packed row of each tile slot (N·rows,) and whether the slot holds it.

    A slot that holds no row of the tile's request reads a zero query
    (:func:`tile_queries`): never another request's row or a padding row, whose NaN
    would reach this tile's keys' gradients (``0 · NaN`` in the backward), and the same
    zeros in every call (batch invariance).
    """
    idx, held = _slots(xp, p, tiles.first, tiles.begin, tiles.end, p.device)
    return xp.reshape(idx, (-1,)), xp.reshape(held, (-1,))


def _slots(
    xp: Any, p: PagedProblem, first: Any, begin: Any, end: Any, device: Any
) -> tuple[Any, Any]:
    """Return the packed row of each tile slot (N, rows), clipped, and whether it is held.

    A tile's slots are the packed rows ``first .. first + rows - 1``; it holds
    ``begin:end``.
    """
    idx = first[:, None] + xp.astype(arange(xp, 0, p.rows, device), first.dtype)[None, :]
    held = xp.logical_and(idx >= begin[:, None], idx < end[:, None])
    return xp.clip(idx, 0, max(p.num_tokens - 1, 0)), held


def tile_queries(xp: Any, p: PagedProblem, query: Any, slots: Any, held: Any) -> Any:
    """``scale · Q`` of every tile as (N, Hkv, rows·G, Dk), from :func:`query_slots`."""
    rows, hkv, g = p.rows, p.num_kv_heads, p.groups
    dk = query.shape[-1]
    q = xp.take(query, slots, axis=0)  # (N·rows, Hq, Dk)
    q = xp.where(xp.reshape(held, (-1, 1, 1)), xp.astype(q, p.compute_dtype, copy=False), 0.0)
    q = xp.reshape(q * p.scale, (-1, rows, hkv, g, dk))
    return xp.reshape(xp.permute_dims(q, (0, 2, 1, 3, 4)), (-1, hkv, rows * g, dk))


def row_positions(xp: Any, p: PagedProblem, slots: Any, positions: Any) -> Any:
    """Positions of the tiles' rows among their requests' keys, (N, 1, rows·G, 1).

    `slots` the packed row of each tile slot (:func:`query_slots`), `positions` (T,)
    the packed rows'. A tile's slots that hold no row are computed like the others
    (zero queries, at some other row's position) and never read: :func:`finish` takes
    only the rows the tiles hold.
    """
    pos = xp.reshape(xp.take(positions, slots), (-1, p.rows, 1))
    n = pos.shape[0]
    pos = xp.broadcast_to(pos, (n, p.rows, p.groups))
    return xp.reshape(pos, (n, 1, p.matmul_rows, 1))


def head_rows(xp: Any, p: PagedProblem, per_head: Any) -> Any:
    """Lay a per-query-head array (Hq,) out as the tiles' rows: (1, Hkv, rows·G, 1)."""
    x = xp.reshape(per_head, (p.num_kv_heads, 1, p.groups))
    x = xp.broadcast_to(x, (p.num_kv_heads, p.rows, p.groups))
    return xp.reshape(x, (1, p.num_kv_heads, p.matmul_rows, 1))


class ChunkIndex(NamedTuple):
    """Where chunk ``j``'s keys are for some tiles: what a plan computes once per step.

    ``pages`` (N·c,) the physical pages of the tiles' logical pages ``j·c .. j·c+c-1``
    (clipped into the pool), ``key_ok`` (N, bk) whether each key slot is one of the
    request's keys, ``kpos`` (bk,) the chunk's key positions.
    """

    pages: Any
    key_ok: Any
    kpos: Any


def chunk_index(
    xp: Any, p: PagedProblem, chunk: Any, request: Any, page_table: Any, kv_lengths: Any
) -> ChunkIndex:
    """Return the :class:`ChunkIndex` of chunk `chunk` (an int, or a traced 0-d integer)."""
    c, ps, bk = p.chunk_pages, p.page_size, p.chunk_keys
    logical = chunk * c + xp.astype(arange(xp, 0, c, p.device), request.dtype)  # (c,)
    flat = request[:, None] * p.max_pages + xp.clip(logical, 0, p.max_pages - 1)[None, :]
    pages = xp.take(xp.reshape(page_table, (-1,)), xp.reshape(flat, (-1,)))  # (N·c,)
    pages = xp.clip(xp.astype(pages, request.dtype), 0, p.num_pages - 1)
    kpos = chunk * bk + xp.astype(arange(xp, 0, bk, p.device), request.dtype)  # (bk,)
    key_ok = xp.logical_and(
        kpos[None, :] < xp.take(kv_lengths, request)[:, None],  # (N, bk)
        xp.reshape(xp.broadcast_to((logical < p.max_pages)[:, None], (c, ps)), (1, bk)),
    )
    return ChunkIndex(pages, key_ok, kpos)


def step(
    xp: Any,
    p: PagedProblem,
    state: RowState,
    index: ChunkIndex,
    q: Any,
    pos: Any,
    pools: tuple[Any, Any],
    alibi: Any | None,
    request: Any,
    *,
    sanitize: bool = True,
    masked: bool = True,
) -> RowState:
    """Fold the key chunk `index` locates (:func:`chunk_index`) into the tiles' state.

    `q` (N, Hkv, rows·G, Dk) and `pos` (N, 1, rows·G, 1) of the tiles; `pools` is
    ``(key_pages, value_pages)``, `value_pages` None where the values are the keys'
    first ``value_dim`` features; `alibi` the slopes as :func:`head_rows` lays them
    out, or None; `request` (N,) the tiles' requests, which the rules see. `sanitize`:
    zero the gathered slots past a request's length;
    `masked`: hide the keys past a length and those causal or window structure hides.
    Either False only where the caller knows there is nothing to zero or hide in any
    of these tiles (:meth:`HostWalk.runs`).
    """
    key_pages, value_pages = pools
    pages, key_ok, kpos = index
    n = q.shape[0]
    b = p.product_keys
    c2 = p.chunk_keys // b
    k = _gathered(xp, p, key_pages, pages, n)
    v = None if value_pages is None else _gathered(xp, p, value_pages, pages, n)
    ok = xp.reshape(key_ok, (n, c2, 1, 1, b))
    kp = xp.reshape(kpos, (1, c2, 1, 1, b))
    allowed = None
    if masked:
        allowed = ok
        if p.band.restricts:
            allowed = xp.logical_and(allowed, p.band.between(pos[:, None, ...], kp))
    keys = (k, v, kp, ok if sanitize else None, allowed)
    return fold_keys(xp, p, state, q, pos, keys, alibi, request)


def fold_keys(
    xp: Any,
    p: PagedProblem,
    state: RowState,
    q: Any,
    pos: Any,
    keys: tuple[Any, Any, Any, Any, Any],
    alibi: Any | None,
    request: Any,
) -> RowState:
    """Fold gathered keys into the tiles' state: the one score pipeline of every key source.

    `keys` is ``(k, v, kp, keep, allowed)``: keys (N, c', Hkv|1, b, Dk) and values (the
    same, Dv; None: the keys' first ``value_dim`` features) as a source gathered them
    (the pages of a chunk, :func:`step`; a row's listed positions, :func:`index_step`),
    their positions `kp` and which slots hold a key to keep (zeroed elsewhere, whatever
    they hold) and which each row may see, each broadcastable to (N, c', Hkv, 1, b), or
    None: keep / show every slot. Scores ``softcap(scale · Q Kᵀ)``, then `score_mod`,
    ALiBi and the masks (`mask_mod` AND-ed with `allowed`), then the online softmax.
    """
    dt = p.compute_dtype
    k, v, kp, keep, allowed = keys
    n = q.shape[0]
    if keep is not None:  # slots that hold no key: zero (NaN in values or gradients)
        keep = xp.matrix_transpose(keep)
        k = each_part(lambda x: xp.where(keep, x, 0.0), k)
        v = None if v is None else each_part(lambda x: xp.where(keep, x, 0.0), v)
    if v is None:  # one pool: the values are the keys' first value_dim features
        v = (
            k[..., : p.value_dim]
            if not isinstance(k, Scaled)
            else k._replace(x=k.x[..., : p.value_dim])
        )
    s = scores_of(xp, q[:, None, ...], k)  # (N, c', Hkv, rows·G, b)
    if p.softcap is not None:
        s = p.softcap * xp.tanh(s / p.softcap)
    pos = pos[:, None, ...]  # (N, 1, 1, rows·G, 1)
    at: tuple[Any, ...] = ()
    if p.score_mod is not None or p.mask_mod is not None:
        # the rules' indices: request (N, 1, 1, 1, 1), query head (1, 1, Hkv, rows·G, 1),
        # the row's and the key's positions among the request's keys
        heads = arange(xp, 0, p.num_q_heads, p.device)
        heads = head_rows(xp, p, xp.astype(heads, kp.dtype))
        at = (xp.reshape(request, (n, 1, 1, 1, 1)), heads[:, None, ...], pos, kp)
    if p.score_mod is not None:
        modified = p.score_mod(s, *at)
        _validation.check_score_mod_result(xp, modified, s)
        s = xp.astype(modified, dt, copy=False)
    if alibi is not None:
        s = s - alibi[:, None, ...] * distance(xp, pos, kp, dt)
    if p.mask_mod is not None:
        ruled = p.mask_mod(*at)
        _validation.check_mask_mod_result(xp, ruled, s.shape)
        allowed = ruled if allowed is None else xp.logical_and(allowed, ruled)
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)
    ops = PagedOps(xp, p)
    # the engine's update, over the chunk's pages; the running max's gradient stopped as
    # in every walk
    return online_step(
        ops,
        state,
        s,
        lambda e, first: ops.over_pages(weighted(xp, e, v)),
        stop_gradient=stop_gradient,
    )


def scores_of(xp: Any, q: Any, k: Any) -> Any:
    """``q @ kᵀ``; keys with their scales apart (:class:`~._quant.Scaled`) scale the scores.

    ``q · (x - z) s = (q · x - z Σq) s``: per key, not per feature.
    """
    if not isinstance(k, Scaled):
        return q @ xp.matrix_transpose(k)
    s = q @ xp.matrix_transpose(k.x)
    if k.zero is not None:
        s = s - xp.sum(q, axis=-1, keepdims=True) * xp.matrix_transpose(k.zero)
    return s * xp.matrix_transpose(k.scale)


def weighted(xp: Any, e: Any, v: Any) -> Any:
    """``e @ v``; values with their scales apart scale the weights: ``(e s) @ (x - z)``."""
    if not isinstance(v, Scaled):
        return e @ v
    e = e * xp.matrix_transpose(v.scale)
    out = e @ v.x
    return out if v.zero is None else out - e @ v.zero


def index_tiles(xp: Any, p: PagedProblem, q_starts: Any) -> Tiles:
    """Return one tile per packed row, in packed order: the tiles of an index walk.

    With :func:`index_step` each row sees its own listed keys, so a tile holds one row
    (``p.rows == 1``); padding rows' tiles hold none.
    """
    request, valid, row = owners(xp, q_starts[1:], p.num_tokens, p.device)
    end = xp.where(valid, row + 1, row)
    none = xp.zeros_like(row)
    return Tiles(request, row, row, end, none, none - 1, row, valid)


def listed_keys(
    xp: Any,
    p: PagedProblem,
    kv_indices: Any,
    tiles: Tiles,
    positions: Any,
    kv_lengths: Any,
    *,
    window_union: bool,
) -> tuple[Any, Any]:
    """Return the keys each row sees by its list: positions and whether kept, (T, Hkv, W).

    `kv_indices` (T, Hkv, k) the rows' listed positions (``-1`` padding), `tiles` the
    rows' (:func:`index_tiles`), `positions` (T,) theirs. A listed position counts once
    (the list is sorted and a repeat dropped) and only where it is one of the request's
    keys and inside the band (causal, window); a padding row keeps none. With
    `window_union` the band's keys are seen whatever the list says: they are appended
    to every list (``W = k + left + right + 1``), and a listed key inside the band is
    dropped (seen once), one outside it kept where the causal rule shows it. Positions
    are int32 where every slot of the pool has an int32 index.
    """
    small = p.num_pages * p.page_size * p.num_kv_heads < 2**31
    dtype = xp.int32 if small else xp.int64
    idx = xp.sort(xp.astype(kv_indices, dtype), axis=-1)
    t, hkv, k = idx.shape
    length = xp.astype(xp.take(kv_lengths, tiles.request), dtype)[:, None, None]
    pos = xp.astype(positions, dtype)[:, None, None]
    repeat = xp.concat(
        [
            xp.zeros((t, hkv, min(k, 1)), dtype=xp.bool, **on_device(p.device)),
            idx[..., 1:] == idx[..., :-1],
        ],
        axis=-1,
    )
    kept = (idx >= 0) & (idx < length) & ~repeat & tiles.valid[:, None, None]
    band = p.band
    if window_union:
        causal = Band.of(p.is_causal, None)
        if causal.restricts:
            kept = kept & causal.between(pos, idx)
        kept = kept & ~band.between(pos, idx)
        left, right = band.left or 0, band.right or 0  # bounded both ways (the call checks)
        offsets = xp.astype(arange(xp, -left, right + 1, p.device), dtype)
        near = xp.broadcast_to(pos + offsets[None, None, :], (t, hkv, offsets.shape[0]))
        near_kept = (near >= 0) & (near < length) & band.between(pos, near)
        near_kept = near_kept & tiles.valid[:, None, None]
        idx, kept = xp.concat([idx, near], axis=-1), xp.concat([kept, near_kept], axis=-1)
    elif band.restricts:
        kept = kept & band.between(pos, idx)
    return idx, kept


def listed_chunk(xp: Any, listed: tuple[Any, Any], j: Any, chunk: int) -> tuple[Any, Any]:
    """Return chunk `j` (an int, or traced) of :func:`listed_keys`: (N, Hkv, chunk) each.

    Positions not kept (and past the lists' end) are the request's first key, 0.
    """
    idx, kept = listed
    width = idx.shape[-1]
    cols = j * chunk + xp.astype(arange(xp, 0, chunk, device(idx)), idx.dtype)
    inside = cols < width
    cols = xp.clip(cols, 0, max(width - 1, 0))
    kept_j = xp.take(kept, cols, axis=2) & inside[None, None, :]
    return xp.where(kept_j, xp.take(idx, cols, axis=2), 0), kept_j


def index_step(
    xp: Any,
    p: PagedProblem,
    state: RowState,
    listed: tuple[Any, Any],
    q: Any,
    pos: Any,
    pools: tuple[Any, Any, Any],
    alibi: Any | None,
    request: Any,
) -> RowState:
    """Fold one chunk of the rows' listed keys (:func:`listed_keys`) into their state.

    `listed` the chunk's positions and kept flags (N, Hkv, c) of rows (tiles of one
    row, :func:`index_tiles`); `pools` ``(keys, values, page_table)``, the pools as
    (P·page_size·Hkv, D) rows (values None: the keys' first ``value_dim`` features).
    Each key is one ``take`` of its row of the pool: ``O(N · Hkv · c)`` gathered keys,
    none zeroed: a listed key not kept is its request's first, a key like any other, and
    a row with no key of its own (padding; a request whose metadata is wrong, NaN) sees
    none, so whatever its slots hold is hidden from its scores and, through their mask,
    from every gradient.
    """
    kpos, kept = listed
    key_rows, value_rows, page_table = pools
    n, hkv, c = kpos.shape
    ps = p.page_size
    page = xp.take(
        xp.reshape(page_table, (-1,)),
        xp.reshape(request[:, None, None] * p.max_pages + kpos // ps, (-1,)),
    )
    page = xp.clip(xp.astype(page, kpos.dtype), 0, p.num_pages - 1)
    head = xp.astype(arange(xp, 0, hkv, p.device), kpos.dtype)[None, :, None]
    flat = (xp.reshape(page, kpos.shape) * ps + kpos % ps) * hkv + head  # (N, Hkv, c)
    flat = xp.reshape(flat, (-1,))

    def gathered(rows: Any) -> Any:
        x = taken_scaled(xp, rows, flat, p.compute_dtype)
        return each_part(lambda part: xp.reshape(part, (n, 1, hkv, c, -1)), x)

    k = gathered(key_rows)
    v = None if value_rows is None else gathered(value_rows)
    ok = xp.reshape(kept, (n, 1, hkv, 1, c))
    kp = xp.reshape(kpos, (n, 1, hkv, 1, c))
    return fold_keys(xp, p, state, q, pos, (k, v, kp, None, ok), alibi, request)


def _gathered(xp: Any, p: PagedProblem, pool: Any, pages: Any, n: int) -> Any:
    """Gather the chunk's pages of a pool, as (N, c', Hkv, b, D): `b` the product's keys.

    A pool with a scale per token comes as :class:`~._quant.Scaled` parts laid out alike.
    """
    hkv, b = p.num_kv_heads, p.product_keys

    def laid_out(x: Any) -> Any:
        if not p.head_major:
            x = xp.permute_dims(x, (0, 2, 1, 3))  # (N·c, Hkv, page_size, D)
        x = xp.reshape(x, (n, p.chunk_pages, hkv, p.page_size, -1))
        if b == p.page_size:
            return x
        x = xp.permute_dims(x, (0, 2, 1, 3, 4))  # (N, Hkv, c, page_size, D): positions in order
        x = xp.reshape(x, (n, hkv, p.chunk_keys // b, b, -1))
        return xp.permute_dims(x, (0, 2, 1, 3, 4))

    return each_part(laid_out, taken_scaled(xp, pool, pages, p.compute_dtype))


def finish_rows(
    xp: Any, p: PagedProblem, state: RowState, sinks: Any | None, dtype: Any
) -> tuple[Any, Any, Any]:
    """Normalise rows of one row a tile (:func:`index_tiles`): out (n, Hq, Dv), lse, max.

    Their tiles are the rows themselves, in order: a reshape puts them back. A row that
    saw nothing (padding too) is zeros with lse ``-inf`` (the sink's where given).
    """
    m, l_sum, acc = (x[:, 0, ...] for x in state[:3])
    sink_rows = None if sinks is None else head_rows(xp, p, xp.astype(sinks, p.compute_dtype))
    out, lse = normalised(xp, RowState(m, l_sum, acc), sink_rows)
    n, hq = out.shape[0], p.num_q_heads
    out = xp.astype(xp.reshape(out, (n, hq, p.value_dim)), dtype, copy=False)
    return out, xp.reshape(lse, (n, hq)), xp.reshape(m, (n, hq))


def faulty_rows(
    xp: Any,
    q_starts: Any,
    kv_lengths: Any,
    page_table: Any,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    device: Any,
    q_positions: Any = None,
) -> Any:
    """Return the packed rows (T,) whose request's metadata is wrong (all: a wrong packing).

    For metadata without values (``jax.jit``), where no error can be raised: these rows
    come out NaN (:func:`finish`) and are not written (``paged_kv_write``). With
    `q_positions`, a row whose position is not one of its request's keys is wrong too.
    """
    packing, lengths, pages = _validation.metadata_faults(
        xp, q_starts, kv_lengths, page_table, num_tokens, num_pages, page_size, device
    )
    wrong = xp.logical_or(lengths, xp.any(pages, axis=1))
    req, inside, _ = owners(xp, q_starts[1:], num_tokens, device)
    rows = xp.take(wrong, req)
    if q_positions is not None:
        outside = xp.logical_or(q_positions < 0, q_positions >= xp.take(kv_lengths, req))
        rows = xp.logical_or(rows, outside)
    return xp.logical_or(packing, xp.logical_and(inside, rows))


def finish(
    xp: Any,
    p: PagedProblem,
    state: RowState,
    tiles: Tiles,
    sinks: Any | None,
    dtype: Any,
    faulty: Any | None = None,
) -> tuple[Any, Any, Any]:
    """Normalise the tiles' rows and put them back in packed order.

    Returns out (T, Hq, Dv), lse (T, Hq) and the largest visible score of each row
    (T, Hq): the running max, the sink left out. Padding rows are zeros with lse and
    max ``-inf``; a row that sees no key (and no sink) too. The rows `faulty` (T,)
    marks (:func:`faulty_rows`) are NaN, in all three.
    """
    m, l_sum, acc = (x[:, 0, ...] for x in state[:3])
    sink_rows = None if sinks is None else head_rows(xp, p, xp.astype(sinks, p.compute_dtype))
    out, lse = normalised(xp, RowState(m, l_sum, acc), sink_rows)
    n = out.shape[0]
    rows, hkv, g, hq = p.rows, p.num_kv_heads, p.groups, p.num_q_heads
    out = xp.reshape(out, (n, hkv, rows, g, p.value_dim))
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3, 4)), (n * rows, hq, p.value_dim))
    out = xp.take(out, tiles.source, axis=0)  # (T, Hq, Dv)
    valid = tiles.valid
    out = xp.where(valid[:, None, None], out, 0.0)
    stats = []
    for x in (lse, m):
        x = xp.reshape(xp.permute_dims(xp.reshape(x, (n, hkv, rows, g)), (0, 2, 1, 3)), (-1, hq))
        x = xp.where(valid[:, None], xp.take(x, tiles.source, axis=0), -xp.inf)
        stats.append(x if faulty is None else xp.where(faulty[:, None], xp.nan, x))
    if faulty is not None:
        out = xp.where(faulty[:, None, None], xp.nan, out)
    return xp.astype(out, dtype, copy=False), stats[0], stats[1]

"""Dask: one task per (query chunk, key chunk) pair, merged per query chunk by a tree.

A Dask call is validated once, eagerly, on the Dask arrays (:func:`prepare`); this
module then builds the graph by hand (a :class:`~dask.highlevelgraph.HighLevelGraph`
that Dask's own schedulers run):

- one task per (batch chunk, head chunk, query chunk, key chunk) that the pair states
  (``_lib/_blocks.py``: causal/window structure, a block mask) do not skip: no task.
  It receives the chunks themselves (NumPy or CuPy arrays inside the worker), builds
  an :class:`AttentionCall` for them in their own namespace (the call's
  :meth:`~AttentionCall.unflatten` of the blocks of every array field), places it at
  the chunk's absolute query and key positions
  (:func:`portable_attn._paths._partial.place_block`) and runs the path the policy
  chose for the pairs (:func:`portable_attn._paths._partial.partial_attention`):
  the same kernel every backend runs. It returns the pair's normalised output and
  row log-sum-exp;
- a `score_mod` runs inside the task on one-chunk Dask arrays (:func:`_on_dask`), so a
  function written for the Dask call (the Dask namespace, Dask arrays it holds) works;
  its blocks keep every batch item and head, as documented ((B..., Hq, bq, bk)): with a
  `score_mod`, batch and heads are one chunk;
- per query chunk, the partials of its key chunks are combined by the exact
  online-softmax merge (:func:`portable_attn._lib._merge.merge_partials`) in a tree
  of ``DaskGrid.merge_fan_in`` partials per task; its
  root is the output chunk (rows that see no key are zero). A query chunk with one
  visible key chunk needs no merge: its pair task returns the output chunk.

Every array field (:data:`~portable_attn._lib._fields.FIELDS`) is rechunked to the
grid along the axes its declaration names (axes of size one stay broadcast): Q, K, V,
masks, biases, segment ids, lengths, ALiBi slopes, sinks; a learned scale or softcap
is one chunk. Nothing is computed here: the result is a lazy Dask array. Dask has no
automatic differentiation, so there is no backward.

Legend: ``B...`` batch, ``Hq``/``Hkv`` query/key heads, ``G = Hq // Hkv``, ``Lq``,
``Lk`` queries and keys, ``Dk``/``Dv`` features.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._lib._block_states import block_index
from .._lib._blocks import host_pair_states
from .._lib._call import AttentionCall
from .._lib._compat import array_namespace, device, library_name
from .._lib._fields import field
from .._lib._masks import arange
from .._lib._merge import merge_partials
from .._lib._path import DaskGrid, Dense, Tiled
from .._lib._tiled import tiled_forward
from ._buffered import buffered_forward
from ._partial import partial_attention, placed_part

__all__ = ["dask_attention"]

Array = Any
Range = tuple[int, int]


@dataclass(frozen=True)
class _Kernel:
    """What every task of one call shares: the call without its arrays, the inner path."""

    skeleton: AttentionCall  # AttentionCall.flatten()'s skeleton, without a namespace
    names: tuple[str, ...]  # the array fields each pair task receives, in order
    inner: Dense | Tiled  # the path each pair task runs on its chunks
    with_lse: bool = False  # the output chunks come with their row log-sum-exp


@dataclass(frozen=True)
class _Pair:
    """One (query chunk, key chunk) pair: absolute ranges on the grid's axes."""

    batch: tuple[Range, ...]
    heads: Range  # query heads; key/value heads are these divided by G
    q: Range
    k: Range
    final: bool  # the only visible key chunk of its query chunk: return the output alone


def dask_attention(call: AttentionCall, path: DaskGrid, *, with_lse: bool = False) -> Any:
    """Attention of a Dask call as a lazy Dask array, one task per visible chunk pair.

    Parameters
    ----------
    call : AttentionCall
        A validated call whose arrays are Dask arrays: query (B..., Hq, Lq, Dk),
        key (B..., Hkv, Lk, Dk), value (B..., Hkv, Lk, Dv).
    path : DaskGrid
        The (Lq chunks, Lk chunks) grid, the path inside each chunk pair and the
        merge fan-in.
    with_lse : bool, default False
        Also return the row log-sum-exp.

    Returns
    -------
    out : dask array, shape (*batch, Hq, Lq, Dv), compute dtype
        Chunked like the query along batch, (whole groups of) heads and ``Lq``;
        one chunk along ``Dv``.
    lse : dask array, shape (*batch, Hq, Lq, 1), compute dtype
        Only with `with_lse` (then ``(out, lse)`` is returned): ``-inf`` for rows
        with no visible key (the sink logit with `sinks`).
    """
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    plan = call.plan
    grid = _grid(call, path)
    if call.terms.score_mod is not None:
        _check_score_mod(call, grid)
    if call.terms.mask_mod is not None:
        _check_mask_mod(call, grid)
    batch_axes = tuple(f"b{i}" for i in range(len(plan.batch)))
    arrays, skeleton = call.flatten()
    # every array field on the grid: the axes of its declaration, after the batch axes
    aligned = {n: _align(da, x, batch_axes + field(n).axes, grid) for n, x in arrays.items()}
    names = tuple(aligned)
    once = [i for i, n in enumerate(names) if field(n).once_per_row is not None]
    kernel = _Kernel(dataclasses.replace(skeleton, xp=None), names, path.inner, with_lse)
    deps = [x for x, _ in aligned.values()]
    # the kernel holds every static fact of the call (its plan and terms: dropout
    # factor, score_mod, ...), so calls that differ only there get different names
    name = "attention-" + tokenize(kernel, [x.name for x in deps], grid)
    pair_name, merge_name, both_name = f"{name}-pair", f"{name}-merge", f"{name}-both"
    lse_name = f"{name}-lse"
    lse_dsk: dict[Any, Any] = {}
    ranges = {axis: _ranges(chunks) for axis, chunks in grid.items()}

    dsk: dict[Any, Any] = {}
    head_ranges, q_ranges, k_ranges = ranges["hq"], ranges["lq"], ranges["lk"]
    states = host_pair_states(call, q_ranges, k_ranges)
    for b_idx in itertools.product(*(range(len(ranges[a])) for a in batch_axes)):
        b_ranges = tuple(ranges[a][i] for a, i in zip(batch_axes, b_idx, strict=True))
        batch_rows = math.prod(e - s for s, e in b_ranges)
        for hi, h_range in enumerate(head_ranges):
            heads = batch_rows * (h_range[1] - h_range[0])  # (batch, head) rows of a chunk
            for qi, q_range in enumerate(q_ranges):
                out_key = (name, *b_idx, hi, qi, 0)
                if with_lse:  # the root returns (out, lse): one getter each
                    root = (both_name, *b_idx, hi, qi, 0)
                    dsk[out_key] = (operator.getitem, root, 0)
                    lse_key = (lse_name, *b_idx, hi, qi, 0)
                    lse_dsk[lse_key] = (operator.getitem, root, 1)
                    out_key = root
                visible = [  # key chunks with keys that the pair states show
                    ki for ki, kr in enumerate(k_ranges) if kr[1] > kr[0] and states[qi][ki]
                ]
                index = {**dict(zip(batch_axes, b_idx, strict=True)), "hq": hi, "hkv": hi}
                index["lq"] = qi
                if not visible:  # every key hidden by causal/window: zero rows
                    pair = _Pair(b_ranges, h_range, q_range, (0, 0), final=True)
                    keys = {"lk": 0, **index}
                    args = [_block_key(aligned[n], keys) for n in names]
                    dsk[out_key] = (_zeros_task, kernel, pair, *args)
                    continue
                parts = []
                runs = _runs(visible, heads * (q_range[1] - q_range[0]), k_ranges, path)
                for run in runs:
                    final = len(runs) == 1
                    pairs, args = [], []
                    for ki in run:
                        pairs.append(_Pair(b_ranges, h_range, q_range, k_ranges[ki], final))
                        keys = {"lk": ki, **index}
                        blocks = [_block_key(aligned[n], keys) for n in names]
                        if ki != visible[0]:  # a sink logit counts once a row: in one partial
                            for i in once:
                                blocks[i] = None
                        args += blocks
                    key = out_key if final else (pair_name, *b_idx, hi, qi, run[0])
                    dsk[key] = (_run_task, kernel, tuple(pairs), *args)
                    parts.append(key)
                if len(parts) > 1:
                    root = (merge_name, *b_idx, hi, qi)
                    _merge_tree(dsk, parts, out_key, root, path.merge_fan_in, not with_lse)

    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    rows = (*(grid[a] for a in batch_axes), grid["hq"], grid["lq"])
    meta = meta_from_array(call.query, ndim=len(rows) + 1, dtype=plan.compute_dtype)
    out = da.Array(graph, name, (*rows, (plan.value_dim,)), meta=meta)
    if not with_lse:
        return out
    lse_deps: list[Any] = [out]
    lse_graph = HighLevelGraph.from_collections(lse_name, lse_dsk, dependencies=lse_deps)
    return out, da.Array(lse_graph, lse_name, (*rows, (plan.stats_width,)), meta=meta)


# ---------------------------------------------------------------------------
# the grid and the operands aligned to it


def _grid(call: AttentionCall, path: DaskGrid) -> dict[str, tuple[int, ...]]:
    """Chunks of every grid axis: batch axes, heads (whole GQA groups), Lq, Lk, features."""
    plan = call.plan
    nb = len(plan.batch)
    qkv = [x for x in (call.query, call.key, call.value) if x is not None]
    grid: dict[str, tuple[int, ...]] = {}
    for i, n in enumerate(plan.batch):
        bounds: set[int] = set()
        for x in qkv:
            axis = x.ndim - 3 - (nb - i)  # the operand's axis for batch axis i, if it has one
            if axis >= 0 and x.shape[axis] == n and n != 1:
                bounds |= _bounds(x.chunks[axis])
        grid[f"b{i}"] = _chunks_from(bounds, n)
    # a score_mod's blocks are (B..., Hq, bq, bk), a mask_mod's index arrays cover
    # every batch item and head: one chunk along both
    whole = call.terms.score_mod is not None or call.terms.mask_mod is not None
    if whole:
        grid.update({f"b{i}": (n,) for i, n in enumerate(plan.batch)})
    g = plan.groups
    head_bounds = {b for b in _bounds(call.query.chunks[-3]) if b % g == 0}
    if whole:
        head_bounds = set()
    grid["hq"] = _chunks_from(head_bounds, plan.num_q_heads)
    grid["hkv"] = tuple(n // g for n in grid["hq"])
    grid["lq"] = tuple(int(n) for n in path.q_chunks)
    grid["lk"] = tuple(int(n) for n in path.k_chunks)
    grid["dk"], grid["dv"] = (plan.key_dim,), (plan.value_dim,)
    return grid


def _check_score_mod(call: AttentionCall, grid: dict[str, tuple[int, ...]]) -> None:
    """Call the checked `score_mod` once, lazily, on Dask stand-ins of the first chunk pair.

    The tasks call it on NumPy chunks; this raises its shape and dtype errors now, on
    the Dask-level call, as the other paths do. Nothing is computed.
    """
    xp, plan = call.xp, call.plan
    bq, bk = grid["lq"][0], grid["lk"][0]
    shape = (*plan.batch, plan.num_q_heads, bq, bk)
    scores = xp.zeros(shape, dtype=plan.compute_dtype)
    n = math.prod(plan.batch)
    batch = xp.reshape(arange(xp, 0, n, None), (*plan.batch, 1, 1, 1))
    score_mod: Any = call.terms.score_mod
    score_mod(scores, *block_index(xp, batch, plan.num_q_heads, (0, bq), (0, bk)))


def _check_mask_mod(call: AttentionCall, grid: dict[str, tuple[int, ...]]) -> None:
    """Call the checked `mask_mod` once, lazily, on the index arrays of the first chunk pair.

    Raises its dtype and shape errors on the Dask-level call; nothing is computed.
    """
    xp, plan = call.xp, call.plan
    bq, bk = grid["lq"][0], grid["lk"][0]
    mask_mod: Any = call.terms.mask_mod
    mask_mod(*block_index(xp, call.terms.batch_index, plan.num_q_heads, (0, bq), (0, bk)))


def _bounds(chunks: tuple[int, ...]) -> set[int]:
    return set(itertools.accumulate(int(n) for n in chunks))


def _chunks_from(bounds: set[int], total: int) -> tuple[int, ...]:
    """Chunk sizes between the sorted boundaries, ending at `total`."""
    ends = sorted(b for b in bounds | {total} if 0 < b <= total)
    return tuple(e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)) or (total,)


def _ranges(chunks: tuple[int, ...]) -> list[Range]:
    ends = list(itertools.accumulate(chunks))
    return [(e - n, e) for n, e in zip(chunks, ends, strict=True)]


def _align(da: Any, x: Array, axes: tuple[str, ...], grid: dict) -> tuple[Array, tuple]:
    """Pad `x` to the axes' rank and rechunk it to the grid; size-1 axes stay broadcast.

    Returns the aligned array and, per axis, its grid axis name or None (broadcast).
    """
    if library_name(x) != "dask":
        x = da.asarray(x)
    if x.ndim < len(axes):
        x = x[(None,) * (len(axes) - x.ndim)]
    chunks: list[tuple[int, ...]] = []
    roles: list[str | None] = []
    for n, axis in zip(x.shape, axes, strict=True):
        target = grid[axis]
        if n == 1 and sum(target) != 1:
            chunks.append((1,))
            roles.append(None)
        else:
            chunks.append(target)
            roles.append(axis)
    if tuple(x.chunks) != tuple(chunks):
        x = x.rechunk(tuple(chunks))
    return x, tuple(roles)


def _block_key(aligned: tuple[Array, tuple] | None, index: dict[str, int]) -> Any:
    """Return the key of the block of an aligned operand that a chunk pair reads, or None."""
    if aligned is None:
        return None
    x, roles = aligned
    return (x.name, *(0 if role is None else index.get(role, 0) for role in roles))


def _merge_tree(
    dsk: dict, parts: list[Any], out_key: Any, prefix: tuple, fan_in: int, alone: bool
) -> None:
    """Merge `parts` `fan_in` at a time; the root goes under `out_key`.

    The root returns the output alone when `alone`, else ``(out, lse)``.
    """
    level = 0
    while len(parts) > fan_in:
        merged = []
        for g in range(0, len(parts), fan_in):
            group = parts[g : g + fan_in]
            if len(group) == 1:
                merged.append(group[0])
                continue
            key = (*prefix, level, g // fan_in)
            dsk[key] = (_merge_task, False, group)
            merged.append(key)
        parts, level = merged, level + 1
    dsk[out_key] = (_merge_task, alone, parts)


# ---------------------------------------------------------------------------
# what runs in the tasks (on NumPy or CuPy chunks)


def _chunk_call(kernel: _Kernel, pair: _Pair, blocks: tuple[Array | None, ...]) -> AttentionCall:
    """Build the call of one chunk pair from its blocks of every field, in their namespace."""
    arrays = {n: x for n, x in zip(kernel.names, blocks, strict=True) if x is not None}
    q = arrays["query"]
    xp = array_namespace(query=q)
    skeleton = kernel.skeleton
    plan = skeleton.plan
    (h0, h1), (qs, qe), (ks, ke) = pair.heads, pair.q, pair.k
    call = skeleton.unflatten(
        arrays,
        batch=tuple(e - s for s, e in pair.batch),
        num_q_heads=h1 - h0,
        num_kv_heads=(h1 - h0) // plan.groups,
        q_len=qe - qs,
        kv_len=ke - ks,
        device=device(q),
    )
    terms = call.terms
    if terms.score_mod is not None:
        mod = _head_shifted(_on_dask(terms.score_mod), h0)
        terms = dataclasses.replace(terms, score_mod=mod)
    if terms.mask_mod is not None:  # batch and heads are one chunk (see _grid)
        terms = dataclasses.replace(terms, mask_mod=_on_dask(terms.mask_mod))
    return dataclasses.replace(call, xp=xp, terms=terms)


def _runs(visible: list[int], rows: int, k_ranges: list[Range], path: DaskGrid) -> list[list]:
    """Group a query chunk's visible key chunks into the runs that one task each computes.

    Consecutive key chunks join a run until it holds ``path.task_scores`` scores
    (`rows` (batch, head) rows of the query chunk times its keys): small chunk pairs
    share a task, whose overhead costs more than they compute; large ones stay alone.
    """
    runs: list[list[int]] = []
    scores = 0
    for ki in visible:
        if not runs or scores >= path.task_scores:
            runs.append([])
            scores = 0
        runs[-1].append(ki)
        scores += rows * (k_ranges[ki][1] - k_ranges[ki][0])
    return runs


def _pair_task(kernel: _Kernel, pair: _Pair, *blocks: Array | None) -> tuple[Array, Array]:
    """Compute one chunk pair: its output (..., Hq_c, bq, Dv) and lse (..., Hq_c, bq, 1).

    `blocks` are the pair's blocks of the fields ``kernel.names`` (None for a
    ``once_per_row`` field that another pair of the query chunk counts).
    """
    call = _chunk_call(kernel, pair, blocks)
    whole = kernel.skeleton.plan
    out, lse = partial_attention(
        call,
        kernel.inner,
        kv_start=pair.k[0],
        kv_total=whole.kv_len,
        q_start=pair.q[0],
        q_total=whole.q_len,
    )
    return _full_rows(call, out, lse)


def _placed(kernel: _Kernel, pair: _Pair, call: AttentionCall) -> AttentionCall:
    """Return the call of a chunk pair, placed at its absolute query and key positions."""
    whole = kernel.skeleton.plan
    return placed_part(
        call, kv_start=pair.k[0], kv_total=whole.kv_len, q_start=pair.q[0], q_total=whole.q_len
    )


def _full_rows(call: AttentionCall, out: Array, lse: Array) -> tuple[Array, Array]:
    """Return `out` and `lse` broadcast to every (batch, head) row of the chunk pair."""
    xp, plan = call.xp, call.plan
    full = (*plan.batch, plan.num_q_heads, plan.q_len)
    stats = (*full, plan.stats_width)
    return xp.broadcast_to(out, (*full, plan.value_dim)), xp.broadcast_to(lse, stats)


def _run_task(kernel: _Kernel, pairs: tuple[_Pair, ...], *blocks: Array | None) -> Any:
    """Compute a run of chunk pairs of one query chunk, merged: ``(out, lse)``.

    `blocks` hold each pair's blocks of the fields ``kernel.names``, pair after
    pair. Returns the output alone when the run is its query chunk's only one.
    """
    n = len(kernel.names)
    alone = pairs[0].final and not kernel.with_lse
    inner = kernel.inner
    if isinstance(inner, Tiled) and len(pairs) > 1:  # the key chunks as parts of one walk
        calls = [
            _placed(kernel, pair, _chunk_call(kernel, pair, blocks[i * n : (i + 1) * n]))
            for i, pair in enumerate(pairs)
        ]
        forward = buffered_forward if inner.walk == "buffered" else tiled_forward
        out, lse = forward(calls[0], inner.block_q, inner.block_k, fold=inner.fold, parts=calls)
        out, lse = _full_rows(calls[0], out, lse)
        return out if alone else (out, lse)
    parts = [
        _pair_task(kernel, pair, *blocks[i * n : (i + 1) * n]) for i, pair in enumerate(pairs)
    ]
    if len(parts) > 1:
        return _merge_task(alone, parts)
    return parts[0][0] if alone else parts[0]


def _on_dask(fn: Callable[..., Array] | None) -> Callable[..., Array] | None:
    """Wrap a `score_mod` / `mask_mod` to be called as on the Dask-level call (Dask arrays).

    A function written for a Dask call uses the Dask namespace (and may hold Dask
    arrays, e.g. a learned table); inside a task the scores and index arrays are NumPy
    (CuPy) chunks, so they are lifted to one-chunk Dask arrays for the call and the
    result is computed in the task with the synchronous scheduler.
    """
    if fn is None:
        return None

    def mod(*args: Array) -> Array:
        import dask.array as da

        lifted = [da.from_array(x, chunks=x.shape) for x in args]
        result = fn(*lifted)
        return result.compute(scheduler="sync") if hasattr(result, "dask") else result

    return mod


def _head_shifted(score_mod: Callable[..., Array] | None, h0: int) -> Callable[..., Array] | None:
    """`score_mod` seeing the absolute query head of a head chunk starting at `h0`."""
    if score_mod is None or h0 == 0:
        return score_mod

    def mod(scores: Array, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        return score_mod(scores, batch, head + h0, q_idx, kv_idx)

    return mod


def _merge_task(alone: bool, parts: list[tuple[Array, Array]]) -> Any:
    """Exact online-softmax merge of partials; the output alone when `alone`."""
    xp = array_namespace(out=parts[0][0])
    out, lse = merge_partials(
        xp,
        xp.stack([p[0] for p in parts]),
        xp.stack([p[1] for p in parts]),
        max_over=lambda x: xp.max(x, axis=0),
        sum_over=lambda x: xp.sum(x, axis=0),
    )
    return out if alone else (out, lse)


def _zeros_task(kernel: _Kernel, pair: _Pair, *blocks: Array | None) -> Any:
    """Return the output chunk of a query chunk that sees no key chunk (:func:`empty_result`).

    With `with_lse`, also its log-sum-exp: ``-inf``, or the sink logit.
    """
    call = _chunk_call(kernel, pair, blocks)
    out, lse = call.empty_result()
    return (out, lse) if kernel.with_lse else out

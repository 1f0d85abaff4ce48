"""NumPy's tiled forward with its block loop in reused buffers (no allocation per block).

The portable :func:`~portable_attn._lib._tiled.tiled_forward` can only use the array
API, which has no ``out=``: every block of scores, of weights and of the accumulator
is a fresh array. NumPy hands each of those (1 MiB for 8 heads of 128 x 256 float32
scores) to glibc's ``malloc``, which maps the larger ones fresh and faults their
pages in, or not, depending on a threshold that moves with what the process did
before (issue 23: the same call measured 58 ms and 106 ms in one process; a Dask
worker ran at half the speed of one NumPy process). So the speed of a call depended
on its history.

:func:`buffered_forward` computes exactly what the portable kernel computes, the
same online softmax (:class:`~portable_attn._lib._tiled.RowWalk`'s steps, in the
same order), but writes every block into buffers it allocates once per call (per
thread): the scores and weights of one (query block, key block) pair, a boolean
block for the masks, the accumulator and ``P @ V`` of one query block, all through
NumPy's ``out=``. In steady state the block loop allocates nothing larger than a
row vector ((..., Hq, bq, 1): running max, rescale factor). The masks and score
terms still come from the portable score pipeline (``allowed_block``,
``slice_block``), so there is one definition of what a block shows.

This is the one backend-specific module for it: the policy chooses it for NumPy
arrays (``Tiled.buffered``), which have no autodiff to record the in-place writes;
the threads of :mod:`._threads` and Dask's pair tasks on NumPy chunks run it too.
Its tests compare it with the portable kernel and the float64 oracle, and check
the allocations (``tests/test_buffered.py``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np
from array_api_compat import numpy as _xp  # clip(min=) on NumPy 1.26 too

from .._lib._call import AttentionCall
from .._lib._masks import arange
from .._lib._path import Blocks
from .._lib._scores import (
    alibi_distance,
    empty_result,
    hidden_by_value,
    slice_block,
)
from .._lib._softmax import finite_shift, safe_denominator
from .._lib._tiled import block_ranges, pair_visibility, visible_entries

__all__ = ["KEEP_WORKSPACE_BYTES", "Workspace", "buffered_forward", "buffered_parts"]

Range = tuple[int, int]


#: A thread keeps its workspace for its next call up to this many bytes (a larger one
#: is allocated per call, where faulting it in costs little beside what it computes):
#: then neither the per-call allocation nor glibc's thresholds (which Dask's workers
#: set to trim at 64 KiB) decide the speed of small calls and Dask's chunk pairs.
KEEP_WORKSPACE_BYTES = 16 * 2**20
_ALIGN = 64  # bytes: every buffer of the arena starts on a cache line
_LOCAL = threading.local()


class Workspace:
    """The buffers of one thread's block loop, carved from one arena of bytes.

    A view of the first ``prod(shape)`` elements of a flat buffer is C-contiguous
    whatever the shape, so the shorter last blocks (and the ``(..., Hkv, G*bq, bk)``
    row layout of grouped-query attention) reuse the same memory. The arena is the
    thread's own, kept between calls (:data:`KEEP_WORKSPACE_BYTES`); a call made
    while the thread's arena is in use (a ``score_mod`` that calls attention) gets
    an arena of its own.
    """

    scores: np.ndarray
    hidden: np.ndarray
    acc: np.ndarray
    pv: np.ndarray
    query: np.ndarray
    v_ones: np.ndarray

    def __init__(
        self, call: AttentionCall, block_q: int, block_k: int, width: int, v_ones: int = 0
    ) -> None:
        plan = call.plan
        dt = np.dtype(plan.compute_dtype)
        rows = math.prod(plan.batch) * plan.num_q_heads * block_q
        sizes = {
            "scores": (rows * block_k, dt),  # scores, then weights, in place
            "hidden": (rows * block_k, np.dtype(bool)),  # the masks' complement
            "acc": (rows * width, dt),  # the running weighted sum
            "pv": (rows * width, dt),  # one block's P @ V
            "query": (rows * plan.key_dim, np.dtype(call.query.dtype)),  # scale * Q
        }
        if v_ones:  # [V | 1] of each key part, the row sums folded into P @ V
            sizes["v_ones"] = (v_ones, np.dtype(call.value.dtype))
        offsets, total = {}, 0
        for name, (n, dtype) in sizes.items():
            offsets[name] = total
            total += -(-n * dtype.itemsize // _ALIGN) * _ALIGN
        self.arena, self.owns_thread_arena = self._take(total)
        for name, (n, dtype) in sizes.items():
            start = offsets[name]
            setattr(self, name, self.arena[start : start + n * dtype.itemsize].view(dtype))

    @staticmethod
    def _take(nbytes: int) -> tuple[np.ndarray, bool]:
        """Return an arena of at least `nbytes`, and whether it is the thread's (now busy)."""
        if getattr(_LOCAL, "busy", False) or nbytes > KEEP_WORKSPACE_BYTES:
            return np.empty(nbytes, dtype=np.uint8), False  # a call inside a call, or large
        held = getattr(_LOCAL, "arena", None)
        if held is None or held.size < nbytes:
            held = np.empty(nbytes, dtype=np.uint8)
            _LOCAL.arena = held
        _LOCAL.busy = True
        return held, True

    def release(self) -> None:
        """Hand the thread's arena back for its next call (after the last use of a view)."""
        if self.owns_thread_arena:
            _LOCAL.busy = False

    def arena_view(self, name: str, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """Return `shape` elements of buffer `name` from element `offset` on, C-contiguous."""
        n = math.prod(shape)
        return getattr(self, name)[offset : offset + n].reshape(shape)

    @staticmethod
    def view(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Return the first ``prod(shape)`` elements of `buffer` as a C-contiguous array."""
        return buffer[: math.prod(shape)].reshape(shape)


def _block_width(blocks: Blocks, length: int) -> int:
    """Return the largest block of `blocks` (an int, or the sizes of consecutive blocks)."""
    if isinstance(blocks, int):
        return max(1, min(blocks, length))
    return max(blocks, default=1)


def buffered_forward(
    call: AttentionCall,
    block_q: Blocks,
    block_k: Blocks,
    *,
    fold: bool = False,
    q_ranges: list[Range] | None = None,
    v_ones: Any = None,
    out: Any = None,
    lse: Any = None,
) -> tuple[Any, Any]:
    """Attention output (..., Hq, Lq, Dv) and lse (..., Hq, Lq, 1): the tiled path, buffered.

    The same result as :func:`~portable_attn._lib._tiled.tiled_forward` with the
    same arguments (the same operations in the same order, in float32 or float64).

    Parameters
    ----------
    call : AttentionCall
        A prepared call of NumPy arrays in the compute dtype, with a value.
    block_q, block_k : int or tuple of int
        The tiles (an int, or the sizes of consecutive blocks).
    fold : bool, default False
        Take the row sums from ``P @ [V | 1]`` (decided by the path policy).
    q_ranges : list of (int, int), optional
        Compute only these query ranges (by default every block of `block_q`).
    v_ones : array, optional
        ``[V | 1]`` (:func:`~portable_attn._lib._scores.with_ones_column`), shared
        by the threads of one call; built in the workspace when `fold` and not given.
    out, lse : arrays (..., Hq, Lq, Dv) and (..., Hq, Lq, 1), optional
        Where the rows of `q_ranges` are written (the threads of one call share
        them); allocated here when not given.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    lse : array, shape (..., Hq, Lq, 1)
        ``-inf`` for rows with no visible key (and no sink).
    """
    plan = call.plan
    if q_ranges is None:
        q_ranges = block_ranges(plan.q_len, block_q)
    if out is None:
        out = call.zeros(plan.q_len, plan.value_dim)
    if lse is None:
        lse = call.zeros(plan.q_len, 1)
    return _walk([call], block_k, fold, q_ranges, [v_ones], out, lse)


def buffered_parts(
    calls: list[AttentionCall], block_q: Blocks, block_k: Blocks, *, fold: bool = False
) -> tuple[Any, Any]:
    """Attention of one set of queries over consecutive key parts, as one online softmax.

    Each call holds the same queries (and query-side arrays) and one part of the
    keys, placed at its absolute key positions (a Dask chunk pair:
    ``_partial.place_block``); a ``once_per_row`` field (the sink) is in the first
    call only. The result is the attention over every part's keys: the parts are
    walked as consecutive key blocks of one call, with no partial results to merge.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    lse : array, shape (..., Hq, Lq, 1)
        ``-inf`` for rows with no visible key (and no sink).
    """
    call = calls[0]
    plan = call.plan
    out = call.zeros(plan.q_len, plan.value_dim)
    lse = call.zeros(plan.q_len, 1)
    q_ranges = block_ranges(plan.q_len, block_q)
    return _walk(calls, block_k, fold, q_ranges, [None] * len(calls), out, lse)


@dataclasses.dataclass(frozen=True)
class _Keys:
    """One part of the keys a walk visits: its call, ``Kᵀ``, the values, its key blocks."""

    call: AttentionCall
    k_t: np.ndarray  # (..., Hkv, Dk, Lk_part): a view of the call's keys
    values: np.ndarray  # V, or [V | 1] with the row sums folded
    blocks: list[Range]
    hide_rows: bool  # something besides the band may hide entries or give -inf scores


def _walk(
    calls: list[AttentionCall],
    block_k: Blocks,
    fold: bool,
    q_ranges: list[Range],
    v_ones: list[Any],
    out: Any,
    lse: Any,
) -> tuple[Any, Any]:
    """Walk the query blocks of `q_ranges` over every key part of `calls`, into `out`, `lse`."""
    first = calls[0]
    width = first.plan.value_dim + (1 if fold else 0)
    shapes = [(*c.value.shape[:-1], width) for c in calls]
    build = [fold and given is None for given in v_ones]
    extra = sum(math.prod(shape) for shape, b in zip(shapes, build, strict=True) if b)
    bq = max((e - s for s, e in q_ranges), default=1)
    bk = max(_block_width(block_k, c.plan.kv_len) for c in calls)
    space = Workspace(first, bq, bk, width, extra)
    try:
        parts, offset = [], 0
        for call, shape, given, made in zip(calls, shapes, v_ones, build, strict=True):
            values = call.value if not fold else given
            if made:  # [V | 1] in the workspace
                values = space.arena_view("v_ones", offset, shape)
                offset += math.prod(shape)
                np.copyto(values[..., :-1], call.value)
                values[..., -1] = 1.0
            blocks = block_ranges(call.plan.kv_len, block_k)
            k_t = np.swapaxes(call.key, -1, -2)  # (..., Hkv, Dk, Lk): a view
            hide = hidden_by_value(call.bias, call.terms)
            parts.append(_Keys(call, k_t, values, blocks, hide))
        walk = _Walk(first, space, fold)
        for qs, qe in q_ranges:
            walk.rows((qs, qe), parts, out[..., qs:qe, :], lse[..., qs:qe, :])
    finally:
        space.release()
    return out, lse


class _Walk:
    """The online softmax of one query block at a time, in a :class:`Workspace`."""

    def __init__(self, call: AttentionCall, space: Workspace, fold: bool) -> None:
        self.call, self.space, self.fold = call, space, fold

    def rows(self, q_range: Range, parts: list[_Keys], out: np.ndarray, lse: np.ndarray) -> None:
        """Compute one query block over the visible key blocks of `parts` into `out`, `lse`."""
        call, space = self.call, self.space
        plan, terms = call.plan, call.terms
        visible = [
            (part, k_range, vis)
            for part in parts
            for k_range in part.blocks
            if (vis := pair_visibility(part.call.plan, part.call.terms, q_range, k_range))
            != "skip"
        ]
        qs, qe = q_range
        bq = qe - qs
        heads = (*plan.batch, plan.num_q_heads, bq)
        if not visible and terms.sinks is None:  # every key block hidden: zero rows
            zeros, empty = empty_result(call.xp, plan, None, rows=bq)
            np.copyto(out, zeros)
            np.copyto(lse, empty)
            return
        q_blk = call.query[..., qs:qe, :]
        q_rows = space.view(space.query, q_blk.shape)
        np.multiply(q_blk, plan.scale, out=q_rows)  # scale · Q: Lq·Dk, not Lq·Lk
        q_rows = _heads_to_rows(q_rows, plan.num_kv_heads)
        dv = plan.value_dim
        acc = space.view(space.acc, (*heads, dv + (1 if self.fold else 0)))
        m, l_sum, rows_seen = self._start(acc, heads)
        for part, k_range, vis in visible:
            m, l_sum, rows_seen = self._step(
                part, q_rows, acc, m, l_sum, rows_seen, q_range, k_range, vis
            )
        if self.fold:
            acc, l_sum = acc[..., :dv], acc[..., dv:]
        if terms.dropout_keep is not None:
            np.multiply(acc, terms.dropout_scale, out=acc)
        denominator = safe_denominator(_xp, l_sum)  # (..., Hq, bq, 1)
        m_safe = m if rows_seen else finite_shift(_xp, m)
        row_lse = m_safe + np.log(denominator)
        if not rows_seen:
            row_lse = np.where(l_sum == 0.0, -np.inf, row_lse)
        np.divide(acc, denominator, out=out)
        np.copyto(lse, row_lse)

    def _start(self, acc: np.ndarray, heads: tuple[int, ...]) -> tuple[Any, Any, bool]:
        """Return the state before the first key block: at the sink if any, else nothing."""
        sinks = self.call.terms.sinks
        if sinks is None:
            return None, None, False
        # the sink is a key with logit sink_h and a zero value (RowWalk.start)
        m = np.broadcast_to(sinks, (*heads, 1))
        l_sum = np.exp(sinks - finite_shift(_xp, m))  # (..., Hq, bq, 1)
        acc.fill(0.0)
        if not self.fold:
            return m, l_sum, False
        np.copyto(acc[..., -1:], l_sum)  # the denominator rides along as the last column
        return m, None, False

    def _scores(
        self, part: _Keys, q_rows: np.ndarray, q_range: Range, k_range: Range, vis: str
    ) -> np.ndarray:
        """One block's scores (..., Hq, bq, bk) in the workspace, hidden entries ``-inf``."""
        call, space = part.call, self.space
        plan, terms = call.plan, call.terms
        (qs, qe), (ks, ke) = q_range, k_range
        hkv, hq = plan.num_kv_heads, plan.num_q_heads
        xp = call.xp  # the portable score pipeline's helpers take the namespace
        rows = space.view(space.scores, (*plan.batch, hkv, q_rows.shape[-2], ke - ks))
        np.matmul(q_rows, part.k_t[..., ks:ke], out=rows)  # (..., Hkv, G*bq, bk)
        s = rows.reshape((*plan.batch, hq, qe - qs, ke - ks))  # a view: (..., Hq, bq, bk)
        if plan.softcap is not None:  # softcap · tanh(s / softcap)
            np.divide(s, plan.softcap, out=s)
            np.tanh(s, out=s)
            np.multiply(s, plan.softcap, out=s)
        if terms.score_mod is not None:  # its result may be anything: copied into ours
            head = arange(xp, 0, hq, plan.device)[:, None, None]
            q_idx = arange(xp, qs, qe, plan.device)[:, None]
            kv_idx = arange(xp, ks, ke, plan.device)[None, :]
            np.copyto(s, terms.score_mod(s.copy(), terms.batch_index, head, q_idx, kv_idx))
        bias = slice_block(call.bias, q_range, k_range)
        if bias is not None:
            np.add(s, bias, out=s)
        if terms.alibi_slopes is not None:
            distance = alibi_distance(xp, terms, plan, q_range, k_range)
            np.subtract(s, terms.alibi_slopes * distance, out=s)
        allowed = visible_entries(xp, terms, plan, q_range, k_range, vis)
        if allowed is not None:
            hidden = space.view(space.hidden, s.shape)
            np.logical_not(allowed, out=hidden)
            np.copyto(s, -np.inf, where=hidden)
        return s

    def _step(
        self,
        part: _Keys,
        q_rows: np.ndarray,
        acc: np.ndarray,
        m: Any,
        l_sum: Any,
        rows_seen: bool,
        q_range: Range,
        k_range: Range,
        vis: str,
    ) -> tuple[Any, Any, bool]:
        """Visit one key block (``RowWalk.step``, in place); return ``(m, l_sum, rows_seen)``."""
        space, terms = self.space, part.call.terms
        hkv = part.call.plan.num_kv_heads
        ks, ke = k_range
        s = self._scores(part, q_rows, q_range, k_range, vis)
        m_new = np.max(s, axis=-1, keepdims=True)  # (..., Hq, bq, 1)
        if m is not None:
            np.maximum(m, m_new, out=m_new)
        if rows_seen:  # m_new is finite in every row already
            m_safe = m_new
        else:  # a row hidden in every block so far: exp(-inf - finite) = 0
            m_safe = finite_shift(_xp, m_new)
            rows_seen = not part.hide_rows and vis == "full"
        np.subtract(s, m_safe, out=s)
        np.exp(s, out=s)  # the weights, (..., Hq, bq, bk)
        alpha = None if m is None else np.exp(m - m_safe)  # rescales the old sums
        p_rows = _heads_to_rows(s, hkv)
        v_blk = part.values[..., ks:ke, :]
        if not self.fold:
            p_sum = np.sum(s, axis=-1, keepdims=True)  # before dropout, as RowWalk
            keep = slice_block(terms.dropout_keep, q_range, k_range)
            if keep is not None:
                hidden = space.view(space.hidden, s.shape)
                np.logical_not(keep, out=hidden)
                np.copyto(s, 0.0, where=hidden)
            l_sum = p_sum if alpha is None else alpha * l_sum + p_sum
        # the first block's P V is the accumulator; later ones are added to it, rescaled
        target = acc if alpha is None else space.view(space.pv, acc.shape)
        np.matmul(p_rows, v_blk, out=_heads_to_rows(target, hkv))  # (..., Hkv, G*bq, Dv(+1))
        if alpha is not None:
            np.multiply(acc, alpha, out=acc)
            np.add(acc, target, out=acc)
        return m_new, l_sum, rows_seen


def _heads_to_rows(x: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """(..., Hq, L, D) to (..., Hkv, G*L, D): a view of a C-contiguous `x` (``heads_to_rows``)."""
    *batch, hq, rows, cols = x.shape
    return x.reshape((*batch, num_kv_heads, (hq // num_kv_heads) * rows, cols))

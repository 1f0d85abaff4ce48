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

import math
from typing import Any

import numpy as np

from .._lib._call import AttentionCall
from .._lib._masks import arange
from .._lib._path import Blocks
from .._lib._scores import (
    alibi_distance,
    allowed_block,
    empty_result,
    hidden_by_value,
    slice_block,
)
from .._lib._tiled import block_ranges, pair_visibility

__all__ = ["Workspace", "buffered_forward"]

Range = tuple[int, int]


class Workspace:
    """The buffers of one thread's block loop: flat arrays, carved into views per block.

    A view of the first ``prod(shape)`` elements of a flat buffer is C-contiguous
    whatever the shape, so the shorter last blocks (and the ``(..., Hkv, G*bq, bk)``
    row layout of grouped-query attention) reuse the same memory.
    """

    def __init__(self, call: AttentionCall, block_q: int, block_k: int, width: int) -> None:
        plan = call.plan
        dt = plan.compute_dtype
        rows = math.prod(plan.batch) * plan.num_q_heads * block_q
        self.scores = np.empty(rows * block_k, dtype=dt)  # scores, then weights, in place
        self.hidden = np.empty(rows * block_k, dtype=bool)  # the masks' complement
        self.acc = np.empty(rows * width, dtype=dt)  # the running weighted sum
        self.pv = np.empty(rows * width, dtype=dt)  # one block's P @ V
        self.query = np.empty(rows * plan.key_dim, dtype=call.query.dtype)  # scale * Q

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
        by the threads of one call; built here when `fold` and not given.
    out, lse : arrays (..., Hq, Lq, Dv) and (..., Hq, Lq, 1), optional
        Where the rows of `q_ranges` are written (the threads of one call share
        them); allocated here when not given.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    lse : array, shape (..., Hq, Lq, 1)
        ``-inf`` for rows with no visible key (and no sink).
    """
    plan, terms = call.plan, call.terms
    if q_ranges is None:
        q_ranges = block_ranges(plan.q_len, block_q)
    if out is None:
        out = call.zeros(plan.q_len, plan.value_dim)
    if lse is None:
        lse = call.zeros(plan.q_len, 1)
    if fold and v_ones is None:
        v = call.value
        v_ones = np.concatenate([v, np.ones((*v.shape[:-1], 1), dtype=v.dtype)], axis=-1)
    k_blocks = block_ranges(plan.kv_len, block_k)
    width = plan.value_dim + (1 if fold else 0)
    bq = max((e - s for s, e in q_ranges), default=1)
    space = Workspace(call, bq, _block_width(block_k, plan.kv_len), width)
    walk = _Walk(call, space, fold, v_ones, hidden_by_value(call.bias, terms))
    k_t = np.swapaxes(call.key, -1, -2)  # (..., Hkv, Dk, Lk): a view
    for q_range in q_ranges:
        qs, qe = q_range
        visible = [
            (k_range, vis)
            for k_range in k_blocks
            if (vis := pair_visibility(plan, terms, q_range, k_range)) != "skip"
        ]
        walk.rows(q_range, visible, k_t, out[..., qs:qe, :], lse[..., qs:qe, :])
    return out, lse


class _Walk:
    """The online softmax of one query block at a time, in a :class:`Workspace`."""

    def __init__(
        self, call: AttentionCall, space: Workspace, fold: bool, v_ones: Any, hide_rows: bool
    ) -> None:
        self.call, self.space, self.fold, self.hide_rows = call, space, fold, hide_rows
        self.v_ones = v_ones

    def rows(
        self,
        q_range: Range,
        visible: list[tuple[Range, str]],
        k_t: np.ndarray,
        out: np.ndarray,
        lse: np.ndarray,
    ) -> None:
        """Compute one query block over its `visible` key blocks into `out` and `lse` (views)."""
        call, space = self.call, self.space
        plan, terms = call.plan, call.terms
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
        for k_range, vis in visible:
            m, l_sum, rows_seen = self._step(
                q_rows, k_t, acc, m, l_sum, rows_seen, q_range, k_range, vis
            )
        if self.fold:
            acc, l_sum = acc[..., :dv], acc[..., dv:]
        if terms.dropout_keep is not None:
            np.multiply(acc, terms.dropout_scale, out=acc)
        denominator = np.where(l_sum == 0.0, 1.0, l_sum)  # (..., Hq, bq, 1)
        m_safe = m if rows_seen else np.where(m == -np.inf, 0.0, m)
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
        l_sum = np.exp(sinks - np.where(m == -np.inf, 0.0, m))  # (..., Hq, bq, 1)
        acc.fill(0.0)
        if not self.fold:
            return m, l_sum, False
        np.copyto(acc[..., -1:], l_sum)  # the denominator rides along as the last column
        return m, None, False

    def _scores(
        self, q_rows: np.ndarray, k_t: np.ndarray, q_range: Range, k_range: Range, vis: str
    ) -> np.ndarray:
        """One block's scores (..., Hq, bq, bk) in the workspace, hidden entries ``-inf``."""
        call, space = self.call, self.space
        plan, terms = call.plan, call.terms
        (qs, qe), (ks, ke) = q_range, k_range
        hkv, hq = plan.num_kv_heads, plan.num_q_heads
        xp = call.xp  # the portable score pipeline's helpers take the namespace
        rows = space.view(space.scores, (*plan.batch, hkv, q_rows.shape[-2], ke - ks))
        np.matmul(q_rows, k_t[..., ks:ke], out=rows)  # (..., Hkv, G*bq, bk)
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
        blocks = terms.segment_blocks  # host ids: a pair inside one document needs no id mask
        segments = blocks is None or not blocks.one_segment(q_range, k_range)
        full = vis == "full"
        allowed = allowed_block(
            xp,
            terms,
            plan,
            q_range,
            k_range,
            structural=not full,
            segments=segments,
            mask_mod=not full,
        )
        if allowed is not None:
            hidden = space.view(space.hidden, s.shape)
            np.logical_not(allowed, out=hidden)
            np.copyto(s, -np.inf, where=hidden)
        return s

    def _step(
        self,
        q_rows: np.ndarray,
        k_t: np.ndarray,
        acc: np.ndarray,
        m: Any,
        l_sum: Any,
        rows_seen: bool,
        q_range: Range,
        k_range: Range,
        vis: str,
    ) -> tuple[Any, Any, bool]:
        """Visit one key block (``RowWalk.step``, in place); return ``(m, l_sum, rows_seen)``."""
        call, space = self.call, self.space
        plan, terms = call.plan, call.terms
        hkv = plan.num_kv_heads
        ks, ke = k_range
        s = self._scores(q_rows, k_t, q_range, k_range, vis)
        m_new = np.max(s, axis=-1, keepdims=True)  # (..., Hq, bq, 1)
        if m is not None:
            np.maximum(m, m_new, out=m_new)
        if rows_seen:  # m_new is finite in every row already
            m_safe = m_new
        else:  # a row hidden in every block so far keeps max 0: exp(-inf) = 0
            m_safe = np.where(m_new == -np.inf, 0.0, m_new)
            rows_seen = not self.hide_rows and vis == "full"
        np.subtract(s, m_safe, out=s)
        np.exp(s, out=s)  # the weights, (..., Hq, bq, bk)
        alpha = None if m is None else np.exp(m - m_safe)  # rescales the old sums
        p_rows = _heads_to_rows(s, hkv)
        if self.fold:
            v_blk = self.v_ones[..., ks:ke, :]
        else:
            v_blk = call.value[..., ks:ke, :]
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

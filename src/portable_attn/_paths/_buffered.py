"""NumPy's workspace: the online softmax's block operations in buffers allocated once per call.

The portable walk (:func:`~portable_attn._lib._tiled.tiled_forward`) can only use the
array API, which has no ``out=``: every block of scores, of weights and of the
accumulator is a fresh array. NumPy hands each of those (1 MiB for 8 heads of 128 x
256 float32 scores) to glibc's ``malloc``, which maps the larger ones fresh and faults
their pages in, or not, depending on a threshold that moves with what the process
did before (issue 23: the same call measured 58 ms and 106 ms in one process; a Dask
worker ran at half the speed of one NumPy process).

:class:`Workspace` is the walk's hook for that (:class:`~portable_attn._lib._tiled.Ops`
in NumPy's terms): the same walk, the same operations in the same order, written
through ``out=`` into buffers carved from one arena per thread: the scores and
weights of one pair, a boolean block for the masks, the accumulator and ``P @ V``
of one query block, ``scale · Q`` and ``[V | 1]``. In steady state a block allocates
nothing larger than a row vector ((..., Hq, bq, 1): running max, rescale factor).
The router chooses it for NumPy (``Tiled(walk="buffered")``), which has no autodiff
to record the in-place writes; the threads and Dask's tasks on NumPy chunks run it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._lib import _route
from .._lib._blocks import block_ranges
from .._lib._call import AttentionCall
from .._lib._path import Blocks
from .._lib._tiled import Ops, tiled_forward

__all__ = ["Workspace", "buffered_forward"]

Range = tuple[int, int]

_LOCAL = threading.local()


class Workspace(Ops):
    """The buffers of one thread's walk, carved from one arena of bytes, and their ``out=`` ops.

    A view of the first ``prod(shape)`` elements of a flat buffer is C-contiguous
    whatever the shape, so the shorter last blocks (and the ``(..., Hkv, G*bq, bk)``
    row layout of grouped-query attention) reuse the same memory. The arena is the
    thread's own, kept between calls (:data:`~portable_attn._lib._route.KEEP_WORKSPACE_BYTES`);
    a call made while the thread's arena is in use (a ``score_mod`` that calls
    attention) gets an arena of its own.

    Parameters
    ----------
    call : AttentionCall
        The call whose queries are walked (NumPy arrays in the compute dtype).
    block_q, block_k : int
        The largest query and key blocks.
    width : int
        Columns of the accumulator: Dv, or Dv + 1 with the row sums folded.
    v_ones : int, default 0
        Elements of the ``[V | 1]`` arrays to build here (of every key part).
    """

    def __init__(
        self, call: AttentionCall, block_q: int, block_k: int, width: int, v_ones: int = 0
    ) -> None:
        super().__init__(call.xp)
        plan = call.plan
        dt = np.dtype(plan.compute_dtype)
        rows = math.prod(plan.batch) * plan.num_q_heads * block_q
        sizes = {
            "scores": (rows * block_k, dt),  # scores, then weights, in place
            "hidden": (rows * block_k, np.dtype(bool)),  # the masks' complement
            "acc": (rows * width, dt),  # the running weighted sum
            "pv": (rows * width, dt),  # one block's P @ V
            "query": (rows * plan.key_dim, np.dtype(call.query.dtype)),  # scale * Q
            "v_ones": (v_ones, dt),  # [V | 1] of each key part
        }
        align = _route.WORKSPACE_ALIGN
        offsets, total = {}, 0
        for name, (n, dtype) in sizes.items():
            offsets[name] = total
            total += -(-n * dtype.itemsize // align) * align
        self.arena, self.owns_thread_arena = self._take(total)
        self.buffers = {
            name: self.arena[offsets[name] : offsets[name] + n * dtype.itemsize].view(dtype)
            for name, (n, dtype) in sizes.items()
        }
        self._v_ones_used = 0

    @staticmethod
    def _take(nbytes: int) -> tuple[np.ndarray, bool]:
        """Return an arena of at least `nbytes`, and whether it is the thread's (now busy)."""
        if getattr(_LOCAL, "busy", False) or nbytes > _route.KEEP_WORKSPACE_BYTES:
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
            self.owns_thread_arena = False
            _LOCAL.busy = False

    def view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Return the first ``prod(shape)`` elements of buffer `name` as a C-contiguous array."""
        return self.buffers[name][: math.prod(shape)].reshape(shape)

    def query_rows(self, q_blk: Any, plan: Any) -> Any:
        rows = self.view("query", q_blk.shape)
        np.multiply(q_blk, plan.scale, out=rows)  # scale · Q: Lq·Dk, not Lq·Lk
        *batch, hq, bq, dk = rows.shape
        hkv = plan.num_kv_heads
        return rows.reshape((*batch, hkv, (hq // hkv) * bq, dk))

    def with_ones(self, call: AttentionCall) -> Any:
        shape = (*call.value.shape[:-1], call.value.shape[-1] + 1)
        n = math.prod(shape)
        values = self.buffers["v_ones"][self._v_ones_used : self._v_ones_used + n]
        self._v_ones_used += n
        values = values.reshape(shape)
        np.copyto(values[..., :-1], call.value)
        values[..., -1] = 1.0
        return values

    def scores(self, q_rows: Any, k_t: Any, shape: tuple[int, ...]) -> Any:
        rows = self.view("scores", (*shape[:-3], q_rows.shape[-3], q_rows.shape[-2], shape[-1]))
        np.matmul(q_rows, k_t, out=rows)  # (..., Hkv, G*bq, bk)
        return rows.reshape(shape)  # a view: (..., Hq, bq, bk)

    def cap(self, s: Any, softcap: Any) -> Any:
        np.divide(s, softcap, out=s)
        np.tanh(s, out=s)
        np.multiply(s, softcap, out=s)
        return s

    def modified(self, s: Any, score_mod: Any, *index: Any) -> Any:
        np.copyto(s, score_mod(s.copy(), *index))  # its result may be anything: copied in
        return s

    def add(self, s: Any, x: Any) -> Any:
        np.add(s, x, out=s)
        return s

    def hide(self, s: Any, allowed: Any) -> Any:
        hidden = self.view("hidden", s.shape)
        np.logical_not(allowed, out=hidden)
        np.copyto(s, -np.inf, where=hidden)
        return s

    def maximum(self, m: Any, m_blk: Any) -> Any:
        np.maximum(m, m_blk, out=m_blk)  # m_blk: a fresh row vector
        return m_blk

    def exp_shifted(self, s: Any, m: Any, owned: bool) -> Any:
        np.subtract(s, m, out=s)  # s is always a buffer of ours
        np.exp(s, out=s)
        return s

    def dropped(self, p: Any, keep: Any) -> Any:
        hidden = self.view("hidden", p.shape)
        np.logical_not(keep, out=hidden)
        np.copyto(p, 0.0, where=hidden)
        return p

    def matmul(self, p_rows: Any, v: Any, first: bool) -> Any:
        # the first block's P V is the accumulator; later ones are added to it, rescaled
        shape = (*np.broadcast_shapes(p_rows.shape[:-2], v.shape[:-2]), p_rows.shape[-2])
        target = self.view("acc" if first else "pv", (*shape, v.shape[-1]))
        np.matmul(p_rows, v, out=target)
        return target

    def rescaled(self, acc: Any, alpha: Any, pv: Any) -> Any:
        np.multiply(acc, alpha, out=acc)
        np.add(acc, pv, out=acc)
        return acc

    def write(self, target: Any, value: Any) -> None:
        np.copyto(target, value)


def _widest(blocks: Blocks, length: int) -> int:
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
    parts: list[AttentionCall] | None = None,
    v_ones: Any = None,
    out: Any = None,
    lse: Any = None,
) -> tuple[Any, Any]:
    """:func:`~portable_attn._lib._tiled.tiled_forward` of a NumPy call in a :class:`Workspace`.

    The same arguments and result (the same operations in the same order); `out` and
    `lse` are allocated here when not given.
    """
    plan = call.plan
    if q_ranges is None:
        q_ranges = block_ranges(plan.q_len, block_q)
    keyed = [call] if parts is None else parts
    width = plan.value_dim + (1 if fold else 0)
    built = 0
    if fold:
        built = sum(
            math.prod((*p.value.shape[:-1], width))
            for p in keyed
            if not (v_ones is not None and p is call)
        )
    bq = max((e - s for s, e in q_ranges), default=1)
    bk = max(_widest(block_k, p.plan.kv_len) for p in keyed)
    if out is None:
        out = call.zeros(plan.q_len, plan.value_dim)
    if lse is None:
        lse = call.zeros(plan.q_len, plan.stats_width)
    space = Workspace(call, bq, bk, width, built)
    return tiled_forward(
        call,
        block_q,
        block_k,
        fold=fold,
        q_ranges=q_ranges,
        parts=parts,
        v_ones=v_ones,
        ops=space,
        out=out,
        lse=lse,
    )

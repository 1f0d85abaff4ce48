"""Query blocks of the tiled path computed in parallel threads (NumPy: ``Tiled.workers``).

NumPy runs each elementwise op (``max``, ``-``, ``exp``) on one core, while its
BLAS runs the two matmuls of a block on all of them. The query blocks of the
tiled path are independent (each has its own running max, sum and output), so
:func:`threaded_attention` hands contiguous runs of them to a pool of threads:
NumPy releases the GIL inside ufuncs and BLAS calls, so the elementwise passes of
different blocks run on different cores at the same time. Each run is the buffered
walk itself (:func:`~._buffered.buffered_forward` with ``q_ranges=``) in a workspace
of its thread, writing its rows of one output, so the result is the tiled path's,
block for block.

To keep the threads from each starting a full set of BLAS threads
(oversubscription), the BLAS pools are limited to one thread for the duration of
the call (:mod:`threadpoolctl`; the router asks for threads only where it can).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._lib._blocks import block_ranges, host_pair_states
from .._lib._call import AttentionCall
from .._lib._cpu import blas_limited
from .._lib._path import Blocks, Tiled
from .._lib._scores import with_ones_column
from ._buffered import buffered_forward

__all__ = ["threaded_attention", "tile_map"]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """Return the process-wide pool for `workers` threads (started once, not per call)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="portable_attn")


def tile_map(workers: int) -> Any:
    """Return a ``map`` over independent tiles in `workers` threads (the builtin for 1).

    For :func:`portable_attn.block_mask.create_block_mask`, whose tiles are
    elementwise work that NumPy runs on one core with the GIL released.
    """
    return map if workers < 2 else _pool(workers).map


def _balanced_chunks(call: AttentionCall, q_ranges: list[Any], block_k: Blocks, n: int) -> list:
    """Split the query blocks into `n` contiguous runs of about equal work.

    The work of a query block is its number of visible key blocks (causal and
    window structure make it uneven); a run is a contiguous slice, so the
    outputs concatenate back in order.
    """
    states = host_pair_states(call, q_ranges, block_ranges(call.plan.kv_len, block_k))
    costs = [1 + len(row) - row.count(0) for row in states]
    runs: list[Any] = []
    total, start, done = sum(costs), 0, 0
    for i, cost in enumerate(costs):
        done += cost
        if done * n >= total * (len(runs) + 1) and len(runs) < n - 1:
            runs.append(q_ranges[start : i + 1])
            start = i + 1
    runs.append(q_ranges[start:])
    return [run for run in runs if run]


def threaded_attention(
    call: AttentionCall,
    path: Tiled,
    *,
    limit_blas: bool = True,
    tasks_per_worker: int = 1,
) -> tuple[Any, Any]:
    """Return the buffered walk's output (..., Hq, Lq, Dv) and lse, query blocks in threads.

    Parameters
    ----------
    call : AttentionCall
        A prepared call of NumPy arrays in the compute dtype, with a value.
    path : Tiled
        The tiles, the folding of the row sums and ``workers`` threads.
    limit_blas : bool, default True
        Limit BLAS to one thread per worker during the call.
    tasks_per_worker : int, default 1
        Runs of query blocks per worker (balanced by their visible key blocks).

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    lse : array, shape (..., Hq, Lq, 1)
        ``-inf`` for rows with no visible key (and no sink).
    """
    plan = call.plan
    block_q, block_k = path.block_q, path.block_k
    q_ranges = block_ranges(plan.q_len, block_q)
    n_runs = min(len(q_ranges), max(1, path.workers) * max(1, tasks_per_worker))
    workers = min(path.workers, n_runs)
    # the [V | 1] of the walk, built once and shared by every run
    v_ones = with_ones_column(call.xp, call.value, plan) if path.fold else None
    # one output of ours, each run writing its rows (no concatenation holding them twice)
    out = call.zeros(plan.q_len, plan.value_dim)
    lse = call.zeros(plan.q_len, plan.stats_width)

    def run(ranges: list[Any]) -> None:
        buffered_forward(
            call,
            block_q,
            block_k,
            fold=path.fold,
            q_ranges=ranges,
            v_ones=v_ones,
            out=out,
            lse=lse,
        )

    if workers <= 1:  # one worker, or one query block: the calling thread
        run(q_ranges)
        return out, lse
    runs = _balanced_chunks(call, q_ranges, block_k, n_runs)
    with blas_limited(limit_blas):
        list(_pool(workers).map(run, runs))
    return out, lse

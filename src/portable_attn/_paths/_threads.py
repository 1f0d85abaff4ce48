"""Query blocks of the tiled path computed in parallel threads (eager CPU libraries: NumPy).

NumPy runs each elementwise op (``max``, ``-``, ``exp``) on one core, while its
BLAS runs the two matmuls of a block on all of them. The query blocks of the
tiled path are independent (each has its own running max, sum and output), so
:func:`threaded_attention` hands them to a pool of threads: NumPy releases the
GIL inside ufuncs and BLAS calls, so the elementwise passes of different blocks
run on different cores at the same time. Each block is computed by the portable
:func:`portable_attn._lib._tiled.tiled_forward` itself (``q_ranges=``), so the
result is the tiled path's, block for block.

To keep ``workers`` threads from each starting a full set of BLAS threads
(oversubscription), the BLAS pools are limited to one thread for the duration of
the call when :mod:`threadpoolctl` is installed (an optional dependency; the
limit is process-wide while the call runs and restored afterwards).

This is the one backend-specific module for it: it is only called for NumPy
arrays without autodiff (no backward is needed or provided).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._lib._call import AttentionCall
from .._lib._compat import parallel_query_blocks
from .._lib._cpu import available_workers, blas_limited
from .._lib._path import Blocks, Tiled
from .._lib._scores import with_ones_column
from .._lib._tiled import block_ranges, pair_visibility, tiled_forward
from ._buffered import buffered_forward

__all__ = ["available_workers", "tile_map", "threaded_attention"]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """Return the process-wide pool for `workers` threads (started once, not per call)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="portable_attn")


def tile_map(xp: Any) -> Any:
    """Return a ``map`` over independent tiles: a thread per core for NumPy, else ``map``.

    For :func:`portable_attn.block_mask.create_block_mask`, whose tiles are
    elementwise work that NumPy runs on one core with the GIL released.
    """
    workers = available_workers()
    if workers < 2 or not parallel_query_blocks(xp.asarray(0)):
        return map
    return _pool(workers).map


def _balanced_chunks(call: AttentionCall, q_ranges: list[Any], block_k: Blocks, n: int) -> list:
    """Split the query blocks into `n` contiguous runs of about equal work.

    The work of a query block is its number of visible key blocks (causal and
    window structure make it uneven); a run is a contiguous slice, so the
    outputs concatenate back in order.
    """
    k_blocks = block_ranges(call.plan.kv_len, block_k)
    costs = [
        1 + sum(pair_visibility(call.plan, call.terms, qr, kr) != "skip" for kr in k_blocks)
        for qr in q_ranges
    ]
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
    """Compute the tiled path's output (..., Hq, Lq, Dv) and lse, its query blocks in threads.

    Computes exactly ``tiled_forward(call, path.block_q, path.block_k, fold=path.fold)``
    with the query blocks in ``path.workers`` threads; with ``path.buffered``, each
    thread runs :func:`~._buffered.buffered_forward` (the same blocks in reused
    buffers), writing its rows of one output.

    Parameters
    ----------
    call : AttentionCall
        A prepared call with NumPy arrays and a value (no autodiff).
    path : Tiled
        The tiles, the folding of the row sums and the threads; ``workers=1`` (or
        a single query block) computes in the calling thread.
        :func:`available_workers` gives the cores this process may use.
    limit_blas : bool, default True
        Limit BLAS to one thread per worker during the call (needs threadpoolctl;
        without it the BLAS threads are left as they are).
    tasks_per_worker : int, default 1
        Runs of query blocks per worker (balanced by their visible key blocks);
        more runs balance better on a machine with other load.

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
    if workers <= 1 and path.buffered:
        return buffered_forward(call, block_q, block_k, fold=path.fold)
    if workers <= 1:
        return tiled_forward(call, block_q, block_k, fold=path.fold)
    # the [V | 1] of the tiled path, built once and shared by every run
    v_ones = with_ones_column(call.xp, call.value, plan) if path.fold else None

    # One output array of ours, each query block written into its rows as it is done
    # (NumPy only: no concatenation holding every block twice).
    out = call.zeros(plan.q_len, plan.value_dim)
    lse = call.zeros(plan.q_len, 1)

    def run(ranges: list[Any]) -> None:
        if path.buffered:  # one workspace per thread, reused by its blocks
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
            return
        for q_range in ranges:
            block, block_lse = tiled_forward(
                call, block_q, block_k, fold=path.fold, q_ranges=[q_range], v_ones=v_ones
            )
            out[..., q_range[0] : q_range[1], :] = block
            lse[..., q_range[0] : q_range[1], :] = block_lse

    runs = _balanced_chunks(call, q_ranges, block_k, n_runs)
    with blas_limited(limit_blas):
        list(_pool(workers).map(run, runs))
    return out, lse

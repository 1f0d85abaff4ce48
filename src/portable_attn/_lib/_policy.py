"""Which path computes a call: the whole policy, in one place.

:func:`choose_path` returns a :data:`~portable_attn._lib._path.Path`; this module
imports no path, and no path imports it. Five paths compute the same exact attention:

======== ==============================================================================
path     what it is
======== ==============================================================================
Empty    no query or no key: zeros, nothing computed
Dense    one block: the (Lq, Lk) scores built once (``_lib/_dense.py``)
Tiled    the online softmax over (query block, key block) pairs (``_lib/_tiled.py``),
         O(L) memory, blocks hidden by causal/window structure skipped; NumPy's
         query blocks in threads (``_paths/_threads.py``)
Native   the framework's kernel with our masks and empty-row contract
         (``_paths/_native.py``)
DaskGrid Dask arrays: one task per (query chunk, key chunk) pair running the tiled
         path on the chunks, merged per query chunk by a tree (``_paths/_dask.py``)
======== ==============================================================================

How the path is chosen (`block_size`, `implementation`):

- An int or a pair `block_size` is the tiled path with those blocks, ``"dense"``
  the dense path: the caller's choice, never routed to a native kernel.
- ``implementation="native"`` always routes to the native kernel, or raises when
  the kernel cannot express the call (an int, pair or ``"dense"`` `block_size`
  asks for a portable path, so it cannot be native).
- ``block_size=None`` (the default) and its alias ``"auto"`` leave the path to
  this table, which picks the fastest exact path measured for the library, the
  shape and the arguments:

  0. Before any path is chosen, :func:`scaled_dot_product_attention` drops the keys
     that `kv_lengths` read on the host hide from every row (:func:`kept_keys`: a
     KV cache filled to 3584 of 4096 attends over 3584 keys), whatever the path; an
     exact cut, since lengths, not ``Lk``, align the rows.

  1. ``implementation=None`` on a library whose native kernel is fused
     (:func:`~._compat.fused_native_kernel`: torch SDPA) and a call the
     kernel can express (see :func:`unsupported_reason`: no softcap,
     ``score_mod``, ALiBi, dropout, sinks or ``return_lse``) with at least
     :data:`NATIVE_MIN_KEYS` keys (fewer lose a NaN of a query on torch CPU): the
     native kernel, with every mask in its own broadcast shape. Where block
     skipping (causal/window structure, host segment ids, a block mask) hides at
     least :data:`NATIVE_TILES_MIN_SKIP` of the (:data:`NATIVE_TILE`,
     :data:`NATIVE_TILE`) tile pairs, or a ``mask_mod`` is given, the kernel runs
     once per query tile over that tile's visible key span (``Native.tiles``),
     so the hidden tiles are not computed; causal alone on a square call stays
     one call (the kernel's causal flag skips the hidden half itself). A call the
     kernel per tile does not take and whose structure lets the tiled path skip at
     least :data:`SKIP_FRACTION_FOR_TILED` of its pairs takes the tiled path.
  2. Dask arrays (checked before the explicit `block_size` choices, which they
     keep): one task per (query chunk, key chunk) pair, which runs the tiled
     path of NumPy (CuPy) on the chunks themselves with :data:`EAGER_TILES`
     inside the pair (an int or pair `block_size`: those tiles; ``"dense"``: one
     block per pair), so no task holds more than one chunk pair of scores and a
     (1, H, 1024, 64) chunk is as fast per core as NumPy; the partials of a query
     chunk are merged :data:`DASK_MERGE_FAN_IN` at a time.
  3. Otherwise dense while the dense logits fit in :data:`AUTO_DENSE_LIMIT_BYTES`
     (:data:`AUTO_DENSE_LIMIT_BYTES_MULTITHREADED` for libraries with
     multi-threaded elementwise kernels, :data:`BUFFERED_DENSE_LIMIT_BYTES` for
     NumPy, whose tiled path runs in reused buffers: ``Tiled.buffered``), tiled
     above with :data:`EAGER_TILES` (NumPy, and Dask's NumPy chunk pairs:
     :func:`buffered_tiles`),
     or, for traced libraries (JAX), :data:`LOOP_TILES` (:data:`LOOP_WINDOW_TILES`
     under a window) as a traced loop (rule 6)
     or, below :data:`LOOP_MIN_SCORE_BYTES`, at least :data:`TRACED_MIN_BLOCK`
     and at most :data:`TRACED_MAX_BLOCKS` blocks per axis, unrolled.
  4. On the tiled path, libraries whose elementwise ops run on one core and
     release the GIL (:func:`~._lib._compat.parallel_query_blocks`: NumPy) run
     their query blocks in one thread per core once the dense scores would pass
     :data:`THREADS_MIN_SCORE_BYTES`, when BLAS threads can be limited meanwhile
     (threadpoolctl), so that the threads do not oversubscribe the cores.
  5. The dense and tiled paths of eager libraries take the row sums of the
     weights from ``P @ [V | 1]`` (:func:`fold_row_sums`) where that pays. The
     dense path divides the ``(Lq, Dv)`` output by the row sums, except where a
     compiler fuses the softmax into ``P @ V`` (JAX): there it divides the weights
     before ``P @ V`` (:func:`dense_weights_first`).
  6. Traced libraries (JAX) run the tiled path of a call with at least
     :data:`LOOP_MIN_SCORE_BYTES` of dense scores as a traced loop
     (``Tiled.loop``: ``lax.map`` / ``fori_loop``, ``_paths/_loop.py``): the
     program and its live buffers stay O(1) in the number of blocks, which an
     unrolled Python loop is not (under ``jax.jit`` it kept 5 GiB alive at
     L = 16384, and 11 GiB for ``jit(grad)``: issue 21's table), and which it
     outran at every length measured (``LOOP_MIN_SCORE_BYTES`` cites the figures);
     below, the dense path runs, or the unrolled program between the two limits.
  7. Half precision (float16, bfloat16) accumulates in float32 on every path, but
     only the paths that need it get float32 copies of Q, K and V: a native kernel
     that accumulates in float32 itself takes them in their dtype where
     :data:`NATIVE_HALF_ROUTES` measured that faster (:func:`native_upcasts`), and
     the dense path takes FlashAttention's form where the library has a
     float32-accumulating half matmul and :data:`PORTABLE_HALF_FLASH` measured it
     faster (:func:`dense_flash_form`). Everything else casts to float32 first.

The thresholds below are the only copies; each cites the measurement behind it.
"""

from __future__ import annotations

import math
from typing import Any

from . import _validation as v
from ._call import AttentionCall
from ._compat import (
    builds_task_graphs,
    chunk_sizes,
    device_kind,
    fused_native_kernel,
    fuses_softmax_into_matmul,
    has_native_kernel,
    library_name,
    matmul_float32,
    multithreaded_elementwise,
    native_kernel_needs_equal_dims,
    parallel_query_blocks,
    reuses_buffers,
    traces_python_loops,
)
from ._cpu import available_workers, can_limit_blas, has_float16_arithmetic
from ._path import Blocks, DaskGrid, Dense, Empty, Native, Path, Tiled
from ._scores import block_visibility
from ._tiled import block_ranges, pair_visibility

__all__ = [
    "AUTO_DENSE_LIMIT_BYTES",
    "AUTO_DENSE_LIMIT_BYTES_MULTITHREADED",
    "BUFFERED_BLOCK_SCORES",
    "BUFFERED_DENSE_LIMIT_BYTES",
    "BUFFERED_TILE",
    "DASK_MERGE_FAN_IN",
    "DASK_TASK_SCORES",
    "EAGER_TILES",
    "SKIP_FRACTION_FOR_TILED",
    "THREADS_MIN_SCORE_BYTES",
    "LOOP_MIN_SCORE_BYTES",
    "LOOP_TILES",
    "LOOP_WINDOW_TILES",
    "NATIVE_TILE",
    "NATIVE_TILES_MIN_SKIP",
    "MASK_LOOP_MIN_TILE",
    "TRACED_MAX_BLOCKS",
    "TRACED_MIN_BLOCK",
    "FLOAT16_CPU_ROUTES",
    "NATIVE_HALF_ROUTES",
    "PORTABLE_HALF_FLASH",
    "choose_path",
    "buffered_tiles",
    "default_tiles",
    "dense_flash_form",
    "native_upcasts",
    "runs_as_loop",
    "fold_row_sums",
    "kept_keys",
    "skipped_fraction",
    "unsupported_reason",
]

#: ``block_size="auto"`` keeps the dense path while its logits would take at most
#: this many bytes (batch x Hq x Lq x Lk x 4, or x 8 for float64), and tiles above.
#: NumPy: dense and tiled are within a factor of 1.7 either way at L = 1024-8192
#: without causal masking, while the tiled path's memory is O(L)
#: (benchmarks/results/history/tiled.json and bench-numpy.json, measured at 529c890
#: and 5bf34e7).
AUTO_DENSE_LIMIT_BYTES = 64 * 2**20
#: The same limit for libraries whose eager elementwise kernels are multi-threaded
#: (torch): its dense path measured 1.7-2.6x (non-causal) and 2.8-6.1x (causal)
#: slower than its tiled path at L = 512-8192 (B=1, H=8, D=64:
#: benchmarks/results/history/bench-torch.json, at 5bf34e7), while at L = 128 (0.5 MiB)
#: dense is the faster of the two.
AUTO_DENSE_LIMIT_BYTES_MULTITHREADED = 4 * 2**20
#: ``(block_q, block_k)`` of ``"auto"`` for eagerly executed libraries: two
#: (H, 128, 256) float32 score blocks (1 MiB each for H = 8) stay cache-friendly.
EAGER_TILES = (128, 256)
#: NumPy (``Tiled.buffered``: the block loop in reused buffers, ``_paths/_buffered.py``)
#: keeps the dense path only while its logits take at most this many bytes (L = 256 at
#: B=1, H=8): tiled over dense was 1.27 / 1.07 / 0.98 at L = 64 / 128 / 256 and 0.59 /
#: 0.78 at L = 512 / 1024 (benchmarks/results/targets.json, numpy group, at 63874a5).
BUFFERED_DENSE_LIMIT_BYTES = 2 * 2**20
#: The tiles of the buffered tiled path: query tiles of this many rows (fewer for a
#: shorter Lq) ...
BUFFERED_TILE = 256
#: ... and key tiles of BUFFERED_TILE, widened while the query tile is shorter to hold
#: this many scores per (batch, head): a decoding step (Lq = 1) takes 4096 keys in
#: one block. Chosen from hand runs of 64-256 x 256-512 tiles at L = 128-4096 (256 x
#: 256 was the fastest or within noise of it on causal calls, and within 10% on plain
#: ones; one query row over 4096 keys ran 20% faster in one block than in 16); the
#: default call's figures are in benchmarks/results/targets.json, numpy group.
BUFFERED_BLOCK_SCORES = 256 * 256
#: The default routes a call the fused native kernel could take whole (and not per
#: tile) to the tiled path instead when causal/window structure hides at least this
#: fraction of the (query block, key block) pairs of EAGER_TILES: torch, window
#: (256, 0) + causal at L = 4096 skips 88% of the pairs (before the kernel per tile:
#: benchmarks/results/cases-torch.json); causal alone skips 38-47% (L = 1024-4096),
#: where the kernel stays faster.
SKIP_FRACTION_FOR_TILED = 0.75
#: Query tile (and key tile) of the native kernel run per tile (``Native.tiles``, rule 1),
#: chosen from hand runs, not a results file: of 128, 256 and 512 rows, torch SDPA per
#: 256-row tile over its visible key span (with the span's mask) was the fastest on a
#: packed-document causal call (4 x 1024 in 4096, B=1, H=8, D=64). The default call's
#: figures are in benchmarks/results/flex.json and cases-torch.json.
NATIVE_TILE = 256
#: ... and is chosen over one whole kernel call when block skipping hides at least this
#: fraction of the (NATIVE_TILE, NATIVE_TILE) tile pairs.
NATIVE_TILES_MIN_SKIP = 0.5
#: The fewest keys a call needs for the default route to the native kernel, per
#: ``(library, device kind)``: torch 2.13 CPU SDPA returns zeros, not NaN, for a query row
#: holding a NaN when Lk < 16 and no ``attn_mask`` is given (float16 to float64 at some
#: sizes; D = 16-128; any Lq), against the contract that NaN propagates; from 16 keys on
#: it propagates. Such small whole calls take the portable path
#: (``implementation="native"`` still asks for the kernel as it is). The kernel per query
#: tile (``Native.tiles``) can still give it a part of fewer keys: not covered yet.
NATIVE_MIN_KEYS: dict[tuple[str, str], int] = {("torch", "cpu"): 16}
#: NumPy's tiled path runs its query blocks in threads from this many bytes of dense
#: scores (B x Hq x Lq x Lk x itemsize): on 2 cores, 2 threads with BLAS limited to
#: one thread each took 0.71 (plain) / 0.77 (causal) of the single-threaded time at
#: L = 4096 and 0.91 / 0.97 at L = 2048 (128 MiB, H = 8), but 1.07 / 1.13 at L = 1024
#: (benchmarks/results/threads.json, benchmarks/threads.py).
THREADS_MIN_SCORE_BYTES = 128 * 2**20
#: Dask merges the partials of one query chunk (one per visible key chunk) this many
#: at a time, as a tree: a merge task holds that many (..., Hq, bq, Dv) partials, which
#: stays under one chunk pair of scores (..., Hq, bq, bk) while 4 Dv <= bk, and a query
#: chunk over n key chunks costs about n / 3 merge tasks.
DASK_MERGE_FAN_IN = 4
#: Consecutive visible chunk pairs of one query chunk share one Dask task (which merges
#: them itself) until the task holds this many scores: a task costs about 2 ms
#: of scheduling whatever it computes, more than a (1, 8, 256, 256) pair computes, while
#: a (1, 8, 1024, 1024) pair (8 Mi scores) stays a task of its own
#: (benchmarks/results/targets.json: tasks per call, per-task overhead, throughput).
DASK_TASK_SCORES = 4 * 2**20
#: ``(block_q, block_k)`` of the traced loop (rule 6), clipped to the lengths. A loop
#: step carries the online softmax (no per-step merge), so it costs about what its
#: block computes; smaller blocks skip more of the causal half. Chosen from hand runs,
#: not a results file (B=1, H=8, D=64, float32, jax.jit, L = 4096 and 8192, causal and
#: plain, forward and jit(grad); blocks of 256, 512 and 1024): 512 was the fastest or
#: within noise of it in each; benchmarks/results/loop.json measures these tiles.
LOOP_TILES = (512, 512)
#: ... and of a call with a window (a left bound of the band): most of a 512 block lies
#: outside a narrow band, so the loop takes blocks of this size there, chosen from the
#: same hand runs (window (256, 0) + causal at L = 4096: 256 was the fastest of the three).
LOOP_WINDOW_TILES = (256, 256)
#: Traced libraries run the tiled path as a traced loop from this many bytes of dense
#: scores (B x Hq x Lq x Lk x itemsize; L = 2048 for B=1, H=8 in float32), below which
#: the dense path (AUTO_DENSE_LIMIT_BYTES) or, between the two, the unrolled program
#: runs. Measured (benchmarks/results/loop.json at 543f13a, causal, B=1, H=8, D=64,
#: float32, jax.jit, each case in a fresh process), loop against unrolled: at L = 2048,
#: 0.043 s against 0.126 s forward and 0.15 s against 0.29 s for jit(grad); at 4096,
#: 0.137 s against 0.278 s and 0.47 s against 0.75 s, compiled in 0.26 s against 2.3 s,
#: with 100 / 208 MiB of extra peak RSS against 602 / 1444 MiB; at 8192, 0.46 s
#: against 0.74 s (1.7 s against 3.0 s for the gradient).
LOOP_MIN_SCORE_BYTES = 128 * 2**20
#: A traced block mask runs the traced loop whatever the length (only the loop can
#: skip by value), in tiles of whole state blocks of at least this size, chosen from
#: hand runs, not a results file (B=1, H=8, L=4096, D=64, float32, states of 128,
#: jax.jit; tiles of 128, 256 and 512): larger tiles suit the 4 causal documents of
#: 1024 (fewer loop steps), smaller ones the causal window of 256 (less work outside
#: the band); 256 was close to the faster of the three on both. The default
#: call's figures are in benchmarks/results/flex.json.
MASK_LOOP_MIN_TILE = 256
#: Below LOOP_MIN_SCORE_BYTES a traced library unrolls the Python loop into the
#: program: blocks of at least this size ...
TRACED_MIN_BLOCK = 256
#: ... and at most this many blocks per axis keep compile time bounded.
TRACED_MAX_BLOCKS = 16
#: Half-precision inputs of a native kernel: ``(library, device kind, dtype)`` -> whether
#: they reach the kernel in their own dtype (True) or as float32 copies (False); a
#: route not listed upcasts. Each kernel below accumulates Q Kᵀ and P V in float32
#: and runs its softmax in float32, so both routes keep the contract; the table keeps
#: the faster. Measured in benchmarks/results/half-torch.json and half-jax.json
#: (benchmarks/half.py: B=1, H=8, D=64, L = 1024-4096, each length in a fresh process,
#: interleaved medians, max error against float64 beside SDPA's own):
#:
#: - torch CPU bfloat16: SDPA's CPU flash kernel takes bfloat16 with float32
#:   accumulators (``accum_t = opmath_type``); the float32 copies cost 7-21% at
#:   L = 1024-2048 and 31 MiB of peak memory at L = 4096 (issue 25, e325749), for the
#:   same error. Own dtype.
#: - torch CPU float16: on a CPU without float16 arithmetic SDPA in float16 is slow:
#:   the float32 route ran at 0.63-0.74x of SDPA in float16 at L = 1024-4096 in all but
#:   one row (half-torch.json at cb3194b; the first row of its process, plain at
#:   L = 1024, at 1.22x there and 0.64x in the run at e2a084f). Upcast, except on a CPU
#:   with float16 arithmetic (:data:`FLOAT16_CPU_ROUTES`).
#: - torch CUDA bfloat16 / float16: the flash, memory-efficient and cuDNN kernels
#:   take half precision only (float32 falls back to the math kernel) and accumulate
#:   in float32. Own dtype; not yet timed here: benchmarks/gpu.sh measures both routes
#:   and the kernel torch selects.
#: - JAX (``implementation="native"`` only; the default is the portable path):
#:   ``jax.nn.dot_product_attention``'s XLA form takes the products with
#:   ``preferred_element_type=float32`` and a float32 softmax. Own dtype, except
#:   float16 on a CPU: under ``jax.jit`` (and so every eager call, which runs
#:   compiled: ``_paths/_compiled.py``) XLA CPU refuses it ("The precision
#:   'F16_F16_F32' is not supported by dot_general on CPU", jax 0.10.2). Upcast.
NATIVE_HALF_ROUTES: dict[tuple[str, str, str], bool] = {
    ("torch", "cpu", "bfloat16"): True,
    ("torch", "cpu", "float16"): False,
    ("torch", "cuda", "bfloat16"): True,
    ("torch", "cuda", "float16"): True,
    ("jax", "cpu", "bfloat16"): True,
    ("jax", "cpu", "float16"): False,
    ("jax", "gpu", "bfloat16"): True,
    ("jax", "gpu", "float16"): True,
}
#: Routes of :data:`NATIVE_HALF_ROUTES` that take the input dtype instead on a CPU with
#: float16 arithmetic (AVX512-FP16 or AMX-FP16: :func:`~._cpu.has_float16_arithmetic`).
#: torch CPU float16 on such a CPU (AVX512-FP16; half-torch.json at 12f45a8, L = 1024-4096,
#: plain / causal / padding): the float32 route ran at 0.98-1.17x SDPA in float16 (above
#: 1.05x in 4 rows of 9, all at L <= 2048; 0.98-1.07x at 538c7b4), the float16 route at
#: 0.99-1.02x; the float32 route's max error against float64 was 0.83-1.0x SDPA's.
FLOAT16_CPU_ROUTES = frozenset({("torch", "cpu", "float16")})
#: The dense path's half-precision form per ``(library, device kind)``: True is
#: FlashAttention's form (half products accumulated in float32, float32 softmax,
#: probabilities cast back for ``P @ V``: :class:`~._path.Dense` `flash`), False (and
#: unlisted) casts Q, K and V to float32 first. JAX CPU bfloat16 under ``jit``, L = 1024
#: (dense): FlashAttention's form is faster than the upcast with an error within the
#: contract's bound (benchmarks/results/half-jax.json). GPUs: not yet measured
#: (benchmarks/gpu.sh times both forms), so today's upcast stays.
PORTABLE_HALF_FLASH: dict[tuple[str, str], bool] = {("jax", "cpu"): True}


#: The paths :func:`choose_path` decided, by :func:`_path_key`, with the plan they were
#: decided for: a repeated eager call skips the rules, part of the route's Python that
#: took 36 us per call in a loop and 138 us right after a kernel (issue 25,
#: benchmarks/results/per-call-torch.json).
_PATHS: dict[Any, tuple[Any, Path]] = {}
_PATHS_SIZE = 256
#: Tests set this: a cached path is decided again and compared, so that a policy
#: setting changed by a test (``monkeypatch``) after a call cannot go unnoticed.
CHECK_CACHED_PATHS = False


def forget_paths() -> None:
    """Drop every cached path (:data:`_PATHS`): after a policy setting changes."""
    _PATHS.clear()


def choose_path(
    call: AttentionCall, block_size: Any, implementation: Any, *, return_lse: bool = False
) -> Path:
    """Decide how `call` is computed (see the module docstring for the rules).

    `return_lse`: the caller needs the row log-sum-exp too (no native kernel gives it).

    A call like one decided before (:func:`_path_key`) takes the same path again
    without the rules.

    Raises
    ------
    ValueError
        A `block_size` or `implementation` that is not one of the documented
        values, or ``implementation="native"`` for a call the kernel cannot express.
    """
    key = _path_key(call, block_size, implementation, return_lse)
    hit = None if key is None else _PATHS.get(key)
    if hit is not None and hit[0] is call.plan:
        if CHECK_CACHED_PATHS:
            decided = _decide_path(call, block_size, implementation, return_lse)
            if decided != hit[1]:
                msg = f"cached path {hit[1]!r} but the policy says {decided!r}: forget_paths()"
                raise AssertionError(msg)
        return hit[1]
    path = _decide_path(call, block_size, implementation, return_lse)
    if key is not None and isinstance(path, (Native, Dense, Empty)):
        if len(_PATHS) >= _PATHS_SIZE:
            _PATHS.clear()
        _PATHS[key] = (call.plan, path)
    return path


def _path_key(call: AttentionCall, block_size: Any, implementation: Any, return_lse: bool) -> Any:
    """Return what the rules read of a call where that is its static facts, else None.

    The plan's identity stands for the call's signature (types, shapes, dtypes,
    devices, scalar options: :func:`~._call.prepare` makes one plan per signature,
    and the cache holds it, so its id is not reused), with the dtypes of Q, K, V and
    the bias (a derived call may cast them under the same plan) and whether a mask
    and bias are given. Calls with other score terms (lengths, segment ids, a
    ``mask_mod``, ...) are decided each time: the rules read their host values.
    Only native, dense and empty paths are cached: the tiled path's threads follow
    the cores this process may use now, and Dask's grid its chunks.
    """
    terms, plan = call.terms, call.plan
    if v.array_or_none(plan.scale) is not None or v.array_or_none(plan.softcap) is not None:
        return None  # a learned scale or cap: a plan of this call only (a tracer in jit)
    if (
        terms.kv_lengths is not None
        or terms.q_lengths is not None
        or terms.alibi_slopes is not None
        or terms.score_mod is not None
        or terms.dropout_keep is not None
        or terms.sinks is not None
        or terms.q_segments is not None
        or terms.mask_mod is not None
        or terms.block_states is not None
    ):
        return None
    bias = call.bias
    value = call.value
    try:
        key = (
            id(call.plan),
            call.query.dtype,
            call.key.dtype,
            None if value is None else value.dtype,
            None if bias is None else bias.dtype,
            terms.mask is None,
            # block_size with its type (and its entries'): 1 == 1.0 == True, one invalid
            type(block_size),
            block_size,
            tuple(map(type, block_size)) if type(block_size) is tuple else None,
            implementation,
            return_lse,
        )
        hash(key)
    except TypeError:  # an unhashable block_size: decided each time
        return None
    return key


def _decide_path(
    call: AttentionCall, block_size: Any, implementation: Any, return_lse: bool
) -> Path:
    """:func:`choose_path` by the rules."""
    v.check_implementation(implementation)
    sizes = v.check_block_size(block_size)  # "auto", "dense" or (block_q, block_k)
    if implementation == "native":
        explicit = sizes != "auto"  # the caller asked for a portable path
        reason = unsupported_reason(call, explicit_block_size=explicit, return_lse=return_lse)
        v.check_native_route(reason)
    if call.is_empty:
        return Empty()
    if implementation == "native":
        return Native(native_upcasts(call))
    if builds_task_graphs(call.query):
        return _dask_path(call, sizes)
    fold = fold_row_sums(call)
    if sizes == "dense":
        return Dense(fold, dense_flash_form(call), dense_weights_first(call))
    loop = runs_as_loop(call)  # rule 6: JAX runs long calls' blocks as a traced loop
    if isinstance(sizes, tuple):
        return Tiled(*sizes, fold=fold, loop=loop, buffered=reuses_buffers(call.query))
    if implementation is None:
        native = _native_route(call, return_lse)
        if native is not None:
            return native
    tiles = _auto_tiles(call)
    if tiles is None:
        return Dense(fold, dense_flash_form(call), dense_weights_first(call))
    buffered = reuses_buffers(call.query)
    return Tiled(*tiles, fold=fold, workers=_workers(call), loop=loop, buffered=buffered)


def kept_keys(call: AttentionCall) -> int | None:
    """Rule 0: how many leading keys `call` needs, when `kv_lengths` hide the rest.

    With `kv_lengths` read on the host (``ScoreTerms.kv_length_values``: NumPy, torch
    CPU) no row sees a key at or past the largest length, so the keys from there
    on are computed by no path: return that length (at least 1, so gradients still
    reach K and V as zeros), or None when every key may be seen. The cut call is
    the same whole call, with lengths, not ``Lk``, aligning its rows
    (``i' = i + kv_len - q_len``); every array with a key axis is cut with the keys.
    Not with what is laid out over the whole key axis on the host: segment ids
    (their block skipper) and a ``mask_mod`` or block mask (its block states).
    """
    terms = call.terms
    values = terms.kv_length_values
    if values is None or call.plan.align is not None:
        return None
    if terms.q_segments is not None or terms.mask_mod is not None:
        return None
    keep = max(1, max(values))
    return keep if keep < call.plan.kv_len else None


def unsupported_reason(
    call: AttentionCall,
    *,
    explicit_block_size: bool = False,
    return_lse: bool = False,
    per_tile: bool = False,
) -> str | None:
    """Why `call` cannot go to its library's native kernel, or None when it can.

    `explicit_block_size` is an int, a pair or "dense": a request for a portable
    tiled path. `return_lse`: neither kernel returns the log-sum-exp publicly.
    `per_tile`: the kernel runs per query tile (``Native.tiles``), where a
    ``mask_mod`` is evaluated into each tile's mask.
    torch SDPA and ``jax.nn.dot_product_attention`` (which needs Dv == Dk) take
    masks, bias, lengths, windows, segment ids and GQA.
    """
    plan, terms = call.plan, call.terms
    if not has_native_kernel(call.query):
        lib = library_name(call.query)
        return f"there is no native attention kernel for {lib} arrays (torch and jax only)"
    unsupported = [
        name
        for name, used in (
            ("softcap", plan.softcap is not None),
            ("score_mod", terms.score_mod is not None),
            ("mask_mod (or block_mask)", terms.mask_mod is not None and not per_tile),
            ("alibi_slopes", terms.alibi_slopes is not None),
            ("dropout_mask", terms.dropout_keep is not None),
            ("sinks", terms.sinks is not None),
            ("return_lse", return_lse),
            ("an explicit block_size (a portable path)", explicit_block_size),
        )
        if used
    ]
    if unsupported:
        return f"the native kernel cannot express {', '.join(unsupported)}"
    if native_kernel_needs_equal_dims(call.query) and plan.value_dim != plan.key_dim:
        return (
            "jax.nn.dot_product_attention needs `value` axis -1 (Dv) == `key` axis -1 "
            f"(Dk), but got Dv={plan.value_dim} and Dk={plan.key_dim}"
        )
    return None


def fold_row_sums(call: AttentionCall, q_len: int | None = None) -> bool:
    """Rule 5: take the row sums of P from ``P @ [V | 1]`` instead of a pass over P.

    Not with dropout (it drops weights from ``P V`` but not from the sums), and
    not for traced libraries (JAX): XLA fuses the sum into the ``exp`` pass
    already, and the wider matmul measured 4-11% slower under ``jax.jit``.
    Eager libraries save one pass over every (bq, bk) block (NumPy: 3-7%), but
    building ``[V | 1]`` copies V: it pays only when each K/V head has more query
    rows (G * Lq) than V has columns (decoding, Lq = 1, copied V for nothing).
    `q_len`: the queries of one task (a Dask chunk), by default the call's.
    """
    plan = call.plan
    rows = plan.groups * (plan.q_len if q_len is None else q_len)
    return (
        call.terms.dropout_keep is None
        and not traces_python_loops(call.query)
        and rows > plan.value_dim
    )


def _half_input_dtype(call: AttentionCall) -> str | None:
    """``"float16"`` / ``"bfloat16"`` when Q, K, V (and a bias) all have that dtype, else None.

    Mixed dtypes, a float32 bias beside half Q (the kernel would round it to half
    precision) and a learned `scale` (a float32 array) keep the float32 route.
    """
    xp, plan = call.xp, call.plan
    dt = plan.result_dtype
    if dt == plan.compute_dtype or v.array_or_none(plan.scale) is not None:
        return None  # float32 / float64, or a learned temperature
    arrays = (call.query, call.key, call.value, call.bias)
    if any(x is not None and x.dtype != dt for x in arrays):
        return None
    for name in ("bfloat16", "float16"):
        if getattr(xp, name, None) is not None and dt == getattr(xp, name):
            return name
    return None


def native_upcasts(call: AttentionCall) -> bool:
    """Rule 6: whether the native kernel gets float32 copies of half Q, K, V.

    True unless :data:`NATIVE_HALF_ROUTES` (or :data:`FLOAT16_CPU_ROUTES`, on a CPU
    with float16 arithmetic) routes the library, device kind and dtype to the kernel
    in the input dtype (and there is no float32 copy to avoid).
    """
    half = _half_input_dtype(call)
    if half is None:
        return True
    route = (library_name(call.query), device_kind(call.query), half)
    if route in FLOAT16_CPU_ROUTES and has_float16_arithmetic():
        return False
    return not NATIVE_HALF_ROUTES.get(route, False)


def dense_weights_first(call: AttentionCall) -> bool:
    """Rule 5: whether the dense path divides the weights, not the output, by the row sums.

    Where XLA fuses the softmax into ``P @ V`` (:func:`~._compat.fuses_softmax_into_matmul`)
    it compiles ``(P / l) @ V`` into one kernel, and ``(P @ V) / l`` into a slower one:
    under ``jax.jit``, B=1, H=8, D=64, L=1024, the output form ran 1.18-1.22x the
    weights form (plain, causal, padding, both), and 1.04x at B=2, L=512 with padding
    (benchmarks/results/xla-forms.json). Eager libraries run each operation on its
    own, where dividing the (Lq, Dv) output is cheaper than the (Lq, Lk) weights.

    Not in FlashAttention's form (:func:`dense_flash_form`), whose ``P`` is rounded to
    the half dtype for ``P @ V``: before the division every row's largest weight is
    exactly 1, which half precision holds exactly, so the keys that dominate a row
    lose nothing; rounding the divided weights instead gave 2.3x (plain) and 1.6x
    (causal) the max error against float64 of ``jax.nn`` in bfloat16 at L = 1024
    (benchmarks/results/history/half-jax-23f1316.json). That form ran at 0.48 / 0.58x
    ``jax.nn`` there, the output form at 0.69 / 0.75x (its ``dense_flash_form`` rows):
    accuracy is bought with 1.3-1.4x the time, still well under ``jax.nn``'s.
    """
    return fuses_softmax_into_matmul(call.query) and not dense_flash_form(call)


def dense_flash_form(call: AttentionCall) -> bool:
    """Rule 6: whether the dense path computes half inputs in FlashAttention's form."""
    if _half_input_dtype(call) is None or matmul_float32(call.query) is None:
        return False
    return PORTABLE_HALF_FLASH.get((library_name(call.query), device_kind(call.query)), False)


def _workers(call: AttentionCall) -> int:
    """Rule 4: threads for the query blocks of the tiled path."""
    if not parallel_query_blocks(call.query):
        return 1
    if _score_bytes(call) < THREADS_MIN_SCORE_BYTES or not can_limit_blas():
        return 1
    return available_workers()


def _score_bytes(call: AttentionCall) -> int:
    """Bytes of the dense scores B x Hq x Lq x Lk of the call."""
    plan = call.plan
    return math.prod(plan.batch) * plan.num_q_heads * plan.q_len * plan.kv_len * _itemsize(call)


def _native_route(call: AttentionCall, return_lse: bool) -> Native | None:
    """Rule 1: the fused native kernel, whole or per query tile, unless the tiled path wins.

    Per query tile (:data:`NATIVE_TILE` rows, ``Native.tiles``) where block skipping
    hides at least :data:`NATIVE_TILES_MIN_SKIP` of the tile pairs or a ``mask_mod``
    is given (the kernel cannot take one whole); whole where the tiled path would
    skip under :data:`SKIP_FRACTION_FOR_TILED` of its pairs; else the tiled path.
    """
    if not fused_native_kernel(call.query):
        return None
    if unsupported_reason(call, return_lse=return_lse, per_tile=True) is not None:
        return None
    kind = (library_name(call.query), device_kind(call.query))
    if call.plan.kv_len < NATIVE_MIN_KEYS.get(kind, 0):
        return None
    upcast = native_upcasts(call)
    if call.terms.mask_mod is not None:
        return Native(upcast, tiles=NATIVE_TILE)
    if _kernel_causal(call):  # the kernel's own causal skipping: one call
        return Native(upcast)
    if skipped_fraction(call, NATIVE_TILE, NATIVE_TILE) >= NATIVE_TILES_MIN_SKIP:
        return Native(upcast, tiles=NATIVE_TILE)
    if skipped_fraction(call, *EAGER_TILES) < SKIP_FRACTION_FOR_TILED:
        return Native(upcast)
    return None


def _kernel_causal(call: AttentionCall) -> bool:
    """Causal alone on a square call: the kernel's causal flag skips the hidden half itself."""
    plan = call.plan
    return (
        plan.is_causal
        and plan.window is None
        and plan.q_len == plan.kv_len
        and call.terms.segment_blocks is None
        and call.terms.block_host is None
    )


def skipped_fraction(call: AttentionCall, block_q: int, block_k: int) -> float:
    """Return the fraction of (query block, key block) pairs the tiled path skips.

    What :func:`~._tiled.pair_visibility` hides: causal/window structure, host segment
    ids and a block mask's states. Nothing with an alignment from values (lengths).
    """
    plan, terms = call.plan, call.terms
    by_value = terms.segment_blocks is not None or terms.block_host is not None
    if plan.has_lengths or (not plan.band.restricts and not by_value):
        return 0.0  # nothing is static enough to skip
    if not by_value and block_visibility(plan, (0, plan.q_len), (0, plan.kv_len)) == "full":
        return 0.0  # the band hides nothing (a decoding step): no walk over the pairs
    q_blocks, k_blocks = block_ranges(plan.q_len, block_q), block_ranges(plan.kv_len, block_k)
    skipped = sum(
        pair_visibility(plan, terms, q_range, k_range) == "skip"
        for q_range in q_blocks
        for k_range in k_blocks
    )
    return skipped / max(1, len(q_blocks) * len(k_blocks))


def _dask_path(call: AttentionCall, sizes: Any) -> DaskGrid:
    """Rule 2: the chunk grid of a Dask call and the path inside each chunk pair."""
    plan = call.plan
    q_chunks = chunk_sizes(call.query, -2) or (plan.q_len,)
    k_chunks = chunk_sizes(call.key, -2) or (plan.kv_len,)
    # the pair tasks run NumPy (CuPy) chunks: eager, so folding follows their query chunk
    fold = fold_row_sums(call, q_len=max(q_chunks))
    inner: Dense | Tiled
    buffered = reuses_buffers(call.query)
    if sizes == "dense":
        inner = Dense(fold)
    else:
        block_q, block_k = (
            default_tiles(False, max(q_chunks), max(k_chunks), buffered=buffered)
            if sizes == "auto"
            else sizes
        )
        inner = Tiled(block_q, block_k, fold=fold, buffered=buffered)
    return DaskGrid(tuple(q_chunks), tuple(k_chunks), inner, DASK_MERGE_FAN_IN, DASK_TASK_SCORES)


def _auto_tiles(call: AttentionCall) -> tuple[Blocks, Blocks] | None:
    """Rule 3: (block_q, block_k) of the tiled path, or None for the dense path."""
    plan = call.plan
    buffered = reuses_buffers(call.query)
    limit = AUTO_DENSE_LIMIT_BYTES
    if multithreaded_elementwise(call.query):
        limit = AUTO_DENSE_LIMIT_BYTES_MULTITHREADED
    elif buffered:
        limit = BUFFERED_DENSE_LIMIT_BYTES
    if _traced_block_mask(call):  # the loop skips what the states hide, at their blocks
        return _mask_loop_tiles(call)
    if _score_bytes(call) <= limit:
        return None
    traced = traces_python_loops(call.query)
    windowed = plan.band.left is not None
    return default_tiles(
        traced,
        plan.q_len,
        plan.kv_len,
        loop=runs_as_loop(call),
        windowed=windowed,
        buffered=buffered,
    )


def _mask_loop_tiles(call: AttentionCall) -> tuple[int, int]:
    """Tiles of the traced loop over a traced block mask: multiples of its blocks.

    At least :data:`MASK_LOOP_MIN_TILE` (fewer loop steps where the mask shows many
    blocks), and whole state blocks, so every state maps onto one tile.
    """
    plan = call.plan
    mq, mk = call.terms.state_block or EAGER_TILES
    bq = mq * max(1, -(-MASK_LOOP_MIN_TILE // mq))
    bk = mk * max(1, -(-MASK_LOOP_MIN_TILE // mk))
    return min(bq, max(1, plan.q_len)), min(bk, max(1, plan.kv_len))


def runs_as_loop(call: AttentionCall) -> bool:
    """Rule 6: whether the tiled path of `call` runs as a traced loop (JAX).

    Long calls, and calls with a block mask whose states are traced (only the loop
    reads them by value and skips what they hide).
    """
    if not traces_python_loops(call.query):
        return False
    return _score_bytes(call) >= LOOP_MIN_SCORE_BYTES or _traced_block_mask(call)


def _traced_block_mask(call: AttentionCall) -> bool:
    terms = call.terms
    return terms.block_states is not None and terms.block_host is None


def default_tiles(
    traced: bool,
    q_len: int,
    kv_len: int,
    *,
    loop: bool = False,
    windowed: bool = False,
    buffered: bool = False,
) -> tuple[int, int]:
    """``(block_q, block_k)`` for ``block_size="auto"`` above the dense limit.

    `traced`: the library traces Python loops (JAX); `loop`: the blocks run as a
    traced loop (:data:`LOOP_TILES`; :data:`LOOP_WINDOW_TILES` for a `windowed`
    band), else unrolled in at most
    :data:`TRACED_MAX_BLOCKS` blocks of at least :data:`TRACED_MIN_BLOCK` per axis.
    `buffered`: the block loop runs in reused buffers (NumPy: :func:`buffered_tiles`).
    Other eager libraries take :data:`EAGER_TILES`.
    """
    if buffered:
        return buffered_tiles(q_len, kv_len)
    if traced and loop:
        bq, bk = LOOP_WINDOW_TILES if windowed else LOOP_TILES
        return min(bq, max(1, q_len)), min(bk, max(1, kv_len))
    if traced:
        per_axis = TRACED_MAX_BLOCKS * 128
        return (
            max(TRACED_MIN_BLOCK, 128 * math.ceil(q_len / per_axis)),
            max(TRACED_MIN_BLOCK, 128 * math.ceil(kv_len / per_axis)),
        )
    return EAGER_TILES


def buffered_tiles(q_len: int, kv_len: int) -> tuple[int, int]:
    """``(block_q, block_k)`` of the buffered tiled path (NumPy), clipped to the lengths.

    :data:`BUFFERED_TILE` query rows (or all of a shorter Lq), and key tiles of
    :data:`BUFFERED_TILE` widened to :data:`BUFFERED_BLOCK_SCORES` scores per block.
    """
    bq = min(BUFFERED_TILE, max(1, q_len))
    bk = max(BUFFERED_TILE, BUFFERED_BLOCK_SCORES // bq)
    return bq, min(bk, max(1, kv_len))


def _itemsize(call: AttentionCall) -> int:
    return 8 if call.plan.compute_dtype == call.xp.float64 else 4

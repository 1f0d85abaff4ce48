"""The router: which path computes a call, what each library can do, every tuning constant.

One function decides, :func:`route`, and returns a :class:`~._path.Route`; the drivers
(:mod:`portable_attn._paths`) run it and decide nothing. What a library can do is
data, one row of :data:`LIBRARIES` per library; every threshold the router (or any
module of the engine) tunes by is a constant of this module, with the measurement
behind it. Five paths compute the same exact attention:

======== ==============================================================================
path     what it is
======== ==============================================================================
Empty    no query or no key: zeros, nothing computed
Dense    one block: the (Lq, Lk) scores built once (``_lib/_dense.py``)
Tiled    the online softmax over (query block, key block) pairs (``_lib/_tiled.py``),
         O(L) memory, hidden block pairs skipped (``_lib/_blocks.py``); walked as a
         Python loop, in reused buffers (NumPy), in threads, or as a traced loop (JAX)
Native   the framework's kernel with our masks and empty-row contract
         (``_paths/_native.py``), whole or once per query tile
DaskGrid Dask arrays: one task per visible (query chunk, key chunk) pair running the
         tiled path on the chunks, merged per query chunk by a tree (``_paths/_dask.py``)
======== ==============================================================================

What a library can do depends on the device its arrays live on: the table has one
row per (library, device kind) (:data:`LIBRARIES`, :func:`library`), holding its
kernels (:class:`Kernel`: what each expresses, the dtypes and head dims it takes, how
it handles half precision and empty rows), its tiles and its dense limit. The router
reads the row; no other module names a device kind.

The rules, in the order :func:`route` applies them:

0. `kv_lengths` read on the host (NumPy, torch CPU) hide every key at or past the
   largest length from every row: only the first keys are computed
   (:func:`kept_keys`, ``Route.keys``), whatever the path.
1. An int or a pair `block_size` is the tiled path with those blocks, ``"dense"`` the
   dense path; ``implementation="native"`` is the row's first kernel that computes
   the call (:func:`native_kernel`), or a ValueError with each kernel's reason
   (:func:`unsupported_reason`).
2. Dask arrays: one task per (query chunk, key chunk) pair (:func:`_dask_path`).
3. ``implementation=None``: the row's first default kernel that computes the call
   (:func:`_native_route`). SDPA with at least ``Kernel.min_keys`` keys: whole, or
   once per query tile where block skipping hides at least
   :data:`NATIVE_TILES_MIN_SKIP` of the tiles (or a ``mask_mod`` is given, on a CPU);
   a call whose structure lets the tiled path skip at least
   :data:`SKIP_FRACTION_FOR_TILED` of its pairs goes on to the next kernel (flex on
   CUDA) or the tiled path. flex (torch CUDA) and cuDNN (JAX GPU): whole. A call
   differentiated in forward mode skips the kernels without a forward rule
   (``Kernel.forward_mode``).
4. Otherwise dense while the dense scores fit in the library's ``dense_limit``, tiled
   above (:func:`_tiles`): NumPy in reused buffers (:func:`buffered_tiles`), in
   threads above :data:`THREADS_MIN_SCORE_BYTES`; JAX as a traced loop from
   :data:`LOOP_MIN_SCORE_BYTES` (or with a traced block mask), unrolled below; other
   libraries the row's ``tiles``.
5. Eager libraries take the row sums from ``P @ [V | 1]`` where that pays
   (:func:`fold_row_sums`); XLA divides the weights before ``P @ V``
   (``Library.fuses_softmax``; benchmarks/results/xla-forms.json).
6. Half precision accumulates in float32 on every path; a native kernel takes half
   inputs in their own dtype where ``Kernel.own_half`` says that measured faster
   (:func:`native_upcasts`), the dense path takes FlashAttention's form where
   ``Library.half_flash`` does (:func:`dense_flash_form`).
7. A JAX call runs its path as one compiled program (``Route.compiled``), eagerly and
   under ``grad`` and ``vmap`` (under ``jit``, one call inside the caller's program),
   not under ``jax.jvp`` (:func:`runs_compiled`).

A router setting changed at run time takes effect after :func:`portable_attn._lib._cache.forget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from . import _validation as v
from ._blocks import SKIP, block_ranges, host_pair_states
from ._compat import (
    chunk_library,
    chunk_sizes,
    device_kind,
    forward_mode,
    library_name,
    reads_host_values,
    records_grad,
    torch_func_transforms,
    torch_records,
    torch_release,
)
from ._cpu import available_workers, can_limit_blas, has_half_arithmetic
from ._path import Blocks, DaskGrid, Dense, Empty, Native, Paged, Path, Route, Tiled

if TYPE_CHECKING:
    from ._call import AttentionCall

__all__ = [
    "AUTO_DENSE_LIMIT_BYTES",
    "BUFFERED_BLOCK_SCORES",
    "BUFFERED_TILE",
    "CACHE_SIZE",
    "CHUNK_KEYS",
    "COMPILED_SIGNATURES",
    "DASK_MERGE_FAN_IN",
    "DASK_TASK_SCORES",
    "DEFAULT_MASK_BLOCK",
    "EAGER_TILES",
    "FEATURES",
    "FLEX_CUDA",
    "GPU_CHUNK_KEYS",
    "INVARIANT_MATMUL_ROWS",
    "INVARIANT_PRODUCT_KEYS",
    "MAX_TILE_ROWS",
    "GPU_DENSE_LIMIT_BYTES",
    "GPU_LOOP_TILES",
    "GPU_TILES",
    "JAX_CUDNN",
    "JAX_NN_GPU",
    "JAX_NN_CPU",
    "KEEP_WORKSPACE_BYTES",
    "LIBRARIES",
    "LOOP_MIN_SCORE_BYTES",
    "LOOP_TILES",
    "LOOP_WINDOW_TILES",
    "MASK_LOOP_MIN_TILE",
    "MASK_TILE_ENTRIES",
    "NATIVE_TILE",
    "NATIVE_TILES_MIN_SKIP",
    "PAGED_ENGINE_MAX_KEYS",
    "PAGED_ENGINE_ROWS",
    "SKIP_FRACTION_FOR_TILED",
    "THREADS_MIN_SCORE_BYTES",
    "TRACED_BLOCK_STEP",
    "TRACED_MAX_BLOCKS",
    "TRACED_MIN_BLOCK",
    "WORKSPACE_ALIGN",
    "Kernel",
    "Library",
    "SDPA_CPU",
    "SDPA_CUDA",
    "buffered_tiles",
    "default_tiles",
    "fold_row_sums",
    "kept_keys",
    "kernel_reason",
    "library",
    "native_kernel",
    "paged_by_engine",
    "reads_values",
    "route",
    "row_key",
    "runs_compiled",
    "rows_of",
    "skipped_fraction",
    "tile_rows",
    "unsupported_reason",
]


# ---------------------------------------------------------------------------
# tiles

#: ``(block_q, block_k)`` of ``"auto"`` for eagerly executed libraries: (H, 256, 256)
#: float32 score blocks (2 MiB for H = 8). torch CPU, B=1, H=8, D=64, L=4096, causal,
#: side by side with (128, 256) (hand runs): forward 9% faster, forward and backward
#: 6%, a step with a learned relative-position score_mod 13% (half the block pairs,
#: each with its fixed cost: a score_mod's autograd, the walk's Python).
EAGER_TILES = (256, 256)
#: The tiles of the buffered walk (NumPy): query tiles of this many rows (fewer for a
#: shorter Lq) ...
BUFFERED_TILE = 256
#: ... and key tiles of BUFFERED_TILE, widened while the query tile is shorter to hold
#: this many scores per (batch, head): a decoding step (Lq = 1) takes 4096 keys in one
#: block. Chosen from hand runs of 64-256 x 256-512 tiles at L = 128-4096 (256 x 256
#: was the fastest or within noise of it on causal calls, and within 10% on plain
#: ones; one query row over 4096 keys ran 20% faster in one block than in 16).
BUFFERED_BLOCK_SCORES = 256 * 256
#: NumPy's tiled path runs its query blocks in threads from this many bytes of dense
#: scores: on 2 cores, 2 threads with BLAS limited to one thread each took 0.71
#: (plain) / 0.77 (causal) of the single-threaded time at L = 4096 and 0.91 / 0.97 at
#: L = 2048 (128 MiB, H = 8), but 1.07 / 1.13 at L = 1024 (benchmarks/results/threads.json).
THREADS_MIN_SCORE_BYTES = 128 * 2**20
#: A thread keeps its workspace (the buffered walk's buffers) for its next call up to
#: this many bytes; a larger one is allocated per call, where faulting it in costs
#: little beside what it computes. Then neither the per-call allocation nor glibc's
#: thresholds (which Dask's workers set to trim at 64 KiB) decide the speed of small
#: calls and Dask's chunk pairs (issue 23: the same call measured 58 ms and 106 ms in
#: one process before).
KEEP_WORKSPACE_BYTES = 16 * 2**20
#: Bytes: every buffer of a workspace starts on a cache line.
WORKSPACE_ALIGN = 64
#: ``(block_q, block_k)`` of the traced loop (rule 4), clipped to the lengths. A loop
#: step carries the online softmax, so it costs about what its block computes; smaller
#: blocks skip more of the causal half. Chosen from hand runs (B=1, H=8, D=64, float32,
#: jax.jit, L = 4096 and 8192, causal and plain, forward and jit(grad); blocks of 256,
#: 512 and 1024): 512 was the fastest or within noise of it in each;
#: benchmarks/results/loop.json measures these tiles.
LOOP_TILES = (512, 512)
#: ... and of a call with a window (a left bound of the band): most of a 512 block lies
#: outside a narrow band; window (256, 0) + causal at L = 4096: 256 was the fastest.
LOOP_WINDOW_TILES = (256, 256)
#: Traced libraries run the tiled path as a traced loop from this many bytes of dense
#: scores (L = 2048 for B=1, H=8 in float32), below which the dense path or, between
#: the two limits, the unrolled program runs. Measured (benchmarks/results/loop.json,
#: causal, B=1, H=8, D=64, float32, jax.jit), loop against unrolled: at L = 2048,
#: 0.043 s against 0.126 s forward and 0.15 s against 0.29 s for jit(grad); at 4096,
#: 0.137 s against 0.278 s, compiled in 0.26 s against 2.3 s, with 100 / 208 MiB of
#: extra peak RSS against 602 / 1444 MiB; at 8192, 0.46 s against 0.74 s.
LOOP_MIN_SCORE_BYTES = 128 * 2**20
#: A traced block mask runs the traced loop whatever the length (only the loop skips
#: by value), in tiles of whole state blocks of at least this size: of 128, 256 and 512
#: (B=1, H=8, L=4096, D=64, float32, states of 128, jax.jit), 256 was close to the
#: faster on 4 causal documents of 1024 and on a causal window of 256 (flex.json).
MASK_LOOP_MIN_TILE = 256
#: Below LOOP_MIN_SCORE_BYTES a traced library unrolls the Python loop into the
#: program: blocks of a multiple of this many positions ...
TRACED_BLOCK_STEP = 128
#: ... of at least this size ...
TRACED_MIN_BLOCK = 256
#: ... and at most this many blocks per axis keep compile time bounded.
TRACED_MAX_BLOCKS = 16
#: FlexAttention's default block size, the default of ``create_block_mask``.
DEFAULT_MASK_BLOCK = 128
#: Booleans a ``mask_mod`` is evaluated on at once while its block states are built
#: (whole blocks, every (batch, head) it differs over): 4 Mi. NumPy asks for huge pages
#: from 4 MiB on; with smaller tiles much of the build went to page faults (hand runs;
#: build time and memory at L = 32768 in benchmarks/results/flex.json, "build").
MASK_TILE_ENTRIES = 2**22

# ---------------------------------------------------------------------------
# the native kernel

#: The default routes a call the fused native kernel could take whole (and not per
#: tile) to the tiled path instead when causal/window structure hides at least this
#: fraction of the (query block, key block) pairs of EAGER_TILES: window (256, 0) +
#: causal at L = 4096 skips 88% of the pairs; causal alone skips 38-47% (L = 1024-4096),
#: where the kernel stays faster (benchmarks/results/cases-torch.json).
SKIP_FRACTION_FOR_TILED = 0.75
#: Query tile (and key tile) of the native kernel run per tile: of 128, 256 and 512
#: rows, SDPA per 256-row tile over its visible key span was the fastest on a
#: packed-document causal call (4 x 1024 in 4096, B=1, H=8, D=64; hand runs; the
#: default call's figures are in benchmarks/results/flex.json and cases-torch.json) ...
NATIVE_TILE = 256
#: ... chosen over one whole kernel call when block skipping hides at least this
#: fraction of the (NATIVE_TILE, NATIVE_TILE) tile pairs.
NATIVE_TILES_MIN_SKIP = 0.5

# ---------------------------------------------------------------------------
# Dask and the caches

#: Dask merges the partials of one query chunk this many at a time, as a tree: a merge
#: task holds that many (..., Hq, bq, Dv) partials, under one chunk pair of scores
#: while 4 Dv <= bk; a query chunk over n key chunks costs about n / 3 merge tasks.
DASK_MERGE_FAN_IN = 4
#: Consecutive visible chunk pairs of one query chunk share one Dask task (one walk)
#: until the task holds this many scores: a task costs about 2 ms of scheduling, more
#: than a (1, 8, 256, 256) pair computes, while a (1, 8, 1024, 1024) pair (8 Mi scores)
#: stays a task of its own (benchmarks/results/targets.json: tasks per call).
DASK_TASK_SCORES = 4 * 2**20
#: Call signatures the one cache keeps (``_lib/_cache.py``): all are dropped when full.
CACHE_SIZE = 256
#: Compiled programs of eager JAX calls kept, least recently used first out: one per
#: call signature (shapes, dtypes, options, functions) and path.
COMPILED_SIGNATURES = 256


# ---------------------------------------------------------------------------
# what each (library, device kind) can do

#: The features beyond Q, K, V, a boolean mask, a bias, lengths, a window, segment ids,
#: a learned scale and GQA that a :class:`Kernel` may compute itself (every kernel
#: takes those): the names its ``expresses`` holds.
FEATURES = (
    "mask_mod",
    "mask_mod_per_sequence",
    "score_mod",
    "softcap",
    "alibi_slopes",
    "sinks",
    "dropout",
    "return_lse",
    "return_max_logit",
)


@dataclass(frozen=True)
class Kernel:
    """A fused attention kernel of one (library, device kind) row, and what it takes.

    Attributes
    ----------
    name : {"sdpa", "flex", "jax_nn"}
        ``torch.nn.functional.scaled_dot_product_attention``, torch's ``flex_attention``
        (``_paths/_flex.py``) or ``jax.nn.dot_product_attention`` (``_paths/_native.py``).
    default : bool
        The default route (``implementation=None``) may take it; otherwise only
        ``implementation="native"`` does.
    expresses : frozenset of str
        The :data:`FEATURES` it computes itself.
    per_tile : bool
        The default route may run it once per query tile over the tile's visible key
        span, where block skipping hides most tiles, a ``mask_mod`` (or block mask)
        evaluated into each tile's boolean mask (SDPA on a CPU). Without it such calls
        go on to the next kernel (flex on CUDA, which skips blocks itself).
    backward : bool
        It differentiates its inputs; a call that records gradients goes elsewhere.
    transforms : bool
        It runs under ``torch.func``'s transforms (``vmap``, ``grad``); flex does not
        (dynamo refuses its batched tensors): such calls go elsewhere.
    forward_mode : bool
        It has a forward-mode derivative (``torch.func.jvp``, ``forward_ad``,
        ``jax.jvp``): XLA's composition of ``jax.nn.dot_product_attention``. torch's
        fused kernels have none (SDPA's CPU flash kernel raises; only its math backend
        has one, building the whole scores), nor has cuDNN's ``custom_vjp``: the default
        route sends a call differentiated in forward mode to the portable path, whose
        walk differentiates in forward mode at O(L) memory. ``implementation="native"``
        still runs SDPA there, on its math backend (``_paths/_native.py``).
    even_lengths : bool
        With a mask or a bias it needs even Lq and Lk (cuDNN's backward with a bias,
        jax 0.10's ``check_is_flash_attention``).
    dtypes : frozenset of str or None
        The input dtypes it takes (``"float16"``, ``"bfloat16"``, ``"float32"``,
        ``"float64"``); None: any.
    head_dims : frozenset of int or None
        The head dims (Dk and Dv) it takes; None: any.
    equal_dims : bool
        It needs ``Dv == Dk``.
    min_keys : int
        The fewest keys an unmasked call may have (below, the kernel loses a query's
        NaN: those calls get an explicit mask, whole calls the portable path).
    zeroes_empty_rows : (int, int) or None
        The torch release from which it returns zeros, with zero gradients, for a row
        that sees no key, so no guard is built around it; None: guarded.
    own_half : frozenset of str
        Half dtypes it takes as they are (it accumulates in float32 itself); others
        reach it as float32 copies.
    own_half_with_arithmetic : frozenset of str
        Half dtypes it takes as they are on a CPU with that arithmetic (AVX512-FP16,
        AMX-FP16: ``_cpu.has_half_arithmetic``).
    implementation : {"cudnn", "xla"} or None
        ``jax.nn.dot_product_attention``'s ``implementation=``.
    compiles : bool
        It runs ``torch.compile``-d, once per signature (flex).
    """

    name: Literal["sdpa", "flex", "jax_nn"]
    default: bool = False
    expresses: frozenset[str] = frozenset()
    per_tile: bool = False
    backward: bool = True
    transforms: bool = True
    forward_mode: bool = False
    even_lengths: bool = False
    dtypes: frozenset[str] | None = None
    head_dims: frozenset[int] | None = None
    equal_dims: bool = False
    min_keys: int = 0
    zeroes_empty_rows: tuple[int, int] | None = None
    own_half: frozenset[str] = frozenset()
    own_half_with_arithmetic: frozenset[str] = frozenset()
    implementation: Literal["cudnn", "xla"] | None = None
    compiles: bool = False


CHUNK_KEYS = 128
"""Keys per chunk of the paged walk on a CPU (rounded down to whole pages, at least one page).

Fixed per (library, device kind), not chosen per call (``Library.chunk_keys``): the
chunks are the same for every call over a pool, which batch invariance needs. 128 keys:
a decode step over 32 requests (Hkv=8, D=128) gathers 16 MiB of keys per chunk (32 MiB
at 256, glibc's largest threshold above which every allocation is a fresh mapping).
Against 256 keys, interleaved with the prefill step: decode 1.04x the time on torch,
0.95x NumPy, 0.92x under ``jax.jit``, with ``batch_invariant`` 0.99x, 1.02x, 0.94x;
prefill 1.01x, invariant 0.94x (``--only chunks`` of ``benchmarks/serving.py``:
benchmarks/results/serving-chunks.json). Timed alone, torch's decode step varied from
0.77x to 1.0x between runs."""

INVARIANT_MATMUL_ROWS = 16
"""With ``batch_invariant=True``, a paged tile holds ``ceil(16 / G)`` rows, from a multiple
of them among its request's positions: the matrix products are ``G · rows`` by ``bk``, the
same for every call of the model, and a row's place in them is its position's."""

INVARIANT_PRODUCT_KEYS = 16
"""With ``batch_invariant=True``, the paged walk multiplies a tile's rows by 16 keys at a
time, whatever the page size (where a chunk's keys are a multiple of 16): a row's bits
then do not depend on how a pool pages its keys, so pools whose page size divides the
walk's chunk (``Library.chunk_keys``: 1, 2, 4, ... 128 slots a page on a CPU), and
``varlen_attention``'s packed keys (pages of one slot), give the same bits. With 16
slots a page these are the pages themselves, as before."""

MAX_TILE_ROWS = 128
"""Without it, a paged tile holds the mean rows per request rounded up to a power of two,
at most 128: one row per request when decoding, 128 for prefill chunks of 512 (the keys
of a chunk are gathered once per tile, so bigger tiles gather less)."""


PAGED_ENGINE_ROWS = 16
"""A paged request with at least this many new rows (a prefill, or a chunk of one) is not
walked: its keys are gathered from the pool and its rows computed by the engine's own route
(torch's SDPA on a CPU), one request at a time (``Library.paged_engine``; never with
``batch_invariant``, whose bits are the walk's). One request of 2048 keys (Hq = 32,
Hkv = 8, D = 128), the engine's time over the walk's: torch 0.46-0.54x at 1-16 rows,
0.59-0.73x at 32-64; NumPy 0.56-0.75x (benchmarks/results/serving-engine.json, an Intel
Xeon); the prefill step of
``benchmarks/serving.py`` (512-row chunks) took 0.32x the walk's time on torch, 0.68x
on NumPy (serving.json). A decode step keeps the walk, which batches its requests:
0.92x the time of SDPA per request on its gathered pages (serving.json)."""

PAGED_ENGINE_MAX_KEYS = 32768
"""... and at most this many keys: its gathered keys and values are a copy of its cache
(256 MiB at Hkv = 8, D = 128 in float32); a longer one is walked, a chunk at a time."""


def paged_by_engine(row: Library, rows: int, keys: int, batch_invariant: bool) -> bool:
    """Whether a paged request's `rows` over its `keys` go to the engine (see above)."""
    return (
        row.paged_engine
        and not batch_invariant
        and rows >= PAGED_ENGINE_ROWS
        and keys <= PAGED_ENGINE_MAX_KEYS
    )


INDEX_GATHER_KEYS = 1 << 15
"""An index walk (``ragged_paged_attention(kv_indices=...)``) gathers at most this many keys
per fold: rows ``32768 // (Hkv · INDEX_CHUNK_KEYS)`` at a time, each with one chunk of its
listed keys (64 MiB at D = 512 in float32), so its extra memory does not grow with the
rows."""

INDEX_CHUNK_KEYS = 256
"""Listed keys per chunk of an index walk, fixed (a row's bits do not depend on the batch):
products of ``G`` rows by 256 keys."""


def index_rows(num_tokens: int, num_kv_heads: int) -> int:
    """Return the rows an index walk folds at a time (:data:`INDEX_GATHER_KEYS`)."""
    return max(1, min(num_tokens, INDEX_GATHER_KEYS // (num_kv_heads * INDEX_CHUNK_KEYS)))


def tile_rows(num_tokens: int, num_requests: int, groups: int, batch_invariant: bool) -> int:
    """Return the rows of a paged tile: fixed per model with `batch_invariant`, else by shape."""
    if batch_invariant:
        return max(1, math.ceil(INVARIANT_MATMUL_ROWS / groups))
    mean = -(-num_tokens // max(num_requests, 1))
    return min(MAX_TILE_ROWS, 1 << max(mean - 1, 0).bit_length())


@dataclass(frozen=True)
class Library:
    """What one array library can do on one kind of device: one row of :data:`LIBRARIES`.

    Attributes
    ----------
    dense_limit : int
        ``block_size=None`` keeps the dense path while the dense scores take at most
        this many bytes (B x Hq x Lq x Lk x itemsize), and tiles above.
    walk : {"python", "buffered", "traced"}
        How its tiled path walks the blocks: a Python loop of fresh arrays, the same
        loop in buffers reused through ``out=`` (NumPy), or a loop the library
        traces into a program (JAX: unrolled when short, a traced loop when long).
    tiles : (int, int)
        ``(block_q, block_k)`` of the Python walk above the dense limit.
    loop_tiles, loop_window_tiles : (int, int)
        Those of the traced loop, and of a call with a window (a left bound).
    chunk_keys : int
        Keys per chunk of the paged walk (``serving.ragged_paged_attention``), fixed
        per row so that every call over a pool has the same chunks.
    threads : bool
        Query blocks may run in threads: elementwise work on one core that releases
        the GIL, no autodiff to record it (NumPy).
    kernels : tuple of Kernel
        Its fused attention kernels, in the order a call tries them.
    host : bool
        Its arrays live in the CPU's memory: half-precision forms hold only where the
        CPU has half arithmetic (``_cpu.has_half_arithmetic``).
    half_flash : bool
        The dense path computes half inputs in FlashAttention's form (half products
        accumulated in float32, float32 softmax, probabilities cast back for
        ``P @ V``); otherwise Q, K and V are cast to float32 first.
    autodiff : {"torch", "jax"} or None
        Whose custom-backward API its arrays take.
    compiles_eager : bool
        An eager call runs its path as one compiled program, cached per signature
        (JAX dispatches each eager operation on its own, 10-20 us each on a CPU).
    fuses_softmax : bool
        Its compiler fuses the softmax into the ``P @ V`` after it (XLA).
    half_matmul : bool
        It has a half-precision matmul accumulating in float32 in the standard's
        terms (``jnp.matmul(preferred_element_type=float32)``).
    pins_devices : bool
        Mixing devices among the arguments is an error to catch (torch, CuPy; JAX
        places and shards arrays itself).
    task_graphs : bool
        Arrays are lazy task graphs (Dask): a call becomes tasks on their chunks.
    sums_by_program : bool
        Its compiler adds up a fused reduction in an order that depends on the whole
        program (XLA: ``jnp.sum`` over the same values gave other bits in programs
        compiled for other batches), while a matrix product's order depends on its
        shapes alone. The paged walk then takes its sums as products with ones, so
        that ``batch_invariant=True`` holds under ``jax.jit`` across programs; elsewhere
        ``xp.sum``, already invariant in eager libraries and cheaper (torch's decode step
        took 1.16x its time with products; benchmarks/results/serving-lanes.json).
    gathers_strided : bool
        Its ``take`` reads a permuted view as fast as contiguous memory, so a paged call
        gathers pages from the pool's head-major view (P, Hkv, page_size, D) and
        multiplies them without a copy; the others gather token-major pages and permute
        them after. The decode step of ``benchmarks/serving.py`` took 0.53x its time
        with it on torch, 21.6x on NumPy (benchmarks/results/serving-lanes.json); XLA
        fuses the permutation into its gather either way.
    exp2 : bool
        Its ``exp2`` (not in the standard) is several times faster than its ``exp``, so
        the Python walk takes ``exp(x)`` as ``exp2(x · log2 e)`` (``Tiled.exp2``;
        FlashAttention's form). Rounding ``x · log2 e`` costs at most ``|x| · 2⁻²⁴``
        relative in float32: 1e-6 at ``x = -20``, a weight of 2e-9. torch CPU, one
        (8, 256, 256) float32 block (hand runs): ``exp`` 240 us, 1150 us when half the
        entries are ``-inf`` (a diagonal causal block), the exp2 form 110 us either way;
        ``benchmarks/results/learned-torch.json`` holds the training step it speeds up.
    writes : {"items", "at", "arrays"}
        How ``serving.paged_kv_write`` writes rows into the pools: item assignment into
        the arrays given (NumPy, torch, CuPy), ``.at[].set`` (JAX: in place when the
        pools are donated to ``jax.jit``), or new arrays by array-API operations alone.
    paged_engine : bool
        A paged request with many new rows is computed by the engine over its gathered
        keys (:data:`PAGED_ENGINE_ROWS`). Not JAX: outside ``jit`` each request's shape
        would compile a program of its own (under ``jit`` the metadata is traced, and
        every request walked).
    """

    dense_limit: int
    walk: Literal["python", "buffered", "traced"] = "python"
    tiles: tuple[int, int] = EAGER_TILES
    loop_tiles: tuple[int, int] = LOOP_TILES
    loop_window_tiles: tuple[int, int] = LOOP_WINDOW_TILES
    chunk_keys: int = CHUNK_KEYS
    threads: bool = False
    kernels: tuple[Kernel, ...] = ()
    host: bool = True
    half_flash: bool = False
    autodiff: Literal["torch", "jax"] | None = None
    compiles_eager: bool = False
    fuses_softmax: bool = False
    half_matmul: bool = False
    pins_devices: bool = False
    task_graphs: bool = False
    gathers_strided: bool = False
    sums_by_program: bool = False
    exp2: bool = False
    writes: Literal["items", "at", "arrays"] = "arrays"
    paged_engine: bool = True


#: ``block_size=None`` keeps the dense path while its logits would take at most this
#: many bytes, and tiles above. NumPy measured dense and tiled within a factor of 1.7
#: either way at L = 1024-8192 without causal masking, the tiled path's memory O(L)
#: (benchmarks/results/history/tiled.json and bench-numpy.json).
AUTO_DENSE_LIMIT_BYTES = 64 * 2**20
#: The dense limit of a GPU row: the scores of B=1, H=16, L=8192 in float32. A GPU
#: runs the (Lq, Lk) scores as a few large kernels at its memory bandwidth, while each
#: block of the Python walk is a dozen kernel launches: not yet measured (gpu.sh).
GPU_DENSE_LIMIT_BYTES = 4 * 2**30
#: The Python walk's tiles on a GPU: blocks of (H, 2048, 2048) float32 scores (128 MiB
#: at H = 8), a few large kernels per block. Not yet measured (gpu.sh).
GPU_TILES = (2048, 2048)
#: The traced loop's tiles on a GPU (JAX). Not yet measured (gpu.sh).
GPU_LOOP_TILES = (1024, 1024)
#: The paged walk's chunks on a GPU: 2048 keys, a decode step over 32 requests (Hkv=8,
#: D=128) gathering 64 MiB of keys per chunk in a few kernels. Not yet measured (gpu.sh).
GPU_CHUNK_KEYS = 2048

#: torch SDPA on a CPU (torch 2.13):
#:
#: - default: a fused kernel (flash on a CPU) that it can express, with at least
#:   ``min_keys`` keys (rule 3);
#: - ``min_keys``: SDPA returns zeros, not NaN, for a query row holding a NaN when
#:   Lk < 16 and no ``attn_mask`` is given (float16 to float64, D = 16-128, any Lq),
#:   against the contract that NaN propagates; given a mask it propagates;
#: - ``zeroes_empty_rows``: from 2.13 it returns zeros, with zero gradients, for a row
#:   that sees no key (float16 to float64; flash and math kernels; forward and
#:   backward; eager, under inductor and ``torch.func``): ``tests/test_native.py`` and
#:   ``tests/test_transforms.py`` check it on every run;
#: - half precision (benchmarks/results/half-torch.json: B=1, H=8, D=64, L = 1024-4096):
#:   bfloat16 as it is (the float32 copies cost 7-21% at L = 1024-2048 and 31 MiB of
#:   peak memory at L = 4096, for the same error); float16 as float32 copies (without
#:   float16 arithmetic the float32 route ran at 0.63-0.74x of SDPA in float16), as it
#:   is on a CPU with float16 arithmetic (AVX512-FP16 or AMX-FP16: the float32 route
#:   at 0.98-1.17x, the float16 one at 0.99-1.02x, the float32 route's error 0.83-1.0x
#:   SDPA's).
#:
#: torch's flex_attention is not in the CPU row: on a CPU it has no backward and no
#: ``max_scores`` (torch 2.13 raises), and compiling it took 6 s per signature (hand
#: run); the portable path is timed against it in benchmarks/results/flex.json.
SDPA_CPU = Kernel(
    "sdpa",
    default=True,
    per_tile=True,
    min_keys=16,
    zeroes_empty_rows=(2, 13),
    own_half=frozenset({"bfloat16"}),
    own_half_with_arithmetic=frozenset({"float16"}),
)
#: torch SDPA on CUDA: the fused kernels (FlashAttention, cuDNN, memory-efficient)
#: take half precision and accumulate in float32. ``min_keys`` and
#: ``zeroes_empty_rows``: not yet measured (guarded); the speed of the default call
#: against cuDNN SDPA is in benchmarks/results/gpu.json (1.26-1.66x at L <= 4096 on an
#: H200, from the per-call Python work; 1.02-1.03x at 16384). Not per tile: a call
#: whose blocks mostly hide goes to flex, one fused kernel that skips them.
SDPA_CUDA = Kernel("sdpa", default=True, own_half=frozenset({"bfloat16", "float16"}))
#: torch's flex_attention on CUDA, compiled once per signature: the calls SDPA cannot
#: express -- every mask as its ``BlockMask`` and ``mask_mod``, every score term as its
#: ``score_mod``, the lse and the row max as its auxiliary outputs, sinks from the lse
#: (``_paths/_flex.py``). Float64, Dv != Dk, head dims other than powers of two from 16
#: to 256 and dropout take the portable path: not yet measured (gpu.sh). Its speed
#: against flex_attention called directly with the same mods: not yet measured
#: (benchmarks/gpu_features.py; issue 47).
FLEX_CUDA = Kernel(
    "flex",
    default=True,
    expresses=frozenset(FEATURES) - {"dropout", "mask_mod_per_sequence"},
    dtypes=frozenset({"float16", "bfloat16", "float32"}),
    head_dims=frozenset({16, 32, 64, 128, 256}),
    equal_dims=True,
    own_half=frozenset({"bfloat16", "float16"}),
    compiles=True,
    transforms=False,
)
#: ``jax.nn.dot_product_attention`` on a CPU (XLA's composition of the operations, no
#: fused kernel): only ``implementation="native"``; it needs Dv == Dk. Half precision:
#: bfloat16 as it is; float16 as float32 copies (XLA CPU refuses "The precision
#: 'F16_F16_F32'", benchmarks/results/half-jax.json).
JAX_NN_CPU = Kernel("jax_nn", equal_dims=True, own_half=frozenset({"bfloat16"}), forward_mode=True)
#: ``jax.nn.dot_product_attention(implementation="cudnn")`` on a GPU, by default where
#: cuDNN takes the call: float16 / bfloat16, Dv == Dk, head dims up to 128 and a
#: multiple of 8 (jax 0.10's ``check_is_flash_attention``; 256 on Hopper and later).
#: The portable default was 2.6-3.3x slower than it at L = 1024, 7.1-9.1x at 4096 and
#: 12.5-15.7x at 16384 on an H200 (benchmarks/results/gpu.json); the default call
#: through it: not yet measured (gpu.sh).
JAX_CUDNN = Kernel(
    "jax_nn",
    default=True,
    dtypes=frozenset({"float16", "bfloat16"}),
    head_dims=frozenset(range(8, 129, 8)),
    equal_dims=True,
    even_lengths=True,
    own_half=frozenset({"bfloat16", "float16"}),
    implementation="cudnn",
)
#: ``jax.nn.dot_product_attention`` with XLA's implementation on a GPU: what
#: ``implementation="native"`` gets where cuDNN does not take the call (float32, other
#: head dims); not the default (it builds the whole scores).
JAX_NN_GPU = Kernel(
    "jax_nn", equal_dims=True, own_half=frozenset({"bfloat16", "float16"}), forward_mode=True
)

#: One row per (library, device kind): the library by the name of the module that owns
#: its arrays, the kind as :func:`~._compat.device_kind` names it. A kind not listed
#: takes its library's ``"cpu"`` row; a library not listed ``Library(AUTO_DENSE_LIMIT_BYTES)``:
#: the portable path, a Python walk, no native kernel.
#:
#: - numpy: the tiled path in reused buffers kept the dense path only up to 2 MiB of
#:   scores (L = 256 at B=1, H=8): tiled over dense was 1.27 / 1.07 / 0.98 at L = 64 /
#:   128 / 256 and 0.59 / 0.78 at L = 512 / 1024 (benchmarks/results/targets.json).
#: - torch CPU: its multi-threaded eager kernels made the dense path 1.7-2.6x (plain)
#:   and 2.8-6.1x (causal) slower than the tiled path at L = 512-8192, faster at L = 128
#:   (0.5 MiB): 4 MiB (benchmarks/results/history/bench-torch.json).
#: - JAX: the dense path in FlashAttention's form for half inputs on a CPU with half
#:   arithmetic: JAX CPU bfloat16 under ``jit`` (dense, L = 1024) ran it at 0.69-0.75x
#:   ``jax.nn`` and the float32 form at 0.80-0.88x on an Intel AMX CPU
#:   (benchmarks/results/history/half-jax-23f1316.json), while on AMD EPYC CPUs, with
#:   AVX512-BF16 and without, the float32 form was the faster (half-jax.json); on an
#:   H200 (gpu.json) 1.20-1.41x faster at L = 4096, 0.94-1.08x at 1024.
#: - GPU rows (torch cuda, jax gpu, cupy cuda): GPU_DENSE_LIMIT_BYTES, GPU_TILES,
#:   GPU_LOOP_TILES, GPU_CHUNK_KEYS; not yet measured.
_TORCH_CPU = Library(
    4 * 2**20,
    kernels=(SDPA_CPU,),
    writes="items",
    autodiff="torch",
    pins_devices=True,
    gathers_strided=True,
    exp2=True,
)
_JAX_CPU = Library(
    AUTO_DENSE_LIMIT_BYTES,
    walk="traced",
    kernels=(JAX_NN_CPU,),
    half_flash=True,
    autodiff="jax",
    compiles_eager=True,
    fuses_softmax=True,
    half_matmul=True,
    sums_by_program=True,
    writes="at",
    paged_engine=False,
)


def _on_gpu(row: Library, **fields: Any) -> Library:
    """`row` sized for a GPU (the GPU constants above), with `fields`."""
    gpu = {"dense_limit": GPU_DENSE_LIMIT_BYTES, "chunk_keys": GPU_CHUNK_KEYS, "host": False}
    return replace(row, **{**gpu, **fields})


LIBRARIES: dict[tuple[str, str], Library] = {
    ("numpy", "cpu"): Library(2 * 2**20, walk="buffered", threads=True, writes="items"),
    ("torch", "cpu"): _TORCH_CPU,
    ("torch", "cuda"): _on_gpu(_TORCH_CPU, tiles=GPU_TILES, kernels=(SDPA_CUDA, FLEX_CUDA)),
    ("jax", "cpu"): _JAX_CPU,
    ("jax", "gpu"): _on_gpu(
        _JAX_CPU,
        loop_tiles=GPU_LOOP_TILES,
        loop_window_tiles=GPU_LOOP_TILES,
        kernels=(JAX_CUDNN, JAX_NN_GPU),
    ),
    ("cupy", "cuda"): _on_gpu(
        Library(GPU_DENSE_LIMIT_BYTES), tiles=GPU_TILES, pins_devices=True, writes="items"
    ),
    ("array_api_strict", "cpu"): Library(AUTO_DENSE_LIMIT_BYTES),
    ("dask", "cpu"): Library(AUTO_DENSE_LIMIT_BYTES, task_graphs=True),
}
_PORTABLE = Library(AUTO_DENSE_LIMIT_BYTES)


def library(x: Any) -> Library:
    """Return the row of :data:`LIBRARIES` of the library and device kind that own array `x`.

    A device kind not listed (torch's ``mps``, ``xpu``) takes its library's CPU row with
    nothing measured of its kernels: rows without keys are guarded, half inputs upcast.
    """
    key = row_key(x)
    row = LIBRARIES.get(key)
    if row is not None:
        return row
    cpu = LIBRARIES.get((key[0], "cpu"))
    if cpu is None:
        return _PORTABLE
    unmeasured = (
        replace(
            k, zeroes_empty_rows=None, own_half=frozenset(), own_half_with_arithmetic=frozenset()
        )
        for k in cpu.kernels
    )
    return replace(cpu, kernels=tuple(unmeasured), host=False)


def row_key(x: Any) -> tuple[str, str]:
    """Return the key of `x`'s row in :data:`LIBRARIES`: its library and device kind."""
    return (library_name(x), device_kind(x))


def rows_of(name: str) -> dict[tuple[str, str], Library]:
    """Return the rows of library `name`, one per device kind."""
    return {key: row for key, row in LIBRARIES.items() if key[0] == name}


# ---------------------------------------------------------------------------
# the router


def route(
    call: AttentionCall,
    block_size: Any,
    implementation: Any,
    *,
    return_lse: bool = False,
    row: Library | None = None,
    batch_invariant: bool = False,
) -> Route:
    """Decide how `call` is computed (the rules are in the module docstring).

    Parameters
    ----------
    call : AttentionCall
        The validated call.
    block_size, implementation
        The caller's choices, as :func:`portable_attn.scaled_dot_product_attention` takes them.
    return_lse : bool, default False
        The caller needs the row statistics too (the lse, and the row max where the
        plan says ``row_max``).
    row : Library, optional
        The row of :data:`LIBRARIES` to route by; by default that of `call`'s library
        and device kind (:func:`library`). The decision is data: a test routes a CPU
        call by a GPU row.
    batch_invariant : bool, default False
        The caller asked for a row's bits to depend on its own sequence alone: the
        paged walk (:class:`~._path.Paged`), whatever else could compute the call.

    Raises
    ------
    ValueError
        A `block_size` or `implementation` that is not one of the documented values,
        or ``implementation="native"`` for a call the kernel cannot express.
    """
    v.check_implementation(implementation)
    sizes = v.check_block_size(block_size)  # "auto", "dense" or (block_q, block_k)
    lib = library(call.query) if row is None else row
    user_functions = call.terms.score_mod is not None or call.terms.mask_mod is not None
    if batch_invariant:
        v.check_invariant_call(call, implementation, sizes, lib.task_graphs)
        if call.is_empty:
            return Route(Empty())
        return Route(Paged(), compiled=runs_compiled(lib, user_functions))
    if implementation == "native":
        explicit = sizes != "auto"  # the caller asked for a portable path
        reason = unsupported_reason(
            call, explicit_block_size=explicit, return_lse=return_lse, row=lib
        )
        v.check_native_route(reason)
    keys = kept_keys(call)  # rule 0
    if keys is not None:
        call = call.first_keys(keys)
    path = _path(call, lib, sizes, implementation, return_lse)
    segments = call.terms.q_segments is not None
    if isinstance(path, Native) and path.kernel == "flex" and (user_functions or segments):
        portable = _path(call, replace(lib, kernels=()), sizes, "portable", return_lse)
        path = replace(path, fallback=Route(portable, keeps_dtype=_keeps_dtype(portable)))
    # eager, and under grad and vmap too (an eager jax.grad of the path would compile each
    # operation of its backward on its own: 378 programs for one gradient in the suite);
    # under jit the program is one call inside the caller's
    forward = forward_mode(call.flatten()[0].values())
    compiled = not isinstance(path, Empty) and runs_compiled(lib, user_functions, forward)
    return Route(path, keys, compiled, _keeps_dtype(path))


def runs_compiled(row: Library, user_functions: bool, forward: bool = False) -> bool:
    """Whether a call runs its path as one compiled program (rule 7).

    Every JAX call, a paged one too, but one with a ``mask_mod`` or ``score_mod``: a
    program would keep them, with what they close over; nor one `forward` mode
    differentiates (``jax.jvp``): the program would be traced without its tangents, and
    the tiled paths' ``custom_vjp`` inside refuses forward mode.
    """
    return row.compiles_eager and not user_functions and not forward


def reads_values(call: AttentionCall) -> bool:
    """Whether :func:`route` reads values of `call` on the host (then it routes every call).

    Lengths and segment ids read where that is free (rule 0's cut, the pairs the
    native kernel per tile skips); everything else it reads is the call's signature.
    """
    terms = call.terms
    return any(
        x is not None and reads_host_values(x)
        for x in (terms.q_lengths, terms.kv_lengths, terms.q_segments)
    )


def _keeps_dtype(path: Path) -> bool:
    """Whether `path` takes half-precision Q, K, V in their own dtype (no float32 copy)."""
    match path:
        case Native(upcast=upcast):
            return not upcast
        case Dense(flash=flash):
            return flash
    return False


def _path(
    call: AttentionCall, lib: Library, sizes: Any, implementation: Any, return_lse: bool
) -> Path:
    """Rules 1-6: the path of `call` (its keys already cut by rule 0)."""
    if call.is_empty:
        return Empty()
    if implementation == "native":
        kernel = native_kernel(call, lib, return_lse=return_lse)
        assert kernel is not None  # unsupported_reason said so
        return _native(call, kernel)
    if lib.task_graphs:
        return _dask_path(call, sizes)
    fold = fold_row_sums(call)
    if sizes == "dense":
        return _dense(call, lib, fold)
    if isinstance(sizes, tuple):
        return _tiled(call, lib, sizes, fold, workers=1)
    if implementation is None and lib.kernels:
        native = _native_route(call, lib, return_lse)
        if native is not None:
            return native
    tiles = _tiles(call, lib)
    if tiles is None:
        return _dense(call, lib, fold)
    return _tiled(call, lib, tiles, fold, workers=_workers(call, lib))


def _dense(call: AttentionCall, lib: Library, fold: bool) -> Dense:
    """Rules 5-6: the dense path's form."""
    flash = dense_flash_form(call, lib)
    return Dense(fold, flash, lib.fuses_softmax and not flash)


def _tiled(
    call: AttentionCall, lib: Library, tiles: tuple[Blocks, Blocks], fold: bool, *, workers: int
) -> Tiled:
    """Return the tiled path in `tiles`: its walk and its backward."""
    walk: Literal["python", "buffered", "loop"] = "python"
    if lib.walk == "buffered":
        walk = "buffered"
    elif lib.walk == "traced" and runs_as_loop(call):
        walk = "loop"
    backward: Literal["torch", "jax", "autodiff"] | None = lib.autodiff
    if backward is not None and call.terms.score_mod is not None and torch_records(call.query):
        # torch.compile and torch.func run no TorchFunctionMode watch nor autograd.grad
        # inside (_paths/_autodiff.torch_params): their own autodiff differentiates the
        # walk, every block saved
        backward = "autodiff"
    exp2 = lib.exp2 and walk == "python"
    return Tiled(*tiles, fold=fold, walk=walk, workers=workers, backward=backward, exp2=exp2)


def _native(call: AttentionCall, kernel: Kernel, tiles: int | None = None) -> Native:
    """Return `kernel` for `call`, whole or per query tile of `tiles` rows.

    Whole, SDPA and ``jax.nn`` run once per sequence over the sequence's own keys where
    host-read `kv_lengths` differ (:func:`_ragged`); flex skips blocks itself.
    """
    since = kernel.zeroes_empty_rows
    zeroes = since is not None and torch_release() >= since
    per_sequence = tiles is None and kernel.name != "flex" and _ragged(call)
    return Native(
        kernel.name,
        native_upcasts(call, kernel),
        tiles,
        not zeroes,
        kernel.min_keys,
        per_sequence,
        kernel.implementation,
        kernel.compiles,
    )


def _ragged(call: AttentionCall) -> bool:
    """Whether host-read `kv_lengths` differ between the sequences of one batch axis.

    The kernel then runs once per sequence over its own keys. Decoding (B=4, H=8, D=64,
    Lk=4096, float32, torch CPU) with lengths 512 / 1500 / 3000 / 4096: 2.6 ms per
    sequence against 4.5 ms for SDPA on the padded keys with their mask (hand runs;
    0.93-1.0x with equal or near-equal lengths); the keys past each length are then
    not read at all, whatever they hold (NaN in a cache allocated with ``empty``).
    """
    values, plan, terms = call.terms.kv_length_values, call.plan, call.terms
    if values is None or len(values) < 2 or len(plan.batch) != 1 or plan.align is not None:
        return False
    return terms.q_lengths is None and terms.q_segments is None and terms.mask_mod is None


def kept_keys(call: AttentionCall) -> int | None:
    """Rule 0: how many leading keys `call` needs, when `kv_lengths` hide the rest.

    With `kv_lengths` read on the host (``ScoreTerms.kv_length_values``: NumPy, torch
    CPU) no row sees a key at or past the largest length, so the keys from there on
    are computed by no path: return that length (at least 1, so gradients still reach
    K and V as zeros), or None when every key may be seen. The cut call is the same
    whole call, with lengths, not ``Lk``, aligning its rows. Not with what is laid
    out over the whole key axis on the host: segment ids and a ``mask_mod`` or block
    mask (their host states).
    """
    terms = call.terms
    values = terms.kv_length_values
    if values is None or call.plan.align is not None:
        return None
    if terms.q_segments is not None or terms.mask_mod is not None:
        return None
    keep = max(1, max(values))
    return keep if keep < call.plan.kv_len else None


#: How an error message names a feature of :data:`FEATURES`.
_FEATURE_NAMES = {
    "mask_mod": "mask_mod (or block_mask)",
    "mask_mod_per_sequence": "a mask rule aligned by the lengths",
    "dropout": "dropout_mask",
}


def kernel_reason(
    call: AttentionCall,
    kernel: Kernel,
    *,
    explicit_block_size: bool = False,
    return_lse: bool = False,
    per_tile: bool = False,
) -> str | None:
    """Why `kernel` cannot compute `call`, or None when it can.

    `explicit_block_size` is an int, a pair or "dense": a request for a portable
    tiled path. `return_lse`: the call needs the row statistics (the lse, and the row
    max where the plan says ``row_max``). `per_tile`: the kernel would run per query
    tile, where a ``mask_mod`` is evaluated into each tile's mask
    (``Kernel.per_tile``).
    """
    plan, terms = call.plan, call.terms
    tiled_rule = per_tile and kernel.per_tile  # evaluated into each tile's mask
    used = {
        "mask_mod": terms.mask_mod is not None and not tiled_rule,
        "mask_mod_per_sequence": getattr(terms.mask_mod, "per_sequence", False) and not tiled_rule,
        "score_mod": terms.score_mod is not None,
        "softcap": plan.softcap is not None,
        "alibi_slopes": terms.alibi_slopes is not None,
        "sinks": terms.sinks is not None,
        "dropout": terms.dropout_keep is not None,
        "return_lse": return_lse,
        "return_max_logit": return_lse and plan.row_max,
    }
    unsupported = [
        _FEATURE_NAMES.get(name, name)
        for name, is_used in used.items()
        if is_used and name not in kernel.expresses
    ]
    if explicit_block_size:
        unsupported.append("an explicit block_size (a portable path)")
    if unsupported:
        return f"the native kernel cannot express {', '.join(unsupported)}"
    what = _kernel_names[kernel.name]
    dtype = _dtype_name(call)
    if dtype in ("float16", "bfloat16") and native_upcasts(call, kernel):
        dtype = "float32"  # what the kernel is given (a learned scale, a float32 bias)
    if kernel.dtypes is not None and dtype not in kernel.dtypes:
        return f"{what} takes {', '.join(sorted(kernel.dtypes))} inputs, but got {dtype}"
    masked = call.bias is not None or terms.hides_by_value or plan.band.restricts
    # (only where the kernel asks: torch.export's symbolic lengths take no guard)
    if kernel.even_lengths and masked and (plan.q_len % 2 or plan.kv_len % 2):
        lengths = f"Lq={plan.q_len}, Lk={plan.kv_len}"
        return f"{what} takes a mask or bias with even Lq and Lk only, but got {lengths}"
    if kernel.equal_dims and plan.value_dim != plan.key_dim:
        return (
            f"{what} needs `value` axis -1 (Dv) == `key` axis -1 "
            f"(Dk), but got Dv={plan.value_dim} and Dk={plan.key_dim}"
        )
    dims = kernel.head_dims
    if dims is not None and not {plan.key_dim, plan.value_dim} <= dims:
        return (
            f"{what} takes head dims (`query` axis -1) {sorted(dims)}, "
            f"but got Dk={plan.key_dim}, Dv={plan.value_dim}"
        )
    functions = terms.score_mod is not None or terms.mask_mod is not None
    if not kernel.backward and records_grad(*call.flatten()[0].values(), functions=functions):
        return f"{what} has no backward here, and the inputs require grad"
    if not kernel.transforms and torch_func_transforms(call.query):
        return f"{what} does not run under torch.func's transforms"
    return None


_kernel_names = {
    "sdpa": "torch's scaled_dot_product_attention",
    "flex": "torch's flex_attention",
    "jax_nn": "jax.nn.dot_product_attention",
}


def native_kernel(call: AttentionCall, lib: Library, *, return_lse: bool = False) -> Kernel | None:
    """Return the first kernel of `lib` that computes `call` (rule 1), or None."""
    for kernel in lib.kernels:
        if kernel_reason(call, kernel, return_lse=return_lse) is None:
            return kernel
    return None


def unsupported_reason(
    call: AttentionCall,
    *,
    explicit_block_size: bool = False,
    return_lse: bool = False,
    row: Library | None = None,
) -> str | None:
    """Why no native kernel of `call`'s row (or `row`) can compute it, or None when one can.

    Each kernel's reason (:func:`kernel_reason`), one per kernel of the row.
    """
    lib = library(call.query) if row is None else row
    if not lib.kernels:
        name = library_name(call.query)
        return f"there is no native attention kernel for {name} arrays (torch and jax only)"
    reasons = [
        kernel_reason(call, kernel, explicit_block_size=explicit_block_size, return_lse=return_lse)
        for kernel in lib.kernels
    ]
    if any(reason is None for reason in reasons):
        return None
    if len(reasons) == 1:
        return reasons[0]
    return "; ".join(f"{k.name}: {r}" for k, r in zip(lib.kernels, reasons, strict=True))


def _dtype_name(call: AttentionCall) -> str | None:
    """Return the name of the inputs' dtype (``"float32"``, ...) as ``Kernel.dtypes`` has it."""
    xp, dt = call.xp, call.plan.result_dtype
    for name in ("float32", "float16", "bfloat16", "float64"):
        if getattr(xp, name, None) is not None and dt == getattr(xp, name):
            return name
    return None


def fold_row_sums(call: AttentionCall, q_len: int | None = None) -> bool:
    """Rule 5: take the row sums of P from ``P @ [V | 1]`` instead of a pass over P.

    Not with dropout (it drops weights from ``P V`` but not from the sums), and not
    for traced libraries (JAX): XLA fuses the sum into the ``exp`` pass already, and
    the wider matmul measured 4-11% slower under ``jax.jit``. Eager libraries save one
    pass over every (bq, bk) block (NumPy: 3-7%), but building ``[V | 1]`` copies V:
    it pays only when each K/V head has more query rows (G * Lq) than V has columns.
    `q_len`: the queries of one task (a Dask chunk), by default the call's.
    """
    plan = call.plan
    rows = plan.groups * (plan.q_len if q_len is None else q_len)
    traced = library(call.query).walk == "traced"
    return call.terms.dropout_keep is None and not traced and rows > plan.value_dim


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


def native_upcasts(call: AttentionCall, kernel: Kernel) -> bool:
    """Rule 6: whether `kernel` gets float32 copies of half Q, K, V (``Kernel.own_half``)."""
    half = _half_input_dtype(call)
    if half is None or half in kernel.own_half:
        return half is None
    return not (half in kernel.own_half_with_arithmetic and has_half_arithmetic(half))


def dense_flash_form(call: AttentionCall, lib: Library | None = None) -> bool:
    """Rule 6: whether the dense path computes half inputs in FlashAttention's form."""
    lib = library(call.query) if lib is None else lib
    half = _half_input_dtype(call)
    if not (lib.half_matmul and lib.half_flash) or half is None:
        return False
    return not lib.host or has_half_arithmetic(half)


def _workers(call: AttentionCall, lib: Library) -> int:
    """Rule 4: threads for the query blocks of the tiled path."""
    if not lib.threads or _score_bytes(call) < THREADS_MIN_SCORE_BYTES or not can_limit_blas():
        return 1
    return available_workers()


def _score_bytes(call: AttentionCall) -> int:
    """Bytes of the dense scores B x Hq x Lq x Lk of the call."""
    plan = call.plan
    itemsize = 8 if plan.compute_dtype == call.xp.float64 else 4
    return math.prod(plan.batch) * plan.num_q_heads * plan.q_len * plan.kv_len * itemsize


def _native_route(call: AttentionCall, lib: Library, return_lse: bool) -> Native | None:
    """Rule 3: the row's first default kernel that takes the call, unless tiles win."""
    forward = forward_mode(call.flatten()[0].values())
    for kernel in lib.kernels:
        if not kernel.default or (forward and not kernel.forward_mode):
            continue
        if kernel_reason(call, kernel, return_lse=return_lse, per_tile=True) is not None:
            continue
        if kernel.name != "sdpa":  # flex skips blocks itself; cuDNN runs whole
            return _native(call, kernel)
        native = _sdpa_route(call, lib, kernel)
        if native is not None:
            return native
    return None


def _sdpa_route(call: AttentionCall, lib: Library, kernel: Kernel) -> Native | None:
    """SDPA whole, or per query tile, or None where the tiled path skips enough to win."""
    kv_len = call.plan.kv_len  # symbolic under torch.export: no guard on its value
    if isinstance(kv_len, int) and kv_len < kernel.min_keys:
        return None
    if call.terms.mask_mod is not None:
        return _native(call, kernel, NATIVE_TILE)
    if _kernel_causal(call):  # the kernel's own causal skipping: one call
        return _native(call, kernel)
    if skipped_fraction(call, NATIVE_TILE, NATIVE_TILE) >= NATIVE_TILES_MIN_SKIP:
        return _native(call, kernel, NATIVE_TILE) if kernel.per_tile else None
    if skipped_fraction(call, *lib.tiles) < SKIP_FRACTION_FOR_TILED:
        return _native(call, kernel)
    return None


def _kernel_causal(call: AttentionCall) -> bool:
    """Causal alone on a square call: the kernel's causal flag skips the hidden half itself."""
    plan = call.plan
    return (
        plan.is_causal
        and plan.window is None
        and plan.q_len == plan.kv_len
        and call.terms.q_segments is None
        and call.terms.block_host is None
    )


def skipped_fraction(call: AttentionCall, block_q: int, block_k: int) -> float:
    """Return the fraction of (query block, key block) pairs the tiled path skips.

    What :func:`~._blocks.host_pair_states` hides where the call has structure: a band
    aligned from shapes, segment ids, a ``mask_mod``. A band aligned by lengths decides
    nothing here (the lengths' own skipping is rule 0's cut, taken every call).
    """
    plan, terms = call.plan, call.terms
    band = plan.band.restricts and not plan.has_lengths
    if not (band or terms.q_segments is not None or terms.mask_mod is not None):
        return 0.0
    states = host_pair_states(
        call, block_ranges(call.plan.q_len, block_q), block_ranges(call.plan.kv_len, block_k)
    )
    pairs = sum(len(row) for row in states)
    return sum(row.count(SKIP) for row in states) / pairs if pairs else 0.0


def _dask_path(call: AttentionCall, sizes: Any) -> DaskGrid:
    """Rule 2: the chunk grid of a Dask call and the path inside each chunk pair."""
    plan = call.plan
    q_chunks = chunk_sizes(call.query, -2) or (plan.q_len,)
    k_chunks = chunk_sizes(call.key, -2) or (plan.kv_len,)
    # the pair tasks run NumPy (CuPy) chunks: eager, so folding follows their query chunk
    fold = fold_row_sums(call, q_len=max(q_chunks))
    # the chunks' library, on the one kind of device it has (NumPy's host, CuPy's GPU)
    chunk_lib = next(iter(rows_of(chunk_library(call.query)).values()), _PORTABLE)
    walk: Literal["python", "buffered"] = "buffered" if chunk_lib.walk == "buffered" else "python"
    inner: Dense | Tiled
    if sizes == "dense":
        inner = Dense(fold)
    else:
        block_q, block_k = (
            default_tiles(chunk_lib, max(q_chunks), max(k_chunks)) if sizes == "auto" else sizes
        )
        inner = Tiled(block_q, block_k, fold=fold, walk=walk)
    return DaskGrid(tuple(q_chunks), tuple(k_chunks), inner, DASK_MERGE_FAN_IN, DASK_TASK_SCORES)


def _tiles(call: AttentionCall, lib: Library) -> tuple[int, int] | None:
    """Rule 4: (block_q, block_k) of the tiled path, or None for the dense path."""
    if _traced_block_mask(call):  # the loop skips what the states hide, at their blocks
        return _mask_loop_tiles(call)
    if _score_bytes(call) <= lib.dense_limit:
        return None
    plan = call.plan
    loop = runs_as_loop(call)
    return default_tiles(
        lib, plan.q_len, plan.kv_len, loop=loop, windowed=plan.band.left is not None
    )


def _mask_loop_tiles(call: AttentionCall) -> tuple[int, int]:
    """Return the tiles of the traced loop over a traced block mask.

    Whole state blocks, at least :data:`MASK_LOOP_MIN_TILE`.
    """
    plan = call.plan
    mq, mk = call.terms.state_block or EAGER_TILES
    bq = mq * max(1, -(-MASK_LOOP_MIN_TILE // mq))
    bk = mk * max(1, -(-MASK_LOOP_MIN_TILE // mk))
    return min(bq, max(1, plan.q_len)), min(bk, max(1, plan.kv_len))


def runs_as_loop(call: AttentionCall) -> bool:
    """Rule 4: whether the tiled path of a traced library runs as a traced loop (JAX).

    Long calls, and calls with a block mask whose states are traced (only the loop
    reads them by value and skips what they hide).
    """
    if library(call.query).walk != "traced":
        return False
    return _score_bytes(call) >= LOOP_MIN_SCORE_BYTES or _traced_block_mask(call)


def _traced_block_mask(call: AttentionCall) -> bool:
    terms = call.terms
    return terms.block_states is not None and terms.block_host is None


def default_tiles(
    lib: Library, q_len: int, kv_len: int, *, loop: bool = False, windowed: bool = False
) -> tuple[int, int]:
    """``(block_q, block_k)`` of the tiled path of `lib` above the dense limit.

    Buffered walks take :func:`buffered_tiles`; traced ones :data:`LOOP_TILES`
    (:data:`LOOP_WINDOW_TILES` for a `windowed` band) as a `loop`, else at most
    :data:`TRACED_MAX_BLOCKS` unrolled blocks of at least :data:`TRACED_MIN_BLOCK` per
    axis; other libraries :data:`EAGER_TILES`.
    """
    if lib.walk == "buffered":
        return buffered_tiles(q_len, kv_len)
    if lib.walk == "traced" and loop:
        bq, bk = lib.loop_window_tiles if windowed else lib.loop_tiles
        return min(bq, max(1, q_len)), min(bk, max(1, kv_len))
    if lib.walk == "traced":
        per_axis = TRACED_MAX_BLOCKS * TRACED_BLOCK_STEP
        return (
            max(TRACED_MIN_BLOCK, TRACED_BLOCK_STEP * math.ceil(q_len / per_axis)),
            max(TRACED_MIN_BLOCK, TRACED_BLOCK_STEP * math.ceil(kv_len / per_axis)),
        )
    return lib.tiles


def buffered_tiles(q_len: int, kv_len: int) -> tuple[int, int]:
    """``(block_q, block_k)`` of the buffered walk (NumPy), clipped to the lengths.

    :data:`BUFFERED_TILE` query rows (or all of a shorter Lq), and key tiles of
    :data:`BUFFERED_TILE` widened to :data:`BUFFERED_BLOCK_SCORES` scores per block.
    """
    bq = min(BUFFERED_TILE, max(1, q_len))
    bk = max(BUFFERED_TILE, BUFFERED_BLOCK_SCORES // bq)
    return bq, min(bk, max(1, kv_len))

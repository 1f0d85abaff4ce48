"""Which path computes a call: the whole policy, in one place.

Four paths compute the same exact attention:

======== ==============================================================================
path     what it is
======== ==============================================================================
empty    no query or no key: zeros, nothing computed
dense    one block: the (Lq, Lk) scores built once (``_lib/_dense.py``)
tiled    the online softmax over (query block, key block) pairs (``_lib/_tiled.py``),
         O(L) memory, blocks hidden by causal/window structure skipped
native   the framework's kernel with our masks and empty-row contract (``_native.py``)
======== ==============================================================================

How the path is chosen (`block_size`, `implementation`):

- ``implementation="portable"`` never routes to a native kernel;
  ``implementation="native"`` always does, or raises when the kernel cannot
  express the call (an int or pair `block_size` asks for the portable tiled path
  and so cannot be native; ``"auto"`` can).
- ``implementation=None`` routes to the native kernel only where it is fused by
  default (torch SDPA) and the call has nothing the fused kernels cannot take
  (no mask, bias, lengths or window; causal only with ``Lq == Lk``, where the
  kernel's top-left causal flag agrees with our bottom-right one), and only with
  `block_size` None or ``"auto"``.
- Dask arrays split along ``Lq`` or ``Lk`` take the tiled path with `block_size`
  None or ``"auto"``: one block per (query chunk, key chunk) pair, so no task
  holds more than one chunk pair of scores; ``"auto"`` also splits a chunk pair
  whose scores would pass :data:`AUTO_DENSE_LIMIT_BYTES`.
- ``block_size="auto"`` stays dense while the dense logits fit in
  :data:`AUTO_DENSE_LIMIT_BYTES` (:data:`AUTO_DENSE_LIMIT_BYTES_MULTITHREADED` for
  libraries with multi-threaded elementwise kernels) and tiles above, with
  :data:`EAGER_TILES`, or for traced libraries (JAX) blocks of at least
  :data:`TRACED_MIN_BLOCK` and at most :data:`TRACED_MAX_BLOCKS` per axis.
- ``block_size=None`` is the dense path; an int or a pair is the tiled path.

The thresholds below are the only copies; each cites the measurement behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ._lib import _validation as v
from ._lib._call import AttentionCall
from ._lib._compat import (
    chunk_sizes,
    fused_native_kernel,
    multithreaded_elementwise,
    traces_python_loops,
)
from ._lib._tiled import Blocks
from ._native import unsupported_reason

__all__ = [
    "AUTO_DENSE_LIMIT_BYTES",
    "AUTO_DENSE_LIMIT_BYTES_MULTITHREADED",
    "EAGER_TILES",
    "TRACED_MAX_BLOCKS",
    "TRACED_MIN_BLOCK",
    "Path",
    "choose_path",
    "default_tiles",
]

#: ``block_size="auto"`` keeps the dense path while its logits would take at most
#: this many bytes (batch x Hq x Lq x Lk x 4, or x 8 for float64), and tiles above.
#: NumPy: dense and tiled are within a factor of 1.7 either way at L = 1024-8192
#: without causal masking, while the tiled path's memory is O(L)
#: (benchmarks/results/tiled.json, bench-numpy.json).
AUTO_DENSE_LIMIT_BYTES = 64 * 2**20
#: The same limit for libraries whose eager elementwise kernels are multi-threaded
#: (torch): its dense path measured 1.7-2.6x (non-causal) and 2.8-6.1x (causal)
#: slower than its tiled path at L = 512-8192 (B=1, H=8, D=64:
#: benchmarks/results/bench-torch.json), while at L = 128 (0.5 MiB of logits)
#: dense is the faster of the two.
AUTO_DENSE_LIMIT_BYTES_MULTITHREADED = 4 * 2**20
#: ``(block_q, block_k)`` of ``"auto"`` for eagerly executed libraries: two
#: (H, 128, 256) float32 score blocks (1 MiB each for H = 8) stay cache-friendly.
EAGER_TILES = (128, 256)
#: Traced libraries unroll the block loops into the program: blocks of at least
#: this size ...
TRACED_MIN_BLOCK = 256
#: ... and at most this many blocks per axis keep compile time bounded.
TRACED_MAX_BLOCKS = 16


@dataclass(frozen=True)
class Path:
    """The path that computes one call, and its tiles on the tiled path."""

    kind: Literal["empty", "dense", "tiled", "native"]
    tiles: tuple[Blocks, Blocks] | None = None


def choose_path(call: AttentionCall, block_size: Any, implementation: Any) -> Path:
    """Decide how `call` is computed (see the module docstring for the rules).

    Raises
    ------
    ValueError
        A `block_size` or `implementation` that is not one of the documented
        values, or ``implementation="native"`` for a call the kernel cannot express.
    """
    v.check_implementation(implementation)
    sizes = v.check_block_size(block_size)
    tiles = _tiles(call, sizes)
    if implementation == "native":
        explicit = isinstance(sizes, tuple)  # "auto" leaves the path to the library
        v.check_native_route(unsupported_reason(call, explicit_tiles=explicit))
    if call.is_empty:
        return Path("empty")
    if implementation == "native" or (
        implementation is None and sizes in (None, "auto") and _prefer_native(call)
    ):
        return Path("native")
    return Path("dense") if tiles is None else Path("tiled", tiles)


def _prefer_native(call: AttentionCall) -> bool:
    """Decide the default route: native only where its fused kernels take the call as is."""
    plan, terms = call.plan, call.terms
    if not fused_native_kernel(call.query) or unsupported_reason(call) is not None:
        return False
    plain = terms.mask is None and call.bias is None and not plan.has_lengths
    return plain and plan.window is None and (not plan.is_causal or plan.q_len == plan.kv_len)


def _tiles(call: AttentionCall, sizes: Any) -> tuple[Blocks, Blocks] | None:
    """(block_q, block_k) of the tiled path, or None for the dense path."""
    plan = call.plan
    if sizes is None or sizes == "auto":
        q_chunks, k_chunks = chunk_sizes(call.query, -2), chunk_sizes(call.key, -2)
        if q_chunks is not None or k_chunks is not None:
            q_sizes, k_sizes = q_chunks or (plan.q_len,), k_chunks or (plan.kv_len,)
            if (
                sizes == "auto"
                and _chunk_pair_bytes(call, max(q_sizes), max(k_sizes)) > AUTO_DENSE_LIMIT_BYTES
            ):  # chunks too large for one block: tile within them
                q_sizes = _subdivide(q_sizes, EAGER_TILES[0])
                k_sizes = _subdivide(k_sizes, EAGER_TILES[1])
            return q_sizes, k_sizes
    if sizes is None:
        return None
    if sizes == "auto":
        rows = math.prod(plan.batch) * plan.num_q_heads * plan.q_len
        limit = (
            AUTO_DENSE_LIMIT_BYTES_MULTITHREADED
            if multithreaded_elementwise(call.query)
            else AUTO_DENSE_LIMIT_BYTES
        )
        if rows * plan.kv_len * _itemsize(call) <= limit:
            return None
        return default_tiles(traces_python_loops(call.query), plan.q_len, plan.kv_len)
    return sizes


def default_tiles(traced: bool, q_len: int, kv_len: int) -> tuple[int, int]:
    """``(block_q, block_k)`` for ``block_size="auto"`` above the dense limit."""
    if traced:
        per_axis = TRACED_MAX_BLOCKS * 128
        return (
            max(TRACED_MIN_BLOCK, 128 * math.ceil(q_len / per_axis)),
            max(TRACED_MIN_BLOCK, 128 * math.ceil(kv_len / per_axis)),
        )
    return EAGER_TILES


def _itemsize(call: AttentionCall) -> int:
    return 8 if call.plan.compute_dtype == call.xp.float64 else 4


def _chunk_pair_bytes(call: AttentionCall, bq: int, bk: int) -> int:
    """Bytes of the scores of one (query chunk, key chunk) pair of a Dask call."""
    query = call.query
    lead = [chunk_sizes(query, axis) or (query.shape[axis],) for axis in range(query.ndim - 2)]
    return math.prod(max(sizes) for sizes in lead) * bq * bk * _itemsize(call)


def _subdivide(sizes: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Split each chunk into blocks of at most `size`, keeping the chunk boundaries."""
    return tuple(min(size, n - start) for n in sizes for start in range(0, n, size))

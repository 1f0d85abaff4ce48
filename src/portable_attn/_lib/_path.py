"""What computes one call: the :data:`Path` union that the policy decides and the paths run.

The policy (:mod:`portable_attn._lib._policy`) returns one of these and imports
no path; the paths (:mod:`portable_attn._paths`) run one and import no policy.
Every decision the policy makes for a call (tiles, threads, folding the row sums
into ``P @ [V | 1]``, the Dask grid) is carried here, so a path never decides
one again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Blocks", "DaskGrid", "Dense", "Empty", "Native", "Path", "Tiled", "keeps_input_dtype"]

#: A block size, or the sizes of consecutive blocks (a Dask array's chunks).
Blocks = int | tuple[int, ...]


@dataclass(frozen=True)
class Empty:
    """No query, key or query head: zeros (and the empty-row lse), nothing computed."""


@dataclass(frozen=True)
class Dense:
    """One block: the (Lq, Lk) scores built once (``_lib/_dense.py``).

    `fold`: the row sums of the weights come from ``P @ [V | 1]``, not another pass.
    `flash`: half-precision Q, K, V stay in their dtype, FlashAttention's form: both
    products take half operands and accumulate in float32
    (:func:`~._compat.matmul_float32`), the softmax and its statistics are float32,
    the probabilities are cast back to the input dtype for ``P @ V``. Otherwise
    (the default) Q, K and V are cast to float32 first.
    `weights_first`: the weights are divided by their row sums before ``P @ V``
    (XLA compiles the softmax and ``P @ V`` into one kernel); otherwise the
    ``(Lq, Dv)`` output is divided after it, which is cheaper where each operation
    runs on its own.
    """

    fold: bool = False
    flash: bool = False
    weights_first: bool = False


@dataclass(frozen=True)
class Tiled:
    """The online softmax over (query block, key block) pairs (``_lib/_tiled.py``).

    `block_q`, `block_k`: the tiles (ints, or the sizes of consecutive blocks);
    `fold`: as for :class:`Dense`, per block; `workers`: threads over the query
    blocks (NumPy), 1 for the calling thread alone; `loop`: the blocks run as a
    traced loop (JAX: ``lax.map`` / ``fori_loop``, ``_paths/_loop.py``) instead of a
    Python loop, so the program does not grow with the number of blocks; `buffered`:
    the block loop writes into buffers allocated once per call (NumPy's ``out=``,
    ``_paths/_buffered.py``) instead of fresh arrays per block.
    """

    block_q: Blocks
    block_k: Blocks
    fold: bool = False
    workers: int = 1
    loop: bool = False
    buffered: bool = False


@dataclass(frozen=True)
class Native:
    """The framework's fused kernel with our masks and empty-row contract (``_native.py``).

    `upcast`: half-precision Q, K, V (and bias) reach the kernel cast to float32;
    False: in their own dtype, for a kernel that accumulates in float32 itself
    (the policy's :data:`~._policy.NATIVE_HALF_ROUTES` says which).
    `tiles`: None, one kernel call for the whole call; an int, one call per query
    tile of that many rows over the keys its visible key tiles span, so the key
    tiles that block skipping hides (the band, segment ids, a block mask) are not
    computed (``_native.native_tiles``).
    """

    upcast: bool = True
    tiles: int | None = None


@dataclass(frozen=True)
class DaskGrid:
    """Dask: tasks over the visible (query chunk, key chunk) pairs, merged by a tree.

    `q_chunks`, `k_chunks`: the chunk sizes along ``Lq`` and ``Lk``; `inner`: the
    path each pair runs on its chunks (:class:`Dense`: one block per pair);
    `merge_fan_in`: partials merged per merge task; `task_scores`: consecutive
    visible pairs of a query chunk share one task (and its merge) until it holds
    that many scores (0: a task per pair).
    """

    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    inner: Dense | Tiled
    merge_fan_in: int
    task_scores: int = 0


#: The path of one call: exactly one of these.
Path = Empty | Dense | Tiled | Native | DaskGrid


def keeps_input_dtype(path: Path) -> bool:
    """Whether `path` takes half-precision Q, K, V in their own dtype (no float32 copy)."""
    match path:
        case Native(upcast=upcast):
            return not upcast
        case Dense(flash=flash):
            return flash
    return False

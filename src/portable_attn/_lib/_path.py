"""What computes one call: the :class:`Route` the router decides and the drivers run.

The router (:func:`portable_attn._lib._route.route`) returns a :class:`Route`; the
drivers (:mod:`portable_attn._paths`) run it and decide nothing: every choice the
router makes for a call (the driver, its tiles, threads, folding the row sums into
``P @ [V | 1]``, the backward, the kernel and its guard, the Dask grid) is a field
here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Blocks", "DaskGrid", "Dense", "Empty", "Native", "Paged", "Path", "Route", "Tiled"]

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
    products take half operands and accumulate in float32, the softmax is float32,
    the probabilities are cast back to the input dtype for ``P @ V``. Otherwise
    Q, K and V are cast to float32 first.
    `weights_first`: the weights are divided by their row sums before ``P @ V``
    (XLA compiles the softmax and ``P @ V`` into one kernel); otherwise the
    ``(Lq, Dv)`` output is divided after it.
    """

    fold: bool = False
    flash: bool = False
    weights_first: bool = False


@dataclass(frozen=True)
class Tiled:
    """The online softmax over (query block, key block) pairs (``_lib/_tiled.py``).

    `block_q`, `block_k`: the tiles (ints, or the sizes of consecutive blocks);
    `fold`: as for :class:`Dense`, per block; `walk`: how the blocks are walked --
    ``"python"`` a Python loop of fresh arrays, ``"buffered"`` the same loop writing
    into buffers allocated once per call (NumPy's ``out=``, ``_paths/_buffered.py``),
    ``"loop"`` a traced loop (JAX's ``lax.map`` / ``fori_loop``, ``_paths/_loop.py``)
    whose program does not grow with the number of blocks; `workers`: threads over
    the query blocks (NumPy), 1 for the calling thread alone; `backward`: what
    differentiates the walk -- ``"torch"`` / ``"jax"`` the recomputing O(L) backward
    registered with that library, ``"autodiff"`` the library's own autodiff through
    the walk (a ``score_mod`` under ``torch.compile``), None no autodiff; `exp2`: the
    Python walk takes ``exp(x)`` as ``exp2(x · log2 e)`` (``Library.exp2``).
    """

    block_q: Blocks
    block_k: Blocks
    fold: bool = False
    walk: Literal["python", "buffered", "loop"] = "python"
    workers: int = 1
    backward: Literal["torch", "jax", "autodiff"] | None = None
    exp2: bool = False


@dataclass(frozen=True)
class Native:
    """The framework's fused kernel with our masks and empty-row contract (``_native.py``).

    `kernel`: ``"sdpa"`` (torch), ``"flex"`` (torch's ``flex_attention``, ``_flex.py``:
    every mask, score term and the row statistics in one fused kernel) or ``"jax_nn"``
    (``jax.nn.dot_product_attention``).
    `upcast`: half-precision Q, K, V (and bias) reach the kernel cast to float32;
    False: in their own dtype, for a kernel that accumulates in float32 itself.
    `tiles`: None, one kernel call for the whole call; an int, one call per query
    tile of that many rows over the keys its visible key tiles span.
    `guard`: rows that may see no key are given a harmless mask and zeroed after
    the kernel (False where no row can be empty or the kernel zeroes them itself).
    `min_keys`: a kernel call over fewer keys gets an explicit boolean mask (the
    unmasked kernel loses a NaN of a query there).
    `per_sequence`: one kernel call per sequence over its own valid keys (host-read
    `kv_lengths` that differ): no padding mask, no padded key computed or read.
    `implementation`: the ``implementation=`` ``jax.nn.dot_product_attention`` is
    given (``"cudnn"``, ``"xla"``, or None: its own choice).
    `compiled`: the kernel runs ``torch.compile``-d, once per signature (flex; its
    uncompiled form materialises the whole scores).
    `fallback`: the portable route of a flex call with a user's ``score_mod`` or
    ``mask_mod``, run where flex cannot trace them (a function written for the
    portable path's blocks, which flex calls on scalar indices under ``vmap``), or
    with segment ids, run where a value is not finite (flex's ``P @ V`` would weigh
    another document's NaN by 0).
    """

    kernel: Literal["sdpa", "flex", "jax_nn"] = "sdpa"
    upcast: bool = True
    tiles: int | None = None
    guard: bool = True
    min_keys: int = 0
    per_sequence: bool = False
    implementation: Literal["cudnn", "xla"] | None = None
    compiled: bool = False
    fallback: Route | None = None


@dataclass(frozen=True)
class DaskGrid:
    """Dask: tasks over the visible (query chunk, key chunk) pairs, merged by a tree.

    `q_chunks`, `k_chunks`: the chunk sizes along ``Lq`` and ``Lk``; `inner`: the
    path each pair runs on its chunks (:class:`Dense`: one block per pair);
    `merge_fan_in`: partials merged per merge task; `task_scores`: consecutive
    visible pairs of a query chunk share one task (and one walk) until it holds
    that many scores (0: a task per pair).
    """

    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    inner: Dense | Tiled
    merge_fan_in: int
    task_scores: int = 0


@dataclass(frozen=True)
class Paged:
    """``batch_invariant``: the paged walk, each sequence a request over pages of one slot.

    ``_paths/_paged.py``'s :func:`invariant_attention`: a row's bits are those
    ``ragged_paged_attention(batch_invariant=True)`` gives its sequence, whatever else
    the batch holds.
    """


#: The path of one call: exactly one of these.
Path = Empty | Dense | Tiled | Native | DaskGrid | Paged


@dataclass(frozen=True)
class Route:
    """Everything the router decided for one call.

    `path`: what computes it. `keys`: compute only the first `keys` keys (those the
    host-read `kv_lengths` show some row), None for all. `compiled`: an eager JAX
    call runs `path` as one compiled program, cached per call signature
    (``_paths/_compiled.py``). `keeps_dtype`: half-precision Q, K, V reach the path
    in their own dtype (no float32 copies).
    """

    path: Path
    keys: int | None = None
    compiled: bool = False
    keeps_dtype: bool = False

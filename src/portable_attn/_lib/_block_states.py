"""Block states of a ``mask_mod``: which (query block, key block) pairs it hides.

A ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (FlexAttention's convention,
written with array-API operations) says which entries may attend. Its *block
states* say, per (batch, head, query block, key block), whether the block is

- :data:`HIDDEN` (0): every entry is False -- the pair is not computed at all;
- :data:`PARTIAL` (1): some entries are True -- computed, the mask evaluated;
- :data:`FULL` (2): every entry is True -- computed without any mask work.

:func:`build_states` evaluates the mask one tile of blocks at a time (O(block)
memory, never the (Lq, Lk) mask); :class:`HostStates` answers, for any query and key
ranges, what the states say of the rectangle (every path's tiles and Dask's chunks,
whatever their size: a rectangle is hidden only if every block it overlaps is, full
only if every block it overlaps is -- exact in both directions, since a part of a
full block is full and a part of a hidden block hidden).

Everything except :class:`HostStates` is array-API standard; :class:`HostStates`
holds NumPy copies, read on the host while a path decides what to compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from . import _route
from ._compat import (
    array_namespace,
    device,
    has_concrete_values,
    numpy_namespace,
    on_device,
    register_pytree,
    to_host,
)
from ._masks import at_rank

__all__ = [
    "FULL",
    "HIDDEN",
    "PARTIAL",
    "BlockMask",
    "HostStates",
    "block_index",
    "build_states",
    "evaluate_mask_mod",
]

Array = Any
MaskMod = Callable[[Array, Array, Array, Array], Array]

HIDDEN, PARTIAL, FULL = 0, 1, 2

Range = tuple[int, int]


def block_index(
    xp: Any, batch: Any, heads: int, q_range: Range, k_range: Range, device: Any = None
) -> tuple[Any, Any, Any, Any]:
    """Return the index arrays of one block for ``mask_mod`` and ``score_mod``, at one rank.

    `batch` is the (*batch, 1, 1, 1) flat batch index; ``head`` comes back as
    (1..., H, 1, 1), ``q_idx`` as (1..., 1, bq, 1) and ``kv_idx`` as (1..., 1, 1, bk)
    (absolute positions), each with ``batch.ndim`` axes: a ``mask_mod`` or
    ``score_mod`` written FlexAttention's way (``score + table[q_idx - kv_idx]``,
    ``kv_idx < lengths[b]``) then broadcasts without rank promotion, which JAX with
    ``jax_numpy_rank_promotion="raise"`` refuses.
    """
    rank = batch.ndim
    head = at_rank(xp, xp.arange(0, heads, **on_device(device))[:, None, None], rank)
    q_idx = at_rank(xp, xp.arange(q_range[0], q_range[1], **on_device(device))[:, None], rank)
    kv_idx = at_rank(xp, xp.arange(k_range[0], k_range[1], **on_device(device))[None, :], rank)
    return batch, head, q_idx, kv_idx


def evaluate_mask_mod(
    xp: Any,
    mask_mod: Callable[..., Any],
    batch: Any,
    heads: int,
    q_range: Range,
    k_range: Range,
    device: Any = None,
) -> Any:
    """``mask_mod`` of one block: bool (..., H, bq, bk), broadcast as it returned it.

    `batch` is the (*batch, 1, 1, 1) flat batch index; the indices are those of
    :func:`block_index` (absolute positions, every one at the rank of `batch`).
    """
    return mask_mod(*block_index(xp, batch, heads, q_range, k_range, device))


def build_states(
    xp: Any,
    mask_mod: Callable[..., Any],
    batch_index: Any,
    heads: int,
    q_len: int,
    kv_len: int,
    block: tuple[int, int],
    device: Any = None,
    check: Callable[[Any, tuple[int, ...]], None] | None = None,
    map_tiles: Callable[..., Any] = map,
) -> Any:
    """Block states (*batch, heads, nq, nk) as int8 (:data:`HIDDEN`/:data:`PARTIAL`/:data:`FULL`).

    `batch_index` is the (*batch, 1, 1, 1) flat batch index given to `mask_mod`.
    The mask is evaluated on tiles of whole blocks, each at most
    :data:`~._route.MASK_TILE_ENTRIES` booleans in all (over the (batch, head) pairs
    it differs over, which one block evaluated first tells): memory O(block),
    whatever the lengths; a mask that does not depend on the batch or head is
    reduced in its own broadcast shape (not once per head). `check` (result,
    expected shape) validates what `mask_mod` returned, on that first block.
    `map_tiles` maps the tile function over the tiles (a thread pool's ``map``
    for libraries that release the GIL).
    """
    bq, bk = block
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    lead = (*batch_index.shape[:-3], heads)
    if nq == 0 or nk == 0:
        return xp.zeros((*lead, nq, nk), dtype=xp.int8, **on_device(device))
    first = (min(bq, q_len), min(bk, kv_len))
    probe = evaluate_mask_mod(
        xp, mask_mod, batch_index, heads, (0, first[0]), (0, first[1]), device
    )
    if check is not None:  # raises a mask_mod's errors before any thread starts
        check(probe, (*lead, *first))
    differs_over = math.prod(probe.shape[:-2])  # (batch, head) pairs evaluated apart
    if differs_over == 0:  # no sequence or head: nothing to hide or show
        return xp.zeros((*lead, nq, nk), dtype=xp.int8, **on_device(device))
    per_block = bq * bk * differs_over
    entries = _route.MASK_TILE_ENTRIES
    cols = max(1, min(nk, entries // per_block))  # key blocks per tile
    rows = max(1, min(nq, entries // (per_block * cols)))  # query blocks per tile

    def tile(start: tuple[int, int]) -> Any:
        i, j = start
        q_range = (i * bq, min((i + rows) * bq, q_len))
        k_range = (j * bk, min((j + cols) * bk, kv_len))
        allowed = evaluate_mask_mod(xp, mask_mod, batch_index, heads, q_range, k_range, device)
        block_shape = (q_range[1] - q_range[0], k_range[1] - k_range[0])
        allowed = xp.broadcast_to(allowed, (*allowed.shape[:-2], *block_shape))
        n_rows, n_cols = min(rows, nq - i), min(cols, nk - j)
        states = _reduce_tile(xp, allowed, n_rows * bq, n_cols * bk, block, device)
        return xp.broadcast_to(states, (*lead, n_rows, n_cols))

    starts = [(i, j) for i in range(0, nq, rows) for j in range(0, nk, cols)]
    tiles = list(map_tiles(tile, starts))
    per_row = -(-nk // cols)
    lines = [tiles[r : r + per_row] for r in range(0, len(tiles), per_row)]
    axis = len(lead)
    joined = [ln[0] if len(ln) == 1 else xp.concat(ln, axis=axis + 1) for ln in lines]
    return joined[0] if len(joined) == 1 else xp.concat(joined, axis=axis)


def _reduce_tile(
    xp: Any, allowed: Any, rows: int, cols: int, block: tuple[int, int], device: Any
) -> Any:
    """States of one tile (..., r, c): pad to whole blocks, then any / all per block."""
    bq, bk = block
    *lead, r, c = allowed.shape
    any_in, all_in = allowed, allowed
    kw = on_device(device)
    if c < cols:  # the last key block is short: pad with False for any, True for all
        pad = (*lead, r, cols - c)
        any_in = xp.concat([any_in, xp.zeros(pad, dtype=xp.bool, **kw)], axis=-1)
        all_in = xp.concat([all_in, xp.ones(pad, dtype=xp.bool, **kw)], axis=-1)
    if r < rows:
        pad = (*lead, rows - r, cols)
        any_in = xp.concat([any_in, xp.zeros(pad, dtype=xp.bool, **kw)], axis=-2)
        all_in = xp.concat([all_in, xp.ones(pad, dtype=xp.bool, **kw)], axis=-2)
    grid = (*lead, rows // bq, bq, cols // bk, bk)
    n = len(lead)
    # one axis at a time: a two-axis reduction copies the tile first in some libraries
    # (torch through array-api-compat measured about twice as slow, by hand)
    some = xp.any(xp.any(xp.reshape(any_in, grid), axis=n + 3), axis=n + 1)  # (..., nq, nk)
    every = xp.all(xp.all(xp.reshape(all_in, grid), axis=n + 3), axis=n + 1)
    # HIDDEN 0, PARTIAL 1, FULL 2: every block shown in full is shown at all
    return xp.astype(some, xp.int8) + xp.astype(every, xp.int8)


class HostStates:
    """Block states read on the host, reduced over batch and heads.

    The paths compute every batch item and head of a block together: a state block
    is hidden only if every (batch, head) hides it, and needs no mask only if every
    one shows it all (``_blocks.pair_states`` reads them at any block size).

    Parameters
    ----------
    states : NumPy array of int8, shape (..., nq, nk)
    block : (int, int)
        The query and key block sizes of the states.
    """

    def __init__(self, states: Any, block: tuple[int, int]) -> None:
        np_xp = numpy_namespace()
        self.block = block
        lead = tuple(range(states.ndim - 2))
        self.some = np_xp.any(states != HIDDEN, axis=lead)  # (nq, nk)
        self.every = np_xp.all(states == FULL, axis=lead)  # (nq, nk)

    def built(self, block: tuple[int, int]) -> HostStates:
        """Return these states (their own block size; `block` is a hint for lazy ones)."""
        return self


class LazyHostStates:
    """:class:`HostStates` of a ``mask_mod`` given without a block mask, built when first asked.

    The dense path never asks (it evaluates the mask once); a tiled path asks for the
    states of its pairs, and they are built then, once per call, in blocks of the
    first pairs asked about (coarser pairs are read exactly, finer ones as partial).
    """

    def __init__(
        self,
        xp: Any,
        mask_mod: MaskMod,
        batch_index: Any,
        heads: int,
        q_len: int,
        kv_len: int,
        device: Any,
    ) -> None:
        self._args = (xp, mask_mod, batch_index, heads, q_len, kv_len)
        self._device = device
        self._host: HostStates | None = None
        self._unreadable = False

    def built(self, block: tuple[int, int]) -> HostStates | None:
        """Return the states, built in blocks of `block` on the first call.

        None where the rule's values cannot be read (it closes over a value a
        transform traces: ``vmap`` over per-example document ids).
        """
        if self._host is None and not self._unreadable:
            block = (max(1, block[0]), max(1, block[1]))
            states = build_states(*self._args, block, self._device)
            if has_concrete_values(states):
                self._host = HostStates(to_host(states), block)
            else:
                self._unreadable = True
        return self._host


class BlockMask:
    """Which (query block, key block) pairs a ``mask_mod`` hides, shows in part or in full.

    Built by :func:`create_block_mask`; pass it as ``block_mask=`` to
    :func:`~portable_attn.scaled_dot_product_attention`, which then applies its
    `mask_mod` and skips the hidden blocks. Under ``jax.jit`` it is a pytree (its
    states are the one leaf), so it can be a traced argument.

    Attributes
    ----------
    states : integer array, shape (B | 1, H | 1, nq, nk)
        0 hidden, 1 partial, 2 full, per block of ``block_size`` queries and keys
        (the last blocks may be shorter), in the namespace and on the device it was
        built with.
    mask_mod : callable
        The mask itself, evaluated on the blocks that are partially visible.
    q_len, kv_len : int
        The lengths it was built for; a call must have exactly these.
    block_size : (int, int)
        Query and key block sizes.
    """

    def __init__(
        self,
        states: Array,
        mask_mod: MaskMod,
        q_len: int,
        kv_len: int,
        block_size: tuple[int, int],
    ) -> None:
        self.states = states
        self.mask_mod = mask_mod
        self.q_len = q_len
        self.kv_len = kv_len
        self.block_size = block_size
        self._host: HostStates | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B | 1, H | 1, Lq, Lk): the mask's shape, a broadcast axis as 1."""
        b, h = self.states.shape[:2]
        return (int(b), int(h), self.q_len, self.kv_len)

    def host(self) -> HostStates | None:
        """Return the states read on the host (cached), or None while they are traced."""
        if self._host is None and _readable(self.states):
            self._host = HostStates(to_host(self.states), self.block_size)
        return self._host

    def _fractions(self) -> tuple[float, float] | None:
        """(full, partial) fractions of the (batch, head, block) states, or None if traced."""
        if not _readable(self.states):
            return None
        np_xp = numpy_namespace()
        states = to_host(self.states)
        if states.size == 0:
            return 0.0, 0.0

        def share(state: int) -> float:
            return float(np_xp.mean(np_xp.astype(states == state, np_xp.float64)))

        return share(FULL), share(PARTIAL)

    def visible_fraction(self) -> float:
        """Return the fraction of blocks that are computed (partially or fully visible)."""
        fractions = self._fractions()
        if fractions is None:
            msg = "the states of this BlockMask are traced: their values cannot be read"
            raise ValueError(msg)
        return fractions[0] + fractions[1]

    def sparsity(self) -> float:
        """Percentage of blocks hidden (not computed), as FlexAttention's ``sparsity()``."""
        return 100.0 * (1.0 - self.visible_fraction())

    def to_dense(self) -> Array:
        """Return the boolean mask (B | 1, H | 1, Lq, Lk) this block mask applies (checking).

        Evaluates `mask_mod` on every entry: O(Lq · Lk) memory.
        """
        xp = array_namespace(states=self.states)
        b, h, lq, lk = self.shape
        dev = device(self.states)
        batch = xp.reshape(xp.arange(0, b, **on_device(dev)), (b, 1, 1, 1))
        allowed = evaluate_mask_mod(xp, self.mask_mod, batch, h, (0, lq), (0, lk), dev)
        return xp.broadcast_to(allowed, (b, h, lq, lk))

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        fractions = self._fractions()
        if fractions is None:
            computed = "computed=traced"
        else:
            full, partial = fractions
            computed = (
                f"computed={100 * (full + partial):.1f}% of blocks "
                f"(full {100 * full:.1f}%, partial {100 * partial:.1f}%)"
            )
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, {computed}, "
            f"mask_mod={name})"
        )

    # JAX pytree protocol: the states are the leaf, everything else is static
    def tree_flatten(self) -> tuple[tuple[Array], tuple[Any, ...]]:
        return (self.states,), (self.mask_mod, self.q_len, self.kv_len, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Array, ...]) -> BlockMask:
        return cls(children[0], *aux)


register_pytree(
    BlockMask,
    lambda bm: bm.tree_flatten(),
    lambda aux, children: BlockMask.tree_unflatten(aux, children),
)


def _readable(states: Any) -> bool:
    """Whether the states' values can be read now (Dask's are computed: they are small)."""
    return _route.library(states).task_graphs or has_concrete_values(states)

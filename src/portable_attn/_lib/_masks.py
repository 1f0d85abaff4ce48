"""Boolean "allowed" arrays built from index arithmetic.

Causal and sliding-window structure is never stored: it is computed from query
and key positions for exactly the (query block, key block) being processed, so
the dense path builds one ``(Lq, Lk)`` boolean array and a tiled path can build
one per block. All positions use the bottom-right alignment of the library::

    i' = i + (Lk - Lq)          # query i's position on the key axis
    causal:  j <= i'
    window:  i' - left <= j <= i' + right
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._compat import on_device

__all__ = [
    "Alignment",
    "Band",
    "arange",
    "at_rank",
    "padding_allowed",
    "segment_allowed",
]

Range = tuple[int, int]


def arange(xp: Any, start: int, stop: int, device: Any) -> Any:
    """Positions ``start .. stop - 1`` next to the inputs (`device` may be None)."""
    return xp.arange(start, stop, **on_device(device))


def take_at(xp: Any, values: Any, idx: Any) -> Any:
    """``values[idx]`` for a 1-D `values` and an index array of any shape."""
    return xp.reshape(xp.take(values, xp.reshape(idx, (-1,))), idx.shape)


def at_rank(xp: Any, x: Any, ndim: int) -> Any:
    """`x` with leading axes of size one up to `ndim` axes: broadcasting without rank promotion.

    The engine's arrays broadcast against each other by shape; JAX with
    ``jax_numpy_rank_promotion="raise"`` (a documented option some code bases set)
    refuses operands of different ranks, so every operand is given the same rank
    first. A free reshape; `x` itself when it has `ndim` axes or more (or is None).
    """
    if x is None or x.ndim >= ndim:
        return x
    return xp.reshape(x, (1,) * (ndim - x.ndim) + tuple(x.shape))


@dataclass(frozen=True)
class Alignment:
    """Where the queries and keys of a call sit in the whole sequences: the one alignment.

    A whole call has the defaults. A part of a call (a Dask chunk pair, a block
    placed by :func:`portable_attn._paths._partial.place_block`) starts at
    `q_start` / `kv_start` of `q_total` / `kv_total` queries and keys. Query ``i``
    of the part is aligned on the key axis at ``i' = i + offset`` (see
    :meth:`offset`): bottom-right, ``i' = i + Lk - Lq`` for a whole call.
    """

    q_start: int = 0
    kv_start: int = 0
    q_total: int | None = None  # None: the call's own Lq
    kv_total: int | None = None  # None: the call's own Lk

    def static_offset(self, q_len: int, kv_len: int) -> int:
        """``i' - i`` from shapes alone: ``Lk_total - Lq_total + q_start - kv_start``."""
        q_total = q_len if self.q_total is None else self.q_total
        kv_total = kv_len if self.kv_total is None else self.kv_total
        return kv_total - q_total + self.q_start - self.kv_start

    def offset(self, q_len: int, kv_len: int, q_lengths: Any, kv_lengths: Any) -> Any:
        """``i' - i``: static, or per sequence (*batch, 1, 1, 1) when lengths are given.

        The lengths are those of this call's own positions (a part's are already
        shifted by its start), so ``i' = i + kv_len[b] - q_len[b]`` in local indices.
        """
        if q_lengths is None and kv_lengths is None:
            return self.static_offset(q_len, kv_len)
        q_total = q_len if self.q_total is None else self.q_total
        kv_total = kv_len if self.kv_total is None else self.kv_total
        kv = kv_total - self.kv_start if kv_lengths is None else kv_lengths
        q = q_total - self.q_start if q_lengths is None else q_lengths
        return kv - q


@dataclass(frozen=True)
class Band:
    """The causal / sliding-window band: the one place it is computed.

    Query ``i`` (aligned at ``i' = i + offset``) may see key ``j`` iff
    ``i' - left <= j <= i' + right``; a None side is unbounded. Causal is
    ``right = min(right, 0)``.
    """

    left: int | None = None
    right: int | None = None

    @classmethod
    def of(cls, is_causal: bool, window: tuple[int | None, int | None] | None) -> Band:
        """Return the band of ``is_causal`` and ``window=(left, right)``."""
        left, right = window if window is not None else (None, None)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        if left is None and right is None:
            return _UNBOUNDED
        return cls(left, right)

    @property
    def restricts(self) -> bool:
        """Whether the band hides anything at all."""
        return self.left is not None or self.right is not None

    def allowed(
        self, xp: Any, q_range: Range, k_range: Range, offset: Any, device: Any = None
    ) -> Any | None:
        """Return the "may attend" array of a block of queries and keys, or None.

        Parameters
        ----------
        xp : namespace
            Array namespace to build the array in.
        q_range, k_range : (int, int)
            Half-open ranges ``[start, stop)`` of query and key positions.
        offset : int or integer array of shape (*batch, 1, 1, 1)
            ``i' - i`` (:meth:`Alignment.offset`).
        device : device, optional
            Device of the inputs.

        Returns
        -------
        array of bool, shape (bq, bk), or (*batch, 1, bq, bk) with an array offset
            None when the band restricts nothing.
        """
        if not self.restricts:
            return None
        if not hasattr(offset, "ndim"):  # an int (or torch.export's symbolic int)
            q_pos = arange(xp, q_range[0] + offset, q_range[1] + offset, device)[:, None]
        else:  # (*batch, 1, bq, 1)
            q_pos = at_rank(xp, arange(xp, q_range[0], q_range[1], device)[:, None], offset.ndim)
            q_pos = q_pos + offset
        k_pos = at_rank(xp, arange(xp, k_range[0], k_range[1], device)[None, :], q_pos.ndim)
        return self.between(q_pos, k_pos)

    def between(self, q_pos: Any, k_pos: Any) -> Any:
        """Return whether a query at (aligned) `q_pos` may see the key at `k_pos`.

        Integers or integer arrays that broadcast together; True where the band
        restricts nothing. The one place the band's comparison is written.
        """
        allowed: Any = True
        lo, hi = self.key_bounds(q_pos, q_pos)
        if hi is not None:
            allowed = k_pos <= hi
        if lo is not None:
            allowed = allowed & (k_pos >= lo)
        return allowed

    def key_bounds(self, first_q: Any, last_q: Any) -> tuple[Any | None, Any | None]:
        """Return the first and last key the (aligned) rows ``first_q..last_q`` may see.

        ``(first_q - left, last_q + right)``, None on an unbounded side; integers or
        arrays. Swapped, ``key_bounds(last_q, first_q)`` are the keys *every* row sees.
        """
        lo = None if self.left is None else first_q - self.left
        hi = None if self.right is None else last_q + self.right
        return lo, hi

    def blocks(self, first_q: Any, last_q: Any, first_k: Any, last_k: Any) -> tuple[Any, Any]:
        """Return ``(hidden, full)`` of rows ``first_q..last_q`` and keys ``first_k..last_k``.

        `hidden`: the band hides every key from every row; `full`: it shows every key to
        every row. Integers (bools) or arrays (elementwise).
        """
        hidden: Any = False
        full: Any = True
        lo, hi = self.key_bounds(first_q, last_q)  # what some row sees
        lo_all, hi_all = self.key_bounds(last_q, first_q)  # what every row sees
        if hi is not None:
            hidden = first_k > hi
            full = last_k <= hi_all
        if lo is not None:
            hidden = hidden | (last_k < lo)
            full = full & (first_k >= lo_all)
        return hidden, full

    def visibility(self, q_range: Range, k_range: Range, offset: int | None) -> str:
        """``"skip"`` when the band hides the whole block, else ``"partial"`` or ``"full"``.

        `offset` None: the alignment depends on values (lengths): every block is "partial".
        """
        if offset is None:
            return "partial"
        hidden, full = self.blocks(
            q_range[0] + offset, q_range[1] - 1 + offset, k_range[0], k_range[1] - 1
        )
        return "skip" if hidden else "full" if full else "partial"

    def empties_rows(self, q_len: int, kv_len: int, offset: int | None) -> bool:
        """Whether some query row sees no key through the band alone (None offset: maybe)."""
        if not self.restricts:
            return False
        if offset is None:
            return True
        if q_len == 0 or kv_len == 0:
            return kv_len == 0 < q_len
        # a row is empty iff its band misses [0, Lk): the first row is the first to miss
        # it on the left, the last on the right
        first, last = (self.blocks(q, q, 0, kv_len - 1)[0] for q in (offset, offset + q_len - 1))
        return bool(first or last)


_UNBOUNDED = Band()


def padding_allowed(
    xp: Any,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    q_lengths: Any | None,
    kv_lengths: Any | None,
    device: Any = None,
) -> Any | None:
    """Valid-prefix mask from per-sequence lengths of shape (*batch, 1, 1, 1).

    Query ``i`` is valid iff ``i < q_len``, key ``j`` iff ``j < kv_len``; the
    result broadcasts to (*batch, 1, bq, bk). None when no lengths are given.
    """
    allowed = None
    if kv_lengths is not None:
        keys = arange(xp, k_range[0], k_range[1], device)[None, :]
        allowed = at_rank(xp, keys, kv_lengths.ndim) < kv_lengths  # (*batch, 1, 1, bk)
    if q_lengths is not None:
        rows = arange(xp, q_range[0], q_range[1], device)[:, None]
        rows = at_rank(xp, rows, q_lengths.ndim) < q_lengths  # (*batch, 1, bq, 1)
        if allowed is not None:
            ndim = max(rows.ndim, allowed.ndim)
            rows = xp.logical_and(at_rank(xp, allowed, ndim), at_rank(xp, rows, ndim))
        allowed = rows
    return allowed


def segment_allowed(
    xp: Any, q_segments: Any, kv_segments: Any, q_range: tuple[int, int], k_range: Any
) -> Any | None:
    """Packed sequences: query ``i`` may see key ``j`` iff their segment ids are equal.

    The ids are (*batch, 1, Lq, 1) and (*batch, 1, 1, Lk); the block's comparison
    broadcasts to (*batch, 1, bq, bk). None without segment ids.
    """
    if q_segments is None:
        return None
    q_ids = q_segments[..., q_range[0] : q_range[1], :]  # (*batch, 1, bq, 1)
    kv_ids = kv_segments[..., k_range[0] : k_range[1]]  # (*batch, 1, 1, bk)
    ndim = max(q_ids.ndim, kv_ids.ndim)
    return at_rank(xp, q_ids, ndim) == at_rank(xp, kv_ids, ndim)

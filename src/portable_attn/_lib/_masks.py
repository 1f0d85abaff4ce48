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

from typing import Any

from ._compat import on_device

__all__ = ["SegmentBlocks", "arange", "padding_allowed", "segment_allowed", "structure_allowed"]


def arange(xp: Any, start: int, stop: int, device: Any) -> Any:
    """Positions ``start .. stop - 1`` next to the inputs (`device` may be None)."""
    return xp.arange(start, stop, **on_device(device))


def structure_allowed(
    xp: Any,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    *,
    offset: Any,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    device: Any = None,
) -> Any | None:
    """Return the causal/window "may attend" array for a block of queries and keys.

    Parameters
    ----------
    xp : namespace
        Array namespace to build the array in.
    q_range, k_range : (int, int)
        Half-open ranges ``[start, stop)`` of query and key positions.
    offset : int or integer array of shape (*batch, 1, 1, 1)
        ``Lk - Lq`` (or ``kv_len - q_len`` per sequence when lengths are given):
        added to query positions to align them on the key axis.
    is_causal : bool
        Apply ``j <= i'``.
    window : (int or None, int or None) or None
        ``(left, right)`` band around ``i'``; None sides are unbounded.
    device : device, optional
        Device of the inputs.

    Returns
    -------
    array of bool, shape (q_stop - q_start, k_stop - k_start), or None
        (with an array offset: shape (*batch, 1, bq, bk)). None when neither
        causal nor any window side restricts anything.
    """
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    if isinstance(offset, int):
        q_pos = arange(xp, q_range[0] + offset, q_range[1] + offset, device)[:, None]  # (Lq, 1)
    else:
        q_pos = arange(xp, q_range[0], q_range[1], device)[:, None] + offset  # (..., 1, Lq, 1)
    k_pos = arange(xp, k_range[0], k_range[1], device)[None, :]  # (1, Lk)
    allowed = None
    if right is not None:
        allowed = k_pos <= q_pos + right  # (Lq, Lk)
    if left is not None:
        lower = k_pos >= q_pos - left  # (Lq, Lk)
        allowed = lower if allowed is None else xp.logical_and(allowed, lower)
    return allowed


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
        allowed = arange(xp, k_range[0], k_range[1], device)[None, :] < kv_lengths  # (.., 1, bk)
    if q_lengths is not None:
        rows = arange(xp, q_range[0], q_range[1], device)[:, None] < q_lengths  # (.., bq, 1)
        allowed = rows if allowed is None else xp.logical_and(allowed, rows)
    return allowed


def segment_allowed(
    q_segments: Any | None, kv_segments: Any | None, q_range: tuple[int, int], k_range: Any
) -> Any | None:
    """Packed sequences: query ``i`` may see key ``j`` iff their segment ids are equal.

    The ids are (*batch, 1, Lq, 1) and (*batch, 1, 1, Lk); the block's comparison
    broadcasts to (*batch, 1, bq, bk). None without segment ids.
    """
    if q_segments is None:
        return None
    q_ids = q_segments[..., q_range[0] : q_range[1], :]  # (*batch, 1, bq, 1)
    kv_ids = kv_segments[..., k_range[0] : k_range[1]]  # (*batch, 1, 1, bk)
    return q_ids == kv_ids


class SegmentBlocks:
    """Which (query block, key block) pairs share no segment, from concrete host ids.

    Built only for host arrays (NumPy) whose values can be read eagerly; under
    ``jax.jit`` nothing is skipped by value. A pair is skipped when, in every
    sequence of the batch, the id range of the query block and that of the key
    block do not overlap (exact for packed, sorted ids; never wrong for others:
    a pair that merely shares no id but overlaps in range is computed and masked).

    Parameters
    ----------
    xp : namespace
    q_ids, kv_ids : integer arrays, shape (N, Lq) and (N, Lk)
        The ids, the batch broadcast and flattened to N sequences.
    """

    def __init__(self, xp: Any, q_ids: Any, kv_ids: Any) -> None:
        self._xp = xp
        self._q_ids, self._kv_ids = q_ids, kv_ids
        self._ranges: dict[tuple[bool, int, int], tuple[Any, Any]] = {}

    def _bounds(self, query: bool, r: tuple[int, int]) -> tuple[Any, Any]:
        key = (query, *r)
        found = self._ranges.get(key)
        if found is None:
            ids = (self._q_ids if query else self._kv_ids)[:, r[0] : r[1]]
            found = (self._xp.min(ids, axis=1), self._xp.max(ids, axis=1))  # (N,) each
            self._ranges[key] = found
        return found

    def disjoint(self, q_range: tuple[int, int], k_range: tuple[int, int]) -> bool:
        """Whether no query of `q_range` shares a segment with a key of `k_range`."""
        if q_range[0] >= q_range[1] or k_range[0] >= k_range[1]:
            return False
        q_lo, q_hi = self._bounds(True, q_range)
        k_lo, k_hi = self._bounds(False, k_range)
        xp = self._xp
        return bool(xp.all(xp.logical_or(q_hi < k_lo, k_hi < q_lo)))

    def one_segment(self, q_range: tuple[int, int], k_range: tuple[int, int]) -> bool:
        """Whether every query and key of the pair is in one and the same segment."""
        q_lo, q_hi = self._bounds(True, q_range)
        k_lo, k_hi = self._bounds(False, k_range)
        xp = self._xp
        same = xp.logical_and(xp.logical_and(q_lo == q_hi, k_lo == k_hi), q_lo == k_lo)
        return bool(xp.all(same))

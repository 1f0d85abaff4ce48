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

__all__ = ["structure_allowed"]


def _arange(xp: Any, start: int, stop: int, device: Any) -> Any:
    # Inside jax.jit the device of a tracer can be None: then let the library choose.
    if device is None:
        return xp.arange(start, stop)
    return xp.arange(start, stop, device=device)


def structure_allowed(
    xp: Any,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    *,
    offset: int,
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
    offset : int
        ``Lk - Lq``: added to query positions to align them on the key axis.
    is_causal : bool
        Apply ``j <= i'``.
    window : (int or None, int or None) or None
        ``(left, right)`` band around ``i'``; None sides are unbounded.
    device : device, optional
        Device of the inputs.

    Returns
    -------
    array of bool, shape (q_stop - q_start, k_stop - k_start), or None
        None when neither causal nor any window side restricts anything.
    """
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    q_pos = _arange(xp, q_range[0] + offset, q_range[1] + offset, device)[:, None]  # (Lq, 1)
    k_pos = _arange(xp, k_range[0], k_range[1], device)[None, :]  # (1, Lk)
    allowed = None
    if right is not None:
        allowed = k_pos <= q_pos + right  # (Lq, Lk)
    if left is not None:
        lower = k_pos >= q_pos - left  # (Lq, Lk)
        allowed = lower if allowed is None else xp.logical_and(allowed, lower)
    return allowed

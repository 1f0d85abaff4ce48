"""ALiBi: attention with linear biases (Press et al., 2022)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._lib._compat import namespace_or_numpy, on_device
from ._lib._validation import check_count

__all__ = ["get_alibi_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)  # 2^(-8/n), then its powers
    return [start ** (i + 1) for i in range(n)]


def get_alibi_slopes(num_heads: int, *, xp: Any = None, device: Any = None) -> Any:
    """Return the standard per-head ALiBi slopes, as in the ALiBi paper and BLOOM/MPT.

    For ``n`` heads, a power of two, the slopes are the geometric sequence
    ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``. Otherwise, with ``m`` the largest power
    of two below ``n``, they are the ``m`` slopes of ``m`` heads followed by
    every other slope of ``2m`` heads, ``n - m`` of them.

    Parameters
    ----------
    num_heads : int
        Number of query heads, ``Hq``.
    xp : namespace, optional
        Array namespace of the result; NumPy (float64) when omitted.
    device : device, optional
        Device of the result.

    Returns
    -------
    array, shape (num_heads,)
        Pass it as ``alibi_slopes=`` to :func:`scaled_dot_product_attention`.

    Examples
    --------
    >>> from portable_attn import get_alibi_slopes
    >>> get_alibi_slopes(4)
    array([0.25      , 0.0625    , 0.015625  , 0.00390625])
    """
    check_count("num_heads", num_heads, minimum=1)
    m = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(m)
    if m < num_heads:
        slopes += _power_of_two_slopes(2 * m)[0::2][: num_heads - m]
    xp = namespace_or_numpy(xp)
    return xp.asarray(np.asarray(slopes, dtype=np.float64), **on_device(device))

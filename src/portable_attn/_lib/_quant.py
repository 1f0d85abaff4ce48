"""Quantized KV pools: stored as int8, packed 4-bit or float8, dequantized where gathered.

A pool given with scales is held as :class:`Quantized`; the walks gather its pages (or
a row's listed keys) and dequantize only what they gathered (:func:`taken`), so no
float copy of the pool is ever made. ``x = (q - zero_point) · scale`` with a scale
(and an optional zero point) per token, ``(P, page_size, Hkv)``, or per group of
``D / G`` features, ``(P, page_size, Hkv, G)``. With 4 bits, each byte (uint8) holds two
signed values (two's complement, -8..7), the low nibble first. Only array-API
functions: the bit operations are the standard's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "Quantized",
    "Scaled",
    "as_rows",
    "dequantized",
    "each_part",
    "permuted",
    "quantized",
    "taken",
    "taken_scaled",
]


class Quantized(NamedTuple):
    """A pool stored quantized: its `data`, `scales`, `zero_points` (or None) and `bits`.

    `shape`, `ndim` and `dtype` are those of the pool it stands for (the features of
    a 4-bit pool are twice its bytes; the dtype is its scales'), so the checks of a
    float pool read it as one.
    """

    data: Any
    scales: Any
    zero_points: Any
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, d = self.data.shape
        return (*lead, d * 2 if self.bits == 4 else d)

    @property
    def ndim(self) -> int:
        return int(self.data.ndim)

    @property
    def dtype(self) -> Any:
        return self.scales.dtype


def _each(pool: Quantized, fn: Any) -> Quantized:
    """Apply ``fn(x, is_data)`` to the data, the scales and the zero points."""
    zp = None if pool.zero_points is None else fn(pool.zero_points, False)
    return Quantized(fn(pool.data, True), fn(pool.scales, False), zp, pool.bits)


def permuted(xp: Any, pool: Any, axes: tuple[int, ...]) -> Any:
    """``permute_dims`` of a pool's leading axes (a quantized pool's scales alike)."""
    if not isinstance(pool, Quantized):
        return xp.permute_dims(pool, axes)
    return _each(
        pool, lambda x, _: xp.permute_dims(x, axes[: x.ndim] + tuple(range(len(axes), x.ndim)))
    )


def as_rows(xp: Any, pool: Any) -> Any:
    """Return a (P, page_size, Hkv, D) pool as (P·page_size·Hkv, D) rows, a key each."""
    if not isinstance(pool, Quantized):
        return xp.reshape(pool, (-1, pool.shape[-1]))
    lead = pool.data.ndim - 1

    def rows(x: Any, is_data: bool) -> Any:
        return xp.reshape(x, (-1, *x.shape[lead:]) if is_data or x.ndim > lead else (-1,))

    return _each(pool, rows)


def taken(xp: Any, pool: Any, index: Any, dtype: Any) -> Any:
    """``take(pool, index, axis=0)`` as `dtype`, dequantized where the pool is quantized."""
    if not isinstance(pool, Quantized):
        return xp.astype(xp.take(pool, index, axis=0), dtype, copy=False)
    part = _each(pool, lambda x, _: xp.take(x, index, axis=0))
    return dequantized(xp, part, dtype)


class Scaled(NamedTuple):
    """Gathered keys or values whose per-token scale is applied later: ``(x - zero) · scale``.

    `x` (..., b, D) the stored values as floats, `scale` and `zero` (..., b, 1) (`zero`
    None: symmetric). The walk multiplies the scores and the weights by the scales (a
    score per key, a weight per value) instead of every feature: one pass less over what
    it gathered (``_paged.fold_keys``).
    """

    x: Any
    scale: Any
    zero: Any


def taken_scaled(xp: Any, pool: Any, index: Any, dtype: Any) -> Any:
    """:func:`taken`, but a pool with a scale per token as :class:`Scaled` (scales not applied)."""
    if not isinstance(pool, Quantized) or pool.scales.ndim != pool.data.ndim - 1:
        return taken(xp, pool, index, dtype)
    part = _each(pool, lambda x, _: xp.take(x, index, axis=0))
    x = dequantized(xp, Quantized(part.data, None, None, pool.bits), dtype)
    zero = None if part.zero_points is None else xp.astype(part.zero_points, dtype)[..., None]
    return Scaled(x, xp.astype(part.scales, dtype)[..., None], zero)


def each_part(fn: Any, x: Any) -> Any:
    """``fn`` of gathered keys, or of each part of :class:`Scaled` ones (None stays None)."""
    if not isinstance(x, Scaled):
        return fn(x)
    return Scaled(*(None if part is None else fn(part) for part in x))


def dequantized(xp: Any, pool: Quantized, dtype: Any) -> Any:
    """``(q - zero_point) · scale`` of (part of) a quantized pool, as `dtype` (..., D)."""
    data, scales, zp, bits = pool  # scales None: the stored values as `dtype` alone
    if bits == 4:  # two signed nibbles a byte, the low one first
        low = xp.bitwise_and(data, 15)
        high = xp.bitwise_right_shift(data, 4)
        pair = xp.stack([low, high], axis=-1)
        signed = xp.astype(pair, xp.int8) - xp.astype(pair >= 8, xp.int8) * 16
        data = xp.reshape(signed, (*data.shape[:-1], data.shape[-1] * 2))
    x = xp.astype(data, dtype)
    if scales is None:
        return x
    lead = x.shape[:-1]
    groups = 1 if scales.ndim == len(lead) else scales.shape[-1]
    x = xp.reshape(x, (*lead, groups, x.shape[-1] // groups))
    per = scales.ndim == len(lead)

    def spread(s: Any) -> Any:  # (..., ) or (..., G) -> (..., G, 1)
        s = xp.astype(s, dtype)
        return s[..., None, None] if per else s[..., None]

    if zp is not None:
        x = x - spread(zp)
    return xp.reshape(x * spread(scales), (*lead, -1))


def quantized(xp: Any, x: Any, groups: int, bits: int) -> tuple[Any, Any]:
    """Quantize `x` (..., D) symmetrically: data and scales, ``(...)`` or ``(..., G)``.

    ``scale = max|x| / (2**(bits-1) - 1)`` per token (`groups` 0) or per group of
    ``D / groups`` features, ``q = round(x / scale)`` (half to even), 0 where the scale is
    0; `bits` 8: int8, 4: two values a byte (uint8), the low nibble first.
    """
    top = 2 ** (bits - 1) - 1
    lead, d = x.shape[:-1], x.shape[-1]
    g = max(groups, 1)
    parts = xp.reshape(x, (*lead, g, d // g))
    scale = xp.max(xp.abs(parts), axis=-1, keepdims=True) / top
    safe = xp.where(scale == 0, xp.ones_like(scale), scale)
    q = xp.clip(xp.round(parts / safe), -float(top), float(top))  # float bounds of a float array
    q = xp.astype(xp.reshape(q, (*lead, d)), xp.int8)
    scales = scale[..., 0] if groups else scale[..., 0, 0]
    if bits == 4:
        nibbles = xp.astype(xp.bitwise_and(xp.astype(q, xp.int16), 15), xp.uint8)
        nibbles = xp.reshape(nibbles, (*lead, d // 2, 2))
        q = nibbles[..., 0] | xp.bitwise_left_shift(nibbles[..., 1], 4)
    return q, scales

"""An immutable, fixed-capacity key/value cache for autoregressive decoding.

The cache never changes shape: appending writes the new tokens into slots
``[length, length + T)`` by index arithmetic (no in-place writes), so one
``jax.jit`` compilation serves every decoding step. Attention over the cache
masks the slots past each sequence's length and aligns causality on the valid
lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._attention import scaled_dot_product_attention
from ._lib._compat import (
    array_namespace,
    device,
    has_concrete_values,
    library_name,
    namespace_or_numpy,
    on_device,
    register_pytree,
    to_host,
)
from ._lib._masks import arange, at_rank
from ._lib._validation import check_count

__all__ = ["KVCache", "kv_cache_append", "kv_cache_attention", "kv_cache_init"]


@dataclass(frozen=True)
class KVCache:
    """Keys and values of a fixed capacity and the valid length of each sequence.

    Attributes
    ----------
    keys : array, shape (B..., Hkv, capacity, Dk)
        Cached keys; slots at or past `lengths` are unused.
    values : array, shape (B..., Hkv, capacity, Dv)
        Cached values.
    lengths : integer array, shape (B...)
        Number of valid tokens of each sequence.
    """

    keys: Any
    values: Any
    lengths: Any

    @property
    def capacity(self) -> int:
        """The number of token slots, ``keys.shape[-2]``."""
        return int(self.keys.shape[-2])

    def __repr__(self) -> str:
        """Return the library, dtype, sizes and lengths: never the arrays themselves.

        ``KVCache(numpy float32, batch_shape=(2,), num_kv_heads=2, capacity=16,
        head_dim=64, lengths=[3, 5])``; more than 8 sequences give the lengths' range,
        traced (under ``jax.jit``) or lazy (Dask) lengths are not read.
        """
        keys, values, lengths = self.keys, self.values, self.lengths
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (keys, values, lengths)):
            return (
                f"KVCache(keys={keys!r}, values={values!r}, lengths={lengths!r})"  # pytree specs
            )
        lib = library_name(keys)
        dtype = str(keys.dtype).rsplit(".", 1)[-1]  # torch.float32, array_api_strict.float32
        dev = device(keys)  # None while traced
        shown = dev is not None and "cpu" not in str(dev).lower()
        head = f"{lib} {dtype}" + (f" on {dev}" if shown else "")
        sizes = (
            f"batch_shape={tuple(keys.shape[:-3])}, num_kv_heads={keys.shape[-3]}, "
            f"capacity={keys.shape[-2]}, head_dim={keys.shape[-1]}"
        )
        if values.shape[-1] != keys.shape[-1]:
            sizes += f", value_dim={values.shape[-1]}"
        return f"KVCache({head}, {sizes}, lengths={_lengths_summary(lengths)})"


def _lengths_summary(lengths: Any) -> str:
    """``[3, 5]``, ``"1-7 over 16 sequences"``, or ``"traced"`` / ``"lazy"`` (not read)."""
    if not has_concrete_values(lengths):
        return "lazy" if library_name(lengths) == "dask" else "traced"
    values = [int(n) for n in to_host(lengths).reshape(-1).tolist()]
    low, high = min(values, default=0), max(values, default=0)
    if len(values) <= 8:
        return str(values)
    if low == high:
        return f"{low} in all {len(values)} sequences"
    return f"{low}-{high} over {len(values)} sequences"


# a JAX pytree, so it passes through jax.jit, vmap and grad (whenever JAX is imported)
register_pytree(
    KVCache,
    lambda c: ((c.keys, c.values, c.lengths), None),
    lambda _, children: KVCache(*children),
)


def kv_cache_init(
    _xp: Any = None,
    /,
    *,
    batch_shape: tuple[int, ...],
    num_kv_heads: int,
    capacity: int,
    head_dim: int,
    value_dim: int | None = None,
    dtype: Any = None,
    device: Any = None,
    xp: Any = None,
) -> KVCache:
    """Create an empty cache of zeros with all lengths 0.

    Parameters
    ----------
    batch_shape : tuple of int
        Leading batch dims ``B...``.
    num_kv_heads, capacity, head_dim : int
        ``Hkv``, the number of token slots, ``Dk``.
    value_dim : int, optional
        ``Dv``; defaults to `head_dim`.
    dtype : dtype, optional
        Dtype of keys and values; float32 by default.
    device : device, optional
        Device of the arrays.
    xp : namespace, optional
        Array namespace of the cache (e.g. ``array_api_compat.array_namespace(q)``);
        NumPy when omitted. (Passing it first, positionally, is deprecated.)

    Returns
    -------
    KVCache
    """
    xp = namespace_or_numpy(xp, caller="kv_cache_init", positional=_xp)
    num_kv_heads = check_count("num_kv_heads", num_kv_heads, minimum=1)
    capacity = check_count("capacity", capacity, minimum=1)
    head_dim = check_count("head_dim", head_dim, minimum=1)
    if not isinstance(batch_shape, tuple):
        msg = f"`batch_shape` must be a tuple of sizes, but got {batch_shape!r}"
        raise TypeError(msg)
    batch_shape = tuple(check_count("batch_shape entry", n, minimum=0) for n in batch_shape)
    value_dim = head_dim if value_dim is None else check_count("value_dim", value_dim, minimum=1)
    dtype = xp.float32 if dtype is None else dtype
    kw = on_device(device)
    shape = (*batch_shape, num_kv_heads, capacity)
    return KVCache(
        keys=xp.zeros((*shape, head_dim), dtype=dtype, **kw),
        values=xp.zeros((*shape, value_dim), dtype=dtype, **kw),
        lengths=xp.zeros(tuple(batch_shape), dtype=xp.int32, **kw),
    )


def _write(xp: Any, slots: Any, new: Any, lengths: Any, t: int) -> Any:
    """Write `new` (..., Hkv, T, D) at slots [length, length + T) of `slots` (..., Hkv, C, D)."""
    cap = slots.shape[-2]
    start = xp.reshape(lengths, (*lengths.shape, 1, 1, 1))  # (..., 1, 1, 1)
    pos = at_rank(xp, arange(xp, 0, cap, device(slots))[:, None], start.ndim) - start
    inside = xp.logical_and(pos >= 0, pos < t)  # (..., 1, C, 1)
    if hasattr(xp, "take_along_axis"):
        index = xp.clip(pos, 0, t - 1)  # (..., 1, C, 1)
        gathered = xp.take_along_axis(new, index, axis=-2)  # (..., Hkv, C, D)
        return xp.where(inside, gathered, slots)
    out = slots  # libraries without take_along_axis (Dask): one select per new token
    for i in range(t):
        out = xp.where(pos == i, new[..., i : i + 1, :], out)
    return out


def kv_cache_append(cache: KVCache, key: Any, value: Any) -> KVCache:
    """Return a new cache with `key`/`value` appended after each sequence's valid tokens.

    Parameters
    ----------
    cache : KVCache
        The current cache (not modified).
    key : array, shape (B..., Hkv, T, Dk)
        New keys (already position-encoded, e.g. by :func:`apply_rope`).
    value : array, shape (B..., Hkv, T, Dv)
        New values.

    Returns
    -------
    KVCache
        Same shapes; ``lengths`` increased by ``T``.

    Raises
    ------
    ValueError
        Shapes that do not match the cache, or (where lengths are concrete, i.e.
        not traced under ``jax.jit``) an append past the capacity.
    """
    xp = array_namespace(key=key, value=value, keys=cache.keys)
    for name, x, ref in (("key", key, cache.keys), ("value", value, cache.values)):
        exp = (*ref.shape[:-2], ref.shape[-1])
        got = (*x.shape[:-2], x.shape[-1])
        if x.ndim != ref.ndim or got != exp:
            msg = (
                f"`{name}` shape {tuple(x.shape)} does not match the cache: expected "
                f"(..., Hkv, T, D) with (..., Hkv) and D of cache shape {tuple(ref.shape)}"
            )
            raise ValueError(msg)
    if key.shape[-2] != value.shape[-2]:
        msg = (
            "`key` and `value` must add the same number of tokens (axis -2), but got "
            f"key shape {tuple(key.shape)} and value shape {tuple(value.shape)}"
        )
        raise ValueError(msg)
    t = int(key.shape[-2])
    if t == 0:  # nothing to append: the same cache
        return cache
    _check_capacity(xp, cache, t)
    keys = _write(xp, cache.keys, xp.astype(key, cache.keys.dtype), cache.lengths, t)
    values = _write(xp, cache.values, xp.astype(value, cache.values.dtype), cache.lengths, t)
    return KVCache(keys, values, cache.lengths + t)


def _check_capacity(xp: Any, cache: KVCache, t: int) -> None:
    lengths = cache.lengths
    if not has_concrete_values(lengths):
        return  # traced or lazy: checking would need a host sync or a computation
    longest = int(xp.max(lengths)) if lengths.ndim else int(lengths)
    if longest + t > cache.capacity:
        msg = (
            f"appending {t} token(s) to a KV cache of capacity {cache.capacity} whose longest "
            f"sequence already holds {longest} would overflow it"
        )
        raise ValueError(msg)


def kv_cache_attention(
    query: Any,
    cache: KVCache,
    *,
    scale: float | Any | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Any | None = None,
    is_causal: bool = True,
    **kwargs: Any,
) -> Any:
    """Attention of the newest queries over the valid part of a cache.

    ``query`` holds the last ``T`` tokens of each sequence (those just appended
    with :func:`kv_cache_append`); causal alignment uses the valid lengths,
    ``i' = i + length - T``, so query ``i`` sees the cache up to its own token.

    Parameters
    ----------
    query : array, shape (B..., Hq, T, Dk)
        Queries of the newest tokens.
    cache : KVCache
        The cache, including these tokens.
    is_causal : bool, default True
        Causal masking, bottom-right aligned: the newest tokens see the whole
        cache up to themselves (unlike :func:`scaled_dot_product_attention`, the
        default here is True).
    scale, window, softcap
        As in :func:`scaled_dot_product_attention`.
    **kwargs
        Other arguments of :func:`scaled_dot_product_attention` (``alibi_slopes``,
        ``block_size``, ...).

    Returns
    -------
    array, shape (B..., Hq, T, Dv)
    """
    if "layout" in kwargs:  # it would swap the cache's axes too
        msg = (
            "kv_cache_attention() takes no `layout`: the cache holds (B..., Hkv, capacity, D); "
            "pass `query` as (B..., Hq, T, Dk)"
        )
        raise TypeError(msg)
    return scaled_dot_product_attention(
        query,
        cache.keys,
        cache.values,
        kv_lengths=cache.lengths,
        is_causal=is_causal,
        scale=scale,
        window=window,
        softcap=softcap,
        **kwargs,
    )

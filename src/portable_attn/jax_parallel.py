"""JAX-specific: sequence (context) parallel attention over a device mesh.

Batch and head parallelism need nothing from this module: give
:func:`portable_attn.scaled_dot_product_attention` inputs sharded with
``jax.sharding.NamedSharding`` over the batch or head axis and call it under
``jax.jit``; every operation is independent across batch and heads, so XLA keeps
the sharding and inserts no collective.

For sequences too long for one device, :func:`sequence_parallel_attention`
shards the *keys and values* along ``Lk`` over one mesh axis. Each device
computes attention of all queries over its own slice of keys, with the positions
of the whole sequence, plus the row log-sum-exp; the parts are then combined
with the exact online-softmax merge as two collective reductions (``pmax`` of
the log-sum-exp, ``psum`` of the rescaled outputs and denominators). No device
ever holds another device's keys or values, and no all-gather is issued.

Costs to know: causal block skipping is not applied inside a device's part (the
part's positions are traced values), so a device whose keys all lie after every
query still computes its part, which the merge then weights by zero; and
``jax.grad`` differentiates through the forward blocks, so backward memory per
device is that of its ``(Lq, Lk / devices)`` part rather than O(L). Tested with
JAX 0.10 (``jax.shard_map``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._lib._call import prepare
from ._lib._compat import library_name
from ._lib._merge import merge_partials
from ._lib._validation import check_given
from ._partial import partial_attention

__all__ = ["sequence_parallel_attention"]

Array = Any


def sequence_parallel_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mesh: Any,
    axis_name: str,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | Array | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> Array:
    """Attention with keys/values split along ``Lk`` over the mesh axis `axis_name`.

    Same result as :func:`portable_attn.scaled_dot_product_attention` with the
    same arguments (bottom-right causal alignment, zero rows for queries that
    see no key, float32 accumulation for half precision). Works eagerly and
    under ``jax.jit``; differentiable with ``jax.grad``.

    Parameters
    ----------
    query : jax.Array, shape (B..., Hq, Lq, Dk)
        Replicated over `axis_name` (every device needs every query).
    key, value : jax.Array, shape (B..., Hkv, Lk, Dk) and (B..., Hkv, Lk, Dv)
        Split into equal contiguous slices along ``Lk`` over `axis_name`;
        ``Lk`` must be a multiple of the axis size.
    mesh : jax.sharding.Mesh
        The device mesh.
    axis_name : str
        The mesh axis to split the keys over. Other mesh axes are replicated.
    mask, bias : jax.Array, broadcastable to (B..., Hq, Lq, Lk), optional
        Split along their last axis with the keys when it has length ``Lk``.
    block_size : int or (int, int), optional
        Tile each device's part (online softmax within the part too); default
        one block per device.
    is_causal, scale, window, softcap, q_lengths, kv_lengths, alibi_slopes, score_mod
        As in :func:`portable_attn.scaled_dot_product_attention`; positions are
        those of the whole sequence.

    Returns
    -------
    jax.Array, shape (B..., Hq, Lq, Dv)
        Replicated over `axis_name`, in the promoted dtype of the inputs.

    Raises
    ------
    ValueError
        ``Lk`` not a multiple of the size of `axis_name`, an unknown axis name,
        or any error :func:`portable_attn.scaled_dot_product_attention` raises.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_given(name, x)
        if library_name(x) not in ("jax", "numpy"):  # host NumPy arrays are placed by JAX
            msg = (
                f"sequence_parallel_attention needs JAX (or NumPy) arrays, but `{name}` is a "
                f"{library_name(x)} array; use scaled_dot_product_attention for it"
            )
            raise TypeError(msg)
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def attention_call(a: dict[str, Array]) -> Any:  # on the whole arrays, or one part
        return prepare(
            a["query"],
            a["key"],
            a["value"],
            mask=a.get("mask"),
            bias=a.get("bias"),
            is_causal=is_causal,
            scale=scale,
            window=window,
            softcap=softcap,
            q_lengths=a.get("q_lengths"),
            kv_lengths=a.get("kv_lengths"),
            alibi_slopes=a.get("alibi_slopes"),
            score_mod=score_mod,
        )

    given = {
        "mask": mask,
        "bias": bias,
        "q_lengths": q_lengths,
        "kv_lengths": kv_lengths,
        "alibi_slopes": alibi_slopes,
    }
    arrays = {"query": query, "key": key, "value": value}
    arrays |= {name: x for name, x in given.items() if x is not None}
    plan = attention_call(arrays).plan  # every check, on the whole arrays
    if axis_name not in mesh.shape:
        msg = f"`axis_name` {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}"
        raise ValueError(msg)
    parts = mesh.shape[axis_name]
    if plan.kv_len % parts:
        msg = (
            f"`key` axis -2 (Lk={plan.kv_len}) must be a multiple of the mesh axis "
            f"{axis_name!r} of size {parts}: key shape {tuple(key.shape)}"
        )
        raise ValueError(msg)
    part_len = plan.kv_len // parts

    def split_keys(x: Array) -> Any:  # the key axis of K/V, and of a mask/bias that has it
        return P(*([None] * (x.ndim - 2)), axis_name, None)

    def split_last(x: Array) -> Any:
        if x.ndim >= 1 and x.shape[-1] == plan.kv_len and plan.kv_len > 1:
            return P(*([None] * (x.ndim - 1)), axis_name)
        return P()

    specs = {"query": P(), "key": split_keys(key), "value": split_keys(value)}
    for name in given:
        if name in arrays:
            specs[name] = split_last(arrays[name]) if name in ("mask", "bias") else P()

    def local(a: dict[str, Array]) -> Array:
        start = lax.axis_index(axis_name) * part_len
        out, lse = partial_attention(
            attention_call(a), kv_start=start, kv_total=plan.kv_len, block_size=block_size
        )
        merged, _ = merge_partials(
            jnp,
            out,
            lse,
            # the shift cancels exactly, so it needs no gradient (pmax has none)
            max_over=lambda x: lax.pmax(lax.stop_gradient(x), axis_name),
            sum_over=lambda x: lax.psum(x, axis_name),
        )
        return merged

    # Lay every input out as its spec says (inside jit: a sharding constraint; a K/V
    # already split along Lk over `axis_name` moves nothing).
    arrays = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in arrays.items()}
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX: only the experimental location (untested here)
        from jax.experimental.shard_map import shard_map
    run = shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P())
    out = run(arrays).astype(plan.result_dtype)
    return out[0] if query.ndim == key.ndim == value.ndim == 2 else out

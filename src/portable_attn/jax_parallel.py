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
from ._lib._compat import as_jax, device, jax_placeable, library_name
from ._lib._fields import field
from ._lib._merge import merge_partials
from ._lib._route import route
from ._lib._validation import check_given
from ._paths._partial import partial_attention

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
    sinks: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> Array:
    """Attention with keys/values split along ``Lk`` over the mesh axis `axis_name`.

    Same result as :func:`portable_attn.scaled_dot_product_attention` with the
    same arguments (bottom-right causal alignment, zero rows for queries that
    see no key, float32 accumulation for half precision). Works eagerly and
    under ``jax.jit``; differentiable with ``jax.grad`` (eagerly too).

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
        as the library picks for one device's part.
    is_causal, scale, window, softcap, q_lengths, kv_lengths, alibi_slopes, score_mod
        As in :func:`portable_attn.scaled_dot_product_attention`; positions are
        those of the whole sequence.
    sinks, q_segment_ids, kv_segment_ids
        As in :func:`portable_attn.scaled_dot_product_attention`: the sink logit
        joins the softmax once (on the first device's part); the key ids are
        split with the keys.

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
    given = {"query": query, "key": key, "value": value}
    for name, x in given.items():
        check_given(name, x)
        if not jax_placeable(x):  # host NumPy arrays are placed by JAX
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

    on_jax = as_jax  # host NumPy arrays become JAX arrays

    call = prepare(  # every check, on the whole arrays
        *(on_jax(x) for x in (query, key, value)),
        mask=on_jax(mask),
        bias=on_jax(bias),
        is_causal=is_causal,
        scale=scale,
        window=window,
        softcap=softcap,
        q_lengths=on_jax(q_lengths),
        kv_lengths=on_jax(kv_lengths),
        alibi_slopes=on_jax(alibi_slopes),
        score_mod=score_mod,
        sinks=on_jax(sinks),
        q_segment_ids=on_jax(q_segment_ids),
        kv_segment_ids=on_jax(kv_segment_ids),
    )
    plan = call.plan
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
    arrays, skeleton = call.flatten()

    def spec(name: str, x: Array) -> Any:
        """Split a field along its key axis over `axis_name` where it has all Lk keys."""
        axes = field(name).axes
        if "lk" not in axes or plan.kv_len <= 1:
            return P()
        dim = x.ndim - len(axes) + axes.index("lk")
        if dim < 0 or x.shape[dim] != plan.kv_len:
            return P()  # broadcast along the keys
        return P(*([None] * dim), axis_name, *([None] * (x.ndim - dim - 1)))

    specs = {name: spec(name, x) for name, x in arrays.items()}

    def local(a: dict[str, Array]) -> Array:
        index = lax.axis_index(axis_name)
        for name, x in a.items():  # a sink logit counts once per row: in the first part
            neutral = field(name).once_per_row
            if neutral is not None:
                a = {**a, name: jnp.where(index == 0, x, neutral)}
        part = skeleton.unflatten(a, kv_len=part_len, device=device(a["query"]))
        path = route(part, block_size, "portable").path  # the router, for one part
        out, lse = partial_attention(part, path, kv_start=index * part_len, kv_total=plan.kv_len)
        merged, _ = merge_partials(
            jnp,
            out,
            lse,
            # the shift cancels exactly, so it needs no gradient (pmax has none)
            max_over=lambda x: lax.pmax(lax.stop_gradient(x), axis_name),
            sum_over=lambda x: lax.psum(x, axis_name),
        )
        return merged

    mesh = _auto_mesh(jax, mesh)
    shard_map: Any = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX: only the experimental location (untested here)
        from jax.experimental import shard_map as experimental

        shard_map = experimental.shard_map
    run = shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P())
    # Lay every input out as its spec says (inside jit: a sharding constraint; a K/V
    # already split along Lk over `axis_name` moves nothing).
    arrays = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in arrays.items()}
    return call.finish(run(arrays))


def _auto_mesh(jax: Any, mesh: Any) -> Any:
    """`mesh` with its axes of the automatic type, the same devices and names.

    ``jax.make_mesh`` makes explicit axes (JAX 0.10): the output would then carry the
    mesh in its type, and an eager ``jax.grad`` of a loss of it asks for a mesh
    context that it cannot enter. The collectives here name their axis themselves,
    so the automatic type loses nothing.
    """
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    auto = (axis_type.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)

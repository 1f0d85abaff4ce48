"""Public attention entry points: docstrings, namespace resolution, checks, dispatch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

from ._autodiff import tiled_attention
from ._lib import _validation as v
from ._lib._compat import array_namespace, chunk_sizes, device, library_name
from ._lib._dense import dense_attention, dense_weights
from ._lib._masks import arange
from ._lib._scores import AttentionPlan, ScoreTerms
from ._lib._tiled import EAGER_TILES, Blocks, default_tiles
from ._native import native_attention, native_unsupported_reason, prefer_native

__all__ = ["attention_weights", "scaled_dot_product_attention"]

Array = Any

#: ``block_size="auto"`` keeps the dense path while its logits would take at most
#: this many bytes (batch x Hq x Lq x Lk x 4, or x 8 for float64), and tiles above.
AUTO_DENSE_LIMIT_BYTES = 64 * 2**20
#: The same limit for torch, whose eager dense path measured 1.7-2.6x (non-causal) and
#: 2.8-6.1x (causal) slower than its tiled path at L = 512-8192 (B=1, H=8, D=64:
#: benchmarks/results/bench-torch.json),
#: while at L = 128 (0.5 MiB of logits) dense is the faster of the two.
AUTO_DENSE_LIMIT_BYTES_TORCH = 4 * 2**20


_PLAN_CACHE: dict[Any, AttentionPlan] = {}
_PLAN_CACHE_SIZE = 256


def _meta(x: Array | None) -> Any:
    return None if x is None else (tuple(x.shape), x.dtype)


def _plan(
    xp: Any,
    query: Array,
    key: Array,
    value: Array | None,
    mask: Array | None,
    bias: Array | None,
    **options: Any,
) -> AttentionPlan:
    """Validate and plan a call; calls with the same static facts reuse the plan.

    Everything a plan depends on (shapes, dtypes, device and the scalar options)
    is in the cache key, so a hit returns exactly what validation would build;
    a call that fails validation is never cached.
    """
    try:
        cache_key = (
            id(xp),
            _meta(query),
            _meta(key),
            _meta(value),
            _meta(mask),
            _meta(bias),
            device(query),
            tuple(sorted((n, repr(o)) for n, o in options.items())),
        )
        hash(cache_key)
    except TypeError:  # an unhashable device (CuPy) or option: plan without the cache
        return _build_plan(xp, query, key, value, mask, bias, **options)
    plan = _PLAN_CACHE.get(cache_key)
    if plan is None:
        plan = _build_plan(xp, query, key, value, mask, bias, **options)
        if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[cache_key] = plan
    return plan


def _build_plan(
    xp: Any,
    query: Array,
    key: Array,
    value: Array | None,
    mask: Array | None,
    bias: Array | None,
    *,
    is_causal: bool,
    scale: float | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
) -> AttentionPlan:
    """Validate every argument and decide the static facts of the call."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None:
            v.check_floating(xp, name, x)
    q_shape, k_shape, v_shape = v.check_attention_arrays(query, key, value)
    batch = v.broadcast_batch_shapes(
        [("query", q_shape[:-3]), ("key", k_shape[:-3])]
        + ([("value", v_shape[:-3])] if value is not None else [])
    )
    hq, lq, dk = q_shape[-3:]
    hkv, lk = k_shape[-3], k_shape[-2]
    logits_shape = (
        *v.broadcast_batch_shapes([("query", q_shape[:-3]), ("key", k_shape[:-3])]),
        hq,
        lq,
        lk,
    )
    if mask is not None:
        v.check_mask_dtype(xp, "mask", mask)
        v.check_broadcastable_to("mask", mask, logits_shape, "logits (..., Hq, Lq, Lk)")
    if bias is not None:
        v.check_floating(xp, "bias", bias)
        v.check_broadcastable_to("bias", bias, logits_shape, "logits (..., Hq, Lq, Lk)")
    if not isinstance(is_causal, bool):
        msg = f"`is_causal` must be True or False, but got {is_causal!r}"
        raise TypeError(msg)
    scale = 1.0 / math.sqrt(dk) if scale is None else v.check_positive_scalar("scale", scale)
    if softcap is not None:
        softcap = v.check_positive_scalar("softcap", softcap)
    if window is not None:
        window = v.check_window(window)
    dtypes = [query.dtype, key.dtype] + ([value.dtype] if value is not None else [])
    result_dtype = xp.result_type(*dtypes)
    # float16/bfloat16 accumulate in float32; float32 and float64 stay as they are.
    compute_dtype = xp.result_type(result_dtype, xp.float32)
    return AttentionPlan(
        batch=batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        q_len=lq,
        kv_len=lk,
        value_dim=v_shape[-1],
        scale=scale,
        softcap=softcap,
        is_causal=is_causal,
        window=window,
        compute_dtype=compute_dtype,
        result_dtype=result_dtype,
        device=device(query),
        key_dim=dk,
    )


def signed_lengths(xp: Any, x: Array) -> Array:
    """Lengths as a signed integer array, so ``kv_len - q_len`` can go below zero."""
    if not xp.isdtype(x.dtype, "unsigned integer"):
        return x
    return xp.astype(x, xp.int32 if library_name(x) == "jax" else xp.int64)


def _terms(
    xp: Any,
    plan: AttentionPlan,
    mask: Array | None,
    extras: dict[str, Any],
) -> tuple[AttentionPlan, ScoreTerms]:
    """Validate the model-building arguments and gather them as score terms."""
    if (
        type(extras["dropout_p"]) in (float, int)
        and extras["dropout_p"] == 0
        and all(x is None for n, x in extras.items() if n != "dropout_p")
    ):  # the common call: none of them given
        return plan, ScoreTerms(
            mask=None if mask is None else _at_least_2d(xp, mask), offset=plan.offset
        )
    q_lengths, kv_lengths = extras["q_lengths"], extras["kv_lengths"]
    slopes, score_mod = extras["alibi_slopes"], extras["score_mod"]
    dropout_p, keep = extras["dropout_p"], extras["dropout_mask"]
    logits_shape = (*plan.batch, plan.num_q_heads, plan.q_len, plan.kv_len)
    lengths = {}
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if x is None:
            continue
        if not xp.isdtype(x.dtype, "integral"):
            msg = f"`{name}` must be an integer array of valid lengths, but got dtype {x.dtype}"
            raise TypeError(msg)
        v.check_broadcastable_to(name, x, plan.batch, "batch")
        x = signed_lengths(xp, x)
        lengths[name] = xp.reshape(x, (*x.shape, 1, 1, 1))  # (*batch, 1, 1, 1)
    offset: Any = plan.offset
    if lengths:
        q_len = lengths.get("q_lengths", plan.q_len)
        kv_len = lengths.get("kv_lengths", plan.kv_len)
        offset = kv_len - q_len  # i' = i + kv_len[b] - q_len[b]
        plan = dataclasses.replace(plan, has_lengths=True)
    if slopes is not None:
        v.check_floating(xp, "alibi_slopes", slopes)
        v.check_broadcastable_to(
            "alibi_slopes", slopes, (*plan.batch, plan.num_q_heads), "(..., Hq) heads"
        )
        if slopes.ndim == 0 or slopes.shape[-1] not in (1, plan.num_q_heads):
            msg = (
                f"`alibi_slopes` must end with the head axis Hq={plan.num_q_heads} (or 1), "
                f"but has shape {tuple(slopes.shape)}"
            )
            raise ValueError(msg)
        slopes = xp.reshape(xp.astype(slopes, plan.compute_dtype), (*slopes.shape, 1, 1))
    if score_mod is not None and not callable(score_mod):
        msg = f"`score_mod` must be callable, but got {type(score_mod).__name__}"
        raise TypeError(msg)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        msg = f"`dropout_p` must be a float in [0, 1), but got {dropout_p!r}"
        raise TypeError(msg)
    if not 0.0 <= dropout_p < 1.0:
        msg = f"`dropout_p` must be in [0, 1), but got {dropout_p!r}"
        raise ValueError(msg)
    if (dropout_p > 0) != (keep is not None):
        msg = (
            "`dropout_p` > 0 needs a `dropout_mask` (a boolean keep-mask from your own "
            "random generator) and a `dropout_mask` needs `dropout_p` > 0; got "
            f"dropout_p={dropout_p!r} and dropout_mask={'None' if keep is None else 'an array'}"
        )
        raise ValueError(msg)
    if keep is not None:
        v.check_mask_dtype(xp, "dropout_mask", keep)
        v.check_broadcastable_to("dropout_mask", keep, logits_shape, "weights (..., Hq, Lq, Lk)")
        keep = _at_least_2d(xp, keep)
    batch_index = None
    if score_mod is not None:
        n = math.prod(plan.batch)
        batch_index = xp.reshape(arange(xp, 0, n, plan.device), (*plan.batch, 1, 1, 1))
    terms = ScoreTerms(
        mask=None if mask is None else _at_least_2d(xp, mask),
        q_lengths=lengths.get("q_lengths"),
        kv_lengths=lengths.get("kv_lengths"),
        offset=offset,
        alibi_slopes=slopes,
        score_mod=score_mod,
        batch_index=batch_index,
        dropout_keep=keep,
        dropout_scale=1.0 / (1.0 - dropout_p),
    )
    return plan, terms


def _setup(
    query: Array,
    key: Array,
    value: Array | None,
    mask: Array | None,
    bias: Array | None,
    options: dict[str, Any],
    extras: dict[str, Any],
) -> tuple[Any, AttentionPlan, ScoreTerms]:
    """Resolve the namespace, validate everything and gather the score terms of a call."""
    xp = array_namespace(
        query=query,
        key=key,
        value=value,
        mask=mask,
        bias=bias,
        q_lengths=extras["q_lengths"],
        kv_lengths=extras["kv_lengths"],
        alibi_slopes=extras["alibi_slopes"],
        dropout_mask=extras["dropout_mask"],
    )
    plan = _plan(xp, query, key, value, mask, bias, **options)
    plan, terms = _terms(xp, plan, mask, extras)
    return xp, plan, terms


def _prepare(xp: Any, x: Array | None, dtype: Any) -> Array | None:
    """Give a 2-D input its head axis and cast it to the compute dtype (no copy if equal)."""
    if x is None:
        return None
    if x.ndim == 2:
        x = xp.expand_dims(x, axis=0)  # (1, L, D)
    return x if x.dtype == dtype else xp.astype(x, dtype)


def _at_least_2d(xp: Any, x: Array) -> Array:
    """Give a mask or bias of shape (Lk,) a query axis, so blocks can slice it."""
    return xp.expand_dims(x, axis=0) if x.ndim < 2 else x


def _chunk_pair_bytes(xp: Any, query: Array, plan: AttentionPlan, bq: int, bk: int) -> int:
    """Bytes of the scores of one (query chunk, key chunk) pair of a Dask call."""
    lead = [chunk_sizes(query, axis) or (query.shape[axis],) for axis in range(query.ndim - 2)]
    itemsize = 8 if plan.compute_dtype == xp.float64 else 4
    return math.prod(max(sizes) for sizes in lead) * bq * bk * itemsize


def _subdivide(sizes: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Split each chunk into blocks of at most `size`, keeping the chunk boundaries."""
    return tuple(min(size, n - start) for n in sizes for start in range(0, n, size))


def _tiles(
    xp: Any, query: Array, key: Array, plan: AttentionPlan, block_size: Any
) -> tuple[Blocks, Blocks] | None:
    """(block_q, block_k) of the tiled path, or None for the dense path."""
    if block_size is None or block_size == "auto":
        # Dask split along Lq or Lk: one block per chunk pair, merged by the online
        # softmax, so no task holds more than one (q chunk, k chunk) block of scores.
        q_chunks, k_chunks = chunk_sizes(query, -2), chunk_sizes(key, -2)
        if q_chunks is not None or k_chunks is not None:
            q_sizes, k_sizes = q_chunks or (plan.q_len,), k_chunks or (plan.kv_len,)
            if (
                block_size == "auto"
                and _chunk_pair_bytes(xp, query, plan, max(q_sizes), max(k_sizes))
                > AUTO_DENSE_LIMIT_BYTES
            ):  # chunks too large for one block: tile within them
                q_sizes = _subdivide(q_sizes, EAGER_TILES[0])
                k_sizes = _subdivide(k_sizes, EAGER_TILES[1])
            return q_sizes, k_sizes
    if block_size is None:
        return None
    if block_size == "auto":
        itemsize = 8 if plan.compute_dtype == xp.float64 else 4
        rows = math.prod(plan.batch) * plan.num_q_heads * plan.q_len
        lib = library_name(query)
        limit = AUTO_DENSE_LIMIT_BYTES_TORCH if lib == "torch" else AUTO_DENSE_LIMIT_BYTES
        if rows * plan.kv_len * itemsize <= limit:
            return None
        return default_tiles(lib == "jax", plan.q_len, plan.kv_len)
    sizes = block_size if isinstance(block_size, tuple) and len(block_size) == 2 else None
    sizes = sizes or (block_size, block_size)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        msg = (
            "`block_size` must be None, a positive integer, a pair (block_q, block_k) of "
            f"positive integers or 'auto', but got {block_size!r}"
        )
        raise ValueError(msg)
    return sizes[0], sizes[1]


def _route(
    implementation: Any,
    lib: str,
    plan: AttentionPlan,
    terms: ScoreTerms,
    bias: Array | None,
    tiles: Any,
    block_size: Any,
) -> bool:
    """Whether this call goes to the framework's native kernel (see ``_native``)."""
    if implementation == "portable":
        return False
    if implementation == "native":
        # "auto" leaves the path to the library, and the native kernel is one: only an
        # explicit block size asks for the portable tiled path
        explicit = tiles if block_size != "auto" else None
        reason = native_unsupported_reason(lib, plan, terms, explicit)
        if reason is not None:
            msg = f"implementation='native': {reason}; use implementation=None or 'portable'"
            raise ValueError(msg)
        return True
    if implementation is not None:
        msg = f"`implementation` must be None, 'portable' or 'native', but got {implementation!r}"
        raise ValueError(msg)
    if block_size not in (None, "auto") or plan.kv_len == 0 or plan.q_len == 0:
        return False
    return native_unsupported_reason(lib, plan, terms, None) is None and prefer_native(
        lib, plan, terms, bias
    )


def _finish(xp: Any, out: Array, plan: AttentionPlan, *, drop_head: bool) -> Array:
    if out.dtype != plan.result_dtype:
        out = xp.astype(out, plan.result_dtype)
    return out[0, ...] if drop_head else out


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_size: int | tuple[int, int] | Literal["auto"] | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Array | None = None,
    implementation: Literal["portable", "native"] | None = None,
) -> Array:
    r"""Scaled dot-product attention, ``softmax(Q Kᵀ · scale) V``, on any array-API library.

    Dimensions: ``B...`` batch (any number, broadcast), ``Hq`` query heads,
    ``Hkv`` key/value heads, ``G = Hq // Hkv``, ``Lq`` queries, ``Lk`` keys,
    ``Dk`` query/key features, ``Dv`` value features.

    The computation, in this order:

    1. ``logits = (query · scale) @ keyᵀ``, with ``scale = 1 / sqrt(Dk)`` by default;
    2. ``logits = softcap · tanh(logits / softcap)`` if `softcap` is given;
    3. ``logits = score_mod(logits, ...)``, then ``+ bias`` and the ALiBi term;
    4. positions not allowed by ``mask AND causal AND window`` are removed;
    5. softmax over keys in at least float32 (the row maximum is subtracted);
    6. rows with no visible key become exactly zero (never NaN);
    7. ``output = weights @ value``, cast to the result dtype.

    Parameters
    ----------
    query : array, shape (B..., Hq, Lq, Dk) or (Lq, Dk)
        Queries. A 2-D input is one head.
    key : array, shape (B..., Hkv, Lk, Dk) or (Lk, Dk)
        Keys. ``Hq`` must be a multiple of ``Hkv``: query head ``h`` uses key/value
        head ``h // (Hq // Hkv)`` (grouped-query attention; K/V are not repeated).
    value : array, shape (B..., Hkv, Lk, Dv) or (Lk, Dv)
        Values.
    mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        True where a query may attend to a key.
    bias : floating array, broadcastable to (B..., Hq, Lq, Lk), optional
        Added to the logits after `softcap`; ``-inf`` entries mask a position.
        Computed in the compute dtype (see Notes).
    is_causal : bool, default False
        Bottom-right aligned causal mask: query ``i`` may see key ``j`` iff
        ``j <= i + (Lk - Lq)``. (PyTorch's and JAX's ``is_causal`` are top-left
        aligned; use :func:`causal_mask` with ``align="top-left"`` for that.)
    scale : float, optional
        Factor applied to the queries before the product; default ``1 / sqrt(Dk)``.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: query ``i`` may see key ``j`` iff
        ``i' - left <= j <= i' + right`` with ``i' = i + (Lk - Lq)``. None on a
        side means unbounded. Combines with `is_causal` and `mask` by AND.
    softcap : float, optional
        Soft-capping of the logits, ``softcap · tanh(logits / softcap)``.
    block_size : int, (int, int) or "auto", optional
        None (default): the dense path, which builds the (Lq, Lk) scores once
        (unless `implementation` routes the call to a native kernel).
        An int (or a pair ``(block_q, block_k)``): the tiled path, exact online
        softmax over query and key blocks of this size; memory O(Lq + Lk) per
        head instead of O(Lq · Lk), and key blocks that causal/window structure
        hides entirely are not computed.
        Its backward (torch autograd, ``jax.grad``) recomputes blocks instead of
        storing them, so training memory stays O(L) as well.
        ``"auto"``: dense while the dense logits would fit in
        ``AUTO_DENSE_LIMIT_BYTES`` (64 MiB; 4 MiB for torch, whose eager dense
        path is the slower one above that), tiled above with 128 queries x 256
        keys per block (for JAX, blocks of at least 256 and at most 16 per axis,
        since each block is a node of the traced program).
        Dask arrays chunked along ``Lq`` or ``Lk`` take the tiled path with
        None or "auto" too, one block per (query chunk, key chunk) pair: key
        chunks are merged by the online softmax and no task holds more than one
        chunk pair of scores. "auto" also splits a chunk pair whose scores would
        pass ``AUTO_DENSE_LIMIT_BYTES`` into blocks of 128 x 256 within it.
    q_lengths, kv_lengths : integer array, broadcastable to the batch dims, optional
        Valid prefix length of each sequence, e.g. shape (B,). Keys at or past
        ``kv_lengths`` are masked, query rows at or past ``q_lengths`` are zero.
        Causal, window and ALiBi alignment then use the valid lengths:
        ``i' = i + kv_len[b] - q_len[b]`` (a fixed-capacity KV cache needs this).
        Either may be given alone. Built by index arithmetic, never a host sync.
    alibi_slopes : floating array, shape (Hq,) or (B, Hq), optional
        ALiBi: adds ``-slope · |i' - j|`` to the logits, with the causal alignment
        ``i'``. :func:`get_alibi_slopes` gives the standard slopes.
    score_mod : callable, optional
        ``score_mod(scores, batch, head, q_idx, kv_idx) -> scores``, applied after
        `scale` and `softcap`, before `bias`/ALiBi and the masks, on each block of
        scores (..., Hq, bq, bk). The index arrays broadcast against it: `batch`
        (B..., 1, 1, 1) flat batch index, `head` (Hq, 1, 1), `q_idx` (bq, 1) and
        `kv_idx` (1, bk) absolute positions. Write it with array-API operations.
    dropout_p : float, default 0.0
        Dropout probability on the attention weights; needs `dropout_mask`.
    dropout_mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        Keep-mask drawn by the caller's own random generator (True = keep); kept
        weights are scaled by ``1 / (1 - dropout_p)``. The array API has no random
        generator, so the library never draws one itself.
    implementation : {None, "portable", "native"}, default None
        ``"portable"``: always the array-API implementation. ``"native"``: the
        framework's fused kernel (torch SDPA, ``jax.nn.dot_product_attention``)
        with our masks, alignment and empty-row handling; a call it cannot
        express (softcap, score_mod, ALiBi, dropout, an int or pair block_size,
        JAX with Dv != Dk, other libraries) raises ValueError; "auto" is
        allowed. None: the native kernel only where it is expressible, honours
        the contract and is measured faster (torch without mask, bias,
        lengths or window, causal only with Lq == Lk, block_size None or "auto");
        the portable path otherwise.

    Returns
    -------
    array, shape (B..., Hq, Lq, Dv), or (Lq, Dv) when all inputs are 2-D
        In the namespace, on the device and with the promoted floating dtype of
        `query`, `key` and `value`.

    Raises
    ------
    TypeError
        Arrays from different libraries; non-floating `query`, `key`, `value`
        or `bias`; non-boolean `mask`; arguments of the wrong type.
    ValueError
        Shapes that do not agree (each message names the argument, the axis and
        both shapes), a non-positive or non-finite `scale` or `softcap`, a
        negative `window` entry, a `block_size` that is not a positive integer
        or "auto".

    Notes
    -----
    float16 and bfloat16 inputs are computed in float32 (logits, softmax and the
    weighted sum) and the result is cast back; float64 stays float64. A query
    row with no visible key returns zeros and has zero gradients. NaN or inf in
    the inputs propagate. Inputs are never modified, no value-dependent Python
    branching is done, so the function works under ``jax.jit``, ``jax.vmap``,
    ``jax.grad``, torch autograd and ``torch.compile``.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 5, 16))     # (B, Hq, Lq, Dk)
    >>> k = rng.standard_normal((2, 2, 7, 16))     # (B, Hkv, Lk, Dk): 4 query heads per group
    >>> v = rng.standard_normal((2, 2, 7, 32))     # (B, Hkv, Lk, Dv)
    >>> scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 8, 5, 32)
    """
    xp, plan, terms = _setup(
        query,
        key,
        value,
        mask,
        bias,
        {"is_causal": is_causal, "scale": scale, "window": window, "softcap": softcap},
        {
            "q_lengths": q_lengths,
            "kv_lengths": kv_lengths,
            "alibi_slopes": alibi_slopes,
            "score_mod": score_mod,
            "dropout_p": dropout_p,
            "dropout_mask": dropout_mask,
        },
    )
    tiles = _tiles(xp, query, key, plan, block_size)
    route = _route(implementation, library_name(query), plan, terms, bias, tiles, block_size)
    if route:
        tiles = None
    drop_head = query.ndim == key.ndim == value.ndim == 2
    dt = plan.compute_dtype
    q, k, val = (_prepare(xp, x, dt) for x in (query, key, value))
    b = None if bias is None else _at_least_2d(xp, xp.astype(bias, dt, copy=False))
    if plan.kv_len == 0 or plan.q_len == 0:
        shape = (*plan.batch, plan.num_q_heads, plan.q_len, plan.value_dim)
        out = xp.zeros(shape, dtype=dt, device=plan.device)
    elif route:
        out = native_attention(xp, q, k, val, b, terms, plan)
    elif tiles is None:
        out = dense_attention(xp, q, k, val, b, terms, plan)
    else:
        out = tiled_attention(xp, q, k, val, b, terms, plan, *tiles)
    return _finish(xp, out, plan, drop_head=drop_head)


def attention_weights(
    query: Array,
    key: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Array | None = None,
) -> Array:
    """Attention weights ``softmax(Q Kᵀ · scale)`` of :func:`scaled_dot_product_attention`.

    Same arguments, order of operations and conventions as
    :func:`scaled_dot_product_attention`, without `value`.

    Parameters
    ----------
    query : array, shape (B..., Hq, Lq, Dk) or (Lq, Dk)
        Queries.
    key : array, shape (B..., Hkv, Lk, Dk) or (Lk, Dk)
        Keys; ``Hq`` must be a multiple of ``Hkv``.
    mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        True where a query may attend to a key.
    bias : floating array, broadcastable to (B..., Hq, Lq, Lk), optional
        Additive bias after `softcap`; ``-inf`` masks.
    is_causal : bool, default False
        Bottom-right aligned causal mask (``j <= i + Lk - Lq``).
    scale : float, optional
        Default ``1 / sqrt(Dk)``.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)`` around ``i' = i + Lk - Lq``.
    softcap : float, optional
        ``softcap · tanh(logits / softcap)``.
    q_lengths, kv_lengths, alibi_slopes, score_mod, dropout_p, dropout_mask
        As in :func:`scaled_dot_product_attention`; the dropout mask is applied
        to the returned weights.

    Returns
    -------
    array, shape (B..., Hq, Lq, Lk), or (Lq, Lk) when both inputs are 2-D
        Each row sums to 1 over its visible keys, or is all zeros when no key
        is visible. Dtype: the promoted dtype of `query` and `key`.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import attention_weights
    >>> q = k = np.eye(3)
    >>> attention_weights(q, k, is_causal=True, scale=100.0).round(3)
    array([[1., 0., 0.],
           [0., 1., 0.],
           [0., 0., 1.]])
    """
    xp, plan, terms = _setup(
        query,
        key,
        None,
        mask,
        bias,
        {"is_causal": is_causal, "scale": scale, "window": window, "softcap": softcap},
        {
            "q_lengths": q_lengths,
            "kv_lengths": kv_lengths,
            "alibi_slopes": alibi_slopes,
            "score_mod": score_mod,
            "dropout_p": dropout_p,
            "dropout_mask": dropout_mask,
        },
    )
    drop_head = query.ndim == key.ndim == 2
    dt = plan.compute_dtype
    q, k = _prepare(xp, query, dt), _prepare(xp, key, dt)
    b = None if bias is None else _at_least_2d(xp, xp.astype(bias, dt, copy=False))
    if plan.kv_len == 0:
        w = xp.zeros((*plan.batch, plan.num_q_heads, plan.q_len, 0), dtype=dt, device=plan.device)
    else:
        w = dense_weights(xp, q, k, b, terms, plan)
    return _finish(xp, w, plan, drop_head=drop_head)

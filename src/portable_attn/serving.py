"""Serving: ragged batches over a paged KV cache, and packed variable-length sequences.

A serving engine keeps the keys and values of every request in one *pool* of pages of
``page_size`` tokens; a *page table* maps request ``r``'s logical page ``j`` to a
physical page. One call serves a ragged batch: the new tokens of all requests packed
along one axis (``q_starts`` marks where each request's rows begin), some requests
prefilling a chunk, others decoding one token.

- :func:`paged_kv_write` writes the new tokens' keys and values into their pages;
- :func:`ragged_paged_attention` is the attention of the new tokens over their
  requests' pages: decode rows walk them chunk by chunk, a prefill chunk is one engine
  call over its request's gathered keys;
- :func:`plan_ragged` plans a step once for every layer's call (:class:`PagedPlan`);
- :func:`varlen_attention` is the same on contiguous packed keys (training on packed
  data: ``flash_attn_varlen_func``'s job), on the library's tiled engine.

Layouts are token-major, as in vLLM and flash-attn: ``(tokens, heads, features)`` and
``(pages, page_size, heads, features)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._attention import scaled_dot_product_attention
from ._lib import _paged
from ._lib._call import compute_dtype_of, scalar_option
from ._lib._compat import (
    array_namespace,
    device,
    has_concrete_values,
    is_array_api_obj,
    on_device,
    reads_host_values,
    result_type,
    split_rows,
    to_host,
)
from ._lib._masks import Band, arange, take_at
from ._lib._quant import Quantized, quantized, taken
from ._lib._route import library, runs_compiled
from ._lib._rules import MaskRule
from ._lib._scores import distance
from ._lib._validation import (
    check_count,
    check_exact_rank,
    check_groups,
    check_head_groups,
    check_head_vector,
    check_integer_array,
    check_is_flag,
    check_mask_mod,
    check_one_device,
    check_paged,
    check_paged_metadata,
    check_positions,
    check_same_axis,
    check_score_mod,
    check_starts,
    check_window,
    guarded_rule,
)
from ._paths._paged import (
    index_attention,
    paged_attention,
    plan_walk,
    problem,
    traced_faults,
)
from .merge import merge_attention

__all__ = [
    "PagedPlan",
    "paged_kv_write",
    "plan_ragged",
    "cascade_attention",
    "ragged_paged_attention",
    "topk_indices",
    "varlen_attention",
]

Array = Any


def ragged_paged_attention(
    query: Array,
    key_pages: Array,
    value_pages: Array | None,
    page_table: Array,
    kv_lengths: Array,
    q_starts: Array,
    *,
    q_positions: Array | None = None,
    is_causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    scale: float | Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
    batch_invariant: bool = False,
    plan: PagedPlan | None = None,
    value_dim: int | None = None,
    kv_indices: Array | None = None,
    window_union: bool = False,
    key_scales: Array | None = None,
    value_scales: Array | None = None,
    key_zero_points: Array | None = None,
    value_zero_points: Array | None = None,
    kv_bits: int = 8,
) -> Array | tuple[Array, ...]:
    """Attention of a ragged batch of new tokens over their requests' pages in a pool.

    Dimensions: ``T`` packed query rows, ``R`` requests, ``P`` pages of ``page_size``
    slots, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq`` a multiple of it),
    ``Dk``/``Dv`` features, ``max_pages`` pages per request at most.

    Parameters
    ----------
    query : array, shape (T, Hq, Dk)
        The new tokens of every request, packed: request ``r`` owns rows
        ``q_starts[r] : q_starts[r+1]``; rows at or past ``q_starts[R]`` are padding
        and come out as zeros (lse ``-inf``).
    key_pages : array, shape (P, page_size, Hkv, Dk)
        The pool of keys (vLLM's and flash-attn's token-major layout).
    value_pages : array, shape (P, page_size, Hkv, Dv), or None
        The pool of values. None: the values are the first `value_dim` features of
        the keys (one pool for both, as MLA's latent cache keeps them), gathered once.
    page_table : integer array, shape (R, max_pages)
        Request ``r``'s logical page ``j`` is physical page ``page_table[r, j]``;
        entries past a request's length are not read (any value).
    kv_lengths : integer array, shape (R,)
        The valid keys of each request, its new tokens included (write them first
        with :func:`paged_kv_write`).
    q_starts : integer array, shape (R + 1,)
        ``q_starts[0] == 0``, nondecreasing, ``q_starts[R] <= T``.
    q_positions : integer array, shape (T,), optional
        Each row's position among its request's keys, ``0 <= q_positions[t] <
        kv_lengths[r]`` (padding rows: any value), where the bottom-right rule below does
        not hold: a prompt written to the pool in full and computed in chunks, rows
        placed among keys written after them. The band, ALiBi and the rules see these
        positions. Given, every request is walked (none goes to the engine). With
        `batch_invariant`, a request's rows take a tile's slots in order from its first
        row's position, so rows whose positions follow each other (a chunk) get the bits
        they get without `q_positions`.
    is_causal : bool, default True
        Row ``i`` of request ``r`` (``n_r`` rows) sits at position
        ``kv_lengths[r] - n_r + i`` (or at ``q_positions[q_starts[r] + i]``) and sees
        the keys up to it (bottom-right, as ``scaled_dot_product_attention``'s
        `is_causal`).
    window : (int or None, int or None), optional
        ``(left, right)``: the keys ``position - left .. position + right``.
    softcap, scale, sinks, alibi_slopes
        As in :func:`~portable_attn.scaled_dot_product_attention`; `sinks` and
        `alibi_slopes` have shape (Hq,), ALiBi distances use the positions above.
    mask_mod : callable, optional
        ``mask_mod(request, head, q_pos, kv_pos) -> bool array``: True where a row may
        see a key of its request, AND-ed with `is_causal` and `window`. `request` is
        the request's index, `head` the query head's, `q_pos` and `kv_pos` positions
        among the request's keys (a row's as above), integer index arrays that
        broadcast together. A speculative-decoding tree: ``lambda r, h, q, k: (k <
        first[r]) | ancestor[r, q - first[r], k - first[r]]`` (clipped indices) with
        ``is_causal=False``; an image's tokens seen both ways: ``(k <= q) | ((k >=
        lo[r]) & (q < hi[r]))``. A ready rule of ``portable_attn.block_mask``
        (``chunked_mask_mod(8192)``, Llama 4's chunked layers) sees these positions as
        its aligned ones.
    score_mod : callable, optional
        ``score_mod(scores, request, head, q_pos, kv_pos) -> scores``, the same indices,
        after `softcap` and before ALiBi; arrays it closes over get gradients.
    return_lse : bool, default False
        Also return the rows' log-sum-exp, shape (T, Hq), in the compute dtype.
    return_max_logit : bool, default False
        Also return each row's largest visible score (after `scale`, `softcap` and
        ALiBi; the sink is not a score), shape (T, Hq), in the compute dtype, after the
        lse: ``-inf`` for padding rows and rows that see no key; no gradient. As
        :func:`~portable_attn.scaled_dot_product_attention`'s (QK-clip reads it).
    batch_invariant : bool, default False
        Make a request's rows (output and lse) the same bits whatever other requests
        share the call and in what order, whichever pages hold its keys, and however
        its tokens were split across calls (a prefill, chunks, decode steps), on one
        backend and device (under ``jax.jit`` across programs compiled for other
        ``T`` and ``R`` too). Every call's key chunks are the same; the flag also
        fixes the rows of a tile per model (``ceil(16 / G)``) and starts each tile at
        a multiple of them among its request's positions, so the matrix products have
        the same shapes in every call and a row sits at the same place in them (a
        CPU's matrix product rounds a row by the product's shape and by the row's
        place in it: OpenBLAS's AVX2 kernels do). Without it a tile holds the mean
        rows per request (one when decoding, up to 128), faster, and results may
        differ in the last bits.
    plan : PagedPlan, optional
        The step's plan (:func:`plan_ragged`), built once for every layer of the step
        from the same `page_table`, `kv_lengths` and `q_starts` arrays and options:
        the call then neither reads nor checks the metadata. Without it the call
        plans for itself.
    value_dim : int, optional
        With ``value_pages=None``: ``Dv``, the key features that are the values (the
        first ones), ``1 <= value_dim <= Dk``; by default all of them.
    kv_indices : integer array, shape (T, Hkv, k), optional
        Sparse attention (DeepSeek V3.2's selected tokens): for each row and KV head,
        the positions among its request's keys (``0 <= p < kv_lengths[r]``) of the keys
        it sees, ``-1`` padding; the ``Hq / Hkv`` query heads of a group share their
        head's list, a position listed twice counts once, and `is_causal`, `window` and
        `mask_mod` still hide what they hide. Each key is gathered from the pool by its
        position (``O(T · Hkv · k)`` keys, a chunk at a time; never a mask over all the
        keys). Under ``jax.jit`` the indices may be traced; a row whose list holds a
        position outside its request's keys then comes out NaN (an eager call raises).
    window_union : bool, default False
        With `kv_indices`: each row also sees every key of its `window` band (``left``
        keys before it, and ``right`` after it when not causal), listed or not, each
        once (DeepSeek V4's sliding window beside its selected entries); listed keys
        outside the band are seen where `is_causal` shows them. Needs a `window` whose
        band is bounded on both sides.
    key_scales, value_scales : arrays, shape (P, page_size, Hkv) or (P, page_size, Hkv, G)
        A quantized pool: its pages are int8 (or uint8 with ``kv_bits=4``) or float8,
        and a key's features are ``(stored - zero_point) · scale``, one scale per token
        or per group of ``D / G`` features (``G`` dividing ``D``), in the dtype of the
        result. Each chunk is dequantized where it is gathered: no float copy of the
        pool is made. :func:`paged_kv_write` given the scales quantizes what it writes.
    key_zero_points, value_zero_points : arrays, optional
        The zero points, shaped as the scales; none: symmetric (zero).
    kv_bits : {8, 4}, default 8
        4: each byte of a uint8 pool holds two signed 4-bit values (two's complement,
        ``-8 .. 7``), the low nibble first, so the pool's last axis is ``D / 2``.

    Returns
    -------
    out : array, shape (T, Hq, Dv)
        In the promoted dtype of `query`, `key_pages` and `value_pages`.
    lse : array, shape (T, Hq)
        Only with `return_lse`.
    max_logit : array, shape (T, Hq)
        Only with `return_max_logit`.

    Notes
    -----
    Exact. The keys are visited in chunks of 128 positions (whole pages): each chunk
    gathers, for the tiles of rows that may see it, only the pages it covers, so the
    extra memory is a few chunks per tile; chunks past a request's length or hidden by
    `is_causal` and `window` are not visited. With metadata on the host, a request with
    16 new rows or more (a prefill chunk; up to 32768 keys; not with `batch_invariant`,
    nor JAX, which walks every request) is computed instead as one call of
    :func:`~portable_attn.scaled_dot_product_attention` over its keys gathered from the
    pool, a copy of its cache (torch's SDPA on a CPU; the prefill step of
    ``benchmarks/serving.py`` took 0.32x the walk's time on torch, 0.68x on NumPy). Pool slots
    that hold no valid key of a request may contain anything, NaN included. With
    metadata on the host (NumPy, torch) the loop bounds are read there once per call;
    under ``jax.jit`` the metadata stays traced and a chunk no row may see is skipped
    by value (``T``, ``R``, ``P`` and ``max_pages`` are static). An eager call on JAX
    arrays (no `mask_mod` or `score_mod`) runs as that one program, ``jax.jit`` of the
    call, compiled once per shapes and options; a `plan` is checked, not used, there.
    The decode step of ``benchmarks/serving.py`` called eagerly took 1.03x the time of
    the call under ``jax.jit``, and 1.9 s for its first call (2.6x and 67 s op by op
    before; ``results/serving-eager-jax*.json``).
    Metadata is checked where it has values (a precise :class:`ValueError`: a page
    outside the pool that a request uses, a length below its new rows or above
    ``max_pages * page_size``, `q_starts` not a packing). Where it is traced (``jax.jit``,
    torch tracers) no error can be raised: the rows of a request whose metadata is
    wrong come out NaN, out and lse (every row, padding included, when `q_starts` is
    wrong), and no other request's rows read the pages it names.
    A query row reaches only its own request's results and gradients (the other
    rows of a tile are zeros, never another request's rows or padding), so a NaN
    there makes no other request's values or key/value gradients NaN.
    Differentiable with respect to `query`, the pools, `scale`, `softcap`, `sinks`,
    `alibi_slopes` and the arrays a `score_mod` closes over (torch autograd,
    ``jax.grad``), by automatic differentiation through the walk (the engine's own
    backward for the requests it computes).

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn.serving import ragged_paged_attention
    >>> rng = np.random.default_rng(0)
    >>> pool_k = rng.standard_normal((8, 16, 2, 64), dtype=np.float32)
    >>> pool_v = rng.standard_normal((8, 16, 2, 64), dtype=np.float32)
    >>> table = np.array([[3, 5, 0, 0], [1, 2, 7, 4]])  # two requests' pages
    >>> lengths, starts = np.array([20, 50]), np.array([0, 4, 5])  # 4 new rows, then 1
    >>> q = rng.standard_normal((5, 8, 64), dtype=np.float32)
    >>> ragged_paged_attention(q, pool_k, pool_v, table, lengths, starts).shape
    (5, 8, 64)
    """
    xp = _namespace(
        query,
        key_pages,
        value_pages,
        page_table,
        kv_lengths,
        q_starts,
        q_positions,
        sinks,
        alibi_slopes,
        kv_indices,
        key_scales,
        value_scales,
        key_zero_points,
        value_zero_points,
    )
    scaling = (key_scales, value_scales, key_zero_points, value_zero_points)
    keys, values = _stored_pools(xp, key_pages, value_pages, scaling, kv_bits)
    t, hq, dk = check_exact_rank(xp, "query", query, 3, "(T, Hq, Dk)")
    check_same_axis("query", query, -1, "key_pages", keys, -1, "Dk")
    n_pages, page_size, hkv, dv, _, max_pages = check_paged(
        xp, keys, values, page_table, kv_lengths, q_starts, value_dim
    )
    check_head_groups(query, keys, hq, hkv)
    check_positions(xp, q_positions, query)
    check_head_vector(xp, sinks, "sinks", hq)
    check_head_vector(xp, alibi_slopes, "alibi_slopes", hq)
    check_mask_mod(mask_mod, signature="mask_mod(request, head, q_pos, kv_pos)")
    check_score_mod(score_mod)
    mask_mod = _on_positions(mask_mod)
    is_causal = check_is_flag("is_causal", is_causal)
    return_lse = check_is_flag("return_lse", return_lse)
    return_max_logit = check_is_flag("return_max_logit", return_max_logit)
    batch_invariant = check_is_flag("batch_invariant", batch_invariant)
    left, right = (None, None) if window is None else check_window(window)
    window_union = check_is_flag("window_union", window_union)
    _check_listing(xp, kv_indices, window_union, (t, hkv), is_causal, (left, right))
    check_one_device(
        query=query,
        key_pages=key_pages,
        value_pages=value_pages,
        page_table=page_table,
        kv_lengths=kv_lengths,
        q_starts=q_starts,
        q_positions=q_positions,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        kv_indices=kv_indices,
        key_scales=key_scales,
        value_scales=value_scales,
        key_zero_points=key_zero_points,
        value_zero_points=value_zero_points,
    )
    shape = _StepShape(t, hq, hkv, page_size, n_pages, max_pages)
    flags = (is_causal, _bounds(left, right), batch_invariant)
    metadata = (page_table, kv_lengths, q_starts, q_positions)
    if plan is None:
        check_paged_metadata(
            q_starts,
            kv_lengths,
            page_table,
            t,
            n_pages,
            page_size,
            max_pages,
            q_positions=q_positions,
        )
    else:
        walk = _plan_for(plan, shape, flags, metadata)[0]
    _check_listed_values(kv_indices, q_starts, kv_lengths)  # a plan holds no list
    arrays = {"query": query, "key_pages": key_pages, "value_pages": value_pages}
    arrays.update(page_table=page_table, kv_lengths=kv_lengths, q_starts=q_starts)
    arrays.update(q_positions=q_positions, sinks=sinks, alibi_slopes=alibi_slopes)
    arrays.update(scale=scale, softcap=softcap, kv_indices=kv_indices)
    arrays.update(key_scales=key_scales, value_scales=value_scales)
    arrays.update(key_zero_points=key_zero_points, value_zero_points=value_zero_points)
    user_functions = mask_mod is not None or score_mod is not None
    if runs_compiled(library(query), user_functions) and all(
        has_concrete_values(x) for x in arrays.values() if is_array_api_obj(x)
    ):  # one program (its plan traced in it), as an eager JAX call of the single attention
        statics: dict[str, Any] = {"is_causal": is_causal, "window": _bounds(left, right)}
        statics.update(return_lse=return_lse, return_max_logit=return_max_logit)
        statics.update(batch_invariant=batch_invariant, value_dim=dv, window_union=window_union)
        statics.update(kv_bits=kv_bits)
        numbers = {k: x for k, x in arrays.items() if x is not None and not is_array_api_obj(x)}
        return _compiled_program()(
            {k: x for k, x in arrays.items() if k not in numbers},
            tuple(sorted({**statics, **numbers}.items())),
        )
    pools = (keys,) if values is None else (keys, values)
    dtype = result_type(xp, query.dtype, *(x.dtype for x in pools))
    compute = compute_dtype_of(xp, dtype)
    asked = (True, return_lse, return_max_logit)
    layer = {
        "value_dim": dv,
        "scale": 1.0 / math.sqrt(dk)
        if scale is None
        else scalar_option(xp, "scale", scale, compute),
        "softcap": None if softcap is None else scalar_option(xp, "softcap", softcap, compute),
        "compute_dtype": compute,
        "mask_mod": None if mask_mod is None else guarded_rule("mask_mod", mask_mod),
        "score_mod": None if score_mod is None else guarded_rule("score_mod", score_mod),
    }
    kv = (keys, values, page_table, kv_lengths)
    if kv_indices is not None:
        geometry = dataclasses.replace(_geometry(shape, page_table, *flags), **layer)
        listed = _listed_attention(xp, geometry, query, kv, metadata, (kv_indices, window_union))
        return _results(*zip(listed(sinks, alibi_slopes, dtype), asked, strict=True))
    if plan is None:
        walk = _walk_plan(xp, shape, metadata, *flags)
    walked: tuple[Any, ...] = (None, None, None)
    if walk.walks:
        walked = paged_attention(xp, walk, query, kv, sinks, alibi_slopes, dtype, **layer)
    if not walk.engine:
        return _results(*zip(walked, asked, strict=True))
    options = {"is_causal": is_causal, "window": _bounds(left, right), "softcap": softcap}
    options.update(scale=scale, sinks=sinks, alibi_slopes=alibi_slopes)
    options.update(mask_mod=mask_mod, score_mod=score_mod)
    parts = _by_engine(xp, walk, query, (keys, values, dv), asked, options)
    fills = (0.0, -xp.inf, -xp.inf)  # padding rows: zeros, lse and max -inf
    results = [
        (_merged(xp, walk, x, got, fill) if flag else None, flag)
        for x, got, fill, flag in zip(walked, parts, fills, asked, strict=True)
    ]
    return _results(*results)


@functools.cache
def _compiled_program() -> Any:
    """:func:`ragged_paged_attention` jitted: its arrays traced, its options static."""
    import jax

    def call(arrays: dict[str, Any], options: tuple[tuple[str, Any], ...]) -> Any:
        return ragged_paged_attention(**arrays, **dict(options))

    return jax.jit(call, static_argnums=1)


def _by_engine(
    xp: Any,
    walk: _paged.WalkPlan,
    query: Any,
    pools: tuple[Any, Any, int],
    asked: tuple[bool, bool, bool],
    options: dict[str, Any],
) -> list[list[Any]]:
    """Return the rows of the requests the plan leaves to the engine, request by request.

    Each such request (:attr:`~._lib._paged.WalkPlan.engine`) is one call of
    :func:`~portable_attn.scaled_dot_product_attention` over its keys gathered from the
    pools (its own route: torch's SDPA on a CPU), with the call's options. Returns the
    out (n, Hq, Dv), lse and max logit (n, Hq) of each, those `asked`.
    """
    key_pages, value_pages, dv = pools
    parts: list[list[Any]] = [[], [], []]
    # every request's rows, and every request's pages gathered, split once: in the
    # backward one concatenation each (a slice's is a zero array of the whole)
    cuts = [0, *(x for r in walk.engine for x in (r.begin, r.end)), query.shape[0]]
    rows = split_rows(query, cuts)[1::2]
    n_pages = list(itertools.accumulate((r.pages.shape[0] for r in walk.engine), initial=0))
    pages = xp.concat([r.pages for r in walk.engine])
    dtype = result_type(xp, query.dtype, key_pages.dtype)
    key_parts = split_rows(taken(xp, key_pages, pages, dtype), n_pages)
    value_parts = (
        key_parts
        if value_pages is None
        else split_rows(taken(xp, value_pages, pages, dtype), n_pages)
    )
    for i, request in enumerate(walk.engine):
        keys = _keys_of(xp, key_parts[i], request)  # (Hkv, L, Dk)
        values = keys[..., :dv] if value_pages is None else _keys_of(xp, value_parts[i], request)
        q = xp.permute_dims(rows[i], (1, 0, 2))  # (Hq, n, Dk)
        got = scaled_dot_product_attention(
            q,
            keys,
            values,
            return_lse=asked[1],
            return_max_logit=asked[2],
            **_request_rules(request, options),
        )
        got = iter(got if isinstance(got, tuple) else (got,))
        for i, part in enumerate(parts):
            if asked[i]:
                x = next(got)
                part.append(xp.permute_dims(x, (1, 0, 2) if i == 0 else (1, 0)))
    return parts


def _request_rules(request: _paged.EngineRequest, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the call's rules seeing `request`'s index and positions.

    The engine's call over the request's keys gives ``(batch, head, q_idx, kv_idx)``;
    the rules take ``(request, head, q_pos, kv_pos)``, the row at ``q_idx + m - n``.
    """
    mask_mod, score_mod = options["mask_mod"], options["score_mod"]
    if mask_mod is None and score_mod is None:
        return options
    shift = request.length - (request.end - request.begin)

    def at(b: Any, q_idx: Any) -> tuple[Any, Any]:
        return b * 0 + request.request, q_idx + shift

    def masked(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        r, q_pos = at(b, q_idx)
        return mask_mod(r, h, q_pos, kv_idx)

    def scored(scores: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        r, q_pos = at(b, q_idx)
        return score_mod(scores, r, h, q_pos, kv_idx)

    return {
        **options,
        "mask_mod": None if mask_mod is None else masked,
        "score_mod": None if score_mod is None else scored,
    }


def _merged(xp: Any, walk: _paged.WalkPlan, walked: Any, engine: list[Any], fill: float) -> Any:
    """Return one result (T, ...) from the walk's and the engine's rows, by the plan's runs."""
    first = engine[0]
    pieces = []
    for source, a, b in walk.merge:
        if source == _paged.WALK:
            pieces.append(walked[a:b, ...])
        elif source == _paged.PADDING:
            shape = (b - a, *first.shape[1:])
            pieces.append(xp.full(shape, fill, dtype=first.dtype, **on_device(device(first))))
        else:
            pieces.append(engine[source][a:b, ...])
    return pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=0)


def _keys_of(xp: Any, pages: Any, request: _paged.EngineRequest) -> Any:
    """Return a request's keys (or values) from its gathered pages, as (Hkv, L, D)."""
    x = xp.reshape(pages, (-1, *pages.shape[2:]))[: request.length, ...]  # (pages, ps, Hkv, D)
    return xp.permute_dims(x, (1, 0, 2))


def _results(*results: tuple[Any, bool]) -> Any:
    """Return the arrays asked for, in order: the first alone, or a tuple."""
    asked = [x for x, flag in results if flag]
    return asked[0] if len(asked) == 1 else tuple(asked)


class _StepShape(NamedTuple):
    """The shapes a step's plan is built for: T, Hq, Hkv, page_size, P, max_pages."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int
    num_pages: int
    max_pages: int


@dataclass(frozen=True, eq=False)
class PagedPlan:
    """The plan of one serving step, shared by every layer's :func:`ragged_paged_attention`.

    Built by :func:`plan_ragged` from the step's metadata; holds which tiles of query
    rows the walk computes, which key chunks each visits and where their pages are,
    and which requests' rows the engine computes over their gathered keys, so a model
    of ``n`` layers reads and checks the metadata once per step, not ``n`` times (on a
    GPU each read of the metadata is a synchronisation with the host).
    The attributes are the shapes and options it was built for; a call given it must
    have the same ones and the same metadata arrays, unchanged since: a plan holds what
    it read of them, so metadata written in place after planning needs a new plan.
    """

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int
    num_pages: int
    is_causal: bool
    window: tuple[int | None, int | None] | None
    batch_invariant: bool
    _walk: _paged.WalkPlan = field(repr=False)
    _slots: _Slots | None = field(repr=False)
    _metadata: tuple[Any, Any, Any, Any] = field(repr=False)
    _max_pages: int = field(repr=False)


def plan_ragged(
    page_table: Array,
    kv_lengths: Array,
    q_starts: Array,
    *,
    q_positions: Array | None = None,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    num_pages: int,
    is_causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
    batch_invariant: bool = False,
) -> PagedPlan:
    """Plan a serving step once, for every layer's :func:`ragged_paged_attention` of it.

    A serving engine builds the plan after the scheduler has fixed the step's batch,
    before the model's layers run, and passes it to each layer's call as ``plan=``
    with the same metadata arrays (FlashInfer's ``plan()`` then ``run()``): the
    metadata is checked, read on the host and turned into the walk's tiles, chunk
    ranges and page indices once per step. Under ``jax.jit`` build it inside the
    jitted step from the traced metadata: the tiles are then array operations, traced
    once for all the layers.

    Parameters
    ----------
    page_table, kv_lengths, q_starts : integer arrays
        As in :func:`ragged_paged_attention`: shapes (R, max_pages), (R,), (R + 1,).
    q_positions : integer array, shape (T,), optional
        As in :func:`ragged_paged_attention`; the calls given the plan pass the same.
    num_tokens : int
        ``T``, the packed query rows of the step (axis 0 of the calls' `query`).
    num_q_heads, num_kv_heads : int
        ``Hq`` and ``Hkv`` of the calls' `query` and pools.
    page_size, num_pages : int
        Axes 1 and 0 of the calls' pools.
    is_causal, window, batch_invariant
        As in :func:`ragged_paged_attention`; the calls given the plan pass the same.

    Returns
    -------
    PagedPlan

    Raises
    ------
    ValueError
        Metadata that does not fit (as :func:`ragged_paged_attention` checks it), or
        shapes that cannot be a call's.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn.serving import plan_ragged, ragged_paged_attention
    >>> rng = np.random.default_rng(0)
    >>> table = np.array([[3, 5, 0, 0], [1, 2, 7, 4]])
    >>> lengths, starts = np.array([20, 50]), np.array([0, 4, 5])
    >>> plan = plan_ragged(table, lengths, starts, num_tokens=5, num_q_heads=8,
    ...                    num_kv_heads=2, page_size=16, num_pages=8)
    >>> for layer in range(2):  # every layer of the step: its own pools, one plan
    ...     pool_k, pool_v = rng.standard_normal((2, 8, 16, 2, 64), dtype=np.float32)
    ...     q = rng.standard_normal((5, 8, 64), dtype=np.float32)
    ...     out = ragged_paged_attention(q, pool_k, pool_v, table, lengths, starts, plan=plan)
    >>> out.shape
    (5, 8, 64)
    """
    names = ("page_table", "kv_lengths", "q_starts", "q_positions")
    xp = _namespace(page_table, kv_lengths, q_starts, q_positions, names=names)
    counts = {
        "num_tokens": (num_tokens, 0),
        "num_q_heads": (num_q_heads, 1),
        "num_kv_heads": (num_kv_heads, 1),
        "page_size": (page_size, 1),
        "num_pages": (num_pages, 1),
    }
    t, hq, hkv, ps, n_pages = (check_count(n, v, minimum=m) for n, (v, m) in counts.items())
    check_groups(hq, hkv, "(`num_q_heads`)", "`num_kv_heads`")
    n_req, max_pages = check_integer_array(xp, "page_table", page_table, 2, "(R, max_pages)")
    check_integer_array(xp, "kv_lengths", kv_lengths, 1, "(R,)", (n_req,), "page_table")
    check_integer_array(xp, "q_starts", q_starts, 1, "(R + 1,)", (n_req + 1,), "page_table")
    check_positions(xp, q_positions, None, t)
    check_one_device(
        page_table=page_table, kv_lengths=kv_lengths, q_starts=q_starts, q_positions=q_positions
    )
    is_causal = check_is_flag("is_causal", is_causal)
    batch_invariant = check_is_flag("batch_invariant", batch_invariant)
    left, right = (None, None) if window is None else check_window(window)
    check_paged_metadata(
        q_starts,
        kv_lengths,
        page_table,
        t,
        n_pages,
        ps,
        max_pages,
        pages_from="`num_pages`",
        q_positions=q_positions,
    )
    shape = _StepShape(t, hq, hkv, ps, n_pages, max_pages)
    bounds = _bounds(left, right)
    metadata = (page_table, kv_lengths, q_starts, q_positions)
    walk = _walk_plan(xp, shape, metadata, is_causal, bounds, batch_invariant)
    return PagedPlan(
        t,
        hq,
        hkv,
        ps,
        n_pages,
        is_causal,
        bounds,
        batch_invariant,
        walk,
        _write_slots(xp, page_table, kv_lengths, q_starts, t, n_pages, ps),
        metadata,
        max_pages,
    )


def _bounds(left: int | None, right: int | None) -> tuple[int | None, int | None] | None:
    """Return a window's bounds, None for no window (``window=None`` or ``(None, None)``)."""
    return None if left is None and right is None else (left, right)


def _walk_plan(
    xp: Any,
    shape: _StepShape,
    metadata: tuple[Any, Any, Any, Any],
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    batch_invariant: bool,
) -> _paged.WalkPlan:
    """Return the walk's plan of checked metadata (:func:`~._paths._paged.plan_walk`).

    `metadata`: the page table, lengths, starts and query positions (or None).
    """
    geometry = _geometry(shape, metadata[0], is_causal, window, batch_invariant)
    return plan_walk(xp, geometry, *metadata)


def _geometry(
    shape: _StepShape,
    page_table: Any,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    batch_invariant: bool,
) -> _paged.PagedProblem:
    """Return the problem of a step's shapes and options (:func:`~._paths._paged.problem`)."""
    return problem(
        page_table,
        num_tokens=shape.num_tokens,
        num_pages=shape.num_pages,
        page_size=shape.page_size,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        is_causal=is_causal,
        window=window,
        batch_invariant=batch_invariant,
    )


def _listed_attention(
    xp: Any,
    p: _paged.PagedProblem,
    query: Any,
    kv: tuple[Any, Any, Any, Any],
    metadata: tuple[Any, Any, Any, Any],
    listing: tuple[Any, bool],
) -> Callable[..., tuple[Any, Any, Any]]:
    """Return the index walk of a call (:func:`~._paths._paged.index_attention`), ready to run.

    The rows' positions (given, or each request's last), and where the metadata or the
    lists have no values (``jax.jit``), the rows they make wrong (NaN).
    """
    page_table, kv_lengths, q_starts, q_positions = metadata
    t = p.num_tokens
    positions = q_positions
    if positions is None:
        positions = _paged.bottom_right(xp, q_starts, kv_lengths, t, p.device)
    positions = xp.astype(positions, q_starts.dtype)
    faulty = traced_faults(xp, p, page_table, kv_lengths, q_starts, q_positions)
    if faulty is not None or not has_concrete_values(listing[0]):
        if faulty is None:
            faulty = xp.zeros((t,), dtype=xp.bool, **on_device(p.device))
        request, inside, _ = _paged.owners(xp, q_starts[1:], t, p.device)
        limit = xp.astype(xp.take(kv_lengths, request), listing[0].dtype)[:, None, None]
        outside = (listing[0] < -1) | (listing[0] >= limit)  # padding rows: any value
        faulty = faulty | (inside & xp.any(xp.reshape(outside, (t, -1)), axis=1))
    rows = (q_starts, positions, kv_lengths)
    return functools.partial(index_attention, xp, p, query, kv, rows, listing, faulty=faulty)


def _stored_pools(
    xp: Any, key_pages: Any, value_pages: Any, scaling: tuple[Any, ...], bits: Any
) -> tuple[Any, Any]:
    """Return the pools as the walks read them: arrays, or :class:`~._lib._quant.Quantized`.

    `scaling` the key and value scales and zero points (None each where not given).
    Checks that a quantized pool's dtype, scales and zero points go together.
    """
    key_scales, value_scales, key_zp, value_zp = scaling
    if isinstance(bits, bool) or bits not in (4, 8):
        msg = f"`kv_bits` must be 8 or 4, but got {bits!r}"
        raise (TypeError if not isinstance(bits, int) else ValueError)(msg)
    keys = _stored(xp, "key", key_pages, key_scales, key_zp, bits)
    if value_pages is None:
        for name, x in (("value_scales", value_scales), ("value_zero_points", value_zp)):
            if x is not None:
                msg = f"`{name}` is given but `value_pages` is None (the values are the keys')"
                raise ValueError(msg)
        return keys, None
    return keys, _stored(xp, "value", value_pages, value_scales, value_zp, bits)


def _stored(xp: Any, name: str, pool: Any, scales: Any, zero_points: Any, bits: int) -> Any:
    """Return one pool as the walks read it (see :func:`_stored_pools`)."""
    pages = f"`{name}_pages`"
    dtype = getattr(pool, "dtype", None)
    if scales is None:
        if zero_points is not None:
            msg = f"`{name}_zero_points` needs `{name}_scales`"
            raise ValueError(msg)
        if bits != 8:
            msg = f"`kv_bits={bits}` needs `{name}_scales`: a 4-bit pool is quantized"
            raise ValueError(msg)
        if dtype is not None and xp.isdtype(dtype, "integral"):
            msg = (
                f"{pages} is {dtype}: a quantized pool needs `{name}_scales` of shape "
                f"(P, page_size, Hkv) or (P, page_size, Hkv, G)"
            )
            raise TypeError(msg)
        return pool
    wanted = "uint8 (kv_bits=4)" if bits == 4 else "int8 or a float8"
    ok = (
        dtype == xp.uint8
        if bits == 4
        else (dtype == xp.int8 or xp.isdtype(dtype, "real floating"))
    )
    if not ok:
        msg = f"{pages} with `{name}_scales` must be {wanted}, but got {dtype}"
        raise TypeError(msg)
    if not xp.isdtype(scales.dtype, "real floating"):
        msg = f"`{name}_scales` must be a floating array, but got {scales.dtype}"
        raise TypeError(msg)
    stored = Quantized(pool, scales, zero_points, bits)
    shape, lead = tuple(stored.shape), tuple(pool.shape[:3])
    layout = "(P, page_size, Hkv) or (P, page_size, Hkv, G), G dividing D"
    groups = scales.shape[3] if scales.ndim == 4 else 1
    if scales.ndim not in (3, 4) or tuple(scales.shape[:3]) != lead or shape[-1] % groups:
        msg = (
            f"`{name}_scales` must have shape {layout}, but got shape {tuple(scales.shape)} "
            f"for {pages} of shape {tuple(pool.shape)} (D = {shape[-1]})"
        )
        raise ValueError(msg)
    if zero_points is not None and tuple(zero_points.shape) != tuple(scales.shape):
        msg = (
            f"`{name}_zero_points` must have the shape of `{name}_scales` "
            f"{tuple(scales.shape)}, but got shape {tuple(zero_points.shape)}"
        )
        raise ValueError(msg)
    return stored


def _check_listing(
    xp: Any,
    kv_indices: Any,
    window_union: bool,
    rows: tuple[int, int],
    is_causal: bool,
    window: tuple[int | None, int | None],
) -> None:
    """Check `kv_indices` (T, Hkv, k) against the call's rows and heads, and `window_union`."""
    if kv_indices is None:
        if window_union:
            msg = "`window_union=True` needs `kv_indices`: it joins a window to listed keys"
            raise ValueError(msg)
        return
    shape = check_integer_array(xp, "kv_indices", kv_indices, 3, "(T, Hkv, k)")
    for axis, (name, n) in enumerate(zip(("T", "Hkv"), rows, strict=True)):
        if shape[axis] != n:
            source = "axis 0 of `query`" if axis == 0 else "axis 2 of `key_pages`"
            msg = (
                f"`kv_indices` axis {axis} ({name}) is {shape[axis]}, but {source} is {n}: "
                f"kv_indices has shape {shape}, (T, Hkv, k)"
            )
            raise ValueError(msg)
    left, right = window
    if window_union and (left is None or (right is None and not is_causal)):
        msg = (
            f"`window_union=True` needs a `window` bounded on both sides (a left bound, and a "
            f"right one or `is_causal`), but got window={window}, is_causal={is_causal}"
        )
        raise ValueError(msg)


def _check_listed_values(kv_indices: Any, q_starts: Any, kv_lengths: Any) -> None:
    """Refuse listed positions outside their request's keys, where they have values."""
    if kv_indices is None or not all(
        has_concrete_values(x) for x in (kv_indices, q_starts, kv_lengths)
    ):
        return
    starts = np.asarray(to_host(q_starts), dtype=np.int64)
    lengths = np.asarray(to_host(kv_lengths), dtype=np.int64)
    listed = np.asarray(to_host(kv_indices), dtype=np.int64)[: starts[-1]]
    limit = np.repeat(lengths, np.diff(starts))[:, None, None]
    bad = np.argwhere((listed < -1) | (listed >= limit))
    if len(bad):
        t, h, i = (int(x) for x in bad[0])
        r = int(np.searchsorted(starts, t, side="right")) - 1
        msg = (
            f"`kv_indices`[{t}, {h}, {i}] = {listed[t, h, i]} must be -1 (padding) or a "
            f"position among the keys of row {t}'s request {r}: 0 <= position < "
            f"`kv_lengths`[{r}] = {lengths[r]}"
        )
        raise ValueError(msg)


def _plan_for(
    plan: Any,
    shape: _StepShape,
    flags: tuple[bool, Any, bool] | None,
    metadata: tuple[Any, ...],
) -> tuple[_paged.WalkPlan, _Slots | None]:
    """Return the walk and the write slots of `plan`, once it is this call's (else raise).

    `metadata`: the page table, lengths, starts and (the attention's) query positions.
    `flags` None (the write's) are not compared.
    """
    if not isinstance(plan, PagedPlan):
        msg = f"`plan` must be a PagedPlan from plan_ragged, but got {type(plan).__name__}"
        raise TypeError(msg)
    names = ("page_table", "kv_lengths", "q_starts", "q_positions")
    for name, x, y in zip(names, metadata, plan._metadata, strict=False):
        if x is not y:
            msg = (
                f"`plan` was built for other metadata: pass the `{name}` array given to "
                "plan_ragged (a plan holds what it read of the step's metadata; under "
                "jax.jit, build the plan inside the jitted function)"
            )
            raise ValueError(msg)
    planned = _StepShape(
        plan.num_tokens,
        plan.num_q_heads,
        plan.num_kv_heads,
        plan.page_size,
        plan.num_pages,
        plan._max_pages,
    )
    where = {
        "num_tokens": "axis 0 of `query` or `new_keys`",
        "num_q_heads": "axis 1 of `query`",
        "num_kv_heads": "axis 2 of `key_pages`",
        "page_size": "axis 1 of `key_pages`",
        "num_pages": "axis 0 of `key_pages`",
        "max_pages": "axis 1 of `page_table`",
    }
    for name, want, got in zip(_StepShape._fields, planned, shape, strict=True):
        if want != got:
            msg = f"`plan` was built for {name}={want}, but this call has {got} ({where[name]})"
            raise ValueError(msg)
    options = {
        "is_causal": plan.is_causal,
        "window": plan.window,
        "batch_invariant": plan.batch_invariant,
    }
    for (name, built), called in zip(options.items(), flags or options.values(), strict=True):
        if built != called:
            msg = f"`plan` was built with {name}={built}, but this call has {name}={called}"
            raise ValueError(msg)
    return plan._walk, plan._slots


def paged_kv_write(
    key_pages: Array,
    value_pages: Array | None,
    page_table: Array,
    kv_lengths: Array,
    q_starts: Array,
    new_keys: Array,
    new_values: Array | None,
    *,
    plan: PagedPlan | None = None,
    key_scales: Array | None = None,
    value_scales: Array | None = None,
    kv_bits: int = 8,
) -> tuple[Array | None, ...]:
    """Write the new tokens' keys and values into their pages; return the pools.

    Row ``i`` of request ``r`` (``n_r = q_starts[r+1] - q_starts[r]`` rows) goes to
    position ``kv_lengths[r] - n_r + i`` of the request: slot ``position % page_size``
    of physical page ``page_table[r, position // page_size]``. `kv_lengths` counts the
    new tokens already (the lengths :func:`ragged_paged_attention` then takes). Rows
    at or past ``q_starts[R]`` are padding and are not written.

    **This function writes into the arrays it is given** where the library's arrays
    are mutable (NumPy, torch, CuPy: the pools returned are the pools given). Under
    JAX it is functional (``.at[].set``), and in place when the pools are donated to
    ``jax.jit``; other libraries (array-api-strict) get new pools. Metadata with
    values is checked as in :func:`ragged_paged_attention`; under ``jax.jit`` the
    rows of a request whose metadata is wrong (a page outside the pool, a length that
    does not fit) are not written, and no other page changes.

    Parameters
    ----------
    key_pages : array, shape (P, page_size, Hkv, Dk)
    value_pages : array, shape (P, page_size, Hkv, Dv), or None
        None: one pool for keys and values (``ragged_paged_attention(value_pages=None)``);
        `new_values` is then None too.
    page_table : integer array, shape (R, max_pages)
    kv_lengths : integer array, shape (R,)
    q_starts : integer array, shape (R + 1,)
    new_keys : array, shape (T, Hkv, Dk)
        Cast to the pool's dtype.
    new_values : array, shape (T, Hkv, Dv), or None
    plan : PagedPlan, optional
        The step's plan (:func:`plan_ragged`), as :func:`ragged_paged_attention` takes
        it: the slots to write are then the plan's, the metadata neither read nor
        checked again.
    key_scales, value_scales : arrays, shape (P, page_size, Hkv) or (P, page_size, Hkv, G)
        Quantize on write, into an int8 pool (or uint8 with ``kv_bits=4``): each new
        token's (or each group of ``D / G`` features') scale is ``max |x| / 127`` (``/ 7``
        with 4 bits), its values ``round(x / scale)``, half to even; the scales are
        written to the same slots of these arrays (as :func:`ragged_paged_attention`
        reads them, without zero points).
    kv_bits : {8, 4}, default 8
        As in :func:`ragged_paged_attention`.

    Returns
    -------
    key_pages, value_pages : arrays
        The pools with the new tokens written (`value_pages` None if given None).
    key_scales, value_scales : arrays
        Only when quantizing: the scales, written.
    """
    xp = _namespace(
        key_pages,
        value_pages,
        page_table,
        kv_lengths,
        q_starts,
        new_keys,
        new_values,
        names=(
            "key_pages",
            "value_pages",
            "page_table",
            "kv_lengths",
            "q_starts",
            "new_keys",
            "new_values",
        ),
    )
    quantizing = key_scales is not None or value_scales is not None
    if quantizing and (key_scales is None or (value_pages is not None and value_scales is None)):
        msg = "`key_scales` and `value_scales` must both be given to quantize both pools"
        raise ValueError(msg)
    keys, values = _stored_pools(
        xp, key_pages, value_pages, (key_scales, value_scales, None, None), kv_bits
    )
    quantized_pools = [(n, x) for n, x in (("key", keys), ("value", values)) if x is not None]
    for name, pool in quantized_pools if quantizing else ():
        dtype = pool.data.dtype
        if dtype not in (xp.int8, xp.uint8):
            msg = (
                f"paged_kv_write quantizes into int8 pools (or uint8 with kv_bits=4), but "
                f"`{name}_pages` is {dtype}: write a float8 pool's values as they are stored"
            )
            raise TypeError(msg)
    n_pages, page_size, hkv, _, _, max_pages = check_paged(
        xp, keys, values, page_table, kv_lengths, q_starts
    )
    t = check_exact_rank(xp, "new_keys", new_keys, 3, "(T, Hkv, Dk)")[0]
    check_same_axis("new_keys", new_keys, 1, "key_pages", keys, 2, "Hkv")
    check_same_axis("new_keys", new_keys, 2, "key_pages", keys, 3, "Dk")
    if (value_pages is None) != (new_values is None):
        msg = (
            "`value_pages` and `new_values` must both be arrays or both None (one pool for "
            f"keys and values), but got {type(value_pages).__name__} and "
            f"{type(new_values).__name__}"
        )
        raise TypeError(msg)
    if new_values is not None:
        check_exact_rank(xp, "new_values", new_values, 3, "(T, Hkv, Dv)")
        check_same_axis("new_keys", new_keys, 0, "new_values", new_values, 0, "T")
        check_same_axis("new_values", new_values, 1, "value_pages", values, 2, "Hkv")
        check_same_axis("new_values", new_values, 2, "value_pages", values, 3, "Dv")
    check_one_device(
        key_pages=key_pages,
        value_pages=value_pages,
        page_table=page_table,
        kv_lengths=kv_lengths,
        q_starts=q_starts,
        new_keys=new_keys,
        new_values=new_values,
        key_scales=key_scales,
        value_scales=value_scales,
    )
    if plan is None:
        check_paged_metadata(q_starts, kv_lengths, page_table, t, n_pages, page_size, max_pages)
        slots = _write_slots(xp, page_table, kv_lengths, q_starts, t, n_pages, page_size)
    else:
        hq = getattr(plan, "num_q_heads", 0)  # the write has no query heads
        shape = _StepShape(t, hq, hkv, page_size, n_pages, max_pages)
        slots = _plan_for(plan, shape, None, (page_table, kv_lengths, q_starts))[1]
    if slots is None:  # no row, or every row padding
        return (key_pages, value_pages, key_scales, value_scales)[: 4 if quantizing else 2]
    named = {"key_pages": (key_pages, new_keys), "value_pages": (value_pages, new_values)}
    named = {n: (pool, x) for n, (pool, x) in named.items() if x is not None}
    if quantizing:
        for name, scales in (("key", key_scales), ("value", value_scales)):
            if scales is not None and f"{name}_pages" in named:
                pool, x = named[f"{name}_pages"]
                groups = scales.shape[3] if scales.ndim == 4 else 0
                data, scale = quantized(xp, x, groups, kv_bits)
                named[f"{name}_pages"] = (pool, data)
                named[f"{name}_scales"] = (scales, scale)
    named = {n: (pool, xp.astype(x, pool.dtype)) for n, (pool, x) in named.items()}
    written = dict(zip(named, _WRITERS[library(key_pages).writes](xp, named, slots), strict=True))
    names = ("key_pages", "value_pages", "key_scales", "value_scales")[: 4 if quantizing else 2]
    return tuple(written.get(n) for n in names)


def varlen_attention(
    query: Array,
    key: Array,
    value: Array,
    q_starts: Array,
    kv_starts: Array,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    scale: float | Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
    batch_invariant: bool = False,
) -> Array | tuple[Array, ...]:
    """Attention within each of R packed sequences: ``flash_attn_varlen_func``'s job.

    Request ``r`` owns query rows ``q_starts[r] : q_starts[r+1]`` and keys
    ``kv_starts[r] : kv_starts[r+1]``; rows at or past ``q_starts[R]`` are padding
    (zeros), keys at or past ``kv_starts[R]`` are never seen.

    Parameters
    ----------
    query : array, shape (T, Hq, Dk)
    key : array, shape (S, Hkv, Dk)
    value : array, shape (S, Hkv, Dv)
    q_starts, kv_starts : integer array, shape (R + 1,)
        Starting at 0, nondecreasing, the last at most ``T`` (``S``).
    is_causal : bool, default False
        Per request, bottom-right: row ``i`` of a request with ``n`` rows and ``m``
        keys sees its keys ``j <= i + m - n``.
    window, softcap, scale, sinks, alibi_slopes, return_lse, return_max_logit
        As in :func:`ragged_paged_attention`, per request.
    mask_mod : callable, optional
        ``mask_mod(request, head, q_pos, kv_pos) -> bool array``: True where a row may
        see a key of its request, AND-ed with the rest. `request` is the request's
        index, `q_pos` and `kv_pos` positions among the request's keys (a row's
        bottom-right: ``i + m - n``), index arrays that broadcast as those of
        :func:`~portable_attn.scaled_dot_product_attention`'s `mask_mod`. A prefix seen
        both ways (prefix-LM, an image's tokens): ``lambda r, h, q, k: (k <= q) |
        (k < prefix[r])`` with ``is_causal=False``. A ready rule of
        ``portable_attn.block_mask`` sees these positions as its aligned ones.
    score_mod : callable, optional
        ``score_mod(scores, request, head, q_pos, kv_pos) -> scores``, the same
        indices, after `softcap` and before ALiBi; arrays it closes over get gradients.
    batch_invariant : bool, default False
        The bits :func:`ragged_paged_attention` gives the same requests with
        ``batch_invariant=True`` (pools whose page size divides the walk's chunk of
        keys: 1, 2, 4, ... 128 on a CPU), whatever else is packed beside them: a
        trainer's and a generator's attention agree bit for bit on one backend and
        device. The packed keys are walked as a pool of one-slot pages (the paged walk,
        not the engine's kernels: slower; gradients by automatic differentiation
        through it). Each request needs at least as many keys as rows (its rows sit at
        positions of its keys).

    Returns
    -------
    out : array, shape (T, Hq, Dv)
    lse : array, shape (T, Hq)
        Only with `return_lse`.
    max_logit : array, shape (T, Hq)
        Only with `return_max_logit`.

    Notes
    -----
    One call of :func:`~portable_attn.scaled_dot_product_attention` on the packed
    axis with segment ids (a request's rows see only its keys; on the tiled path no
    block pair across two requests is computed): the engine's routes, its recomputing
    backward (O(T + S) training memory) and ``jax.jit`` all apply. Where every
    request's rows sit on its keys as the packed axis's rows on its keys
    (``kv_starts[r+1] - q_starts[r+1] == S - T``: packed training, the same starts
    array for both, or equal starts read where that is free), the causal band, window
    and ALiBi are the call's own (torch's fused kernel per document); otherwise a
    ``mask_mod`` (and for ALiBi a ``score_mod``) places each request, as it places the
    indices of yours.
    """
    xp = _namespace(
        query,
        key,
        value,
        q_starts,
        kv_starts,
        sinks,
        alibi_slopes,
        names=("query", "key", "value", "q_starts", "kv_starts", "sinks", "alibi_slopes"),
    )
    t, hq, _ = check_exact_rank(xp, "query", query, 3, "(T, Hq, Dk)")
    s, hkv, _ = check_exact_rank(xp, "key", key, 3, "(S, Hkv, Dk)")
    check_exact_rank(xp, "value", value, 3, "(S, Hkv, Dv)")
    check_same_axis("query", query, 2, "key", key, 2, "Dk")
    check_same_axis("key", key, 0, "value", value, 0, "S")
    check_same_axis("key", key, 1, "value", value, 1, "Hkv")
    check_head_groups(query, key, hq, hkv)
    (n1,) = check_integer_array(xp, "q_starts", q_starts, 1, "(R + 1,)")
    check_integer_array(xp, "kv_starts", kv_starts, 1, "(R + 1,)", (n1,), "q_starts")
    if n1 < 1:
        msg = f"`q_starts` must hold at least one entry (R + 1 >= 1), but got shape {(n1,)}"
        raise ValueError(msg)
    check_head_vector(xp, sinks, "sinks", hq)
    check_head_vector(xp, alibi_slopes, "alibi_slopes", hq)
    check_mask_mod(mask_mod, signature="mask_mod(request, head, q_pos, kv_pos)")
    check_score_mod(score_mod)
    mask_mod = _on_positions(mask_mod)
    is_causal = check_is_flag("is_causal", is_causal)
    return_lse = check_is_flag("return_lse", return_lse)
    return_max_logit = check_is_flag("return_max_logit", return_max_logit)
    left, right = (None, None) if window is None else check_window(window)
    batch_invariant = check_is_flag("batch_invariant", batch_invariant)
    check_one_device(
        query=query,
        key=key,
        value=value,
        q_starts=q_starts,
        kv_starts=kv_starts,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    for name, starts, limit in (("q_starts", q_starts, t), ("kv_starts", kv_starts, s)):
        check_starts(name, starts, limit)
    if batch_invariant and s > 0:  # the paged walk's bits, over pages of one slot
        return ragged_paged_attention(
            query,
            *_one_slot_pages(xp, key, value, q_starts, kv_starts),
            is_causal=is_causal,
            window=window,
            softcap=softcap,
            scale=scale,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            mask_mod=mask_mod,
            score_mod=score_mod,
            return_lse=return_lse,
            return_max_logit=return_max_logit,
            batch_invariant=True,
        )
    seg_q, pos_q = _segments(xp, q_starts, t, -1)
    seg_k, pos_k = _segments(xp, kv_starts, s, -2)
    options = {"softcap": softcap, "scale": scale, "sinks": sinks}
    options.update(return_lse=return_lse, return_max_logit=return_max_logit)
    # a row's place among its request's keys: bottom-right
    n_q = q_starts[1:] - q_starts[:-1]
    n_k = kv_starts[1:] - kv_starts[:-1]
    padding = xp.zeros((1,), dtype=n_q.dtype, **on_device(device(q_starts)))  # R = 0 too
    shift = xp.take(xp.concat([n_k - n_q, padding]), xp.where(seg_q < 0, n1 - 1, seg_q))
    pos_q = pos_q + shift
    request = xp.where(seg_q < 0, 0, seg_q)  # padding rows see no key: request 0's indices
    if n1 == 1:  # no request: every row padding, and no request's index to give yours
        mask_mod = score_mod = None

    placed = _packed_alignment(q_starts, kv_starts, t, s)  # each request's band: the call's
    if placed:
        options.update(is_causal=is_causal, window=window, alibi_slopes=alibi_slopes)
    band = Band() if placed else Band.of(is_causal, (left, right))
    rules = _Rules(band, None if placed else alibi_slopes, mask_mod, score_mod)
    positions = (pos_q, pos_k, request)
    return _varlen_call(xp, query, key, value, seg_q, seg_k, rules.into(xp, positions, options))


def cascade_attention(
    query: Array,
    prefix_key: Array,
    prefix_value: Array | None,
    key_pages: Array,
    value_pages: Array | None,
    page_table: Array,
    kv_lengths: Array,
    q_starts: Array,
    group_starts: Array,
    *,
    is_causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    scale: float | Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
    plan: PagedPlan | None = None,
    value_dim: int | None = None,
) -> Array | tuple[Array, ...]:
    """Attention of a ragged batch whose requests share prompts, each prompt's keys read once.

    Consecutive requests form ``G`` groups; each request's keys are its group's prefix
    (``Lp`` keys, positions ``0 .. Lp - 1``) followed by its own keys in the pool
    (positions ``Lp ..``). The prefix is attended once for all rows of its group (one
    engine call over the packed rows, each group's rows seeing its own prefix), each
    request's own keys as :func:`ragged_paged_attention` attends them, and the two
    parts merged by their log-sum-exps (:func:`~portable_attn.merge_attention`):
    FlashInfer's ``MultiLevelCascadeAttentionWrapper``, vLLM's cascade attention.

    Parameters
    ----------
    query : array, shape (T, Hq, Dk)
        The new tokens of every request, packed as in :func:`ragged_paged_attention`.
    prefix_key : array, shape (G, Lp, Hkv, Dk)
        Each group's shared prefix.
    prefix_value : array, shape (G, Lp, Hkv, Dv), or None
        None with ``value_pages=None``: the first `value_dim` features of the keys.
    key_pages, value_pages, page_table, q_starts, plan, value_dim
        Each request's own keys, as :func:`ragged_paged_attention` takes them.
    kv_lengths : integer array, shape (R,)
        Each request's own keys (its new tokens included), the prefix not counted.
    group_starts : integer array, shape (G + 1,)
        Group ``g`` holds requests ``group_starts[g] : group_starts[g+1]``: from 0,
        nondecreasing, ending at ``R`` (a group may be empty).
    is_causal, window, softcap, scale, alibi_slopes
        As in :func:`ragged_paged_attention`, at each row's position among all its keys:
        row ``i`` of a request with ``n`` rows sits at ``Lp + kv_lengths[r] - n + i``.
    sinks : array, shape (Hq,), optional
        Counted once per row (with the prefix).
    mask_mod, score_mod : callable, optional
        As in :func:`ragged_paged_attention`; `q_pos` and `kv_pos` are positions among
        all of a request's keys, the prefix's first.
    return_lse, return_max_logit : bool, default False
        As in :func:`ragged_paged_attention`, over all of a row's keys.

    Returns
    -------
    out : array, shape (T, Hq, Dv)
    lse : array, shape (T, Hq)
        Only with `return_lse`.
    max_logit : array, shape (T, Hq)
        Only with `return_max_logit`.

    Notes
    -----
    Exact: the result of :func:`ragged_paged_attention` over pages holding each
    request's prefix and own keys. Padding rows come out as zeros (lse ``-inf``).
    Differentiable as both parts are, the prefixes included. With metadata on the host
    the prefix call visits only the blocks of each group's rows and prefix (segment
    ids); under ``jax.jit`` they are masked. :func:`paged_kv_write` must never target a
    page that requests share (a prefix kept in the pool and named by several tables):
    give each request its own pages for the keys it writes.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn.serving import cascade_attention
    >>> rng = np.random.default_rng(0)
    >>> prefix_k, prefix_v = rng.standard_normal((2, 2, 100, 2, 16))  # 2 prompts
    >>> pool_k, pool_v = rng.standard_normal((2, 8, 16, 2, 16))
    >>> table = np.array([[0, 1], [2, 3], [4, 5]])  # 3 requests, their own pages
    >>> lengths, starts = np.array([5, 9, 3]), np.array([0, 1, 2, 3])  # decoding
    >>> groups = np.array([0, 2, 3])  # requests 0 and 1 share prompt 0; 2 has prompt 1
    >>> q = rng.standard_normal((3, 4, 16))
    >>> cascade_attention(q, prefix_k, prefix_v, pool_k, pool_v, table, lengths, starts,
    ...                   groups).shape
    (3, 4, 16)
    """
    xp = _namespace(
        query,
        prefix_key,
        prefix_value,
        group_starts,
        sinks,
        alibi_slopes,
        names=("query", "prefix_key", "prefix_value", "group_starts", "sinks", "alibi_slopes"),
    )
    t = check_exact_rank(xp, "query", query, 3, "(T, Hq, Dk)")[0]
    g, lp = check_exact_rank(xp, "prefix_key", prefix_key, 4, "(G, Lp, Hkv, Dk)")[:2]
    for axis, what in ((2, "Hkv"), (3, "Dk")):
        check_same_axis("prefix_key", prefix_key, axis, "key_pages", key_pages, axis, what)
    if (value_pages is None) != (prefix_value is None):
        msg = (
            "`value_pages` and `prefix_value` must both be arrays or both None (K = V pools), "
            f"but got {type(value_pages).__name__} and {type(prefix_value).__name__}"
        )
        raise TypeError(msg)
    check_head_vector(xp, sinks, "sinks", int(query.shape[1]))
    check_mask_mod(mask_mod, signature="mask_mod(request, head, q_pos, kv_pos)")
    check_score_mod(score_mod)
    mask_mod = _on_positions(mask_mod)
    if prefix_value is None:
        prefix_value = prefix_key[..., : prefix_key.shape[-1] if value_dim is None else value_dim]
    else:
        check_exact_rank(xp, "prefix_value", prefix_value, 4, "(G, Lp, Hkv, Dv)")
        for axis, what in ((0, "G"), (1, "Lp"), (2, "Hkv")):
            check_same_axis(
                "prefix_value", prefix_value, axis, "prefix_key", prefix_key, axis, what
            )
        check_same_axis("prefix_value", prefix_value, 3, "value_pages", value_pages, 3, "Dv")
    r = int(page_table.shape[0])
    check_integer_array(xp, "group_starts", group_starts, 1, "(G + 1,)")
    if group_starts.shape[0] != g + 1:
        msg = (
            f"`group_starts` must have shape (G + 1,) = ({g + 1},) (G = {g}, axis 0 of "
            f"`prefix_key`), but got shape {tuple(group_starts.shape)}"
        )
        raise ValueError(msg)
    host = check_starts("group_starts", group_starts, r)
    if host is not None and int(host[-1]) != r:
        msg = (
            f"`group_starts` must end at R = {r} (axis 0 of `page_table`): every request in "
            f"a group, but got {host.tolist()}"
        )
        raise ValueError(msg)
    check_one_device(query=query, prefix_key=prefix_key, prefix_value=prefix_value,
                     group_starts=group_starts, key_pages=key_pages)  # fmt: skip

    def shifted(rule: Any) -> Any:  # the own part's positions, after the prefix
        if rule is None:
            return None
        return lambda *a: rule(*a[:-2], a[-2] + lp, a[-1] + lp)

    stats = {"return_lse": True, "return_max_logit": return_max_logit}
    own = ragged_paged_attention(
        query, key_pages, value_pages, page_table, kv_lengths, q_starts, is_causal=is_causal,
        window=window, softcap=softcap, scale=scale, alibi_slopes=alibi_slopes,
        mask_mod=shifted(mask_mod), score_mod=shifted(score_mod), plan=plan,
        value_dim=value_dim, **stats,
    )  # fmt: skip
    # the prefix part: one packed call, a group's rows seeing its prefix (segment ids)
    seg_r, index = _segments(xp, q_starts, t, -1)  # each row's request, its row in it
    request = xp.where(seg_r < 0, 0, seg_r)
    n_q = q_starts[1:] - q_starts[:-1]
    pos_q = lp + take_at(xp, xp.astype(kv_lengths, n_q.dtype) - n_q, request) + index
    group = _segments(xp, group_starts, r, -1)[0]  # (R,)
    seg_q = xp.where(seg_r < 0, -1, take_at(xp, group, request))
    shape = (g * lp, *prefix_key.shape[2:])
    keys = xp.reshape(prefix_key, shape)
    values = xp.reshape(prefix_value, (g * lp, *prefix_value.shape[2:]))
    at = device(group_starts)
    seg_k = xp.reshape(xp.broadcast_to(arange(xp, 0, g, at)[:, None], (g, lp)), (-1,))
    pos_k = xp.reshape(xp.broadcast_to(arange(xp, 0, lp, at)[None, :], (g, lp)), (-1,))
    # every prefix key comes before every row: only a window's left side can hide one
    left = None if window is None else check_window(window)[0]
    band = Band.of(False, (left, None))
    rules = _Rules(band, alibi_slopes, mask_mod, score_mod)
    options = rules.into(xp, (pos_q, pos_k, request), {**stats, "softcap": softcap})
    options.update(scale=scale, sinks=sinks)
    prefix = _varlen_call(xp, query, keys, values, seg_q, seg_k, options)
    out, lse = merge_attention([prefix[0], own[0]], [prefix[1], own[1]])
    results = [(out, True), (lse, return_lse)]
    if return_max_logit:
        results.append((xp.maximum(prefix[2], own[2]), True))
    return _results(*results)


def topk_indices(scores: Array, k: int, kv_lengths: Array | None = None) -> Array:
    """Return the positions of each row's `k` largest valid scores (a sparse layer's keys).

    What an indexer (DeepSeek V3.2's lightning indexer, NSA's selection) hands a sparse
    attention: for each query row and KV head, the keys it attends to. The array API has
    no top-k; this is a stable descending sort, on every backend.

    Parameters
    ----------
    scores : array, shape (T, Hkv, L)
        Each row's score of each key position (floating).
    k : int
        How many positions per row and head, ``k >= 0`` (may exceed ``L``).
    kv_lengths : integer array, shape (T,), optional
        Row ``t`` may select positions ``< kv_lengths[t]`` only (its request's keys);
        by default every position. A NaN score is never selected.

    Returns
    -------
    array, shape (T, Hkv, k)
        Positions in the default integer dtype, by descending score, ties to the lower
        position; ``-1`` past a row's valid positions when it has fewer than `k`.

    Raises
    ------
    TypeError
        `scores` not floating, `kv_lengths` not integers, `k` not an integer.
    ValueError
        `scores` not of rank 3, `kv_lengths` not of shape (T,), `k` negative.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn.serving import topk_indices
    >>> scores = np.array([[[0.1, 0.9, 0.5, 0.9]], [[3.0, 1.0, 2.0, 0.0]]])
    >>> topk_indices(scores, 3, kv_lengths=np.array([4, 2])).tolist()
    [[[1, 3, 2]], [[0, 1, -1]]]
    """
    xp = array_namespace(scores=scores, kv_lengths=kv_lengths)
    length = check_exact_rank(xp, "scores", scores, 3, "(T, Hkv, L)")[2]
    k = check_count("k", k, minimum=0)
    valid = xp.logical_not(xp.isnan(scores))
    if kv_lengths is not None:
        check_integer_array(xp, "kv_lengths", kv_lengths, 1, "(T,)")
        check_same_axis("scores", scores, 0, "kv_lengths", kv_lengths, 0, "T")
        check_one_device(scores=scores, kv_lengths=kv_lengths)
        positions = arange(xp, 0, length, device(scores))
        inside = positions[None, None, :] < xp.astype(kv_lengths, positions.dtype)[:, None, None]
        valid = xp.logical_and(valid, inside)
    keyed = xp.where(valid, scores, -xp.inf)
    order = xp.argsort(keyed, axis=-1, descending=True, stable=True)  # ties: lower first
    # the valid positions first, in that order (a valid -inf ties with the invalid ones)
    first = xp.argsort(
        xp.astype(xp.logical_not(_take_along(xp, valid, order)), xp.int8), axis=-1, stable=True
    )
    order = _take_along(xp, order, first)[..., : min(k, length)]
    if k > length:  # more than there are: -1 below
        shape = (*order.shape[:-1], k - length)
        fill = xp.full(shape, -1, dtype=order.dtype, **on_device(device(order)))
        order = xp.concat([order, fill], axis=-1)
    count = xp.sum(xp.astype(valid, order.dtype), axis=-1, keepdims=True)
    slots = arange(xp, 0, k, device(scores))
    return xp.where(xp.astype(slots, order.dtype)[None, None, :] < count, order, -1)


def _take_along(xp: Any, x: Any, indices: Any) -> Any:
    """``x`` gathered along its last axis at `indices` (same leading shape)."""
    if hasattr(xp, "take_along_axis"):
        return xp.take_along_axis(x, indices, axis=-1)
    flat = xp.reshape(x, (-1,))
    rows = xp.reshape(arange(xp, 0, math.prod(x.shape[:-1]), device(x)), (*x.shape[:-1], 1))
    where = rows * x.shape[-1] + xp.astype(indices, rows.dtype)
    return xp.reshape(xp.take(flat, xp.reshape(where, (-1,))), indices.shape)


@dataclass(frozen=True)
class _Rules:
    """What a packed call (segment ids on both axes) computes from each entry's positions.

    The band, ALiBi and the caller's rules, which see a row's request and positions.
    """

    band: Band
    alibi_slopes: Any
    mask_mod: Any
    score_mod: Any

    def into(self, xp: Any, positions: tuple[Any, Any, Any], options: dict[str, Any]) -> Any:
        """`options` with the engine's ``mask_mod`` and ``score_mod`` of these rules.

        `positions`: each row's position and each key's (among its request's keys), and
        each row's request, (T,), (S,) and (T,), read by the rules' index arrays.
        """
        pos_q, pos_k, request = positions
        mask_mod, score_mod, band, slopes = (
            self.mask_mod,
            self.score_mod,
            self.band,
            self.alibi_slopes,
        )

        def masked(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            qp, kp = take_at(xp, pos_q, qi), take_at(xp, pos_k, ki)
            ok = None if mask_mod is None else mask_mod(take_at(xp, request, qi), h, qp, kp)
            if band.restricts:
                inside = band.between(qp, kp)
                ok = inside if ok is None else xp.logical_and(ok, inside)
            return ok

        def scored(scores: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
            qp, kp = take_at(xp, pos_q, qi), take_at(xp, pos_k, ki)
            if score_mod is not None:
                scores = score_mod(scores, take_at(xp, request, qi), h, qp, kp)
            if slopes is not None:
                slope = xp.reshape(xp.astype(slopes, scores.dtype), (-1, 1, 1))
                scores = scores - slope * distance(xp, qp, kp, scores.dtype)  # (Hq, bq, bk)
            return scores

        return {
            **options,
            "mask_mod": masked if band.restricts or mask_mod is not None else None,
            "score_mod": scored if slopes is not None or score_mod is not None else None,
        }


def _on_positions(mask_mod: Any) -> Any:
    """Return `mask_mod`, a ready rule (``block_mask``'s) seeing a request's positions.

    The batched calls give their rules positions already aligned (a row's is
    bottom-right), so a rule aligned by the call (``offset=None``) takes offset 0.
    """
    if isinstance(mask_mod, MaskRule) and mask_mod.needs_alignment:
        return mask_mod.aligned(0, 0)
    return mask_mod


def _one_slot_pages(
    xp: Any, key: Any, value: Any, q_starts: Any, kv_starts: Any
) -> tuple[Any, ...]:
    """Packed keys as a paged call's pool of one-slot pages: pools, table, lengths, starts.

    Request ``r``'s page ``j`` is key ``kv_starts[r] + j``; the table is as wide as the
    longest request (read where that is free; else ``S``).
    """
    s, hkv = key.shape[0], key.shape[1]
    lengths = kv_starts[1:] - kv_starts[:-1]
    width = s
    if has_concrete_values(kv_starts) and has_concrete_values(q_starts):
        m, n = np.diff(to_host(kv_starts)), np.diff(to_host(q_starts))
        short = np.nonzero(m < n)[0]
        if short.size:
            r = int(short[0])
            msg = (
                f"varlen_attention(batch_invariant=True): request {r} has {int(n[r])} query "
                f"rows (q_starts) but {int(m[r])} keys (kv_starts); each request needs at "
                "least as many keys as rows"
            )
            raise ValueError(msg)
        width = max(int(m.max(initial=0)), 1)
    slot = xp.astype(arange(xp, 0, width, device(key)), kv_starts.dtype)
    table = xp.clip(kv_starts[:-1, None] + slot[None, :], 0, s - 1)  # (R, width)
    pools = (xp.reshape(key, (s, 1, hkv, -1)), xp.reshape(value, (s, 1, hkv, -1)))
    return (*pools, table, lengths, q_starts)


def _packed_alignment(q_starts: Any, kv_starts: Any, t: int, s: int) -> bool:
    """Whether every request's rows sit on its keys as the packed call's rows on its keys.

    Row ``t`` of request ``r`` sees its key ``s`` where ``s - kv_starts[r+1]`` is at most
    ``t - q_starts[r+1]`` (bottom-right in the request), and the packed call's row
    ``t`` where ``s - S`` is at most ``t - T``: the same band, window and ALiBi
    distances when ``kv_starts[r+1] - q_starts[r+1] == S - T`` for every request (the
    same starts, T = S: packed training). Known from the arrays themselves (the same
    array given twice) or from their values where they are read for free.
    """
    if q_starts is kv_starts:
        return t == s
    if not (reads_host_values(q_starts) and reads_host_values(kv_starts)):
        return False
    shift = to_host(kv_starts)[1:] - to_host(q_starts)[1:]
    return bool((shift == s - t).all())


def _varlen_call(
    xp: Any, query: Any, key: Any, value: Any, seg_q: Any, seg_k: Any, options: dict[str, Any]
) -> Any:
    """Return varlen attention: one engine call on the packed axis, its segments the requests."""
    result = scaled_dot_product_attention(
        xp.permute_dims(query, (1, 0, 2)),
        xp.permute_dims(key, (1, 0, 2)),
        xp.permute_dims(value, (1, 0, 2)),
        q_segment_ids=seg_q,
        kv_segment_ids=seg_k,
        **options,
    )
    if not isinstance(result, tuple):
        return xp.permute_dims(result, (1, 0, 2))
    out, *stats = result
    padding = seg_q[:, None] < 0  # (T, 1): lse and max -inf
    stats = [xp.where(padding, -xp.inf, xp.permute_dims(x, (1, 0))) for x in stats]
    return (xp.permute_dims(out, (1, 0, 2)), *stats)


# ---------------------------------------------------------------------------
# helpers


def _segments(xp: Any, starts: Any, length: int, pad_id: int) -> tuple[Any, Any]:
    """Segment id (`pad_id` past the last request) and position within it, (length,) each."""
    seg, inside, idx = _paged.owners(xp, starts[1:], length, device(starts))
    pos = idx - xp.take(starts, seg)
    return xp.where(inside, seg, pad_id), xp.where(inside, pos, 0)


class _Slots(NamedTuple):
    """Where the write puts each new row.

    Physical page and slot (T,), whether it is written (T,), and ``q_starts[R]``, the
    rows to write: an int read when the slots were planned, else the 1-element array
    an item writer reads when it writes (torch's tracers, which give it a value then).
    """

    page: Any
    slot: Any
    valid: Any
    rows: Any


def _write_slots(
    xp: Any, page_table: Any, kv_lengths: Any, q_starts: Any, t: int, n_pages: int, page_size: int
) -> _Slots | None:
    """Return the new rows' slots, or None when no row is written.

    Padding rows are not written, nor the rows of a request whose metadata is wrong
    (traced metadata, which the eager checks could not refuse: never another page).
    """
    if t == 0 or page_table.shape[0] == 0:  # no row, or every row padding
        return None
    req, inside, idx = _paged.owners(xp, q_starts[1:], t, device(q_starts))
    faulty = _paged.faulty_rows(
        xp, q_starts, kv_lengths, page_table, t, n_pages, page_size, device(q_starts)
    )
    valid = xp.logical_and(inside, xp.logical_not(faulty))
    n_r = xp.take(q_starts, req + 1) - xp.take(q_starts, req)
    pos = xp.take(kv_lengths, req) - n_r + (idx - xp.take(q_starts, req))
    pos = xp.where(valid, pos, 0)
    max_pages = page_table.shape[1]
    logical = xp.clip(xp.floor_divide(pos, page_size), 0, max_pages - 1)
    page = xp.take(xp.reshape(page_table, (-1,)), req * max_pages + logical)
    rows = int(to_host(q_starts[-1:])[0]) if has_concrete_values(q_starts) else q_starts[-1:]
    return _Slots(xp.astype(page, q_starts.dtype), pos % page_size, valid, rows)


#: the pools to write, by argument name: ``name -> (pool, new rows in its dtype)``
_Named = dict[str, tuple[Any, Any]]


def _write_items(xp: Any, named: _Named, slots: _Slots) -> list[Any]:
    """NumPy, torch, CuPy: item assignment into the given pools (padding rows left out)."""
    for name, (pool, _) in named.items():
        if getattr(getattr(pool, "flags", None), "writeable", True) is False:
            msg = f"`{name}` is a read-only NumPy array: paged_kv_write writes into the pools"
            raise ValueError(msg)
    n = slots.rows if isinstance(slots.rows, int) else int(to_host(slots.rows)[0])
    for pool, x in named.values():
        pool[slots.page[:n], slots.slot[:n]] = x[:n]
    return [pool for pool, _ in named.values()]


def _write_at(xp: Any, named: _Named, slots: _Slots) -> list[Any]:
    """JAX: ``.at[page, slot].set``, padding rows sent out of bounds and dropped."""
    out = []
    for pool, x in named.values():
        page = xp.where(slots.valid, slots.page, pool.shape[0])
        out.append(pool.at[page, slots.slot].set(x, mode="drop"))
    return out


def _write_arrays(xp: Any, named: _Named, slots: _Slots) -> list[Any]:
    """Any array-API library: new pools, each slot taking the row written to it (O(slots · T))."""
    out = []
    for pool, x in named.values():
        n_pages, page_size = pool.shape[:2]
        flat = xp.reshape(pool, (n_pages * page_size, *pool.shape[2:]))
        target = xp.where(slots.valid, slots.page * page_size + slots.slot, -1)  # (T,)
        at = xp.astype(xp.arange(n_pages * page_size, **on_device(device(pool))), target.dtype)
        hits = at[:, None] == target[None, :]  # (slots, T)
        row = xp.argmax(xp.astype(hits, xp.int32), axis=1)
        written = xp.reshape(xp.any(hits, axis=1), (-1, *(1,) * (flat.ndim - 1)))
        flat = xp.where(written, xp.take(x, row, axis=0), flat)
        out.append(xp.reshape(flat, pool.shape))
    return out


#: how a library writes rows into its pools: the ``writes`` column of its router row
_WRITERS = {"items": _write_items, "at": _write_at, "arrays": _write_arrays}


def _namespace(
    *arrays: Any,
    names: tuple[str, ...] = (
        "query",
        "key_pages",
        "value_pages",
        "page_table",
        "kv_lengths",
        "q_starts",
        "q_positions",
        "sinks",
        "alibi_slopes",
        "kv_indices",
        "key_scales",
        "value_scales",
        "key_zero_points",
        "value_zero_points",
    ),
) -> Any:
    named = dict(zip(names, arrays, strict=True))
    for name, x in named.items():
        if x is not None and library(x).task_graphs:
            msg = (
                f"`{name}` is a Dask array: paged and packed serving calls take arrays of "
                "one device (NumPy, torch, JAX, CuPy); call `.compute()` first"
            )
            raise TypeError(msg)
    return array_namespace(**named)

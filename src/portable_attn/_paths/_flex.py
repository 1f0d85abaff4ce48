"""torch's ``flex_attention`` as a native kernel: a whole call in one fused kernel.

The calls SDPA cannot express (a ``mask_mod`` or block mask, a ``score_mod``, softcap,
ALiBi, sinks, the row statistics) go here on torch CUDA (the router's ``FLEX_CUDA``).
Each term of the call becomes part of flex's two functions, written with the same
index arithmetic as the portable path (``_lib/_scores.py``, ``_lib/_masks.py``), on
the scalar indices flex gives them:

- ``score_mod(score, b, h, q_idx, kv_idx)``: ``softcap``, then the user's
  ``score_mod``, then ``bias``, then ALiBi's ``- slope · |i' - j|``, the portable
  order (:func:`~._lib._scores.scores_block`);
- ``mask_mod(b, h, q_idx, kv_idx)``: the boolean mask, the bottom-right causal /
  window band, lengths, segment ids and the user's ``mask_mod``, AND-ed;
- the ``BlockMask`` comes from the block states the router already has
  (:func:`~._lib._blocks.host_pair_states` at flex's block size): blocks they hide
  are not visited, blocks they show in full skip the ``mask_mod``; the rule is not
  evaluated again on the L² points;
- the lse and the row max are flex's auxiliary outputs; sinks are exact from the lse:
  ``out · exp(lse - logaddexp(lse, sink))`` and ``lse' = logaddexp(lse, sink)``.

A row that sees no key is zeros with an lse of ``-inf`` (flex's own handling).
Flex's index ``b`` is the flat batch index, as the portable ``score_mod`` and
``mask_mod`` receive it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._lib._blocks import FULL, SKIP, block_ranges, host_pair_states
from .._lib._call import AttentionCall
from .._lib._compat import has_concrete_values
from .._lib._masks import at_rank
from .._lib._path import Native
from .._lib._route import DEFAULT_MASK_BLOCK
from .._lib._scores import distance, logits_rank, query_offset, without_hidden_keys
from .._lib._validation import array_or_none

__all__ = ["failed", "flex_attention", "traces", "values_finite"]


def flex_attention(call: AttentionCall, path: Native, *, with_stats: bool) -> tuple[Any, Any]:
    """Compute `call` with torch's ``flex_attention``.

    Returns
    -------
    out : tensor, shape (*batch, Hq, Lq, Dv)
        In the dtype of `call`'s Q (the half input dtype where the route keeps it).
    stats : tensor, shape (*batch, Hq, Lq, w), or None
        With `with_stats`: the row lse (``w = 1``), and the row max after it with
        ``plan.row_max`` (``w = 2``), in float32 or the compute dtype.
    """
    from torch.nn.attention.flex_attention import AuxRequest

    xp, plan, terms = call.xp, call.plan, call.terms
    n = math.prod(plan.batch)
    whole_k = (0, plan.kv_len)  # keys past the lengths: zero, whatever they hold
    k = without_hidden_keys(xp, call.key, terms, plan, whole_k)
    v = without_hidden_keys(xp, call.value, terms, plan, whole_k)
    # flex takes one batch size for Q, K and V: broadcast batch axes are expanded
    q, k, v = (_batched(xp, x, plan) for x in (call.query, k, v))
    scale = plan.scale
    if array_or_none(scale) is not None:  # learned: flex takes a float scale
        q, scale = q * xp.astype(scale, q.dtype), 1.0
    sinks = terms.sinks
    stats = with_stats or sinks is not None
    aux = AuxRequest(lse=True, max_scores=plan.row_max) if stats else None
    kernel = _compiled_flex() if path.compiled else _eager_flex()
    result = kernel(
        q,
        k,
        v,
        score_mod=_score_mod(call),
        block_mask=_block_mask(call, _mask_mod(call), n),
        scale=float(scale),
        enable_gqa=plan.num_q_heads != plan.num_kv_heads,
        return_aux=aux,
    )
    out, aux_out = result if aux is not None else (result, None)
    batch = tuple(plan.batch)
    out = xp.reshape(out, (*batch, *out.shape[1:]))
    if aux_out is None:
        return out, None
    lse = xp.reshape(aux_out.lse, (*batch, plan.num_q_heads, plan.q_len, 1))
    if sinks is not None:  # one more logit in every row's denominator, with no value
        sink = xp.astype(at_rank(xp, sinks, lse.ndim), lse.dtype)
        total = xp.logaddexp(lse, sink)
        seen = total > -xp.inf  # a row of no key and a sink of -inf: zeros, not 0 · NaN
        kept = xp.where(seen, xp.exp(xp.where(seen, lse - total, 0.0)), 0.0)
        out = out * xp.astype(kept, out.dtype)
        lse = total
    if not with_stats:
        return out, None
    if plan.row_max:
        row_max = xp.reshape(aux_out.max_scores, lse.shape)
        lse = xp.concat([lse, xp.astype(row_max, lse.dtype)], axis=-1)
    return out, lse


def _eager_flex() -> Callable[..., Any]:
    from torch.nn.attention import flex_attention as flex

    return flex.flex_attention


_COMPILED: list[Callable[..., Any]] = []


def _compiled_flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, made once: dynamo keeps one program per signature."""
    if not _COMPILED:
        import torch

        _COMPILED.append(torch.compile(_eager_flex()))
    return _COMPILED[0]


def _batched(xp: Any, x: Any, plan: Any) -> Any:
    """Q, K or V as (N, H, L, D): its batch axes broadcast to the call's, as one."""
    x = at_rank(xp, x, len(plan.batch) + 3)
    shape = (*plan.batch, *x.shape[-3:])
    if tuple(x.shape) != shape:
        x = xp.broadcast_to(x, shape)
    return xp.reshape(x, (math.prod(plan.batch), *shape[-3:]))


def values_finite(call: AttentionCall) -> bool:
    """Whether every value of `call` is finite, read on the device (one flag).

    With segment ids flex's ``P @ V`` weighs another document's NaN or inf by 0, which
    is NaN: a call whose values are not (or cannot be read: under a tracer) takes its
    portable route. The read waits for the values: the one host synchronisation of a
    flex call, and only with segment ids.
    """
    value = call.value
    if not has_concrete_values(value):
        return False
    return bool(call.xp.all(call.xp.isfinite(value)))


_UNTRACEABLE: weakref.WeakSet[Any] = weakref.WeakSet()


def traces(call: AttentionCall) -> bool:
    """Whether flex may trace the caller's functions of `call` (none failed it before)."""
    return not any(f in _UNTRACEABLE for f in _functions(call))


def failed(call: AttentionCall) -> None:
    """Remember that flex could not run the caller's functions of `call`."""
    for f in _functions(call):
        # a function not weakly referable (a bound method) is tried again next time
        with contextlib.suppress(TypeError):
            _UNTRACEABLE.add(f)


def _functions(call: AttentionCall) -> list[Any]:
    terms = call.terms
    mask_mod = getattr(terms.mask_mod, "original", terms.mask_mod)
    return [f for f in (terms.score_mod, mask_mod) if f is not None]


def _flat(xp: Any, x: Any, plan: Any, tail: int) -> Any:
    """`x` at the logits' rank with its batch axes as one, ``(N | 1, *x.shape[-tail:])``.

    Batch axes all of size 1 stay one axis of size 1 (no copy).
    """
    x = at_rank(xp, x, len(plan.batch) + tail)
    lead, rest = tuple(x.shape[:-tail]), tuple(x.shape[-tail:])
    if all(d == 1 for d in lead):
        return xp.reshape(x, (1, *rest))
    x = xp.broadcast_to(x, (*plan.batch, *rest))
    return xp.reshape(x, (math.prod(plan.batch), *rest))


def _at(x: Any, *index: Any) -> Any:
    """`x` at `index`, an axis of size 1 at 0 (broadcast, as the portable terms are)."""
    return x[tuple(i if size > 1 else 0 for i, size in zip(index, x.shape, strict=True))]


def _score_mod(call: AttentionCall) -> Callable[..., Any] | None:
    """Flex's ``score_mod``: softcap, the user's ``score_mod``, bias and ALiBi, or None."""
    xp, plan, terms = call.xp, call.plan, call.terms
    cap = plan.softcap
    user = terms.score_mod
    rank = logits_rank(plan)
    bias = None if call.bias is None else _flat(xp, at_rank(xp, call.bias, rank), plan, 3)
    slopes = None
    if terms.alibi_slopes is not None:  # (..., Hq, 1, 1) -> (N | 1, Hq | 1)
        slopes = _flat(xp, at_rank(xp, terms.alibi_slopes, rank), plan, 3)[..., 0, 0]
    offset = _offset(call) if slopes is not None else None
    q0, k0 = _starts(call)
    if cap is None and user is None and bias is None and slopes is None:
        return None

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if cap is not None:
            score = cap * xp.tanh(score / cap)
        if user is not None:
            result = user(score, b, h, q_idx + q0, kv_idx + k0)  # absolute positions
            score = xp.astype(result, score.dtype)
        if bias is not None:
            score = score + _at(bias, b, h, q_idx, kv_idx)
        if slopes is not None:
            far = distance(xp, q_idx + _at(offset, b), kv_idx, score.dtype)
            score = score - _at(slopes, b, h) * far
        return score

    return score_mod


def _offset(call: AttentionCall) -> Any:
    """``i' - i`` per flat sequence, (N | 1,) (an int becomes a one-element tensor)."""
    xp, plan, terms = call.xp, call.plan, call.terms
    offset = query_offset(plan, terms)
    if not hasattr(offset, "ndim"):
        return xp.asarray([offset], **_on(plan))
    return _flat(xp, offset, plan, 3)[:, 0, 0, 0]


def _starts(call: AttentionCall) -> tuple[int, int]:
    """Where this call's first query and key sit in the whole call (a part: its starts)."""
    align = call.plan.align
    return (0, 0) if align is None else (align.q_start, align.kv_start)


def _on(plan: Any) -> dict[str, Any]:
    return {} if plan.device is None else {"device": plan.device}


def _mask_mod(call: AttentionCall) -> Callable[..., Any] | None:
    """Flex's ``mask_mod``: mask, band, lengths, segment ids and the user's rule, or None."""
    xp, plan, terms = call.xp, call.plan, call.terms
    rank = logits_rank(plan)
    mask = None if terms.mask is None else _flat(xp, at_rank(xp, terms.mask, rank), plan, 3)
    band = plan.band
    offset = _offset(call) if band.restricts else None
    kv_lengths = None if terms.kv_lengths is None else _flat(xp, terms.kv_lengths, plan, 3)
    q_lengths = None if terms.q_lengths is None else _flat(xp, terms.q_lengths, plan, 3)
    q_seg = kv_seg = None
    if terms.q_segments is not None:
        q_seg = _flat(xp, terms.q_segments, plan, 3)[:, 0, :, 0]  # (N | 1, Lq)
        kv_seg = _flat(xp, terms.kv_segments, plan, 3)[:, 0, 0, :]  # (N | 1, Lk)
    # the rule as the caller wrote it, without the portable path's shape check of blocks
    user = getattr(terms.mask_mod, "rule", terms.mask_mod)
    q0, k0 = _starts(call)
    if all(x is None for x in (mask, offset, kv_lengths, q_lengths, q_seg, user)):
        return None

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = q_idx >= 0  # True, as a tensor flex can combine
        if mask is not None:
            allowed = allowed & _at(mask, b, h, q_idx, kv_idx)
        if offset is not None:
            allowed = allowed & band.between(q_idx + _at(offset, b), kv_idx)
        if kv_lengths is not None:
            allowed = allowed & (kv_idx < _at(kv_lengths, b, 0, 0, 0))
        if q_lengths is not None:
            allowed = allowed & (q_idx < _at(q_lengths, b, 0, 0, 0))
        if q_seg is not None:
            allowed = allowed & (_at(q_seg, b, q_idx) == _at(kv_seg, b, kv_idx))
        if user is not None:
            allowed = allowed & user(b, h, q_idx + q0, kv_idx + k0)  # absolute positions
        return allowed

    return mask_mod


def _block_mask(call: AttentionCall, mask_mod: Callable[..., Any] | None, n: int) -> Any:
    """Flex's ``BlockMask`` from the call's block states at flex's block size, or None.

    The states the router reads (:func:`~._lib._blocks.host_pair_states`: the band,
    host lengths and segment ids, a block mask's or a ready rule's states) decide
    which blocks flex visits, and which it visits without the ``mask_mod`` (shown in
    full; never with a boolean mask array, which the states do not read). A
    ``mask_mod`` given alone gets its states built by the engine, in bounded tiles,
    read on the host (a host synchronisation on a GPU; a ``block_mask`` or a ready
    rule brings its states without one).
    """
    if mask_mod is None:
        return None
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    plan = call.plan
    block = DEFAULT_MASK_BLOCK
    q_tiles, k_tiles = block_ranges(plan.q_len, block), block_ranges(plan.kv_len, block)
    states = np.asarray(host_pair_states(call, q_tiles, k_tiles), dtype=np.int8)
    if call.terms.mask is not None:
        states = np.minimum(states, 1)  # no block is shown in full by the states alone

    def blocks(which: Any) -> tuple[Any, Any]:
        count = which.sum(axis=1).astype(np.int32)[None, None]  # (1, 1, nq)
        order = np.argsort(~which, axis=1, kind="stable").astype(np.int32)[None, None]
        # to the device without waiting for the copy (no host synchronisation)
        on = {"device": plan.device, "non_blocking": True}
        return torch.from_numpy(count).to(**on), torch.from_numpy(order).to(**on)

    partial = (states != SKIP) & (states != FULL)
    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(states == FULL)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(plan.q_len, plan.kv_len),
    )

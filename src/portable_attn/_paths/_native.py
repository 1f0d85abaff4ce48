"""Routing to the frameworks' own fused kernels, where they agree with our contract.

This is the one module that calls framework-specific attention:
``torch.nn.functional.scaled_dot_product_attention`` and
``jax.nn.dot_product_attention``. What is routed there is exactly what the
portable path computes: every mask (user mask, bottom-right causal, window,
lengths) is folded into one boolean "allowed" array built by the portable
index arithmetic, and rows that see no key are given a harmless all-visible
mask for the kernel and zeroed afterwards (the kernels would otherwise return
NaN or uniform rows there), so their gradients are zero too, except where the
kernel returns zeros with zero gradients there itself
(``Native.guard``, from the router's ``Kernel.zeroes_empty_rows``: torch CPU).

What each kernel can express, and *when* a call is routed here, is decided by the
router (:func:`portable_attn._lib._route.route`, ``Native``): which kernel, whether
half inputs are upcast, whether the kernel runs per query tile, whether rows without
keys need the guard, and how few keys an unmasked call may have. torch SDPA and
``jax.nn.dot_product_attention`` (which needs Dv == Dk, and whose softmax is
float32 even for float64) take masks, bias, lengths, windows and GQA; softcap,
``score_mod``, ALiBi and dropout are not expressible.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from .._lib._blocks import FULL, block_ranges, host_pair_states
from .._lib._call import AttentionCall
from .._lib._compat import forward_mode, to_host, torch_func_transforms
from .._lib._dense import dense_attention
from .._lib._fields import axis_of, field
from .._lib._masks import at_rank
from .._lib._path import Native, Tiled
from .._lib._scores import (
    AttentionPlan,
    ScoreTerms,
    allowed_block,
    hidden_by_value,
    if_finite,
    logits_rank,
    rows_may_be_empty,
    without_hidden_keys,
)
from .._lib._validation import array_or_none
from ._partial import cut_call

__all__ = ["DirectKernel", "direct_kernel", "native_attention", "native_tiles"]


def _visible_rows(xp: Any, allowed: Any | None, bias: Any | None) -> Any:
    """Rows that see at least one key with a finite score, at the smallest deciding shape.

    The ``any`` runs over `allowed` (and the finite entries of `bias`) as they
    are, never broadcast to (B..., Hq, Lq, Lk): a padding mask (B, 1, 1, Lk)
    gives (B, 1, 1, 1).
    """
    if allowed is None and bias is None:
        return None
    ok = allowed
    if bias is not None:
        finite = bias > -xp.inf
        ok = finite if ok is None else xp.logical_and(ok, finite)
    return xp.any(ok, axis=-1, keepdims=True)  # (..., Lq|1, 1)


def _kernel_form(call: AttentionCall) -> tuple[bool, bool]:
    """Return the kernel's causal flag and whether the band's mask is built for it.

    The kernels' own causal flags are top-left aligned: ours is passed as a mask,
    except with ``Lq == Lk``, where both alignments agree and the fused causal kernel
    can be used (it takes no mask beside it). A band that hides nothing of the call,
    and a decoding step (one query, causal, `kv_lengths` alone: ``j <= kv_len - 1`` is
    what the padding says), need no band mask either.
    """
    terms, plan = call.terms, call.plan
    plain = not hidden_by_value(call.bias, terms)
    # square, and aligned at the diagonal (a part placed elsewhere is not)
    square = plan.q_len == plan.kv_len and plan.offset == 0
    kernel_causal = plan.is_causal and plan.window is None and square and plain
    band = plan.band
    hides_nothing = not plan.has_lengths and (
        band.visibility((0, plan.q_len), (0, plan.kv_len), plan.offset) == "full"
    )
    decoding = (
        plan.q_len == 1
        and plan.is_causal
        and plan.window is None
        and terms.q_lengths is None
        and plan.align is None  # a whole call: its one query is aligned at kv_len - 1
    )
    return kernel_causal, not (kernel_causal or hides_nothing or decoding)


@dataclasses.dataclass(frozen=True)
class _KernelArgs:
    """What one kernel call takes: :func:`native_attention`'s decisions for a call."""

    query: Any
    key: Any
    value: Any
    allowed: Any  # bool, broadcastable to (..., Hq, Lq, Lk), or None
    bias: Any
    causal: bool
    plan: AttentionPlan
    visible: Any  # rows that see a key (..., Lq|1, 1): the others are zeroed; None: no guard


def _may_have_fewer(keys: Any, count: int) -> bool:
    """Whether a call may have fewer than `count` keys.

    A symbolic length (``torch.export`` with a dynamic dimension) may, unless its range
    says otherwise, and no guard is put on its value: one exported program is then right
    for every length of its range.
    """
    if isinstance(keys, int):
        return keys < count
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(keys >= count)


def _kernel_args(call: AttentionCall, path: Native) -> _KernelArgs:
    """Every mask folded into one "allowed" array in its own broadcast shape, and the guard.

    A padding mask or `kv_lengths` stays (B, 1, 1, Lk), causal structure is (Lq, Lk),
    structure that hides nothing is no mask at all. Rows that may see no key get a
    harmless mask and are zeroed after the kernel, unless the kernel zeroes them itself
    (``path.guard`` False). A call over fewer than ``path.min_keys`` keys gets a mask
    (the unmasked kernel drops a query's NaN there).
    """
    xp, q, k, v = call.xp, call.query, call.key, call.value
    terms, plan = call.terms, call.plan
    bias = at_rank(xp, call.bias, logits_rank(plan))  # as `allowed` (jax_numpy_rank_promotion)
    whole_k = (0, plan.kv_len)  # keys past the lengths: zero, whatever they hold
    k = without_hidden_keys(xp, k, terms, plan, whole_k)
    v = without_hidden_keys(xp, v, terms, plan, whole_k)
    kernel_causal, structural = _kernel_form(call)
    short = _may_have_fewer(plan.kv_len, path.min_keys)  # unmasked, it drops a query's NaN
    if short and kernel_causal:
        kernel_causal, structural = False, True
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    masked = plan if structural else dataclasses.replace(plan, is_causal=False, window=None)
    allowed = allowed_block(xp, terms, masked, whole_q, whole_k)
    visible = None
    if path.guard and rows_may_be_empty(bias, terms, plan):
        visible = _visible_rows(xp, allowed, bias)
    if visible is not None:  # give empty rows something finite to chew on, zero them later
        if allowed is not None:
            allowed = xp.logical_or(allowed, xp.logical_not(visible))
        if bias is not None:
            bias = xp.where(visible, bias, 0.0)
    if short and allowed is None and bias is None:
        allowed = xp.ones((1, 1), dtype=xp.bool, **_on(plan))  # keeps a query's NaN
    if array_or_none(plan.scale) is not None:  # learned: the kernels take a float scale
        q = q * plan.scale  # so gradients reach it through this product
        plan = dataclasses.replace(plan, scale=1.0)
    return _KernelArgs(q, k, v, allowed, bias, kernel_causal, plan, visible)


def _sequence(call: AttentionCall, b: int, n: int) -> AttentionCall:
    """Sequence `b` of a call of one batch axis, its first `n` keys only.

    A sequence without keys (``n == 0``) keeps one key, hidden by its length of 0:
    its rows see no key, so the kernel (or the guard) gives them zeros, and zero
    gradients, as every path does.
    """
    kept = max(1, n)  # a kernel call needs a key
    arrays, skeleton = call.flatten()
    parts = {}
    for name, x in arrays.items():
        lead = x.ndim - len(field(name).axes)  # its batch axes: one, or none (broadcast)
        x = x[b : b + 1, ...] if lead > 0 and x.shape[0] > 1 else x
        d = axis_of(name, x, "lk")
        parts[name] = x if d is None else x[(slice(None),) * d + (slice(0, kept), ...)]
    part = skeleton.unflatten(parts, batch=(1,), kv_len=kept)
    # the length itself, not the key kept: 0 hides that key (masks, guard, zeroed K and V)
    terms = dataclasses.replace(part.terms, kv_length_values=frozenset({n}))
    return dataclasses.replace(part, terms=terms)


def _on(plan: AttentionPlan) -> dict[str, Any]:
    return {} if plan.device is None else {"device": plan.device}


def native_attention(call: AttentionCall, path: Native) -> Any:
    """Attention by the framework kernel: (*batch, Hq, Lq, Dv) in the dtype of `call`'s Q.

    That is the compute dtype, or the half-precision input dtype itself where the
    route keeps it (the kernel then accumulates in float32 itself). The kernels
    return no log-sum-exp (the router never sends ``return_lse`` here).
    """
    if path.per_sequence:  # one call per sequence, over its own keys
        whole = dataclasses.replace(path, per_sequence=False)
        lengths = np.asarray(to_host(call.terms.kv_lengths)).reshape(-1).tolist()
        outs = [native_attention(_sequence(call, b, n), whole) for b, n in enumerate(lengths)]
        return call.xp.concat(outs, axis=0)
    if call.terms.q_segments is not None:  # keys hidden from some rows only
        # the kernel's P @ V weighs another document's NaN or inf by 0 (NaN): where
        # a value is not finite (or cannot be read free), the portable dense path,
        # whose product keeps documents apart (``_scores.visible_product``)
        def exact() -> Any:
            out = dense_attention(call.in_compute_dtype())
            return call.xp.astype(out, call.query.dtype)

        return if_finite(call.xp, call.value, lambda: _kernel(call, path), exact)
    return _kernel(call, path)


def _kernel(call: AttentionCall, path: Native) -> Any:
    a = _kernel_args(call, path)
    args = (call.xp, a.query, a.key, a.value, a.allowed, a.bias, a.plan, a.causal)
    out = _torch(*args) if path.kernel == "sdpa" else _jax(*args, path.implementation)
    return out if a.visible is None else call.xp.where(a.visible, out, 0.0)


@dataclasses.dataclass(frozen=True)
class DirectKernel:
    """SDPA called with a call's own Q, K, V and mask, as :func:`native_attention` decided.

    Kept by the cache (``_lib/_cache.py``) for a call signature whose arrays go to the
    kernel as they are (:func:`direct_kernel`), so that a repeated call is the kernel
    call alone.
    """

    is_causal: bool
    scale: float
    enable_gqa: bool
    #: the result's dtype, the inputs' (the route's ``finish``): under ``torch.autocast``
    #: SDPA returns the autocast dtype
    dtype: Any

    def __call__(self, query: Any, key: Any, value: Any, mask: Any) -> Any:
        """Return ``F.scaled_dot_product_attention`` of the arrays, as the route calls it."""
        out = sdpa(query, key, value, mask, self.is_causal, self.scale, self.enable_gqa)
        return out if out.dtype == self.dtype else out.to(self.dtype)


def sdpa(
    query: Any, key: Any, value: Any, mask: Any, is_causal: bool, scale: float, enable_gqa: bool
) -> Any:
    """``F.scaled_dot_product_attention`` of (*batch, H, L, D) arrays, given to it at rank 4.

    torch's fused CPU kernel takes (B, H, L, D) arrays and a mask of rank 2 or 4 only:
    otherwise SDPA computes by its unfused math, which took 2.1x the time at rank 3
    and 3.2x at rank 5 (benchmarks/results/ranks.json); the GPU's flash and
    memory-efficient kernels take rank 4 only too. So the batch axes become one (none:
    a batch of 1), the mask gets rank 4 (broadcast over batch axes of its own), and the
    result its batch axes back.
    Not under ``torch.func``'s transforms or forward-mode AD: the fused CPU kernel has no
    batching rule (``vmap`` loops over the examples, with a warning) and no forward-mode
    rule (an error), the math backend has both (asked for by name in forward mode: the
    fused kernel takes rank 4 there too). `query`, `key` and `value` have the same batch
    shape.
    """
    import torch
    import torch.nn.functional as F

    def kernel(query: Any, key: Any, value: Any, mask: Any) -> Any:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip

    if forward_mode([query]):  # only the math backend has a forward-mode rule, at any rank
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return kernel(query, key, value, mask)
    # dynamo cannot trace functorch's queries, and a compiled graph takes rank 4
    if not torch.compiler.is_compiling() and torch_func_transforms(query):
        return kernel(query, key, value, mask)
    batch = tuple(query.shape[:-3])
    n = math.prod(batch)
    if len(batch) != 1:
        query, key, value = (x.reshape(n, *x.shape[-3:]) for x in (query, key, value))
    if mask is not None and mask.ndim != 2:  # rank 4: leading ones, batch axes merged
        mask = mask.reshape((1,) * (max(len(batch), 1) + 3 - mask.ndim) + tuple(mask.shape))
        if len(batch) > 1:
            mask = mask.expand(*batch, *mask.shape[-3:]).reshape(n, *mask.shape[-3:])
    out = kernel(query, key, value, mask)
    if out.grad_fn is not None and type(out.grad_fn).__name__ in ONCE_DIFFERENTIABLE:
        out.grad_fn.register_hook(_second_order(query, key, value, mask, is_causal, scale))
    return out if len(batch) == 1 else out.reshape(*batch, *out.shape[-3:])


#: torch's nodes of SDPA's fused kernels, whose backward has no derivative of its own
ONCE_DIFFERENTIABLE = frozenset(
    {
        "ScaledDotProductFlashAttentionForCpuBackward0",
        "ScaledDotProductFlashAttentionBackward0",
        "ScaledDotProductEfficientAttentionBackward0",
        "ScaledDotProductCudnnAttentionBackward0",
    }
)


def _second_order(query: Any, key: Any, value: Any, mask: Any, causal: bool, scale: float) -> Any:
    """Return a hook for a fused SDPA node: where its backward is recorded, the portable one's.

    The fused kernels' backward has no derivative (torch raises in the second
    backward). Where the backward runs with grad mode on (``create_graph=True``: it
    will be differentiated), the gradients of Q, K and V it passes on are replaced
    by those of the portable path on the same arrays: the tiled walk's recomputing
    backward, recorded at O(L) memory (:func:`~._autodiff.recomputing_attention` on the
    router's tiles). A first-order backward is the kernel's alone.
    The hook holds the node's own inputs (the node keeps them anyway), not the node.
    """
    import torch

    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> Any:
        if not torch.is_grad_enabled() or grad_outputs[0] is None:
            return None
        from .._lib import _route as router
        from .._lib._call import prepare
        from ._autodiff import recomputing_attention

        masks = {}
        if mask is not None:
            masks["mask" if mask.dtype == torch.bool else "bias"] = mask
        qkv = (query, key, value)
        call = prepare(*qkv, is_causal=causal, scale=scale, **masks)
        tiles = router.library(query).tiles  # the tiled walk: O(L) where recorded
        route = router.route(call, tiles, "portable")
        if not isinstance(route.path, Tiled) or route.path.backward != "torch":
            return None  # nothing the walk computes here (the kernel's error stands)
        with torch.enable_grad():
            out, _ = recomputing_attention(call.in_compute_dtype(), route.path)
            out = call.finish(out)
        wanted = [i for i in range(3) if grad_inputs[i] is not None]
        grads = torch.autograd.grad(
            out, [qkv[i] for i in wanted], grad_outputs[0], create_graph=True
        )
        replaced = list(grad_inputs)
        for i, g in zip(wanted, grads, strict=True):
            replaced[i] = g
        return tuple(replaced)

    return hook


def direct_kernel(
    call: AttentionCall, path: Any, arguments: tuple[Any, ...]
) -> DirectKernel | None:
    """Return the kernel call of `call` on `path` where it takes the caller's arrays as they are.

    `call` is the call the route runs (after any cast to the compute dtype);
    `arguments` the caller's query, key, value and mask. None unless SDPA is called
    whole with exactly those objects (no head axis added, no cast, no broadcast, no
    mask built, no guard) and a float scale, and the call holds nothing else.
    """
    if not isinstance(path, Native) or path.kernel != "sdpa" or path.tiles is not None:
        return None
    terms, plan = call.terms, call.plan
    if call.drop_head or terms != ScoreTerms(mask=terms.mask):
        return None
    a = _kernel_args(call, path)
    batch = tuple(plan.batch)
    query, key, value, mask = arguments
    same = a.query is query and a.key is key and a.value is value and a.bias is None
    if not same or a.visible is not None or a.allowed is not mask:
        return None
    if not tuple(query.shape[:-3]) == tuple(key.shape[:-3]) == tuple(value.shape[:-3]) == batch:
        return None
    gqa = plan.num_q_heads != plan.num_kv_heads
    return DirectKernel(a.causal, float(plan.scale), gqa, plan.result_dtype)


def native_tiles(call: AttentionCall, path: Native) -> Any:
    """Run the kernel once per query tile, over the keys its visible key tiles span.

    For each query tile of ``path.tiles`` rows, the key tiles that the pair states
    (``_lib/_blocks.py``: the band, host lengths and segment ids, a ``mask_mod``'s
    states) skip are left out: the kernel sees the keys from the first visible key
    tile to the last (:func:`~._partial.cut_call`, at their positions in the whole
    call), with the masks the part needs -- none where the states show the span in
    full. Consecutive tiles that together make a square causal part inside one
    segment (a packed document) are one call with the kernel's own causal flag
    (:func:`_causal_runs`). A query tile that sees no key is zeros (from the kernel
    given its first key tile, all of it hidden). Exact: every visible key of a row
    is in its tile's span.

    Returns
    -------
    array, shape (*batch, Hq, Lq, Dv)
        In the dtype of `call`'s Q, as :func:`native_attention`.
    """
    xp, plan = call.xp, call.plan
    tile = path.tiles or plan.q_len
    q_tiles, k_tiles = block_ranges(plan.q_len, tile), block_ranges(plan.kv_len, tile)
    states = np.asarray(host_pair_states(call, q_tiles, k_tiles))
    rest = states  # the states without the band: what segments, lengths, mask_mod show
    if plan.band.restricts:
        rest = np.asarray(host_pair_states(_without_band(call), q_tiles, k_tiles))
    parts = []
    for i in range(len(q_tiles)):
        shown = np.flatnonzero(states[i])
        # no visible key: the first key tile, whose masks hide it all (the kernel's
        # empty-row handling gives zeros, and zero gradients that autograd can reach)
        first, last = (int(shown[0]), int(shown[-1]) + 1) if shown.size else (0, 1)
        parts.append((i, i + 1, first, last, bool(shown.size)))
    outs = []
    for i0, i1, j0, j1, seen in _causal_runs(call, parts, rest):
        q_range, span = (q_tiles[i0][0], q_tiles[i1 - 1][1]), (k_tiles[j0][0], k_tiles[j1 - 1][1])
        full = seen and bool(np.all(states[i0:i1, j0:j1] == FULL))
        shown_rest = seen and bool(np.all(rest[i0:i1, j0:j1] == FULL))
        part = _without_shown_masks(cut_call(call, q_range, span), full, shown_rest)
        outs.append(native_attention(part, path))
    return outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)


def _without_band(call: AttentionCall) -> AttentionCall:
    plan = dataclasses.replace(call.plan, is_causal=False, window=None)
    return dataclasses.replace(call, plan=plan)


def _causal_runs(call: AttentionCall, parts: list[Any], rest: Any) -> list[Any]:
    """Merge runs of tiles that share a span start into square causal parts where exact.

    `parts` are ``(i0, i1, j0, j1, seen)`` tile ranges. A run of query tiles ``[i, e)``
    whose spans all start at key tile ``i`` and whose last span ends at tile ``e`` is
    the square part ``[i, e) x [i, e)``: with causal alone inside it (`rest`, the
    states without the band, show it in full: one segment, a ``mask_mod`` shown in
    full; nothing else hides by value) it is one kernel call with the kernel's causal
    flag, which skips the upper triangle itself (a packed document: SDPA on the
    document alone).
    """
    plan, terms = call.plan, call.terms
    others = dataclasses.replace(terms, q_segments=None, kv_segments=None, mask_mod=None)
    if not plan.is_causal or plan.window is not None or hidden_by_value(call.bias, others):
        return parts
    if plan.offset != 0 or plan.q_len != plan.kv_len:  # keys right of the diagonal show
        return parts
    merged: list[Any] = []
    i = 0
    while i < len(parts):
        i0, _, lo, _, _ = parts[i]
        j = i
        if lo == i0:  # a run can start here: find where its last span ends on the diagonal
            while j + 1 < len(parts) and parts[j + 1][2] == lo:
                j += 1
            while j > i and parts[j][3] != parts[j][1]:
                j -= 1
        end = parts[j][1]
        if j > i and parts[j][3] == end and bool(np.all(rest[i0:end, lo:end] == FULL)):
            merged.append((i0, end, lo, end, True))
            i = j + 1
        else:
            merged.append(parts[i])
            i += 1
    return merged


def _without_shown_masks(part: AttentionCall, full: bool, shown_rest: bool) -> AttentionCall:
    """`part` without the masks that show all of it.

    `full`: every structured mask shows it all (band, lengths, segments, ``mask_mod``);
    `shown_rest`: all but the band do (segments and ``mask_mod`` are dropped).
    """
    terms, plan = part.terms, part.plan
    if shown_rest:
        terms = dataclasses.replace(
            terms, q_segments=None, kv_segments=None, mask_mod=None, block_host=None
        )
    if full:
        plan = dataclasses.replace(plan, is_causal=False, window=None, has_lengths=False)
        terms = dataclasses.replace(
            terms,
            q_lengths=None,
            kv_lengths=None,
            kv_length_values=None,
            mask_mod=None,
            block_host=None,
            q_segments=None,
            kv_segments=None,
        )
    return dataclasses.replace(part, plan=plan, terms=terms)


def _to_batch(xp: Any, x: Any, batch: tuple[int, ...]) -> Any:
    """`x` broadcast to the batch shape `batch` (itself where it has that shape)."""
    shape = (*batch, *x.shape[-3:])
    return x if tuple(x.shape) == shape else xp.broadcast_to(x, shape)


def _torch(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any,
    plan: AttentionPlan,
    causal: bool,
) -> Any:
    # broadcast only what needs it: no expanded views of a shape they already have
    q, k, v = (_to_batch(xp, x, plan.batch) for x in (q, k, v))
    attn_mask = None
    if bias is not None:
        attn_mask = bias if allowed is None else xp.where(allowed, bias, -xp.inf)
        attn_mask = xp.astype(attn_mask, q.dtype)
    elif allowed is not None:
        attn_mask = allowed  # in its own broadcast shape, e.g. (B, 1, 1, Lk)
    gqa = plan.num_q_heads != plan.num_kv_heads
    return sdpa(q, k, v, attn_mask, causal, plan.scale, gqa)


def _jax(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any,
    plan: AttentionPlan,
    causal: bool,
    implementation: Literal["cudnn", "xla"] | None,
) -> Any:
    import jax

    n = math.prod(plan.batch)

    def btnh(x: Any) -> Any:  # (*batch, N, T, H) -> (B, T, N, H)
        x = xp.reshape(xp.broadcast_to(x, (*plan.batch, *x.shape[-3:])), (n, *x.shape[-3:]))
        return xp.permute_dims(x, (0, 2, 1, 3))

    def bnts(x: Any | None) -> Any | None:  # broadcast to (B, N|1, T, S)
        if x is None:
            return None
        heads = x.shape[-3] if x.ndim >= 3 else 1
        x = xp.broadcast_to(x, (*plan.batch, heads, plan.q_len, plan.kv_len))
        return xp.reshape(x, (n, heads, plan.q_len, plan.kv_len))

    out = jax.nn.dot_product_attention(
        btnh(q),
        btnh(k),
        btnh(v),
        bias=bnts(bias),
        mask=bnts(allowed),
        scale=plan.scale,
        is_causal=causal,
        implementation=implementation,
    )
    out = xp.permute_dims(out, (0, 2, 1, 3))  # (B, N, T, H)
    return xp.reshape(out, (*plan.batch, plan.num_q_heads, plan.q_len, plan.value_dim))

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
(:func:`~portable_attn._lib._compat.native_kernel_zeroes_empty_rows`: torch CPU).

What each kernel can express, and *when* a call is routed here, is decided by
the policy (:func:`portable_attn._lib._policy.unsupported_reason`): torch SDPA and
``jax.nn.dot_product_attention`` (which needs Dv == Dk, and whose softmax is
float32 even for float64) take masks, bias, lengths, windows and GQA; softcap,
``score_mod``, ALiBi and dropout are not expressible.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .._lib._call import AttentionCall
from .._lib._compat import autodiff_family, native_kernel_zeroes_empty_rows, reads_host_values
from .._lib._masks import arange
from .._lib._scores import (
    AttentionPlan,
    ScoreTerms,
    allowed_block,
    block_visibility,
    hidden_by_value,
    rows_may_be_empty,
    slice_block,
)
from .._lib._tiled import block_ranges, pair_visibility
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


def _visible_rows_of_key_mask(xp: Any, terms: Any, plan: AttentionPlan) -> Any | None:
    """Visible rows from a key-only mask (..., 1, Lk) and the band's right edge alone.

    With no bias, no lengths and no left window edge, query ``i`` (aligned at
    ``i' = i + Lk - Lq``) sees the keys ``j <= i' + right`` that the mask allows, so
    it sees one iff the mask's first allowed key is at most ``i' + right``: decided
    from (..., 1, 1) and (Lq, 1) arrays instead of an ``any`` over (..., Lq, Lk).
    None when this shortcut does not apply.
    """
    mask = terms.mask
    left = plan.band.left
    if mask is None or mask.shape[-2] != 1 or plan.has_lengths or left is not None:
        return None
    if terms.q_segments is not None or terms.mask_mod is not None:  # rows differ
        return None
    right = plan.band.right
    any_key = xp.any(mask, axis=-1, keepdims=True)  # (..., 1, 1)
    if right is None:
        return any_key
    first = xp.argmax(xp.astype(mask, xp.int8), axis=-1, keepdims=True)  # (..., 1, 1)
    last_seen = arange(xp, 0, plan.q_len, plan.device)[:, None] + (plan.offset + right)
    return xp.logical_and(any_key, first <= last_seen)  # (..., Lq, 1)


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
    hides_nothing = block_visibility(plan, (0, plan.q_len), (0, plan.kv_len)) == "full"
    decoding = (
        plan.q_len == 1
        and plan.is_causal
        and plan.window is None
        and terms.q_lengths is None
        and plan.align is None  # a whole call: its one query is aligned at kv_len - 1
    )
    return kernel_causal, not (kernel_causal or hides_nothing or decoding)


def _guards_empty_rows(call: AttentionCall) -> bool:
    """Whether rows without keys are guarded around the kernel.

    Where a row may see no key, unless the kernel zeroes such rows itself (with zero
    gradients: :func:`~portable_attn._lib._compat.native_kernel_zeroes_empty_rows`).
    """
    if not rows_may_be_empty(call.bias, call.terms, call.plan):
        return False
    return not native_kernel_zeroes_empty_rows(call.query)


def native_attention(call: AttentionCall, *, rows_seen: bool = False) -> Any:
    """Attention by the framework kernel: (*batch, Hq, Lq, Dv) in the dtype of `call`'s Q.

    `rows_seen`: the caller knows every query row sees a key (a block mask shows each
    row a block in full, and nothing else hides entries): no empty-row guard.

    That is the compute dtype, or the half-precision input dtype itself on a
    :class:`~portable_attn._lib._path.Native` path that keeps it (the kernel then
    accumulates in float32 itself; the policy's ``NATIVE_HALF_ROUTES`` says where).

    The kernels return no log-sum-exp (the policy never routes ``return_lse`` here).

    Every mask keeps its own broadcast shape: a padding mask or `kv_lengths`
    stays (B, 1, 1, Lk), causal structure is (Lq, Lk), and structure that hides
    nothing (bottom-right causal with ``Lq == 1``: decoding) is no mask at all.
    """
    xp, q, k, v, bias = call.xp, call.query, call.key, call.value, call.bias
    terms, plan = call.terms, call.plan
    kernel_causal, structural = _kernel_form(call)
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    allowed = allowed_block(xp, terms, plan, whole_q, whole_k, structural=structural)
    visible = None
    if not rows_seen and _guards_empty_rows(call):
        if bias is None:
            visible = _visible_rows_of_key_mask(xp, terms, plan)
        if visible is None:
            visible = _visible_rows(xp, allowed, bias)
    if visible is not None and reads_host_values(visible) and bool(xp.all(visible)):
        # read for free (torch CPU, outside transforms): no row is empty, so neither the
        # guard on the mask nor the pass that zeroes empty rows of the output is needed
        visible = None
    if visible is not None:  # give empty rows something finite to chew on, zero them later
        if allowed is not None:
            allowed = xp.logical_or(allowed, xp.logical_not(visible))
        if bias is not None:
            bias = xp.where(visible, bias, 0.0)
    if array_or_none(plan.scale) is not None:  # learned: the kernels take a float scale
        q = q * plan.scale  # so gradients reach it through this product
        plan = dataclasses.replace(plan, scale=1.0)
    if autodiff_family(q) == "torch":
        out = _torch(xp, q, k, v, allowed, bias, plan, kernel_causal)
    else:
        out = _jax(xp, q, k, v, allowed, bias, plan, kernel_causal)
    return out if visible is None else xp.where(visible, out, 0.0)


@dataclasses.dataclass(frozen=True)
class DirectKernel:
    """SDPA called with a call's own Q, K, V and mask: :func:`native_attention` decided.

    What :func:`native_attention` does for the calls of one signature whose arrays go
    to the kernel as they are (:func:`direct_kernel`), kept so that the next call of
    that signature makes the kernel call alone (``portable_attn._direct``).
    """

    is_causal: bool
    scale: float
    enable_gqa: bool
    #: the result's dtype, the inputs' (the route's ``finish``): under ``torch.autocast``
    #: SDPA returns the autocast dtype
    dtype: Any

    def __call__(self, query: Any, key: Any, value: Any, mask: Any) -> Any:
        """Return ``F.scaled_dot_product_attention`` of the arrays, as the route calls it."""
        import torch.nn.functional as F

        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )
        return out if out.dtype == self.dtype else out.to(self.dtype)


def direct_kernel(
    call: AttentionCall, path: Any, arguments: tuple[Any, ...]
) -> DirectKernel | None:
    """Return the kernel call of `call` on `path` where it takes the arrays as they are.

    `arguments`: the caller's query, key, value and mask. :func:`native_attention`
    makes that call, and None is returned, unless: torch, the whole call on ``Native``
    (no tiles) in the inputs' dtype (no float32 copies, no cast of the result), Q, K
    and V the caller's own (at least 3-D: no head axis added) and of the batch shape
    (no broadcast), a float scale, no bias and no score term but the mask, which is the
    kernel's mask itself (at least 2-D, spanning the call), no band mask to build, and
    no empty-row guard (no row can be empty, or the kernel zeroes such rows itself).
    """
    q, k, v, terms, plan = call.query, call.key, call.value, call.terms, call.plan
    query, key, value, mask = arguments
    if q is not query or k is not key or v is not value:
        return None
    if autodiff_family(q) != "torch" or path.tiles is not None or call.drop_head:
        return None
    if call.bias is not None or array_or_none(plan.scale) is not None or v is None:
        return None
    if terms != ScoreTerms(mask=terms.mask) or terms.mask is not mask:
        return None
    if mask is not None and slice_block(mask, (0, plan.q_len), (0, plan.kv_len)) is not mask:
        return None
    if not q.dtype == k.dtype == v.dtype == plan.result_dtype:
        return None
    if path.upcast and plan.result_dtype != plan.compute_dtype:
        return None
    batch = tuple(plan.batch)
    if not tuple(q.shape[:-3]) == tuple(k.shape[:-3]) == tuple(v.shape[:-3]) == batch:
        return None
    kernel_causal, structural = _kernel_form(call)
    if structural and plan.band.restricts:
        return None
    if _guards_empty_rows(call):
        return None
    gqa = plan.num_q_heads != plan.num_kv_heads
    return DirectKernel(kernel_causal, float(plan.scale), gqa, plan.result_dtype)


def native_tiles(call: AttentionCall, tile: int) -> Any:
    """Run the kernel once per query tile, over the keys its visible key tiles span.

    For each query tile of `tile` rows, the key tiles that block skipping hides
    (:func:`~portable_attn._lib._tiled.pair_visibility`: the band, host segment ids,
    a block mask) are left out: the kernel sees the keys from the first visible key
    tile to the last (:func:`~._partial.cut_call`, at their positions in the whole
    call), with the masks the part needs -- none where the span is shown in full and
    lies in one segment. Consecutive tiles that together make a square causal part
    inside one segment (a packed document) are one call with the kernel's own causal
    flag (:func:`_causal_runs`). A query tile that sees no key is zeros (from the
    kernel given its first key tile, all of it hidden). Exact: every visible key of a
    row is in its tile's span.

    Returns
    -------
    array, shape (*batch, Hq, Lq, Dv)
        In the dtype of `call`'s Q, as :func:`native_attention`.
    """
    xp, plan, terms = call.xp, call.plan, call.terms
    k_tiles = block_ranges(plan.kv_len, tile)
    parts = []
    for q_range in block_ranges(plan.q_len, tile):
        seen = [pair_visibility(plan, terms, q_range, kr) for kr in k_tiles]
        shown = [j for j, vis in enumerate(seen) if vis != "skip"]
        # no visible key: the first key tile, whose masks hide it all (the kernel's
        # empty-row handling gives zeros, and zero gradients that autograd can reach)
        first, last = (shown[0], shown[-1]) if shown else (0, 0)
        span = (k_tiles[first][0], k_tiles[last][1])
        full = bool(shown) and all(vis == "full" for vis in seen[first : last + 1])
        parts.append((q_range, span, full))
    outs = []
    for q_range, span, full in _causal_runs(call, parts):
        part = _without_shown_masks(cut_call(call, q_range, span), terms, q_range, span, full)
        outs.append(native_attention(part, rows_seen=_rows_seen(part, terms, q_range, span)))
    return outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)


def _rows_seen(part: AttentionCall, terms: Any, q_range: Any, span: Any) -> bool:
    """Whether every row of `part` provably sees a key, from the block states alone.

    When the ``mask_mod`` is the only thing that hides entries of the part (no band
    left, no mask, lengths, segments or bias) and its states show every row of the
    tile some block of the span in full.
    """
    p_terms, plan = part.terms, part.plan
    host = terms.block_host
    if p_terms.mask_mod is None or host is None or plan.band.restricts:
        return False
    others = dataclasses.replace(p_terms, mask_mod=None)
    if hidden_by_value(part.bias, others):
        return False
    return bool(host.covers_rows(q_range, span))


def _causal_runs(call: AttentionCall, parts: list[Any]) -> list[Any]:
    """Merge runs of tiles that share a span start into square causal parts where exact.

    A run of query tiles ``[s, e)`` whose spans all start at ``s`` and whose last span
    ends at ``e`` is the square part ``[s, e) x [s, e)``: with causal alone inside it
    (one segment, a ``mask_mod`` shown in full, nothing else hiding by value) it is
    one kernel call with the kernel's causal flag, which skips the upper triangle
    itself (a packed document: SDPA on the document alone).
    """
    plan, terms = call.plan, call.terms
    rest = dataclasses.replace(
        terms, q_segments=None, kv_segments=None, segment_blocks=None, mask_mod=None
    )
    if not plan.is_causal or plan.window is not None or hidden_by_value(call.bias, rest):
        return parts
    if plan.offset != 0:  # Lq != Lk: keys right of the diagonal are visible too
        return parts
    merged: list[Any] = []
    i = 0
    while i < len(parts):
        (qs, _), (lo, _), _ = parts[i]
        j = i
        if lo == qs:  # a run can start here: find where its last span ends on the diagonal
            while j + 1 < len(parts) and parts[j + 1][1][0] == lo:
                j += 1
            while j > i and parts[j][1][1] != parts[j][0][1]:
                j -= 1
        qe = parts[j][0][1]
        if j > i and parts[j][1][1] == qe and _inside_one_mask(terms, (qs, qe), (lo, qe)):
            merged.append(((qs, qe), (lo, qe), False))
            i = j + 1
        else:
            merged.append(parts[i])
            i += 1
    return merged


def _inside_one_mask(terms: Any, q_range: Any, span: Any) -> bool:
    """Whether segment ids and a ``mask_mod`` show every entry of the part (host reads)."""
    blocks = terms.segment_blocks
    if terms.q_segments is not None and (blocks is None or not blocks.one_segment(q_range, span)):
        return False
    if terms.mask_mod is not None:
        host = terms.block_host
        return host is not None and host.visibility(q_range, span) == "full"
    return True


def _without_shown_masks(
    part: AttentionCall, terms: Any, q_range: Any, span: Any, full: bool
) -> AttentionCall:
    """`part` without the masks that show all of it: band, segments, ``mask_mod``."""
    new_terms = part.terms
    blocks = terms.segment_blocks
    if blocks is not None and blocks.one_segment(q_range, span):
        new_terms = dataclasses.replace(
            new_terms, q_segments=None, kv_segments=None, segment_blocks=None
        )
    host = terms.block_host
    if (
        terms.mask_mod is not None
        and host is not None
        and host.visibility(q_range, span) == "full"
    ):
        new_terms = dataclasses.replace(new_terms, mask_mod=None, block_host=None)
    plan = part.plan
    if full:
        plan = dataclasses.replace(plan, is_causal=False, window=None)
        new_terms = dataclasses.replace(new_terms, mask_mod=None, block_host=None)
    return dataclasses.replace(part, plan=plan, terms=new_terms)


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
    import torch.nn.functional as F

    # broadcast only what needs it: no expanded views of a shape they already have
    q, k, v = (_to_batch(xp, x, plan.batch) for x in (q, k, v))
    attn_mask = None
    if bias is not None:
        attn_mask = bias if allowed is None else xp.where(allowed, bias, -xp.inf)
        attn_mask = xp.astype(attn_mask, q.dtype)
    elif allowed is not None:
        attn_mask = allowed  # in its own broadcast shape, e.g. (B, 1, 1, Lk)
    gqa = plan.num_q_heads != plan.num_kv_heads
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, scale=plan.scale, enable_gqa=gqa
    )


def _jax(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any,
    plan: AttentionPlan,
    causal: bool,
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
    )
    out = xp.permute_dims(out, (0, 2, 1, 3))  # (B, N, T, H)
    return xp.reshape(out, (*plan.batch, plan.num_q_heads, plan.q_len, plan.value_dim))

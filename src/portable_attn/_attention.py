"""The public attention functions: the cache, :func:`prepare`, the route, the run.

One call: its signature finds what was decided for calls like it (``_lib/_cache.py``);
otherwise every check runs (``_lib/_validation.py``, called by :func:`prepare`), the
router decides the route (``_lib/_route.py``) and the cache keeps it. The drivers
are in ``_paths/``, the numerics in ``_lib/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ._lib import _cache
from ._lib import _route as router
from ._lib._block_states import BlockMask
from ._lib._call import AttentionCall, heads_first, name_swapped_shapes, prepare, swap_heads
from ._lib._dense import dense_kernel, dense_weights
from ._lib._path import Route
from ._lib._rules import lower_arguments
from ._lib._validation import check_given, check_is_flag
from ._paths import compiled, run, tied_to_inputs
from ._paths._native import direct_kernel

__all__ = ["attention_weights", "scaled_dot_product_attention"]

Array = Any


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | Array | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    block_size: int | tuple[int, int] | Literal["auto", "dense"] | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Array | None = None,
    sinks: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    mask_mod: Callable[..., Array] | None = None,
    block_mask: BlockMask | None = None,
    implementation: Literal["portable", "native"] | None = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
    batch_invariant: bool = False,
    layout: Literal["bhld", "blhd"] = "bhld",
) -> Array | tuple[Array, ...]:
    r"""Scaled dot-product attention, ``softmax(Q Kᵀ · scale) V``, on any array-API library.

    Dimensions: ``B...`` batch (any number, broadcast), ``Hq`` query heads,
    ``Hkv`` key/value heads, ``G = Hq // Hkv``, ``Lq`` queries, ``Lk`` keys,
    ``Dk`` query/key features, ``Dv`` value features.

    Layout: `query`, `key` and `value` are (B..., H, L, D), the heads before the
    sequence, as torch's SDPA takes them. Arrays laid out (B, L, H, D) (flash-attn,
    Hugging Face projections before their transpose, ``jax.nn.dot_product_attention``)
    need ``layout="blhd"``: the library cannot always tell the two apart by the
    shapes. A (B, L, H, D) cross-attention whose Lq is a multiple of Lk reads as
    grouped-query attention and runs, with wrong values.

    The order of operations (scale, softcap, ``score_mod``, bias, ALiBi, masks,
    softmax, empty rows, dropout, ``@ value``) is stated once, on the
    documentation's "Semantics" page (``docs/semantics.md``).

    Parameters
    ----------
    query : array, shape (B..., Hq, Lq, Dk) or (Lq, Dk)
        Queries. A 2-D input is one head. (B..., Lq, Hq, Dk) with ``layout="blhd"``,
        and likewise for `key` and `value`.
    key : array, shape (B..., Hkv, Lk, Dk) or (Lk, Dk)
        Keys. ``Hq`` must be a multiple of ``Hkv``: query head ``h`` uses key/value
        head ``h // (Hq // Hkv)`` (grouped-query attention; K/V are not repeated).
    value : array, shape (B..., Hkv, Lk, Dv) or (Lk, Dv)
        Values.
    mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        True where a query may attend to a key. A 0/1 integer mask (a tokenizer's
        ``attention_mask``) is ``mask != 0``. A 2-D mask is (Lq, Lk): a (B, Lk)
        padding mask needs ``mask[:, None, None, :]`` (or ``kv_lengths``); with
        ``B == Lq`` the shapes cannot tell, and it would be read as (Lq, Lk).
    bias : floating array, broadcastable to (B..., Hq, Lq, Lk), optional
        Added to the logits after `softcap`; ``-inf`` entries mask a position.
        Computed in the compute dtype (see Notes). A 0/1 mask added as a bias
        hides nothing: a boolean or integer `bias` is refused.
    is_causal : bool, default False
        Bottom-right aligned causal mask: query ``i`` may see key ``j`` iff
        ``j <= i + (Lk - Lq)``. (PyTorch's and JAX's ``is_causal`` are top-left
        aligned; use :func:`causal_mask` with ``align="top-left"`` for that.)
    scale : float or 0-d floating array, optional
        Factor applied to the queries before the product; default ``1 / sqrt(Dk)``.
        A 0-d array of the inputs' library (or a traced value under ``jax.jit``)
        is a learned temperature: gradients flow to it on every path. A concrete
        value must be finite, > 0 and a normal number of the compute dtype.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: query ``i`` may see key ``j`` iff
        ``i' - left <= j <= i' + right`` with ``i' = i + (Lk - Lq)``. None on a
        side means unbounded. Combines with `is_causal` and `mask` by AND.
    softcap : float or 0-d floating array, optional
        Soft-capping of the logits, ``softcap · tanh(logits / softcap)``; an
        array receives gradients, like `scale`.
    block_size : int, (int, int), "auto" or "dense", optional
        None (default) or its alias ``"auto"``: the library picks the fastest
        exact path measured for the backend, shape and arguments -- the dense
        path (the (Lq, Lk) scores built once) for small calls, the tiled path
        above a memory limit, the framework's fused kernel where it takes the
        call (torch), and for Dask arrays chunked along ``Lq`` or ``Lk`` one
        tile per (query chunk, key chunk) pair, so no task holds more than one
        chunk pair of scores. The rules and their measured thresholds are in
        one place, ``portable_attn._lib._route``.
        ``"dense"``: always the dense path.
        An int (or a pair ``(block_q, block_k)``): the tiled path, exact online
        softmax over query and key blocks of this size; memory O(Lq + Lk) per
        head instead of O(Lq · Lk), and key blocks that causal/window structure
        hides entirely are not computed. Its backward (torch autograd,
        ``jax.grad``) recomputes blocks instead of storing them, so training
        memory stays O(L) as well.
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
        (B..., 1, 1, 1) flat batch index, `head` (1..., Hq, 1, 1), `q_idx`
        (1..., 1, bq, 1) and `kv_idx` (1..., 1, 1, bk) absolute positions, each with
        as many axes as `batch` (so JAX's ``jax_numpy_rank_promotion="raise"`` holds).
        Write it with array-API operations.
    dropout_p : float, default 0.0
        Dropout probability on the attention weights; needs `dropout_mask`.
    dropout_mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        Keep-mask drawn by the caller's own random generator (True = keep); kept
        weights are scaled by ``1 / (1 - dropout_p)``. The array API has no random
        generator, so the library never draws one itself.
    sinks : floating array, broadcastable to (B..., Hq), optional
        Attention sinks: one extra logit per head that joins every row's softmax
        denominator and contributes no value,
        ``w_ij = exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij))``. Not scaled, capped,
        biased or masked; a row with no visible key returns zeros. Gradients
        flow to it (torch autograd, ``jax.grad``) on the dense and tiled paths.
    q_segment_ids, kv_segment_ids : integer array, shape (B..., Lq) and (B..., Lk), optional
        Packed sequences: query ``i`` may see key ``j`` only if their ids are
        equal, AND-ed with every other mask. Given only one, the other is the
        same array (self-attention, ``Lq == Lk``). On the tiled path the mask is
        built per block, and block pairs whose id ranges do not overlap are
        skipped: read on the host for NumPy and torch CPU ids, by value inside
        the traced loop of long calls under ``jax.jit`` (a `block_mask` skips
        by value at any length).
    mask_mod : callable, optional
        ``mask_mod(batch, head, q_idx, kv_idx) -> bool array`` (FlexAttention's
        convention): True where a query may attend to a key, AND-ed with every
        other mask. The index arrays are those of `score_mod` (`batch`
        (B..., 1, 1, 1), `head` (1..., Hq, 1, 1), `q_idx` (1..., 1, bq, 1), `kv_idx`
        (1..., 1, 1, bk)):
        raw positions, so ``q_idx >= kv_idx`` is top-left causal (the library's
        `is_causal` is bottom-right; they agree when ``Lq == Lk``). Evaluated once on
        the dense path and per block on the tiled path, where NumPy and torch
        build its block states on the first tiled call and skip the blocks it
        hides; build a `block_mask` to reuse them (and to skip under ``jax.jit``
        and on Dask).
    block_mask : BlockMask, optional
        From :func:`portable_attn.block_mask.create_block_mask`: applies its
        `mask_mod`, skips the key blocks it hides and evaluates no mask on the
        blocks it shows in full. One block mask serves every call with the same
        (Lq, Lk), batch and heads (every layer); under ``jax.jit`` it may be a
        traced argument (a pytree), and the traced loop skips by its values.
    implementation : {None, "portable", "native"}, default None
        ``"portable"``: always the array-API implementation. ``"native"``: the
        first of the framework's fused kernels on the inputs' device that
        computes the call, with our masks, alignment and empty-row handling:
        torch SDPA, then on CUDA ``flex_attention`` (which also takes softcap,
        score_mod, mask_mod or block_mask, ALiBi, sinks, return_lse and
        return_max_logit), ``jax.nn.dot_product_attention`` (cuDNN on a GPU); a
        call none computes (on a CPU: softcap, score_mod, mask_mod or
        block_mask, ALiBi, sinks, return_lse; dropout, an int, pair or "dense"
        block_size, JAX with Dv != Dk, other libraries) raises ValueError with
        each kernel's reason; "auto" is allowed. (``jax.nn.dot_product_attention``
        computes its softmax in float32 even for float64 inputs: about 1e-7 from
        the float64 result.) None: a kernel only where it computes the call,
        honours the contract and is measured (or, on a GPU, expected) faster:
        torch's fused kernels, on a CPU run once per query tile over its visible
        keys where block skipping hides most tiles (windows, packed documents, a
        `mask_mod` or `block_mask`); on CUDA SDPA, then ``flex_attention``; on a
        JAX GPU cuDNN; the portable path otherwise (rules and the table per
        library and device in ``portable_attn._lib._route``).
    return_lse : bool, default False
        Also return the row log-sum-exp ``log(exp(sink_h) + Σ_j exp(s_ij))`` over
        the visible keys (the sink term only with `sinks`), for
        :func:`merge_attention`. The output is the same as without it (bit for
        bit on the same path; SDPA returns no lse, so torch's default moves such
        a call from SDPA to ``flex_attention`` on CUDA, to the portable path on a
        CPU).
    return_max_logit : bool, default False
        Also return the largest logit of each row, after the output (and after
        the lse with `return_lse`): the largest final score over the row's
        visible keys (after `scale`, `softcap`, `score_mod`, `bias` and ALiBi; the
        sink is not a score), ``-inf`` for a row with no visible key. Computed
        in the forward pass on every path at no extra memory (the online
        softmax carries it), with no gradient: what QK-clip (MuonClip) reads
        every step. Like `return_lse`, it moves a call off SDPA.
    batch_invariant : bool, default False
        Make each sequence's rows (output, lse, max logit) the same bits whatever
        else the batch holds (other sequences, their number and order), on one
        backend and device: the bits
        :func:`~portable_attn.serving.ragged_paged_attention` gives the same sequence
        with ``batch_invariant=True`` (and ``varlen_attention``), so a trainer's batch
        and a server's ragged batches agree. The call runs the paged walk, each
        sequence a request over pages of one slot (slower than the default routes;
        gradients by automatic differentiation through it). Takes every argument but
        dropout, `sinks` that differ by sequence, a `block_mask` built without a
        `mask_mod`, `implementation="native"`, a `block_size` other than "auto" and
        Dask arrays (a ValueError names it).
    layout : {"bhld", "blhd"}, default "bhld"
        The order of the last three axes of `query`, `key`, `value` and the
        output: ``"bhld"`` (..., H, L, D), or ``"blhd"`` (..., L, H, D), the
        layout of flash-attn and of ``jax.nn.dot_product_attention``, where the
        library swaps the two axes of the inputs (views, no copy) and of the
        results back: the output is (B..., Lq, Hq, Dv), the lse and max logit
        (B..., Lq, Hq). `mask`, `bias`, `dropout_mask` keep the logits' shape
        (B..., Hq, Lq, Lk) either way; lengths, segment ids, `sinks` and ALiBi
        slopes have no sequence-and-head pair to swap. 2-D inputs (L, D) are one
        head in either layout.

    Returns
    -------
    out : array, shape (B..., Hq, Lq, Dv), or (Lq, Dv) when all inputs are 2-D
        In the namespace, on the device and with the promoted floating dtype of
        `query`, `key` and `value`. (B..., Lq, Hq, Dv) with ``layout="blhd"``.
    lse : array, shape (B..., Hq, Lq), or (Lq,) when all inputs are 2-D
        Only with ``return_lse=True``: in the compute dtype (float32 for half
        inputs); ``-inf`` for a row with no visible key and no sink (the sink's
        logit with one). Differentiable: its cotangent flows back. (B..., Lq, Hq)
        with ``layout="blhd"``, as :func:`merge_attention` takes it beside the output.
    max_logit : array, shape (B..., Hq, Lq), or (Lq,) when all inputs are 2-D
        Only with ``return_max_logit=True``: in the compute dtype; no gradient.
        (B..., Lq, Hq) with ``layout="blhd"``.

    Raises
    ------
    TypeError
        Arrays from different libraries; non-floating `query`, `key`, `value`
        or `bias`; non-boolean `mask`; arguments of the wrong type.
    ValueError
        Shapes that do not agree (each message names the argument, the axis and
        both shapes), a non-positive or non-finite `scale` or `softcap`, a
        negative `window` entry, a `block_size` that is not None, "auto",
        "dense", a positive integer or a pair of them, a `layout` other than
        "bhld" or "blhd".

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

    The same arrays laid out (B, L, H, D), as flash-attn takes them:

    >>> q_, k_, v_ = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    >>> scaled_dot_product_attention(q_, k_, v_, is_causal=True, layout="blhd").shape
    (2, 5, 8, 32)
    """
    check_given("value", value)
    if layout != "bhld":  # (B..., L, H, D): the heads first for the whole call (views)
        query, key, value = heads_first(layout, query, key, value)

    def arguments_by_name() -> dict[str, Any]:  # prepare's keywords (torch.compile: no locals())
        return dict(
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            scale=scale,
            window=window,
            softcap=softcap,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
            alibi_slopes=alibi_slopes,
            score_mod=score_mod,
            dropout_p=dropout_p,
            dropout_mask=dropout_mask,
            sinks=sinks,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            mask_mod=mask_mod,
            block_mask=block_mask,
        )

    given = None  # built where prepare runs: a kept kernel's call never needs them
    if mask_mod is not None:  # a ready rule: lowered to the band, segment ids, block states
        given = lower_arguments(arguments_by_name(), query, key)
        is_causal, window, mask_mod = given["is_causal"], given["window"], given["mask_mod"]
        q_segment_ids, kv_segment_ids = given["q_segment_ids"], given["kv_segment_ids"]
    arrays: tuple[Any, ...] = (query, key, value, mask, bias, q_lengths, kv_lengths)
    arrays += (alibi_slopes, dropout_mask, sinks, q_segment_ids, kv_segment_ids)
    invariant = check_is_flag("batch_invariant", batch_invariant)
    options: tuple[Any, ...] = (is_causal, scale, window, softcap, block_size, implementation)
    options += (invariant,)
    options += (return_lse, return_max_logit, dropout_p, score_mod is None, mask_mod is None)
    options += (None if block_mask is None else _block_mask_key(block_mask),)
    arguments = (query, key, value, mask)
    signature = _cache.signature(arrays, options)

    def derive() -> tuple[_cache.Entry, Any]:  # a miss: every check, the plan, the route
        call = prepare(query, key, value, **(given or arguments_by_name()))
        with_lse = check_is_flag("return_lse", return_lse)
        if check_is_flag("return_max_logit", return_max_logit):
            call = call.with_row_max()  # kept in the entry's plan for later hits
        kept = arguments if signature is not None else None  # no signature: nothing kept
        stats = with_lse or call.plan.row_max
        entry, route = decide(call, block_size, implementation, stats, kept, invariant)
        return entry, (call, route)

    try:
        entry, derived = _cache.entry_for(signature, derive)
    except ValueError as error:  # the checks saw the swapped arrays of layout="blhd"
        name_swapped_shapes(error, layout)
        raise
    stats = return_lse or return_max_logit  # the row statistics: [lse | max]
    if derived is not None:
        call, route = derived
    elif entry.kept is not None and entry.route is not None and not entry.route.compiled:
        out = entry.kept(query, key, value, mask)  # SDPA with the caller's arrays
        return out if layout == "bhld" else swap_heads(entry.xp, out)
    else:  # a hit: the arrays gathered (the static checks passed for this signature)
        static = (entry.xp, entry.plan)
        call = prepare(query, key, value, static=static, **(given or arguments_by_name()))
        route = entry.route
        if route is None:  # the router reads host values of this call
            route = router.route(
                call, block_size, implementation, return_lse=stats, batch_invariant=invariant
            )
    out, lse = run(call, route, with_lse=stats, kept=entry.kept)
    if not stats and layout == "bhld":
        return call.finish(out)
    results = [call.finish(out)]
    if stats:
        results += [call.finish_lse(lse)] if return_lse else []
        results += [call.finish_lse(lse, 1)] if return_max_logit else []
    if layout != "bhld":  # back to (B..., Lq, Hq, Dv), the statistics to (B..., Lq, Hq)
        results = [swap_heads(call.xp, x, features=i == 0) for i, x in enumerate(results)]
    return tuple(results) if stats else results[0]


def decide(
    call: AttentionCall,
    block_size: Any,
    implementation: Any,
    return_lse: bool,
    arguments: tuple[Any, ...] | None,
    batch_invariant: bool = False,
) -> tuple[_cache.Entry, Route]:
    """Route `call` and return what the cache keeps for its signature, and the route.

    `arguments`: the caller's query, key, value and mask, or None where nothing is
    kept (no signature). The entry keeps the route unless the router read host values
    of the call, the compiled program of an eager JAX call, and the kernel call of a
    torch call whose arrays go to SDPA as they are.
    """
    route = router.route(
        call, block_size, implementation, return_lse=return_lse, batch_invariant=batch_invariant
    )
    if arguments is None or router.reads_values(call):
        return _cache.Entry(call.xp, call.plan), route
    kept = None
    if route.compiled:
        kept = compiled(call.flatten()[1], route, return_lse)
    elif not return_lse and route.keys is None:
        ran = call if route.keeps_dtype else call.in_compute_dtype()
        kept = direct_kernel(ran, route.path, arguments) or dense_kernel(
            ran, route.path, arguments
        )
    return _cache.Entry(call.xp, call.plan, route, kept), route


def _block_mask_key(block_mask: Any) -> Any:
    """Return what the checks read of a block mask: its states' kind, shape, lengths, blocks."""
    if block_mask is None:
        return None
    states = getattr(block_mask, "states", None)
    return (
        type(block_mask),
        type(states),
        getattr(states, "shape", None),
        getattr(states, "dtype", None),
        getattr(block_mask, "q_len", None),
        getattr(block_mask, "kv_len", None),
        getattr(block_mask, "block_size", None),
    )


def attention_weights(
    query: Array,
    key: Array,
    *,
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
    dropout_p: float = 0.0,
    dropout_mask: Array | None = None,
    sinks: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    mask_mod: Callable[..., Array] | None = None,
    block_mask: BlockMask | None = None,
    layout: Literal["bhld", "blhd"] = "bhld",
) -> Array:
    """Attention weights ``softmax(Q Kᵀ · scale)`` of :func:`scaled_dot_product_attention`.

    Same arguments, order of operations and conventions as
    :func:`scaled_dot_product_attention`, without `value`.

    Parameters
    ----------
    query : array, shape (B..., Hq, Lq, Dk) or (Lq, Dk)
        Queries ((B..., Lq, Hq, Dk) with ``layout="blhd"``).
    key : array, shape (B..., Hkv, Lk, Dk) or (Lk, Dk)
        Keys; ``Hq`` must be a multiple of ``Hkv``.
    mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        True where a query may attend to a key.
    bias : floating array, broadcastable to (B..., Hq, Lq, Lk), optional
        Additive bias after `softcap`; ``-inf`` masks.
    is_causal : bool, default False
        Bottom-right aligned causal mask (``j <= i + Lk - Lq``).
    scale : float or 0-d floating array, optional
        Default ``1 / sqrt(Dk)``; an array is a learned temperature.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)`` around ``i' = i + Lk - Lq``.
    softcap : float or 0-d floating array, optional
        ``softcap · tanh(logits / softcap)``.
    q_lengths, kv_lengths, alibi_slopes, score_mod, dropout_p, dropout_mask
        As in :func:`scaled_dot_product_attention`; the dropout mask is applied
        to the returned weights.
    sinks, q_segment_ids, kv_segment_ids, mask_mod, block_mask
        As in :func:`scaled_dot_product_attention`; with `sinks` the rows sum
        to less than one (the sink takes the rest).
    layout : {"bhld", "blhd"}, default "bhld"
        The order of the last three axes of `query` and `key`, as in
        :func:`scaled_dot_product_attention`; the weights are
        (B..., Hq, Lq, Lk) either way, like `mask` and `bias`.

    Returns
    -------
    array, shape (B..., Hq, Lq, Lk), or (Lq, Lk) when both inputs are 2-D
        Each row sums to 1 over its visible keys (less with `sinks`), or is all
        zeros when no key is visible. Dtype: the promoted dtype of `query` and `key`.

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
    given: dict[str, Any] = (
        dict(  # prepare's keywords by name (torch.compile cannot trace locals())
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            scale=scale,
            window=window,
            softcap=softcap,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
            alibi_slopes=alibi_slopes,
            score_mod=score_mod,
            dropout_p=dropout_p,
            dropout_mask=dropout_mask,
            sinks=sinks,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            mask_mod=mask_mod,
            block_mask=block_mask,
        )
    )
    query, key, _ = heads_first(layout, query, key, None)
    if mask_mod is not None:
        given = lower_arguments(given, query, key)
    try:
        call = prepare(query, key, None, **given)
    except ValueError as error:  # the checks saw the swapped arrays of layout="blhd"
        name_swapped_shapes(error, layout)
        raise
    if call.is_empty:  # zeros, tied to the inputs (autodiff reaches them: zero gradients)
        (weights,) = tied_to_inputs(call, call.zeros(call.plan.q_len, call.plan.kv_len))
        return call.finish(weights)
    return call.finish(dense_weights(call))

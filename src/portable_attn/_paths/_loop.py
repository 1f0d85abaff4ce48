"""JAX: the tiled path as a traced loop, so the program and its buffers do not grow with L.

The array API has no loop, so the portable tiled path is a Python loop over
(query block, key block) pairs, which ``jax.jit`` unrolls: every block becomes
nodes of the program and XLA keeps many blocks' buffers alive at once. Here the
same kernel runs inside JAX's structured loops instead:

- queries: ``lax.map`` over the query blocks (a scan: one block body in the
  program, the outputs written into one (nq, ..., bq, Dv) result);
- keys: ``lax.fori_loop`` from the first to the last key block the query block
  can see, with the bounds from the causal/window band and, where they depend on
  values (lengths, segment ids: packed documents), from those values inside the
  program, so a traced call skips other documents' blocks too;
- the block body is the portable kernel itself: each (query block, key block)
  pair is a one-block call (:meth:`~AttentionCall.unflatten` of every field's
  block, placed at its positions by :func:`._partial.place_block`) visited by the
  online softmax of the tiled path (:class:`portable_attn._lib._tiled.RowWalk`),
  whose running max, denominator and weighted sum are the key loop's carry,
  normalised once per query block (as the Python loop does). Merging each step's
  normalised partial result instead (a stack, a log and three exps per step) made
  a loop step several times as costly at 128 x 128 blocks (hand runs, not a
  results file; benchmarks/results/loop.json measures the loop as it is);
- uneven last blocks: Q, K, V and every field are padded to whole blocks along
  their ``Lq``/``Lk`` axes; the padded keys are hidden by a key length, the padded
  query rows are cut off the result;
- a term of every row that belongs to no key (the sink logit, ``once_per_row`` in
  :data:`~portable_attn._lib._fields.FIELDS`) is merged once, at the end;
- the backward is a loop too (a ``jax.custom_vjp``): ``lax.scan`` over the key
  blocks, accumulating dK and dV per key block in the carry and dQ (and the bias
  gradient) into one padded buffer, over the query blocks that see the key block;
  each pair runs the portable :func:`~portable_attn._lib._tiled.tiled_backward`.

A ``score_mod`` is differentiated by JAX itself: then every key block is a step
of a fixed-length loop (``lax.cond`` skips the hidden ones), which reverse-mode
autodiff can transpose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._lib._call import AttentionCall
from .._lib._compat import stop_gradient
from .._lib._fields import Role, axis_of, field
from .._lib._merge import merge_partials
from .._lib._path import Tiled
from .._lib._scores import scaled_query_rows
from .._lib._tiled import RowState, RowWalk, pair_visibility, sum_to_shape, tiled_backward
from ._partial import place_block

__all__ = ["loop_attention"]

Array = Any


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The blocks of one call: sizes, counts and the padded lengths."""

    bq: int
    bk: int
    lq: int
    lk: int

    @property
    def nq(self) -> int:
        return -(-self.lq // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.lk // self.bk)


def loop_attention(call: AttentionCall, path: Tiled) -> tuple[Array, Array]:
    """Run the tiled path of a JAX call as a traced loop: output (..., Hq, Lq, Dv), lse.

    The lse is (..., Hq, Lq, 1), ``-inf`` for a row with no visible key and no sink.
    Differentiable with ``jax.grad`` (a custom VJP that loops too, or JAX's own
    autodiff through the loop with a ``score_mod``).
    """
    import jax

    plan = call.plan
    if not isinstance(path.block_q, int) or not isinstance(path.block_k, int):
        msg = f"the traced loop runs blocks of one size, not {path.block_q}, {path.block_k}"
        raise TypeError(msg)
    bq, bk = min(path.block_q, plan.q_len), min(path.block_k, plan.kv_len)
    grid = _Grid(bq, bk, plan.q_len, plan.kv_len)
    arrays, skeleton = call.flatten()
    if call.terms.score_mod is not None:  # JAX differentiates through a fixed-length loop
        return _forward(skeleton, grid, arrays, differentiable=True)

    @jax.custom_vjp
    def attend(arrays: dict[str, Array]) -> tuple[Array, Array]:
        return _forward(skeleton, grid, arrays)

    def forward(arrays: dict[str, Array]) -> Any:
        out, lse = _forward(skeleton, grid, arrays)
        return (out, lse), (arrays, out, lse)

    def backward(residuals: Any, cotangents: Any) -> tuple[dict[str, Any]]:
        arrays, out, lse = residuals
        dout, dlse = cotangents
        return (_backward(skeleton, grid, arrays, out, lse, dout, dlse),)

    attend.defvjp(forward, backward)
    return attend(arrays)


# ---------------------------------------------------------------------------
# blocks of every field


def _dim(name: str, x: Array, axis: str) -> int | None:
    """Return the dimension of field `name`'s `x` that runs along grid `axis`, or None."""
    return axis_of(name, x, axis)


def _pad_to(x: Array, d: int | None, length: int) -> Array:
    import jax.numpy as jnp

    if d is None or x.shape[d] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[d] = (0, length - x.shape[d])
    return jnp.pad(x, widths)


def _cut(x: Array, d: int | None, start: Any, size: int) -> Array:
    from jax import lax

    return x if d is None else lax.dynamic_slice_in_dim(x, start, size, axis=d)


def _padded(arrays: dict[str, Array], grid: _Grid) -> dict[str, Array]:
    """Every field padded to whole blocks along its Lq and Lk axes (zeros, False)."""
    out = {}
    for name, x in arrays.items():
        x = _pad_to(x, _dim(name, x, "lq"), grid.nq * grid.bq)
        out[name] = _pad_to(x, _dim(name, x, "lk"), grid.nk * grid.bk)
    return out


def _block(
    skeleton: AttentionCall,
    padded: dict[str, Array],
    grid: _Grid,
    i: Any,
    j: Any,
    *,
    full: bool = False,
) -> AttentionCall:
    """Build the one-block call of query block `i` and key block `j` (both may be traced).

    `full`: the band shows the whole block, which then needs no causal/window mask.
    """
    import jax.numpy as jnp

    q_start, kv_start = i * grid.bq, j * grid.bk
    blocks = {}
    for name, x in padded.items():
        if field(name).once_per_row is not None:  # merged once per row, after the loop
            continue
        x = _cut(x, _dim(name, x, "lq"), q_start, grid.bq)
        blocks[name] = _cut(x, _dim(name, x, "lk"), kv_start, grid.bk)
    changes: dict[str, Any] = {"q_len": grid.bq, "kv_len": grid.bk}
    if grid.lk % grid.bk and "kv_lengths" not in blocks:  # hides the padded keys
        blocks["kv_lengths"] = jnp.asarray(grid.lk)
        changes["has_lengths"] = True
    if full:
        changes.update(is_causal=False, window=None)
    call = skeleton.unflatten(blocks, **changes)
    if full and call.terms.mask_mod is not None:  # its block mask shows the pair in full
        call = dataclasses.replace(call, terms=dataclasses.replace(call.terms, mask_mod=None))
    return place_block(call, q_start=q_start, kv_start=kv_start, q_total=grid.lq, kv_total=grid.lk)


def _full(skeleton: AttentionCall, grid: _Grid, i: Any, j: Any) -> Any:
    """Whether the band shows every entry of block pair (i, j) (static alignment only)."""
    import jax.numpy as jnp

    band, offset = skeleton.plan.band, skeleton.plan.offset
    first_q, last_q = i * grid.bq + offset, i * grid.bq + grid.bq - 1 + offset
    first_k, last_k = j * grid.bk, j * grid.bk + grid.bk - 1
    full = jnp.asarray(True)
    if band.right is not None:
        full = jnp.logical_and(full, last_k <= first_q + band.right)
    if band.left is not None:
        full = jnp.logical_and(full, first_k >= last_q - band.left)
    return full


def _offsets(skeleton: AttentionCall, arrays: dict[str, Array]) -> tuple[Any, Any, Any, Any]:
    """``i' - i`` at its least and most over the batch, and the largest q / kv lengths."""
    import jax.numpy as jnp

    plan = skeleton.plan
    q_len = arrays.get("q_lengths")
    kv_len = arrays.get("kv_lengths")
    if q_len is None and kv_len is None:
        return plan.offset, plan.offset, plan.q_len, plan.kv_len
    q = plan.q_len if q_len is None else q_len
    kv = plan.kv_len if kv_len is None else kv_len
    offset = jnp.asarray(kv - q)
    q_max = plan.q_len if q_len is None else jnp.minimum(jnp.max(q_len), plan.q_len)
    kv_max = plan.kv_len if kv_len is None else jnp.minimum(jnp.max(kv_len), plan.kv_len)
    return jnp.min(offset), jnp.max(offset), q_max, kv_max


def _segment_pairs(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """(nq, nk) bool: the block pairs whose segment-id ranges overlap in some sequence.

    From the ids' values inside the program (traced ids skip too): a pair whose query
    ids and key ids have disjoint ranges in every sequence has no visible entry. None
    without segment ids.
    """
    import jax.numpy as jnp

    q_ids, kv_ids = arrays.get("q_segments"), arrays.get("kv_segments")
    if q_ids is None or kv_ids is None:
        return None
    plan = skeleton.plan

    def block_bounds(ids: Array, length: int, block: int, count: int) -> tuple[Array, Array]:
        ids = jnp.reshape(jnp.broadcast_to(ids, (*plan.batch, length)), (-1, length))
        ids = jnp.pad(ids, ((0, 0), (0, count * block - length)), mode="edge")
        ids = jnp.reshape(ids, (ids.shape[0], count, block))  # (N, blocks, block)
        return jnp.min(ids, axis=-1), jnp.max(ids, axis=-1)

    q_lo, q_hi = block_bounds(q_ids[..., 0, :, 0], grid.lq, grid.bq, grid.nq)  # (N, nq)
    k_lo, k_hi = block_bounds(kv_ids[..., 0, 0, :], grid.lk, grid.bk, grid.nk)  # (N, nk)
    apart = jnp.logical_or(
        q_hi[:, :, None] < k_lo[:, None, :], k_hi[:, None, :] < q_lo[:, :, None]
    )  # (N, nq, nk)
    return jnp.any(jnp.logical_not(apart), axis=0)


def _overlaps(length: int, block: int, count: int, state_block: int) -> Array:
    """(count, n_states) 0/1: which state blocks each loop block of `block` overlaps."""
    import numpy as np

    n_states = -(-length // state_block)
    starts = np.arange(count) * block
    stops = np.minimum(starts + block, length)
    first, last = starts // state_block, (stops - 1) // state_block
    idx = np.arange(n_states)
    return ((idx >= first[:, None]) & (idx <= last[:, None])).astype(np.float32)


def _mask_pairs(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> tuple[Any, Any]:
    """(nq, nk) bool each: the pairs a block mask shows at all, and those it shows in full.

    From the states' values inside the program (a traced block mask skips too),
    reduced over batch and heads and mapped onto the loop's blocks (a loop block is
    hidden only if every state block it overlaps is, full only if every one is).
    (None, None) without a block mask.
    """
    import jax.numpy as jnp

    states = arrays.get("block_states")
    if states is None:
        return None, None
    mq, mk = skeleton.terms.state_block or (grid.bq, grid.bk)
    lead = tuple(range(states.ndim - 2))
    some = jnp.any(states != 0, axis=lead).astype(jnp.float32)  # (nq_states, nk_states)
    partly = jnp.any(states != 2, axis=lead).astype(jnp.float32)
    oq = jnp.asarray(_overlaps(grid.lq, grid.bq, grid.nq, mq))  # (nq, nq_states)
    ok = jnp.asarray(_overlaps(grid.lk, grid.bk, grid.nk, mk))  # (nk, nk_states)
    shown = (oq @ some @ ok.T) > 0  # (nq, nk): counts of visible state blocks
    full = (oq @ partly @ ok.T) == 0
    return shown, full


def _pairs(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """(nq, nk) bool of the pairs visible by value (segment ids, block mask), or None."""
    import jax.numpy as jnp

    seg = _segment_pairs(skeleton, arrays, grid)
    shown, _ = _mask_pairs(skeleton, arrays, grid)
    if seg is None or shown is None:
        return shown if seg is None else seg
    return jnp.logical_and(seg, shown)


def _visits(lo: Any, hi: Any, visible: Any) -> tuple[Any, Any, Any]:
    """``(start, stop, index)``: visit ``index(t)`` for ``t`` in ``[start, stop)``.

    Blocks ``[lo, hi)`` (the band and lengths); with a `visible` row of the pairs
    visible by value (segment ids, a block mask: any pattern, strided or global
    tokens), the list of the blocks in ``[lo, hi)`` it shows, in order.
    """
    import jax.numpy as jnp

    if visible is None:
        return lo, jnp.maximum(hi, lo), lambda t: t
    n = visible.shape[0]
    idx = jnp.arange(n)
    row = jnp.logical_and(visible, jnp.logical_and(idx >= lo, idx < hi))
    order = jnp.argsort(jnp.logical_not(row), stable=True)  # visible blocks first, in order
    return jnp.asarray(0), jnp.sum(row.astype(jnp.int32)), lambda t: order[t]


def _key_range(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """``i -> (start, stop, index)``: the key blocks query block `i` can see (:func:`_visits`).

    From the band, the lengths, the segment ids and a block mask.
    """
    import jax.numpy as jnp

    band = skeleton.plan.band
    off_lo, off_hi, q_max, kv_max = _offsets(skeleton, arrays)
    pairs = _pairs(skeleton, arrays, grid)

    def keys(i: Any) -> tuple[Any, Any, Any]:
        first_q = i * grid.bq + off_lo  # the smallest aligned position i' of the block
        last_q = jnp.minimum(i * grid.bq + grid.bq, grid.lq) - 1 + off_hi
        lo = jnp.asarray(0)
        if band.left is not None:
            lo = jnp.clip(jnp.floor_divide(first_q - band.left, grid.bk), 0, grid.nk)
        hi = jnp.minimum(grid.nk, -(-kv_max // grid.bk))  # keys past every length: none
        if band.right is not None:
            hi = jnp.minimum(hi, jnp.floor_divide(last_q + band.right, grid.bk) + 1)
        hi = jnp.where(i * grid.bq >= q_max, lo, hi)  # rows past every query length
        return _visits(lo, hi, None if pairs is None else pairs[i])

    return keys


def _query_range(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """``j -> (start, stop, index)``: the query blocks that can see key block `j`."""
    import jax.numpy as jnp

    band = skeleton.plan.band
    off_lo, off_hi, q_max, kv_max = _offsets(skeleton, arrays)
    pairs = _pairs(skeleton, arrays, grid)

    def queries(j: Any) -> tuple[Any, Any, Any]:
        first_k = j * grid.bk
        last_k = jnp.minimum(j * grid.bk + grid.bk, grid.lk) - 1
        lo = jnp.asarray(0)
        if band.right is not None:  # i' >= j - right
            lo = jnp.clip(jnp.floor_divide(first_k - band.right - off_hi, grid.bq), 0, grid.nq)
        hi = jnp.minimum(grid.nq, -(-q_max // grid.bq))
        if band.left is not None:  # i' <= j + left
            hi = jnp.minimum(hi, jnp.floor_divide(last_k + band.left - off_lo, grid.bq) + 1)
        hi = jnp.where(first_k >= kv_max, lo, hi)
        return _visits(lo, hi, None if pairs is None else pairs[:, j])

    return queries


def _full_pair(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """``(i, j) -> bool``: the pair needs no band and no ``mask_mod``; None if never known.

    The band's part needs a static alignment (no lengths); the block mask's part
    its states (:func:`_mask_pairs`).
    """
    import jax.numpy as jnp

    plan = skeleton.plan
    band_static = plan.band.restricts and not plan.has_lengths
    if plan.band.restricts and plan.has_lengths:
        return None  # the band's alignment comes from values: never dropped
    _, mask_full = _mask_pairs(skeleton, arrays, grid)
    if not band_static and mask_full is None:
        return None

    def full(i: Any, j: Any) -> Any:
        ok = _full(skeleton, grid, i, j) if band_static else jnp.asarray(True)
        return ok if mask_full is None else jnp.logical_and(ok, mask_full[i, j])

    return full


def _rows(x: Array, grid: _Grid, i: Any) -> Array:
    """Rows of query block `i` of a padded (..., Lq_pad, D) array."""
    return _cut(x, x.ndim - 2, i * grid.bq, grid.bq)


def _unblock(x: Array, length: int) -> Array:
    """(n, ..., b, D) blocks to (..., n*b, D), cut to `length` rows."""
    import jax.numpy as jnp

    x = jnp.moveaxis(x, 0, -3)  # (..., n, b, D)
    x = jnp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
    return x[..., :length, :]


def _merge2(xp: Any, a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
    """Merge two partial results (out, lse) of the same rows exactly.

    Stacks the two (..., bq, Dv) partials: small beside a (..., bq, bk) block of scores.
    """
    return merge_partials(
        xp,
        xp.stack([a[0], b[0]]),
        xp.stack([a[1], b[1]]),
        max_over=lambda x: xp.max(x, axis=0),
        sum_over=lambda x: xp.sum(x, axis=0),
    )


# ---------------------------------------------------------------------------
# forward and backward


def _forward(
    skeleton: AttentionCall, grid: _Grid, arrays: dict[str, Array], *, differentiable: bool = False
) -> tuple[Array, Array]:
    import jax.numpy as jnp
    from jax import lax

    padded = _padded(arrays, grid)
    keys = _key_range(skeleton, arrays, grid)
    full_pair = _full_pair(skeleton, arrays, grid)
    stop = stop_gradient if differentiable else None

    def walk(block: AttentionCall) -> RowWalk:
        return RowWalk.of(block, stop_gradient=stop)

    def pair(i: Any, j: Any, carry: Any) -> Any:
        def run(full: bool) -> Any:
            def compute(c: Any) -> Any:
                block = _block(skeleton, padded, grid, i, j, full=full)
                whole = ((0, grid.bq), (0, grid.bk))
                vis = pair_visibility(block.plan, block.terms, *whole)
                if vis == "skip":  # hidden whatever the traced positions
                    return c
                q_rows = scaled_query_rows(jnp, block.query, block.plan)
                return walk(block).step(RowState(*c), q_rows, *whole, vis)[:3]

            return compute

        if full_pair is None:  # one kind of block: every mask applies
            return run(False)(carry)
        return lax.cond(full_pair(i, j), run(True), run(False), carry)

    def query_block(i: Any) -> Any:
        init = walk(_block(skeleton, padded, grid, i, 0)).carry_start(grid.bq)
        start, stop_at, index = keys(i)
        if not differentiable:  # a loop over the visible key blocks
            state = lax.fori_loop(start, stop_at, lambda t, c: pair(i, index(t), c), init)
        else:

            def step(t: Any, carry: Any) -> Any:  # a fixed trip count, transposable
                visible = jnp.logical_and(t >= start, t < stop_at)
                j = index(jnp.minimum(t, grid.nk - 1))
                return lax.cond(visible, lambda c: pair(i, j, c), lambda c: c, carry)

            state = lax.fori_loop(0, grid.nk, step, init)
        # the dropout scale and the empty-row convention of the whole rows
        return walk(_block(skeleton, padded, grid, i, 0)).finish(RowState(*state), grid.bq)

    outs, lses = lax.map(query_block, jnp.arange(grid.nq))
    out, lse = _unblock(outs, grid.lq), _unblock(lses, grid.lq)
    for name, x in arrays.items():  # a logit of every row with a zero value: the sink
        if field(name).once_per_row is not None:
            sink = (jnp.zeros_like(out), jnp.broadcast_to(x, lse.shape))
            out, lse = _merge2(jnp, (out, lse), sink)
    return out, lse


def _backward(
    skeleton: AttentionCall,
    grid: _Grid,
    arrays: dict[str, Array],
    out: Array,
    lse: Array,
    dout: Array,
    dlse: Array,
) -> dict[str, Array]:
    import jax.numpy as jnp
    from jax import lax

    padded = _padded(arrays, grid)
    queries = _query_range(skeleton, arrays, grid)
    lq_pad = grid.nq * grid.bq
    out_p, dout_p, dlse_p = (_pad_to(x, x.ndim - 2, lq_pad) for x in (out, dout, dlse))
    lse_p = jnp.pad(  # padded rows: no probability (an empty row's lse)
        lse, [(0, 0)] * (lse.ndim - 2) + [(0, lq_pad - grid.lq), (0, 0)], constant_values=-jnp.inf
    )
    grads: dict[str, Array] = {}
    # the sink: p_sink = exp(sink - lse), d sink = -Σ_rows p_sink · (D - dlse), once per row
    delta = jnp.sum(dout * out, axis=-1, keepdims=True) - dlse
    for name, x in arrays.items():
        if field(name).once_per_row is not None:
            grads[name] = sum_to_shape(jnp, -jnp.exp(x - lse) * delta, tuple(x.shape))
    need = tuple(
        n
        for n in arrays
        if field(n).differentiable
        and field(n).once_per_row is None
        and field(n).role is not Role.OPERAND
    )
    summed = [n for n in need if n != "bias"]  # whole and learned: one sum over every pair
    q_pad = _padded({"query": arrays["query"]}, grid)["query"]
    has_bias = "bias" in need
    init = {
        "dq": jnp.zeros_like(q_pad),
        "dbias": jnp.zeros_like(padded["bias"]) if has_bias else None,
        **{n: jnp.zeros_like(arrays[n]) for n in summed},
    }
    k_pad, v_pad = padded["key"], padded["value"]
    full_pair = _full_pair(skeleton, arrays, grid)
    k_blk = (*k_pad.shape[:-2], grid.bk, k_pad.shape[-1])
    v_blk = (*v_pad.shape[:-2], grid.bk, v_pad.shape[-1])

    def key_block(carry: dict[str, Any], j: Any) -> Any:
        start, stop_at, index = queries(j)

        def grads_of(i: Any, full: bool) -> Any:
            def compute(_: Any) -> dict[str, Array]:
                return tiled_backward(
                    _block(skeleton, padded, grid, i, j, full=full),
                    _rows(out_p, grid, i),
                    _rows(lse_p, grid, i),
                    _rows(dout_p, grid, i),
                    grid.bq,
                    grid.bk,
                    need=need,
                    dlse=_rows(dlse_p, grid, i),
                )

            return compute

        def pair(t: Any, c: Any) -> Any:
            i = index(t)
            acc, dk, dv = c
            if full_pair is not None:  # blocks shown in full need no band or mask_mod
                g = lax.cond(full_pair(i, j), grads_of(i, True), grads_of(i, False), None)
            else:
                g = grads_of(i, False)(None)
            acc = dict(acc)
            acc["dq"] = _add_rows(acc["dq"], g["query"], grid.bq * i)
            if has_bias:
                acc["dbias"] = _add_block(acc["dbias"], g["bias"], grid, i, j)
            for n in summed:
                acc[n] = acc[n] + g[n]
            return acc, dk + g["key"], dv + g["value"]

        zeros = (jnp.zeros(k_blk, k_pad.dtype), jnp.zeros(v_blk, v_pad.dtype))
        carry, dk, dv = lax.fori_loop(start, stop_at, pair, (carry, *zeros))
        return carry, (dk, dv)

    carry: Any
    carry, (dks, dvs) = lax.scan(key_block, init, jnp.arange(grid.nk))
    grads["query"] = carry["dq"][..., : grid.lq, :]
    grads["key"] = _unblock(dks, grid.lk)
    grads["value"] = _unblock(dvs, grid.lk)
    if has_bias:
        bias = arrays["bias"]
        dbias = carry["dbias"]
        dbias = dbias[..., : bias.shape[-2], :] if _dim("bias", bias, "lq") is not None else dbias
        grads["bias"] = dbias[..., : bias.shape[-1]]
    for n in summed:
        grads[n] = carry[n]
    return {n: grads.get(n) for n in arrays}


def _add_rows(buf: Array, x: Array, start: Any) -> Array:
    """``buf[..., start:start + b, :] += x`` for a (..., b, D) block."""
    from jax import lax

    d = buf.ndim - 2
    return lax.dynamic_update_slice_in_dim(
        buf, lax.dynamic_slice_in_dim(buf, start, x.shape[d], axis=d) + x, start, axis=d
    )


def _add_block(buf: Array, x: Array, grid: _Grid, i: Any, j: Any) -> Array:
    """Add the bias gradient of pair (i, j) into the padded bias gradient (broadcast axes kept)."""
    from jax import lax

    starts = [0] * buf.ndim
    d = _dim("bias", buf, "lq")
    if d is not None:
        starts[d] = i * grid.bq
    d = _dim("bias", buf, "lk")
    if d is not None:
        starts[d] = j * grid.bk
    current = lax.dynamic_slice(buf, starts, x.shape)
    return lax.dynamic_update_slice(buf, current + x, starts)

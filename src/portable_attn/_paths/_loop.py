"""JAX: the tiled path as a traced loop, so the program and its buffers do not grow with L.

The array API has no loop, so the portable tiled path is a Python loop over
(query block, key block) pairs, which ``jax.jit`` unrolls: every block becomes
nodes of the program and XLA keeps many blocks' buffers alive at once. Here the
same kernel runs inside JAX's structured loops instead:

- queries: ``lax.map`` over the query blocks (a scan: one block body in the
  program, the outputs written into one (nq, ..., bq, Dv) result);
- keys: ``lax.fori_loop`` over the key blocks the query block can see, in order:
  the states of every block pair (``_lib/_blocks.py``, the one answer of every
  path) are computed inside the program from the band and, by value, from the
  lengths, the segment ids and a block mask's states, so a traced call skips
  other documents' blocks too, and pairs shown in full take no structured mask;
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
  their ``Lq``/``Lk`` axes; the padded keys are hidden by the mask (whatever the
  lengths say), the padded query rows are cut off the result;
- a term of every row that belongs to no key (the sink logit, ``once_per_row`` in
  :data:`~portable_attn._lib._fields.FIELDS`) joins each query block's rows when
  they are finished, as in the Python walk (it is in no block);
- the backward is a loop too (a ``jax.custom_vjp``): ``lax.scan`` over the key
  blocks, accumulating dK and dV per key block in the carry and dQ (and the bias
  gradient) into one padded buffer, over the query blocks that see the key block;
  each pair runs the portable :func:`~portable_attn._lib._tiled.tiled_backward`.

A ``score_mod`` is differentiated per block in that backward too, with the traced
arrays it closes over as explicit arguments (:class:`~._autodiff.JaxScoreMod`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._lib._blocks import FULL, PARTIAL, traced_pair_states
from .._lib._call import AttentionCall
from .._lib._compat import forward_mode
from .._lib._fields import Role, axis_of, field
from .._lib._masks import at_rank
from .._lib._path import Tiled
from .._lib._route import library
from .._lib._tiled import (
    Keys,
    OnlineSoftmax,
    Ops,
    RowState,
    ScoreVjp,
    block_ranges,
    sum_to_shape,
    tiled_backward,
)
from ._autodiff import JaxScoreMod
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
    Differentiable with ``jax.grad`` (a custom VJP that loops too), also with respect
    to the traced arrays a ``score_mod`` closes over.
    """
    import jax

    plan = call.plan
    if not isinstance(path.block_q, int) or not isinstance(path.block_k, int):
        msg = f"the traced loop runs blocks of one size, not {path.block_q}, {path.block_k}"
        raise TypeError(msg)
    bq, bk = min(path.block_q, plan.q_len), min(path.block_k, plan.kv_len)
    grid = _Grid(bq, bk, plan.q_len, plan.kv_len)
    arrays, skeleton = call.flatten()
    if plan.kv_len % bk:  # the keys padding the last block: hidden whatever the lengths say
        import jax.numpy as jnp

        valid = jnp.ones((1, plan.kv_len), dtype=jnp.bool_)
        mask = arrays.get("mask")
        if mask is not None:  # of the mask's rank (jax_numpy_rank_promotion="raise")
            valid = jnp.logical_and(mask, at_rank(jnp, valid, mask.ndim))
        arrays["mask"] = valid
    mod = JaxScoreMod.of(call, [(bq, bk)])
    if forward_mode([*arrays.values(), *(mod.params if mod else ())]):
        # its VJP is reverse-mode only: jax.jvp differentiates the loop itself
        return _forward(skeleton, grid, arrays, autodiff=True)

    def with_params(params: tuple[Array, ...]) -> AttentionCall:
        return skeleton if mod is None else mod.into(skeleton, params)

    @jax.custom_vjp
    def attend(arrays: dict[str, Array], params: tuple[Array, ...]) -> tuple[Array, Array]:
        return _forward(with_params(params), grid, arrays)

    def forward(arrays: dict[str, Array], params: tuple[Array, ...]) -> Any:
        out, lse = _forward(with_params(params), grid, arrays)
        return (out, lse), (arrays, params, out, lse)

    def backward(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        arrays, params, out, stats = residuals
        dout, dstats = cotangents
        lse, dlse = stats[..., :1], dstats[..., :1]  # the row max has no gradient
        score_vjp = None if mod is None else mod.vjp(params)
        skeleton_ = with_params(params)
        learned = () if mod is None else tuple(params[i] for i in mod.learned)
        grads = _backward(skeleton_, grid, arrays, out, lse, dout, dlse, score_vjp, learned)
        d_learned = grads.pop("score_params")
        return grads, (() if mod is None else mod.cotangents(d_learned))

    attend.defvjp(forward, backward)
    return attend(arrays, () if mod is None else mod.params)


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
    skeleton: AttentionCall, padded: dict[str, Array], grid: _Grid, i: Any, j: Any
) -> AttentionCall:
    """Build the one-block call of query block `i` and key block `j` (both may be traced)."""
    q_start, kv_start = i * grid.bq, j * grid.bk
    blocks = {}
    for name, x in padded.items():
        x = _cut(x, _dim(name, x, "lq"), q_start, grid.bq)
        blocks[name] = _cut(x, _dim(name, x, "lk"), kv_start, grid.bk)
    call = skeleton.unflatten(blocks, q_len=grid.bq, kv_len=grid.bk)
    return place_block(call, q_start=q_start, kv_start=kv_start, q_total=grid.lq, kv_total=grid.lk)


def _states(skeleton: AttentionCall, arrays: dict[str, Array], grid: _Grid) -> Any:
    """(nq, nk) int8: the state of every block pair (``_lib/_blocks.py``), traced by value."""
    call = skeleton.unflatten(arrays)
    q_ranges, k_ranges = block_ranges(grid.lq, grid.bq), block_ranges(grid.lk, grid.bk)
    return traced_pair_states(call, q_ranges, k_ranges, lambda x: library(x).walk == "traced")


def _visits(visible: Any) -> tuple[Any, Any]:
    """Return ``(count, index)``: visit ``index(t)`` for ``t`` in ``[0, count)``.

    The visible blocks of a row (or column) of the pair states, in order.
    """
    import jax.numpy as jnp

    order = jnp.argsort(jnp.logical_not(visible), stable=True)  # visible blocks first
    return jnp.sum(visible.astype(jnp.int32)), lambda t: order[t]


def _rows(x: Array, grid: _Grid, i: Any) -> Array:
    """Rows of query block `i` of a padded (..., Lq_pad, D) array."""
    return _cut(x, x.ndim - 2, i * grid.bq, grid.bq)


def _unblock(x: Array, length: int) -> Array:
    """(n, ..., b, D) blocks to (..., n*b, D), cut to `length` rows."""
    import jax.numpy as jnp

    x = jnp.moveaxis(x, 0, -3)  # (..., n, b, D)
    x = jnp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
    return x[..., :length, :]


# ---------------------------------------------------------------------------
# forward and backward


def _forward(
    skeleton: AttentionCall, grid: _Grid, arrays: dict[str, Array], autodiff: bool = False
) -> tuple[Array, Array]:
    """Return the loop's (out, lse); `autodiff`: JAX differentiates the loop (the max cut)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    padded = _padded(arrays, grid)
    states = _states(skeleton, arrays, grid)
    cut = jax.lax.stop_gradient if autodiff else None

    def walk(block: AttentionCall) -> OnlineSoftmax:
        return OnlineSoftmax(block, Ops(jnp), stop_gradient=cut)

    def pair(i: Any, j: Any, carry: Any) -> Any:
        def run(full: bool) -> Any:
            def compute(c: Any) -> Any:
                block = _block(skeleton, padded, grid, i, j)
                whole = ((0, grid.bq), (0, grid.bk))
                q_rows = walk(block).ops.query_rows(block.query, block.plan)
                keys = Keys.of(block, block.value)
                return walk(block).step(RowState(*c), q_rows, keys, *whole, full)[:3]

            return compute

        return lax.cond(states[i, j] == FULL, run(True), run(False), carry)

    def query_block(i: Any) -> Any:
        init = walk(_block(skeleton, padded, grid, i, 0)).carry_start(grid.bq)
        count, index = _visits(states[i] != 0)  # a loop over the visible key blocks
        state = lax.fori_loop(0, count, lambda t, c: pair(i, index(t), c), init)
        # the dropout scale, the sink and the empty-row convention of the whole rows
        return walk(_block(skeleton, padded, grid, i, 0)).finish(RowState(*state), grid.bq)

    outs, lses = lax.map(query_block, jnp.arange(grid.nq))
    return _unblock(outs, grid.lq), _unblock(lses, grid.lq)


def _backward(
    skeleton: AttentionCall,
    grid: _Grid,
    arrays: dict[str, Array],
    out: Array,
    lse: Array,
    dout: Array,
    dlse: Array,
    score_vjp: ScoreVjp | None = None,
    params: tuple[Array, ...] = (),
) -> dict[str, Array]:
    """Return the gradients of every field by name, and of the ``score_mod``'s `params`.

    `score_vjp` differentiates the ``score_mod`` per block
    (:meth:`~._autodiff.JaxScoreMod.vjp`); the gradients of `params` (its learned
    arrays) come back as ``"score_params"``.
    """
    import jax.numpy as jnp
    from jax import lax

    padded = _padded(arrays, grid)
    states = _states(skeleton, arrays, grid)
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
            p_row = jnp.exp(at_rank(jnp, x, lse.ndim) - lse)
            grads[name] = sum_to_shape(jnp, -p_row * delta, tuple(x.shape))
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
        "score_params": tuple(jnp.zeros_like(p) for p in params),
    }
    k_pad, v_pad = padded["key"], padded["value"]
    k_blk = (*k_pad.shape[:-2], grid.bk, k_pad.shape[-1])
    v_blk = (*v_pad.shape[:-2], grid.bk, v_pad.shape[-1])

    def key_block(carry: dict[str, Any], j: Any) -> Any:
        count, index = _visits(states[:, j] != 0)

        def grads_of(i: Any, full: bool) -> Any:
            def compute(_: Any) -> dict[str, Array]:
                return tiled_backward(
                    _block(skeleton, padded, grid, i, j),
                    _rows(out_p, grid, i),
                    _rows(lse_p, grid, i),
                    _rows(dout_p, grid, i),
                    grid.bq,
                    grid.bk,
                    need=need,
                    dlse=_rows(dlse_p, grid, i),
                    states=[[FULL if full else PARTIAL]],
                    score_vjp=score_vjp,
                )

            return compute

        def pair(t: Any, c: Any) -> Any:
            i = index(t)
            acc, dk, dv = c
            g = lax.cond(states[i, j] == FULL, grads_of(i, True), grads_of(i, False), None)
            acc = dict(acc)
            acc["dq"] = _add_rows(acc["dq"], g["query"], grid.bq * i)
            if has_bias:
                acc["dbias"] = _add_block(acc["dbias"], g["bias"], grid, i, j)
            for n in summed:
                acc[n] = acc[n] + g[n]
            if params:  # in a fixed order: key blocks, then their query blocks
                acc["score_params"] = _sums(acc["score_params"], g["score_params"])
            return acc, dk + g["key"], dv + g["value"]

        zeros = (jnp.zeros(k_blk, k_pad.dtype), jnp.zeros(v_blk, v_pad.dtype))
        carry, dk, dv = lax.fori_loop(0, count, pair, (carry, *zeros))
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
    return {n: grads.get(n) for n in arrays} | {"score_params": carry["score_params"]}


def _sums(totals: tuple[Array, ...], parts: tuple[Array, ...]) -> tuple[Array, ...]:
    return tuple(t + p for t, p in zip(totals, parts, strict=True))


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

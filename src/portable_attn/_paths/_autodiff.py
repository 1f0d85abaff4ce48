"""The tiled path's recomputing backward, registered with torch autograd and JAX.

Plain autograd through the tiled walk would save every block's probabilities,
which brings back O(Lq·Lk) memory in the backward pass. Here the forward saves
only its inputs, the output and the row log-sum-exp; the backward
(:func:`portable_attn._lib._tiled.tiled_backward`, written once in the array
API) recomputes each block. This is the only module that names torch and JAX
autodiff machinery; both are imported lazily, only for their own arrays.

The arrays of the call travel through the autodiff functions as the call's
:meth:`~portable_attn._lib._call.AttentionCall.flatten` gives them, by name:
the differentiable fields (:data:`~portable_attn._lib._fields.FIELDS`) get
their gradients, the others None. No field is named here.

A ``score_mod`` may close over arrays that learn (a relative-position table, a
per-head temperature). Their gradients come from the same backward: each block's
``score_mod`` is differentiated there (:data:`~portable_attn._lib._tiled.ScoreVjp`)
and the arrays' gradients are summed block by block, in the walk's fixed order.
The arrays are found by running the function, not by reading its closure:

- torch: the tensors that require a gradient and that an operation of the
  ``score_mod`` reads, other than its arguments and what it made itself, seen by a
  ``TorchFunctionMode`` in every block of the forward walk (:class:`TorchReads`),
  which runs before the autograd function: a tensor read only in some blocks (under
  a Python condition on the indices, in one branch) is found as surely as one read
  in every block. They become inputs of the autograd function, which returns the
  walk's result and, in the backward, their gradients. Under the same mode, forward
  and backward, a table read on every axis by integer tensors (``table[h, i - j +
  c]``) is gathered by its rows then its columns and its gradient summed by
  ``index_add_`` (:func:`_gathered`), several times faster than torch's indexing on CPU;
- JAX: the traced values it closes over (under ``jit``, ``grad``, ``vmap``), which
  :class:`JaxScoreMod` finds as the tracers among the constants of its jaxpr, traced
  once per block shape; they become explicit arguments of the ``custom_vjp`` (as
  ``jax.closure_convert`` does, without its cache, which would keep the function),
  the floating ones differentiated. A ``score_mod`` that cannot be traced (Python
  logic on the values of its index arguments, in an eager call) is differentiated
  by JAX's own autodiff of the walk instead, which keeps every block's weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Iterable
from typing import Any

from .._lib._blocks import block_ranges
from .._lib._call import AttentionCall
from .._lib._compat import forward_mode, forward_over_reverse, reads_host_values
from .._lib._fields import field
from .._lib._path import Tiled
from .._lib._scores import score_index
from .._lib._tiled import ScoreVjp, tiled_backward
from ._ops import walk, walk_ops

__all__ = [
    "JaxScoreMod",
    "TorchReads",
    "recomputing_attention",
    "torch_requires_grad",
    "torch_score_vjp",
]


def recomputing_attention(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    """Tiled attention output (..., Hq, Lq, Dv) and row log-sum-exp (..., Hq, Lq, 1).

    Differentiated by the O(L)-memory backward registered with ``path.backward``'s
    library (torch autograd, ``jax.grad``); the lse's cotangent flows back too, and
    so do the gradients of the arrays a ``score_mod`` closes over.
    """
    arrays, skeleton = call.flatten()
    held = forward_over_reverse(arrays.values()) and call.terms.score_mod is None
    if forward_mode(arrays.values()) and not held:
        # forward mode differentiates the walk itself, which keeps nothing for later
        # (reverse mode beside it records the walk, as it records the dense path); torch's
        # forward over reverse keeps the function: its JVP rule differentiates the walk,
        # its backward records a node per pair of blocks (a score_mod's closure has no
        # tangent the rules could take)
        return walk(call, path, autodiff=True)
    if path.backward == "jax":
        blocks = [
            (qe - qs, ke - ks)
            for qs, qe in block_ranges(call.plan.q_len, path.block_q)
            for ks, ke in block_ranges(call.plan.kv_len, path.block_k)
        ]
        mod = JaxScoreMod.of(call, blocks)
        if mod is not None and (not mod.traceable or forward_mode(mod.params)):
            # Python logic on the indices' values: JAX's own autodiff differentiates the
            # eager walk (every block's weights kept, as the dense path does), so what the
            # score_mod reads in any branch gets its gradient; or a tangent reaches only
            # the arrays the score_mod closes over
            return walk(call, path, autodiff=True)
        return _jax_function(skeleton, path, mod)(arrays, mod.params if mod else ())
    import torch

    if not torch.is_grad_enabled():
        return _forward(call, path)  # nothing to record
    result, params = None, ()
    if call.terms.score_mod is not None:  # the walk runs here, watching what it reads
        reads = TorchReads(call.terms.score_mod)
        with torch.no_grad():
            result = _forward(reads.into(call), path)
        params = tuple(reads.found.values())
    tensors = (*arrays.values(), *params)
    if not any(map(torch_requires_grad, tensors)):
        return _forward(call, path) if result is None else result  # nothing to record
    # the walk's in-place operations are safe: the function's forward records nothing
    return _torch_function().apply(skeleton, path, tuple(arrays), result, *tensors)


def torch_requires_grad(x: Any) -> bool:
    """Return whether autograd records operations on tensor `x`, seen through ``torch.func``.

    Inside ``torch.func.vmap`` a tensor is a batched wrapper whose own
    ``requires_grad`` is False even where the tensor it wraps requires a gradient
    (``vmap(f)(q)`` with ``q.requires_grad``, then ``.backward()``): the wrappers
    are looked through, down to the tensor autograd sees (not under ``torch.compile``,
    which traces no wrapper, nor the functions that look through one).
    """
    import torch
    from torch._C import _functorch

    if torch.compiler.is_compiling():
        return bool(x.requires_grad)
    while not x.requires_grad:
        if not _functorch.is_functorch_wrapped_tensor(x):
            return False
        x = _functorch.get_unwrapped(x)
    return True


def _forward(call: AttentionCall, path: Tiled) -> tuple[Any, Any]:
    return walk(call, path)


def _backward(
    call: AttentionCall,
    path: Tiled,
    saved: tuple[Any, Any],
    grads: tuple[Any, Any],
    need: tuple[str, ...],
    score_vjp: ScoreVjp | None = None,
    params: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """Run the portable backward; `grads` are the cotangents of (out, row statistics).

    `params`: the arrays the ``score_mod`` closes over (`score_vjp`'s).

    Only the lse column of the statistics has a gradient (the row max has none).
    """
    out, stats = saved
    dout, dstats = grads
    lse = stats[..., :1]
    dlse = None if dstats is None else dstats[..., :1]
    if dout is None:  # only the lse was used
        dout = call.xp.zeros_like(out)
    return tiled_backward(
        call,
        out,
        lse,
        dout,
        path.block_q,
        path.block_k,
        need=need,
        dlse=dlse,
        score_vjp=score_vjp,
        ops=_backward_ops(path, call.xp, params),
    )


def _backward_ops(path: Tiled, xp: Any, params: tuple[Any, ...]) -> Any:
    """Return the operations of the backward walk: the forward's, recorded at O(L) by torch.

    Where torch records the backward (grad mode on in it: ``create_graph=True``, to be
    differentiated again), each pair of blocks is one node of the record
    (:func:`_recomputed_function`) that keeps the arrays the pair reads and runs the
    pair again in its own backward: the record holds no block's scores, where
    recording the walk's operations would hold every block's (O(Lq·Lk)). `params`:
    the arrays the ``score_mod`` closes over, read by the blocks too.
    """
    ops = walk_ops(path, xp)
    if path.backward != "torch":
        return ops
    import torch

    if torch.is_grad_enabled():
        ops.recorder = functools.partial(_recorded, params=params)
    return ops


def _recorded(
    block: Callable[..., Any],
    args: tuple[Any, ...],
    reads: tuple[Any, ...],
    params: tuple[Any, ...],
) -> Any:
    """Run ``block(*args, *reads)`` as one recorded node (:func:`_recomputed_function`)."""
    if not any(map(torch_requires_grad, (*reads, *params))):
        return block(*args, *reads)
    from torch.utils._pytree import tree_unflatten

    spec = types.SimpleNamespace()  # not a list, which torch.func would take apart
    leaves = _recomputed_function().apply(block, args, spec, len(reads), *reads, *params)
    return tree_unflatten(list(leaves), spec.structure)


@functools.cache
def _recomputed_function() -> Any:
    import torch
    from torch.utils._pytree import tree_flatten

    class Recomputed(torch.autograd.Function):
        """``block(*args, *reads)``, differentiated by running it again.

        Inputs: the block, its arguments, a namespace that receives the structure of
        its result, the number of `reads`, the `reads`, then the arrays the ``score_mod``
        closes over (read from the block's closure); outputs: the tensors of its result.
        The backward runs the block on detached `reads` and takes the gradients of those
        and of the closure's arrays by ``torch.autograd.grad``.
        """

        generate_vmap_rule = True

        @staticmethod
        def forward(block: Any, args: Any, spec: Any, n: int, *tensors: Any) -> Any:
            leaves, spec.structure = tree_flatten(block(*args, *tensors[:n]))
            return tuple(leaves)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            block, args, _, n, *tensors = inputs
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(*tensors)
            ctx.block, ctx.args, ctx.n = block, args, n
            ctx.jvp_reads = tuple(tensors[:n])

        @staticmethod
        def jvp(ctx: Any, *tangents: Any) -> Any:
            # a recorded backward in forward mode (forward over reverse): the pair in
            # forward mode; its tangents, None where the pair returns None
            block, args = ctx.block, ctx.args
            return _tangents_of(
                lambda reads: tuple(tree_flatten(block(*args, *reads))[0]),
                ctx.jvp_reads,
                tangents[4 : 4 + ctx.n],
                tangents[4 + ctx.n :],
            )

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            tensors = ctx.saved_tensors
            reads = [
                x.detach().requires_grad_() if torch_requires_grad(x) else x
                for x in tensors[: ctx.n]
            ]
            with torch.enable_grad():
                leaves, _ = tree_flatten(ctx.block(*ctx.args, *reads))
            pairs = [
                (x, g)
                for x, g in zip(leaves, grads, strict=True)
                if g is not None and x is not None and x.requires_grad
            ]
            inputs = (*reads, *tensors[ctx.n :])
            wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
            d: list[Any] = [None] * len(inputs)
            if pairs and wanted:
                found = torch.autograd.grad(
                    [x for x, _ in pairs],
                    [inputs[i] for i in wanted],
                    [g for _, g in pairs],
                    allow_unused=True,
                    create_graph=torch.is_grad_enabled(),
                )
                for i, g in zip(wanted, found, strict=True):
                    d[i] = g
            return (None, None, None, None, *d)

    return Recomputed


def _tangents_of(
    run: Callable[[list[Any]], tuple[Any, ...]],
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
    closed_over: tuple[Any, ...],
) -> tuple[Any, ...]:
    """Return the tangents of ``run(primals)``'s outputs (None for a None output).

    `tangents`: those of `primals`, None where there is none; `closed_over`: those of
    the arrays a ``score_mod`` closes over, which `run` cannot take (it reads them from
    the closure), so none may be given.
    """
    import torch

    if any(t is not None for t in closed_over):
        msg = "forward over reverse with a score_mod's learned arrays: the walk differentiates it"
        raise NotImplementedError(msg)
    given = [i for i, t in enumerate(tangents) if t is not None]
    kept: list[int] = []

    def of_given(*xs: Any) -> tuple[Any, ...]:
        now = list(primals)
        for i, x in zip(given, xs, strict=True):
            now[i] = x
        out = run(now)
        kept[:] = [i for i, x in enumerate(out) if x is not None]
        kept.append(len(out))
        return tuple(out[i] for i in kept[:-1])

    found = torch.func.jvp(
        of_given, tuple(primals[i] for i in given), tuple(tangents[i] for i in given)
    )[1]
    result: list[Any] = [None] * kept[-1]
    for i, t in zip(kept[:-1], found, strict=True):
        result[i] = t
    return tuple(result)


def _differentiable(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if field(n).differentiable)


# ---------------------------------------------------------------------------
# a score_mod's learned arrays


class TorchReads:
    """A ``score_mod`` that records the tensors requiring a gradient that it reads.

    Each call runs under a ``TorchFunctionMode`` (:func:`_watch`) that sees the
    tensor arguments of every operation: those that require a gradient
    (:func:`torch_requires_grad`), other than the call's own arguments and what the
    call made, are what the ``score_mod`` closes over (a parameter, a table computed
    from one), however it reaches them (a closure, a module attribute, a global).
    Run in every block of the forward walk, it sees every branch the walk (and so
    the recomputing backward) takes. `found`: those tensors by id, in order of first
    use.

    Parameters
    ----------
    score_mod : callable
        The user's ``score_mod``.
    """

    def __init__(self, score_mod: Callable[..., Any]) -> None:
        self.score_mod = score_mod
        self.found: dict[int, Any] = {}

    def __call__(self, scores: Any, *index: Any) -> Any:
        # ids only, no reference: what the call made is freed as it would be without us
        # (a tensor read from outside is alive throughout, so no id of it is reused)
        made = {id(x) for x in (scores, *index) if x is not None}
        with _watch()(made, self.found):
            return self.score_mod(scores, *index)

    def into(self, call: AttentionCall) -> AttentionCall:
        """`call` with this recording ``score_mod`` in place of its own."""
        terms = dataclasses.replace(call.terms, score_mod=self)
        return dataclasses.replace(call, terms=terms)


@functools.cache
def _watch() -> Any:
    """Return the ``TorchFunctionMode`` a ``score_mod`` runs under (forward and backward).

    With `made` and `found` (the forward: :class:`TorchReads`), it records the
    tensors read from outside; always, it computes a gather (``table[h, i - j]``, a
    tensor indexed on every axis by integer tensors) by :func:`_gathered`.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    getitem = torch.Tensor.__getitem__

    class Watch(TorchFunctionMode):
        def __init__(
            self, made: set[int] | None = None, found: dict[int, Any] | None = None
        ) -> None:
            super().__init__()
            self.made, self.found = made, found

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            made, found = self.made, self.found
            if made is not None and found is not None:
                for x in _tensors((args, kwargs), torch.Tensor):
                    if id(x) not in made and torch_requires_grad(x):
                        found.setdefault(id(x), x)
            result = None
            if func is getitem and not kwargs:
                result = _gathered(*args)
            if result is None:
                result = func(*args, **kwargs)
            if made is not None:
                made.update(id(x) for x in _tensors(result, torch.Tensor))
            return result

    return Watch


def _tensors(tree: Any, kind: type) -> Iterable[Any]:
    """Yield the instances of `kind` in `tree`, through its tuples, lists and dicts' values.

    What an operation takes and returns (torch's pytree walk of the same took 3% of a
    training step with a learned table, an operation at a time).
    """
    if isinstance(tree, kind):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x, kind)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x, kind)


def _gathered(x: Any, index: Any) -> Any:
    """Return ``x[index]`` for a CPU tensor indexed on every axis by integer tensors, or None.

    torch computes such a gather (a relative-position table read as
    ``table[h, i - j + L - 1]``) several times slower than ``gather`` on positions,
    and its gradient by a serial ``index_put_`` several times slower than
    ``index_add_`` (:func:`_gather_function`): the same values, and each gradient
    entry summed in a fixed order. The block's positions are not made in full where
    the index of the last axis varies along other axes than the others' (``h``
    (1, H, 1, 1), ``i - j`` (1, 1, bq, bk)): the rows the leading indices pick are
    gathered first (H rows of the table), then the last axis's positions in each,
    so no (H, bq, bk) integer array is computed per block (an int64 broadcast add
    that took 15% of a training step with a learned table, L = 4096). None (torch's
    own indexing) for anything else: slices, boolean masks, fewer indices than axes,
    an index out of range (torch's error), another device (where torch's kernels
    are parallel).
    """
    import numpy as np
    import torch

    index = index if isinstance(index, tuple) else (index,)
    if not isinstance(x, torch.Tensor) or not reads_host_values(x) or len(index) != x.ndim:
        return None
    integers = (torch.int8, torch.int16, torch.int32, torch.int64)  # uint8, bool: masks
    positions: list[Any] = []  # per axis: an int64 tensor or an int, from 0
    for size, i in zip(x.shape, index, strict=True):
        if isinstance(i, torch.Tensor):
            if i.dtype not in integers or i.device != x.device or i.numel() == 0:
                return None
            low, high = (int(m) for m in torch.aminmax(i))
            if low < -size or high >= size:
                return None
            i = i.to(torch.int64)
            if low < 0:  # from the end, as torch reads it
                i = torch.where(i < 0, i + size, i)
        elif isinstance(i, int) and not isinstance(i, bool):
            if not -size <= i < size:
                return None
            i %= size
        else:
            return None
        positions.append(i)
    tensors = [i for i in positions if isinstance(i, torch.Tensor)]
    if not tensors:
        return None
    try:  # NumPy's: torch's own is Python, 100 us a call
        shape = np.broadcast_shapes(*(tuple(i.shape) for i in tensors))
    except ValueError:  # torch's error
        return None
    last, size = positions[-1], x.shape[-1]
    lead: Any = 0  # the row of x.reshape(-1, size) the leading indices pick
    for stride, i in zip(_strides(x.shape[:-1]), positions[:-1], strict=True):
        lead = lead + i * stride
    if not _outer(lead, last, shape):  # the rows vary with the last axis: flat positions
        lead, last, size = 0, last + lead * size, x.numel()
    rows = x.reshape(-1, size)
    picks = torch.as_tensor(lead, dtype=torch.int64).reshape(-1)
    columns = torch.as_tensor(last, dtype=torch.int64).reshape(1, -1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _gather_function().apply(rows, picks, columns).reshape(shape)
    return _gather_rows(rows, picks, columns).reshape(shape)


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides of `shape`, in elements."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return strides[::-1]


def _outer(lead: Any, last: Any, shape: tuple[int, ...]) -> bool:
    """Whether every (`lead`, `last`) pair of the broadcast `shape` is one row-major entry.

    True where the axes along which `lead` varies all come before those of `last`
    (an int varies along none) and between them they cover `shape`: the gather of
    rows then columns, laid out as (rows, columns), is the result in `shape`.
    """

    def axes(i: Any) -> list[int]:
        if isinstance(i, int):
            return []
        offset = len(shape) - i.ndim
        return [offset + a for a, n in enumerate(i.shape) if n != 1]

    lead_axes, last_axes = axes(lead), axes(last)
    if lead_axes and last_axes and max(lead_axes) >= min(last_axes):
        return False
    numel = 1 if isinstance(lead, int) else lead.numel()
    return numel * (1 if isinstance(last, int) else last.numel()) == math.prod(shape)


def _gather_rows(rows: Any, picks: Any, columns: Any) -> Any:
    """``rows[picks][:, columns]``: (len(picks), columns.numel())."""
    return rows.index_select(0, picks).gather(1, columns.expand(len(picks), -1))


@functools.cache
def _gather_function() -> Any:
    import torch

    class Gather(torch.autograd.Function):
        """:func:`_gather_rows`, differentiated by ``index_add_`` on the columns, then the rows."""

        @staticmethod
        def forward(rows: Any, picks: Any, columns: Any) -> Any:
            return _gather_rows(rows, picks, columns)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            rows, picks, columns = inputs
            ctx.save_for_backward(picks, columns)
            ctx.shape = rows.shape

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            picks, columns = ctx.saved_tensors
            picked = grad.new_zeros(len(picks), ctx.shape[1]).index_add_(1, columns[0], grad)
            total = grad.new_zeros(ctx.shape).index_add_(0, picks, picked)
            return total, None, None

    return Gather


def torch_score_vjp(score_mod: Callable[..., Any], params: tuple[Any, ...]) -> ScoreVjp:
    """Return a block's ``score_mod`` and its VJP by ``torch.autograd.grad`` (:data:`ScoreVjp`).

    The ``score_mod`` runs under :func:`_watch` (its gathers computed by :func:`_gathered`).
    Where the backward is itself differentiated (``create_graph=True``: grad mode is on
    in it), the block's scores keep their graph and the pullback records its own, so a
    second derivative reaches the queries, keys and parameters through the ``score_mod``.
    """
    import torch

    def score_vjp(scores: Any, *index: Any) -> tuple[Any, Any]:
        graph = torch.is_grad_enabled()
        with torch.enable_grad(), _watch()():
            leaf = scores if graph and scores.requires_grad else scores.detach().requires_grad_()
            modified = score_mod(leaf, *index)

        def pullback(d_modified: Any) -> tuple[Any, tuple[Any, ...]]:
            inputs = (leaf, *params)
            grads: tuple[Any, ...] = (None,) * len(inputs)
            if modified.requires_grad:
                grads = torch.autograd.grad(
                    modified, inputs, d_modified, allow_unused=True, create_graph=graph
                )
            pairs = zip(inputs, grads, strict=True)
            full = [torch.zeros_like(x) if g is None else g for x, g in pairs]
            return full[0], tuple(full[1:])

        return (modified if graph else modified.detach()), pullback

    return score_vjp


@dataclasses.dataclass(frozen=True)
class JaxScoreMod:
    """A JAX ``score_mod`` with the traced arrays it closes over as explicit parameters.

    Traced once per block shape (``jax.make_jaxpr``); the tracers among each jaxpr's
    constants are the parameters (`params`, the same for every shape), the other
    constants stay; the floating ones (`learned`) receive gradients. A ``score_mod``
    that closes over no traced array, or cannot be traced (Python logic on concrete
    values, in an eager call: `traceable` False), is kept as it is (`forms` empty).
    :meth:`bind` gives the ``score_mod`` of other values of the parameters (a
    ``custom_vjp``'s own arguments), :meth:`vjp` its per-block VJP.
    """

    original: Callable[..., Any]
    #: (bq, bk) -> (jaxpr, constants, ((constant index, parameter index), ...))
    forms: dict[tuple[int, int], tuple[Any, list[Any], tuple[tuple[int, int], ...]]]
    params: tuple[Any, ...]
    learned: tuple[int, ...]
    traceable: bool = True

    @classmethod
    def of(cls, call: AttentionCall, blocks: Iterable[tuple[int, int]]) -> JaxScoreMod | None:
        """Trace `call`'s ``score_mod`` for each (bq, bk) of `blocks`; None without one."""
        score_mod = call.terms.score_mod
        if score_mod is None:
            return None
        import jax
        import numpy as np

        params: list[Any] = []
        where: dict[int, int] = {}
        forms = {}
        # the scores' batch is that of Q and K (V may broadcast wider)
        batch = np.broadcast_shapes(call.query.shape[:-3], call.key.shape[:-3])
        for bq, bk in dict.fromkeys(blocks):
            index = score_index(call.xp, call.terms, call.plan, (0, bq), (0, bk))
            scores = jax.ShapeDtypeStruct(
                (*batch, call.plan.num_q_heads, bq, bk), call.plan.compute_dtype
            )
            try:
                closed = jax.make_jaxpr(score_mod)(scores, *index)
            except TypeError:  # Python logic on concrete values: it runs as it is
                return cls(score_mod, {}, (), (), traceable=False)
            slots = []
            for i, c in enumerate(closed.consts):
                if isinstance(c, jax.core.Tracer):
                    if id(c) not in where:
                        where[id(c)] = len(params)
                        params.append(c)
                    slots.append((i, where[id(c)]))
            forms[(bq, bk)] = (closed.jaxpr, list(closed.consts), tuple(slots))
        if not params:  # nothing traced to hand over: the function as it is
            return cls(score_mod, {}, (), ())
        learned = tuple(
            i for i, p in enumerate(params) if jax.numpy.issubdtype(p.dtype, jax.numpy.inexact)
        )
        return cls(score_mod, forms, tuple(params), learned)

    def bind(self, params: tuple[Any, ...]) -> Callable[..., Any]:
        """Return the ``score_mod`` with `params` in place of the traced arrays it closes over."""
        if not self.forms:
            return self.original
        import jax

        def score_mod(scores: Any, *index: Any) -> Any:
            jaxpr, consts, slots = self.forms[tuple(scores.shape[-2:])]
            consts = list(consts)
            for i, p in slots:
                consts[i] = params[p]
            return jax.core.eval_jaxpr(jaxpr, consts, scores, *index)[0]

        return score_mod

    def vjp(self, params: tuple[Any, ...]) -> ScoreVjp:
        """Return a block's ``score_mod`` of `params` and its VJP by ``jax.vjp``.

        The pullback gives the gradients of the `learned` parameters (the floating ones).
        """
        import jax

        def score_vjp(scores: Any, *index: Any) -> tuple[Any, Any]:
            def modify(s: Any, learned: tuple[Any, ...]) -> Any:
                values = list(params)
                for i, x in zip(self.learned, learned, strict=True):
                    values[i] = x
                return self.bind(tuple(values))(s, *index)

            return jax.vjp(modify, scores, tuple(params[i] for i in self.learned))

        return score_vjp

    def cotangents(self, learned: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Return the ``custom_vjp`` cotangents of every parameter from the learned ones'.

        None for the others (integer arrays); zeros where no block was visited (None).
        """
        import jax.numpy as jnp

        if learned is None:
            learned = tuple(jnp.zeros_like(self.params[i]) for i in self.learned)
        out: list[Any] = [None] * len(self.params)
        for i, g in zip(self.learned, learned, strict=True):
            out[i] = g
        return tuple(out)

    def into(self, call: AttentionCall, params: tuple[Any, ...]) -> AttentionCall:
        """`call` with the ``score_mod`` of `params` (:meth:`bind`)."""
        terms = dataclasses.replace(call.terms, score_mod=self.bind(params))
        return dataclasses.replace(call, terms=terms)


@functools.cache
def _torch_function() -> Any:
    import torch

    class TiledAttention(torch.autograd.Function):
        # forward / setup_context / backward are written separately and the vmap rule
        # is generated, so torch.func.grad, jacrev and vmap can transform it too.
        # Inputs: the call's arrays by `names`, then the score_mod's parameters; `result`:
        # the walk's (out, lse) where it ran before (with a score_mod), else None.
        generate_vmap_rule = True

        @staticmethod
        def forward(skeleton: Any, path: Any, names: Any, result: Any, *tensors: Any) -> Any:
            if result is not None:  # the walk ran already (a score_mod's, watched)
                return result
            call = skeleton.unflatten(dict(zip(names, tensors, strict=False)))
            return _forward(call, path)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            skeleton, path, names, _, *tensors = inputs
            ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
            ctx.save_for_backward(*tensors[: len(names)], *output)
            ctx.skeleton, ctx.path, ctx.names = skeleton, path, names
            ctx.params = tuple(tensors[len(names) :])  # read by the score_mod's own closure
            ctx.jvp_primals = tuple(tensors[: len(names)])

        @staticmethod
        def jvp(ctx: Any, *tangents: Any) -> Any:
            # forward over reverse (torch.func.jvp of torch.func.grad): the walk itself in
            # forward mode, at O(L); no call with a score_mod comes here
            names, primals = ctx.names, ctx.jvp_primals
            return _tangents_of(
                lambda arrays: walk(
                    ctx.skeleton.unflatten(dict(zip(names, arrays, strict=True))),
                    ctx.path,
                    autodiff=True,
                ),
                primals,
                tangents[4 : 4 + len(names)],
                tangents[4 + len(names) :],
            )

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
            *arrays, out, lse = ctx.saved_tensors
            names, params = ctx.names, ctx.params
            if dout is None and dlse is None:
                return (None,) * (4 + len(names) + len(params))
            wanted = ctx.needs_input_grad[4 : 4 + len(names)]
            need = _differentiable(tuple(n for n, w in zip(names, wanted, strict=True) if w))
            call = ctx.skeleton.unflatten(dict(zip(names, arrays, strict=True)))
            score_vjp = None
            if call.terms.score_mod is not None:
                score_vjp = torch_score_vjp(call.terms.score_mod, params)
            g = _backward(call, ctx.path, (out, lse), (dout, dlse), need, score_vjp, params)
            d_params = g.get("score_params", (None,) * len(params))
            return (None, None, None, None, *(g.get(n) for n in names), *d_params)

    return TiledAttention


def _jax_function(skeleton: AttentionCall, path: Tiled, mod: JaxScoreMod | None) -> Any:
    import jax

    def call_of(arrays: dict[str, Any], params: tuple[Any, ...]) -> AttentionCall:
        call = skeleton.unflatten(arrays)
        return call if mod is None else mod.into(call, params)

    @jax.custom_vjp
    def attend(arrays: dict[str, Any], params: tuple[Any, ...]) -> Any:
        return _forward(call_of(arrays, params), path)

    def forward(arrays: dict[str, Any], params: tuple[Any, ...]) -> Any:
        out, lse = _forward(call_of(arrays, params), path)
        return (out, lse), (arrays, params, out, lse)

    def backward(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        arrays, params, out, lse = residuals
        need = _differentiable(tuple(arrays))
        score_vjp = None if mod is None else mod.vjp(params)
        g = _backward(call_of(arrays, params), path, (out, lse), cotangents, need, score_vjp)
        d_params = () if mod is None else mod.cotangents(g.get("score_params"))
        return {n: g.get(n) for n in arrays}, d_params

    attend.defvjp(forward, backward)
    return attend

"""FlexAttention-style masks on every backend: ``mask_mod`` and a reusable block mask.

A ``mask_mod(batch, head, q_idx, kv_idx) -> bool array`` says which queries may
attend to which keys, written with array-API operations on broadcasting index
arrays of one rank (``batch`` (B, 1, 1, 1), ``head`` (1, H, 1, 1), ``q_idx``
(1, 1, bq, 1), ``kv_idx`` (1, 1, 1, bk): raw positions, FlexAttention's convention;
no rank promotion, so JAX's ``jax_numpy_rank_promotion="raise"`` is fine).
:func:`create_block_mask`
evaluates it once, tile by tile, into a :class:`BlockMask`: per (batch, head,
query block, key block) whether the block is hidden (not computed at all),
partially visible (computed, the mask evaluated) or fully visible (computed, no
mask work). One block mask serves every call of a batch (every layer of a model):

>>> import numpy as np
>>> from portable_attn import scaled_dot_product_attention
>>> from portable_attn.block_mask import and_masks, create_block_mask
>>> doc = np.repeat(np.arange(4), 64)                      # 4 documents of 64 tokens
>>> def same_doc(b, h, q_idx, kv_idx):
...     return doc[q_idx] == doc[kv_idx]
>>> def causal(b, h, q_idx, kv_idx):
...     return q_idx >= kv_idx
>>> bm = create_block_mask(and_masks(same_doc, causal), None, None, 256, 256, block_size=32)
>>> bm.visible_fraction(), bm.sparsity()
(0.1875, 81.25)
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 256, 16))
>>> scaled_dot_product_attention(q, k, v, block_mask=bm).shape
(1, 2, 256, 16)

Positions are raw indices: ``q_idx >= kv_idx`` is top-left aligned causal. The
library's ``is_causal`` is bottom-right aligned (``kv_idx <= q_idx + Lk - Lq``);
the two agree when ``Lq == Lk``.
"""

from __future__ import annotations

import numbers
from typing import Any

from ._lib import _route
from ._lib import _validation as v
from ._lib._block_states import (
    FULL,
    HIDDEN,
    PARTIAL,
    BlockMask,
    MaskMod,
    block_index,
    build_states,
)
from ._lib._compat import array_namespace, namespace_or_numpy, numpy_namespace, on_device
from ._lib._cpu import available_workers
from ._lib._rules import (
    Band,
    Both,
    Chunk,
    Document,
    Either,
    MaskRule,
    Opaque,
    Prefix,
    Rule,
    combine_mask_mods,
    ids_in,
    replace_offset,
    rule_states,
)
from ._paths._threads import tile_map

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FULL",
    "HIDDEN",
    "PARTIAL",
    "BlockMask",
    "MaskRule",
    "and_masks",
    "causal_mask_mod",
    "chunked_mask_mod",
    "create_block_mask",
    "document_mask_mod",
    "or_masks",
    "prefix_lm_mask_mod",
    "sliding_window_mask_mod",
]

Array = Any

#: FlexAttention's default block size (the router's ``DEFAULT_MASK_BLOCK``).
DEFAULT_BLOCK_SIZE = _route.DEFAULT_MASK_BLOCK


def create_block_mask(
    mask_mod: MaskMod,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    *,
    block_size: int | tuple[int, int] | None = None,
    xp: Any = None,
    device: Any = None,
) -> BlockMask:
    """Evaluate `mask_mod` tile by tile into a :class:`BlockMask`.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(batch, head, q_idx, kv_idx) -> bool array`` broadcasting to
        (B, H, bq, bk), from ``batch`` (B, 1, 1, 1), ``head`` (1, H, 1, 1), ``q_idx``
        (1, 1, bq, 1) and ``kv_idx`` (1, 1, 1, bk): raw positions (FlexAttention's
        convention).
        True where the query may attend to the key.
        A ready rule (:func:`causal_mask_mod` ...) is aligned to `q_len` and `kv_len`
        (bottom-right, not to a call's ``q_lengths`` / ``kv_lengths``), and a positional
        one gets its states from arithmetic on the block bounds, without evaluating it.
    batch, heads : int or None
        The batch size (the flat number of sequences, for several batch axes) and
        query heads the mask differs over; None: the same for every sequence /
        head (the mask is built once, for index 0, and broadcasts).
    q_len, kv_len : int
        Number of queries and keys.
    block_size : int or (int, int), optional
        Query and key block sizes; default 128 (FlexAttention's).
    xp : namespace, optional
        The array library to evaluate `mask_mod` with (the one its closed-over
        arrays belong to); default NumPy.
    device : device, optional
        Where to evaluate it.

    Returns
    -------
    BlockMask
        States (B | 1, H | 1, ceil(Lq / bq), ceil(Lk / bk)), built in tiles of whole
        blocks of at most 4 Mi booleans in all, over every (batch, head) the rule
        differs over (NumPy: one thread per core): O(block) memory, never the
        (Lq, Lk) mask.

    Raises
    ------
    TypeError
        `mask_mod` not callable or returning a non-boolean array.
    ValueError
        Negative lengths, non-positive sizes, a result that does not broadcast.
    """
    v.check_mask_mod(mask_mod)
    xp = namespace_or_numpy(xp, caller="create_block_mask")
    for name, n in (("batch", batch), ("heads", heads)):
        if n is not None:
            v.check_count(name, n, minimum=1)
    q_len = v.check_count("q_len", q_len, minimum=0)
    kv_len = v.check_count("kv_len", kv_len, minimum=0)
    block = v.check_block_pair("block_size", block_size, DEFAULT_BLOCK_SIZE)
    if isinstance(mask_mod, MaskRule):  # aligned to these lengths; a call given both drops it
        aligned = mask_mod.aligned(q_len, kv_len)
        if aligned.rule.positional:
            aligned.source = mask_mod  # type: ignore[attr-defined]
            return _positional(aligned, xp, batch, heads, q_len, kv_len, block, device)
        target = (
            f"create_block_mask evaluates the rule with `xp` = {xp.__name__}: pass the "
            "namespace of the ids as `xp=` (and their `device=`), or NumPy ids"
        )
        aligned = MaskRule(ids_in(aligned.rule, xp, device, target), aligned.__name__)
        aligned.source = mask_mod  # type: ignore[attr-defined]
        mask_mod = aligned
    b, h = batch or 1, heads or 1
    batch_index = xp.reshape(xp.arange(0, b, **on_device(device)), (b, 1, 1, 1))

    def check(result: Array, shape: tuple[int, ...]) -> None:
        v.check_mask_mod_result(xp, result, shape)

    if (batch is None or heads is None) and q_len and kv_len:
        _check_broadcast_axes(xp, mask_mod, batch, heads, block, q_len, kv_len, device)
    workers = available_workers() if _route.library(batch_index).threads else 1
    rule = v.guarded_rule("mask_mod", mask_mod)
    states = build_states(
        xp, rule, batch_index, h, q_len, kv_len, block, device, check, tile_map(workers)
    )
    return BlockMask(states, mask_mod, q_len, kv_len, block)


def _positional(
    rule: MaskRule,
    xp: Any,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    block: tuple[int, int],
    device: Any,
) -> BlockMask:
    """Build the block mask of an aligned positional rule by arithmetic on block bounds."""
    host = rule_states(numpy_namespace(), rule.rule, 0, q_len, kv_len, block)
    states = xp.reshape(xp.asarray(host, **on_device(device)), (1, 1, *host.shape))
    states = xp.broadcast_to(states, (batch or 1, heads or 1, *host.shape))
    return BlockMask(states, rule, q_len, kv_len, block)


def _check_broadcast_axes(
    xp: Any,
    mask_mod: MaskMod,
    batch: int | None,
    heads: int | None,
    block: tuple[int, int],
    q_len: int,
    kv_len: int,
    device: Any,
) -> None:
    """Raise where `mask_mod` differs over a batch or head index it was told it does not.

    A block mask built for index 0 alone (``batch=None`` / ``heads=None``) would skip
    the blocks that index 0 hides for every sequence and head. Checked on the first
    block, for indices 0 and 1 of each axis given as None.
    """
    nb, nh = (2 if batch is None else batch), (2 if heads is None else heads)
    kw = on_device(device)
    b = xp.reshape(xp.arange(0, nb, **kw), (nb, 1, 1, 1))
    first = (min(block[0], q_len), min(block[1], kv_len))
    index = block_index(xp, b, nh, (0, first[0]), (0, first[1]), device)
    try:
        result = xp.broadcast_to(mask_mod(*index), (nb, nh, *first))
    except Exception:  # a rule that fails here: the build raises its errors, checked
        return
    for name, given, axis, what in (
        ("batch", batch, 0, "sequences"),
        ("heads", heads, 1, "query heads"),
    ):
        if given is not None:
            continue
        first = xp.take(result, xp.asarray([0], **kw), axis=axis)
        second = xp.take(result, xp.asarray([1], **kw), axis=axis)
        if not bool(xp.all(first == second)):
            msg = (
                f"`mask_mod` depends on its {name} index (on the first block, index 0 and 1 "
                f"differ) but `{name}` is None, which builds one block mask for index 0 "
                f"alone: pass {name}=<the number of {what}>"
            )
            raise ValueError(msg)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a ``mask_mod`` True where every one of `mask_mods` is (True without any)."""
    return _combine("and_masks", mask_mods, all_of=True)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a ``mask_mod`` True where any of `mask_mods` is (False without any)."""
    return _combine("or_masks", mask_mods, all_of=False)


def _combine(name: str, mask_mods: tuple[MaskMod, ...], *, all_of: bool) -> MaskMod:
    for i, mod in enumerate(mask_mods):
        v.check_mask_mod(mod, name=f"{name} argument {i}")
    names = ", ".join(getattr(m, "__name__", type(m).__name__) for m in mask_mods)
    if any(isinstance(m, MaskRule) for m in mask_mods):  # a rule: the combination is one
        parts = tuple(m.rule if isinstance(m, MaskRule) else Opaque(m) for m in mask_mods)
        return MaskRule(Both(parts) if all_of else Either(parts), f"{name}({names})")

    def constant(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        return (q_idx >= 0) if all_of else (q_idx < 0)  # True / False, (1, 1, bq, 1)

    combined = combine_mask_mods(list(mask_mods), all_of=all_of) if mask_mods else constant
    combined.__name__ = f"{name}({names})"
    return combined


# ---------------------------------------------------------------------------
# ready rules


def causal_mask_mod(*, offset: int | None = None) -> MaskRule:
    """Causal: the query at aligned position ``p`` sees the keys ``j <= p``.

    Parameters
    ----------
    offset : int, optional
        None (default): ``p = i + Lk - Lq`` from the call's lengths, bottom-right like
        ``is_causal`` (with ``q_lengths`` / ``kv_lengths``, the valid lengths), so one
        query decoding over a cache sees the whole cache. An int: ``p = i + offset``
        (``offset=0`` is FlexAttention's and PyTorch's top-left ``q_idx >= kv_idx``).

    Returns
    -------
    MaskRule
        A ``mask_mod`` the call lowers to ``is_causal`` (the same route and speed) at
        ``offset=None``; at another offset, to a window where it can express it.
    """
    return _rule(Band(None, 0), "causal_mask_mod", offset)


def sliding_window_mask_mod(
    left: int | None, right: int | None = 0, *, offset: int | None = None
) -> MaskRule:
    """Sliding window: the query at ``p`` sees the keys ``p - left <= j <= p + right``.

    The call's ``window=(left, right)`` as a rule; a None side is unbounded. Lowered to
    the call's band, so blocks outside the window are skipped on every path.

    Parameters
    ----------
    left, right : int or None
        Keys before and after the query's position it sees (``right=0``: causal).
    offset : int, optional
        As in :func:`causal_mask_mod`.
    """
    sides = [
        None if w is None else v.check_count(n, w, minimum=0)
        for n, w in (("left", left), ("right", right))
    ]
    return _rule(Band(*sides), f"sliding_window_mask_mod({left}, {right})", offset)


def chunked_mask_mod(chunk_size: int, *, offset: int | None = None) -> MaskRule:
    """Chunked local attention (Llama 4): the query at ``p`` sees the keys of its chunk.

    Key ``j`` is visible iff ``j // chunk_size == p // chunk_size``. Not causal by
    itself: combine with ``is_causal=True`` (or ``and_masks(causal_mask_mod(), ...)``)
    for Llama 4's chunked layers. Blocks of other chunks are skipped on every path
    (their states come from arithmetic on the block bounds, also under ``jax.jit``).

    Parameters
    ----------
    chunk_size : int
        Positions per chunk, > 0.
    offset : int, optional
        As in :func:`causal_mask_mod`.
    """
    size = v.check_count("chunk_size", chunk_size, minimum=1)
    return _rule(Chunk(size), f"chunked_mask_mod({size})", offset)


def prefix_lm_mask_mod(prefix_length: int, *, offset: int | None = None) -> MaskRule:
    """Prefix-LM: every query sees the first `prefix_length` keys, and causally after them.

    Key ``j`` is visible iff ``j < prefix_length`` or ``j <= p``.

    Parameters
    ----------
    prefix_length : int
        Keys seen by every query (bidirectional prefix), >= 0.
    offset : int, optional
        As in :func:`causal_mask_mod`.
    """
    n = v.check_count("prefix_length", prefix_length, minimum=0)
    return _rule(Prefix(n), f"prefix_lm_mask_mod({n})", offset)


def document_mask_mod(
    q_segment_ids: Array, kv_segment_ids: Array | None = None, *, offset: int | None = None
) -> MaskRule:
    """Document masking: a query sees the keys of its own document (packed sequences).

    Parameters
    ----------
    q_segment_ids : integer array, shape (L,) or (B, L)
        Without `kv_segment_ids`: the document of every position (``L >= Lk``); a key's
        is read at ``j``, a query's at its aligned position ``p``.
        With `kv_segment_ids`: the document of every query row (``L = Lq``).
    kv_segment_ids : integer array, shape (Lk,) or (B, Lk), optional
        The document of every key.
    offset : int, optional
        As in :func:`causal_mask_mod` (used with one array only).

    Returns
    -------
    MaskRule
        Lowered to the call's ``q_segment_ids`` / ``kv_segment_ids``, which skip the
        block pairs of two documents.

    Notes
    -----
    The ids are arrays of the call's library, or NumPy arrays (a tokenizer's), which
    a call over another library (torch, JAX, Dask, ...) copies to its query's library
    and device, alone or inside :func:`and_masks` / :func:`or_masks`; so does
    :func:`create_block_mask` to its `xp` and `device`.
    """
    for name, ids in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if ids is None:
            continue
        xp = array_namespace(**{name: ids})
        if not xp.isdtype(ids.dtype, "integral") or ids.ndim not in (1, 2):
            msg = (
                f"document_mask_mod: `{name}` must be an integer array of shape (L,) or "
                f"(B, L), but got shape {tuple(ids.shape)} and dtype {ids.dtype}"
            )
            raise TypeError(msg)
    if kv_segment_ids is not None and offset is not None:
        msg = (
            "document_mask_mod: `offset` applies to one array of ids (read at the query's "
            "position); with `kv_segment_ids`, a query's id is read at its row: drop `offset`"
        )
        raise ValueError(msg)
    return _rule(Document(q_segment_ids, kv_segment_ids), "document_mask_mod", offset)


def _rule(rule: Rule, name: str, offset: int | None) -> MaskRule:
    if offset is not None:
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
            msg = f"`offset` must be None or an integer, but got {offset!r}"
            raise TypeError(msg)
        offset = int(offset)
        rule = replace_offset(rule, offset)
    return MaskRule(rule, name if offset is None else f"{name}[offset={offset}]")

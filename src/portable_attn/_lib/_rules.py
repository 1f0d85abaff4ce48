"""Ready mask rules: what each one allows, what it says of blocks, and how a call lowers it.

A rule sees a query at its *aligned* position ``p = i + offset`` (``offset`` None: the
call's own alignment, bottom-right, ``Lk - Lq``, or per sequence with lengths) and a key
at ``j``:

- :class:`Band` ``(left, right)``: ``p - left <= j <= p + right`` (a None side unbounded);
  causal is ``Band(None, 0)``;
- :class:`Chunk` ``(size)``: ``j // size == p // size`` (Llama 4's chunked attention);
- :class:`Prefix` ``(length)``: ``j < length or j <= p`` (prefix-LM);
- :class:`Document` ``(q_ids, kv_ids)``: equal document ids;
- :class:`Both` / :class:`Either`: AND / OR of rules (a plain ``mask_mod`` is an
  :class:`Opaque` part).

:func:`lower` turns a call's rule into the structure the engine already skips: bands
into the call's ``window`` / ``is_causal``, one document into its segment ids, and the
rest into a ``mask_mod`` whose block states come from :meth:`Rule.blocks` (arithmetic
on block bounds, on the host, for every library and under ``jax.jit``), so no mask is
ever evaluated to decide which blocks to visit. Evaluation (:meth:`Rule.allowed`) is
array-API standard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from array_api_compat import is_numpy_array

from ._block_states import FULL, HIDDEN, PARTIAL, HostStates
from ._compat import array_namespace, device, library_name, numpy_namespace, on_device
from ._masks import Band as Positions  # the band's arithmetic, on positions
from ._masks import at_rank, take_at

__all__ = [
    "Band",
    "Both",
    "Chunk",
    "Document",
    "Either",
    "Lowered",
    "MaskRule",
    "Opaque",
    "Prefix",
    "Rule",
    "RuleStates",
    "combine_mask_mods",
    "ids_in",
    "lower",
    "lower_arguments",
    "lower_call",
    "rule_states",
]

Array = Any


class Rule:
    """A mask rule over aligned query positions and key positions.

    ``offset``: None (the call's alignment) or an int (query ``i`` at ``i + offset``).
    """

    offset: int | None = None

    #: whether :meth:`blocks` answers from positions alone (no values, no opaque parts)
    positional = True

    def allowed(self, xp: Any, batch: Array, head: Array, q_pos: Array, k_pos: Array) -> Array:
        """Return whether the query at aligned position `q_pos` may see the key at `k_pos`."""
        raise NotImplementedError

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        """``(hidden, full)`` of blocks with aligned query positions ``[q_lo, q_hi]``.

        NumPy integer arrays, broadcasting (nq, 1) with (1, nk); both bounds inclusive.
        """
        raise NotImplementedError

    def leaves(self) -> tuple[Rule, ...]:
        """Return the parts of a top-level AND (the rule itself otherwise)."""
        return (self,)

    def shifted(self, default: Any) -> Callable[..., Array]:
        """Return the ``mask_mod`` of this rule with `default` as its unset offsets.

        `default`: an int, or integer array (*batch, 1, 1, 1) (per-sequence alignment).
        """
        offset = default if self.offset is None else self.offset

        def mask_mod(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            xp = array_namespace(q_idx=q_idx)
            return self.allowed(xp, batch, head, _at(q_idx, offset), kv_idx)

        return mask_mod


def _at(q_idx: Array, offset: Any) -> Array:
    """Aligned positions of raw query rows: ``q_idx + offset`` (an int, or per sequence)."""
    return offset(q_idx) if callable(offset) else q_idx + offset


@dataclass(frozen=True)
class Band(Rule):
    """``p - left <= j <= p + right``; a None side is unbounded."""

    left: int | None
    right: int | None
    offset: int | None = None

    def allowed(self, xp: Any, batch: Array, head: Array, q_pos: Array, k_pos: Array) -> Array:
        ok = xp.logical_and(q_pos == q_pos, k_pos == k_pos)  # True, (.., bq, bk)
        return ok & Positions(self.left, self.right).between(q_pos, k_pos)

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        return Positions(self.left, self.right).blocks(q_lo, q_hi, k_lo, k_hi)


@dataclass(frozen=True)
class Chunk(Rule):
    """``j // size == p // size``: a query sees the keys of its own chunk of positions."""

    size: int
    offset: int | None = None

    def allowed(self, xp: Any, batch: Array, head: Array, q_pos: Array, k_pos: Array) -> Array:
        return (q_pos // self.size) == (k_pos // self.size)

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        c = self.size
        q_first, q_last, k_first, k_last = q_lo // c, q_hi // c, k_lo // c, k_hi // c
        hidden = (q_last < k_first) | (k_last < q_first)
        full = (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
        return hidden, full


@dataclass(frozen=True)
class Prefix(Rule):
    """``j < length or j <= p``: the prefix seen by all, causal after it."""

    length: int
    offset: int | None = None

    def allowed(self, xp: Any, batch: Array, head: Array, q_pos: Array, k_pos: Array) -> Array:
        return xp.logical_or(k_pos < self.length, k_pos <= q_pos)

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        hidden = (k_lo >= self.length) & (k_lo > q_hi)
        full = (k_hi < self.length) | (k_hi <= q_lo)
        return hidden, full


@dataclass(frozen=True, eq=False)
class Document(Rule):
    """Equal document ids: ``q_ids[p] == kv_ids[j]``.

    One array (`kv_ids` None): the document of every position, read at ``p`` for a
    query and at ``j`` for a key. Two arrays: the query's id is read at its row ``i``
    (the offset does not apply) and the key's at ``j``. Ids (L,) or (B, L).
    """

    q_ids: Array
    kv_ids: Array | None = None
    offset: int | None = None

    positional = False

    def allowed(self, xp: Any, batch: Array, head: Array, q_pos: Array, k_pos: Array) -> Array:
        raise NotImplementedError  # evaluated by shifted(): rows or positions

    def shifted(self, default: Any) -> Callable[..., Array]:
        offset = default if self.offset is None else self.offset
        own, kv_ids = (True, self.q_ids) if self.kv_ids is None else (False, self.kv_ids)

        def mask_mod(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
            xp = array_namespace(q_idx=q_idx)
            q_pos = _at(q_idx, offset) if own else q_idx
            q_doc, inside = _read(xp, self.q_ids, q_pos)  # (*batch, 1, bq, 1)
            k_doc, k_inside = _read(xp, kv_ids, xp.reshape(kv_idx, (-1,))[:, None])
            k_doc = xp.matrix_transpose(k_doc)  # (*batch, 1, 1, bk)
            k_inside = xp.matrix_transpose(k_inside)
            parts = _one_rank(xp, q_doc, k_doc, inside, k_inside)
            return xp.logical_and(xp.logical_and(parts[0] == parts[1], parts[2]), parts[3])

        return mask_mod

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        return False, False  # values: nothing known from positions (sound in AND and OR)


def _read(xp: Any, ids: Array, pos: Array) -> tuple[Array, Array]:
    """Ids (L,) or (*batch, L) at positions `pos`, clipped into range, and whether in range.

    `pos` is one row of positions, (..., n, 1) with every leading axis of size one,
    or (*batch, 1, n, 1) per sequence; the ids come back as (*batch | 1, 1, n, 1).
    """
    length = ids.shape[-1]
    inside = xp.logical_and(pos >= 0, pos < length)
    where = xp.clip(pos, 0, length - 1)
    n = where.shape[-2]
    if ids.ndim == 1:  # one row of ids: positions of any shape
        return take_at(xp, ids, where), inside
    if math.prod(where.shape[:-2]) == 1:  # one row of positions for every sequence's ids
        got = xp.take(ids, xp.reshape(where, (-1,)), axis=-1)  # (*batch, n)
        return xp.reshape(got, (*got.shape[:-1], 1, n, 1)), inside
    # per sequence: each sequence's ids at its positions, read from the flat table
    batch = where.shape[:-3]
    table = xp.reshape(xp.broadcast_to(ids, (*batch, length)), (-1,))
    count = table.shape[0] // length
    steps = xp.arange(0, count, dtype=where.dtype, **on_device(device(where)))
    start = xp.reshape(steps * length, (*batch, 1, 1, 1))
    return take_at(xp, table, where + start), inside


@dataclass(frozen=True)
class Opaque(Rule):
    """A plain ``mask_mod`` in a combination: raw positions, no offset, no block answer."""

    mask_mod: Callable[..., Array]

    positional = False

    def shifted(self, default: Any) -> Callable[..., Array]:
        return self.mask_mod

    def blocks(self, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
        return False, False  # nothing known (sound in AND and OR)


@dataclass(frozen=True)
class Both(Rule):
    """AND of `parts`."""

    parts: tuple[Rule, ...]

    @property
    def positional(self) -> bool:  # type: ignore[override]
        return all(p.positional for p in self.parts)

    def leaves(self) -> tuple[Rule, ...]:
        return tuple(leaf for p in self.parts for leaf in p.leaves())

    def shifted(self, default: Any) -> Callable[..., Array]:
        return combine_mask_mods([p.shifted(default) for p in self.parts], all_of=True)


@dataclass(frozen=True)
class Either(Rule):
    """OR of `parts`."""

    parts: tuple[Rule, ...]

    @property
    def positional(self) -> bool:  # type: ignore[override]
        return all(p.positional for p in self.parts)

    def shifted(self, default: Any) -> Callable[..., Array]:
        return combine_mask_mods([p.shifted(default) for p in self.parts], all_of=False)


def combine_mask_mods(mods: list[Callable[..., Array]], *, all_of: bool) -> Callable[..., Array]:
    """Return the ``mask_mod`` that is the AND (`all_of`) or OR of `mods` (at least one)."""

    def mask_mod(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        xp = array_namespace(q_idx=q_idx)
        result = mods[0](batch, head, q_idx, kv_idx)
        for mod in mods[1:]:
            result, part = _one_rank(xp, result, mod(batch, head, q_idx, kv_idx))
            result = xp.logical_and(result, part) if all_of else xp.logical_or(result, part)
        return result

    return mask_mod


# ---------------------------------------------------------------------------
# the block answer of a positional rule at static offsets


class RuleStates:
    """:class:`~._block_states.HostStates` of a rule, from block bounds alone.

    Built for the block size a path asks for (cached per size): O(nq · nk), no mask
    evaluated, the same on the host for every library, traced or not. Exact for a
    positional rule; for one with values (documents, plain functions) sound but coarse
    (what positions alone show: :meth:`Rule.blocks` of such a part knows nothing).
    """

    def __init__(self, rule: Rule, default: int, q_len: int, kv_len: int) -> None:
        self._rule, self._default = rule, default
        self._lengths = (q_len, kv_len)
        self._built: dict[tuple[int, int], HostStates] = {}

    def built(self, block: tuple[int, int]) -> HostStates:
        """Return the states in blocks of `block` (cached)."""
        block = (max(1, block[0]), max(1, block[1]))
        if block not in self._built:
            states = rule_states(
                numpy_namespace(), self._rule, self._default, *self._lengths, block
            )
            self._built[block] = HostStates(states[None, None], block)
        return self._built[block]


def rule_states(
    ns: Any, rule: Rule, default: Any, q_len: int, kv_len: int, block: tuple[int, int]
) -> Any:
    """(..., nq, nk) int8 states of `rule` in namespace `ns`: HIDDEN, PARTIAL or FULL.

    `default`: the offset of the parts without one: an int, or per sequence an integer
    array (..., 1, 1) (the states then have its leading axes).
    """
    (bq, bk), (lq, lk) = block, (q_len, kv_len)
    ones = (1,) * (getattr(default, "ndim", 2) - 2)  # the bounds at the offsets' rank
    q_start = np.arange(0, lq, bq).reshape(*ones, -1, 1)
    k_start = np.arange(0, lk, bk).reshape(*ones, 1, -1)
    q_stop = np.minimum(q_start + bq, lq) - 1
    k_stop = np.minimum(k_start + bk, lk) - 1
    hidden, full = _blocks_at(rule, default, q_start, q_stop, k_start, k_stop)
    lead = tuple(getattr(default, "shape", ())[:-2])
    shape = (*lead, q_start.shape[-2], k_start.shape[-1])
    hidden = ns.broadcast_to(ns.asarray(hidden), shape)
    full = ns.broadcast_to(ns.asarray(full), shape)
    states = ns.where(hidden, HIDDEN, ns.where(full, FULL, PARTIAL))
    return ns.astype(states, ns.int8)


def _blocks_at(
    rule: Rule, default: Any, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any
) -> tuple[Any, Any]:
    """:meth:`Rule.blocks` of raw query rows, each part at its own offset."""
    if isinstance(rule, (Both, Either)):
        first = isinstance(rule, Either)
        hidden: Any = first
        full: Any = not first
        for part in rule.parts:
            h, f = _blocks_at(part, default, q_lo, q_hi, k_lo, k_hi)
            hidden, full = (hidden & h, full | f) if first else (hidden | h, full & f)
        return hidden, full
    offset = default if rule.offset is None else rule.offset
    return rule.blocks(q_lo + offset, q_hi + offset, k_lo, k_hi)


# ---------------------------------------------------------------------------
# lowering a call's rule


@dataclass(frozen=True)
class Lowered:
    """What a call's rule becomes: the call's band, segment ids and a residual rule."""

    window: tuple[int | None, int | None] | None
    is_causal: bool
    q_segment_ids: Any
    kv_segment_ids: Any
    mask_mod: Callable[..., Array] | None


def lower(
    rule: Rule,
    q_len: int,
    kv_len: int,
    *,
    is_causal: bool,
    window: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    offset: Any,
) -> Lowered:
    """Lower `rule` into the call's structure (see the module docstring).

    `offset` is the call's alignment ``i' - i``: ``Lk - Lq``, or an integer array
    (*batch, 1, 1, 1) with lengths. A band at the call's alignment joins `window`
    (exactly: the window is aligned the same way); a band at another static offset
    joins it shifted, where that keeps both sides non-negative. One document joins
    as the segment ids (when the call has none). What is left is a ``mask_mod``
    carrying its block answer (:func:`_with_states`).
    """
    static = isinstance(offset, int)
    bands: list[tuple[int | None, int | None]] = []
    rest: list[Rule] = []
    ids = (q_segment_ids, kv_segment_ids)
    for leaf in rule.leaves():
        band = _as_window(leaf, offset) if isinstance(leaf, Band) else None
        if band is not None:
            bands.append(band)
            continue
        if isinstance(leaf, Document) and ids[0] is None and ids[1] is None and static:
            found = _as_segments(leaf, q_len, kv_len, offset)
            if found is not None:
                ids = found
                continue
        rest.append(leaf)
    if bands:
        window = _intersect([window, *bands])
        if window == (None, 0) and not is_causal:
            window, is_causal = None, True
    residual = None
    if rest:
        left = rest[0] if len(rest) == 1 else Both(tuple(rest))
        residual = _with_states(left.shifted(offset), left, offset, q_len, kv_len)
    return Lowered(window, is_causal, ids[0], ids[1], residual)


def _as_window(band: Band, offset: Any) -> tuple[int | None, int | None] | None:
    """`band` as the call's ``window``, or None where it is not expressible."""
    if band.offset is None:
        return band.left, band.right
    if not isinstance(offset, int):
        return None
    d = band.offset - offset  # the band's queries sit d positions right of the call's
    left = None if band.left is None else band.left - d
    right = None if band.right is None else band.right + d
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None
    return left, right


def _intersect(windows: list[Any]) -> tuple[int | None, int | None] | None:
    lefts = [w[0] for w in windows if w is not None and w[0] is not None]
    rights = [w[1] for w in windows if w is not None and w[1] is not None]
    if not lefts and not rights:
        return None
    return (min(lefts) if lefts else None, min(rights) if rights else None)


def _as_segments(doc: Document, q_len: int, kv_len: int, offset: int) -> tuple[Any, Any] | None:
    """Return a document's ids as the call's segment ids (static slices), or None."""
    if doc.kv_ids is not None:
        if doc.q_ids.shape[-1] != q_len or doc.kv_ids.shape[-1] != kv_len:
            return None
        return doc.q_ids, doc.kv_ids
    shift = offset if doc.offset is None else doc.offset
    ids = doc.q_ids
    if shift < 0 or shift + q_len > ids.shape[-1] or ids.shape[-1] < kv_len:
        return None
    return ids[..., shift : shift + q_len], ids[..., :kv_len]


def _with_states(
    mask_mod: Callable[..., Array], rule: Rule, offset: Any, q_len: int, kv_len: int
) -> Callable[..., Array]:
    """`mask_mod` carrying what arithmetic on block bounds says of `rule`'s blocks.

    ``block_states``: exact states at a static alignment (every offset known);
    ``rough_states``: sound ones of a rule with values (documents, plain functions),
    for where the rule cannot be evaluated on the host; ``length_states(xp, block)``:
    per-sequence states from the lengths, for a traced program.
    """

    def ruled(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        return mask_mod(batch, head, q_idx, kv_idx)

    static = isinstance(offset, int)
    if static or not _unset(rule):
        states = RuleStates(rule, offset if static else 0, q_len, kv_len)
        name = "block_states" if rule.positional else "rough_states"
        setattr(ruled, name, states)
    else:  # aligned by the lengths: per sequence, by value

        def length_states(xp: Any, block: tuple[int, int]) -> Any:
            return rule_states(xp, rule, offset.per_sequence(xp), q_len, kv_len, block)

        ruled.length_states = length_states  # type: ignore[attr-defined]
    return ruled


def replace_offset(rule: Rule, offset: int | None) -> Rule:
    """`rule` with every unset offset set to `offset` (combinations part by part)."""
    if isinstance(rule, (Both, Either)):
        return dataclasses.replace(
            rule, parts=tuple(replace_offset(p, offset) for p in rule.parts)
        )
    if isinstance(rule, Opaque) or rule.offset is not None:
        return rule
    return dataclasses.replace(rule, offset=offset)  # type: ignore[type-var]


# ---------------------------------------------------------------------------
# the public object


class MaskRule:
    """A ready ``mask_mod``: a rule the call aligns, lowered to what the engine skips.

    Built by :mod:`portable_attn.block_mask`'s ``*_mask_mod`` functions and combined
    with ``and_masks`` / ``or_masks``. Pass it as ``mask_mod=`` (the call aligns it
    and lowers it), or to ``create_block_mask`` (aligned to its ``q_len``, ``kv_len``).
    Called directly, as a FlexAttention ``mask_mod``, every part needs a position:
    give ``offset=`` or use :meth:`aligned`.
    """

    def __init__(self, rule: Rule, name: str) -> None:
        self.rule = rule
        self.__name__ = name

    def aligned(self, q_len: int, kv_len: int) -> MaskRule:
        """Return this rule with every unset offset at ``kv_len - q_len`` (bottom-right)."""
        return MaskRule(replace_offset(self.rule, kv_len - q_len), self.__name__)

    @property
    def needs_alignment(self) -> bool:
        """Whether some part has ``offset=None`` (aligned by the call)."""
        return _unset(self.rule)

    def __call__(self, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        if self.needs_alignment:
            msg = (
                f"{self.__name__} aligns query positions bottom-right from the call's Lq and "
                "Lk, which a direct call does not know: pass it as mask_mod= to the attention "
                "call or to create_block_mask, or use rule.aligned(q_len, kv_len) or offset="
            )
            raise TypeError(msg)
        return self.rule.shifted(0)(batch, head, q_idx, kv_idx)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaskRule) and self.rule == other.rule

    def __hash__(self) -> int:
        return hash(self.rule)

    def __repr__(self) -> str:
        return self.__name__


def _unset(rule: Rule) -> bool:
    if isinstance(rule, (Both, Either)):
        return any(_unset(p) for p in rule.parts)
    return not isinstance(rule, Opaque) and rule.offset is None


def ids_in(rule: Rule, xp: Any, dev: Any, target: str) -> Rule:
    """`rule` with its documents' ids in namespace `xp` on device `dev`.

    NumPy ids are host values (a tokenizer's): they are copied there. Ids of another
    library raise a :class:`TypeError` naming ``document_mask_mod``'s argument;
    `target` says what evaluates the rule and what to do (the rest of that message).
    """
    if isinstance(rule, (Both, Either)):
        parts = tuple(ids_in(p, xp, dev, target) for p in rule.parts)
        if all(new is old for new, old in zip(parts, rule.parts, strict=True)):
            return rule
        return dataclasses.replace(rule, parts=parts)
    if not isinstance(rule, Document):
        return rule
    moved = [
        ids if ids is None else _ids_to(name, ids, xp, dev, target)
        for name, ids in (("q_segment_ids", rule.q_ids), ("kv_segment_ids", rule.kv_ids))
    ]
    if moved[0] is rule.q_ids and moved[1] is rule.kv_ids:
        return rule
    return dataclasses.replace(rule, q_ids=moved[0], kv_ids=moved[1])


def _ids_to(name: str, ids: Array, xp: Any, dev: Any, target: str) -> Array:
    if array_namespace(**{name: ids}) is xp:
        return ids
    if is_numpy_array(ids):  # host ids: copied to the query's library and device
        return xp.asarray(ids, **on_device(dev))
    msg = f"document_mask_mod: `{name}` is a {library_name(ids)} array, but {target}"
    raise TypeError(msg)


def lower_call(
    given: dict[str, Any], q_len: int, kv_len: int, *, like: Any = None
) -> dict[str, Any]:
    """Return the attention call's keywords with a :class:`MaskRule` `mask_mod` lowered.

    Bands join ``window`` / ``is_causal``, one document the segment ids, the rest stays
    a ``mask_mod`` with its block answer. A `block_mask` built from the rule carries it
    (the rule is dropped). Other calls are returned as they are. `like`: the call's
    query, whose library and device documents' NumPy ids are copied to (:func:`ids_in`).
    """
    rule = given.get("mask_mod")
    if not isinstance(rule, MaskRule):
        return given
    block_mask = given.get("block_mask")
    if block_mask is not None and getattr(block_mask.mask_mod, "source", None) == rule:
        return {**given, "mask_mod": None}
    if like is not None:
        lib = library_name(like)
        target = f"the call's `query` is a {lib} array: pass NumPy or {lib} ids"
        tree = ids_in(rule.rule, array_namespace(query=like), device(like), target)
        rule = rule if tree is rule.rule else MaskRule(tree, rule.__name__)
    if block_mask is not None:
        return {**given, "mask_mod": rule}
    q_lengths, kv_lengths = given.get("q_lengths"), given.get("kv_lengths")
    offset: Any = kv_len - q_len
    if q_lengths is not None or kv_lengths is not None:
        offset = _LengthOffset(q_lengths, kv_lengths, q_len, kv_len)
    for doc in _documents(rule.rule):
        _check_document(doc, q_len, kv_len)
    low = lower(
        rule.rule,
        q_len,
        kv_len,
        is_causal=given.get("is_causal", False),
        window=given.get("window"),
        q_segment_ids=given.get("q_segment_ids"),
        kv_segment_ids=given.get("kv_segment_ids"),
        offset=offset,
    )
    return {
        **given,
        "window": low.window,
        "is_causal": low.is_causal,
        "q_segment_ids": low.q_segment_ids,
        "kv_segment_ids": low.kv_segment_ids,
        "mask_mod": low.mask_mod,
    }


def lower_arguments(given: dict[str, Any], query: Any, key: Any) -> dict[str, Any]:
    """Return :func:`lower_call` of `given` at the lengths of `query` and `key`.

    Inputs without a sequence axis are left to the checks, which say what is wrong.
    """
    if not isinstance(given.get("mask_mod"), MaskRule):
        return given
    if getattr(query, "ndim", 0) < 2 or getattr(key, "ndim", 0) < 2:
        return given
    return lower_call(given, int(query.shape[-2]), int(key.shape[-2]), like=query)


class _LengthOffset:
    """Rows aligned by ``kv_len[b] - q_len[b]``: (bq, 1) -> (*batch, 1, bq, 1).

    The lengths are read when a block is evaluated, after the call checked them.
    """

    def __init__(self, q_lengths: Any, kv_lengths: Any, q_len: int, kv_len: int) -> None:
        self._args = (q_lengths, kv_lengths, q_len, kv_len)

    def per_sequence(self, xp: Any) -> Array:
        """``kv_len[b] - q_len[b]`` as (*batch, 1, 1) integers (for block states)."""
        rows = self(xp.zeros((1, 1), dtype=xp.int32))  # (*batch, 1, 1, 1)
        return xp.reshape(rows, rows.shape[:-1])

    def __call__(self, positions: Array) -> Array:
        q_lengths, kv_lengths, q_len, kv_len = self._args
        xp = array_namespace(positions=positions)
        kv = kv_len if kv_lengths is None else _column(xp, kv_lengths, positions.dtype)
        q = q_len if q_lengths is None else _column(xp, q_lengths, positions.dtype)
        positions, shift = _one_rank(xp, positions, kv - q)  # (*batch, 1, bq, 1)
        return positions + shift


def _one_rank(xp: Any, *arrays: Array) -> list[Array]:
    """`arrays` lifted to the largest rank among them (no implicit rank promotion).

    A ``mask_mod``'s indices, a user's ``mask_mod`` result and the lengths' columns
    may differ in rank; JAX with ``jax_numpy_rank_promotion="raise"`` refuses to
    broadcast those (see :func:`~._masks.at_rank`). Python scalars pass unchanged.
    """
    rank = max(getattr(a, "ndim", 0) for a in arrays)
    return [at_rank(xp, a, rank) if hasattr(a, "ndim") else a for a in arrays]


def _column(xp: Any, lengths: Array, dtype: Any) -> Array:
    return xp.reshape(xp.astype(lengths, dtype), (*lengths.shape, 1, 1, 1))


def _documents(rule: Rule) -> list[Document]:
    if isinstance(rule, (Both, Either)):
        return [d for p in rule.parts for d in _documents(p)]
    return [rule] if isinstance(rule, Document) else []


def _check_document(doc: Document, q_len: int, kv_len: int) -> None:
    kv_ids = doc.q_ids if doc.kv_ids is None else doc.kv_ids
    name = "q_segment_ids" if doc.kv_ids is None else "kv_segment_ids"
    if kv_ids.shape[-1] < kv_len or (doc.kv_ids is not None and kv_ids.shape[-1] != kv_len):
        msg = (
            f"document_mask_mod: `{name}` has {kv_ids.shape[-1]} positions on its last axis "
            f"(shape {tuple(kv_ids.shape)}) but the call has Lk={kv_len} keys"
        )
        raise ValueError(msg)
    if doc.kv_ids is not None and doc.q_ids.shape[-1] != q_len:
        msg = (
            f"document_mask_mod: `q_segment_ids` has shape {tuple(doc.q_ids.shape)}, whose last "
            f"axis must be the call's Lq={q_len} (with kv_segment_ids, a query's id is read at "
            "its row)"
        )
        raise ValueError(msg)

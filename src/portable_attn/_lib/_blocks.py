"""Which (query block, key block) pairs a call visits, and which of them need a mask.

The one answer, for every driver: the Python and buffered walks, NumPy's threads,
the traced JAX loop (by value, traced), the native kernel per tile and Dask's chunk
pairs. For query ranges ``[qs, qe)`` and key ranges ``[ks, ke)`` it gives one state
per pair:

- :data:`SKIP` (0): nothing of the pair is visible; it is not computed at all;
- :data:`PARTIAL` (1): computed, every mask applied;
- :data:`FULL` (2): computed without the structured masks -- the causal / window band,
  the lengths, the segment ids and a ``mask_mod`` show every entry (the caller's
  `mask`, bias and score terms, which have no structure, still apply).

The state is the least of what each structured term says of the pair, per sequence:
the band (from the alignment, static or per sequence with lengths), the lengths
(keys past ``kv_len``, rows past ``q_len``), the segment ids (the id ranges of the two
blocks) and the block states of a ``mask_mod`` (its block mask, or states built on
the host). A pair is skipped only if every sequence (and head) hides it, full only
if every one shows it all.

The values a term needs (lengths, ids, states) are read where they are free: on the
host (:func:`host_pair_states`: NumPy, torch CPU outside transforms), or traced
inside a JAX program (:func:`traced_pair_states`). Where they are neither (a device
or a lazy array), the term says :data:`PARTIAL` everywhere: nothing is skipped by
its values, nothing is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._compat import (
    is_compiling,
    is_traced,
    numpy_namespace,
    reads_host_values,
    to_host,
)
from ._path import Blocks

if TYPE_CHECKING:
    from ._call import AttentionCall

__all__ = [
    "FULL",
    "PARTIAL",
    "SKIP",
    "block_ranges",
    "host_pair_states",
    "may_skip",
    "traced_pair_states",
]

SKIP, PARTIAL, FULL = 0, 1, 2

Range = tuple[int, int]
Read = Callable[[Any], Any]


def block_ranges(length: int, size: Blocks) -> list[Range]:
    """Half-open ranges covering ``[0, length)``.

    An int gives blocks of `size` (the last one may be shorter); a tuple gives
    consecutive blocks of those sizes, which must add up to `length`.
    """
    if isinstance(size, int):
        return [(start, min(start + size, length)) for start in range(0, length, size)]
    ends = [sum(size[: i + 1]) for i in range(len(size))]
    if not ends or ends[-1] != length:
        msg = f"block sizes {size} do not add up to the length {length}"
        raise ValueError(msg)
    return [(end - n, end) for n, end in zip(size, ends, strict=True) if n > 0]


def may_skip(call: AttentionCall) -> bool:
    """Whether any structured term could hide or fully show a pair (else all PARTIAL/FULL)."""
    terms = call.terms
    return (
        call.plan.band.restricts
        or terms.q_lengths is not None
        or terms.kv_lengths is not None
        or terms.q_segments is not None
        or terms.mask_mod is not None
    )


def host_pair_states(
    call: AttentionCall, q_ranges: Sequence[Range], k_ranges: Sequence[Range]
) -> list[list[int]]:
    """Return the state of every (query range, key range) pair, decided on the host.

    ``states[i][j]`` is the state of query range `i` and key range `j`. Values are
    read where that is free (:func:`~._compat.reads_host_values`); a term whose
    values are not is :data:`PARTIAL` everywhere. While ``torch.compile`` traces
    (which reads no value, and would trace NumPy into its graph) the band alone
    decides, in Python arithmetic.
    """
    if is_compiling(call.query):
        return _band_states(call, q_ranges, k_ranges)

    def read(x: Any) -> Any:
        return np.asarray(to_host(x)) if reads_host_values(x) else None

    ns = numpy_namespace()
    return np.asarray(_states(ns, call, q_ranges, k_ranges, read, host=True)).tolist()


def _band_states(
    call: AttentionCall, q_ranges: Sequence[Range], k_ranges: Sequence[Range]
) -> list[list[int]]:
    """Return the band's states with a static alignment, every other term PARTIAL."""
    plan, terms = call.plan, call.terms
    offset = None if plan.has_lengths else plan.offset
    others = PARTIAL if may_skip(call) and (terms.mask_mod is not None or _hides(terms)) else FULL
    names = {"skip": SKIP, "partial": PARTIAL, "full": FULL}
    return [
        [min(names[plan.band.visibility(qr, kr, offset)], others) for kr in k_ranges]
        for qr in q_ranges
    ]


def _hides(terms: Any) -> bool:
    return any(x is not None for x in (terms.q_lengths, terms.kv_lengths, terms.q_segments))


def traced_pair_states(
    call: AttentionCall,
    q_ranges: Sequence[Range],
    k_ranges: Sequence[Range],
    in_program: Callable[[Any], bool],
) -> Any:
    """Return the states of :func:`host_pair_states` as a (nq, nk) JAX array, by value.

    Lengths, segment ids and block states that are the program's own arrays
    (`in_program`: JAX's, traced or not, by the router's table) are read by value
    inside the program; host arrays are read on the host.
    """
    import jax.numpy as jnp

    def read(x: Any) -> Any:
        if in_program(x):
            return x
        return jnp.asarray(to_host(x)) if reads_host_values(x) else None

    return _states(jnp, call, q_ranges, k_ranges, read, host=False)


def _states(
    ns: Any,
    call: AttentionCall,
    q_ranges: Sequence[Range],
    k_ranges: Sequence[Range],
    read: Read,
    *,
    host: bool,
) -> Any:
    """:func:`host_pair_states` in namespace `ns` (NumPy's or ``jax.numpy``), values by `read`."""
    nq, nk = len(q_ranges), len(k_ranges)
    if not may_skip(call):
        return ns.full((nq, nk), FULL, dtype=ns.int8)
    # (1, nq, 1) and (1, 1, nk): the rank of the per-sequence terms (N | 1, nq, nk)
    qs, qe = (ns.asarray(np.array([r[i] for r in q_ranges]).reshape(1, -1, 1)) for i in (0, 1))
    ks, ke = (ns.asarray(np.array([r[i] for r in k_ranges]).reshape(1, 1, -1)) for i in (0, 1))
    hidden, full = _sequence_terms(ns, call, q_ranges, k_ranges, qs, qe, ks, ke, read)
    shape = (max(hidden.shape[0], full.shape[0]), nq, nk)
    hidden = ns.reshape(ns.broadcast_to(hidden, shape), shape)
    full = ns.reshape(ns.broadcast_to(full, shape), shape)
    state = ns.where(
        ns.all(hidden, axis=0), SKIP, ns.where(ns.all(full, axis=0), FULL, PARTIAL)
    )  # (nq, nk)
    mask = _mask_term(ns, call, q_ranges, k_ranges, host=host)
    if mask is not None:
        state = ns.minimum(state, mask)
    return ns.astype(state, ns.int8)


def _sequence_terms(
    ns: Any,
    call: AttentionCall,
    q_ranges: Sequence[Range],
    k_ranges: Sequence[Range],
    qs: Any,
    qe: Any,
    ks: Any,
    ke: Any,
    read: Read,
) -> tuple[Any, Any]:
    """``(hidden, full)`` per sequence, (N | 1, nq, nk) bool: band, lengths, segment ids.

    A term whose values cannot be read leaves `full` False (nothing shown in full).
    """
    plan, terms = call.plan, call.terms
    hidden: Any = ns.zeros((1, 1, 1), dtype=ns.bool)
    full: Any = ns.ones((1, 1, 1), dtype=ns.bool)
    q_lengths = _per_sequence(ns, read, terms.q_lengths)
    kv_lengths = _per_sequence(ns, read, terms.kv_lengths)
    known = (terms.q_lengths is None or q_lengths is not None) and (
        terms.kv_lengths is None or kv_lengths is not None
    )
    band = plan.band
    if band.restricts:
        offset = _offset(call, q_lengths, kv_lengths) if known else None
        if offset is None:
            full = ns.zeros((1, 1, 1), dtype=ns.bool)
        else:
            band_hidden, band_full = band.blocks(qs + offset, qe - 1 + offset, ks, ke - 1)
            hidden, full = hidden | band_hidden, full & band_full  # (N | 1, nq, nk)
    for given, values, starts, stops in (
        (terms.kv_lengths, kv_lengths, ks, ke),
        (terms.q_lengths, q_lengths, qs, qe),
    ):
        if given is None:
            continue
        if values is None:
            full = ns.zeros((1, 1, 1), dtype=ns.bool)
            continue
        hidden = hidden | (starts >= values)  # past the valid prefix
        full = full & (stops <= values)
    if terms.q_segments is not None:
        q_ids = _ids(ns, read, terms.q_segments, plan.batch, plan.q_len)
        kv_ids = _ids(ns, read, terms.kv_segments, plan.batch, plan.kv_len)
        if q_ids is None or kv_ids is None:
            full = ns.zeros((1, 1, 1), dtype=ns.bool)
        else:
            q_lo, q_hi = _block_bounds(ns, q_ids, q_ranges)  # (N, nq)
            k_lo, k_hi = _block_bounds(ns, kv_ids, k_ranges)  # (N, nk)
            q_lo, q_hi = q_lo[:, :, None], q_hi[:, :, None]
            k_lo, k_hi = k_lo[:, None, :], k_hi[:, None, :]
            hidden = hidden | (q_hi < k_lo) | (k_hi < q_lo)
            one = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
            full = full & one
    return hidden, full


def _per_sequence(ns: Any, read: Read, x: Any) -> Any:
    """Lengths (*batch, 1, 1, 1) as (N, 1, 1) values, or None (not given, or unreadable)."""
    if x is None:
        return None
    values = read(x)
    return None if values is None else ns.reshape(values, (-1, 1, 1))


def _offset(call: AttentionCall, q_lengths: Any, kv_lengths: Any) -> Any:
    """``i' - i``: the plan's static offset, or per sequence (N, 1, 1) with lengths."""
    plan = call.plan
    if not plan.has_lengths:
        return plan.offset
    align = plan.align
    q_start = 0 if align is None else align.q_start
    kv_start = 0 if align is None else align.kv_start
    q_total = plan.q_len if align is None or align.q_total is None else align.q_total
    kv_total = plan.kv_len if align is None or align.kv_total is None else align.kv_total
    if any(is_traced(s) or not isinstance(s, int) for s in (q_start, kv_start)):
        return None  # a part at traced positions: its alignment is read by nobody
    kv = kv_total - kv_start if kv_lengths is None else kv_lengths
    q = q_total - q_start if q_lengths is None else q_lengths
    return kv - q


def _ids(ns: Any, read: Read, ids: Any, batch: tuple[int, ...], length: int) -> Any:
    """Segment ids (*batch, 1, Lq, 1) or (*batch, 1, 1, Lk) as (N, L) values, or None."""
    values = read(ids)
    if values is None:
        return None
    values = ns.reshape(values, (*values.shape[:-3], length))
    return ns.reshape(ns.broadcast_to(values, (*batch, length)), (-1, length))


def _block_bounds(ns: Any, ids: Any, ranges: Sequence[Range]) -> tuple[Any, Any]:
    """Return the least and largest id of each range, (N, n) each."""
    starts = [s for s, _ in ranges]
    size = ranges[0][1] - ranges[0][0]
    uniform = size > 0 and all(s == i * size for i, s in enumerate(starts))
    if uniform and ranges[-1][1] == ids.shape[1] and all(e - s == size for s, e in ranges[:-1]):
        n = len(ranges)
        pad = n * size - ids.shape[1]
        if pad:  # the last id repeated: the last block's bounds do not change
            ids = ns.concat([ids, ns.broadcast_to(ids[:, -1:], (ids.shape[0], pad))], axis=1)
        blocks = ns.reshape(ids, (ids.shape[0], n, size))
        return ns.min(blocks, axis=-1), ns.max(blocks, axis=-1)
    lows = [ns.min(ids[:, s:e], axis=1) for s, e in ranges]
    highs = [ns.max(ids[:, s:e], axis=1) for s, e in ranges]
    return ns.stack(lows, axis=1), ns.stack(highs, axis=1)


def _mask_term(
    ns: Any,
    call: AttentionCall,
    q_ranges: Sequence[Range],
    k_ranges: Sequence[Range],
    *,
    host: bool,
) -> Any:
    """Return what a ``mask_mod``'s block states say of each pair, (nq, nk), or None.

    States of any block size are read at the pairs' absolute positions: a pair is
    hidden only if every state block it overlaps is, full only if every one is.
    Without readable states: PARTIAL.
    """
    terms, plan = call.terms, call.plan
    if terms.mask_mod is None:
        return None
    align = plan.align
    q0 = 0 if align is None else align.q_start
    k0 = 0 if align is None else align.kv_start
    if not (isinstance(q0, int) and isinstance(k0, int)):
        return PARTIAL  # a part at traced positions
    some_every = _some_every(ns, terms, q_ranges, k_ranges, host=host)
    if some_every is None:
        return PARTIAL
    some, every, (mq, mk) = some_every
    oq = ns.asarray(_overlaps([(s + q0, e + q0) for s, e in q_ranges], mq, some.shape[0]))
    ok = ns.asarray(_overlaps([(s + k0, e + k0) for s, e in k_ranges], mk, some.shape[1]))
    shown = (oq @ ns.astype(some, ns.float32) @ ok.T) > 0  # (nq, nk): visible state blocks
    partly = (oq @ ns.astype(~every, ns.float32) @ ok.T) > 0
    return ns.where(shown, ns.where(partly, PARTIAL, FULL), SKIP)


def _some_every(
    ns: Any, terms: Any, q_ranges: Sequence[Range], k_ranges: Sequence[Range], *, host: bool
) -> tuple[Any, Any, tuple[int, int]] | None:
    """Return the state blocks shown at all / in full by every (batch, head), and their size."""
    source = terms.block_host
    if source is not None:  # host states (a block mask's, or built here from the mask_mod)
        block = (q_ranges[0][1] - q_ranges[0][0], k_ranges[0][1] - k_ranges[0][0])
        states = source.built(block)
        if states is None:  # a rule whose values cannot be read
            return None
        return ns.asarray(states.some), ns.asarray(states.every), states.block
    if host or terms.block_states is None:
        return None
    states = terms.block_states  # traced, (*batch | 1, Hq | 1, nq, nk)
    lead = tuple(range(states.ndim - 2))
    some = ns.any(states != 0, axis=lead)
    every = ns.all(states == FULL, axis=lead)
    return some, every, terms.state_block


def _overlaps(ranges: Sequence[Range], block: int, count: int) -> np.ndarray:
    """(n, count) 0/1 float32: which state blocks of `block` positions each range overlaps."""
    starts = np.array([s for s, _ in ranges]).reshape(-1, 1)
    stops = np.array([max(s + 1, e) for s, e in ranges]).reshape(-1, 1)
    idx = np.arange(count).reshape(1, -1)
    return ((idx >= starts // block) & (idx <= (stops - 1) // block)).astype(np.float32)

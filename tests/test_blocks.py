"""The one answer to which block pairs a call visits (``portable_attn._lib._blocks``).

Against brute force: a pair is SKIP exactly when no entry of it is visible in any
sequence and head (whatever the structured terms can tell), FULL only when the
structured terms show every entry, and the answer read on the host equals the one
traced inside a JAX program.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from portable_attn._lib._blocks import (
    FULL,
    PARTIAL,
    SKIP,
    block_ranges,
    host_pair_states,
    traced_pair_states,
)
from portable_attn._lib._call import prepare
from portable_attn._lib._route import library
from portable_attn.testing import structure


def _entries(lq, lk, batch, *, causal, window, q_lengths, kv_lengths, q_ids, kv_ids, mod):
    """(B, H, Lq, Lk) bool: what each sequence and head sees, from the structured terms."""
    allowed = np.ones((batch, 2, lq, lk), dtype=bool)
    for b in range(batch):
        ql = lq if q_lengths is None else q_lengths[b]
        kl = lk if kv_lengths is None else kv_lengths[b]
        i = np.arange(lq)[:, None] + (kl - ql)
        j = np.arange(lk)[None, :]
        band = np.ones((lq, lk), dtype=bool)
        left, right = window if window is not None else (None, None)
        if causal:
            right = 0 if right is None else min(right, 0)
        if right is not None:
            band &= j <= i + right
        if left is not None:
            band &= j >= i - left
        band &= (j < kl) & (np.arange(lq)[:, None] < ql)
        if q_ids is not None:
            band &= q_ids[b][:, None] == kv_ids[b][None, :]
        allowed[b] = band
    if mod is not None:
        h = np.arange(2)[:, None, None]
        allowed &= mod(
            np.arange(batch)[:, None, None, None], h, np.arange(lq)[:, None], np.arange(lk)
        )
    return allowed


def _striped(b, h, i, j):
    return (i + h) % 3 != j % 2


@given(
    lq=st.integers(1, 12),
    lk=st.integers(1, 12),
    bq=st.integers(1, 5),
    bk=st.integers(1, 5),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (2, None), (None, 1), (3, 2)]),
    lengths=st.booleans(),
    segments=st.booleans(),
    mod=st.sampled_from([None, "band", "striped"]),
    seed=st.integers(0, 2**16),
)
def test_skip_and_full_agree_with_brute_force(
    lq, lk, bq, bk, causal, window, lengths, segments, mod, seed
):
    rng = np.random.default_rng(seed)
    batch = 2
    kw: dict = {"is_causal": causal, "window": window}
    q_lengths = kv_lengths = q_ids = kv_ids = None
    if lengths:
        q_lengths = rng.integers(0, lq + 1, batch)
        kv_lengths = rng.integers(0, lk + 1, batch)
        kw |= {"q_lengths": q_lengths, "kv_lengths": kv_lengths}
    if segments:
        q_ids = np.sort(rng.integers(0, 3, (batch, lq)), axis=1)
        kv_ids = np.sort(rng.integers(0, 3, (batch, lk)), axis=1)
        kw |= {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
    rule = {"band": lambda b, h, i, j: abs(i - j) <= 2, "striped": _striped}.get(mod)
    if rule is not None:
        kw["mask_mod"] = rule
    q = np.zeros((batch, 2, lq, 4))
    k = np.zeros((batch, 2, lk, 4))
    call = prepare(q, k, k, **kw)
    q_ranges, k_ranges = block_ranges(lq, bq), block_ranges(lk, bk)
    states = np.asarray(host_pair_states(call, q_ranges, k_ranges))
    allowed = _entries(
        lq,
        lk,
        batch,
        causal=causal,
        window=window,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        q_ids=q_ids,
        kv_ids=kv_ids,
        mod=rule,
    )
    for (i, qr), (j, kr) in itertools.product(enumerate(q_ranges), enumerate(k_ranges)):
        blk = allowed[..., qr[0] : qr[1], kr[0] : kr[1]]
        assert states[i, j] in (SKIP, PARTIAL, FULL)
        if states[i, j] == SKIP:
            assert not blk.any(), (i, j)
        if states[i, j] == FULL:
            assert blk.all(), (i, j)
    if not lengths and not segments and rule is None:  # the band alone: exact both ways
        band = structure(lq, lk, is_causal=causal, window=window)
        for (i, qr), (j, kr) in itertools.product(enumerate(q_ranges), enumerate(k_ranges)):
            blk = band[qr[0] : qr[1], kr[0] : kr[1]]
            assert (states[i, j] == SKIP) == (not blk.any())
            assert (states[i, j] == FULL) == bool(blk.all())


def test_causal_skips_about_half_the_blocks():
    q = np.zeros((1, 1024, 4))
    call = prepare(q, q, q, is_causal=True)
    blocks = block_ranges(1024, 64)
    states = np.asarray(host_pair_states(call, blocks, blocks))
    assert int((states != SKIP).sum()) == 16 * 17 // 2  # the lower triangle of 16 x 16 blocks
    assert int((states == FULL).sum()) == 16 * 15 // 2  # below the diagonal


def test_host_lengths_skip_the_keys_past_every_length():
    """Read on the host, lengths skip what they hide in every sequence, no more."""
    q = np.zeros((2, 1, 8, 4))
    call = prepare(q, q, q, kv_lengths=np.array([2, 3]))
    assert host_pair_states(call, [(0, 8)], [(0, 4), (4, 8)]) == [[PARTIAL, SKIP]]


@pytest.mark.backends("jax", reason="traced by value inside a JAX program")
@pytest.mark.parametrize(
    "kw",
    [
        {"is_causal": True},
        {"window": (3, 1)},
        {"kv_lengths": np.array([5, 12]), "is_causal": True},
        {"q_segment_ids": np.repeat(np.arange(4), 4)[None].repeat(2, 0)},
    ],
    ids=["causal", "window", "lengths", "segments"],
)
def test_traced_equals_the_host(backend, kw):
    import jax

    q = np.zeros((2, 2, 16, 4), dtype=np.float32)
    host = host_pair_states(prepare(q, q, q, **kw), block_ranges(16, 4), block_ranges(16, 5))
    args = {n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    arrays = {n: x for n, x in args.items() if hasattr(x, "shape")}

    @jax.jit
    def traced(arrays):
        call = prepare(*(backend.asarray(q),) * 3, **(args | arrays))
        in_program = lambda x: library(x).walk == "traced"  # noqa: E731  # the loop's rule
        return traced_pair_states(call, block_ranges(16, 4), block_ranges(16, 5), in_program)

    np.testing.assert_array_equal(np.asarray(traced(arrays)), host)

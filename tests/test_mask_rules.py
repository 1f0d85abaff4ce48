"""Ready mask rules: causal, sliding window, chunked, prefix-LM and document ``mask_mod``s.

Each rule equals its hand-written ``mask_mod`` on the float64 oracle, on every backend
and route, with ``offset=None`` aligned bottom-right from the call's lengths (or the
valid lengths) and an int offset as given; its block states (arithmetic on block
bounds) agree with the dense mask block by block (a property); it lowers to the
structure the engine skips (the band, segment ids, block states), so chunked
attention visits only its chunks' blocks on the eager tiled path, the JAX loop under
``jit`` and Dask; bad arguments get clear errors.
"""

from __future__ import annotations

import array_api_compat.numpy
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import assert_close, qkv
from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn._lib._rules import lower_call, rule_states
from portable_attn.block_mask import (
    FULL,
    HIDDEN,
    MaskRule,
    and_masks,
    causal_mask_mod,
    chunked_mask_mod,
    create_block_mask,
    document_mask_mod,
    or_masks,
    prefix_lm_mask_mod,
    sliding_window_mask_mod,
)
from portable_attn.testing import reference_attention, reference_weights

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 12, 20, 4
OFF = LK - LQ  # the bottom-right alignment: query i sits at i + OFF
DOC = np.repeat(np.arange(4), [6, 3, 7, 4])  # the document of each of the LK positions
DOC2 = np.stack([np.repeat(np.arange(3), [5, 6, 5]), np.repeat(np.arange(4), [2, 7, 3, 4])])
Q_DOC, KV_DOC = np.repeat(np.arange(3), [5, 3, 4]), np.repeat(np.arange(3), [8, 6, 6])


def _strided(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 3) == 0


# name: (the rule, given the backend's ids; the hand-written mask_mod at raw positions)
RULES = {
    "causal": (lambda ids: causal_mask_mod(), lambda b, h, i, j: j <= i + OFF),
    "causal_top_left": (lambda ids: causal_mask_mod(offset=0), lambda b, h, i, j: j <= i),
    "window": (
        lambda ids: sliding_window_mask_mod(3, 1),
        lambda b, h, i, j: (j >= i + OFF - 3) & (j <= i + OFF + 1),
    ),
    "window_offset": (
        lambda ids: sliding_window_mask_mod(2, None, offset=3),
        lambda b, h, i, j: j >= i + 3 - 2,
    ),
    "chunked_causal": (
        lambda ids: and_masks(causal_mask_mod(), chunked_mask_mod(4)),
        lambda b, h, i, j: ((i + OFF) // 4 == j // 4) & (j <= i + OFF),
    ),
    "chunked_offset": (
        lambda ids: chunked_mask_mod(5, offset=-2),
        lambda b, h, i, j: (i - 2) // 5 == j // 5,
    ),
    "prefix_lm": (lambda ids: prefix_lm_mask_mod(5), lambda b, h, i, j: (j < 5) | (j <= i + OFF)),
    "document": (
        lambda ids: and_masks(document_mask_mod(ids["doc"]), causal_mask_mod()),
        lambda b, h, i, j: (DOC[i + OFF] == DOC[j]) & (j <= i + OFF),
    ),
    "document_two_ids": (
        lambda ids: document_mask_mod(ids["q_doc"], ids["kv_doc"]),
        lambda b, h, i, j: Q_DOC[i] == KV_DOC[j],
    ),
    "or_with_a_function": (
        lambda ids: or_masks(chunked_mask_mod(4), _strided),
        lambda b, h, i, j: ((i + OFF) // 4 == j // 4) | (((i - j) % 3) == 0),
    ),
}


def dense(mask_mod, lq=LQ, lk=LK):
    return np.broadcast_to(
        mask_mod(0, 0, np.arange(lq)[:, None], np.arange(lk)[None, :]), (lq, lk)
    )


def ids_on(backend):
    return {
        name: backend.asarray(a)
        for name, a in (("doc", DOC), ("q_doc", Q_DOC), ("kv_doc", KV_DOC))
    }


@pytest.mark.parametrize("name", list(RULES))
def test_equal_to_the_hand_written_mask_mod(backend, xp, route, name):
    make, hand = RULES[name]
    q, k, v = qkv(batch=(B,), hq=HQ, hkv=HKV, lq=LQ, lk=LK, dk=D, dv=D)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    rule = make(ids_on(backend))
    out = scaled_dot_product_attention(qb, kb, vb, mask_mod=rule, **route.kw)
    assert_close(backend, out, reference_attention(q, k, v, mask=dense(hand)))
    weights = attention_weights(qb, kb, mask_mod=rule)
    assert_close(backend, weights, reference_weights(q, k, mask=dense(hand)))


@pytest.mark.parametrize("name", ["causal", "chunked_causal", "prefix_lm", "window"])
def test_block_mask_of_a_rule(backend, xp, name):
    make, hand = RULES[name]
    q, k, v = qkv(batch=(B,), hq=HQ, hkv=HKV, lq=LQ, lk=LK, dk=D, dv=D)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    rule = make(ids_on(backend))
    on = {} if backend.family == "dask" else {"xp": xp}
    bm = create_block_mask(rule, None, None, LQ, LK, block_size=(3, 4), **on)
    by_hand = create_block_mask(hand, None, None, LQ, LK, block_size=(3, 4))
    states = bm.states if isinstance(bm.states, np.ndarray) else backend.to_numpy(bm.states)
    np.testing.assert_array_equal(states, by_hand.states)
    expected = reference_attention(q, k, v, mask=dense(hand))
    assert_close(backend, scaled_dot_product_attention(qb, kb, vb, block_mask=bm), expected)
    both = scaled_dot_product_attention(qb, kb, vb, block_mask=bm, mask_mod=rule)  # its rule
    assert_close(backend, both, expected)


ALIGNED_BY_LENGTHS = pytest.mark.parametrize(
    ("rule", "hand"),
    [
        (causal_mask_mod(), lambda off, i, j: j <= i + off),
        (
            and_masks(chunked_mask_mod(4), causal_mask_mod()),
            lambda off, i, j: ((i + off) // 4 == j // 4) & (j <= i + off),
        ),
        (prefix_lm_mask_mod(3), lambda off, i, j: (j < 3) | (j <= i + off)),
        (sliding_window_mask_mod(2, 1), lambda off, i, j: (j >= i + off - 2) & (j <= i + off + 1)),
        ("doc", lambda off, i, j: DOC2[0, i + off] == DOC2[0, j]),
        ("docs", lambda off, i, j: DOC2[off % 2, i + off] == DOC2[off % 2, j]),
    ],
    ids=["causal", "chunked", "prefix_lm", "window", "document", "document_per_sequence"],
)


def _decoding(backend, rule, hand):
    """Decoding 3 queries over a padded cache: the backend's call and its oracle."""
    lq, lk, q_len, kv_len = 3, 16, np.array([3, 2]), np.array([16, 9])
    q, k, v = qkv(batch=(B,), hq=HQ, hkv=HKV, lq=lq, lk=lk, dk=D, dv=D)
    if rule == "doc":  # one row of ids, read at each sequence's own positions
        rule = document_mask_mod(backend.asarray(DOC2[0]))
    elif rule == "docs":  # the ids of each sequence (offsets 13 and 7: rows 1 and 1)
        rule = document_mask_mod(backend.asarray(DOC2[[1, 1]]))
    args = [backend.asarray(a) for a in (q, k, v, q_len, kv_len)]

    def call(q, k, v, q_lengths, kv_lengths):
        return scaled_dot_product_attention(
            q, k, v, mask_mod=rule, q_lengths=q_lengths, kv_lengths=kv_lengths
        )

    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    mask = np.stack([hand(kv_len[b] - q_len[b], i, j) for b in range(B)])[:, None]
    expected = reference_attention(q, k, v, mask=mask, q_lengths=q_len, kv_lengths=kv_len)
    return call, args, expected


@ALIGNED_BY_LENGTHS
def test_offset_none_follows_the_valid_lengths(backend, xp, rule, hand):
    """Decoding 3 queries over a padded cache: aligned at each sequence's valid end."""
    call, args, expected = _decoding(backend, rule, hand)
    assert_close(backend, call(*args), expected)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
@ALIGNED_BY_LENGTHS
def test_under_jax_rank_promotion_raise(backend, xp, rule, hand):
    """With ``jax_numpy_rank_promotion="raise"`` a rule aligned by the lengths raised.

    Issue 46, item 11: the (bq, 1) query rows plus the (B, 1, 1, 1) offsets
    ``kv_len[b] - q_len[b]``, and under ``jit`` the (nq, 1) block bounds plus the
    traced (B, 1, 1) offsets. Each operand now at one rank; eager and jitted as
    the oracle.
    """
    import jax

    call, args, expected = _decoding(backend, rule, hand)
    with jax.numpy_rank_promotion("raise"):
        eager, jitted = call(*args), jax.jit(call)(*args)
    assert_close(backend, eager, expected)
    assert_close(backend, jitted, expected)


# the lowering and the skipping


def test_lowering():
    call = {"is_causal": False, "window": None, "q_segment_ids": None, "kv_segment_ids": None}
    low = lower_call({**call, "mask_mod": causal_mask_mod()}, LQ, LK)
    assert (low["is_causal"], low["window"], low["mask_mod"]) == (True, None, None)
    low = lower_call(
        {**call, "window": (5, None), "mask_mod": sliding_window_mask_mod(7, 2)}, 4, 4
    )
    assert (low["is_causal"], low["window"], low["mask_mod"]) == (False, (5, 2), None)
    # a band at another static offset: shifted into the window when both sides stay >= 0
    low = lower_call({**call, "mask_mod": sliding_window_mask_mod(4, 1, offset=OFF + 1)}, LQ, LK)
    assert (low["window"], low["mask_mod"]) == ((3, 2), None)
    low = lower_call({**call, "mask_mod": document_mask_mod(DOC)}, LQ, LK)
    np.testing.assert_array_equal(low["q_segment_ids"], DOC[OFF:])
    np.testing.assert_array_equal(low["kv_segment_ids"], DOC)
    assert low["mask_mod"] is None
    rule = and_masks(causal_mask_mod(), chunked_mask_mod(8))
    low = lower_call({**call, "mask_mod": rule}, LQ, LK)
    assert low["is_causal"]
    assert low["mask_mod"].block_states is not None
    assert lower_call({**call, "mask_mod": _strided}, LQ, LK)["mask_mod"] is _strided


@pytest.mark.backends(
    "numpy", "array_api_strict", "torch", reason="eager tiled path: pairs counted as they run"
)
def test_chunked_visits_only_its_chunks(backend, xp):
    n, block, chunk = 48, 4, 12  # 4 chunks of 3 blocks: 4 x 6 causal pairs of 144
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    visited = []

    def count_pairs(scores, b, h, q_idx, kv_idx):
        visited.append(1)
        return scores

    rule = chunked_mask_mod(chunk)
    out = scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, mask_mod=rule, block_size=block, score_mod=count_pairs
    )
    assert len(visited) == 24
    hand = dense(lambda b, h, i, j: (i // chunk == j // chunk) & (j <= i), n, n)
    assert_close(backend, out, reference_attention(q, k, v, mask=hand))


@pytest.mark.backends("jax", reason="the traced loop under jit skips by the rule's states")
@pytest.mark.parametrize("valid", [None, 300], ids=["no_lengths", "traced_lengths"])
def test_chunked_under_jit_visits_only_its_chunks(backend, xp, monkeypatch, valid):
    """By arithmetic at a static alignment; by value, per sequence, from traced lengths."""
    import jax

    from portable_attn._lib import _route
    from portable_attn._lib._call import prepare
    from portable_attn._paths._loop import _Grid, _states

    monkeypatch.setattr(_route, "MASK_LOOP_MIN_TILE", 64)
    n, chunk = 512, 128
    q, k, v = qkv(batch=(1,), hq=1, hkv=1, lq=n, lk=n, dk=4, dv=4, backend=backend)
    rule = chunked_mask_mod(chunk)
    call = {"is_causal": True, "window": None, "q_segment_ids": None, "kv_segment_ids": None}
    lengths = None if valid is None else backend.asarray(np.array([n]))

    def counts(q, k, v, lengths):
        given = lower_call({**call, "mask_mod": rule, "kv_lengths": lengths}, n, n)
        arrays, skeleton = prepare(q, k, v, **given).flatten()
        return (_states(skeleton, arrays, _Grid(64, 64, n, n)) != 0).sum(axis=1)

    # 8 query blocks of 64 in 4 chunks of 2: each sees 1 or 2 blocks of its chunk
    np.testing.assert_array_equal(np.asarray(jax.jit(counts)(q, k, v, lengths)), [1, 2] * 4)
    f = jax.jit(
        lambda q, k, v, lengths: scaled_dot_product_attention(
            q, k, v, is_causal=True, mask_mod=rule, kv_lengths=lengths
        )
    )
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    end = n if valid is None else valid  # with lengths: aligned at the valid end
    p, j = np.arange(n)[:, None] + end - n, np.arange(n)[None, :]
    hand = (p // chunk == j // chunk) & (j <= p)
    kv = None if valid is None else np.array([valid])
    expected = reference_attention(qn, kn, vn, mask=hand, kv_lengths=kv)
    short = None if valid is None else backend.asarray(np.array([valid]))
    assert_close(backend, f(q, k, v, short), expected)


@pytest.mark.backends("dask", reason="Dask: a hidden chunk pair is no task")
def test_dask_other_chunks_are_no_tasks(backend, xp, monkeypatch):
    import dask.array as da

    from portable_attn._lib import _route

    monkeypatch.setattr(_route, "DASK_TASK_SCORES", 0)  # a task per visible chunk pair
    n = 40
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    qb, kb, vb = (da.from_array(a, chunks=(1, 2, 10, 4)) for a in (q, k, v))
    out = scaled_dot_product_attention(qb, kb, vb, mask_mod=chunked_mask_mod(10))
    assert [key for key in out.__dask_graph__() if "pair" in str(key[0])] == []
    hand = dense(lambda b, h, i, j: i // 10 == j // 10, n, n)
    assert_close(backend, out, reference_attention(q, k, v, mask=hand))


@given(
    lq=st.integers(0, 30),
    lk=st.integers(0, 30),
    bq=st.integers(1, 7),
    bk=st.integers(1, 7),
    chunk=st.integers(1, 9),
    prefix=st.integers(0, 12),
    left=st.one_of(st.none(), st.integers(0, 6)),
    right=st.one_of(st.none(), st.integers(0, 6)),
    offset=st.one_of(st.none(), st.integers(-8, 8)),
    combine=st.sampled_from(["chunk", "prefix", "window", "and", "or"]),
)
def test_rule_states_agree_with_the_dense_mask(
    lq, lk, bq, bk, chunk, prefix, left, right, offset, combine
):
    """Arithmetic states: hidden iff the block shows nothing, full iff it shows everything.

    Exact for one rule; for a combination, sound (hidden: nothing shown, full: all shown).
    """
    parts = {
        "chunk": chunked_mask_mod(chunk, offset=offset),
        "prefix": prefix_lm_mask_mod(prefix),
        "window": sliding_window_mask_mod(left, right, offset=offset),
    }
    combined = {"and": and_masks, "or": or_masks}.get(combine)
    rule = parts[combine] if combined is None else combined(*parts.values())
    rule = rule.aligned(lq, lk)
    states = rule_states(array_api_compat.numpy, rule.rule, 0, lq, lk, (bq, bk))
    allowed = np.broadcast_to(rule(0, 0, np.arange(lq)[:, None], np.arange(lk)[None, :]), (lq, lk))
    for i in range(states.shape[0]):
        for j in range(states.shape[1]):
            block = allowed[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if combined is None or states[i, j] == HIDDEN:
                assert (states[i, j] == HIDDEN) == (not block.any())
            if combined is None or states[i, j] == FULL:
                assert (states[i, j] == FULL) == bool(block.all())


# errors


def test_bad_arguments():
    with pytest.raises(TypeError, match="aligns query positions bottom-right"):
        causal_mask_mod()(0, 0, np.arange(3)[:, None], np.arange(3)[None, :])
    assert causal_mask_mod(offset=0)(
        0, 0, np.arange(2)[:, None], np.arange(2)[None, :]
    ).tolist() == [
        [True, False],
        [True, True],
    ]
    with pytest.raises(ValueError, match="`chunk_size` must be a positive integer"):
        chunked_mask_mod(0)
    with pytest.raises(TypeError, match="`left` must be a non-negative integer"):
        sliding_window_mask_mod(1.5)
    with pytest.raises(ValueError, match="`prefix_length`"):
        prefix_lm_mask_mod(-1)
    with pytest.raises(TypeError, match="`offset` must be None or an integer"):
        causal_mask_mod(offset=1.0)
    with pytest.raises(TypeError, match="`q_segment_ids` must be an integer array"):
        document_mask_mod(np.zeros(4))
    with pytest.raises(ValueError, match="drop `offset`"):
        document_mask_mod(Q_DOC, KV_DOC, offset=1)
    q = np.zeros((1, LQ, D))
    k = np.zeros((1, LK, D))
    with pytest.raises(ValueError, match="Lk=20"):
        scaled_dot_product_attention(q, k, k, mask_mod=document_mask_mod(DOC[:10]))
    with pytest.raises(ValueError, match="Lq=12"):
        scaled_dot_product_attention(q, k, k, mask_mod=document_mask_mod(KV_DOC, KV_DOC))
    assert isinstance(and_masks(causal_mask_mod(), _strided), MaskRule)
    assert causal_mask_mod() == causal_mask_mod()
    assert hash(causal_mask_mod()) == hash(causal_mask_mod())


# combinations with values (found in review)


@pytest.mark.parametrize("form", ["with_user_ids", "two_documents", "or", "block_mask"])
def test_documents_combined(backend, xp, form):
    """A document rule next to the call's own segment ids, another document, in OR, built."""
    n = 12
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    a = np.repeat(np.arange(3), [4, 5, 3])
    b = np.repeat(np.arange(2), [7, 5])
    same_a, same_b = a[:, None] == a[None, :], b[:, None] == b[None, :]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    kw: dict = {}
    if form == "with_user_ids":
        kw = {"mask_mod": document_mask_mod(backend.asarray(a))}
        kw["q_segment_ids"] = backend.asarray(b[None])
        mask = same_a & same_b
    elif form == "two_documents":
        docs = (document_mask_mod(backend.asarray(x)) for x in (a, b))
        kw = {"mask_mod": and_masks(*docs)}
        mask = same_a & same_b
    elif form == "or":
        kw = {"mask_mod": or_masks(document_mask_mod(backend.asarray(a)), causal_mask_mod())}
        mask = same_a | (j <= i)
    else:
        if backend.family == "dask":
            pytest.skip("a block mask is built eagerly: a rule closing over Dask ids cannot")
        rule = and_masks(document_mask_mod(backend.asarray(a)), _strided)
        on = {"xp": xp, "device": backend.device}
        kw = {"block_mask": create_block_mask(rule, None, None, n, n, block_size=4, **on)}
        mask = same_a & (((i - j) % 3) == 0)
    out = scaled_dot_product_attention(qb, kb, vb, **kw)
    assert_close(backend, out, reference_attention(q, k, v, mask=mask))


def test_a_document_in_or_masks_is_checked():
    q = np.zeros((1, 8, 4))
    rule = or_masks(document_mask_mod(np.arange(6)), chunked_mask_mod(100, offset=-200))
    with pytest.raises(ValueError, match="Lk=8"):
        scaled_dot_product_attention(q, q, q, mask_mod=rule)


# NumPy ids in a call over another library (issue 46, item 22)


@pytest.mark.parametrize("combine", ["alone", "two_arrays", "and", "or"])
@pytest.mark.parametrize("rows", ["one_row", "per_sequence"])
@pytest.mark.parametrize("ids_as", ["own", "numpy"])
def test_document_ids_of_numpy_or_of_the_backend(backend, xp, ids_as, rows, combine):
    """The backend's ids and a tokenizer's NumPy ids, (L,) and (B, L), alone and combined."""
    n = 12
    q, k, v = qkv(batch=(B,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    docs = DOC2[:, :n] if rows == "per_sequence" else DOC2[0, :n]
    ids = docs if ids_as == "numpy" else backend.asarray(docs)
    per_row = np.broadcast_to(docs, (B, n))
    same = (per_row[:, :, None] == per_row[:, None, :])[:, None]  # (B, 1, n, n)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    doc = document_mask_mod(ids, ids) if combine == "two_arrays" else document_mask_mod(ids)
    rule, mask = doc, same
    if combine == "and":
        rule, mask = and_masks(doc, _strided), same & (((i - j) % 3) == 0)
    elif combine == "or":
        rule, mask = or_masks(doc, causal_mask_mod()), same | (j <= i)
    out = scaled_dot_product_attention(qb, kb, vb, mask_mod=rule)
    assert_close(backend, out, reference_attention(q, k, v, mask=mask))
    weights = attention_weights(qb, kb, mask_mod=rule)
    assert_close(backend, weights, reference_weights(q, k, mask=mask))
    if backend.family != "dask":  # a block mask is built eagerly (no Dask ids)
        on = {"xp": xp, "device": backend.device}
        batch = B if rows == "per_sequence" else None
        bm = create_block_mask(rule, batch, None, n, n, block_size=4, **on)
        out = scaled_dot_product_attention(qb, kb, vb, block_mask=bm)
        assert_close(backend, out, reference_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("combine", ["alone", "or"])
def test_document_ids_of_another_library_name_the_argument(backend, combine):
    if backend.family == "numpy":
        pytest.skip("NumPy ids go with every library")
    ids = backend.asarray(DOC)
    rule = document_mask_mod(ids)
    rule = rule if combine == "alone" else or_masks(rule, causal_mask_mod())
    q = np.zeros((1, LK, D))
    match = r"document_mask_mod: `q_segment_ids` is a \w+ array, but the call's `query` is a numpy"
    with pytest.raises(TypeError, match=match):
        scaled_dot_product_attention(q, q, q, mask_mod=rule)
    with pytest.raises(TypeError, match=r"`q_segment_ids` is a \w+ array, but create_block_mask"):
        create_block_mask(rule, None, None, LK, LK)

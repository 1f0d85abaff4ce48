"""FlexAttention-style masks: `mask_mod`, `create_block_mask` and `block_mask=`.

On every backend and path, a `mask_mod` (alone or through its block mask) gives
the float64 oracle of the same mask evaluated densely, AND-ed with every other
mask; block states agree with the dense mask block by block; hidden blocks are
not computed (visited pairs counted on the eager tiled path, Dask's tasks, the
JAX loop's visit lists); gradients equal those of the dense mask; bad arguments
get clear errors.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, qkv, set_kernels
from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn.block_mask import (
    FULL,
    HIDDEN,
    PARTIAL,
    BlockMask,
    and_masks,
    create_block_mask,
    or_masks,
)
from portable_attn.testing import reference_attention, reference_weights

B, HQ, HKV, L, D = 2, 4, 2, 13, 4


def doc_causal(b, h, q_idx, kv_idx):  # documents of 5 tokens, causal inside each
    return ((q_idx // 5) == (kv_idx // 5)) & (q_idx >= kv_idx)


def per_head(b, h, q_idx, kv_idx):  # every (h + 2)-th key hidden from head h
    return (kv_idx % (h + 2)) != 0


def per_batch(b, h, q_idx, kv_idx):  # sequence b sees its first 6 + 4 b keys
    return kv_idx < 6 + 4 * b


def prefix_lm(b, h, q_idx, kv_idx):  # a bidirectional prefix of 4, causal after it
    return (kv_idx < 4) | (q_idx >= kv_idx)


def strided(b, h, q_idx, kv_idx):  # every third key back
    return ((q_idx - kv_idx) % 3) == 0


def nothing(b, h, q_idx, kv_idx):  # every row empty: zeros
    return q_idx < 0


def late_rows(b, h, q_idx, kv_idx):  # the first 3 queries see no key
    return (q_idx >= 3) & (kv_idx >= 0)


MASK_MODS = {
    "doc_causal": doc_causal,
    "per_head": per_head,
    "per_batch": per_batch,
    "prefix_lm": prefix_lm,
    "strided": strided,
    "combined": and_masks(or_masks(prefix_lm, strided), per_head),
    "nothing": nothing,
    "late_rows": late_rows,
}


def dense_mask(mask_mod, lq=L, lk=L, batch=B, heads=HQ):
    """`mask_mod` evaluated on every entry with NumPy: (B, H, Lq, Lk)."""
    b = np.arange(batch).reshape(batch, 1, 1, 1)
    h = np.arange(heads)[:, None, None]
    allowed = mask_mod(b, h, np.arange(lq)[:, None], np.arange(lk)[None, :])
    return np.broadcast_to(allowed, (batch, heads, lq, lk))


def problem(backend=None, lq=L, lk=L):
    return qkv(batch=(B,), hq=HQ, hkv=HKV, lq=lq, lk=lk, dk=D, dv=D, backend=backend)


@pytest.mark.parametrize("name", list(MASK_MODS))
@pytest.mark.parametrize("given", ["mask_mod", "block_mask"])
def test_equal_to_the_dense_mask(backend, xp, route, name, given):
    mask_mod = MASK_MODS[name]
    q, k, v = problem()
    dense = dense_mask(mask_mod)
    if given == "mask_mod":
        kw = {"mask_mod": mask_mod}
    else:
        kw = {"block_mask": create_block_mask(mask_mod, B, HQ, L, L, block_size=(3, 2))}
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    out = scaled_dot_product_attention(qb, kb, vb, **route.kw, **kw)
    assert_close(backend, out, reference_attention(q, k, v, mask=dense))
    weights = attention_weights(qb, kb, **kw)
    assert_close(backend, weights, reference_weights(q, k, mask=dense))


@pytest.mark.parametrize(
    "kw",
    [
        {"is_causal": True},
        {"window": (3, 1)},
        {"kv_lengths": np.array([13, 7])},
        {"q_segment_ids": np.repeat(np.arange(3), [4, 5, 4])[None]},
        {"mask": np.arange(L) % 4 != 1},
        {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
        {"softcap": 2.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])},
    ],
    ids=["causal", "window", "lengths", "segments", "mask", "sinks", "softcap-alibi"],
)
def test_and_ed_with_every_other_mask(backend, xp, route, kw):
    q, k, v = problem()
    bm = create_block_mask(prefix_lm, None, None, L, L, block_size=4)
    dense = dense_mask(prefix_lm)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    on = {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out = scaled_dot_product_attention(qb, kb, vb, **route.kw, block_mask=bm, **on)
    mask = dense if "mask" not in kw else np.logical_and(dense, kw["mask"])
    rest = {n: a for n, a in kw.items() if n != "mask"}
    assert_close(backend, out, reference_attention(q, k, v, mask=mask, **rest))


def test_rectangular_calls_use_raw_positions(backend, xp):
    """``q_idx >= kv_idx`` is top-left causal; ``is_causal`` stays bottom-right."""
    q, k, v = problem(lq=5, lk=11)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))

    def top_left(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    out = scaled_dot_product_attention(qb, kb, vb, mask_mod=top_left, block_size=(2, 3))
    dense = dense_mask(top_left, lq=5, lk=11)
    assert_close(backend, out, reference_attention(q, k, v, mask=dense))
    both = scaled_dot_product_attention(qb, kb, vb, mask_mod=top_left, is_causal=True)
    assert_close(backend, both, reference_attention(q, k, v, mask=dense, is_causal=True))


@pytest.mark.parametrize("block", [(4, 4), (3, 5), (13, 13), (20, 1)])
@pytest.mark.parametrize("name", ["doc_causal", "per_head", "per_batch", "strided"])
def test_states_agree_with_the_dense_mask(backend, xp, name, block):
    mask_mod = MASK_MODS[name]
    bm = create_block_mask(mask_mod, B, HQ, L, 11, block_size=block, xp=xp)
    dense = dense_mask(mask_mod, lk=11)
    bq, bk = block
    states = backend.to_numpy(bm.states)
    assert states.shape == (B, HQ, -(-L // bq), -(-11 // bk))
    for i in range(states.shape[2]):
        for j in range(states.shape[3]):
            blk = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            expected = np.where(blk.all((2, 3)), FULL, np.where(blk.any((2, 3)), PARTIAL, HIDDEN))
            np.testing.assert_array_equal(states[:, :, i, j], expected)
    np.testing.assert_array_equal(backend.to_numpy(bm.to_dense()), dense)


@pytest.mark.parametrize("name", ["doc_causal", "per_head", "per_batch"])
def test_build_tiles_bound_the_entries_in_all(backend, xp, monkeypatch, name):
    # a tile holds at most MASK_TILE_ENTRIES booleans over every (batch, head) the mask
    # differs over, whatever the lengths: a per-head mask gets tiles of fewer blocks
    from portable_attn._lib import _route

    monkeypatch.setattr(_route, "MASK_TILE_ENTRIES", 4 * 4 * 4 * 2)  # 8 blocks of 4x4
    sizes = []

    def recorded(b, h, q_idx, kv_idx):
        allowed = MASK_MODS[name](b, h, q_idx, kv_idx)
        full = xp.broadcast_to(allowed, (*allowed.shape[:-2], q_idx.shape[-2], kv_idx.shape[-1]))
        sizes.append(int(np.prod(full.shape)))
        return allowed

    bm = create_block_mask(recorded, B, HQ, 29, 23, block_size=4, xp=xp)
    assert len(sizes) > 1
    assert max(sizes) <= 4 * 4 * 4 * 2
    dense = dense_mask(MASK_MODS[name], 29, 23)
    np.testing.assert_array_equal(backend.to_numpy(bm.to_dense()), dense)


def test_none_broadcasts_and_repr(backend, xp):
    bm = create_block_mask(doc_causal, None, None, 20, 20, block_size=5, xp=xp)
    assert bm.shape == (1, 1, 20, 20)
    # 4 documents of 5 in blocks of 5: the 4 diagonal blocks are partial, the rest hidden
    assert bm.visible_fraction() == pytest.approx(4 / 16)
    assert bm.sparsity() == pytest.approx(75.0)
    assert "computed=25.0% of blocks (full 0.0%, partial 25.0%)" in repr(bm)
    assert "mask_mod=doc_causal" in repr(bm)
    q, k, v = qkv(batch=(3,), hq=2, hkv=2, lq=20, lk=20, dk=4, dv=4)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    out = scaled_dot_product_attention(qb, kb, vb, block_mask=bm, block_size=5)
    dense = dense_mask(doc_causal, 20, 20, 1, 1)
    assert_close(backend, out, reference_attention(q, k, v, mask=dense))


def test_and_or_masks_combine(backend, xp):
    both = and_masks(prefix_lm, strided)
    either = or_masks(prefix_lm, strided)
    np.testing.assert_array_equal(
        dense_mask(both), np.logical_and(dense_mask(prefix_lm), dense_mask(strided))
    )
    np.testing.assert_array_equal(
        dense_mask(either), np.logical_or(dense_mask(prefix_lm), dense_mask(strided))
    )
    assert both.__name__ == "and_masks(prefix_lm, strided)"
    np.testing.assert_array_equal(dense_mask(and_masks()), True)
    np.testing.assert_array_equal(dense_mask(or_masks()), False)


# ---------------------------------------------------------------------------
# hidden blocks are not computed


@pytest.mark.backends(
    "numpy", "array_api_strict", "torch", reason="eager tiled path: pairs counted as they run"
)
@pytest.mark.parametrize("given", ["mask_mod", "block_mask"])
def test_hidden_blocks_are_not_computed(backend, xp, given):
    n, block = 40, 5  # 8 documents of 5: 8 of the 64 block pairs visible
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    visited, evaluated = [], []

    def count_pairs(scores, b, h, q_idx, kv_idx):  # called once per computed pair
        visited.append(1)
        return scores

    def docs(b, h, q_idx, kv_idx):
        evaluated.append(1)
        return (q_idx // 5) == (kv_idx // 5)

    bm = create_block_mask(docs, 1, 1, n, n, block_size=block)  # (None: one more, checking)
    building = len(evaluated)  # the states' evaluations
    evaluated.clear()
    kw = {"mask_mod": docs} if given == "mask_mod" else {"block_mask": bm}
    out = scaled_dot_product_attention(qb, kb, vb, block_size=block, score_mod=count_pairs, **kw)
    assert len(visited) == 8  # the 56 hidden pairs are skipped
    # every visible pair lies in one document: shown in full, no mask evaluated
    # (a mask_mod alone evaluates it as often again, building its states)
    assert len(evaluated) == (0 if given == "block_mask" else building)
    dense = dense_mask(docs, n, n, 1, 1)
    assert_close(backend, out, reference_attention(q, k, v, mask=dense))


@pytest.mark.backends("dask", reason="Dask: a hidden chunk pair is no task")
def test_dask_hidden_chunk_pairs_are_no_tasks(backend, xp, monkeypatch):
    import dask.array as da

    from portable_attn._lib import _route

    monkeypatch.setattr(_route, "DASK_TASK_SCORES", 0)  # a task per visible chunk pair

    n = 40
    q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=4, dv=4)
    chunks = (1, 2, 10, 4)
    qb, kb, vb = (da.from_array(a, chunks=chunks) for a in (q, k, v))

    def docs(b, h, q_idx, kv_idx):  # 4 documents of 10: the chunks
        return (q_idx // 10) == (kv_idx // 10)

    bm = create_block_mask(docs, None, None, n, n, block_size=10)
    out = scaled_dot_product_attention(qb, kb, vb, block_mask=bm)
    plain = scaled_dot_product_attention(qb, kb, vb)
    pair_tasks = [key for key in out.__dask_graph__() if "pair" in str(key[0])]
    assert pair_tasks == []  # each query chunk sees one key chunk: its task is the output
    assert len(dict(out.__dask_graph__())) < len(dict(plain.__dask_graph__()))
    assert_close(backend, out, reference_attention(q, k, v, mask=dense_mask(docs, n, n, 1, 1)))


@pytest.mark.backends("jax", reason="the traced loop reads a traced block mask by value")
def test_traced_block_mask_under_jit(backend, xp):
    import jax

    q, k, v = problem(backend)
    mask_mod = MASK_MODS["combined"]
    bm = create_block_mask(mask_mod, None, HQ, L, L, block_size=3, xp=xp)
    f = jax.jit(lambda q, k, v, bm: scaled_dot_product_attention(q, k, v, block_mask=bm))
    out = f(q, k, v, bm)
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    assert_close(backend, out, reference_attention(qn, kn, vn, mask=dense_mask(mask_mod)))

    # traced segment ids and a traced block mask together
    ids = backend.asarray(np.repeat(np.arange(3), [4, 5, 4])[None])
    g = jax.jit(
        lambda q, k, v, bm, ids: scaled_dot_product_attention(
            q, k, v, block_mask=bm, q_segment_ids=ids
        )
    )
    dense = np.logical_and(dense_mask(mask_mod), _same_segment(backend.to_numpy(ids)))
    assert_close(backend, g(q, k, v, bm, ids), reference_attention(qn, kn, vn, mask=dense))


def _same_segment(ids):
    return (ids[..., :, None] == ids[..., None, :])[:, None]


def _visit_counts(q, k, v, bm):
    from portable_attn._lib._call import prepare
    from portable_attn._lib._route import route
    from portable_attn._paths._loop import _Grid, _states

    call = prepare(q, k, v, block_mask=bm)
    path = route(call, None, None).path
    grid = _Grid(path.block_q, path.block_k, call.plan.q_len, call.plan.kv_len)
    arrays, skeleton = call.flatten()
    states = _states(skeleton, arrays, grid)
    return [(states[i] != 0).sum() for i in range(grid.nq)]


@pytest.mark.backends("jax", reason="the traced loop's visit lists at a longer length")
def test_loop_visits_only_shown_pairs(backend, xp, monkeypatch):
    import jax

    from portable_attn._lib import _route

    monkeypatch.setattr(_route, "MASK_LOOP_MIN_TILE", 256)
    n = 1024  # tiles of 256 over states of 128: 4 x 4 tiles
    q, k, v = qkv(batch=(1,), hq=1, hkv=1, lq=n, lk=n, dk=4, dv=4, backend=backend)

    def docs(b, h, q_idx, kv_idx):  # 2 documents of 512, causal, and a stride inside
        same = (q_idx // 512) == (kv_idx // 512)
        return same & (q_idx >= kv_idx) & ((kv_idx // 256) % 2 == 0)

    bm = create_block_mask(docs, None, None, n, n, xp=xp)
    counts = jax.jit(lambda bm: jax.numpy.stack(_visit_counts(q, k, v, bm)))(bm)
    # key tiles 0 and 2 only (odd 256-tiles hidden), within the document, causal
    np.testing.assert_array_equal(np.asarray(counts), [1, 1, 1, 1])
    out = jax.jit(lambda q, k, v, bm: scaled_dot_product_attention(q, k, v, block_mask=bm))(
        q, k, v, bm
    )
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    ref = reference_attention(qn, kn, vn, mask=dense_mask(docs, n, n, 1, 1))
    assert_close(backend, out, ref)


# ---------------------------------------------------------------------------
# gradients


@pytest.mark.autodiff
def test_gradients_equal_the_dense_mask(backend, xp, route):
    q, k, v = problem(backend)
    mask_mod = MASK_MODS["combined"]
    bm = create_block_mask(mask_mod, None, HQ, L, L, block_size=(3, 2))
    mask = backend.asarray(dense_mask(mask_mod))

    def loss(**kw):
        def f(q, k, v):
            out = scaled_dot_product_attention(q, k, v, **route.kw, **kw)
            return xp.sum(out**2)

        return f

    ours = backend.grad(loss(block_mask=bm), q, k, v)
    theirs = backend.grad(loss(mask=mask), q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(backend, a, backend.to_numpy(b), rtol=1e-10, atol=1e-12)


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_under_jax_rank_promotion_raise(backend, xp, route):
    """With ``jax_numpy_rank_promotion="raise"`` a FlexAttention-style ``mask_mod`` raised.

    Issue 46, item 11: ``kv_idx < 6 + 4 * b`` or ``kv_idx % (h + 2)`` broadcast the
    (B, 1, 1, 1) batch or (H, 1, 1) head index with the (1, bk) key positions (and
    ``to_dense`` the same). The indices now come at one rank, (B, 1, 1, 1),
    (1, H, 1, 1), (1, 1, bq, 1) and (1, 1, 1, bk); values and gradients as without.
    """
    import jax

    q, k, v = problem()
    mask_mod = and_masks(per_batch, per_head, doc_causal)
    dense = dense_mask(mask_mod)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    cot = backend.asarray(np.random.default_rng(4).standard_normal((B, HQ, L, D)))

    def loss(q, k, v, **kw):
        return xp.sum(scaled_dot_product_attention(q, k, v, **route.kw, **kw) * cot)

    with jax.numpy_rank_promotion("raise"):
        bm = create_block_mask(mask_mod, B, HQ, L, L, block_size=(3, 2))
        np.testing.assert_array_equal(backend.to_numpy(bm.to_dense()), dense)
        for kw in ({"mask_mod": mask_mod}, {"block_mask": bm}):
            out = scaled_dot_product_attention(qb, kb, vb, **route.kw, **kw)
            assert_close(backend, out, reference_attention(q, k, v, mask=dense))
            grads = backend.grad(partial(loss, **kw), qb, kb, vb)
            expected = backend.grad(partial(loss, mask=backend.asarray(dense)), qb, kb, vb)
            for g, e in zip(grads, expected, strict=True):
                assert_close(backend, g, backend.to_numpy(e), rtol=1e-10, atol=1e-12)


@pytest.mark.backends("jax", reason="jax.grad under jit with a traced block mask (the loop)")
def test_jit_grad_with_a_traced_block_mask(backend, xp):
    import jax

    q, k, v = problem(backend)
    mask_mod = MASK_MODS["doc_causal"]
    bm = create_block_mask(mask_mod, None, None, L, L, block_size=2, xp=xp)
    mask = backend.asarray(dense_mask(mask_mod))

    def loss(q, k, v, bm):
        return xp.sum(scaled_dot_product_attention(q, k, v, block_mask=bm) ** 2)

    def dense_loss(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, mask=mask) ** 2)

    ours = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bm)
    theirs = jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(backend, a, backend.to_numpy(b), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# errors


def test_bad_arguments(backend, xp):
    q, k, v = (backend.asarray(a) for a in problem())
    with pytest.raises(TypeError, match=r"`mask_mod` must be callable"):
        scaled_dot_product_attention(q, k, v, mask_mod=3)
    with pytest.raises(TypeError, match=r"`block_mask` must be a BlockMask"):
        scaled_dot_product_attention(q, k, v, block_mask=np.ones((L, L), bool))

    def integers(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(TypeError, match=r"`mask_mod` must return a boolean array"):
        scaled_dot_product_attention(q, k, v, mask_mod=integers)
    with pytest.raises(TypeError, match=r"`mask_mod` must return a boolean array"):
        create_block_mask(integers, None, None, 4, 4)
    with pytest.raises(ValueError, match=r"built for \(Lq, Lk\) = \(12, 13\).*Lq=13"):
        scaled_dot_product_attention(
            q, k, v, block_mask=create_block_mask(prefix_lm, None, None, 12, 13)
        )
    with pytest.raises(ValueError, match=r"built for heads=3.*Hq=4"):
        scaled_dot_product_attention(
            q, k, v, block_mask=create_block_mask(prefix_lm, None, 3, L, L)
        )
    with pytest.raises(ValueError, match=r"built for batch=5.*2 sequences"):
        scaled_dot_product_attention(
            q, k, v, block_mask=create_block_mask(prefix_lm, 5, None, L, L)
        )
    bm = create_block_mask(prefix_lm, None, None, L, L)
    with pytest.raises(ValueError, match=r"both `mask_mod` and a `block_mask`"):
        scaled_dot_product_attention(q, k, v, block_mask=bm, mask_mod=strided)
    assert isinstance(bm, BlockMask)
    scaled_dot_product_attention(q, k, v, block_mask=bm, mask_mod=prefix_lm)  # the same: fine
    with pytest.raises(ValueError, match=r"`block_size` must be a positive integer"):
        create_block_mask(prefix_lm, None, None, L, L, block_size=0)


# ---------------------------------------------------------------------------
# torch: the fused kernel per query tile over its visible key span


@pytest.mark.backends("torch", reason="torch SDPA per query tile (Native.tiles)")
def test_native_per_tile_rectangular_documents(backend, xp, monkeypatch):
    """Lq < Lk (bottom-right causal): documents are not merged into square causal calls."""
    from portable_attn._lib import _route

    monkeypatch.setattr(_route, "NATIVE_TILE", 4)
    q, k, v = problem(lq=8, lk=13)
    q_ids = np.repeat(np.arange(2), [4, 4])[None]
    kv_ids = np.repeat(np.arange(2), [7, 6])[None]
    on = {"q_segment_ids": backend.asarray(q_ids), "kv_segment_ids": backend.asarray(kv_ids)}
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    out = scaled_dot_product_attention(qb, kb, vb, is_causal=True, **on)
    mask = (q_ids[..., :, None] == kv_ids[..., None, :])[:, None]
    assert_close(backend, out, reference_attention(q, k, v, mask=mask, is_causal=True))


@pytest.mark.backends("torch", reason="torch SDPA per query tile (Native.tiles)")
@pytest.mark.parametrize(
    "kw",
    [
        {"block_mask": "doc_causal"},
        {"mask_mod": "strided"},
        {"is_causal": True, "q_segment_ids": np.repeat(np.arange(3), [4, 5, 4])[None]},
        {"is_causal": True, "q_segment_ids": np.repeat(np.arange(2), [8, 5])[None]},
        {"is_causal": True, "window": (3, 0)},
        {"window": (2, 2), "kv_lengths": np.array([13, 6])},
        {"block_mask": "nothing"},
        {"block_mask": "prefix_lm", "mask": np.arange(L) % 4 != 1, "is_causal": True},
        {"block_mask": "late_rows", "mask": np.arange(L) % 4 != 1},
    ],
    ids=[
        "block-mask",
        "mask-mod",
        "segments",
        "documents",
        "window",
        "window-lengths",
        "empty",
        "mixed",
        "empty-rows-key-mask",
    ],
)
def test_native_kernel_per_tile(backend, xp, monkeypatch, kw):
    from portable_attn._lib import _route
    from portable_attn._lib._call import prepare
    from portable_attn._lib._compat import reads_host_values
    from portable_attn._lib._path import Native

    monkeypatch.setattr(_route, "NATIVE_TILE", 4)  # 4 query tiles of a 13-token call
    set_kernels(monkeypatch, min_keys=0)  # which would take no kernel
    q, k, v = problem()
    on, dense = {}, np.ones((L, L), bool)
    for name, a in kw.items():
        if name in ("block_mask", "mask_mod"):
            mod = MASK_MODS[a]
            dense = np.logical_and(dense, dense_mask(mod))
            on[name] = (
                create_block_mask(mod, B, HQ, L, L, block_size=2) if name != "mask_mod" else mod
            )
        elif isinstance(a, np.ndarray):
            on[name] = backend.asarray(a)
        else:
            on[name] = a
    rest = {n: a for n, a in kw.items() if n not in ("block_mask", "mask_mod")}
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    path = _route.route(prepare(qb, kb, vb, **on), None, None).path
    assert isinstance(path, Native)
    # two sequences aligned 7 apart by their lengths: their bands together hide too
    # few tiles for the kernel per tile; segment ids on a GPU are not read (no sync)
    segments = on.get("q_segment_ids")
    per_tile = "kv_lengths" not in kw and (segments is None or reads_host_values(segments))
    assert path.tiles == (4 if per_tile else None)
    from portable_attn._paths import _native

    calls = []
    kernel = _native.native_attention
    monkeypatch.setattr(
        _native, "native_attention", lambda c, *a: calls.append(c) or kernel(c, *a)
    )
    out = scaled_dot_product_attention(qb, kb, vb, **on)
    if per_tile and segments is not None and kw["q_segment_ids"].max() == 1:  # 8 and 5
        # each document (two tiles each) is one square causal call, without ids
        assert [c.plan.q_len for c in calls] == [8, 5]
        assert calls[0].terms.q_segments is None
        assert calls[0].plan.align.kv_start == 0
    mask = dense if "mask" not in rest else np.logical_and(dense, rest.pop("mask"))
    ref = reference_attention(q, k, v, mask=mask, **rest)
    assert_close(backend, out, ref)

    def loss(q, k, v, **extra):
        return xp.sum(scaled_dot_product_attention(q, k, v, **extra) ** 2)

    portable = {**on, "implementation": "portable"}
    grads = backend.grad(lambda q, k, v: loss(q, k, v, **on), qb, kb, vb)
    expected = backend.grad(lambda q, k, v: loss(q, k, v, **portable), qb, kb, vb)
    for a, b in zip(grads, expected, strict=True):
        assert_close(backend, a, backend.to_numpy(b), rtol=1e-8, atol=1e-10)

"""Sparse attention over a paged pool: ``ragged_paged_attention(kv_indices=...)``.

Each row sees exactly the keys its head's list names (a repeat once, ``-1`` padding
none), AND-ed with causal, window and ``mask_mod``, or joined to the window band with
``window_union``: against a float64 oracle that attends to each row's key set, on every
backend, through several chunks and row blocks; the pool's free slots hold NaN; equal
to the paged walk when every key is listed; gradients against central differences;
under ``jax.jit`` with traced lists (a list outside its request makes only its row NaN);
bad input named.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn._lib import _route
from portable_attn.serving import ragged_paged_attention, topk_indices
from portable_attn.testing import central_differences
from test_serving import DK, HKV, HQ, SLOPES, Pool, _on

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")

LENGTHS, NEW = [20, 45, 7, 0], [3, 1, 2, 0]


def _lists(pool, k, seed=1):
    """(T, Hkv, k) random positions of each row's request, -1 and repeats among them."""
    rng = np.random.default_rng(seed)
    t = pool.query.shape[0]
    idx = np.full((t, HKV, k), -1, dtype=np.int64)
    for r, n in enumerate(pool.lengths):
        for row in range(pool.starts[r], pool.starts[r + 1]):
            idx[row] = rng.integers(-1, n, size=(HKV, k)) if n else -1
    return idx


def _positions(pool, q_positions=None):
    t = pool.query.shape[0]
    pos = np.zeros(t, dtype=np.int64)
    req = np.full(t, -1)
    for r, n in enumerate(pool.lengths):
        a, b = pool.starts[r], pool.starts[r + 1]
        pos[a:b] = n - (b - a) + np.arange(b - a)
        req[a:b] = r
    return (pos if q_positions is None else np.asarray(q_positions)), req


def oracle(
    pool,
    idx,
    *,
    is_causal=True,
    window=None,
    window_union=False,
    scale=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    q_positions=None,
    value_dim=None,
    keep=None,
):
    """out (T, Hq, Dv), lse and max logit (T, Hq): each row over its key set, in float64."""
    pos, req = _positions(pool, q_positions)
    t = pool.query.shape[0]
    dv = pool.heads[3] if value_dim is None else value_dim
    out, lse, top = np.zeros((t, HQ, dv)), np.full((t, HQ), -np.inf), np.full((t, HQ), -np.inf)
    scale = 1 / np.sqrt(DK) if scale is None else scale
    left, right = window if window is not None else (None, None)
    for row in range(t):
        r = req[row]
        if r < 0:
            continue
        n, p = pool.lengths[r], pos[row]

        def in_band(x, causal=is_causal, p=p):
            hi = p if causal else (np.inf if right is None else p + right)
            if causal and right is not None:
                hi = min(hi, p + right)
            lo = -np.inf if left is None else p - left
            return lo <= x <= hi

        for hq in range(HQ):
            h = hq // (HQ // HKV)
            listed = {int(x) for x in idx[row, h] if x >= 0}
            if window_union:
                seen = {x for x in listed if not is_causal or x <= p}
                seen |= {x for x in range(n) if in_band(x)}
            else:
                seen = {x for x in listed if in_band(x)}
            if keep is not None:
                seen = {x for x in seen if keep(x)}
            keys = sorted(seen)
            k = pool.keys[r][keys, h]
            v = k[:, :dv] if value_dim is not None else pool.values[r][keys, h]
            s = scale * (k @ pool.query[row, hq].astype(np.float64))
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s - alibi_slopes[hq] * np.abs(p - np.asarray(keys))
            parts = list(s) + ([] if sinks is None else [sinks[hq]])
            if not parts:
                continue
            m = max(parts)
            total = np.sum(np.exp(np.asarray(parts) - m))
            lse[row, hq] = m + np.log(total)
            if keys:
                out[row, hq] = np.exp(s - lse[row, hq]) @ v
                top[row, hq] = s.max()
    return out, lse, top


OPTIONS = {
    "causal": {},
    "window": {"window": (6, 0)},
    "window-union": {"window": (4, 0), "window_union": True},
    "union-not-causal": {"window": (3, 2), "window_union": True, "is_causal": False},
    "softcap+sinks": {"softcap": 2.0, "sinks": randn(HQ, seed=3), "scale": 0.4},
    "alibi-not-causal": {"alibi_slopes": SLOPES, "is_causal": False},
}


@pytest.mark.parametrize("name", OPTIONS)
def test_listed_keys_against_oracle(backend, xp, name):
    pool = Pool(LENGTHS, NEW)
    idx = _lists(pool, 9)
    kw = OPTIONS[name]
    got = ragged_paged_attention(
        *pool.args(backend),
        kv_indices=backend.asarray(idx),
        return_lse=True,
        return_max_logit=True,
        **_on(backend, kw),
    )
    for g, want in zip(got, oracle(pool, idx, **kw), strict=True):
        assert_close(backend, g, want)


def test_many_chunks_and_row_blocks_with_repeats(backend, xp, monkeypatch):
    # 300 listed positions of at most 45 keys: every chunk (128 on a CPU) full of
    # repeats and padding; one row folded at a time
    monkeypatch.setattr(_route, "INDEX_GATHER_KEYS", 1)
    pool = Pool(LENGTHS, NEW)
    idx = _lists(pool, 300, seed=2)
    kw = {"window": (9, 0), "window_union": True, "sinks": randn(HQ, seed=3)}
    got = ragged_paged_attention(
        *pool.args(backend), kv_indices=backend.asarray(idx), return_lse=True, **_on(backend, kw)
    )
    for g, want in zip(got, oracle(pool, idx, **kw)[:2], strict=True):
        assert_close(backend, g, want)


def test_every_key_listed_is_the_paged_walk(backend, xp):
    pool = Pool(LENGTHS, NEW)
    t = pool.query.shape[0]
    every = np.broadcast_to(np.arange(45)[None, None, ::-1], (t, HKV, 45)).copy()
    _, req = _positions(pool)
    every[every >= np.asarray(pool.lengths)[np.maximum(req, 0)][:, None, None]] = -1
    args = pool.args(backend)
    kw = {"window": (11, 0), "alibi_slopes": SLOPES}
    listed = ragged_paged_attention(*args, kv_indices=backend.asarray(every), **_on(backend, kw))
    walked = ragged_paged_attention(*args, **_on(backend, kw))
    assert_close(backend, listed, backend.to_numpy(walked))


def test_one_pool_for_keys_and_values(backend, xp):
    # K = V (MLA's latent cache, DeepSeek V4): the values are the keys' first features
    pool = Pool(LENGTHS, NEW)
    idx = _lists(pool, 7)
    q, kp, _, *meta = pool.args(backend)
    got = ragged_paged_attention(q, kp, None, *meta, kv_indices=backend.asarray(idx), value_dim=5)
    assert_close(backend, got, oracle(pool, idx, value_dim=5)[0])


def test_q_positions_and_mask_mod(backend, xp):
    # a prompt in the pool in full, its rows placed by q_positions; a rule that hides odd
    # keys equals lists without them
    pool = Pool([20, 45], [3, 2], pad=1)
    idx = _lists(pool, 12)
    positions = np.array([2, 11, 19, 30, 31, 0])
    meta = pool.args(backend)
    kw = {"q_positions": backend.asarray(positions), "kv_indices": backend.asarray(idx)}
    got = ragged_paged_attention(*meta, mask_mod=lambda r, h, q, k: k % 2 == 0, **kw)
    even = oracle(pool, idx, q_positions=positions, keep=lambda x: x % 2 == 0)[0]
    assert_close(backend, got, even)


def test_topk_selection_feeds_the_walk(backend, xp):
    # an indexer's scores -> topk_indices -> the sparse call: each row sees its k best
    pool = Pool(LENGTHS, NEW)
    t = pool.query.shape[0]
    scores = randn(t, HKV, 45, seed=8)
    _, req = _positions(pool)
    lengths = np.asarray(pool.lengths)[np.maximum(req, 0)] * (req >= 0)
    idx = topk_indices(backend.asarray(scores), 6, backend.asarray(lengths))
    got = ragged_paged_attention(*pool.args(backend), kv_indices=idx, is_causal=False)
    want = oracle(pool, backend.to_numpy(idx), is_causal=False)[0]
    assert_close(backend, got, want)


@pytest.mark.autodiff
def test_gradients_match_central_differences(backend, xp):
    pool = Pool([5, 3], [2, 1], page_size=2, num_pages=6, fill=0.0, pad=1)
    pool.query = pool.query[:, :, :3]
    kp, vp = pool.key_pages[..., :3], pool.value_pages[..., :2]
    idx = _lists(pool, 4, seed=5)
    weights_np = randn(pool.query.shape[0], HQ, 2, seed=4)
    meta = (pool.table, pool.lengths, pool.starts)
    kw = {"window": (1, 0), "window_union": True}

    def loss_np(q, k, v, sinks, softcap, slopes):
        out = ragged_paged_attention(
            q,
            k,
            v,
            *meta,
            kv_indices=idx,
            sinks=sinks,
            softcap=softcap,
            alibi_slopes=slopes,
            **kw,
        )
        return float(np.sum(out * weights_np))

    args = [pool.query, kp, vp, randn(HQ, seed=5), np.asarray(3.0), SLOPES]
    expected = central_differences(loss_np, args)
    weights = backend.asarray(weights_np)
    meta_b = tuple(backend.asarray(m) for m in meta)
    idx_b = backend.asarray(idx)

    def loss(q, k, v, sinks, softcap, slopes):
        out = ragged_paged_attention(
            q,
            k,
            v,
            *meta_b,
            kv_indices=idx_b,
            sinks=sinks,
            softcap=softcap,
            alibi_slopes=slopes,
            **kw,
        )
        return xp.sum(out * weights)

    grads = backend.grad(loss, *(backend.asarray(a) for a in args))
    for g, e in zip(grads, expected, strict=True):
        assert_close(backend, g, e, atol=1e-7, rtol=1e-6)


@pytest.mark.autodiff
@pytest.mark.parametrize("pad", [0, 2], ids=["no-padding", "padding"])
def test_gradients_stay_finite_over_nan_slots(backend, xp, pad):
    # NaN in every free slot, page 0 among them; without padding rows no gathered key is
    # zeroed (each is one of its request's), with them the padding rows' are: they belong
    # to the last request, which has no key, and its table names page 0
    order = [*range(1, 8), 0]
    pool = Pool([6, 11, 0], [3, 1, 0], page_size=4, num_pages=8, pad=pad, order=order)
    q, kp, vp, *meta = pool.args(backend)
    idx = backend.asarray(_lists(pool, 5))

    def loss(q, k, v):
        return xp.sum(ragged_paged_attention(q, k, v, *meta, kv_indices=idx))

    free = np.isnan(pool.key_pages[..., 0, 0])
    for g in (backend.to_numpy(g) for g in backend.grad(loss, q, kp, vp)):
        assert np.all(np.isfinite(g))
    gk, gv = (backend.to_numpy(g) for g in backend.grad(loss, q, kp, vp)[1:])
    assert np.all(gk[free] == 0.0)
    assert np.all(gv[free] == 0.0)


@pytest.mark.backends("jax", reason="jax.jit with traced lists and metadata")
def test_under_jit_with_traced_lists(backend):
    import jax

    pool = Pool(LENGTHS, NEW)
    idx = _lists(pool, 9)
    kw = {"window": (4, 0), "window_union": True, "sinks": randn(HQ, seed=3)}
    f = jax.jit(
        lambda *a, kv_indices: ragged_paged_attention(
            *a, kv_indices=kv_indices, return_lse=True, **_on(backend, kw)
        )
    )
    got = f(*pool.args(backend), kv_indices=backend.asarray(idx))
    for g, want in zip(got, oracle(pool, idx, **kw)[:2], strict=True):
        np.testing.assert_allclose(np.asarray(g), want, atol=1e-12)
    wrong = idx.copy()
    wrong[1, 0, 3] = 20  # request 0 has 20 keys: position 20 is none of them
    out = np.asarray(f(*pool.args(backend), kv_indices=backend.asarray(wrong))[0])
    assert np.isnan(out[1]).all()
    rest = np.delete(np.arange(out.shape[0]), 1)
    np.testing.assert_allclose(out[rest], oracle(pool, wrong, **kw)[0][rest], atol=1e-12)


@pytest.mark.parametrize(
    ("change", "kind", "match"),
    [
        ({"kv_indices": np.zeros((8, 2, 3))}, TypeError, r"`kv_indices` must be an integer"),
        ({"kv_indices": np.zeros((8, 2), dtype=np.int64)}, ValueError, r"\(T, Hkv, k\)"),
        ({"kv_indices": np.zeros((7, 2, 3), dtype=np.int64)}, ValueError, r"axis 0 \(T\) is 7"),
        ({"kv_indices": np.zeros((8, 1, 3), dtype=np.int64)}, ValueError, r"axis 1 \(Hkv\) is 1"),
        ({"kv_indices": np.full((8, 2, 3), 20)}, ValueError, r"`kv_indices`\[0, 0, 0\] = 20"),
        ({"kv_indices": np.full((8, 2, 3), -2)}, ValueError, r"`kv_indices`\[0, 0, 0\] = -2"),
        ({"window_union": True}, ValueError, "`window_union=True` needs `kv_indices`"),
        (
            {"kv_indices": np.zeros((8, 2, 3), dtype=np.int64), "window_union": True},
            ValueError,
            "bounded on both sides",
        ),
        (
            {
                "kv_indices": np.zeros((8, 2, 3), dtype=np.int64),
                "window_union": True,
                "window": (None, 0),
            },
            ValueError,
            "bounded on both sides",
        ),
    ],
)
def test_bad_input_is_named(backend, change, kind, match):
    pool = Pool(LENGTHS, NEW)
    kw = {n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in change.items()}
    with pytest.raises(kind, match=match):
        ragged_paged_attention(*pool.args(backend), **kw)


def test_lists_without_values_give_nan_rows_where_wrong(backend, xp, monkeypatch):
    # the checks metadata without values takes (torch's tracers, jax.jit) on every
    # backend: a list outside its request's keys makes only its own row NaN
    from test_serving import _traced

    _traced(monkeypatch)
    pool = Pool(LENGTHS, NEW)
    idx = _lists(pool, 9)
    idx[3, 1, 0] = 30  # request 1's row (45 keys): fine
    idx[5, 0, 2] = 7  # request 2 has 7 keys: outside
    out = backend.to_numpy(
        ragged_paged_attention(*pool.args(backend), kv_indices=backend.asarray(idx))
    )
    assert np.isnan(out[5]).all()
    rest = np.delete(np.arange(out.shape[0]), 5)
    np.testing.assert_allclose(out[rest], oracle(pool, idx)[0][rest], atol=1e-12)


def test_lists_are_checked_with_a_plan_too(backend, xp):
    # a plan holds the step's metadata, not any layer's lists
    from portable_attn.serving import plan_ragged

    pool = Pool(LENGTHS, NEW)
    q, kp, vp, table, lengths, starts = pool.args(backend)
    plan = plan_ragged(
        table,
        lengths,
        starts,
        num_tokens=q.shape[0],
        num_q_heads=HQ,
        num_kv_heads=HKV,
        page_size=pool.page_size,
        num_pages=kp.shape[0],
    )
    wrong = _lists(pool, 3)
    wrong[0, 0, 0] = 20  # request 0 has 20 keys
    with pytest.raises(ValueError, match=r"`kv_indices`\[0, 0, 0\] = 20"):
        ragged_paged_attention(
            q, kp, vp, table, lengths, starts, plan=plan, kv_indices=backend.asarray(wrong)
        )
    idx = _lists(pool, 9)
    got = ragged_paged_attention(
        q, kp, vp, table, lengths, starts, plan=plan, kv_indices=backend.asarray(idx)
    )
    assert_close(backend, got, oracle(pool, idx)[0])

"""Cascade attention: requests sharing a prompt, its keys read once per group.

Every result against the float64 oracle on each request's whole sequence (its group's
prefix, then its own keys), on every backend; gradients against central differences;
traced metadata under ``jax.jit``; the merge of log-sum-exps in base 2 and of empty
states; shared pages equal private copies; bad input named.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from _helpers import randn
from portable_attn import merge_attention
from portable_attn.serving import cascade_attention, ragged_paged_attention
from portable_attn.testing import (
    central_differences,
    reference_attention,
    reference_lse,
    reference_max_logit,
)
from test_serving import HKV, HQ, OPTIONS, Pool

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")

DK, DV = 8, 6
LP = 13  # not a multiple of any page or tile
#: requests' own keys and new rows; groups [0, 2), [2, 2) (empty), [2, 5)
LENGTHS, NEW_ROWS, GROUPS = [5, 9, 1, 12, 4], [3, 1, 1, 5, 0], [0, 2, 2, 5]


class Cascade:
    """Groups' prefixes, requests' own keys in a pool, and the oracle over both."""

    def __init__(
        self, lp=LP, groups=GROUPS, lengths=LENGTHS, new_rows=NEW_ROWS, seed=0, num_pages=48
    ):
        heads = (HQ, HKV, DK, DV)
        self.pool = Pool(lengths, new_rows, seed=seed, heads=heads, num_pages=num_pages)
        g = len(groups) - 1
        self.prefix_key = randn(g, lp, HKV, DK, seed=seed + 40)
        self.prefix_value = randn(g, lp, HKV, DV, seed=seed + 41)
        self.groups = np.asarray(groups, dtype=np.int64)

    def args(self, backend):
        q, kp, vp, table, lengths, starts = self.pool.args(backend)
        b = backend.asarray
        prefix = (b(self.prefix_key), b(self.prefix_value))
        return (q, *prefix, kp, vp, table, lengths, starts, b(self.groups))

    def oracle(self, **kw):
        """out (T, Hq, Dv), lse and max logit (T, Hq) in float64, request by request."""
        kw = {"is_causal": True, **kw}
        pool = self.pool
        t = pool.query.shape[0]
        out, lse = np.zeros((t, HQ, DV)), np.full((t, HQ), -np.inf)
        top = np.full((t, HQ), -np.inf)
        for r in range(len(pool.lengths)):
            a, b = pool.starts[r], pool.starts[r + 1]
            if a == b:
                continue
            g = int(np.searchsorted(self.groups, r, side="right")) - 1
            keys = np.concatenate([self.prefix_key[g], pool.keys[r]])
            values = np.concatenate([self.prefix_value[g], pool.values[r]])
            q = pool.query[a:b].transpose(1, 0, 2)[None]
            k, v = keys.transpose(1, 0, 2)[None], values.transpose(1, 0, 2)[None]
            out[a:b] = reference_attention(q, k, v, **kw)[0].transpose(1, 0, 2)
            lse[a:b] = reference_lse(q, k, **kw)[0].transpose(1, 0)
            logit_kw = {n: x for n, x in kw.items() if n != "sinks"}
            top[a:b] = reference_max_logit(q, k, **logit_kw)[0].transpose(1, 0)
        return out, lse, top


def _on(backend, kw):
    return {n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_cascade_against_oracle(backend, name):
    case = Cascade()
    kw = OPTIONS[name]
    got = cascade_attention(
        *case.args(backend), return_lse=True, return_max_logit=True, **_on(backend, kw)
    )
    for g, w in zip(got, case.oracle(**kw), strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), w, atol=1e-12)


def test_rules_see_positions_among_all_keys(backend, xp):
    """A ``mask_mod`` and a ``score_mod`` get the prefix's positions first: the same
    rules over the whole sequence (a prefix seen both ways, a relative bias)."""
    case = Cascade()

    def mask_mod(r, h, q, k):
        return (k <= q) | (k < LP)

    def score_mod(s, r, h, q, k):
        return s + xp.astype(q - k, s.dtype) * 0.05

    got = cascade_attention(*case.args(backend), is_causal=False, mask_mod=mask_mod,
                            score_mod=score_mod)  # fmt: skip
    pool = case.pool
    for r in range(len(pool.lengths)):
        a, b = pool.starts[r], pool.starts[r + 1]
        if a == b:
            continue
        g = int(np.searchsorted(case.groups, r, side="right")) - 1
        keys = np.concatenate([case.prefix_key[g], pool.keys[r]]).transpose(1, 0, 2)
        values = np.concatenate([case.prefix_value[g], pool.values[r]]).transpose(1, 0, 2)
        m = keys.shape[1]
        qpos, kpos = np.arange(m - (b - a), m)[:, None], np.arange(m)[None, :]
        want = reference_attention(
            pool.query[a:b].transpose(1, 0, 2), keys, values,
            mask=(kpos <= qpos) | (kpos < LP), bias=0.05 * (qpos - kpos),
        ).transpose(1, 0, 2)  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(got)[a:b], want, atol=1e-12)


def test_one_group_without_prefix_keys_or_requests(backend):
    """Lp = 0 (the own keys alone, sinks still once) and a batch of padding rows."""
    kw = {"sinks": randn(HQ, seed=3)}
    case = Cascade(lp=0, groups=[0, 5])
    got = cascade_attention(*case.args(backend), return_lse=True, **_on(backend, kw))
    for g, w in zip(got, case.oracle(**kw)[:2], strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), w, atol=1e-12)
    own = ragged_paged_attention(*case.pool.args(backend), **_on(backend, kw))
    np.testing.assert_allclose(backend.to_numpy(got[0]), backend.to_numpy(own), atol=1e-12)


@pytest.mark.backends("torch", "jax", reason="gradients")
def test_gradients_against_central_differences(backend):
    case = Cascade(lp=3, groups=[0, 1, 2], lengths=[3, 2], new_rows=[2, 1], num_pages=2)
    case.pool.query = case.pool.query[:3]  # no padding rows
    args = list(case.args(backend))
    cot = randn(3, HQ, DV, seed=5)
    kw = {"window": (3, 0), "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}

    def loss(q, pk, pv, kp, vp):
        out = cascade_attention(q, pk, pv, kp, vp, *rest, **_on(backend, kw))
        return (out * backend.asarray(cot)).sum()

    rest = args[5:]
    wrt = args[:5]
    analytic = backend.grad(loss, *wrt)

    fn = loss
    if backend.family == "jax":  # one program for the many evaluations
        import jax

        fn = jax.jit(loss)

    def loss_np(*a):
        return float(backend.to_numpy(fn(*(backend.asarray(x) for x in a))))

    host = [np.nan_to_num(backend.to_numpy(a)) for a in wrt]  # free slots: NaN, no gradient
    numeric = central_differences(loss_np, host)
    for g, n in zip(analytic, numeric, strict=True):
        np.testing.assert_allclose(np.nan_to_num(backend.to_numpy(g)), n, atol=1e-6)


@pytest.mark.backends("jax", reason="jax.jit with traced metadata")
def test_under_jit_with_traced_metadata(backend):
    import jax

    case = Cascade()
    kw = OPTIONS["alibi+window-right"]
    f = jax.jit(lambda *a: cascade_attention(*a, return_lse=True, **_on(backend, kw)))
    got = f(*case.args(backend))
    for g, w in zip(got, case.oracle(**kw)[:2], strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-12)


def test_pages_shared_by_requests_equal_private_copies(backend):
    """A prompt kept once in the pool and named by several tables (prefix caching):
    each request's result is that of its own copy of the pages."""
    pool = Pool([20, 20], [1, 1], page_size=4)
    shared = pool.table.copy()
    shared[1, :3] = shared[0, :3]  # request 1 reads request 0's first 12 keys
    kp, vp = pool.key_pages.copy(), pool.value_pages.copy()
    for j in range(3):  # the private copy: request 1's own pages hold the same keys
        kp[pool.table[1, j]], vp[pool.table[1, j]] = kp[pool.table[0, j]], vp[pool.table[0, j]]
    b = backend.asarray
    common = (b(pool.lengths), b(pool.starts))
    q = b(pool.query)
    private = ragged_paged_attention(q, b(kp), b(vp), b(pool.table), *common)
    aliased = ragged_paged_attention(q, b(kp), b(vp), b(shared), *common)
    np.testing.assert_array_equal(backend.to_numpy(aliased), backend.to_numpy(private))


def test_merge_of_base_2_states_and_of_empty_states(backend):
    """``lse_base=2``: FlashInfer's log2 states merge as the natural ones; two empty
    states merge to an empty state (zeros, lse -inf), never NaN."""
    rng = np.random.default_rng(0)
    outs = [rng.standard_normal((2, 3, 5)) for _ in range(2)]
    lses = [rng.standard_normal((2, 3)) for _ in range(2)]
    lses[1][0, 0] = lses[0][0, 0] = -np.inf  # a row empty in both parts
    b = backend.asarray
    out_e, lse_e = merge_attention([b(o) for o in outs], [b(x) for x in lses])
    out_2, lse_2 = merge_attention(
        [b(o) for o in outs], [b(x / math.log(2)) for x in lses], lse_base=2
    )
    np.testing.assert_allclose(backend.to_numpy(out_2), backend.to_numpy(out_e), atol=1e-12)
    np.testing.assert_allclose(
        backend.to_numpy(lse_2) * math.log(2), backend.to_numpy(lse_e), atol=1e-12
    )
    assert not np.isnan(backend.to_numpy(out_2)).any()
    assert backend.to_numpy(lse_2)[0, 0] == -np.inf
    assert not backend.to_numpy(out_2)[0, 0].any()


@pytest.mark.parametrize("base", [1, 0, -2.0, math.inf, "2"])
def test_merge_refuses_a_bad_base(backend, base):
    b = backend.asarray
    kind = TypeError if isinstance(base, str) else ValueError
    with pytest.raises(kind, match="lse_base"):
        merge_attention([b(np.ones((1, 2, 3)))], [b(np.zeros((1, 2)))], lse_base=base)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"groups": [0, 2, 4, 4]}, r"`group_starts` must end at R = 5"),
        ({"groups": [0, 3, 2, 5]}, r"`group_starts` must start at 0, never decrease"),
        (
            {"prefix_key": randn(2, LP, HKV, DK), "prefix_value": randn(2, LP, HKV, DV)},
            r"`group_starts` must have shape \(G \+ 1,\) = \(3,\) \(G = 2",
        ),
        ({"prefix_key": randn(3, LP, HKV, DK + 1)}, r"`prefix_key` axis 3 and `key_pages`"),
        ({"prefix_value": randn(3, LP + 1, HKV, DV)}, r"`prefix_value` axis 1 and `prefix_key`"),
    ],
)
def test_bad_input_is_named(backend, change, match):
    case = Cascade()
    for name, value in change.items():
        setattr(case, name, np.asarray(value, dtype=np.int64) if name == "groups" else value)
    with pytest.raises(ValueError, match=match):
        cascade_attention(*case.args(backend))


def test_values_given_for_one_part_only_are_named(backend):
    case = Cascade()
    q, pk, pv, kp, vp, *rest = case.args(backend)
    with pytest.raises(TypeError, match="`value_pages` and `prefix_value` must both be"):
        cascade_attention(q, pk, None, kp, vp, *rest)
    with pytest.raises(ValueError, match=r"`sinks` must have shape \(Hq,\) = \(4,\)"):
        cascade_attention(q, pk, pv, kp, vp, *rest, sinks=backend.asarray(np.zeros(3)))

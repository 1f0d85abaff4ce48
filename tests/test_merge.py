"""Attention over parts of the keys, merged exactly: the kernel of sequence parallelism.

Keys are split into uneven contiguous parts; each part is computed with the
positions of the whole sequence (``partial_attention``) and the parts are
combined with ``merge_partials``. The result must equal attention over all keys
on every backend, for every position-dependent feature.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from _helpers import qkv
from portable_attn import get_alibi_slopes
from portable_attn._lib._call import prepare
from portable_attn._lib._merge import merge_partials
from portable_attn._lib._route import route
from portable_attn._paths._partial import partial_attention
from portable_attn.testing import reference_attention

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 6, 11, 8
PARTS = ((0, 3), (3, 4), (4, 11))  # uneven, one of a single key


def _merge_parts(backend, q, k, v, *, mask=None, bias=None, block_size=None, **kw):
    """Each part's call holds its keys and the whole call's lengths, as a Dask chunk's does."""
    xp = backend.xp
    if mask is not None:
        kw["mask"] = backend.asarray(mask)
    if bias is not None:
        kw["bias"] = backend.asarray(bias)
    whole = prepare(*(backend.asarray(a) for a in (q, k, v)), **kw)
    outs, lses = [], []
    for start, stop in PARTS:
        call = whole.sliced({"lk": (start, stop)}, kv_len=stop - start)
        call = dataclasses.replace(  # a part: the lengths' host values are the whole's
            call, terms=dataclasses.replace(call.terms, kv_length_values=None)
        )
        path = route(call, block_size, "portable").path
        out, lse = partial_attention(call, path, kv_start=start, kv_total=LK)
        outs.append(out)
        lses.append(lse)
    merged, lse = merge_partials(
        xp,
        xp.stack(outs),
        xp.stack(lses),
        max_over=lambda x: xp.max(x, axis=0),
        sum_over=lambda x: xp.sum(x, axis=0),
    )
    return merged, lse


_problem = partial(qkv, batch=(B,), hq=HQ, hkv=HKV, lq=LQ, lk=LK, dk=D, dv=D)


@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize(
    "features",
    [
        {},
        {"is_causal": True},
        {"is_causal": True, "window": (3, None)},
        {"window": (2, 2), "softcap": 2.0},
        {"is_causal": True, "kv_lengths": [11, 3], "q_lengths": [6, 4]},  # parts past the end
        {"is_causal": True, "alibi_slopes": get_alibi_slopes(HQ)},
    ],
    ids=["plain", "causal", "causal-window", "band-softcap", "lengths", "alibi"],
)
def test_parts_merge_to_the_whole(backend, features, block_size):
    q, k, v = _problem()
    kw = {
        n: backend.asarray(np.asarray(x)) if isinstance(x, (list, np.ndarray)) else x
        for n, x in features.items()
    }
    out, _ = _merge_parts(backend, q, k, v, block_size=block_size, **kw)
    expected = reference_attention(q, k, v, **features)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=1e-12, rtol=1e-10)


def test_masks_bias_score_mod_and_empty_rows(backend):
    q, k, v = _problem(seed=1)
    rng = np.random.default_rng(2)
    mask = rng.random((LQ, LK)) < 0.7
    mask[2] = False  # no key at all: zero row
    mask[4, 3:] = False  # keys only in the first part: the other parts are empty
    bias = rng.standard_normal((HQ, LQ, LK))

    def score_mod(scores, batch, head, q_idx, kv_idx):  # depends on absolute key positions
        return backend.xp.where(kv_idx % 3 == 1, scores - 1.5, scores)

    def score_mod_np(scores, batch, head, q_idx, kv_idx):
        return np.where(kv_idx % 3 == 1, scores - 1.5, scores)

    out, lse = _merge_parts(backend, q, k, v, mask=mask, bias=bias, score_mod=score_mod)
    expected = reference_attention(q, k, v, mask=mask, bias=bias, score_mod=score_mod_np)
    result = backend.to_numpy(out)
    np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)
    assert np.all(result[:, :, 2] == 0)
    assert np.all(np.isneginf(backend.to_numpy(lse)[:, :, 2]))


def test_unsigned_lengths_may_put_queries_before_every_key(backend):
    """uint8 lengths: ``kv_len - q_len`` is negative here and must not wrap around."""
    from portable_attn import scaled_dot_product_attention

    q, k, v = _problem(seed=3)
    kv_len = np.array([2, 11], dtype=np.uint8)
    expected = reference_attention(q, k, v, is_causal=True, kv_lengths=kv_len.astype(np.int64))
    lengths = backend.asarray(kv_len)
    qkv = (backend.asarray(a) for a in (q, k, v))
    whole = scaled_dot_product_attention(*qkv, is_causal=True, kv_lengths=lengths)
    merged, _ = _merge_parts(backend, q, k, v, is_causal=True, kv_lengths=lengths)
    for out in (whole, merged):
        result = backend.to_numpy(out)
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)
        assert np.all(result[0, :, :4] == 0)  # i' = i + 2 - 6 < 0 for the first four queries
